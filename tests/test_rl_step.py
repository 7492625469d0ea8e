"""The jitted RL train step on the tiny model: it trains, its log-probs agree with the
trainer's own, zero advantages give zero gradient, the sign of the update is right end to end,
and distillation from an identical teacher has zero advantage."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from configs import rl_tiny, tiny
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.posttrain import algorithms, rl_step
from glm5_jax.posttrain.config import rl_config, validate_rl_config
from glm5_jax.posttrain.rl_config_checks import validate_rl_experiment
from glm5_jax.sharding import activation_sharding, make_mesh

B, L, PROMPT = 4, 24, 8
RESPONSE = (12, 9, 14, 6)  # response lengths; the rest of each row is padding


@pytest.fixture(scope="module")
def setup(helpers):
  config = tiny.get_config()
  # Two layers (dense, then MoE; DSA in both) keep every kind of parameter the step treats
  # differently (indexers, router bias, MTP) at half the compile time of the four.
  config.model.num_hidden_layers = 2
  config.rl = rl_config(steps=10)
  config.optim.warmup_steps = 0
  config.optim.learning_rate = 3e-3
  config.train.dsa_dense_steps = 0
  model = ModelConfig.from_config(config.model)
  params = helpers.random_params(model, seed=0, std=0.05)
  optimizer, schedule = rl_step.build_rl_optimizer(config, params)
  # The sharded step as a run builds it, on the default mesh (one device here).
  mesh = make_mesh(config.mesh)
  state_sharding, batch_sharding = rl_step.rl_shardings(config, model, optimizer, mesh)
  jitted = rl_step.make_rl_train_step(config, model, optimizer, schedule,
                                      state_sharding=state_sharding, batch_sharding=batch_sharding)

  def step(state, batch):
    with activation_sharding(mesh, config.mesh.logical_axis_rules):
      return jitted(state, batch)

  step.state_sharding = state_sharding
  return config, model, params, optimizer, step


def make_batch(model, params, advantages_B):
  """A rollout batch whose rollout log-probs are the trainer's own (`policy_logprobs`)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(16, model.vocab_size, (B, L)).astype(np.int32)
  segment_ids = np.zeros((B, L), np.int32)
  loss_mask = np.zeros((B, L), np.float32)
  for b, n in enumerate(RESPONSE):
    segment_ids[b, :PROMPT + n] = 1
    loss_mask[b, PROMPT:PROMPT + n] = 1.0
  tokens = np.where(segment_ids == 1, tokens, 0).astype(np.int32)
  batch = {"tokens": tokens, "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)),
           "segment_ids": segment_ids, "loss_mask": loss_mask}
  logp = rl_step.teacher_logp(model, params, batch)
  batch["rollout_logp"] = np.asarray(logp) * loss_mask
  batch["advantages"] = (np.asarray(advantages_B, np.float32)[:, None] * loss_mask)
  rl_step.check_rl_batch(batch, vocab_size=model.vocab_size)
  return batch


def fresh_state(params, optimizer, step):
  """The initial state placed as the step returns it (one compilation for every call); a copy,
  since the step donates its state and the cached test params must stay alive."""
  state = rl_step.init_rl_state(jax.tree.map(jnp.copy, params), optimizer)
  return jax.device_put(state, step.state_sharding)


def response_logp(model, params, batch, row):
  logp = np.asarray(rl_step.teacher_logp(model, params, batch))
  return float((logp[row] * batch["loss_mask"][row]).sum() / batch["loss_mask"][row].sum())


def test_step_trains_with_nothing_clipped_or_masked(setup):
  config, model, params, optimizer, step = setup
  batch = make_batch(model, params, [1.0, -1.0, 0.5, -0.5])
  state, metrics = step(fresh_state(params, optimizer, step), batch)
  metrics = jax.device_get(metrics)
  assert int(state.step) == 1
  assert all(np.isfinite(v) for v in metrics.values()), metrics
  # rollout_logp is the trainer's own: the ratio is exactly 1, IcePop keeps every token.
  assert metrics["icepop_masked_fraction"] == 0.0
  assert metrics["clip_low_fraction"] == metrics["clip_high_fraction"] == 0.0
  assert metrics["ratio_mean"] == 1.0
  assert metrics["logp_mismatch_max"] < 1e-4
  assert metrics["loss_tokens"] == sum(RESPONSE) and metrics["entropy"] > 0
  assert metrics["grad_norm"] > 0
  old = traverse_util.flatten_dict(params)
  new = traverse_util.flatten_dict(jax.device_get(state.params))
  changed = {k for k in old if not np.array_equal(old[k], new[k])}
  assert ("lm_head",) in changed
  assert {k[1:] for k in changed if k[0].startswith("layers_1")} >= {
      ("self_attn", "q_a_proj"), ("mlp", "experts", "up_proj")}
  # Frozen: indexers and the MTP layer (rl.mtp_loss_weight 0); the router bias moves by
  # loss-free balancing, not by gradients.
  assert not any("indexer" in k or k[0] == "mtp" for k in changed), sorted(changed)
  assert any(k[0].startswith("layers_1") and k[-1] == "e_score_correction_bias"
             for k in changed)


def test_zero_advantages_give_zero_policy_gradient(setup):
  # `grad_norm` is the norm of the loss gradient before the optimizer (which may still move
  # params by weight decay): all-zero advantages must give exactly zero.
  _, model, params, optimizer, step = setup
  batch = make_batch(model, params, [0.0, 0.0, 0.0, 0.0])
  _, metrics = step(fresh_state(params, optimizer, step), batch)
  assert float(metrics["grad_norm"]) == 0.0 and float(metrics["loss"]) == 0.0


def test_positive_advantage_raises_its_logp(setup):
  _, model, params, optimizer, step = setup
  batch = make_batch(model, params, [1.0, -1.0, 0.0, 0.0])
  before = [response_logp(model, params, batch, row) for row in (0, 1)]
  state = fresh_state(params, optimizer, step)
  for _ in range(3):
    # On-policy as in the loop: each step's rollout log-probs come from the current params.
    # (params fetched to the host: mesh-placed ones would compile teacher_logp once more)
    current = jax.device_get(state.params)
    batch["rollout_logp"] = np.asarray(rl_step.teacher_logp(model, current, batch)
                                       ) * batch["loss_mask"]
    state, metrics = step(state, batch)
    assert float(metrics["icepop_masked_fraction"]) == 0.0
  after = [response_logp(model, jax.device_get(state.params), batch, row) for row in (0, 1)]
  # Measured: -6.19 -> -4.71 and -6.08 -> -7.56 (mean log-prob of each row's response).
  assert after[0] > before[0] + 0.5, (before, after)  # advantage +1: more likely
  assert after[1] < before[1] - 0.5, (before, after)  # advantage -1: less likely


def test_distill_advantage_of_identical_teacher_is_zero(setup, helpers):
  config, model, params, _, _ = setup
  batch = make_batch(model, params, [0.0] * B)
  teacher = rl_step.teacher_logp(model, params, batch)
  advantages = algorithms.distill_advantages(teacher, batch["rollout_logp"]) * batch["loss_mask"]
  assert (np.asarray(advantages) == 0).all()
  # A different teacher disagrees on the student's tokens.
  other = rl_step.teacher_logp(model, helpers.random_params(model, seed=1, std=0.05), batch)
  advantages = algorithms.distill_advantages(other, batch["rollout_logp"]) * batch["loss_mask"]
  assert np.abs(np.asarray(advantages)).sum() > 0


def test_check_rl_batch_names_the_problem(setup):
  _, model, params, _, _ = setup
  batch = make_batch(model, params, [1.0, 0.0, 0.0, 0.0])
  bad = {k: np.array(v) for k, v in batch.items()}
  bad["loss_mask"][0, 0] = 1.0
  with pytest.raises(ValueError, match="position 0"):
    rl_step.check_rl_batch(bad)
  bad = {k: np.array(v) for k, v in batch.items()}
  bad["rollout_logp"][0, 0] = -0.5
  with pytest.raises(ValueError, match="rollout_logp"):
    rl_step.check_rl_batch(bad)
  with pytest.raises(ValueError, match="missing keys \\['advantages'\\]"):
    rl_step.check_rl_batch({k: v for k, v in batch.items() if k != "advantages"})


def test_rl_config_validation():
  validate_rl_config(rl_config())
  validate_rl_config(rl_config(loss="distill", teacher="/tmp/teacher", group_size=1))
  with pytest.raises(ConfigError, match="config.rl.teacher"):
    validate_rl_config(rl_config(loss="distill"))
  with pytest.raises(ConfigError, match="config.rl.group_size"):
    validate_rl_config(rl_config(group_size=1))
  with pytest.raises(ConfigError, match="config.rl.icepop_beta"):
    validate_rl_config(rl_config(icepop_beta=1.0))
  with pytest.raises(ConfigError, match="did you mean 'eps_low'"):
    validate_rl_config(rl_config(eps_lo=0.1))
  with pytest.raises(ConfigError, match="config.rl.minibatches"):
    validate_rl_config(rl_config(minibatches=0))
  with pytest.raises(ConfigError, match="config.rl.eval_samples"):
    validate_rl_config(rl_config(eval_samples=-1))


def test_rl_experiment_rows_must_split_into_minibatches():
  config = rl_tiny.get_config("recipe=plain")
  del config["sft"]
  config.rl.update(prompts_per_step=3, group_size=4, minibatches=2)
  validate_rl_experiment(config)  # 12 rows, 2 minibatches of 6
  config.rl.minibatches = 5
  with pytest.raises(ConfigError, match="config.rl.prompts_per_step: .* rl.minibatches=5"):
    validate_rl_experiment(config)


@pytest.mark.slow
def test_mtp_loss_weight_keeps_the_mtp_head_training(setup):
  config, model, params, _, _ = setup
  config = config.copy_and_resolve_references()
  config.rl.mtp_loss_weight = 0.3
  config.model.mtp_depths = 1  # the same params (one shared MTP layer); a third of the compile
  optimizer, schedule = rl_step.build_rl_optimizer(config, params)
  step = rl_step.make_rl_train_step(config, ModelConfig.from_config(config.model), optimizer,
                                    schedule)
  batch = make_batch(model, params, [1.0, -1.0, 0.0, 0.0])
  # Unsharded (no mesh): the path of `make_rl_train_step` without shardings.
  state = rl_step.init_rl_state(jax.tree.map(jnp.copy, params), optimizer)
  state, metrics = step(state, batch)
  assert np.isfinite(float(metrics["mtp_loss"])) and float(metrics["mtp_loss"]) > 0
  np.testing.assert_allclose(float(metrics["loss"]), float(metrics["policy_loss"])
                             + 0.3 * float(metrics["mtp_loss"]), rtol=1e-5)
  old = traverse_util.flatten_dict(params)
  new = traverse_util.flatten_dict(jax.device_get(state.params))
  changed = {k for k in old if not np.array_equal(old[k], new[k])}
  assert ("mtp", "eh_proj") in changed and ("mtp", "layer", "self_attn", "q_a_proj") in changed
  assert not any("indexer" in k for k in changed)


def test_microbatches_accumulate_to_the_one_pass_result(setup):
  """`train.microbatches=2` (strided halves, one of them with more loss tokens than the other)
  gives the one-pass loss, metrics and gradients to float rounding, with IcePop masking some
  tokens (so `ratio_mean`'s kept-token mean differs from a loss-token mean), ratios away from 1
  (an `old_logp` from another policy) and the MTP loss on (its own per-depth denominators)."""
  _, model, params, _, _ = setup
  batch = make_batch(model, params, [1.0, -0.5, 0.25, -1.0])
  rng = np.random.default_rng(1)
  mask = batch["loss_mask"]
  batch["old_logp"] = ((batch["rollout_logp"] + rng.normal(0, 0.1, mask.shape)) * mask
                       ).astype(np.float32).clip(max=0.0)
  far = (rng.random(mask.shape) < 0.2) & (mask > 0)  # IcePop masks these: |mismatch| > log 2
  batch["old_logp"] = np.where(far, batch["old_logp"] - 1.0, batch["old_logp"]).astype(np.float32)
  one_pass = rl_step.RLStepConfig(mtp_loss_weight=0.3, dsa_stage="sparse")
  split = rl_step.RLStepConfig(mtp_loss_weight=0.3, dsa_stage="sparse", microbatches=2)
  run = jax.jit(rl_step.rl_loss_and_grads, static_argnums=(0, 1))
  metrics_1, counts_1, grads_1 = run(model, one_pass, params, batch)
  metrics_2, counts_2, grads_2 = run(model, split, params, batch)
  assert 0 < float(metrics_1["icepop_masked_fraction"]) < 1
  assert abs(float(metrics_1["ratio_mean"]) - 1.0) > 1e-3
  assert "mtp_loss" in metrics_1 and set(metrics_1) == set(metrics_2)
  for name in metrics_1:  # (the log-probs of a half batch differ from the whole's by ~1e-6)
    np.testing.assert_allclose(float(metrics_2[name]), float(metrics_1[name]), rtol=2e-5,
                               atol=2e-6, err_msg=name)
  for a, b in zip(jax.tree.leaves(counts_1), jax.tree.leaves(counts_2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for path, g1 in traverse_util.flatten_dict(grads_1).items():
    g2 = traverse_util.flatten_dict(grads_2)[path]
    np.testing.assert_allclose(np.asarray(g2), np.asarray(g1), rtol=1e-4,
                               atol=1e-6 * float(np.abs(g1).max() + 1e-12), err_msg=str(path))


def test_build_rl_run_converts_the_model_config_once(monkeypatch):
  """The RL builders take the ModelConfig built once in `build_rl_run` (it was validated and
  expanded 5 times there); a ConfigDict below them is refused."""
  from glm5_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from glm5_jax.posttrain import rl_run  # pylint: disable=g-import-not-at-top
  calls = []
  original = config_lib.validate_model_config
  monkeypatch.setattr(config_lib, "validate_model_config",
                      lambda m: calls.append(1) or original(m))
  config = rl_tiny.get_config("recipe=plain")
  _, _, shapes, trainer = rl_run.build_rl_run(config)
  assert len(calls) == 1
  with pytest.raises(TypeError, match="make_rl_train_step: expected the ModelConfig"):
    rl_step.make_rl_train_step(config, config.model, trainer.optimizer, None)
