"""Sharded forward on 8 simulated CPU devices equals the single-device forward."""

import pytest

from glm5_jax.config import ConfigError
from glm5_jax.sharding import mesh_config
from tests.conftest import run_on_host_devices

_SCRIPT = r"""
import json, jax, numpy as np
from configs import tiny
import glm5_jax
from glm5_jax import sharding
from glm5_jax.config import ModelConfig

assert jax.device_count() == 8, jax.devices()
cfg = tiny.get_config()
cfg.mesh.shape.update(data=1, fsdp=2, expert=2, tensor=2)
rules = cfg.mesh.logical_axis_rules
mesh = sharding.make_mesh(cfg.mesh)
params = glm5_jax.init_params(cfg.model, jax.random.key(0))
tokens = jax.random.randint(jax.random.key(1), (4, 64), 0, cfg.model.vocab_size)
model = ModelConfig.from_config(cfg.model)
ref = jax.jit(lambda p, t: glm5_jax.forward(model, p, t))(params, tokens)
shapes, logical_axes = glm5_jax.abstract_params_and_axes(cfg.model)
shardings = sharding.param_shardings(shapes, logical_axes, mesh, rules)
sharded_params = jax.device_put(params, shardings)
sharded_tokens = jax.device_put(tokens, sharding.batch_sharding(mesh, rules))
with sharding.activation_sharding(mesh, rules):
  out = jax.jit(lambda p, t: glm5_jax.forward(model, p, t))(sharded_params, sharded_tokens)
expert_spec = shardings["layers_1_3"]["mlp"]["experts"]["gate_proj"].spec
print(json.dumps({
    "logits": float(np.abs(np.asarray(out["logits"]) - np.asarray(ref["logits"])).max()),
    "mtp": float(np.abs(np.asarray(out["mtp_logits"]) - np.asarray(ref["mtp_logits"])).max()),
    "expert_spec": [str(a) for a in expert_spec],
    "param_devices": len(sharded_params["lm_head"].sharding.device_set),
    "logits_spec": [str(a) for a in out["logits"].sharding.spec],
}))
"""


@pytest.mark.slow  # a subprocess with 8 host devices
def test_sharded_forward_matches_single_device():
  result = run_on_host_devices(_SCRIPT, timeout=600)
  assert result["logits"] < 1e-5, result
  assert result["mtp"] < 1e-5, result
  # [layers, E, D, F]: the scanned run's layers axis stays whole on every device.
  assert result["expert_spec"] == ["None", "expert", str(("fsdp", "context")), "tensor"], result
  assert result["param_devices"] == 8, result
  # The batch stays sharded to the output, over the batch rule's axes (data has size 1).
  assert result["logits_spec"][0] == str(("fsdp", "expert")), result


def test_indivisible_parameter_is_a_clear_error():
  import jax
  from configs import tiny
  import glm5_jax
  from glm5_jax import sharding

  cfg = tiny.get_config()
  devices = jax.devices()[:1]
  mesh = sharding.make_mesh(mesh_config(data=1), devices)
  # Pretend a 3-way tensor axis over a 1-device mesh by asking for a mesh shape it has not.
  with pytest.raises(ConfigError, match="mesh.shape"):
    sharding.make_mesh(mesh_config(data=1, tensor=3), devices)
  three_way_tensor = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 3}
  with pytest.raises(ConfigError, match=r"logical 'heads', size 4\) is not divisible"):
    sharding.param_mesh_specs(*glm5_jax.abstract_params_and_axes(cfg.model), three_way_tensor,
                              [("heads", "tensor")])
  assert mesh.shape == {"data": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1}


@pytest.mark.parametrize("context", [1, 4])
def test_every_matrix_is_sharded_over_fsdp_and_context(helpers, context):
  """Under an fsdp (x context) mesh every parameter with two or more (non-layer) dimensions is
  split over fsdp and context. The MLA and indexer up-projections (`q_b_proj [Q, H, K]`,
  `k_b_proj` / `v_b_proj [C, H, N]`, `wq_b [Q, J, I]`) have no embed dimension and were
  replicated on every device until `q_lora` and `kv_lora` got rules (16.5 GiB of the 744B
  model's 28 GiB of fp32 params per device on fsdp 64 x expert 4: docs/scaling.md). A context
  shard needs every weight, as a data shard does, so params are split over `context` too: a
  long-context layout would otherwise hold `context` copies of params and optimizer state."""
  import jax
  import glm5_jax
  from glm5_jax import sharding

  cfg = helpers.config(attention_pattern="MDRR", first_k_dense_replace=1)
  shapes, logical_axes = glm5_jax.abstract_params_and_axes(cfg)
  mesh_shape = {"data": 1, "fsdp": 2, "context": context, "expert": 1, "tensor": 1}
  specs = sharding.param_mesh_specs(shapes, logical_axes, mesh_shape,
                                    sharding.default_logical_axis_rules())
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  replicated = []
  for (path, spec), logical in zip(jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec),
                                   jax.tree_util.tree_leaves(logical_axes, is_leaf=is_spec)):
    matrix_dims = [a for a in logical if a != "layers"]
    axes = jax.tree_util.tree_leaves(tuple(spec))
    if len(matrix_dims) >= 2 and not {"fsdp", "context"} <= set(axes):
      replicated.append(jax.tree_util.keystr(path))
  assert not replicated, f"replicated over fsdp or context: {replicated}"
  # An activation [B, L, D] keeps D whole: fsdp and context are on B and L.
  activation = sharding.logical_to_mesh_spec(
      jax.sharding.PartitionSpec("batch", "length", "embed"),
      sharding.default_logical_axis_rules())
  assert tuple(activation) == (("data", "fsdp", "expert"), "context", None)


_WHOLE_BATCH_GATHERS = r"""
import json, jax, jax.numpy as jnp
import glm5_jax
from glm5_jax import sharding
from glm5_jax.planning import hlo_stats
from tests.sharded_tiny import abstract_on_mesh
cfg, mesh, model, params = abstract_on_mesh(dict(data=1, fsdp=2, expert=2, tensor=2),
                                            num_hidden_layers=2, mtp_depths=2)
rules = cfg.mesh.logical_axis_rules
B, L = 8, 32
tokens = jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=sharding.batch_sharding(mesh, rules))
def loss(p, t):
  out = glm5_jax.forward(model, p, t)
  return out["mtp_logits"].sum() + out["logits"].sum()
with sharding.activation_sharding(mesh, rules):
  text = jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()
D = cfg.model.hidden_size
whole = [f"{c.dtype}{list(c.shape)}" for c in hlo_stats.collectives(text)
         if c.op == "all-gather" and c.shape == (B, L, D)]
print(json.dumps({"whole_batch_gathers": whole}))
"""


@pytest.mark.slow  # a subprocess with 8 host devices compiling a tiny forward + backward
def test_mtp_embeddings_are_not_gathered_over_the_batch():
  """The MTP inputs, `eh_proj`'s output and the embedding lookup are pinned to the residual
  stream's sharding. Left free, the SPMD partitioner gave them `eh_proj`'s embed (fsdp)
  sharding and, the batch being on fsdp too, all-gathered whole-batch `[B, L, D]` activations
  on every device: 5 x `f32[64, 4096, 6144]` (30 GiB) per device for the 744B model on fsdp 16
  x expert 4 x tensor 4, and 20-odd whole-batch all-gathers in this tiny step (3 remain,
  outside the MTP inputs)."""
  result = run_on_host_devices(_WHOLE_BATCH_GATHERS, timeout=600)
  assert len(result["whole_batch_gathers"]) <= 3, result


_QUERY_KERNEL_GATHERS = r"""
import json, jax, jax.numpy as jnp
import glm5_jax
from glm5_jax import sharding
from glm5_jax.planning import hlo_stats
from tests.sharded_tiny import abstract_on_mesh
B, L = 8, 16
cfg, mesh, model, params = abstract_on_mesh(dict(data=1, fsdp=2, expert=2, tensor=2),
                                            num_hidden_layers=3, scan_layers=True, mtp_depths=0,
                                            remat_policy="save_selections_o_proj")
rules = cfg.mesh.logical_axis_rules
tokens = jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=sharding.batch_sharding(mesh, rules))
loss = lambda p, t: glm5_jax.forward(model, p, t, mtp=False)["logits"].sum()
with sharding.activation_sharding(mesh, rules):
  text = jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()
m = cfg.model
# q_b_proj [Q, H, N + R], gathered over fsdp (Q) to each tensor shard's heads
shape = (m.q_lora_rank, m.num_attention_heads // 2, m.qk_nope_head_dim + m.qk_rope_head_dim)
print(json.dumps({"gathers": sum(c.op == "all-gather" and c.shape == shape
                                 for c in hlo_stats.collectives(text))}))
"""


@pytest.mark.slow  # a subprocess with 8 host devices compiling a tiny forward + backward
def test_the_query_up_projection_is_gathered_once_under_save_selections_o_proj():
  """save_selections_o_proj keeps each layer's query up-projection as gathered over fsdp
  (`q_b_proj_gathered`, `glm5_jax.layers.remat`): the backward's rerun and its input gradient
  use the forward's copy, so each scanned run gathers it once, in the forward's layer loop (two
  runs here: the dense layer's and the MoE layers'). Without it the backward's loop gathers it
  again: 4 here under save_selections (2026-12-03)."""
  result = run_on_host_devices(_QUERY_KERNEL_GATHERS, timeout=600)
  assert result["gathers"] == 2, result


_EXPERT_GATHERS = r"""
import glob, json, os, re, tempfile
dump = tempfile.mkdtemp()
# The partitioner's own output: XLA:CPU later runs bf16 collectives in fp32 (it converts around
# them), so the optimized module would hide the dtype a TPU or GPU all-gather moves.
os.environ["XLA_FLAGS"] += (f" --xla_dump_to={dump}"
                            " --xla_dump_hlo_pass_re=spmd-partitioning")
import jax, jax.numpy as jnp
import glm5_jax
from glm5_jax import sharding
from tests.sharded_tiny import abstract_on_mesh
cfg, mesh, model, params = abstract_on_mesh(
    dict(data=1, fsdp=2, expert=2, tensor=2), num_hidden_layers=2, first_k_dense_replace=1,
    dtype="bfloat16", param_dtype="float32", moe_impl="expert_parallel",
    moe_transport="all_to_all")
rules = cfg.mesh.logical_axis_rules
tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=sharding.batch_sharding(mesh, rules))
with sharding.activation_sharding(mesh, rules):
  jax.jit(lambda p, t: glm5_jax.forward(model, p, t, mtp=False)["logits"]).lower(
      params, tokens).compile()
text = open(glob.glob(f"{dump}/*after_spmd-partitioning*")[0]).read()
# The routed experts' joined gate and up [E, D, 2F] and down, transposed, [E, D, F] kernels,
# local over expert and tensor (E 8 / 2, F 32 / 2), gathered over fsdp (D 64) in the
# expert-parallel shard_map.
gathers = re.findall(r"= (\w+)\[(4,64,32|4,64,16)\]\S* all-gather\(", text)
print(json.dumps({"expert_gathers": gathers}))
"""


@pytest.mark.slow  # a subprocess with 8 host devices compiling a tiny forward
def test_routed_experts_are_gathered_in_the_compute_dtype():
  """fp32 params, bf16 compute: the expert kernels' fsdp all-gather moves bf16. Before the cast
  was pinned to the param's sharding (`layers.params.kernels`), the open-source SPMD partitioner
  gathered the fp32 kernels and cast after the gather: `f32[4,64,16]` x 2 and `f32[4,16,64]`
  here, before gate and up were joined (the TPU compiler's own passes gathered bf16 even then)."""
  result = run_on_host_devices(_EXPERT_GATHERS, timeout=600)
  gathers = result["expert_gathers"]
  assert len(gathers) == 2 and all(dtype == "bf16" for dtype, _ in gathers), result
