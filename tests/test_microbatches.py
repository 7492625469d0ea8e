"""Gradient accumulation (`train.microbatches`): 2 and 4 microbatches give the one-batch step.

The batch's rows carry different amounts of padding and loss-mask holes, so the microbatches'
target-token and non-padding counts differ (one microbatch of four has almost none), and a
mean of per-microbatch means would be off by far more than the tolerance.
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_jax
from glm5_jax import optim
from glm5_jax.config import ConfigError
from glm5_jax.config_validation import validate_config
from glm5_jax.planning import op_costs
from glm5_jax.train import losses
from glm5_jax.train.state import TrainState, trainable_mask
from glm5_jax.train.step import (MICROBATCH_SCOPE, StepConfig, loss_and_grads, make_train_step,
                                 split_microbatches)
from tests.conftest import host_devices_xla_flags

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


LOSS_METRICS = ("loss", "lm_loss", "z_loss", "accuracy", "target_tokens", "mtp_loss",
                "mtp1_loss", "mtp1_accuracy", "mtp2_loss", "mtp2_accuracy", "indexer_kl",
                "sequence_balance_loss")
STEP = dict(mtp_loss_weight=0.37, z_loss_weight=0.013, indexer_loss_weight=1.9,
            sequence_balance_weight=0.21, balance_bias_rate=0.004)  # every term on, distinct


@pytest.fixture(scope="module")
def setup(helpers):
  """A 1-layer fp32 tiny model (a DSA layer with indexer KL and MoE, and the MTP layer at 2
  depths; a vocab of 8, so random params get accuracies well above 0), its optimizer (Muon
  Split + AdamW as configs/tiny.py builds it), a train state and the padded batch."""
  model = helpers.config(num_hidden_layers=1, first_k_dense_replace=0, mtp_depths=2,
                         vocab_size=8, dtype="float32", param_dtype="float32")
  params = helpers.random_params(model)
  optim_config = helpers.load_config_module(os.path.join(ROOT, "configs", "tiny.py")).get_config(
  ).optim
  shapes = glm5_jax.abstract_params(model)
  optimizer, schedule = optim.build_optimizer(
      optim_config, shapes, total_steps=100, trainable=trainable_mask(shapes, "sparse"))
  state = TrainState(step=jnp.ones((), jnp.int32), params=params,
                     opt_state=optimizer.init(params), rng=jnp.zeros((2,), jnp.uint32))
  return model, optimizer, schedule, state, _padded_batch(model.vocab_size)


def _grads(setup, microbatches):
  model, *_, state, batch = setup
  step_cfg = StepConfig(**STEP, microbatches=microbatches)
  return jax.device_get(jax.jit(lambda p, b: loss_and_grads(model, step_cfg, p, b))(
      state.params, batch))


def _step(setup, microbatches):
  model, optimizer, schedule, state, batch = setup
  step_cfg = StepConfig(**STEP, microbatches=microbatches)
  return jax.device_get(jax.jit(make_train_step(model, step_cfg, optimizer, schedule))(
      state, batch))


def _assert_trees_close(got, want):
  def close(path, g, w):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  jax.tree_util.tree_map_with_path(close, got, want)


def _assert_metrics_equal(got, want):
  assert sorted(got) == sorted(want)
  for name in LOSS_METRICS:  # every term present, every accuracy non-trivial
    assert want[name] != 0, name
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.fixture(scope="module")
def one_batch_grads(setup):
  return _grads(setup, 1)


def test_the_microbatches_hold_different_token_counts(setup):
  """The premise of the tests below: the split gives microbatches unequal denominators (of 4,
  one has 5 non-padding tokens, another 64), so a mean of their own means is not the batch's."""
  *_, batch = setup
  for n in (2, 4):
    parts = split_microbatches(batch, n)
    shares = [losses.loss_denominators(jax.tree.map(lambda x: x[k], parts), 2)
              for k in range(n)]
    for key in ("lm", "indexer"):
      counts = [float(s[key]) for s in shares]
      assert len(set(counts)) == n, (n, key, counts)
  # Microbatch k holds rows k, k + n, ... (strided: see split_microbatches).
  np.testing.assert_array_equal(split_microbatches(batch, 4)["tokens"][1],
                                batch["tokens"][np.array([1, 5])])


def test_microbatched_loss_and_grads_equal_one_batch(setup, one_batch_grads):
  """Loss, every metric (per-depth MTP losses and accuracies, indexer KL, balance loss, ...)
  and every gradient equal the one-batch pass; expert counts exactly."""
  want_metrics, want_counts, want_grads = one_batch_grads
  metrics, counts, grads = _grads(setup, 4)
  _assert_metrics_equal(metrics, want_metrics)
  assert counts
  jax.tree.map(np.testing.assert_array_equal, counts, want_counts)
  _assert_trees_close(grads, want_grads)


@pytest.mark.slow  # two compiled train steps with Muon Split
def test_microbatched_train_step_equals_one_batch(setup):
  """Through the whole train step (Muon Split + AdamW, loss-free balancing from the summed
  expert counts): 2 microbatches give the one-batch step's metrics (grad norm, expert load,
  ...), updated params, moved balancing biases and optimizer state (4 microbatches, with the
  near-empty one, are checked at the gradients above; the step only sums what they return)."""
  want_state, want_metrics = _step(setup, 1)
  before = setup[3].params
  moved = [not np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(_biases(want_state.params)), jax.tree.leaves(_biases(before)))]
  assert moved and all(moved)
  for microbatches in (2,):
    state, metrics = _step(setup, microbatches)
    assert {"grad_norm", "update_norm", "expert_load_max"} <= set(metrics)
    _assert_metrics_equal(metrics, want_metrics)
    _assert_trees_close(state.params, want_state.params)
    jax.tree.map(np.testing.assert_array_equal, _biases(state.params),
                 _biases(want_state.params))
    _assert_trees_close(state.opt_state, want_state.opt_state)


def _biases(params):
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(params)
          if "e_score_correction_bias" in jax.tree_util.keystr(path)}


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


_SHARDED = r"""
import json, re, jax, numpy as np
from configs import tiny
from glm5_jax.sharding import activation_sharding
from glm5_jax.train.trainer import build_trainer

assert jax.device_count() == 8, jax.devices()
results = {}
for m in (1, 2):
  config = tiny.get_config()
  config.model.update(num_hidden_layers=1, first_k_dense_replace=0, mtp_depths=1)
  # The batch splits over the batch rule's data x fsdp x expert = 4 ways: 2 microbatches of 4.
  config.mesh.shape.update(data=1, fsdp=2, expert=2, tensor=2)
  config.data.update(seq_len=256, batch_size=8, prefetch=0)
  config.train.update(steps=4, dsa_dense_steps=0, microbatches=m)
  config.optim.update(warmup_steps=1)
  config.eval.update(every_steps=0)
  t = build_trainer(config)
  state, batch = t.init_state(), t.to_device(next(t.train_iter))
  with activation_sharding(t.mesh, t.rules):
    compiled = t.train_step.lower(state, batch).compile()
  hlo = compiled.as_text()
  state, metrics = compiled(state, batch)
  results[m] = {
      "metrics": {k: float(v) for k, v in metrics.items()},
      "params": [np.asarray(x, np.float64).ravel().tolist() for x in jax.tree.leaves(state.params)],
      "collectives": {op: len(re.findall(rf"= [^=]*? {op}(-start)?\(", hlo))
                      for op in ("all-gather", "all-to-all", "collective-permute")},
      "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}
print(json.dumps(results))
"""


@pytest.mark.slow  # a subprocess with 8 host devices, two compiled train steps
def test_microbatched_step_on_8_devices_equals_one_batch():
  """Through `build_trainer` on an fsdp x expert x tensor mesh: 2 microbatches give the one-batch
  step's metrics and params, add no gather, all-to-all or permute to the compiled step (the
  strided split stays on each device), and need less temp memory per device."""
  env = dict(os.environ, XLA_FLAGS=host_devices_xla_flags(8),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", _SHARDED], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  one, two = json.loads(proc.stdout.strip().splitlines()[-1]).values()
  assert sorted(one["metrics"]) == sorted(two["metrics"])
  for name, value in one["metrics"].items():
    np.testing.assert_allclose(two["metrics"][name], value, rtol=1e-5, atol=1e-7, err_msg=name)
  for got, want in zip(two["params"], one["params"]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert two["collectives"] == one["collectives"], (one["collectives"], two["collectives"])
  assert two["temp_bytes"] < one["temp_bytes"], (one["temp_bytes"], two["temp_bytes"])


def test_the_planners_categories_see_through_the_microbatch_loop(setup):
  """The accumulation loop's ops carry `MICROBATCH_SCOPE`, and `op_costs.category` files them
  as in a one-pass step (the loop's `while/body/closed_call/` prefix alone is the optimizer's:
  every model op was "optimizer" before the scope)."""
  model, *_, state, batch = setup
  step_cfg = StepConfig(**STEP, microbatches=2)
  def train_step(params, batch):  # named as the real step: the rules read `jit(train_step)/`
    return loss_and_grads(model, step_cfg, params, batch)

  hlo = jax.jit(train_step).lower(
      state.params, batch).compile().as_text()  # op_names as the planner reads them
  names = set(re.findall(r'op_name="([^"]*)"', hlo))
  in_loop = {n for n in names if f"/{MICROBATCH_SCOPE}/" in n and "jvp(" in n}
  assert in_loop, sorted(names)[:20]
  found = {op_costs.category(n, "fusion") for n in in_loop}
  assert "optimizer" not in found, sorted(found)
  assert {"attention projections", "experts and FFN", "loss and LM head"} <= found, found
