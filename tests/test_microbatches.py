"""Gradient accumulation (`train.microbatches`): 2 and 4 microbatches give the one-batch step.

The batch's rows carry different amounts of padding and loss-mask holes, so the microbatches'
target-token and non-padding counts differ (one microbatch of four has almost none), and a
mean of per-microbatch means would be off by far more than the tolerance.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_jax
from glm5_jax import optim
from glm5_jax.config import ConfigError
from glm5_jax.config_validation import validate_config
from glm5_jax.train import losses
from glm5_jax.train.state import TrainState, trainable_mask
from glm5_jax.train.step import StepConfig, loss_and_grads, make_train_step, split_microbatches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, LENGTH = 8, 32
# Non-padding tokens per row: every microbatch split (strided, rows k, k + n, ...) gets a
# different count; rows 3 and 7 (microbatch 3 of 4) are nearly all padding.
REAL_TOKENS = (32, 20, 27, 3, 32, 14, 25, 2)


def _padded_batch(vocab, seed=0):
  """Rows of two packed documents each, padding (segment id 0) at the end of each row."""
  rng = np.random.default_rng(seed)
  columns = np.arange(LENGTH)[None]
  real = np.asarray(REAL_TOKENS)[:, None]
  split = real // 2
  segments = np.where(columns < split, 1, 2) * (columns < real)
  positions = np.where(segments == 2, columns - split, columns) * (segments != 0)
  loss_mask = (rng.random((ROWS, LENGTH)) > 0.2) & (segments != 0)
  return {"tokens": jnp.asarray(rng.integers(1, vocab, (ROWS, LENGTH)), jnp.int32),
          "positions": jnp.asarray(positions, jnp.int32),
          "segment_ids": jnp.asarray(segments, jnp.int32),
          "loss_mask": jnp.asarray(loss_mask, jnp.float32)}


@pytest.fixture(scope="module")
def setup(helpers):
  """A 2-layer fp32 tiny model (DSA layers with indexer KL, MoE, 2 MTP depths), its optimizer
  (Muon Split + AdamW as configs/tiny.py builds it), a train state and the padded batch."""
  model = helpers.config(num_hidden_layers=2, first_k_dense_replace=1, mtp_depths=2,
                         dtype="float32", param_dtype="float32")
  params = helpers.random_params(model)
  optim_config = helpers.load_config_module(os.path.join(ROOT, "configs", "tiny.py")).get_config(
  ).optim
  shapes = glm5_jax.abstract_params(model)
  optimizer, schedule = optim.build_optimizer(
      optim_config, shapes, total_steps=100, trainable=trainable_mask(shapes, "sparse"))
  state = TrainState(step=jnp.ones((), jnp.int32), params=params,
                     opt_state=optimizer.init(params), rng=jnp.zeros((2,), jnp.uint32))
  return model, optimizer, schedule, state, _padded_batch(model.vocab_size)


def _run(setup, microbatches):
  """One jitted train step and the gradients it took, with `microbatches`; every loss term on
  (distinct weights, so a term combined wrongly cannot hide behind another)."""
  model, optimizer, schedule, state, batch = setup
  step_cfg = StepConfig(mtp_loss_weight=0.37, z_loss_weight=0.013, indexer_loss_weight=1.9,
                        sequence_balance_weight=0.21, balance_bias_rate=0.004,
                        microbatches=microbatches)
  train_step = make_train_step(model, step_cfg, optimizer, schedule)

  @jax.jit
  def step_and_grads(state, batch):
    new_state, metrics = train_step(state, batch)
    _, counts, grads = loss_and_grads(model, step_cfg, state.params, batch)  # CSE'd with the step
    return new_state, metrics, counts, grads

  return jax.device_get(step_and_grads(state, batch))


@pytest.fixture(scope="module")
def one_batch(setup):
  return _run(setup, 1)


def test_the_microbatches_hold_different_token_counts(setup):
  """The premise of the test below: its split gives microbatches unequal denominators."""
  model, *_, batch = setup
  for n in (2, 4):
    parts = split_microbatches(batch, n)
    lm = [float(losses.loss_denominators(jax.tree.map(lambda x: x[k], parts), 2)["lm"])
          for k in range(n)]
    assert len(set(lm)) == n, (n, lm)
  # Microbatch k holds rows k, k + n, ... (strided: see split_microbatches).
  np.testing.assert_array_equal(split_microbatches(batch, 4)["tokens"][1],
                                batch["tokens"][np.array([1, 5])])


@pytest.mark.parametrize("microbatches", [2, 4])
def test_microbatched_step_equals_one_batch(setup, one_batch, microbatches):
  """Loss, every metric, gradients, updated params (Muon Split + AdamW) and the loss-free
  balancing biases (from expert counts summed over microbatches) equal the one-batch step."""
  want_state, want_metrics, want_counts, want_grads = one_batch
  state, metrics, counts, grads = _run(setup, microbatches)

  assert sorted(metrics) == sorted(want_metrics)
  assert {"mtp1_loss", "mtp2_accuracy", "indexer_kl", "sequence_balance_loss",
          "expert_load_max"} <= set(metrics)
  for name, want in want_metrics.items():
    np.testing.assert_allclose(metrics[name], want, rtol=1e-5, atol=1e-7, err_msg=name)
  jax.tree.map(np.testing.assert_array_equal, counts, want_counts)  # integer counts: exact

  def close(path, got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))

  jax.tree_util.tree_map_with_path(close, grads, want_grads)
  jax.tree_util.tree_map_with_path(close, state.params, want_state.params)
  jax.tree_util.tree_map_with_path(close, state.opt_state, want_state.opt_state)
  biases = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
            if "e_score_correction_bias" in jax.tree_util.keystr(path)]
  before = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(setup[3].params)
            if "e_score_correction_bias" in jax.tree_util.keystr(path)]
  assert biases and all(np.any(b != a) for b, a in zip(biases, before))  # the biases moved


def test_mean_of_microbatch_means_would_differ(setup, one_batch):
  """Guards the test above: naive averaging of the microbatches' own means misses the one-batch
  LM loss by far more than its tolerance, so equality there is the denominators' doing."""
  model, *_, batch = setup
  step_cfg = StepConfig(mtp_loss_weight=0.37, z_loss_weight=0.013, indexer_loss_weight=1.9,
                        sequence_balance_weight=0.21)
  parts = split_microbatches(batch, 4)
  naive = np.mean([
      jax.jit(lambda p, b: loss_and_grads(model, step_cfg, p, b)[0]["lm_loss"])(
          setup[3].params, jax.tree.map(lambda x: x[k], parts)) for k in range(4)])
  want = one_batch[1]["lm_loss"]
  assert abs(naive - want) > 1e-3 * abs(want), (naive, want)


def test_batch_must_split_into_the_microbatches(helpers):
  tiny = helpers.load_config_module(os.path.join(ROOT, "configs", "tiny.py"))
  config = tiny.get_config()
  config.data.batch_size = 8
  config.train.microbatches = 4
  validate_config(config, num_devices=2)  # 4 microbatches of 2 rows, one per device

  config.train.microbatches = 3
  with pytest.raises(ConfigError, match=r"config.train.microbatches: data.batch_size=8 rows do "
                     r"not split into 3 equal microbatches"):
    validate_config(config)

  config.train.microbatches = 8  # 8 microbatches of 1 row cannot spread over 2 devices
  with pytest.raises(ConfigError, match=r"config.train.microbatches: .* must be a multiple of "
                     r"microbatches \* 2 = 16"):
    validate_config(config, num_devices=2)

  config.train.microbatches = 0
  with pytest.raises(ConfigError, match=r"config.train.microbatches: must be an int >= 1"):
    validate_config(config)


def test_step_refuses_a_batch_that_does_not_split(setup):
  *_, batch = setup
  with pytest.raises(ConfigError, match="config.train.microbatches: the batch's"):
    split_microbatches(batch, 3)
