"""One GLM-5 744B MoE layer (routed experts expert-parallel over ragged_all_to_all, shared
expert, router), forward + backward, compiled ahead of time by the TPU compiler for a TPU slice
(`glm5_jax.planning.aot_targets`; needs the `tpu-aot` extra): per-device memory, matmul FLOPs and
collectives per step, one JSON line. docs/scaling.md ("Making the step fast") has its figures.

  JAX_PLATFORMS=cpu python tools/moe_layer_tpu.py v5p:4x4x4 fsdp=4,expert=16 128 4096 megablox 1.25
  JAX_PLATFORMS=cpu python tools/moe_layer_tpu.py v5p:8x8x16 fsdp=32,expert=32 2048 4096 \
      megablox 1.25 moe_dispatch_chunks=2 "device_layout=expert=x8,y4:2;fsdp=y2,z16" /tmp/l.hlo.gz

argv: target, mesh (axis=size,...), global batch, seq_len, model.moe_matmul,
model.moe_capacity_factor, then any of: `<model field>=<int>` (a model override, such as
`moe_dispatch_chunks=2`), `device_layout=<spec>` (`config.mesh.device_layout`), a path to save the optimized module's text (.gz: gzipped; its mesh
layout beside it, `planner.write_hlo`, so `glm5_jax.planning.step_cost` can price it again).
The JSON line also carries the compiler estimate of the layer's compute by category
(`glm5_jax.planning.op_costs`: each instruction's `estimated_cycles`, megablox at its stated
efficiency; collectives not included), `compute_ms`, and the layer's time three ways
(`glm5_jax.planning.step_cost`: collectives priced on the target's torus; `schedule` is the
compiled schedule's own overlap), `time_ms`.
"""
import json
import sys
import time

import jax
import jax.numpy as jnp
from flax import linen as nn
from glm5_jax import sharding
from glm5_jax.planning import aot_targets, hlo_loops, hlo_stats, planner, step_cost
from glm5_jax.config import ModelConfig
from glm5_jax.moe import MoE
import configs.glm5_744b as c744

target, mesh_s, batch, seq, matmul, cap = sys.argv[1:7]
batch, seq = int(batch), int(seq)
shape = {k: int(v) for k, v in (kv.split("=") for kv in mesh_s.split(","))}
overrides = dict((k, v) for k, v in (a.split("=", 1) for a in sys.argv[7:] if "=" in a))
layout = overrides.pop("device_layout", "")
overrides = {k: int(v) for k, v in overrides.items()}
hlo_path = next((a for a in sys.argv[7:] if "=" not in a), None)
model_cfg = c744.get_config().model
model_cfg.update(moe_impl="expert_parallel", moe_transport="ragged_all_to_all",
                 moe_matmul=matmul, moe_capacity_factor=float(cap), **overrides)
model = ModelConfig.from_config(model_cfg)
mesh_cfg = sharding.mesh_config(**shape)
mesh_cfg.device_layout = layout
mesh = sharding.make_mesh(mesh_cfg, aot_targets.tpu_devices(target))
rules = sharding.default_logical_axis_rules()


class Layer(nn.Module):
  """The MoE under the name the decoder gives it (`mlp`), so that its instructions' op_names fall
  in the cost model's categories (`op_costs.CATEGORY_RULES`) as in the whole step."""

  model: ModelConfig

  @nn.compact
  def __call__(self, x_BLD):
    return MoE(self.model, name="mlp")(x_BLD)


module = Layer(model)
dtype = jnp.dtype(model.dtype)
x_sh = sharding.batch_sharding(mesh, rules, 3)
x = jax.ShapeDtypeStruct((batch, seq, model.hidden_size), dtype, sharding=x_sh)
boxed = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros(x.shape, dtype)))["params"]
shapes = nn.meta.unbox(boxed)
shs = sharding.param_shardings(shapes, nn.get_partition_spec(boxed), mesh, rules)
params = jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shs)
def loss(p, x_BLD):
  y, aux = module.apply({"params": p}, x_BLD)
  return y.astype(jnp.float32).sum() + aux["sequence_balance_loss"]
fn = jax.jit(jax.grad(loss, argnums=(0, 1)), out_shardings=(shs, x_sh))
t = time.time()
with planner._backend_seen_by_model("tpu"), sharding.activation_sharding(mesh, rules):
  compiled = fn.lower(params, x).compile()
text = compiled.as_text()
mem = compiled.memory_analysis()
if hlo_path:
  planner.write_hlo(text, mesh, hlo_path)
module = hlo_loops.parse_module(text)
report = step_cost.price_module(module, target, planner.mesh_layout(mesh), batch * seq / mesh.size,
                                None)
found = hlo_stats.step_collectives(text, dict(mesh.shape))
print(json.dumps({"target": target, "mesh": shape, "batch": batch, "seq": seq, "matmul": matmul,
  "capacity": float(cap), "overrides": overrides, "tokens_per_chip": batch * seq / mesh.size,
  "compile_s": round(time.time() - t, 1),
  "time_ms": {k: round(v * 1e3, 2) for k, v in report.times.items()},
  "temp_GiB": mem.temp_size_in_bytes / 2**30, "argument_GiB": mem.argument_size_in_bytes / 2**30,
  "compute_ms": {k: round(v * 1e3, 2) for k, v in report.compute_by_category.items()},
  "flops": hlo_stats.step_dot_flops(text), "convolutions": text.count(" convolution("),
  "collectives_GiB": {k: round(v["bytes"] / 2**30, 3) for k, v in hlo_stats.summarize_step(found, "op").items()}}))
