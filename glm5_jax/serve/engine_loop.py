"""The one engine thread of a server: every request goes through one `infer.Engine`, so
concurrent requests are batched continuously (a request's tokens do not depend on its
neighbours: `glm5_jax.infer.engine`).

Callers on any thread `submit` a `Request` and get a `Stream` of its `Event`s; `cancel(stream)`
frees its slot at the engine's next iteration (a client that disconnects). Commands travel
through one bounded queue, so the engine is touched by its own thread only; a full queue is
`QueueFull` at once (a server answers 429/503) instead of an unbounded backlog. The loop runs
`engine.step()` while anything is in flight and blocks on the queue when idle.
"""

import asyncio
import queue
import threading

from glm5_jax.infer.engine import Engine, Event
from glm5_jax.infer.requests import Request


class QueueFull(Exception):
  """The loop's bounded submission queue is full (`max_queue` waiting)."""


class Stream:
  """One request's events, in order; `None` after its last one (finished or cancelled), or an
  exception the engine raised for it (e.g. a ValueError from `Engine.submit`)."""

  def __init__(self, aloop=None):
    self._events: queue.Queue = queue.Queue()
    self.handle: int | None = None
    # With an asyncio loop, events go to an asyncio.Queue (`aget`) instead: a blocked thread
    # per waiting stream would exhaust the executor with many streams.
    self._aloop = aloop
    self._aevents = asyncio.Queue() if aloop is not None else None

  def _put(self, item) -> None:
    if self._aloop is None:
      self._events.put(item)
    else:
      self._aloop.call_soon_threadsafe(self._aevents.put_nowait, item)

  async def aget(self):
    """`get` for a stream submitted with an asyncio loop."""
    item = await self._aevents.get()
    if isinstance(item, Exception):
      raise item
    return item

  def get(self, timeout: float | None = None):
    """The next `Event`, `None` at the end; raises what the engine raised for the request."""
    item = self._events.get(timeout=timeout)
    if isinstance(item, Exception):
      raise item
    return item

  def __iter__(self):
    while (event := self.get()) is not None:
      yield event


class EngineLoop:
  """Owns `engine` on a daemon thread. `max_queue`: submissions waiting for the thread (and,
  counted with them, requests the engine holds waiting for a slot) before `QueueFull`."""

  def __init__(self, engine: Engine, *, max_queue: int = 256):
    if not isinstance(max_queue, int) or max_queue < 1:
      raise ValueError(f"EngineLoop: max_queue must be an int >= 1, got {max_queue!r}")
    self.engine, self.max_queue = engine, max_queue
    self._commands: queue.Queue = queue.Queue()
    self._pending = 0  # submitted, not yet admitted to a slot (commands + engine's waiting)
    self._lock = threading.Lock()
    self._streams: dict[int, Stream] = {}
    self._stop = False
    self.tokens_generated = 0
    self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
    self._thread.start()

  def submit(self, request: Request, aloop=None) -> Stream:
    """Queues `request`; its events come back on the returned stream (on `aloop`, an asyncio
    event loop, when given: read them with `await stream.aget()`)."""
    with self._lock:
      if self._pending >= self.max_queue:
        raise QueueFull(f"{self._pending} requests waiting, max_queue={self.max_queue}")
      self._pending += 1
    stream = Stream(aloop)
    self._commands.put(("submit", request, stream))
    return stream

  def cancel(self, stream: Stream) -> None:
    self._commands.put(("cancel", None, stream))

  def waiting(self) -> int:
    return self._pending

  def running(self) -> int:
    return self.engine.running()

  def close(self) -> None:
    self._stop = True
    self._commands.put(("stop", None, None))
    self._thread.join()

  def _run(self) -> None:
    while not self._stop:
      try:  # block only when the engine has nothing to do
        self._command(*self._commands.get(block=not self.engine.busy))
        while True:
          self._command(*self._commands.get_nowait())
      except queue.Empty:
        pass
      if self._stop or not self.engine.busy:
        continue
      try:
        events = self.engine.step()
      except Exception as e:  # the engine is broken: every request in flight hears why
        for stream in self._streams.values():
          stream._put(e)
        raise
      with self._lock:
        self._pending = self.engine.waiting() + self._commands.qsize()
      for event in events:
        self._deliver(event)

  def _deliver(self, event: Event) -> None:
    stream = self._streams.get(event.handle)
    if stream is None:
      return
    self.tokens_generated += len(event.tokens)
    stream._put(event)
    if event.completion is not None:
      del self._streams[event.handle]
      stream._put(None)

  def _command(self, kind, request, stream) -> None:
    if kind == "submit":
      try:
        stream.handle = self.engine.submit(request)
        self._streams[stream.handle] = stream
      except ValueError as e:
        with self._lock:
          self._pending -= 1
        stream._put(e)
    elif kind == "cancel" and stream.handle is not None:
      if self.engine.cancel(stream.handle) and self._streams.pop(stream.handle, None):
        stream._put(None)
