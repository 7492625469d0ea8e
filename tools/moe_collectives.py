"""The collectives XLA emits for one MoE layer's forward + backward, "ragged" vs "expert_parallel".

Compiles the layer from abstract inputs (`jax.ShapeDtypeStruct` with shardings; nothing is
allocated) on simulated CPU devices and lists the collectives of the optimized HLO
(`glm5_jax.planning.hlo_stats`), with bytes per token. On CPU the expert-parallel layer uses the dense
"all_to_all" transport: XLA:CPU cannot compile `ragged-all-to-all`.

  python tools/moe_collectives.py --devices=8 --mesh=expert=8 --hidden=6144 --ffn=2048 \\
      --experts=256 --topk=8 --batch=8 --seq=128

Measured (jax 0.10.2, XLA:CPU, `--devices=8 --mesh=expert=8 --hidden=6144 --ffn=2048
--experts=256 --topk=8 --batch=8 --seq=64 --batch_axes=data,fsdp,expert`, 64 tokens/device):
"ragged" keeps the expert weights sharded and instead replicates all 4096 global pairs,
all-reducing `[4096, 6144]` four times: 588 MiB per device, 9.6 MB per token, growing with the
global token count. "expert_parallel" (dense all_to_all): four all-to-alls of `8 x [512, 6144]`,
384 MiB per device, 6.3 MB per token, no weight gather; ragged_all_to_all would send only the
512 real rows each way, 1/8 of that (arithmetic: XLA:CPU cannot compile it). XLA:CPU runs bf16
collectives in f32, so TPU/GPU bytes are half these.
"""

import argparse
import os



def compile_moe_layer(model_cfg, mesh, rules, batch: int, seq: int, grad: bool = True,
                      compiled: bool = True) -> str:
  """The optimized HLO text of the MoE layer of `model_cfg` on `mesh`.

  Args:
    model_cfg: a `ModelConfig` (its `moe_impl` / `moe_transport` pick the dispatch, its
      `remat_policy` the layer's `jax.checkpoint` as the model's layers take it).
    grad: forward + backward (gradients w.r.t. params and input, sharded as the params and
      input), else the forward.
    compiled: the compiled module's HLO, else the lowered StableHLO (what jax emits: a remat
      policy's reruns, before XLA's passes).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import linen as nn  # pylint: disable=g-import-not-at-top

  from glm5_jax import sharding  # pylint: disable=g-import-not-at-top
  from glm5_jax.layers.remat import checkpoint_policy  # pylint: disable=g-import-not-at-top
  from glm5_jax.moe import MoE  # pylint: disable=g-import-not-at-top

  module = MoE(model_cfg)
  dtype = jnp.dtype(model_cfg.dtype)
  x_sharding = sharding.batch_sharding(mesh, rules, 3)
  x = jax.ShapeDtypeStruct((batch, seq, model_cfg.hidden_size), dtype, sharding=x_sharding)
  boxed = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros(x.shape, dtype)))
  boxed = boxed["params"]
  shapes = nn.meta.unbox(boxed)
  shardings = sharding.param_shardings(shapes, nn.get_partition_spec(boxed), mesh, rules)
  params = jax.tree_util.tree_map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

  layer = lambda p, x_BLD: module.apply({"params": p}, x_BLD)
  if model_cfg.remat_policy != "none":
    layer = jax.checkpoint(layer, policy=checkpoint_policy(model_cfg.remat_policy))

  def loss(p, x_BLD):  # squared: the backward needs the layer's output, as a next layer would
    y_BLD, aux = layer(p, x_BLD)
    return jnp.square(y_BLD.astype(jnp.float32)).sum() + aux["sequence_balance_loss"]

  if grad:
    fn = jax.jit(jax.grad(loss, argnums=(0, 1)), out_shardings=(shardings, x_sharding))
  else:
    fn = jax.jit(lambda p, x_BLD: module.apply({"params": p}, x_BLD)[0],
                 out_shardings=x_sharding)
  with sharding.activation_sharding(mesh, rules):
    lowered = fn.lower(params, x)
    return lowered.compile().as_text() if compiled else lowered.as_text()


def expert_weight_gathers(found, num_experts: int):
  """The all-gathers whose result has a full expert dimension (`num_experts`) and rank >= 3:
  an expert kernel gathered across the expert axis."""
  return [c for c in found
          if c.op == "all-gather" and any(len(s) >= 3 and num_experts in s for _, s in c.results)]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--mesh", default="expert=8", help="axis=size,... (data fsdp expert tensor)")
  parser.add_argument("--hidden", type=int, default=6144)
  parser.add_argument("--ffn", type=int, default=2048)
  parser.add_argument("--experts", type=int, default=256)
  parser.add_argument("--topk", type=int, default=8)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--batch_axes", default="data,fsdp",
                      help="mesh axes of the logical 'batch' rule")
  parser.add_argument("--impls", default="ragged,expert_parallel")
  args = parser.parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={args.devices}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import dataclasses  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  from glm5_jax import sharding  # pylint: disable=g-import-not-at-top

  from glm5_jax.planning import hlo_stats  # pylint: disable=g-import-not-at-top
  from glm5_jax.config import ModelConfig, model_config  # pylint: disable=g-import-not-at-top

  axes = {k: int(v) for k, v in (item.split("=") for item in args.mesh.split(","))}
  mesh = sharding.make_mesh(sharding.mesh_config(**{"data": 1, **axes}))
  rules = [(name, tuple(args.batch_axes.split(",")) if name == "batch" else target)
           for name, target in sharding.default_logical_axis_rules()]
  base = ModelConfig.from_config(model_config(
      hidden_size=args.hidden, moe_intermediate_size=args.ffn, n_routed_experts=args.experts,
      num_experts_per_tok=args.topk, n_shared_experts=0, dtype=args.dtype,
      param_dtype=args.dtype, moe_transport="all_to_all"))
  tokens = args.batch * args.seq
  per_device = tokens / args.devices  # B/token: a device's bytes over its share of the tokens
  print(f"mesh {dict(mesh.shape)}, batch rule {args.batch_axes}, D={args.hidden} "
        f"F={args.ffn} E={args.experts} X={args.topk}, {tokens} tokens, {args.dtype}, "
        "forward + backward; bytes are per device, summed over the instructions")
  for impl in args.impls.split(","):
    start = time.time()
    try:
      text = compile_moe_layer(dataclasses.replace(base, moe_impl=impl), mesh, rules,
                               args.batch, args.seq)
    except Exception as e:  # pylint: disable=broad-except
      print(f"\n{impl}: does not compile: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
      continue
    found = hlo_stats.collectives(text)
    print(f"\n{impl} (compiled in {time.time() - start:.1f} s): "
          f"{len(expert_weight_gathers(found, args.experts))} expert-weight all-gathers")
    for c in found:
      print(f"  {c.op:20s} {c.dtype}{list(c.shape)} group {c.group}  {c.bytes / 2**20:10.3f} MiB")
    for op, (count, total) in hlo_stats.summarize(found).items():
      print(f"  total {op:20s} x{count:<3d} {total / 2**20:10.3f} MiB  "
            f"{total / per_device:12.1f} B/token")
    total = sum(c.bytes for c in found)
    print(f"  all collectives: {total / 2**20:.3f} MiB per device, "
          f"{total / per_device:.1f} B per token")


if __name__ == "__main__":
  main()
