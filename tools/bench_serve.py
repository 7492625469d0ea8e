"""Load test of the HTTP server on loopback: C concurrent clients (streaming and/or whole
replies), throughput, p50 / p99 latency, time to first token, and a check that every request is
answered exactly once with all its tokens; then the same batch through the engine directly, for
the HTTP layer's overhead.

  python tools/bench_serve.py --clients=1,32 --requests_per_client=4 --max_tokens=48
  python tools/bench_serve.py --model=small ...   # a slower step (hidden 256, 4 layers)
  python tools/bench_serve.py --model=medium ...  # ~75M parameters: a step of tens of ms
  python tools/bench_serve.py --noengine_process  # the engine on a thread of the server

A random model (`--model`); the engine in a process of its own as experiments/serve.py runs it
(`glm5_jax.serve.engine_process`), every program compiled first; clients in a process of their
own; bounded by --clients (at most 64) and --deadline_s.

  # on a machine with more cores: the server, the engine and the direct run on 2 of them, the
  # load generator on the others, so that it takes no CPU from what it measures
  python tools/bench_serve.py --server_cpus=0,1 --client_cpus=2-15 ..."""

import asyncio
import cProfile
import json
import logging
import multiprocessing
import os
import pstats
import sys
import threading
import time
import urllib.parse

# The repository root, for `experiments` when run as `python tools/X.py` (sys.path[0] is tools/).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags
import httpx
import jax
import ml_collections
import numpy as np

from experiments import serving_flags  # pylint: disable=wrong-import-position
from glm5_jax.api import init_params
from glm5_jax.config import model_config
from glm5_jax.data import make_tokenizer
from glm5_jax.infer.compile_count import count_compiles
from glm5_jax.infer.engine import Engine, request_seed
from glm5_jax.infer.requests import Request
from glm5_jax.serve.app import create_app
from glm5_jax.serve.engine_loop import EngineLoop
from glm5_jax.serve.engine_process import EngineProcess, served_engine
from glm5_jax.serve.threaded_server import ThreadedServer

# hidden, layers, heads, kv_lora_rank, qk_nope / qk_rope / v head dims, indexer head dim, top-k
_SIZES = {"tiny": (64, 2, 4, 32, 16, 8, 16, 16, 8),
          "small": (256, 4, 8, 64, 32, 16, 32, 32, 16),
          "medium": (1024, 8, 16, 256, 64, 32, 64, 64, 32)}


_CLIENTS = flags.DEFINE_list("clients", ["1", "8", "32"], "Concurrent client counts (<= 64).")
_PER_CLIENT = flags.DEFINE_integer("requests_per_client", 2, "Requests each client sends.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "Tokens per request.")
_SLOTS = flags.DEFINE_integer("slots", 32, "Engine slots.")
_DEADLINE = flags.DEFINE_float("deadline_s", 300, "Stop a level's clients after this long.")
_GIL_CHECK = flags.DEFINE_bool("gil_check", False, "Only time Engine.run (64 requests, 32 "
                                "slots) alone and beside a busy pure-Python thread, at switch "
                                "intervals 0.005 and 0.0002 s (no HTTP).")
_PROFILE = flags.DEFINE_bool("profile", False, "cProfile the server's event-loop thread and the "
                             "engine thread during the last level; print their top functions.")
# The engine loop's flags are experiments/serve.py's own (defaults included): the server
# measured here runs its engine as that one does.
_LOOP = serving_flags.define_loop_flags()
_PIPELINED = flags.DEFINE_bool("pipelined", True, "EngineProcess(pipelined=...): the child "
                               "computes the next step while the server delivers the last.")
_MODES = flags.DEFINE_list("modes", ["stream", "whole"], "Client modes: 'stream' (SSE, one chunk "
                           "per engine step per request) and/or 'whole' (one JSON reply).")
_MODEL = flags.DEFINE_enum("model", "tiny", list(_SIZES), "The random model served "
                           "(`_model_config`).")
_HTTP = flags.DEFINE_enum("http", "auto", ["auto", "h11", "httptools"], "uvicorn's HTTP "
                          "protocol ('auto': httptools when installed, as experiments/serve.py).")
_SERVER_CPUS = flags.DEFINE_string("server_cpus", "", "CPU ids ('0,1' or '0-1') for the server, "
                                    "the engine process and the direct run; '': all.")
_CLIENT_CPUS = flags.DEFINE_string("client_cpus", "", "CPU ids for the clients' processes; '': "
                                    "all.")
_CLIENT_HTTP = flags.DEFINE_enum("client_http", "asyncio", ["asyncio", "httpx"], "The clients' "
                                 "HTTP: 'asyncio', a minimal keep-alive HTTP/1.1 client on "
                                 "asyncio streams (`_Connection`: cheap, so that the load "
                                 "generator takes little CPU from the server it measures), or "
                                 "httpx's async client.")
_CLIENT_PROCESSES = flags.DEFINE_integer("client_processes", 4, "Processes the clients of a level "
                                         "are spread over (an event loop of clients in each).")
PROMPT = [1, 72, 101, 108, 108, 111]


def _cpus(flag: str, value: str) -> set[int]:
  """'0,1' or '2-15' or '0,4-7' -> a set of CPU ids this process may run on."""
  try:
    ids = set()
    for part in value.split(","):
      lo, _, hi = part.partition("-")
      ids.update(range(int(lo), int(hi or lo) + 1))
  except ValueError:
    raise app.UsageError(f"--{flag}: CPU ids like '0,1' or '2-15', got {value!r}") from None
  allowed = os.sched_getaffinity(0)
  if not ids or not ids <= allowed:
    raise app.UsageError(f"--{flag}={value}: this machine allows CPUs {sorted(allowed)}")
  return ids


def _model_config(size):
  """"tiny": hidden 64, 2 layers (a 32-slot decode step ~1.5 ms on this CPU, ~45 us a token:
  the HTTP layer's per-token cost shows in full); "small": hidden 256, 4 layers (~6.5 ms a
  step); "medium": hidden 1024, 8 layers (~75M parameters; ~140-170 ms a step here, a served
  model's decode step being tens of milliseconds on its accelerator)."""
  hidden, layers, heads, kv_lora, nope, rope, v, index_dim, topk = _SIZES[size]
  return model_config(vocab_size=384, hidden_size=hidden, num_hidden_layers=layers,
                      attention_pattern="D" * layers, first_k_dense_replace=layers,
                      num_attention_heads=heads, q_lora_rank=hidden // 2, kv_lora_rank=kv_lora,
                      qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
                      index_n_heads=2, index_head_dim=index_dim, index_topk=topk,
                      intermediate_size=2 * hidden, num_nextn_predict_layers=0, mtp_depths=0,
                      dtype="float32", cache_dtype="float32")


def _model():
  cfg = _model_config(_MODEL.value)
  return cfg, init_params(cfg, jax.random.key(0))


def _build_engine(size, slots, max_rows):
  """The engine process's `build`: the bench's model (the same params as `_model`), warm."""
  run = ml_collections.ConfigDict({"model": _model_config(size), "data": {"tokenizer": "byte"}})
  return served_engine(dict(random_init_config=run, seed=0),
                       dict(slots=slots, max_len=64, prefill_chunk=16), max_rows)


class _Connection:
  """One keep-alive HTTP/1.1 connection on asyncio streams: `post(body)` yields the reply's
  body as it arrives (chunked or sized). Hand-written because the load generator shares the
  server's 2 cores here: httpx's async client spent ~355 us of CPU per streamed token (~130
  whole), more than the server's HTTP layer, and the bench measures the server, not itself."""

  def __init__(self, host: str, port: int, path: str):
    self.host, self.port, self.path = host, port, path
    self.reader = self.writer = None

  async def post(self, payload: dict):
    if self.writer is None:
      self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
    body = json.dumps(payload).encode()
    self.writer.write(f"POST {self.path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: "
                      f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    status = await self.reader.readline()
    length, chunked = None, False
    while (line := await self.reader.readline()) not in (b"\r\n", b""):
      name, _, value = line.decode("latin-1").partition(":")
      name = name.strip().lower()
      if name == "content-length":
        length = int(value)
      elif name == "transfer-encoding":
        chunked = "chunked" in value.lower()
    pieces = self._chunks() if chunked else self._sized(length or 0)
    if not status.startswith(b"HTTP/1.1 200"):
      text = b"".join([piece async for piece in pieces])[:500]
      raise RuntimeError(f"{status.decode().strip()}: {text!r}")
    async for piece in pieces:
      yield piece

  async def _sized(self, length: int):
    yield await self.reader.readexactly(length)

  async def _chunks(self):
    while size := int((await self.reader.readline()).split(b";")[0], 16):
      yield (await self.reader.readexactly(size + 2))[:-2]
    while await self.reader.readline() not in (b"\r\n", b""):  # trailers
      pass

  def close(self):
    if self.writer is not None:
      self.writer.close()


def _httpx_post(http, url):
  async def post(payload):
    async with http.stream("POST", url, json=payload) as r:
      if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
      async for piece in r.aiter_raw():
        yield piece
  return post


async def _client(post, n, results, deadline, max_tokens, stream):
  """One client: `n` requests one after another through `post` (payload -> the reply's body in
  pieces); appends `(ids, latency, TTFT, tokens)`."""
  for _ in range(n):
    if time.time() > deadline:
      return
    start, first = time.perf_counter(), None
    ids = set()
    tokens = 0  # counted when the request finishes (ignore_eos: exactly max_tokens)
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
            "temperature": 1.0}
    if not stream:  # the whole reply at once: its "time to first token" is its latency
      reply = json.loads(b"".join([piece async for piece in post(body)]))
      first = time.perf_counter()
      tokens = reply["usage"]["completion_tokens"]
      results.append(({reply["id"]}, first - start, first - start, tokens))
      continue
    pending = b""
    async for piece in post(body):
      *events, pending = (pending + piece).split(b"\n\n")
      for event in events:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
          continue
        first = first or time.perf_counter()
        chunk = json.loads(event[6:])
        ids.add(chunk["id"])
        if chunk["choices"][0]["finish_reason"]:
          tokens = max_tokens
    results.append((ids, time.perf_counter() - start, first - start, tokens))


def _run_level(url, c, per_client, max_tokens, deadline_s, stream, client_http):
  """C clients x `per_client` requests at once, as coroutines on one event loop (threads of
  one process contend for its GIL: 32 client threads burned ~1.6-1.9 ms of CPU per token on 16
  cores, several times the server's work); (results, wall seconds)."""
  results = []
  deadline = time.time() + deadline_s

  async def clients():
    if client_http == "httpx":
      limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
      async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(_client(_httpx_post(http, url), per_client, results, deadline,
                                       max_tokens, stream) for _ in range(c)))
      return
    parts = urllib.parse.urlsplit(url)
    connections = [_Connection(parts.hostname, parts.port, parts.path) for _ in range(c)]
    try:
      await asyncio.gather(*(_client(conn.post, per_client, results, deadline, max_tokens,
                                     stream) for conn in connections))
    finally:
      for conn in connections:
        conn.close()

  start = time.perf_counter()
  asyncio.run(clients())
  return results, time.perf_counter() - start


def _client_process(url, c, per_client, max_tokens, deadline_s, stream, client_http, ready, go,
                    out, cpus):
  """C clients (coroutines) in a process of their own (as real clients are: their JSON and HTTP
  work does not take the server's GIL): an untimed round, then, on `go`, the timed one."""
  if cpus:
    os.sched_setaffinity(0, cpus)
  _run_level(url, c, 1, max_tokens, deadline_s, stream, client_http)
  ready.release()
  go.wait()
  cpu = time.process_time()
  results, _ = _run_level(url, c, per_client, max_tokens, deadline_s, stream, client_http)
  out.put((results, time.process_time() - cpu))


class _StepTimer:
  """Wall time inside `engine.step` (the engine thread's own work, device time included), and
  inside its admissions (prefill and first tokens of newly admitted requests)."""

  def __init__(self, engine):
    self.seconds, self.steps = 0.0, 0
    self.admit_seconds, self.admits = 0.0, 0
    step, admit = engine.step, getattr(engine, "_admit", None)

    def timed_admit(*args):
      start = time.perf_counter()
      try:
        return admit(*args)
      finally:
        self.admit_seconds += time.perf_counter() - start
        self.admits += 1
    if admit is not None:  # in-process engines only (an EngineProcess admits in its child)
      engine._admit = timed_admit

    def timed_step():
      start = time.perf_counter()
      try:
        return step()
      finally:
        self.seconds += time.perf_counter() - start
        self.steps += 1
    engine.step = timed_step


class _Profiles:
  """cProfile of the event-loop thread and of the engine thread (each enabled on its own
  thread: a Profile sees the thread that enabled it only)."""

  def __init__(self, server, engine):
    self.aloop = server.servers[0].get_loop()
    # CPU time of the thread (time.thread_time), not wall time: waits for the GIL or a core
    # are not charged to whatever function happened to be running.
    self.loop_prof = cProfile.Profile(time.thread_time)
    self.engine_prof = cProfile.Profile(time.thread_time)
    self.on, self._engine_on = False, False
    step = engine.step

    def profiled_step():
      if self.on != self._engine_on:
        (self.engine_prof.enable if self.on else self.engine_prof.disable)()
        self._engine_on = self.on
      return step()
    engine.step = profiled_step

  def start(self):
    self.on = True
    self.aloop.call_soon_threadsafe(self.loop_prof.enable)

  def stop(self):
    self.on = False
    done = threading.Event()
    self.aloop.call_soon_threadsafe(lambda: (self.loop_prof.disable(), done.set()))
    done.wait(10)

  def report(self):
    for name, prof in (("event-loop thread", self.loop_prof), ("engine thread",
                                                                self.engine_prof)):
      print(f"---- {name}: top 20 by own time")
      stats = pstats.Stats(prof).sort_stats("tottime")
      stats.print_stats(20)
      stats.print_callers(3)


def _gil_check(cfg, params):
  """Does a thread running Python (as the event loop does under load) slow the engine thread?
  It gives up the GIL at every device call and transfer, and waits up to a switch interval for
  it each time."""
  requests = [Request(i, tuple(PROMPT), _MAX_TOKENS.value, 1.0, 1.0, 0, request_seed(0, i))
              for i in range(64)]
  engine = Engine(cfg, params, slots=32, max_len=64, prefill_chunk=16)
  engine.run(requests)

  def rate():
    runs = []
    for _ in range(3):
      start = time.perf_counter()
      engine.run(requests)
      runs.append(len(requests) * _MAX_TOKENS.value / (time.perf_counter() - start))
    return float(np.median(runs))

  def spin(stop):
    while not stop.is_set():
      pass

  for interval in (0.005, 0.0002):
    sys.setswitchinterval(interval)
    alone, stop = rate(), threading.Event()
    busy = threading.Thread(target=spin, args=(stop,))
    busy.start()
    beside = rate()
    stop.set()
    busy.join()
    print(f"switch interval {interval} s: Engine.run alone {alone:.0f} tok/s, beside a busy "
          f"Python thread {beside:.0f} tok/s ({alone / beside:.1f}x slower)")


def _level(url, c, stream, loop, timer, profiles, last, client_cpus):
  """One level: C clients, timed; prints its line; returns tokens/s."""
  spawn = multiprocessing.get_context("spawn")
  ready, go, out = spawn.Semaphore(0), spawn.Event(), spawn.Queue()
  # Clients spread over processes: on a many-core machine one process's event loop (one core)
  # would limit the load it generates.
  shares = np.array_split(np.arange(c), min(_CLIENT_PROCESSES.value, c))
  clients = [spawn.Process(target=_client_process, args=(
      url, len(share), _PER_CLIENT.value, _MAX_TOKENS.value, _DEADLINE.value, stream,
      _CLIENT_HTTP.value, ready, go, out, client_cpus)) for share in shares]
  for p in clients:
    p.start()
  for _ in clients:
    ready.acquire()
  steps, slot_steps = loop.steps, loop.slot_steps
  step_s, timed_steps = timer.seconds, timer.steps
  admit_s, admits = timer.admit_seconds, timer.admits
  child_s = getattr(loop.engine, "step_seconds", None)
  child_cpu = getattr(loop.engine, "cpu_seconds", None)
  if profiles and last:
    profiles.start()
  # Compiles where the engine runs: its own process (this one never compiles its programs), or
  # this one when the engine is on a thread here.
  child_compiles = getattr(loop.engine, "compiles", None)
  with count_compiles() as compiles:
    server_cpu = time.process_time()
    start = time.perf_counter()
    go.set()
    results, clients_cpu = [], 0.0
    for _ in clients:
      part, part_cpu = out.get()
      results += part
      clients_cpu += part_cpu
    wall = time.perf_counter() - start
    server_cpu = time.process_time() - server_cpu
  for p in clients:
    p.join()
  if profiles and last:
    profiles.stop()
  ids = [i for r in results for i in r[0]]
  expected = c * _PER_CLIENT.value
  assert len(results) == expected, f"{expected - len(results)} requests lost"
  assert len(ids) == len(set(ids)) == expected, "a request answered twice or under two ids"
  assert all(r[3] == _MAX_TOKENS.value for r in results), "a request with missing tokens"
  lat = np.array([r[1] for r in results])
  ttft = np.array([r[2] for r in results])
  rate = sum(r[3] for r in results) / wall
  batch = (loop.slot_steps - slot_steps) / max(loop.steps - steps, 1)
  in_step = timer.seconds - step_s
  mean_step = 1e3 * in_step / max(timer.steps - timed_steps, 1)
  admissions = (f"; {timer.admits - admits} admissions, "
                f"{1e3 * (timer.admit_seconds - admit_s):.0f} ms" if timer.admits else "")
  if child_s is not None:
    child_s = loop.engine.step_seconds - child_s
    per_step = 1e3 * child_s / max(timer.steps - timed_steps, 1)
    admissions += f"; inside the engine process {per_step:.1f} ms, {100 * child_s / wall:.0f}%"
  if child_compiles is not None:
    compiled = f"{loop.engine.compiles - child_compiles} compiles (engine process)"
  else:
    compiled = f"{compiles.count} compiles (server process, the engine's)"
  tokens = sum(r[3] for r in results)
  # CPU time per generated token of each process (all its threads): what the 2 cores are
  # shared out to, whatever the machine's other load.
  cpu = f"CPU us/token: server process {1e6 * server_cpu / tokens:.0f}"
  if child_cpu is not None:
    cpu += f", engine process {1e6 * (loop.engine.cpu_seconds - child_cpu) / tokens:.0f}"
  cpu += f", clients {1e6 * clients_cpu / tokens:.0f}"
  print(f"{'stream' if stream else 'whole'} clients {c:3d}: {rate:8.1f} tok/s  latency p50 "
        f"{np.percentile(lat, 50):.3f} s p99 {np.percentile(lat, 99):.3f} s  TTFT p50 "
        f"{np.percentile(ttft, 50):.3f} s p99 {np.percentile(ttft, 99):.3f} s  mean decode batch "
        f"{batch:.1f}, {timer.steps - timed_steps} steps of {mean_step:.1f} ms "
        f"({100 * in_step / wall:.0f}% of the wall in engine.step{admissions})  "
        f"{compiled}  ({expected} requests, none lost or "
        f"repeated)  {cpu}", flush=True)
  return rate


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)
  # Both read before either is set: the clients' process starts from the server's mask.
  client_cpus = _cpus("client_cpus", _CLIENT_CPUS.value) if _CLIENT_CPUS.value else None
  if _SERVER_CPUS.value:
    # Before the first jax computation: XLA sizes its CPU thread pool from the allowed CPUs, and
    # the engine process (spawned below) inherits the mask.
    os.sched_setaffinity(0, _cpus("server_cpus", _SERVER_CPUS.value))
  print(f"CPUs: server {sorted(os.sched_getaffinity(0))}, clients "
        f"{_CLIENT_CPUS.value or 'all'}", flush=True)
  cfg, params = _model()
  if _GIL_CHECK.value:
    _gil_check(cfg, params)
    return
  max_rows = len(PROMPT) + _MAX_TOKENS.value - 1
  modes = [m.strip() for m in _MODES.value]
  if not modes or set(modes) - {"stream", "whole"}:
    raise app.UsageError(f"--modes: 'stream' and/or 'whole', got {_MODES.value}")
  if _LOOP.engine_process.value:
    engine = EngineProcess(_build_engine, _MODEL.value, _SLOTS.value, max_rows,
                           pipelined=_PIPELINED.value)
  else:
    engine = Engine(cfg, params, slots=_SLOTS.value, max_len=64, prefill_chunk=16)
    engine.warmup(max_rows)  # every program compiled before anything is timed
  sys.setswitchinterval(_LOOP.switch_interval_s.value)
  loop = EngineLoop(engine, max_queue=1024, **_LOOP.loop_kwargs())
  server = ThreadedServer(create_app(loop, make_tokenizer("byte"), model_name="bench"),
                          http=_HTTP.value)
  url = server.url + "/v1/completions"
  for stream in (True, False):  # first-request one-off costs
    _run_level(url, 1, 2, _MAX_TOKENS.value, 300, stream, _CLIENT_HTTP.value)
  profiles = _Profiles(server.server, engine) if _PROFILE.value else None
  timer = _StepTimer(engine)
  rates, levels = {}, [min(int(x), 64) for x in _CLIENTS.value]
  for mode in modes:
    for c in levels:
      rates[mode, c] = _level(url, c, mode == "stream", loop, timer, profiles,
                              (mode, c) == (modes[-1], levels[-1]), client_cpus)
    if 1 in levels and 32 in levels:
      print(f"{mode}: throughput 32 clients / 1 client: "
            f"{rates[mode, 32] / rates[mode, 1]:.2f}x")
  server.close()
  loop.close()
  # The same work as the 32-client level (32 x requests_per_client requests, 32 at a time),
  # submitted at once to the engine that served, in its own process (processes of one program
  # differ by ~10% in speed on this machine); the median of 3 runs.
  n = 32 * _PER_CLIENT.value
  requests = [Request(i, tuple(PROMPT), _MAX_TOKENS.value, 1.0, 1.0, 0, request_seed(0, i))
              for i in range(n)]
  cpu_now = (lambda: engine.cpu_seconds) if _LOOP.engine_process.value else time.process_time
  runs, cpu = [], cpu_now()
  for _ in range(3):
    start = time.perf_counter()
    engine.run(requests)
    runs.append(n * _MAX_TOKENS.value / (time.perf_counter() - start))
  cpu = cpu_now() - cpu
  if _LOOP.engine_process.value:
    engine.close()
  direct_rate = float(np.median(runs))
  where = ("the engine process that served" if _LOOP.engine_process.value
           else "the engine that served")
  print(f"engine direct ({where}), {n} requests, {_SLOTS.value} slots: "
        f"{direct_rate:.1f} tok/s (median of {', '.join(f'{r:.0f}' for r in runs)}), CPU "
        f"us/token {1e6 * cpu / (3 * n * _MAX_TOKENS.value):.0f}")
  for mode in modes:
    if (mode, 32) in rates:
      print(f"{mode}: HTTP overhead at 32 clients x {_PER_CLIENT.value}: "
            f"{100 * (1 - rates[mode, 32] / direct_rate):.1f}%")
  if profiles:
    profiles.report()


if __name__ == "__main__":
  app.run(main)
