"""The optimizer (docs/reference.md section 3, "Muon Split"): per-head / per-expert
orthogonalization, consistent-RMS scaling, the Muon/AdamW partition of every tiny-model param,
frozen leaves, schedule, clipping, the three variants, and parity with `optax.contrib.muon`.

Notation: Q q latent, H heads, K head dim, E experts, D hidden, F expert intermediate.
"""

import dataclasses
import functools
import importlib.util
import pathlib

import jax
import jax.extend
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers, scale_by_muon

import glm5_jax
from glm5_jax import layer_runs
from glm5_jax.config import ConfigError
from glm5_jax.layer_runs import is_run_name
from glm5_jax.optim import (
    UnknownParamError, build_optimizer, muon_dimension_numbers, optim_config, param_labels,
    validate_optim_config, weight_decay_mask)
from glm5_jax.optim import ns_precision
from glm5_jax.optim.muon_split import (
    ADAM, FROZEN, HEADS_IN, HEADS_OUT, MATRIX, MUON, PER_EXPERT, PER_HEAD, path_names)

# Newton-Schulz with GLM's coefficients (3.4445, -4.7750, 2.0315) does not converge to exactly 1:
# over 20 random 32x16 per-head/per-expert slices, 5 steps give singular values in [0.68, 1.13]
# (square matrices can keep a much smaller one, so the test shapes are 2:1).
SV_BAND = (0.6, 1.25)
Q, H, K = 32, 4, 16
E, D, F = 4, 32, 16


def exact_cfg(**overrides):
  """No warmup, constant LR 1, no decay/clipping/momentum unless overridden; consistent_rms None
  leaves only the width scaling sqrt(max(1, fan_out / fan_in)), which is 1 for [in >= out]
  slices: one update is exactly minus the orthogonalized gradient."""
  base = dict(learning_rate=1.0, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0,
              grad_clip_norm=0.0, momentum=0.0, consistent_rms=None)
  return optim_config(**{**base, **overrides})


def one_update(cfg, params, grads, trainable=None):
  tx, _ = build_optimizer(cfg, params, total_steps=10, trainable=trainable)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  return updates


def singular_values(m):
  return np.linalg.svd(np.asarray(m, np.float64), compute_uv=False)


def lopsided_gradient(shape, axis, seed=0):
  """Random gradient whose slice 0 along `axis` is x1000 and slice 1 is x1e-3."""
  g = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  index = [slice(None)] * len(shape)
  index[axis] = 0
  g[tuple(index)] *= 1000.0
  index[axis] = 1
  g[tuple(index)] *= 1e-3
  return jnp.asarray(g)


TINY_CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.py"


@functools.lru_cache(maxsize=None)
def tiny_abstract(arg=None, **model_overrides):
  """Abstract params of `configs/tiny.py:arg` with model overrides, in the unrolled layout
  (`layers_{i}`, as the partition table below names them) unless `scan_layers=True`."""
  model_overrides.setdefault("scan_layers", False)
  spec = importlib.util.spec_from_file_location("configs_tiny_optim", TINY_CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  config.model.update(model_overrides)
  return glm5_jax.abstract_params(config.model)


@pytest.fixture(scope="module")
def tiny(helpers):
  """`(abstract params, random params)` of configs/tiny.py as shipped (DSA + MoE + MTP)."""
  abstract = tiny_abstract()
  return abstract, helpers.random_tree(abstract, seed=0)


def named_leaves(tree, is_leaf=None):
  """`{"a/b/c": leaf}`."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  return {"/".join(path_names(path)): leaf for path, leaf in flat}


def random_grads(params, seed=1, scale=1.0):
  leaves, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(treedef, [
      jnp.asarray(scale * rng.standard_normal(x.shape), jnp.float32) for x in leaves])


# ---------------------------------------------------------------------------------------------
# 1. Orthogonalization per head / per expert
# ---------------------------------------------------------------------------------------------


def test_muon_split_orthogonalizes_each_head_alone():
  """Head slices of a q_b_proj gradient scaled x1000 and x1e-3 all come out with singular
  values ~1 under Muon Split; whole-matrix Muon lets the big head swamp the small one."""
  params = {"self_attn": {"q_b_proj": jnp.zeros((Q, H, K))}}
  grads = {"self_attn": {"q_b_proj": lopsided_gradient((Q, H, K), axis=1)}}

  split = one_update(exact_cfg(name="muon_split"), params, grads)["self_attn"]["q_b_proj"]
  for h in range(H):
    sv = singular_values(split[:, h, :])
    assert SV_BAND[0] < sv.min() and sv.max() < SV_BAND[1], (h, sv)

  whole = one_update(exact_cfg(name="muon"), params, grads)["self_attn"]["q_b_proj"]
  assert singular_values(whole[:, 1, :]).max() < 1e-3  # the x1e-3 head barely moves
  assert singular_values(whole[:, 0, :]).min() > 0.5


@pytest.mark.parametrize("name", ["muon_split", "muon"])
def test_experts_are_orthogonalized_one_by_one(name):
  """Experts `[E, D, F]` are separate matrices under both Muon variants."""
  params = {"mlp": {"experts": {"gate_proj": jnp.zeros((E, D, F)),
                                "down_proj": jnp.zeros((E, F, D))}}}
  grads = {"mlp": {"experts": {"gate_proj": lopsided_gradient((E, D, F), axis=0),
                               "down_proj": lopsided_gradient((E, F, D), axis=0, seed=1)}}}
  updates = one_update(exact_cfg(name=name), params, grads)["mlp"]["experts"]
  for kernel in ("gate_proj", "down_proj"):
    for e in range(E):
      sv = singular_values(updates[kernel][e])
      # width scaling sqrt(max(1, fan_out / fan_in)) = sqrt(2) for down_proj [F=16, D=32]
      sv = sv / (np.sqrt(2.0) if kernel == "down_proj" else 1.0)
      assert SV_BAND[0] < sv.min() and sv.max() < SV_BAND[1], (kernel, e, sv)

  # The same gradient as one [E * D, F] matrix: the x1e-3 expert's slice is tiny.
  whole = scale_by_muon(beta=0.0, weight_dimension_numbers={
      "w": MuonDimensionNumbers(reduction_axis=(0, 1), output_axis=2)})
  g = {"w": grads["mlp"]["experts"]["gate_proj"]}
  out, _ = whole.update(g, whole.init(g))
  assert singular_values(out["w"][1]).max() < 1e-3


def test_consistent_rms_matches_adamw_scale(tiny):
  """`consistent_rms=0.2`: every Muon slice's update has RMS ~0.2 * lr, whatever its shape
  (Moonlight). Newton-Schulz leaves singular values in ~[0.68, 1.13], so measured 0.16-0.21."""
  abstract, params = tiny
  lr = 0.5
  updates = one_update(exact_cfg(consistent_rms=0.2, learning_rate=lr), params,
                       random_grads(params))
  dims = named_leaves(muon_dimension_numbers(abstract),
                      is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
  updates = named_leaves(updates)
  checked = 0
  for path, d in dims.items():
    if d is None:
      continue
    u = np.asarray(updates[path])
    batch = [a for a in range(u.ndim) if a not in np.atleast_1d(d.reduction_axis)
             and a not in np.atleast_1d(d.output_axis)]
    for index in np.ndindex(*[u.shape[a] for a in batch]):
      sl = [slice(None)] * u.ndim
      for a, i in zip(batch, index):
        sl[a] = i
      rms = np.sqrt(np.mean(u[tuple(sl)] ** 2)) / lr
      assert 0.15 < rms < 0.23, (path, index, rms)
      checked += 1
  assert checked > 50


# ---------------------------------------------------------------------------------------------
# 2. The partition
# ---------------------------------------------------------------------------------------------

EXPECTED_DIMS = {  # path: (muon_split, muon)
    "layers_1/self_attn/q_b_proj": (PER_HEAD, HEADS_OUT),
    "layers_1/self_attn/k_b_proj": (PER_HEAD, HEADS_OUT),
    "layers_1/self_attn/v_b_proj": (PER_HEAD, HEADS_OUT),
    "mtp/layer/self_attn/v_b_proj": (PER_HEAD, HEADS_OUT),
    "layers_1/self_attn/o_proj": (HEADS_IN, HEADS_IN),
    "layers_1/self_attn/q_a_proj": (MATRIX, MATRIX),
    "layers_1/self_attn/kv_a_proj_with_mqa": (MATRIX, MATRIX),
    "layers_1/self_attn/indexer/wq_b": (HEADS_OUT, HEADS_OUT),
    "layers_1/self_attn/indexer/wk": (MATRIX, MATRIX),
    "layers_1/self_attn/indexer/weights_proj": (MATRIX, MATRIX),
    "layers_0/mlp/gate_proj": (MATRIX, MATRIX),
    "layers_0/mlp/down_proj": (MATRIX, MATRIX),
    "layers_1/mlp/gate": (MATRIX, MATRIX),
    "layers_1/mlp/shared_experts/up_proj": (MATRIX, MATRIX),
    "layers_1/mlp/experts/gate_proj": (PER_EXPERT, PER_EXPERT),
    "layers_1/mlp/experts/down_proj": (PER_EXPERT, PER_EXPERT),
    "mtp/eh_proj": (MATRIX, MATRIX),
    "embed_tokens": (None, None),
    "lm_head": (None, None),
    "norm/scale": (None, None),
    "mtp/enorm/scale": (None, None),
    "layers_1/input_layernorm/scale": (None, None),
    "layers_1/self_attn/q_a_layernorm/scale": (None, None),
    "layers_1/self_attn/indexer/k_norm/bias": (None, None),
    "layers_1/mlp/e_score_correction_bias": (None, None),
}
EXPECTED_GQA_DIMS = {
    "layers_1/self_attn/q_proj": HEADS_OUT,
    "layers_1/self_attn/k_proj": HEADS_OUT,
    "layers_1/self_attn/v_proj": HEADS_OUT,
    "layers_1/self_attn/o_proj": HEADS_IN,
}
DECAYED = {"lm_head": True, "embed_tokens": False, "norm/scale": False,
           "layers_1/self_attn/q_b_proj": True, "layers_1/mlp/experts/up_proj": True,
           "layers_1/mlp/e_score_correction_bias": False}


def dims_by_path(abstract, split):
  return named_leaves(muon_dimension_numbers(abstract, split=split),
                      is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("arg,overrides", [
    (None, {}), ("attention=G", {}), ("attention=M", {}), ("attention=DRMG", {}),
    ("attention=DRRR", {}), (None, {"attention_bias": True, "num_nextn_predict_layers": 0,
                                    "mtp_depths": 0})])
def test_every_tiny_param_gets_a_decision(arg, overrides, scan_layers):
  abstract = tiny_abstract(arg, **overrides, scan_layers=scan_layers)
  shapes = named_leaves(abstract)
  for split in (True, False):
    dims = dims_by_path(abstract, split)
    assert dims.keys() == shapes.keys()
    for path, d in dims.items():
      # AdamW exactly for embeddings, LM head and vectors; Muon for every other matrix (a
      # scanned run's leaves have one more, leading, layers axis).
      layer_rank = len(shapes[path].shape) - is_run_name(path.split("/")[0])
      expect_adam = path in ("embed_tokens", "lm_head") or layer_rank <= 1
      assert (d is None) == expect_adam, (path, d)
  labels = named_leaves(param_labels(abstract, "muon_split"))
  for path, label in labels.items():
    expected = (FROZEN if path.endswith("e_score_correction_bias") else
                ADAM if dims_by_path(abstract, True)[path] is None else MUON)
    assert label == expected, path
  assert set(named_leaves(param_labels(abstract, "adamw")).values()) == {ADAM, FROZEN}
  if overrides.get("attention_bias") and not scan_layers:
    assert dims_by_path(abstract, True)["layers_1/self_attn/o_proj_bias"] is None
    assert not weight_decay_mask(abstract)["layers_1"]["self_attn"]["q_a_proj_bias"]


def test_partition_table(tiny):
  abstract, _ = tiny
  split, whole = dims_by_path(abstract, True), dims_by_path(abstract, False)
  for path, (want_split, want_whole) in EXPECTED_DIMS.items():
    assert split[path] == want_split, path
    assert whole[path] == want_whole, path
  gqa = dims_by_path(tiny_abstract("attention=G"), True)
  for path, want in EXPECTED_GQA_DIMS.items():
    assert gqa[path] == want, path
  decay = named_leaves(weight_decay_mask(abstract))
  for path, want in DECAYED.items():
    assert decay[path] == want, path


@pytest.mark.parametrize("name", ["muon_split", "muon"])
def test_scanned_layers_update_each_layer_as_unrolled(helpers, name):
  """A scanned run's `[layers, ...]` kernels get, layer by layer, exactly the update of the same
  kernels in the unrolled layout: the layers axis is a Muon batch axis, never part of a matrix
  (and never mixed into another layer's orthogonalization)."""
  cfg = helpers.config(attention_pattern="DDRR", scan_layers=False, dtype="float32")
  scanned_cfg = dataclasses.replace(cfg, scan_layers=True)
  params = helpers.random_params(cfg)
  grads = random_grads(params)
  opt = optim_config(name=name, warmup_steps=0, weight_decay=0.1)
  unrolled = one_update(opt, params, grads)
  scanned = one_update(opt, layer_runs.stack_layers(params, scanned_cfg),
                       layer_runs.stack_layers(grads, scanned_cfg))
  want = named_leaves(layer_runs.stack_layers(unrolled, scanned_cfg))
  got = named_leaves(scanned)
  assert got.keys() == want.keys()
  assert any(is_run_name(path.split("/")[0]) and got[path].shape[0] > 1 for path in got)
  for path in got:
    np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-6, err_msg=path)


@pytest.mark.parametrize("params,message", [
    ({"self_attn": {"q_c_proj": jnp.zeros((4, 4))}}, "self_attn/q_c_proj"),
    ({"layers_0": {"attn": {"wk": jnp.zeros((4, 4))}}}, "layers_0/attn/wk"),  # wk outside indexer
    ({"self_attn": {"q_b_proj": jnp.zeros((4, 8))}}, "rank 3"),  # a 2-D q_b_proj: layout changed
])
def test_unknown_param_raises_naming_the_path(params, message):
  with pytest.raises(UnknownParamError, match=message):
    muon_dimension_numbers(params)
  with pytest.raises(UnknownParamError, match=message):
    build_optimizer(optim_config(name="adamw", warmup_steps=0), params, total_steps=10)


# ---------------------------------------------------------------------------------------------
# 3. Frozen leaves, clipping, schedule
# ---------------------------------------------------------------------------------------------


def run_steps(tx, params, grads_per_step):
  step = jax.jit(tx.update)
  state = tx.init(params)
  for grads in grads_per_step:
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def indexer_only(params):
  """The DSA warm-up's trainable tree: the indexers only."""
  return jax.tree_util.tree_map_with_path(lambda path, _: "indexer" in path_names(path), params)


@pytest.mark.parametrize("name", ["muon_split", "adamw"])
def test_frozen_leaves_get_exactly_zero_updates(tiny, name):
  """DSA warm-up: only the indexers train; with weight decay on, big gradients everywhere and
  several steps, every other leaf (and the router bias always) is bit-identical."""
  abstract, params = tiny
  trainable = indexer_only(params)
  cfg = optim_config(name=name, learning_rate=1e-2, warmup_steps=1, weight_decay=0.5)
  tx, _ = build_optimizer(cfg, abstract, total_steps=10, trainable=trainable)
  new, state = run_steps(tx, params, [random_grads(params, seed=s, scale=10.0) for s in range(3)])

  flags = named_leaves(trainable)
  old_leaves, new_leaves = named_leaves(params), named_leaves(new)
  for path, flag in flags.items():
    moved = not np.array_equal(old_leaves[path], new_leaves[path])
    assert moved == flag, path
  assert any(flags.values())

  # No optimizer state for frozen leaves: one moment per trainable Muon leaf, two per AdamW leaf,
  # plus the Muon group's Newton-Schulz coefficients (3 numbers).
  labels = named_leaves(param_labels(abstract, name, trainable))
  sizes = {path: x.size for path, x in old_leaves.items()}
  expected = sum(sizes[p] * (1 if l == MUON else 2) for p, l in labels.items() if l != FROZEN)
  expected += 3 if MUON in labels.values() else 0
  state_size = sum(x.size for x in jax.tree.leaves(state) if x.ndim >= 1)
  assert state_size == expected


@pytest.mark.parametrize("name", ["muon_split", "adamw"])
def test_clipping_by_global_norm_of_trainable_grads(name):
  """clip=1 on gradients G gives the same updates as clip=0 on G / max(1, |G_trainable|); a
  frozen leaf's huge gradient does not enter the norm. Momentum mixes two steps of different
  norms, so clipping changes the result."""
  params = {"mlp": {"gate_proj": jnp.ones((8, 6)), "e_score_correction_bias": jnp.zeros(6)},
            "norm": {"scale": jnp.ones(8)}, "frozen": {"up_proj": jnp.ones((8, 6))}}
  trainable = {"mlp": True, "norm": True, "frozen": False}
  grads = [random_grads(params, seed=1, scale=100.0), random_grads(params, seed=2, scale=0.01)]
  for g in grads:
    g["frozen"]["up_proj"] = g["frozen"]["up_proj"] * 1e6
    g["mlp"]["e_score_correction_bias"] = g["mlp"]["e_score_correction_bias"] * 1e6

  def clipped(g):
    norm = optax.tree.norm([g["mlp"]["gate_proj"], g["norm"]["scale"]])
    return jax.tree.map(lambda x: x / jnp.maximum(1.0, norm), g)

  cfg = dict(name=name, warmup_steps=0, learning_rate=0.1, momentum=0.9, weight_decay=0.0)
  with_clip, _ = build_optimizer(optim_config(grad_clip_norm=1.0, **cfg), params,
                                 total_steps=10, trainable=trainable)
  no_clip, _ = build_optimizer(optim_config(grad_clip_norm=0.0, **cfg), params,
                               total_steps=10, trainable=trainable)
  a, _ = run_steps(with_clip, params, grads)
  b, _ = run_steps(no_clip, params, [clipped(g) for g in grads])
  c, _ = run_steps(no_clip, params, grads)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  assert not np.allclose(a["mlp"]["gate_proj"], c["mlp"]["gate_proj"], atol=1e-4)


def test_schedule_warmup_then_cosine():
  peak, warmup, total, ratio = 3e-3, 10, 110, 0.1
  _, schedule = build_optimizer(
      optim_config(learning_rate=peak, warmup_steps=warmup, min_lr_ratio=ratio),
      {"w": {"gate_proj": jnp.zeros((4, 4))}}, total_steps=total)
  lr = lambda step: float(schedule(step))
  assert lr(0) == 0.0
  np.testing.assert_allclose([lr(5), lr(10)], [peak / 2, peak], rtol=1e-5)
  np.testing.assert_allclose(lr(60), peak * (ratio + (1 - ratio) / 2), rtol=1e-5)  # cosine mid
  np.testing.assert_allclose([lr(110), lr(500)], [peak * ratio] * 2, rtol=1e-5)
  values = [lr(s) for s in range(10, 111)]
  assert all(a >= b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("adam_lr,expected", [(None, 1.0), (0.0, 1.0), (0.01, 0.01)])
def test_adam_learning_rate(adam_lr, expected):
  """The AdamW group's first step is -adam_lr * sign(g) (bias-corrected Adam, no warmup)."""
  params = {"embed_tokens": jnp.zeros((6, 4)), "mlp": {"gate_proj": jnp.zeros((4, 4))}}
  grads = random_grads(params)
  updates = one_update(exact_cfg(adam_learning_rate=adam_lr, eps=1e-12), params, grads)
  np.testing.assert_allclose(updates["embed_tokens"], -expected * np.sign(grads["embed_tokens"]),
                             rtol=1e-5)


@pytest.mark.parametrize("overrides,field", [
    (dict(name="sgd"), "optim.name"), (dict(warmup_steps=10), "optim.warmup_steps"),
    (dict(min_lr_ratio=2.0), "optim.min_lr_ratio"), (dict(learning_rate=0.0), "learning_rate"),
    (dict(ns_coeffs=(1.0, 2.0)), "optim.ns_coeffs"), (dict(nesterov=1), "optim.nesterov"),
    (dict(lerning_rate=1e-3), "optim.lerning_rate: unknown field .did you mean 'learning_rate'"),
    (dict(ns_dtype="float16"), "optim.ns_dtype")])
def test_bad_config_names_field(overrides, field):
  # A ConfigDict built from a dict, as from JSON: no type coercion from the defaults.
  config = ml_collections.ConfigDict({**optim_config(warmup_steps=0).to_dict(), **overrides})
  with pytest.raises(ConfigError, match=field):
    validate_optim_config(config, total_steps=10)


# ---------------------------------------------------------------------------------------------
# 4. Variants, parity with optax.contrib.muon
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["muon_split", "muon", "adamw"])
def test_variants_build_and_step(tiny, name):
  """Each variant steps the whole tiny model; everything moves except the MoE router's
  loss-free-balancing bias, which gradients never touch (trainable=None)."""
  abstract, params = tiny
  tx, schedule = build_optimizer(optim_config(name=name, warmup_steps=1), abstract,
                                 total_steps=5)
  new, state = run_steps(tx, params, [random_grads(params, seed=s) for s in range(3)])
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(new))
  old_leaves, new_leaves = named_leaves(params), named_leaves(new)
  for path in old_leaves:
    unchanged = np.array_equal(old_leaves[path], new_leaves[path])
    assert unchanged == path.endswith("e_score_correction_bias"), path
  has_muon_state = any(isinstance(s, optax.contrib.MuonState)
                       for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(
                           s, optax.contrib.MuonState)))
  assert has_muon_state == (name != "adamw")
  assert float(schedule(1)) == pytest.approx(3e-3)


LAYOUTS = {  # one leaf of each Muon layout, plus AdamW leaves
    "self_attn": {"q_b_proj": (Q, H, K), "o_proj": (H, K, D), "q_a_proj": (D, Q),
                  "indexer": {"wq_b": (Q, 2, 8)}, "q_a_layernorm": {"scale": (Q,)}},
    "mlp": {"experts": {"up_proj": (E, D, F)}, "gate": (D, E), "down_proj": (F, D)},
    "embed_tokens": (12, D),
}


@pytest.mark.parametrize("name", ["muon_split", "muon"])
def test_muon_group_matches_optax_contrib_muon(helpers, name):
  """Our Muon group (scale_by_muon + own shape scaling + decay + LR) equals optax.contrib.muon
  with the same dimension numbers, over 3 steps with momentum, Nesterov and weight decay."""
  abstract = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32), LAYOUTS,
                          is_leaf=lambda x: isinstance(x, tuple))
  params = helpers.random_tree(abstract, seed=0)
  hyper = dict(learning_rate=0.02, momentum=0.9, weight_decay=0.1, consistent_rms=0.2)
  ours, _ = build_optimizer(optim_config(name=name, warmup_steps=0, min_lr_ratio=1.0,
                                         grad_clip_norm=0.0, **hyper), abstract, total_steps=10)
  reference = optax.contrib.muon(
      learning_rate=hyper["learning_rate"], beta=hyper["momentum"],
      weight_decay=hyper["weight_decay"], consistent_rms=hyper["consistent_rms"],
      muon_weight_dimension_numbers=muon_dimension_numbers(abstract, split=name == "muon_split"))
  grads = [random_grads(params, seed=s) for s in range(3)]
  a, _ = run_steps(ours, params, grads)
  b, _ = run_steps(reference, params, grads)
  labels = named_leaves(param_labels(abstract, name))
  a, b = named_leaves(a), named_leaves(b)
  for path, label in labels.items():
    if label == MUON:
      np.testing.assert_allclose(a[path], b[path], rtol=1e-5, atol=1e-6, err_msg=path)


def test_bf16_newton_schulz_is_close_to_fp32_with_bf16_matmuls_and_the_same_state(helpers):
  """`optim.ns_dtype` bfloat16 (`optim.ns_precision`): the two-stage form equals optax's
  `scale_by_muon` in fp32; in bf16, over 3 steps with momentum, each Muon param's total move is
  within bf16 NS rounding of the fp32 one (plain optax NS of random 32x16-256x128 matrices in
  bf16 vs fp32: 4-7% relative, measured), every NS dot takes bf16 operands, and the state is
  the fp32 run's `MuonState` in structure and dtypes (momentum fp32)."""
  dims = {"w": MuonDimensionNumbers(0, 1)}
  kw = dict(ns_coeffs=(3.4445, -4.7750, 2.0315), ns_steps=5, beta=0.9, nesterov=True,
            weight_dimension_numbers=dims)
  small = {"w": jnp.zeros((32, 16))}
  steps = [{"w": jax.random.normal(jax.random.key(s), (32, 16))} for s in range(3)]
  np.testing.assert_allclose(run_steps(ns_precision.two_stage_muon(jnp.float32, **kw), small,
                                       steps)[0]["w"],
                             run_steps(scale_by_muon(**kw), small, steps)[0]["w"], atol=3e-6)

  abstract = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32), LAYOUTS,
                          is_leaf=lambda x: isinstance(x, tuple))
  params = helpers.random_tree(abstract, seed=0)
  grads = [random_grads(params, seed=s) for s in range(3)]
  run = {}
  for dtype in ("float32", "bfloat16"):
    tx, _ = build_optimizer(optim_config(warmup_steps=0, min_lr_ratio=1.0, grad_clip_norm=0.0,
                                         ns_dtype=dtype), abstract, total_steps=10)
    run[dtype] = run_steps(tx, params, grads) + (tx,)
  (p32, s32, _), (p16, s16, tx16) = run["float32"], run["bfloat16"]
  assert jax.tree.structure(s32) == jax.tree.structure(s16)
  assert [a.dtype for a in jax.tree.leaves(s32)] == [b.dtype for b in jax.tree.leaves(s16)]
  labels = named_leaves(param_labels(abstract, "muon_split"))
  a, b, p0 = named_leaves(p32), named_leaves(p16), named_leaves(params)
  for path, label in labels.items():
    if label == MUON:
      move32, move16 = np.asarray(a[path]) - p0[path], np.asarray(b[path]) - p0[path]
      error = np.linalg.norm(move16 - move32) / np.linalg.norm(move32)
      assert error < 0.1, (path, error)
  dots = executed_dot_dtypes(jax.make_jaxpr(tx16.update)(grads[0], tx16.init(params),
                                                          params).jaxpr)
  assert dots and set(dots) == {jnp.dtype(jnp.bfloat16)}, dots


def executed_dot_dtypes(jaxpr):
  """Operand dtypes of the `dot_general`s `jaxpr` runs, through nested jaxprs; a zero-length
  scan runs nothing (the fp32 momentum stage's `ns_steps=0` loop)."""
  dtypes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      dtypes.append(eqn.invars[0].aval.dtype)
    if eqn.primitive.name == "scan" and eqn.params["length"] == 0:
      continue
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      dtypes += executed_dot_dtypes(sub)
  return dtypes


_SHARDED_MUON = r"""
import json, jax, jax.numpy as jnp, numpy as np
from configs import tiny
import glm5_jax
from glm5_jax import optim, sharding
from glm5_jax.planning import hlo_stats
from glm5_jax.optim import optim_config

def program(mtp: bool, layer_moves: bool):
  cfg = tiny.get_config()
  cfg.model.update(attention_pattern="DD", num_hidden_layers=2, first_k_dense_replace=0,
                   n_routed_experts=8, scan_layers=True, dtype="float32")
  if not mtp:
    cfg.model.update(num_nextn_predict_layers=0, mtp_depths=0)
  cfg.mesh.shape.update(data=1, fsdp=4, expert=2, tensor=1)
  rules = cfg.mesh.logical_axis_rules
  mesh = sharding.make_mesh(cfg.mesh)
  shapes, axes = glm5_jax.abstract_params_and_axes(cfg.model)
  # Params and grads from numpy: a jitted init and a jax.random draw per leaf shape were ~20 s
  # of compiles here, and the updates compared below do not depend on how they were drawn.
  rng = np.random.default_rng(0)
  draw = lambda std: jax.tree.map(
      lambda x: jnp.asarray(std * rng.standard_normal(x.shape), x.dtype), shapes)
  params, grads = draw(0.02), draw(1.0)
  tx, _ = optim.build_optimizer(optim_config(warmup_steps=0), params, total_steps=10,
                                logical_axes=axes if layer_moves else None)

  def two_updates(params, grads):
    state = tx.init(params)
    u1, state = tx.update(grads, state, params)
    return tx.update(jax.tree.map(lambda g: 0.5 * g, grads), state, params)

  want = jax.jit(two_updates)(params, grads)
  shard = sharding.param_shardings(shapes, axes, mesh, rules)
  with sharding.activation_sharding(mesh, rules):
    compiled = jax.jit(two_updates, in_shardings=(shard, shard)).lower(params, grads).compile()
    text = compiled.as_text()
    got = compiled(jax.device_put(params, shard), jax.device_put(grads, shard))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  errors = {jax.tree_util.keystr(p): float(np.abs(np.asarray(g) - np.asarray(w)).max())
            for (p, g), w in zip(jax.tree_util.tree_leaves_with_path(got[0]),
                                 jax.tree.leaves(want[0]))}
  state_error = max(float(np.abs(np.asarray(g) - np.asarray(w)).max())
                    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])))
  # Gram matrices all-reduced: a routed expert's [local experts, F, F] / [.., D, D], or any
  # other matrix's [..., k, k] (k > 1) inside a Newton-Schulz iteration.
  e_local, f, d = 4, cfg.model.moe_intermediate_size, cfg.model.hidden_size
  reduces = [c for c in hlo_stats.collectives(text) if c.op == "all-reduce"]
  return {"experts": {k: v for k, v in errors.items() if "['experts']" in k},
          "worst": max(errors.values()), "state": state_error,
          "expert_grams": sum(tuple(c.shape[-3:]) in ((e_local, f, f), (e_local, d, d))
                              for c in reduces),
          "grams": sum(len(c.shape) >= 2 and c.shape[-1] == c.shape[-2] > 1 for c in reduces),
          "all_to_all": sum(c.op == "all-to-all" for c in hlo_stats.collectives(text))}

def stacked_expert_matrices(layers, experts):
  # The matrices a scanned run's routed-expert kernel [layers, experts, 16, 32] is iterated as
  # (fsdp 4 x expert 2), padding included.
  from jax.sharding import PartitionSpec as P
  from glm5_jax.optim import whole_matrices as wm
  cfg = tiny.get_config()
  cfg.mesh.shape.update(data=1, fsdp=4, expert=2, tensor=1)
  mesh = sharding.make_mesh(cfg.mesh)
  shape = (layers, experts, 16, 32)
  owner = wm._stacked_expert_owner(shape, P(None, "expert", "fsdp", None), mesh)
  with sharding.activation_sharding(mesh, cfg.mesh.logical_axis_rules):
    moved = jax.eval_shape(lambda x: wm._to_owner(wm._experts_first(x, owner), owner.owner),
                           jax.ShapeDtypeStruct(shape, jnp.float32))
  return moved.shape[0]

print(json.dumps({"experts_move": program(mtp=True, layer_moves=False),
                  "layers_move": program(mtp=False, layer_moves=True),
                  "stacked_expert_matrices": [stacked_expert_matrices(3, 4),
                                              stacked_expert_matrices(3, 2)]}))
"""


@pytest.mark.slow  # a subprocess with 8 host devices
def test_sharded_muon_orthogonalizes_whole_matrices_with_unsharded_numbers():
  """On fsdp 4 x expert 2, Muon's Newton-Schulz runs on whole matrices (`optim.whole_matrices`):
  the routed experts' normalized momenta move to one device per matrix, layer by layer; the
  scanned run's other split matrices (attention, shared expert) move whole with the layers
  spread over the devices, the routed experts among them (each expert shard's layers and local
  experts together). The updates and the optimizer state equal the unsharded ones; no
  expert Gram all-reduce is left (one per iteration before), only the iteration's input and
  output cross (at most two all-to-alls per routed-expert kernel per update; moving the
  momentum too was 42 in this program), and a model whose every layer is in the scanned run
  all-reduces no Gram matrix at all (66 all-reduces layer by layer)."""
  from tests.conftest import run_on_host_devices  # pylint: disable=g-import-not-at-top
  result = run_on_host_devices(_SHARDED_MUON, timeout=600)
  # A run's expert kernels move with its layers: each expert shard's layers x local experts are
  # padded together to the 4 devices splitting a matrix (3 x 2 -> 8, 3 x 1 -> 4), not each
  # layer's (24 matrices either way, 12 or 18 of them zero).
  assert result.pop("stacked_expert_matrices") == [2 * 8, 2 * 4], result
  for run in result.values():
    assert run["experts"] and max(run["experts"].values()) < 1e-5, result
    assert run["worst"] < 1e-5 and run["state"] < 1e-5, result
    assert run["expert_grams"] == 0, result
  experts_move = result["experts_move"]  # the routed experts alone move (no logical axes)
  expert_kernels = len(experts_move["experts"])
  assert 0 < experts_move["all_to_all"] <= 2 * 2 * expert_kernels, result  # two updates
  assert result["layers_move"]["grams"] == 0, result
