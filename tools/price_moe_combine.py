"""The expert-parallel MoE's combine (each token's X expert rows gathered and summed,
`glm5_jax.moe_parallel`), compiled by the TPU compiler ahead of time for one chip and priced op
by op, in the forms its sum can take (issue 40).

  ALLOW_MULTIPLE_LIBTPU_LOAD=1 python tools/price_moe_combine.py --target=v5p:2x2x1
      [--rows=36864 --tokens=4096 --hidden=6144 --top_k=8]

At the 744B headline's per-device shapes of one dispatch chunk (a 36,864-row bf16 buffer, 4,096
tokens, D 6,144, X 8), with the capacity factor's keep mask `[X, m]` (a dropped pair adds zero):
  reduce         the rows gathered X-major `[X, m, D]`, masked by one select, summed by one
                 reduce over X (the form before `moe_parallel._summed_slabs`)
  reduce_nomask  the same without the mask
  masked_slabs   the mask as one select over `[X, m, D]`, then the slabs added
  slabs          `moe_parallel._summed_slabs`: a chain of X - 1 adds of `[m, D]` slabs, each
                 slab's select beside its add (the form the dispatch runs)
Prints each form's compiler estimate (`glm5_jax.planning.op_costs`: each instruction's
`estimated_cycles`) and its costliest ops. Needs libtpu (the `tpu-aot` extra).
"""

import argparse

import jax
import jax.numpy as jnp

from glm5_jax import moe_parallel
from glm5_jax.accelerators import ACCELERATORS
from glm5_jax.planning import aot_targets, hlo_loops, op_costs


def combine(form: str, x: int, m: int, d: int):
  """`(rows_RD, slot_XM, keep_XM) -> y_MD` in `form` (module docstring)."""

  def run(rows_RD, slot_XM, keep_XM):
    rows_XMD = rows_RD[slot_XM.reshape(-1)].reshape(x, m, d)
    if form == "slabs":
      return moe_parallel._summed_slabs(rows_XMD, keep_XM).astype(rows_RD.dtype)
    if form == "masked_slabs":
      rows_XMD = jnp.where(keep_XM[..., None], rows_XMD, 0)
      return moe_parallel._summed_slabs(rows_XMD).astype(rows_RD.dtype)
    if form == "reduce":
      rows_XMD = jnp.where(keep_XM[..., None], rows_XMD, 0)
    return rows_XMD.sum(0, dtype=jnp.float32).astype(rows_RD.dtype)

  return run


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="v5p:2x2x1")
  parser.add_argument("--forms", default="reduce,reduce_nomask,masked_slabs,slabs")
  parser.add_argument("--rows", type=int, default=36864)
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--hidden", type=int, default=6144)
  parser.add_argument("--top_k", type=int, default=8)
  parser.add_argument("--top", type=int, default=3, help="each form's N costliest ops")
  args = parser.parse_args(argv)
  chip = ACCELERATORS[aot_targets.parse_target(args.target)[0]]
  device = aot_targets.tpu_devices(args.target)[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  x, m, d = args.top_k, args.tokens, args.hidden
  shapes = [jax.ShapeDtypeStruct(s, t, sharding=sharding) for s, t in (
      ((args.rows, d), jnp.bfloat16), ((x, m), jnp.int32), ((x, m), jnp.bool_))]
  print(f"the combine of {m} tokens x {x} rows of a {args.rows} x {d} bf16 buffer, one device "
        f"of {args.target} (compiler estimates)")
  for form in args.forms.split(","):
    compiled = jax.jit(combine(form, x, m, d)).trace(*shapes).lower(
        lowering_platforms=("tpu",)).compile()
    costs = op_costs.price_module(hlo_loops.parse_module(compiled.as_text()), chip)
    total = sum(cost.seconds * cost.runs for cost in costs)
    print(f"{form:<14} {total * 1e3:7.3f} ms")
    for cost in sorted(costs, key=lambda cost: -cost.seconds * cost.runs)[:args.top]:
      print(f"  {cost.seconds * cost.runs * 1e3:8.3f} ms x{cost.runs:<3} {cost.op:<8} "
            f"{cost.source[-60:]}")


if __name__ == "__main__":
  main()
