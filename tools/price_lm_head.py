"""The LM head and its cross-entropy alone, compiled by the TPU compiler ahead of time and
priced op by op, in the three forms the trainer has (issue 40).

  ALLOW_MULTIPLE_LIBTPU_LOAD=1 python tools/price_lm_head.py --target=v5p:2x2x1
      [--batch=2 --seq_len=4096 --hidden=6144 --vocab=154880 --chunk=512]

One head at the per-device shapes of the 744B headline step (2 x 4,096 tokens per device, D
6,144, Y 154,880, bf16 operands), loss and gradients in h and W on one device of `--target`:
  logits      the model's fp32 `[B, L, Y]` logits, then `losses.cross_entropy` (`ce_chunk=0`)
  recompute   `losses.fused_cross_entropy` (`train.ce_chunk`): the backward recomputes each
              chunk's logits
  in_forward  `fused_ce.loss_with_gradients` (`train.ce_grad_in_forward`): d logits, dh and dW
              formed in the forward from each chunk's logits
Prints per form the compiler estimate (`glm5_jax.planning.op_costs`, each instruction's
`estimated_cycles`, as tools/price_dsa_stage.py), the matmul FLOPs at the chip's peak (a bound),
the compiled program's temporaries and (`--top`) its costliest ops. Needs libtpu (the `tpu-aot`
extra).
"""

import argparse
import time

import jax
import jax.numpy as jnp

from glm5_jax.accelerators import ACCELERATORS
from glm5_jax.planning import aot_targets, hlo_loops, op_costs
from glm5_jax.train import fused_ce, losses

FORMS = ("logits", "recompute", "in_forward")


def head_loss(form: str, chunk: int):
  """`(h_BLD, w_DY, targets_BL, weights_BL) -> (loss, (dh, dW))` of one head in `form`."""

  def loss(h_BLD, w_DY, targets_BL, weights_BL):
    if form == "logits":
      logits_BLY = jnp.einsum("bld,dy->bly", h_BLD, w_DY, preferred_element_type=jnp.float32)
      return losses.cross_entropy(logits_BLY, targets_BL, weights_BL)["loss"]
    if form == "recompute":
      return losses.fused_cross_entropy(h_BLD, w_DY, targets_BL, weights_BL, chunk=chunk)["loss"]
    ce_weights_BL = weights_BL / jnp.maximum(weights_BL.sum(), 1.0)
    head = (h_BLD, targets_BL, ce_weights_BL, jnp.zeros_like(weights_BL))
    return fused_ce.loss_with_gradients([head], w_DY, chunk)[0]

  return jax.value_and_grad(loss, argnums=(0, 1))


def compile_form(form: str, args):
  """The compiled program of `form` at the arguments' shapes, on one device of --target."""
  device = aot_targets.tpu_devices(args.target)[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  b, l, d, y = args.batch, args.seq_len, args.hidden, args.vocab
  shapes = [jax.ShapeDtypeStruct(s, t, sharding=sharding) for s, t in (
      ((b, l, d), jnp.bfloat16), ((d, y), jnp.bfloat16), ((b, l), jnp.int32),
      ((b, l), jnp.float32))]
  return jax.jit(head_loss(form, args.chunk)).trace(*shapes).lower(
      lowering_platforms=("tpu",)).compile()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="v5p:2x2x1")
  parser.add_argument("--forms", default=",".join(FORMS))
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq_len", type=int, default=4096)
  parser.add_argument("--hidden", type=int, default=6144)
  parser.add_argument("--vocab", type=int, default=154880)
  parser.add_argument("--chunk", type=int, default=512)
  parser.add_argument("--top", type=int, default=0, help="also list each form's N costliest ops")
  args = parser.parse_args(argv)
  chip = ACCELERATORS[aot_targets.parse_target(args.target)[0]]
  matmuls = {"logits": 3, "recompute": 4, "in_forward": 3}
  print(f"one head, B={args.batch} L={args.seq_len} D={args.hidden} Y={args.vocab}, chunk "
        f"{args.chunk}, one device of {args.target}")
  for form in args.forms.split(","):
    start = time.perf_counter()
    compiled = compile_form(form, args)
    seconds = time.perf_counter() - start
    module = hlo_loops.parse_module(compiled.as_text())
    costs = op_costs.price_module(module, chip)
    total = sum(cost.seconds * cost.runs for cost in costs)
    by_kind = {}
    for cost in costs:
      by_kind[cost.kind] = by_kind.get(cost.kind, 0.0) + cost.seconds * cost.runs
    flops = matmuls[form] * 2 * args.batch * args.seq_len * args.hidden * args.vocab
    temp_gib = compiled.memory_analysis().temp_size_in_bytes / 2 ** 30
    print(f"{form:<10} compiler estimate {total * 1e3:7.1f} ms ("
          + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(by_kind.items(),
                                                               key=lambda kv: -kv[1]))
          + f"); {matmuls[form]} matmuls {flops / 1e12:.2f} TFLOP, at peak (bound) "
          f"{flops / chip.peak_flops * 1e3:.1f} ms; temporaries {temp_gib:.2f} GiB; compiled "
          f"in {seconds:.0f} s")
    for cost in sorted(costs, key=lambda cost: -cost.seconds * cost.runs)[:args.top]:
      print(f"  {cost.seconds * cost.runs * 1e3:8.2f} ms x{cost.runs:<4} {cost.op:<10} "
            f"{cost.source[-90:]}")


if __name__ == "__main__":
  main()
