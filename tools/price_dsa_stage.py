"""The DSA sparse stage alone, compiled by the TPU compiler ahead of time and priced op by op.

  python tools/price_dsa_stage.py --target=v5p:2x2x1 [--batch=2 --seq_len=4096 --impl=xla]
      [--kl_target=pass]   # the KL target as a second pass (sparse_mla_head_mean_probs)
  python tools/price_dsa_stage.py --target=v5p:2x2x1 --impl=pallas   # the Mosaic kernels
  python tools/price_dsa_stage.py --target=v5p:2x2x1 --attention_keys=dense  # every key, causal
  python tools/price_dsa_stage.py --target=v5p:2x2x1 --form=FORM  # every key, with projections
      # FORM: absorbed (sparse_mla_dense), expanded (sparse_mla_dense_expanded, XLA) or
      # expanded_pallas (its TPU kernels)
  python tools/price_dsa_stage.py --target=v5p:2x2x1 --part=indexer_kl [--keys=gather|dense]
      [--query_block=8]

One layer's sparse attention at the per-device shapes of the 744B headline step (GLM-5: 64
heads, C = 512 latent dims, R = 64 RoPE dims, top-2048; batch 2 x 4,096 tokens per device),
as the train step runs it under `remat_policy=full`: the forward (output, log-sum-exp and the
indexer KL's target), recomputed, then the backward; one device of `--target`, no collectives.
Prints the compiler estimate (`glm5_jax.planning.op_costs`: each instruction's
`estimated_cycles`, gathers the compiler leaves unpriced at HBM peak, custom calls from their
`pl.CostEstimate` at `op_costs.KERNEL_EFFICIENCY`) and each kernel's FLOPs, bytes and time at
the chip's peak (a bound): a minutes-long check of a change to the stage, where the whole step
at depth 2 is a 20-minute compile. Needs libtpu (the `tpu-aot` extra).

`--form`: the sparse attention over every key (causal, no KL target) with the projections that
differ between the forms: absorbed, `q_nope W_kb` before and `W_vb` after the attention;
expanded, the per-head keys `c W_kb` and values `c W_vb` before it (what `mla.py` runs for each);
so the forms compare like for like.

`--part=indexer_kl`: the indexer KL on the selection instead (`dsa_kl_fused.
indexer_kl_at_selection`: GLM-5's 32 index heads of dim 128, its query-block loop under its
own checkpoint, forward, remat recompute and backward); `--keys` picks `indexer_scores_at`'s
form, `--query_block` forces its blocks (the default is what it picks for one device's rows).
"""

import argparse
import functools
import gzip
import time

import jax
import jax.numpy as jnp

import pallas_kernels
from glm5_jax.accelerators import ACCELERATORS
from glm5_jax.attention import dsa_kl_fused
from glm5_jax.planning import aot_targets, hlo_loops, hlo_stats, op_costs
from pallas_kernels.blocking import lowering_for


def stage(impl: str, kl_target: str, scale: float, attention_keys: str = "gather",
          query_block: int | None = None):
  """`(inputs, dout) -> (loss, input gradients)` of the sparse stage: sparse MLA and the KL
  target, under `jax.checkpoint` as the layer is under `remat_policy=full` (the loss keeps the
  first forward and the target alive, as the step's later layers and the KL do).
  `attention_keys="dense"`: the sparse MLA over every key (`sparse_mla_dense`, causal, as the
  model runs `dsa_attention_keys="dense"` without context parallelism; `impl` unused;
  `query_block` its blocks, None: its default)."""
  if attention_keys == "dense":
    dense = lambda fn: functools.partial(fn, causal=True, query_block=query_block)
    ops = pallas_kernels.DSAOps(None, dense(pallas_kernels.sparse_mla_dense),
                                dense(pallas_kernels.sparse_mla_dense_with_kl_target))
  else:
    ops = pallas_kernels.dsa_ops(impl, platform="tpu")  # "pallas": the Mosaic kernels

  def forward(q, q_rope, kv, k_rope, topk, dout):
    if kl_target == "fused":  # the target from the attention pass, as the model runs it
      fused = (pallas_kernels.sparse_mla_xla_with_kl_target
               if impl == "xla" and attention_keys == "gather" else ops.sparse_mla_with_probs)
      out, lse, target = fused(q, q_rope, kv, k_rope, topk, scale=scale)
    else:
      out, lse = ops.sparse_mla(q, q_rope, kv, k_rope, topk, scale=scale)
      target = pallas_kernels.sparse_mla_head_mean_probs(q, q_rope, kv, k_rope, topk, lse,
                                                         scale=scale)
    finite_lse = jnp.where(lse > -jnp.inf, lse, 0.0)
    return (jnp.vdot(out.astype(jnp.float32), dout) + jnp.sum(finite_lse)
            + jnp.sum(jax.lax.stop_gradient(target)))

  return jax.value_and_grad(jax.checkpoint(forward), argnums=(0, 1, 2, 3))


def forms_stage(form: str, scale: float):
  """`(q_nope, q_rope, kv, k_rope, topk, dout, w_kb, w_vb) -> (loss, gradients of all but topk
  and dout)`: one layer's attention over every key in `form` (module docstring, `--form`),
  under `jax.checkpoint`."""

  def forward(q_nope, q_rope, kv, k_rope, topk, dout, w_kb, w_vb):
    if form == "absorbed":
      q_latent = jnp.einsum("blhn,chn->blhc", q_nope, w_kb)
      out, lse = pallas_kernels.sparse_mla_dense(q_latent, q_rope, kv, k_rope, topk,
                                                 scale=scale, causal=True)
      out = jnp.einsum("blhc,chv->blhv", out, w_vb)
    else:
      k_nope = jnp.einsum("bsc,chn->bshn", kv, w_kb)
      k = jnp.concatenate(
          [k_nope, jnp.broadcast_to(k_rope[:, :, None], k_nope.shape[:3] + k_rope.shape[-1:])],
          -1)
      v = jnp.einsum("bsc,chv->bshv", kv, w_vb)
      op = (pallas_kernels.sparse_mla_dense_expanded_pallas if form == "expanded_pallas"
            else pallas_kernels.sparse_mla_dense_expanded)
      out, lse = op(jnp.concatenate([q_nope, q_rope], -1), k, v, topk, scale=scale, causal=True)
    return (jnp.vdot(out.astype(jnp.float32), dout)
            + jnp.sum(jnp.where(lse > -jnp.inf, lse, 0.0)))

  return jax.value_and_grad(jax.checkpoint(forward), argnums=(0, 1, 2, 3, 6, 7))


def indexer_kl_stage(index_scale: float, query_block: int | None, keys: str):
  """`(q, k, w, topk, target) -> (KL sum, q / k / w gradients)` of the indexer KL on the
  selection, under `jax.checkpoint` as the layer is under `remat_policy=full`."""

  def forward(q, k, w, topk, target):
    return jnp.sum(dsa_kl_fused.indexer_kl_at_selection(
        q, k, w, topk, target, index_scale=index_scale, query_block=query_block, keys=keys,
        causal=True))  # as the model runs it without context parallelism

  return jax.value_and_grad(jax.checkpoint(forward), argnums=(0, 1, 2))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="v5p:2x2x1")
  parser.add_argument("--impl", default="xla", help="model.dsa_impl: xla, pallas (the TPU "
                      "kernels), reference")
  parser.add_argument("--attention_keys", choices=("gather", "dense"), default="gather",
                      help="model.dsa_attention_keys: dense = the sparse MLA over every key "
                      "(sparse_mla_dense, causal)")
  parser.add_argument("--kl_target", choices=("fused", "pass"), default="fused",
                      help="fused: from the attention pass (sparse_mla_xla_with_kl_target, the "
                      "kernels' sparse_mla_with_probs); pass: sparse_mla_head_mean_probs after it")
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq_len", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=64)
  parser.add_argument("--topk", type=int, default=2048)
  parser.add_argument("--part", choices=("attention", "indexer_kl"), default="attention",
                      help="attention: the sparse MLA (and the KL target); indexer_kl: the "
                      "indexer KL on the selection")
  parser.add_argument("--query_block", type=int, default=None,
                      help="queries per block of --part=indexer_kl, or of --attention_keys=dense "
                      "(default: each op's own)")
  parser.add_argument("--form", choices=("absorbed", "expanded", "expanded_pallas"),
                      default=None, help="the attention over every key in this form, with the "
                      "projections that differ (module docstring); overrides --attention_keys")
  parser.add_argument("--keys", choices=("auto", "gather", "dense"), default="auto",
                      help="--part=indexer_kl: indexer_scores_at's form")
  parser.add_argument("--hlo_out", default=None, help="save the compiled module's text here")
  parser.add_argument("--hlo_in", default=None, help="price this saved module (--hlo_out's, "
                      ".gz or not) instead of compiling; seconds, no libtpu")
  args = parser.parse_args(argv)
  b, l, h, c, r, t = args.batch, args.seq_len, args.heads, 512, 64, args.topk
  if (args.kl_target == "fused" and args.impl != "xla" and args.attention_keys == "gather"
      and pallas_kernels.dsa_ops(args.impl, platform="tpu").sparse_mla_with_probs is None):
    raise SystemExit(f"--kl_target=fused: --impl={args.impl} has no fused target; use pass")
  start = time.perf_counter()
  if args.hlo_in:
    with (gzip.open if args.hlo_in.endswith(".gz") else open)(args.hlo_in, "rt") as f:
      text = f.read()
    print(f"priced {args.hlo_in} (saved, not compiled)")
  else:
    text = compile_stage(args, b, l, h, c, r, t)
    what = (f"the indexer KL (32 index heads x 128), keys {args.keys}, query block "
            f"{args.query_block or 'default'}"
            if args.part == "indexer_kl" else f"every key, {args.form} form, with projections"
            if args.form else
            f"{args.impl}, keys {args.attention_keys}, KL target {args.kl_target}")
    print(f"compiled in {time.perf_counter() - start:.0f} s; {what}, B={b} L={l} H={h} T={t}")
  print_costs(text, args.target)


def compile_stage(args, b, l, h, c, r, t) -> str:
  """The optimized module's text of the stage at these shapes, on one device of --target."""
  device = aot_targets.tpu_devices(args.target)[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  bf16 = jnp.bfloat16
  if args.part == "indexer_kl":  # GLM-5's indexer: J = 32 heads of I = 128, scale I^-0.5
    j, i = 32, 128
    shapes = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in (
        ((b, l, j, i), bf16), ((b, l, i), bf16), ((b, l, j), jnp.float32),
        ((b, l, t), jnp.int32), ((b, l, t), jnp.float32))]
    fn = indexer_kl_stage(i ** -0.5, args.query_block, args.keys)
  elif args.form:  # GLM-5: N = 192, V = 256, scale (N + R)^-0.5
    n, v = 192, 256
    shapes = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in (
        ((b, l, h, n), bf16), ((b, l, h, r), bf16), ((b, l, c), bf16), ((b, l, r), bf16),
        ((b, l, t), jnp.int32), ((b, l, h, v), jnp.float32), ((c, h, n), bf16),
        ((c, h, v), bf16))]
    fn = forms_stage(args.form, (n + r) ** -0.5)
  else:
    shapes = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in (
        ((b, l, h, c), bf16), ((b, l, h, r), bf16), ((b, l, c), bf16), ((b, l, r), bf16),
        ((b, l, t), jnp.int32), ((b, l, h, c), jnp.float32))]
    fn = stage(args.impl, args.kl_target, (192 + 64) ** -0.5,  # GLM-5: (N + R)^-0.5
               args.attention_keys, args.query_block)
  with lowering_for("tpu"):
    compiled = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("tpu",)).compile()
  text = compiled.as_text()
  if args.hlo_out:
    with (gzip.open if args.hlo_out.endswith(".gz") else open)(args.hlo_out, "wt") as f:
      f.write(text)
  return text


def print_costs(text: str, target: str):
  """The module's ops priced (module docstring), by kind, each kernel, the largest ops."""
  module = hlo_loops.parse_module(text)
  chip = ACCELERATORS[aot_targets.parse_target(target)[0]]
  costs = [cost for cost in op_costs.price_module(module, chip) if cost.kind != "torus"]
  total = sum(cost.seconds * cost.runs for cost in costs)
  by_kind = {}
  for cost in costs:
    by_kind[cost.kind] = by_kind.get(cost.kind, 0.0) + cost.seconds * cost.runs
  print(f"one layer's stage priced (forward, recompute, backward): {total * 1e3:.1f} ms "
        "= " + " + ".join(f"{v * 1e3:.1f} {k}" for k, v in by_kind.items()))
  shapes = {i.name: hlo_stats._arrays(i.result_type) for instrs in module.computations.values()
            for i in instrs}
  instrs = {(c, i.name): i for c, found in module.computations.items() for i in found}
  kernels_at_peak = 0.0
  for cost in costs:
    if cost.kind.startswith("kernel"):
      flops, nbytes = op_costs.kernel_work(instrs[cost.computation, cost.name], shapes)
      at_peak = cost.runs * max(flops / chip.peak_flops, nbytes / chip.hbm_bytes_per_s)
      kernels_at_peak += at_peak
      print(f"  kernel {cost.source.split('/')[-2]} x{cost.runs}: {flops * cost.runs:.4g} "
            f"FLOPs, {nbytes * cost.runs:.4g} bytes ({flops / nbytes:.0f} FLOP/B); at peak "
            f"(bound) {at_peak * 1e3:.2f} ms, {cost.kind} {cost.seconds * cost.runs * 1e3:.2f} ms")
  if kernels_at_peak:
    kernels = sum(v for k, v in by_kind.items() if k.startswith("kernel"))
    print(f"  the stage with every kernel at peak instead: "
          f"{(total - kernels + kernels_at_peak) * 1e3:.1f} ms")
  ranked = sorted(costs, key=lambda cost: -cost.seconds * cost.runs)[:14]
  for cost in ranked:
    print(f"  {cost.seconds * cost.runs * 1e3:8.2f} ms x{cost.runs:<5} {cost.kind:<18} "
          f"{cost.op:<10} {cost.source[-90:]}")


if __name__ == "__main__":
  main()
