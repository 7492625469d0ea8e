"""Expert-parallel MoE (`model.moe_impl="expert_parallel"`) equals the ragged reference.

The 8-device checks run tests/moe_parallel_cases.py in a subprocess (simulated host devices
must be requested before jax initializes); the rest run in-process on one device.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from glm5_jax import sharding
from glm5_jax.config import ConfigError, ModelConfig, model_config
from glm5_jax.moe import MoE
from glm5_jax.planning import hlo_stats
from tests.conftest import REPO_ROOT, host_devices_xla_flags, tiny_model_config


def run_worker(*args):
  env = dict(os.environ, XLA_FLAGS=host_devices_xla_flags(8),
             JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
  proc = subprocess.run([sys.executable, "tests/moe_parallel_cases.py", *args], cwd=REPO_ROOT,
                        env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


CASES = [
    {"mesh": {"data": 1, "expert": 8}},
    # Nearly every token picks experts 3 and 11 (one device holds both pairs' rows), and 15
    # tokens do not divide over 8 devices x 3 dispatch chunks (padding to 24). The production
    # transport, on an exact stand-in of the collective (XLA:CPU cannot compile it) with
    # NaN-filled uninitialized buffers: the combine receives into the used send buffer.
    {"mesh": {"data": 1, "expert": 8}, "bias": "skewed", "batch": [3, 5], "chunks": 3,
     "transport": "ragged_all_to_all"},
    {"mesh": {"data": 1, "expert": 4, "fsdp": 2}, "bias": "skewed"},
    {"mesh": {"data": 2, "expert": 2, "fsdp": 2}, "seed": 1},
    {"mesh": {"data": 1, "expert": 2, "fsdp": 2, "tensor": 2}},  # F split: psum of partials
    # megablox's kernel (interpreted on CPU) under shard_map with check_vma off: the psum over
    # the F shards must still differentiate exactly. On the ragged transport, whose buffers are
    # uninitialized (NaN here): the kernel must leave the rows past its groups out.
    {"mesh": {"data": 1, "expert": 2, "fsdp": 2, "tensor": 2}, "matmul": "megablox",
     "bias": "skewed", "transport": "ragged_all_to_all"},
    # The same for the GPU's Triton gmm / tgmm (interpreted): its pallas_calls too.
    {"mesh": {"data": 1, "expert": 2, "fsdp": 2, "tensor": 2}, "matmul": "triton_gmm",
     "bias": "skewed", "transport": "ragged_all_to_all"},
]


@pytest.mark.slow  # a subprocess with 8 host devices, a compilation or two per case
def test_expert_parallel_equals_ragged_on_8_devices():
  results = run_worker("cases", json.dumps(CASES))
  for case, r in zip(CASES, results):
    assert r["all_to_all_lowered"], (case, r)  # the expert-parallel path ran
    assert r["counts_equal"], (case, r)
    assert r["y"] <= 1e-6 * max(r["y_scale"], 1.0), (case, r)
    assert r["balance"] < 1e-6, (case, r)
    assert r["grad_x"] < 1e-7, (case, r)
    for name, diff in r["grads"].items():
      assert diff < 1e-6, (case, name, r)
  skewed = [r["max_count_share"] for c, r in zip(CASES, results) if c.get("bias")]
  assert min(skewed) == 0.25, skewed  # X=4: a quarter of all pairs on each of the two experts


@pytest.mark.slow  # a subprocess with 8 host devices
def test_tiny_model_loss_and_grads_match_on_a_mesh():
  r = run_worker("model")
  assert r["all_to_all_lowered"], r
  assert r["loss_diff"] < 1e-5, r
  assert r["grad_diff"] < 1e-6, r


@pytest.mark.slow  # a subprocess with 8 host devices
def test_ragged_transport_lowers_but_xla_cpu_cannot_compile_it():
  r = run_worker("ragged_transport")
  # The rows and their router weights out; the backward's: the outputs' cotangents out, the
  # rows' and weights' back. (The forward's exchange back is dead code: the gradient of a sum
  # needs no expert output once the weights scale the rows before the down projection.)
  assert r["ragged_all_to_all"] == 5, r
  assert "ragged-all-to-all" in r["error"] and "XLA:CPU" in r["error"], r


@pytest.mark.slow  # a subprocess with 8 host devices
def test_expert_weights_are_never_all_gathered_across_experts():
  r = run_worker("hlo")
  ep = r["expert_parallel"]
  assert ep["expert_weight_gathers"] == [], r
  assert ep["all_to_alls"] >= 4, r
  # The only weight gathers are over fsdp, of the 16 / 4 local experts, both along D (dim 1:
  # no relayout after the gather): gate and up joined (`[4, D 64, 2 F 64]`), down transposed
  # (`[4, D 64, F 32]`). Gathered inside the shard_map, their gradients are reduce-scattered
  # back to the fsdp shards, never all-reduced whole.
  assert [s for s in ep["all_gathers"] if len(s) == 3] == [[4, 64, 64], [4, 64, 32]], r
  assert ep["weight_reductions"] == [["reduce-scatter", [4, 64, 32]],
                                    ["reduce-scatter", [4, 64, 64]]], r
  # Full remat reruns the count exchange in the backward; save_selections keeps its results.
  assert r["int32 exchanges, remat full"] == {"all_to_all": 2, "all_gather": 2}, r
  assert r["int32 exchanges, remat save_selections"] == {"all_to_all": 1, "all_gather": 1}, r
  # The router weights: out, again in the rerun under full remat, their gradient back.
  assert r["weight exchanges, remat full"] == 3, r
  assert r["weight exchanges, remat save_selections"] == 2, r
  # The shared experts' kernels wait for nothing in flight: forward, rerun, backward.
  assert r["shared kernel barriers, remat save_selections"] == 3, r


@pytest.mark.slow  # a subprocess with 8 host devices, three compilations
def test_quantized_experts_run_expert_parallel_and_equal_the_quantized_dispatch():
  """W4A8 experts (integer sums, exact) through the expert-parallel shard_map equal the
  unsharded quantized dispatch; on expert=8 nothing gathers an expert kernel across experts
  (the TPU compiler all-gathered them all for the global ragged form: docs/quantization.md)."""
  r = run_worker("quantized")
  assert len(r) == 2, r
  for name, row in r.items():
    assert row["y"] <= 1e-6 * row["y_scale"] and row["all_to_all_lowered"], (name, row)
  assert r["w4a8 {'data': 1, 'expert': 8}"]["expert_weight_gathers"] == 0, r


@functools.cache  # one compiled layer per config: the tests below share the reference's
def _moe_apply(cfg):
  return jax.jit(lambda p, x: MoE(cfg).apply({"params": p}, x))


def _moe_outputs(cfg, params, x_BLD):
  return _moe_apply(cfg)(params, x_BLD)


def test_without_a_mesh_or_on_one_device_it_equals_ragged():
  ref_cfg = tiny_model_config(n_routed_experts=8, num_experts_per_tok=3)
  ep_cfg = dataclasses.replace(ref_cfg, moe_impl="expert_parallel", moe_transport="all_to_all")
  x_BLD = jax.random.normal(jax.random.key(0), (2, 5, ref_cfg.hidden_size))
  params = nn.meta.unbox(MoE(ref_cfg).init(jax.random.key(1), x_BLD)["params"])
  ref_y, ref_aux = _moe_outputs(ref_cfg, params, x_BLD)
  no_mesh_y, _ = _moe_outputs(ep_cfg, params, x_BLD)  # no mesh: local dispatch
  np.testing.assert_array_equal(no_mesh_y, ref_y)
  mesh = sharding.make_mesh(sharding.mesh_config(data=1), jax.devices()[:1])
  with sharding.activation_sharding(mesh, sharding.default_logical_axis_rules()):
    y, aux = _moe_outputs(ep_cfg, params, x_BLD)  # shard_map over a 1-device expert axis
    jaxpr = str(jax.make_jaxpr(lambda p, x: MoE(ep_cfg).apply({"params": p}, x))(
        params, x_BLD))
  assert "shard_map" in jaxpr and "all_to_all" in jaxpr  # (lowering elides size-1 axes)
  np.testing.assert_allclose(y, ref_y, atol=1e-6)
  np.testing.assert_array_equal(aux["expert_counts"], ref_aux["expert_counts"])


def test_missing_expert_rule_is_a_clear_error():
  cfg = tiny_model_config(moe_impl="expert_parallel", moe_transport="all_to_all")
  x_BLD = jnp.ones((1, 4, cfg.hidden_size))
  params = nn.meta.unbox(MoE(cfg).init(jax.random.key(0), x_BLD)["params"])
  mesh = sharding.make_mesh(sharding.mesh_config(data=1), jax.devices()[:1])
  with sharding.activation_sharding(mesh, [("batch", "data")]):
    with pytest.raises(ValueError, match="logical axis 'expert' mapped to exactly one mesh"):
      _moe_outputs(cfg, params, x_BLD)


def test_expert_kernels_embed_axes_outside_the_token_axes_is_a_clear_error():
  """The kernels are gathered over their embed axes inside the shard_map, behind a barrier
  with the rows: an embed axis that splits neither the tokens nor F would make the rows vary
  over it (`moe_parallel.expert_parallel_dispatch`)."""
  cfg = tiny_model_config(moe_impl="expert_parallel", moe_transport="all_to_all")
  x_BLD = jnp.ones((1, 4, cfg.hidden_size))
  params = nn.meta.unbox(MoE(cfg).init(jax.random.key(0), x_BLD)["params"])
  mesh = sharding.make_mesh(sharding.mesh_config(data=1), jax.devices()[:1])
  rules = [("batch", "data"), ("expert", "expert"), ("embed", "fsdp")]
  with sharding.activation_sharding(mesh, rules):
    with pytest.raises(ValueError, match=r"embed axes \('fsdp',\) among the token axes"):
      _moe_outputs(cfg, params, x_BLD)


def test_moe_transport_is_validated():
  with pytest.raises(ConfigError, match="model.moe_transport"):
    ModelConfig.from_config(model_config(moe_transport="nccl"))
  with pytest.raises(ConfigError, match="model.moe_matmul"):
    ModelConfig.from_config(model_config(moe_matmul="einsum"))


_HLO = """
ENTRY %main {
  %p = f32[2,64,32]{2,1,0} parameter(0)
  %q = bf16[96,64]{1,0} parameter(1)
  %all-gather = f32[8,64,32]{2,1,0} all-gather(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %all-to-all = (bf16[12,64]{1,0}, bf16[12,64]{1,0}) all-to-all(%q, %q), channel_id=2, replica_groups={{0,1},{2,3}}
  %all-reduce = f32[2,64,32]{2,1,0} all-reduce(%p), channel_id=3, replica_groups={{0},{1}}, to_apply=%add
  %rs = f32[1,64,32]{2,1,0} reduce-scatter(%p), channel_id=4, replica_groups=mesh['a'=2,'b'=4] {'a'}, dimensions={0}
  ROOT %ags = (f32[2,64,32]{2,1,0}, f32[8,64,32]{2,1,0}) all-gather-start(%p), channel_id=5, replica_groups=[2,4]<=[8], dimensions={0}
}
"""


def test_hlo_stats_parses_collectives():
  found = hlo_stats.collectives(_HLO)
  assert [(c.op, c.shape, c.dtype, c.bytes, c.group) for c in found] == [
      ("all-gather", (8, 64, 32), "f32", 8 * 64 * 32 * 4, 4),
      ("all-to-all", (96, 64), "bf16", 2 * 96 * 64 * 2, 2),  # 2 x [12, 64] out, 2 x [96, 64] in
      ("reduce-scatter", (2, 64, 32), "f32", 2 * 64 * 32 * 4, 2),
      ("all-gather", (8, 64, 32), "f32", 8 * 64 * 32 * 4, 4),  # the async start
  ]  # the all-reduce over groups of one device moves nothing and is skipped
  assert hlo_stats.summarize(found)["all-gather"] == (2, 2 * 8 * 64 * 32 * 4)


@pytest.mark.slow  # a subprocess with 8 host devices
def test_capacity_factor_drops_the_pairs_its_rule_names():
  r = run_worker("capacity")
  assert 0.05 < r["dropped"] == pytest.approx(r["expected_dropped"]), r
  assert r["y_diff"] < 1e-5, r
  assert r["big_dropped"] == 0 and r["big_diff"] < 1e-5, r
  # The ragged transport drops the same pairs; their rows (the combine's receive buffer keeps
  # the tokens' inputs there) give no output and no router-weight gradient.
  assert r["ragged_dropped"] == r["dropped"] and r["ragged_y_diff"] < 1e-5, r
  assert max(r["ragged_grad_diffs"]) < 1e-5 and r["dropped_weight_grad"] == 0.0, r
  assert max(r["ref_grad_diffs"]) < 1e-4, r


def test_capacity_factor_is_validated():
  with pytest.raises(ConfigError, match="model.moe_capacity_factor"):
    ModelConfig.from_config(model_config(moe_capacity_factor=1.25))  # moe_impl 'ragged'
  ModelConfig.from_config(model_config(moe_capacity_factor=1.25, moe_impl="expert_parallel"))


def test_dispatch_chunks_are_validated():
  for bad in (0, -2):
    with pytest.raises(ConfigError, match="model.moe_dispatch_chunks"):
      ModelConfig.from_config(model_config(moe_dispatch_chunks=bad))


def test_capacity_on_one_device_drops_nothing_and_reports_it():
  """One expert shard receives at most its own m * X pairs, within any capacity >= 1."""
  ref_cfg = tiny_model_config(n_routed_experts=8, num_experts_per_tok=3)
  cap_cfg = dataclasses.replace(ref_cfg, moe_impl="expert_parallel", moe_transport="all_to_all",
                                moe_capacity_factor=1.0)
  x_BLD = jax.random.normal(jax.random.key(0), (2, 5, ref_cfg.hidden_size))
  params = nn.meta.unbox(MoE(ref_cfg).init(jax.random.key(1), x_BLD)["params"])
  ref_y, _ = _moe_outputs(ref_cfg, params, x_BLD)
  mesh = sharding.make_mesh(sharding.mesh_config(data=1), jax.devices()[:1])
  with sharding.activation_sharding(mesh, sharding.default_logical_axis_rules()):
    y, aux = _moe_outputs(cap_cfg, params, x_BLD)
  np.testing.assert_allclose(y, ref_y, atol=1e-6)
  assert aux["moe_dropped_fraction"].shape == (1,)  # one token shard
  assert float(aux["moe_dropped_fraction"].sum()) == 0.0


def test_dropped_fraction_is_summed_over_shards_once_a_step():
  """Each layer's aux holds the dropped fraction per token shard; the metric sums each layer's
  shards and takes the mean over layers (a scanned run's `[layers, S]`, an MTP depth's `[S]`)."""
  from glm5_jax.train import losses  # pylint: disable=g-import-not-at-top
  out = {"aux": {"layers": {"layers_1_3": {"moe_dropped_fraction": jnp.array(
      [[0.1, 0.2], [0.0, 0.0], [0.3, 0.0]])}, "layers_0_0": {}},
                 "mtp": [{"moe_dropped_fraction": jnp.array([0.05, 0.15])}]}}
  assert float(losses.mean_dropped_fraction(out)) == pytest.approx((0.3 + 0.0 + 0.3 + 0.2) / 4)
  assert float(losses.mean_dropped_fraction({"aux": {"layers": {}, "mtp": []}})) == 0.0


def test_joined_swiglu_equals_jax_forward_and_backward():
  """`_swiglu_joined`'s own VJP: the gradient of `[gate | up]` as jax's of the split halves."""
  from glm5_jax import moe_parallel  # pylint: disable=g-import-not-at-top
  kx, kd = jax.random.split(jax.random.key(3))
  gate_up = 3 * jax.random.normal(kx, (16, 2 * 24))
  dh = jax.random.normal(kd, (16, 24))
  reference = lambda a: jax.nn.silu(a[:, :24]) * a[:, 24:]
  y, vjp = jax.vjp(moe_parallel._swiglu_joined, gate_up)
  y_ref, vjp_ref = jax.vjp(reference, gate_up)
  np.testing.assert_allclose(y, y_ref, rtol=1e-6)
  np.testing.assert_allclose(vjp(dh)[0], vjp_ref(dh)[0], rtol=1e-5, atol=1e-6)


def test_joined_gate_up_puts_each_f_shards_gate_beside_its_up():
  """Split over 2 F shards, each shard of the joined `[E, D, 2F]` is its `[gate | up]`."""
  from glm5_jax import moe_parallel  # pylint: disable=g-import-not-at-top
  gate = jnp.arange(2 * 3 * 8, dtype=jnp.float32).reshape(2, 3, 8)
  up = -gate
  for shard, joined in enumerate(jnp.split(moe_parallel._joined_gate_up(gate, up, 2), 2, -1)):
    np.testing.assert_array_equal(joined, jnp.concatenate(
        [gate[..., 4 * shard:4 * shard + 4], up[..., 4 * shard:4 * shard + 4]], -1))


def _empties_outside_the_scan(anchored: bool) -> int:
  """`empty` allocations the trained forward computes outside a scan of layers that each write
  into one (in place, as the dispatch's ragged all-to-all does)."""
  from glm5_jax import moe_parallel  # pylint: disable=g-import-not-at-top

  def layer(h_BD, w_DD):
    buf = moe_parallel._uninitialized((16, 4), jnp.float32, anchor=h_BD if anchored else None)
    buf = jax.lax.dynamic_update_slice(buf, h_BD @ w_DD, (8, 0))
    return jnp.tanh(buf[8:]) + h_BD, None

  def loss(ws):
    h, _ = jax.lax.scan(jax.checkpoint(layer), jnp.ones((8, 4)), ws)
    return h.sum()

  jaxpr = jax.make_jaxpr(jax.grad(loss))(jnp.ones((3, 4, 4))).jaxpr
  return sum(eqn.primitive.name == "empty" for eqn in jaxpr.eqns)


def test_an_anchored_buffer_is_allocated_in_each_layer_not_hoisted():
  """jax hoists an operand-free `empty` out of the layers' scan, and a write into it in place
  then copies it in every layer (the TPU compiler: 1 ms per dispatch chunk at the 744B
  headline); `_uninitialized(anchor=...)` allocates it in the layer."""
  assert _empties_outside_the_scan(anchored=False) >= 1
  assert _empties_outside_the_scan(anchored=True) == 0
