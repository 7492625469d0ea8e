"""An app served by uvicorn on a thread of this process, on a free loopback port: what the
serving tests and tools/bench_serve.py talk to over real HTTP (experiments/serve.py serves on
the main thread instead, with `uvicorn.run`).

The socket is bound here and handed to uvicorn, so no other process can take the port between
choosing it and listening on it.
"""

import socket
import threading
import time

import uvicorn


class ThreadedServer:
  """`app` listening on `url` (http://127.0.0.1:PORT) once constructed; `close()` stops it.
  `server` is the `uvicorn.Server` (its event loop: `server.servers[0].get_loop()`);
  `uvicorn_kwargs` go to `uvicorn.Config` (e.g. `http="h11"`)."""

  def __init__(self, app, *, start_timeout_s: float = 60.0, **uvicorn_kwargs):
    self._socket = socket.socket()
    self._socket.bind(("127.0.0.1", 0))
    host, port = self._socket.getsockname()[:2]
    self.url = f"http://{host}:{port}"
    self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **uvicorn_kwargs))
    # Off the main thread uvicorn installs no signal handlers: Ctrl-C stays the caller's.
    self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]},
                                    name="threaded-server", daemon=True)
    self._thread.start()
    deadline = time.time() + start_timeout_s
    while not self.server.started:
      if not self._thread.is_alive() or time.time() > deadline:
        self.close()
        raise RuntimeError(f"ThreadedServer: uvicorn did not start on {self.url} within "
                           f"{start_timeout_s:.0f} s")
      time.sleep(0.01)

  def close(self) -> None:
    """Stops serving (open connections are closed) and waits for the thread, at most 30 s."""
    self.server.should_exit = True
    self._thread.join(timeout=30)
    self._socket.close()
