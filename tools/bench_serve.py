"""Load test of the HTTP server on loopback: C concurrent streaming clients, throughput, p50 /
p99 latency, time to first token, and a check that every request is answered exactly once;
then the same batch through the engine directly, for the HTTP layer's overhead.

  python tools/bench_serve.py --clients=1,8,32 --requests_per_client=2 --max_tokens=16

A tiny random model (tests/conftest.py's size class) in-process; bounded by --clients (at most
64) and --deadline_s.
"""

import json
import logging
import socket
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
from glm5_jax.infer.engine import Engine, request_seed
from glm5_jax.infer.requests import Request
from glm5_jax.serve.app import create_app
from glm5_jax.serve.engine_loop import EngineLoop

_CLIENTS = flags.DEFINE_list("clients", ["1", "8", "32"], "Concurrent client counts (<= 64).")
_PER_CLIENT = flags.DEFINE_integer("requests_per_client", 2, "Requests each client sends.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "Tokens per request.")
_SLOTS = flags.DEFINE_integer("slots", 32, "Engine slots.")
_DEADLINE = flags.DEFINE_float("deadline_s", 300, "Stop a level's clients after this long.")
PROMPT = [1, 72, 101, 108, 108, 111]


def _model():
  cfg = model_config(vocab_size=384, hidden_size=64, num_hidden_layers=2, attention_pattern="DD",
                     first_k_dense_replace=2, num_attention_heads=4, q_lora_rank=32,
                     kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     index_n_heads=2, index_head_dim=16, index_topk=8, intermediate_size=128,
                     num_nextn_predict_layers=0, mtp_depths=0, dtype="float32",
                     cache_dtype="float32")
  return cfg, init_params(cfg, jax.random.key(0))


def _client(url, n, results, deadline):
  with httpx.Client(timeout=120) as http:
    for _ in range(n):
      if time.time() > deadline:
        return
      start, first = time.perf_counter(), None
      ids = set()
      tokens = 0  # counted when the request finishes (ignore_eos: exactly max_tokens)
      with http.stream("POST", url, json={"prompt": PROMPT, "max_tokens": _MAX_TOKENS.value,
                                          "stream": True, "ignore_eos": True,
                                          "temperature": 1.0}) as r:
        for line in r.iter_lines():
          if not line.startswith("data: ") or line == "data: [DONE]":
            continue
          first = first or time.perf_counter()
          chunk = json.loads(line[6:])
          ids.add(chunk["id"])
          if chunk["choices"][0]["finish_reason"]:
            tokens = _MAX_TOKENS.value
      results.append((ids, time.perf_counter() - start, first - start, tokens))


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)
  cfg, params = _model()
  engine = Engine(cfg, params, slots=_SLOTS.value, max_len=64, prefill_chunk=16)
  loop = EngineLoop(engine, max_queue=1024)
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
  _client(url, 2, [], time.time() + 300)  # compile the programs before timing
  rates = {}
  for c in [min(int(x), 64) for x in _CLIENTS.value]:
    # An untimed round first: admissions of new row counts compile their prefill programs.
    warm = [threading.Thread(target=_client, args=(url, 1, [], time.time() + _DEADLINE.value))
            for _ in range(c)]
    for t in warm:
      t.start()
    for t in warm:
      t.join()
    results = []
    threads = [threading.Thread(target=_client, args=(url, _PER_CLIENT.value, results,
                                                      time.time() + _DEADLINE.value))
               for _ in range(c)]
    start = time.perf_counter()
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    wall = time.perf_counter() - start
    ids = [i for r in results for i in r[0]]
    expected = c * _PER_CLIENT.value
    assert len(results) == expected, f"{expected - len(results)} requests lost"
    assert len(ids) == len(set(ids)) == expected, "a request answered twice or under two ids"
    lat = np.array([r[1] for r in results])
    ttft = np.array([r[2] for r in results])
    rates[c] = sum(r[3] for r in results) / wall
    print(f"clients {c:3d}: {rates[c]:8.1f} tok/s  latency p50 {np.percentile(lat, 50):.3f} s "
          f"p99 {np.percentile(lat, 99):.3f} s  TTFT p50 {np.percentile(ttft, 50):.3f} s "
          f"p99 {np.percentile(ttft, 99):.3f} s  ({expected} requests, none lost or repeated)")
  if 1 in rates and 32 in rates:
    print(f"throughput 32 clients / 1 client: {rates[32] / rates[1]:.2f}x")
  n = 32
  requests = [Request(i, tuple(PROMPT), _MAX_TOKENS.value, 1.0, 1.0, 0, request_seed(0, i))
              for i in range(n)]
  direct = Engine(cfg, params, slots=_SLOTS.value, max_len=64, prefill_chunk=16)
  direct.run(requests)  # compile
  start = time.perf_counter()
  direct.run(requests)
  direct_rate = n * _MAX_TOKENS.value / (time.perf_counter() - start)
  print(f"engine direct, {n} requests in one batch: {direct_rate:.1f} tok/s")
  if 32 in rates:
    print(f"HTTP overhead at 32 clients x {_PER_CLIENT.value}: "
          f"{100 * (1 - rates[32] / direct_rate):.1f}%")
  server.should_exit = True
  loop.close()


if __name__ == "__main__":
  app.run(main)
