"""Load test of the HTTP server on loopback: C concurrent streaming clients, throughput, p50 /
p99 latency, time to first token, and a check that every request is answered exactly once;
then the same batch through the engine directly, for the HTTP layer's overhead.

  python tools/bench_serve.py --clients=1,8,32 --requests_per_client=2 --max_tokens=16

A tiny random model (tests/conftest.py's size class) in-process; bounded by --clients (at most
64) and --deadline_s.
"""

import cProfile
import json
import logging
import multiprocessing
import pstats
import socket
import sys
import threading
import time

from absl import app, flags
import httpx
import jax
import numpy as np
import uvicorn

from glm5_jax.api import init_params
from glm5_jax.config import model_config
from glm5_jax.data import make_tokenizer
from glm5_jax.infer.compile_count import count_compiles
from glm5_jax.infer.engine import Engine, request_seed
from glm5_jax.infer.requests import Request
from glm5_jax.serve.app import create_app
from glm5_jax.serve.engine_loop import EngineLoop

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
_ADMIT_AFTER = flags.DEFINE_integer("admit_after_steps", 0, "EngineLoop's admit_after_steps "
                                   "(0: every arrival admitted at the next step).")
_SWITCH = flags.DEFINE_float("switch_interval_s", 0.0002, "sys.setswitchinterval, as "
                             "experiments/serve.py sets it (Python's default: 0.005).")
PROMPT = [1, 72, 101, 108, 108, 111]


def _model():
  cfg = model_config(vocab_size=384, hidden_size=64, num_hidden_layers=2, attention_pattern="DD",
                     first_k_dense_replace=2, num_attention_heads=4, q_lora_rank=32,
                     kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     index_n_heads=2, index_head_dim=16, index_topk=8, intermediate_size=128,
                     num_nextn_predict_layers=0, mtp_depths=0, dtype="float32",
                     cache_dtype="float32")
  return cfg, init_params(cfg, jax.random.key(0))


def _client(url, n, results, deadline, max_tokens):
  with httpx.Client(timeout=120) as http:
    for _ in range(n):
      if time.time() > deadline:
        return
      start, first = time.perf_counter(), None
      ids = set()
      tokens = 0  # counted when the request finishes (ignore_eos: exactly max_tokens)
      with http.stream("POST", url, json={"prompt": PROMPT, "max_tokens": max_tokens,
                                          "stream": True, "ignore_eos": True,
                                          "temperature": 1.0}) as r:
        for line in r.iter_lines():
          if not line.startswith("data: ") or line == "data: [DONE]":
            continue
          first = first or time.perf_counter()
          chunk = json.loads(line[6:])
          ids.add(chunk["id"])
          if chunk["choices"][0]["finish_reason"]:
            tokens = max_tokens
      results.append((ids, time.perf_counter() - start, first - start, tokens))


def _run_level(url, c, per_client, max_tokens, deadline_s):
  """C clients x `per_client` requests at once; (results, wall seconds)."""
  results = []
  threads = [threading.Thread(target=_client, args=(url, per_client, results,
                                                    time.time() + deadline_s, max_tokens))
             for _ in range(c)]
  start = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return results, time.perf_counter() - start


def _client_process(url, c, per_client, max_tokens, deadline_s, ready, go, out):
  """The clients of one level in a process of their own (as real clients are: their JSON and
  HTTP work does not take the server's GIL): an untimed round, then, on `go`, the timed one."""
  _run_level(url, c, 1, max_tokens, deadline_s)
  ready.set()
  go.wait()
  out.put(_run_level(url, c, per_client, max_tokens, deadline_s))


class _StepTimer:
  """Wall time inside `engine.step` (the engine thread's own work, device time included), and
  inside its admissions (prefill and first tokens of newly admitted requests)."""

  def __init__(self, engine):
    self.seconds, self.steps = 0.0, 0
    self.admit_seconds, self.admits = 0.0, 0
    step, admit = engine.step, engine._admit

    def timed_admit(*args):
      start = time.perf_counter()
      try:
        return admit(*args)
      finally:
        self.admit_seconds += time.perf_counter() - start
        self.admits += 1
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


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)
  cfg, params = _model()
  if _GIL_CHECK.value:
    _gil_check(cfg, params)
    return
  max_rows = len(PROMPT) + _MAX_TOKENS.value - 1
  engine = Engine(cfg, params, slots=_SLOTS.value, max_len=64, prefill_chunk=16)
  engine.warmup(max_rows)  # every program compiled before anything is timed
  sys.setswitchinterval(_SWITCH.value)
  loop = EngineLoop(engine, max_queue=1024, admit_after_steps=_ADMIT_AFTER.value)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = uvicorn.Server(uvicorn.Config(create_app(loop, make_tokenizer("byte"),
                                                    model_name="bench"),
                                         host="127.0.0.1", port=port, log_level="warning"))
  threading.Thread(target=server.run, daemon=True).start()
  while not server.started:
    time.sleep(0.05)
  url = f"http://127.0.0.1:{port}/v1/completions"
  _client(url, 2, [], time.time() + 300, _MAX_TOKENS.value)  # first-request one-off costs
  profiles = _Profiles(server, engine) if _PROFILE.value else None
  timer = _StepTimer(engine)
  rates, levels = {}, [min(int(x), 64) for x in _CLIENTS.value]
  spawn = multiprocessing.get_context("spawn")
  for c in levels:
    ready, go, out = spawn.Event(), spawn.Event(), spawn.Queue()
    clients = spawn.Process(target=_client_process, args=(
        url, c, _PER_CLIENT.value, _MAX_TOKENS.value, _DEADLINE.value, ready, go, out))
    clients.start()
    ready.wait()
    steps, slot_steps = loop.steps, loop.slot_steps
    step_s, timed_steps = timer.seconds, timer.steps
    admit_s, admits = timer.admit_seconds, timer.admits
    if profiles and c == levels[-1]:
      profiles.start()
    with count_compiles() as compiles:
      go.set()
      results, wall = out.get()
    clients.join()
    if profiles and c == levels[-1]:
      profiles.stop()
    ids = [i for r in results for i in r[0]]
    expected = c * _PER_CLIENT.value
    assert len(results) == expected, f"{expected - len(results)} requests lost"
    assert len(ids) == len(set(ids)) == expected, "a request answered twice or under two ids"
    lat = np.array([r[1] for r in results])
    ttft = np.array([r[2] for r in results])
    rates[c] = sum(r[3] for r in results) / wall
    batch = (loop.slot_steps - slot_steps) / max(loop.steps - steps, 1)
    in_step = timer.seconds - step_s
    mean_step = 1e3 * in_step / max(timer.steps - timed_steps, 1)
    print(f"clients {c:3d}: {rates[c]:8.1f} tok/s  latency p50 {np.percentile(lat, 50):.3f} s "
          f"p99 {np.percentile(lat, 99):.3f} s  TTFT p50 {np.percentile(ttft, 50):.3f} s "
          f"p99 {np.percentile(ttft, 99):.3f} s  mean decode batch {batch:.1f}, "
          f"{timer.steps - timed_steps} steps of {mean_step:.1f} ms ({100 * in_step / wall:.0f}% "
          f"of the wall in engine.step; {timer.admits - admits} admissions, "
          f"{1e3 * (timer.admit_seconds - admit_s):.0f} ms)  "
          f"{compiles.count} compiles  ({expected} requests, none lost or repeated)")
  if 1 in rates and 32 in rates:
    print(f"throughput 32 clients / 1 client: {rates[32] / rates[1]:.2f}x")
  # The same work as the 32-client level (32 x requests_per_client requests, 32 at a time),
  # submitted at once; the median of 3 runs (the machine's other load varies).
  n = 32 * _PER_CLIENT.value
  requests = [Request(i, tuple(PROMPT), _MAX_TOKENS.value, 1.0, 1.0, 0, request_seed(0, i))
              for i in range(n)]
  direct = Engine(cfg, params, slots=_SLOTS.value, max_len=64, prefill_chunk=16)
  direct.run(requests)  # the same programs as the server's engine (compiled above)
  direct_timer, runs = _StepTimer(direct), []
  for _ in range(3):
    start = time.perf_counter()
    direct.run(requests)
    runs.append(n * _MAX_TOKENS.value / (time.perf_counter() - start))
  direct_rate = float(np.median(runs))
  print(f"engine direct, {n} requests, 32 slots: {direct_rate:.1f} tok/s (median of "
        f"{', '.join(f'{r:.0f}' for r in runs)}), steps of "
        f"{1e3 * direct_timer.seconds / direct_timer.steps:.1f} ms "
        f"({direct_timer.admits // 3} admissions per run)")
  if 32 in rates:
    print(f"HTTP overhead at 32 clients x {_PER_CLIENT.value}: "
          f"{100 * (1 - rates[32] / direct_rate):.1f}%")
  if profiles:
    profiles.report()
  server.should_exit = True
  loop.close()


if __name__ == "__main__":
  app.run(main)
