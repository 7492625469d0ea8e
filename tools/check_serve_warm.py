"""Does a warm server compile anything while it serves? experiments/serve.py as users start it
(the engine in a process of its own, warmed before it takes requests), then random requests,
and the engine process's own compile count from `/metrics` before and after them.

  python tools/check_serve_warm.py                       # 100 random requests, tiny model
  python tools/check_serve_warm.py --requests=300 --clients=8 --max_len=1024
  python tools/check_serve_warm.py --serve_flag=--quant=w4a8 --serve_flag=--quant_group_size=32

The requests vary what a client can vary: the endpoint (completions or chat), prompt lengths
(token ids or text, chat with or without tools, thinking on or off), `n`, temperature, top_p,
top_k, seed, stop strings, log-probs and their alternatives, streaming, and max_tokens. Prints
one line per phase: how long warm-up took (the server's "warming N programs" lines go to its
stderr, shown with --verbose), the compiles during the requests (want 0), the answers by status.
Exit status 1 when a request compiled anything or was not answered 200.
"""

import concurrent.futures
import json
import logging
import random
import socket
import subprocess
import sys
import time

from absl import app, flags
import httpx

from glm5_jax.serve.random_requests import random_bodies

_REQUESTS = flags.DEFINE_integer("requests", 100, "Random requests after warm-up.")
_CLIENTS = flags.DEFINE_integer("clients", 4, "Concurrent clients sending them.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random requests.")
_MAX_LEN = flags.DEFINE_integer("max_len", 512, "The server's --max_len (>= 512: chat requests with tools).")
_SLOTS = flags.DEFINE_integer("slots", 4, "The server's --slots.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Show the server's stderr.")
_SERVE_FLAG = flags.DEFINE_multi_string("serve_flag", [], "Another flag for experiments/serve.py "
                                        "(repeatable), e.g. --serve_flag=--quant=w4a8 "
                                        "--serve_flag=--quant_group_size=32.")

def post(url: str, path: str, body: dict) -> int:
  """The status of `body` POSTed to `path` (a stream read to its end)."""
  if body.get("stream"):
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
      for _ in r.iter_lines():
        pass
      return r.status_code
  return httpx.post(url + path, json=body, timeout=600).status_code


def engine_compiles(url: str) -> int:
  """`glm5_engine_compiles_total` of the server's `/metrics` (counted in the engine's process)."""
  for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
    if line.startswith("glm5_engine_compiles_total "):
      return int(line.split()[1])
  raise RuntimeError("/metrics has no glm5_engine_compiles_total")


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health poll otherwise
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  cmd = [sys.executable, "experiments/serve.py", "--random_init", "--config=configs/tiny.py",
         f"--port={port}", f"--slots={_SLOTS.value}", f"--max_len={_MAX_LEN.value}",
         "--prefill_chunk=64", "--max_top_logprobs=3", *_SERVE_FLAG.value]
  server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                            stderr=None if _VERBOSE.value else subprocess.DEVNULL)
  start = time.perf_counter()
  try:
    status = None
    while status != 200:
      if server.poll() is not None:
        raise SystemExit(f"experiments/serve.py exited with {server.returncode} (--verbose)")
      try:
        status = httpx.get(url + "/health", timeout=5).status_code
      except httpx.TransportError:
        pass
      time.sleep(0.5)
    print(f"ready after {time.perf_counter() - start:.1f} s ({' '.join(cmd[1:])})", flush=True)
    before = engine_compiles(url)
    bodies = random_bodies(random.Random(_SEED.value), _REQUESTS.value, max_len=_MAX_LEN.value,
                           max_top=3)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(_CLIENTS.value) as pool:
      statuses = list(pool.map(lambda pb: post(url, *pb), bodies))
    compiled = engine_compiles(url) - before
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    print(f"{len(bodies)} random requests ({_CLIENTS.value} clients) in "
          f"{time.perf_counter() - start:.1f} s: statuses {json.dumps(counts)}; {compiled} "
          f"compiles in the engine process (measured: its /metrics "
          f"glm5_engine_compiles_total)", flush=True)
    if compiled or set(counts) != {200}:
      raise SystemExit(1)
  finally:
    server.terminate()
    server.wait(30)


if __name__ == "__main__":
  app.run(main)
