"""The paged cache's promises, measured: decode cost follows the live lengths, not max_len;
at full length it costs what the contiguous cache costs; and bucketed shapes stop compiling
after warm-up.

  python tools/bench_paged.py                         # tiny GLM-5 on CPU, a few minutes
  python tools/bench_paged.py --max_lens=4096,65536 --live_len=512 --slots=8

Sections:
  step time   the engine's jitted decode step (what it runs per token, to block_until_ready;
              the least of `--rounds` x `--steps` calls, rounds alternating the engines so the
              machine's load hits them alike) with `--slots` slots of `--live_len` rows each,
              at each `--max_lens`, with the paged cache (pool sized for the live rows,
              `--page_size`) and with the contiguous cache (`page_size=None`; skipped above
              `--contiguous_max`, whose cache would not fit), and each one's ratio to the
              smallest max_len.
  full length the same step with every slot holding `--full_len - 1` rows (max_len
              `--full_len`: the view is the whole cache), paged and contiguous timed in the
              same rounds, and paged / contiguous; goal <= 1.2x.
  compiles    XLA compilations during `--requests` random requests (prompt lengths 1 ..
              `--random_prompt`, 1 .. `--random_new` new tokens, greedy and sampled, a fifth
              of them repeating one prompt: groups) after `Engine.warmup(max_rows)` for such
              requests, at the largest max_len; goal 0.

The last output line is all figures as JSON.
"""

import json
import random
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from configs import overrides
from glm5_jax.api import init_params
from glm5_jax.config import ModelConfig
from glm5_jax.infer.compile_count import count_compiles
from glm5_jax.infer.engine import Engine
from glm5_jax.infer.paged import pages_for
from glm5_jax.infer.programs import decode_and_sample
from glm5_jax.infer.requests import Request

_CONFIG = overrides.define_config_file("config", "configs/tiny.py", "Experiment config (its "
                                       "model is benchmarked, random params).")
_MAX_LENS = flags.DEFINE_list("max_lens", ["4096", "65536"], "Engine max_len values to compare.")
_LIVE_LEN = flags.DEFINE_integer("live_len", 256, "Prompt tokens of every slot.")
_SLOTS = flags.DEFINE_integer("slots", 4, "Slots B, all decoding.")
_STEPS = flags.DEFINE_integer("steps", 16, "Timed decode steps per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timing rounds (the least time counts).")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Rows per page.")
_CONTIGUOUS_MAX = flags.DEFINE_integer("contiguous_max", 65536, "Largest max_len the contiguous "
                                       "cache is timed at.")
_FULL_LEN = flags.DEFINE_integer("full_len", 4096, "max_len of the full-length comparison "
                                 "(slots hold max_len - 1 rows); 0 skips it.")
_REQUESTS = flags.DEFINE_integer("requests", 100, "Random requests of the compile count.")
_RANDOM_PROMPT = flags.DEFINE_integer("random_prompt", 200, "Longest random prompt.")
_RANDOM_NEW = flags.DEFINE_integer("random_new", 16, "Most new tokens of a random request.")
_SEED = flags.DEFINE_integer("seed", 0, "Params and prompt seed.")


class StepTimer:
  """The engine's jitted decode step (`programs.decode_and_sample`, what `Engine` runs per
  token) over `slots` slots that each hold `live_len` rows, timed to `block_until_ready`."""

  def __init__(self, cfg, params, *, max_len, page_size, slots, live_len):
    num_pages = None if page_size is None else slots * pages_for(live_len + 1, page_size) + 1
    self.engine = e = Engine(cfg, params, slots=slots, max_len=max_len, prefill_chunk=256,
                             page_size=page_size, num_pages=num_pages)
    table = None
    if e.pages is not None:  # every slot holds its live rows' pages
      for slot in range(slots):
        e.pages.grow(slot, live_len + 1)
      table = e.pages.table(np.arange(slots), live_len + 1)
    zeros = jnp.zeros(slots, jnp.int32)
    self.args = (zeros, jnp.full(slots, live_len, jnp.int32), jnp.ones(slots, bool),
                 *e._slot_arrays([None] * slots), zeros, table)
    self.seconds()  # compiles

  def seconds(self) -> float:
    e = self.engine
    start = time.perf_counter()
    e.cache, e.counts, out, _ = decode_and_sample(
        e.cfg, e.params, e.cache, e.counts, *self.args, return_logits=False,
        record_routing=False, paging=e.paging)
    jax.block_until_ready(out)
    return time.perf_counter() - start


def compile_count(cfg, params, *, max_len, page_size, slots, n, longest, most_new, seed):
  engine = Engine(cfg, params, slots=slots, max_len=max_len, prefill_chunk=64,
                  page_size=page_size)
  warm_start = time.perf_counter()
  engine.warmup(max_rows=longest + most_new - 1)
  warm_s = time.perf_counter() - warm_start
  rng = random.Random(seed)
  prompts = [tuple(rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, longest)))
             for _ in range(n - n // 5)]
  prompts += [prompts[0]] * (n // 5)
  requests = [Request(i, p, rng.randint(1, most_new), rng.choice([0.0, 1.0]), 1.0, 0, i, ())
              for i, p in enumerate(prompts)]
  start = time.perf_counter()
  with count_compiles() as compiles:
    engine.run(requests)
  return compiles.count, warm_s, time.perf_counter() - start


def main(argv):
  del argv
  cfg = ModelConfig.from_config(_CONFIG.value.model)
  params = init_params(cfg, jax.random.key(_SEED.value))
  max_lens = sorted(int(m) for m in _MAX_LENS.value)
  common = dict(slots=_SLOTS.value, live_len=_LIVE_LEN.value)
  print(f"backend {jax.default_backend()}; pattern {cfg.attention_pattern}, "
        f"{cfg.num_hidden_layers} layers; {_SLOTS.value} slots of {_LIVE_LEN.value} live rows")
  figures = {"step_ms": {}}
  timers = {(name, m): StepTimer(cfg, params, max_len=m, page_size=page_size, **common)
            for name, page_size in (("paged", _PAGE_SIZE.value), ("contiguous", None))
            for m in max_lens if page_size or m <= _CONTIGUOUS_MAX.value}
  if _FULL_LEN.value:
    full = dict(slots=_SLOTS.value, live_len=_FULL_LEN.value - 1, max_len=_FULL_LEN.value)
    timers[("paged", "full")] = StepTimer(cfg, params, page_size=_PAGE_SIZE.value, **full)
    timers[("contiguous", "full")] = StepTimer(cfg, params, page_size=None, **full)
  times = {key: float("inf") for key in timers}
  for _ in range(_ROUNDS.value):
    for key, timer in timers.items():
      for _ in range(_STEPS.value):
        times[key] = min(times[key], timer.seconds())
  for name in ("paged", "contiguous"):
    mine = {m: t for (n, m), t in times.items() if n == name and m != "full"}
    if not mine:
      continue
    base = mine[min(mine)]
    for max_len, t in sorted(mine.items()):
      print(f"{name:>10}  max_len {max_len:>6}: decode step {1e3 * t:8.2f} ms  "
            f"({t / base:.2f}x of max_len {min(mine)})")
    figures["step_ms"][name] = {m: round(1e3 * t, 3) for m, t in sorted(mine.items())}
  if _FULL_LEN.value:
    paged_t, contiguous_t = times[("paged", "full")], times[("contiguous", "full")]
    print(f"full length (max_len {_FULL_LEN.value}, {_FULL_LEN.value - 1} rows a slot): paged "
          f"{1e3 * paged_t:.2f} ms, contiguous {1e3 * contiguous_t:.2f} ms: "
          f"{paged_t / contiguous_t:.2f}x (goal <= 1.2x)")
    figures["full_length"] = {"max_len": _FULL_LEN.value, "paged_ms": round(1e3 * paged_t, 3),
                              "contiguous_ms": round(1e3 * contiguous_t, 3),
                              "ratio": round(paged_t / contiguous_t, 3)}
  count, warm_s, run_s = compile_count(
      cfg, params, max_len=max_lens[-1], page_size=_PAGE_SIZE.value, slots=_SLOTS.value,
      n=_REQUESTS.value, longest=_RANDOM_PROMPT.value, most_new=_RANDOM_NEW.value,
      seed=_SEED.value)
  print(f"compiles during {_REQUESTS.value} random requests after warm-up ({warm_s:.1f}s): "
        f"{count} (run {run_s:.1f}s)")
  figures.update(compiles_after_warmup=count, warmup_s=round(warm_s, 2),
                 random_requests_s=round(run_s, 2))
  print(json.dumps(figures))


if __name__ == "__main__":
  app.run(main)
