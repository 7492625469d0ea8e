"""Scanned layers (`model.scan_layers`, `glm5_jax.layer_runs`) and remat (`model.remat_policy`).

The scanned model must compute exactly what the unrolled one does from the same weights
(stacked): logits, MTP logits, the auxiliary losses, gradients, and a whole train step (Muon
Split per layer, the loss-free balancing bias per layer). Its program must not grow with depth.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_jax
from glm5_jax import layer_runs, optim
from glm5_jax.layers.remat import REMAT_POLICIES
from glm5_jax.planning import flop_ledger
from glm5_jax.train.state import TrainState, trainable_mask
from glm5_jax.train.step import StepConfig, compute_loss, make_train_step
from tests.inputs import packed_batch

# D dense | D D (MoE, hands its last top-k to the next run) | R R (reuses it) | S
MIXED = dict(num_hidden_layers=6, attention_pattern="DDDRRS", first_k_dense_replace=1,
             index_topk=8, sliding_window=6, dtype="float32")
LINEAR = dict(num_hidden_layers=4, attention_pattern="GGNL", first_k_dense_replace=0,
              mtp_depths=1, dtype="float32")


def configs(helpers, **overrides):
  unrolled = helpers.config(scan_layers=False, **overrides)
  return unrolled, dataclasses.replace(unrolled, scan_layers=True)


def scan_batch(vocab):
  """Two documents per row (the second from position 14), padding at the end of row 1."""
  return packed_batch(vocab, split=14, padding=4, mask_holes=False)


def assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
  flat_got = dict(jax.tree_util.tree_flatten_with_path(got)[0])
  flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
  assert flat_got.keys() == flat_want.keys()
  for path, value in flat_got.items():
    np.testing.assert_allclose(np.asarray(value), np.asarray(flat_want[path]), rtol=rtol,
                               atol=atol, err_msg=jax.tree_util.keystr(path))


def test_layer_runs_group_identical_consecutive_layers(helpers):
  cfg = helpers.config(**MIXED)
  runs = layer_runs.layer_runs(cfg)
  assert [(r.name, r.attention_kind, r.moe) for r in runs] == [
      ("layers_0_0", "dsa", False), ("layers_1_2", "dsa", True),
      ("layers_3_4", "dsa_shared_topk", True), ("layers_5_5", "swa", True)]
  glm5 = glm5_jax.config.ModelConfig.from_config(glm5_jax.config.model_config())
  assert [r.name for r in layer_runs.layer_runs(glm5)] == ["layers_0_2", "layers_3_77"]


def test_stack_and_unstack_are_inverse_and_match_the_scanned_model(helpers):
  unrolled_cfg, scanned_cfg = configs(helpers, **MIXED)
  params = helpers.random_params(unrolled_cfg)
  stacked = layer_runs.stack_layers(params, scanned_cfg)
  assert (jax.tree.structure(stacked)
          == jax.tree.structure(glm5_jax.abstract_params(scanned_cfg)))
  assert stacked["layers_1_2"]["mlp"]["experts"]["gate_proj"].shape[0] == 2
  assert_trees_close(layer_runs.unstack_layers(stacked, scanned_cfg), params, rtol=0, atol=0)
  assert layer_runs.scanned_location(scanned_cfg, ("layers_4", "mlp", "gate")) == (
      ("layers_3_4", "mlp", "gate"), 1)
  assert layer_runs.scanned_location(scanned_cfg, ("mtp", "eh_proj")) == (("mtp", "eh_proj"),
                                                                           None)


@pytest.mark.parametrize("overrides", [MIXED, LINEAR], ids=["dsa_mixed", "gqa_gdn"])
@pytest.mark.parametrize("stage", ["sparse", "warmup"])
def test_scanned_equals_unrolled_logits_losses_and_grads(helpers, overrides, stage):
  """Same weights, stacked: identical logits, MTP logits, loss terms and gradients (DSA top-k
  active: index_topk 8 < 24 keys, one run handing its selection to the next)."""
  if stage == "warmup" and overrides is LINEAR:
    pytest.skip("no indexer: the warm-up stage computes what the sparse one does")
  unrolled_cfg, scanned_cfg = configs(helpers, **overrides)
  params = helpers.random_params(unrolled_cfg)
  stacked = layer_runs.stack_layers(params, scanned_cfg)
  batch = scan_batch(unrolled_cfg.vocab_size)
  step_cfg = StepConfig(dsa_stage=stage, sequence_balance_weight=0.01)
  grad_fn = jax.jit(jax.value_and_grad(compute_loss, argnums=2, has_aux=True),
                    static_argnums=(0, 1))
  (loss_u, (metrics_u, counts_u, _, nll_u)), grads_u = grad_fn(unrolled_cfg, step_cfg, params,
                                                               batch)
  (loss_s, (metrics_s, counts_s, _, nll_s)), grads_s = grad_fn(scanned_cfg, step_cfg, stacked,
                                                               batch)
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
  assert_trees_close(metrics_s, metrics_u)
  np.testing.assert_allclose(nll_s, nll_u, rtol=1e-5, atol=1e-6)
  assert_trees_close(grads_s, layer_runs.stack_layers(grads_u, scanned_cfg))
  # Expert counts: one [E] per unrolled MoE layer, [layers, E] per scanned run, same numbers.
  for run in layer_runs.layer_runs(scanned_cfg):
    if run.moe:
      want = np.stack([counts_u[(f"layers_{i}", "mlp")] for i in range(run.first, run.last + 1)])
      np.testing.assert_array_equal(counts_s[(run.name, "mlp")], want)
  if overrides is MIXED:
    assert float(metrics_s["indexer_kl"]) > 0


def test_scanned_train_step_equals_unrolled(helpers):
  """One real train step (Muon Split per layer, balancing-bias update per layer)."""
  unrolled_cfg, scanned_cfg = configs(helpers, **MIXED)
  params = helpers.random_params(unrolled_cfg)
  batch = scan_batch(unrolled_cfg.vocab_size)
  step_cfg = StepConfig(dsa_stage="sparse", balance_bias_rate=0.01)
  opt_cfg = optim.optim_config(warmup_steps=0, learning_rate=1e-2, weight_decay=0.1)

  def one_step(cfg, params):
    shapes = jax.eval_shape(lambda: params)
    optimizer, schedule = optim.build_optimizer(opt_cfg, shapes, total_steps=10,
                                                trainable=trainable_mask(shapes, "sparse"))
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                       opt_state=optimizer.init(params), rng=jnp.zeros((2,), jnp.uint32))
    new_state, metrics = jax.jit(make_train_step(cfg, step_cfg, optimizer, schedule))(state,
                                                                                        batch)
    return new_state.params, metrics

  new_u, metrics_u = one_step(unrolled_cfg, params)
  new_s, metrics_s = one_step(scanned_cfg, layer_runs.stack_layers(params, scanned_cfg))
  assert_trees_close(new_s, layer_runs.stack_layers(new_u, scanned_cfg), rtol=1e-5, atol=1e-6)
  assert_trees_close(metrics_s, metrics_u, rtol=1e-5, atol=1e-6)
  bias_before = layer_runs.stack_layers(params, scanned_cfg)["layers_1_2"]["mlp"][
      "e_score_correction_bias"]
  assert not np.array_equal(new_s["layers_1_2"]["mlp"]["e_score_correction_bias"], bias_before)


SMALL = dict(num_hidden_layers=3, attention_pattern="DDR", first_k_dense_replace=1, dsa_impl="xla",
             index_topk=8, mtp_depths=1, dtype="float32")


# One jitted gradient for every policy below: the no-remat reference compiles once per session.
_LOSS_GRAD = jax.jit(jax.grad(lambda cfg, p, b: compute_loss(cfg, StepConfig(), p, b)[0],
                              argnums=1), static_argnums=0)
# What "save_attn_lse" keeps out of the backward's recompute (flop_ledger categories); with
# "xla" the KL target comes from the attention pass, so it has no category of its own.
_ATTENTION_KEPT = ("attention core", "indexer KL target")


_REMAT_FLOPS = {}


def _remat_flops(cfg, params, batch) -> dict:
  """Matmul FLOPs per category that the backward recomputes (`rematted_computation`), from
  the lowered gradient program (`glm5_jax.planning.flop_ledger`; nothing compiled). Kept per
  config: the policies below share one set of params and one batch, and several cases read
  the same policy's ledger."""
  if cfg not in _REMAT_FLOPS:
    text = _LOSS_GRAD.lower(cfg, params, batch).compiler_ir("hlo").get_hlo_module().to_string()
    rows, _, _ = flop_ledger.ledger(text, "cpu")
    _REMAT_FLOPS[cfg] = {name: c["remat"] for name, c in flop_ledger.by_category(rows).items()}
  return _REMAT_FLOPS[cfg]


_CHECKED = ("full", "save_attn_lse", "save_selections", "save_selections_o_proj",
            "save_selections_attn_out")
# The policies that keep the sparse attention's output and log-sum-exp: no attention core rerun.
_KEEP_ATTENTION_OUT = ("save_attn_lse", "save_selections_attn_out")


@pytest.mark.parametrize("policy", [
    p if p in _CHECKED else pytest.param(p, marks=pytest.mark.slow)
    for p in REMAT_POLICIES if p not in ("none", "offload_dots")])
def test_remat_policies_change_memory_not_numbers(helpers, policy):
  """Every policy gives the gradients of no remat (offload_dots needs a backend with pinned
  host memory; the planner measures it). Full remat recomputes the sparse attention and the
  indexer KL target in the backward; "save_attn_lse" keeps their results (named inside the
  sparse MLA custom VJP's forward rule) and recomputes only the rest of the layer;
  "save_selections" keeps the selection and the target: the backward reruns the attention
  but not the indexer's scores over every key (its count exchange: test_moe_parallel)."""
  _, scanned_cfg = configs(helpers, **SMALL)
  remat_cfg = dataclasses.replace(scanned_cfg, remat_policy=policy)
  params = layer_runs.stack_layers(helpers.random_params(dataclasses.replace(
      scanned_cfg, scan_layers=False)), scanned_cfg)
  batch = scan_batch(scanned_cfg.vocab_size)
  assert_trees_close(_LOSS_GRAD(remat_cfg, params, batch), _LOSS_GRAD(scanned_cfg, params, batch))
  if policy in _CHECKED:
    remat = _remat_flops(remat_cfg, params, batch)
    assert remat["attention projections"] > 0, remat
    kept = [remat.get(name, 0.0) for name in _ATTENTION_KEPT]
    if policy in _KEEP_ATTENTION_OUT:
      assert not any(kept), remat
    else:
      assert remat["attention core"] > 0, remat
    # Each MoE layer run reruns its shared expert's gate and up projections, never the down
    # projection: not in the layers, nor in the MTP depth, whose output (`shared_head_norm`'s
    # input) every policy keeps (`glm5_jax.mtp`).
    c, (b, l) = scanned_cfg, batch["tokens"].shape
    moe_runs = sum(map(c.is_moe_layer, range(c.num_hidden_layers))) + c.mtp_depths
    gate_up = 2 * (2 * b * l * c.hidden_size * c.moe_intermediate_size * c.n_shared_experts)
    assert remat["shared expert"] == moe_runs * gate_up, (remat, moe_runs * gate_up)
  if policy == "save_selections":
    full = _remat_flops(dataclasses.replace(scanned_cfg, remat_policy="full"), params, batch)
    # The indexer's scores over every key (its top-k's input; 2 B L S J I FLOPs a DSA layer,
    # L = S), rerun by full remat only; the KL's scores at the selection rerun under both
    # (their own checkpoint). Two DSA layers here: the run's and the MTP layer's.
    b, l = batch["tokens"].shape
    every_key = 2 * b * l * l * scanned_cfg.index_n_heads * scanned_cfg.index_head_dim
    assert sum(full.values()) - sum(remat.values()) >= 2 * every_key, (full, remat)
  if policy == "save_selections_attn_out":
    # Against save_selections_o_proj: the attention core leaves the rerun, nothing else does.
    o_proj = _remat_flops(dataclasses.replace(scanned_cfg, remat_policy="save_selections_o_proj"),
                          params, batch)
    assert o_proj["attention core"] > 0, o_proj
    assert {k: v for k, v in remat.items() if v} == {
        k: v for k, v in o_proj.items() if v and k != "attention core"}, (remat, o_proj)
  if policy == "save_selections_o_proj":
    # Exactly the output projection leaves the rerun: 2 B L (H V) D FLOPs in each of the three
    # layers and in the MTP layer's one depth (the ledger's "MTP layer").
    selections = _remat_flops(dataclasses.replace(scanned_cfg, remat_policy="save_selections"),
                              params, batch)
    o_proj = 2 * b * l * c.num_attention_heads * c.v_head_dim * c.hidden_size
    saved = {name: selections[name] - remat[name] for name in selections}
    assert saved == {**dict.fromkeys(saved, 0.0), "attention projections":
                     c.num_hidden_layers * o_proj, "MTP layer": c.mtp_depths * o_proj}, saved


def test_offload_policy_lowers_with_the_mtp_layer(helpers):
  """offload_dots answers with offload decisions, not booleans; combined with what every policy
  keeps (the MTP depths' output, `glm5_jax.model._rematerialized`) its gradient program still
  lowers (it raised a ValueError from `save_from_both_policies`; compiling it needs a backend
  with pinned host memory)."""
  _, scanned_cfg = configs(helpers, **SMALL)
  cfg = dataclasses.replace(scanned_cfg, remat_policy="offload_dots")
  shapes = glm5_jax.abstract_params(cfg)
  batch = jax.eval_shape(lambda: scan_batch(cfg.vocab_size))
  assert "func.func public @main" in _LOSS_GRAD.lower(cfg, shapes, batch).as_text()


def test_the_attention_output_goes_to_host_memory_under_the_offloading_policy(helpers):
  """save_selections_offload_attn_out keeps what save_selections_attn_out keeps, but puts the
  sparse attention's output (`sparse_mla_out`) of the MoE layers' runs in host memory: in the
  gradient's program each such value is copied to a `<host>` array (XLA:CPU compiles the copy
  away, its host and device memories being one; the TPU compiler makes it an asynchronous
  transfer); the dense run's and the MTP depth's stay on the device, and nothing else moves.
  Here: a dense run, two MoE runs (one layer each), one MTP depth."""
  _, scanned_cfg = configs(helpers, **SMALL)
  cfg = dataclasses.replace(scanned_cfg, remat_policy="save_selections_offload_attn_out")
  grad = jax.grad(lambda p, b: compute_loss(cfg, StepConfig(), p, b)[0])
  text = str(jax.make_jaxpr(grad)(glm5_jax.abstract_params(cfg),
                                  jax.eval_shape(lambda: scan_batch(cfg.vocab_size))))
  named = re.findall(r"(\w+):\S+ = name\[name=sparse_mla_out\]", text)
  moved = re.findall(r"\w+:\w+<host>\[[\d,]*\] = device_put\[[^]]*\] (\w+)", text)
  runs = layer_runs.layer_runs(cfg)
  assert len(named) == len(runs) + cfg.mtp_depths, (named, runs)
  assert len(moved) == sum(run.moe for run in runs) and set(moved) < set(named), (moved, named)


def _program_size(cfg) -> int:
  """Characters of the lowered (StableHLO) train-loss gradient program."""
  shapes = glm5_jax.abstract_params(cfg)
  batch = jax.eval_shape(lambda: scan_batch(cfg.vocab_size))
  fn = jax.grad(lambda p, b: compute_loss(cfg, StepConfig(), p, b)[0])
  return len(jax.jit(fn).lower(shapes, batch).as_text())


def test_scanned_program_does_not_grow_with_depth(helpers):
  """2 -> 8 MoE layers: the scanned program stays the same size (one body per run), the
  unrolled one grows with every layer."""
  sizes = {}
  for scan in (True, False):
    for depth in (2, 8):
      cfg = helpers.config(num_hidden_layers=depth, first_k_dense_replace=0, scan_layers=scan,
                           attention_pattern="D", mtp_depths=1)
      sizes[scan, depth] = _program_size(cfg)
  assert sizes[True, 8] < 1.05 * sizes[True, 2], sizes
  assert sizes[False, 8] > 2.5 * sizes[False, 2], sizes
