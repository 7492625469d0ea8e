"""Wall time of a warm jitted call, as the benchmarks report it (tools/bench_dsa.py and the
device suite's kernel and MoE sections)."""

import time

import jax
import numpy as np


def median_seconds(fn, args, repeats: int) -> float:
  """The median wall time of `repeats` calls `fn(*args)`, each waited for
  (`jax.block_until_ready`); call `fn` once before, so no compile or first-run cost is in it."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))
