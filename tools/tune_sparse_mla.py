"""Times the GPU sparse MLA kernel (`pallas_kernels.sparse_mla_triton`) at several block options,
forward and forward + backward, at GLM-5's shapes, and checks each against the default options'
results: which options the device suite's defaults should be.

  # on an H100 / H200 (wheels and PYTHONPATH as for tools/device_suite.py):
  python3 tools/tune_sparse_mla.py --seq_len=16384 --out=$OUT/tune_sparse_mla.json
  python3 tools/tune_sparse_mla.py --smoke        # CPU: tiny shapes, interpret mode, 2 options

Each option set is one row: compile time, median forward and forward + backward time (the
backward alone is their difference), useful TFLOP/s of each (FLOP rules of
tools/device_suite_kernels.py) and the relative error of out and the four gradients against the
default options (max|got - want| / max|want|; a different head block or summation order moves
bf16 results by ~1e-3). An option set whose launch fails (shared memory over the chip's limit,
say) is a row with its error; the rest still run. Rows past `--budget_s` are skipped.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax

from tools import device_suite_kernels as kernels

# Forward options first (the backward at its defaults), then backward options: the backward is
# where the H200 runs spent 88-93% of the kernel's fwd + bwd time (docs/performance.md). The
# backward runs all heads in one program per token; `backward_head_block=32` is the previous
# design (two programs per token); `backward_dkv_chunk=128` the key-row gradients in whole
# gather chunks; `backward_atomic_order="acq_rel"` plgpu.atomic_add's order (1.6-1.8x slower
# on an H200, pallas_kernels/triton_atomics.py).
GRID = (
    {},
    {"block_t": 16}, {"block_t": 64, "num_stages": 1}, {"num_stages": 1}, {"num_stages": 3},
    {"num_warps": 4}, {"block_t": 16, "num_stages": 3},
    {"backward_atomic_order": "acq_rel"}, {"backward_head_block": 32}, {"backward_block_t": 16},
    {"backward_block_t": 16, "backward_dkv_chunk": 128}, {"backward_dkv_chunk": 128},
    {"backward_c_chunk": 64}, {"backward_c_chunk": 256}, {"backward_num_warps": 16},
    {"backward_num_stages": 2}, {"backward_block_t": 64},
)

_SEQ_LEN = flags.DEFINE_integer("seq_len", 16384, "L = S (one sequence).")
_OPTIONS = flags.DEFINE_string("options", "", "JSON list of option dicts (default: GRID).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per measurement (median).")
_BUDGET = flags.DEFINE_float("budget_s", 150.0, "Seconds for all rows.")
_OUT = flags.DEFINE_string("out", "", "Also write the rows here as JSON.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes, interpret mode (CPU check).")


def main(argv):
  del argv
  smoke = _SMOKE.value
  if jax.default_backend() != "gpu" and not smoke:
    raise app.UsageError("the Triton kernels need a GPU; --smoke runs them in interpret mode")
  try:
    grid = json.loads(_OPTIONS.value) if _OPTIONS.value else list(GRID[:2] if smoke else GRID)
  except json.JSONDecodeError as e:
    raise app.UsageError(f"--options: a JSON list of option dicts, got {_OPTIONS.value!r}: "
                         f"{e}") from None
  if not isinstance(grid, list) or not all(isinstance(o, dict) for o in grid):
    raise app.UsageError(f"--options: a JSON list of option dicts, got {_OPTIONS.value!r}")
  grid = grid if grid and grid[0] == {} else [{}] + grid
  dims = kernels.SMOKE_DIMS if smoke else kernels.GLM5_DIMS
  length = 64 if smoke else _SEQ_LEN.value
  print(f"tune_sparse_mla: {jax.devices()[0].device_kind}, jax {jax.__version__}, L={length}, "
        f"{len(grid)} option sets", flush=True)
  rows = kernels.tune_sparse_mla(length, dims, grid, repeats=_REPEATS.value, budget_s=_BUDGET.value,
              interpret=smoke)
  ok = [r for r in rows if r["status"] == "ok"]
  if ok:
    best_f = min(ok, key=lambda r: r["forward_ms"])
    best_b = min(ok, key=lambda r: r["backward_ms"])
    print(f"fastest forward: {best_f['options']} {best_f['forward_ms']:.2f} ms "
          f"(defaults {ok[0]['forward_ms']:.2f}); fastest backward: {best_b['options']} "
          f"{best_b['backward_ms']:.2f} ms (defaults {ok[0]['backward_ms']:.2f})", flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, seq_len=length,
                     rows=rows), f, indent=1, default=float)
  if not ok:
    sys.exit("tune_sparse_mla: no option set ran")


if __name__ == "__main__":
  app.run(main)
