"""Training: loss drops, exact resume, NaN stop, resume refusal, DSA stage switch and gradient
routing, sharded == unsharded, loss masks. Runs the real loop on a 2-layer tiny config."""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import glm5_jax
from configs import tiny
from glm5_jax import optim
from glm5_jax.train import checkpoint as ckpt
from glm5_jax.train import losses
from glm5_jax.train.loop import NonFiniteLossError, train
from glm5_jax.train.state import TrainState, trainable_mask
from glm5_jax.train.step import StepConfig, compute_loss, make_train_step, update_balance_bias
from tests.conftest import host_devices_xla_flags
from tests.inputs import packed_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_config(steps=16, **model_overrides):
  """configs/tiny.py with 2 layers and short rows, so each run compiles in seconds."""
  config = tiny.get_config()
  config.model.update(num_hidden_layers=2, first_k_dense_replace=1, mtp_depths=2,
                      **model_overrides)
  config.data.update(seq_len=256, batch_size=4, prefetch=0)
  config.train.update(steps=steps, log_every_steps=1, dsa_dense_steps=0)
  config.optim.update(warmup_steps=1)
  config.ckpt.update(every_steps=4, async_save=False)
  config.eval.update(every_steps=0)
  return config


def read_losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


@pytest.mark.slow  # end to end: three training runs
def test_loss_drops_and_resume_is_exact(tmp_path):
  # 8 steps: the train step the file's other 8-step runs load from the compilation cache (a
  # 16-step schedule was a program of its own, ~80 s of compile on a loaded machine).
  config = small_config(steps=8)
  straight = train(config, str(tmp_path / "straight"))
  assert straight["steps"] == 8
  assert straight["last_loss"] < straight["first_loss"] - 1.0, straight

  # Resume at 5 (between the step-4 checkpoint and the next) and run to the end: a state or data
  # position restored wrong shows from step 6 on.
  interrupted = str(tmp_path / "interrupted")
  first = train(config, interrupted, stop_after_steps=5)
  assert first["steps"] == 5
  second = train(config, interrupted)  # params, optimizer, data position
  assert second["steps"] == 8
  expected, got = read_losses(str(tmp_path / "straight")), read_losses(interrupted)
  assert sorted(got) == list(range(1, 9))
  np.testing.assert_allclose([got[s] for s in range(1, 9)],
                             [expected[s] for s in range(1, 9)], rtol=1e-6)


@pytest.mark.slow  # end to end: a training run, then a refused resume
def test_resume_with_a_different_config_is_refused(tmp_path):
  config = small_config(steps=8)  # the step other 8-step tests compile (a cache hit)
  train(config, str(tmp_path), stop_after_steps=2)
  changed = small_config(steps=8, index_topk=8)
  with pytest.raises(ckpt.CheckpointMismatchError, match="model.index_topk"):
    train(changed, str(tmp_path))


@pytest.mark.slow  # end to end: a training run until the poisoned update
def test_non_finite_update_stops_naming_the_step(tmp_path, monkeypatch):
  from glm5_jax import optim

  build = optim.build_optimizer

  def poisoned(*args, **kwargs):  # the third update turns every param into NaN
    tx, schedule = build(*args, **kwargs)

    def update(grads, state, params=None):
      updates, new_state = tx.update(grads, state[0], params)
      factor = jnp.where(state[1] >= 2, jnp.nan, 1.0)
      return jax.tree_util.tree_map(lambda u: u * factor, updates), (new_state, state[1] + 1)

    return optax.GradientTransformation(lambda p: (tx.init(p), jnp.zeros((), jnp.int32)),
                                        update), schedule

  monkeypatch.setattr(optim, "build_optimizer", poisoned)
  config = small_config(steps=8)
  config.ckpt.every_steps = 2
  with pytest.raises(NonFiniteLossError, match="step 3"):
    train(config, str(tmp_path))
  saved = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  assert saved == [2]  # the last good checkpoint stays; nothing non-finite was written


@pytest.mark.slow  # end to end: an MLA run, then a DSA warm-up run from it
def test_mla_checkpoint_into_dsa_warmup_trains_only_the_indexer(tmp_path):
  dense = small_config(steps=2, attention_pattern="M")
  train(dense, str(tmp_path / "mla"))
  mla_params, _ = ckpt.restore_params_from(str(tmp_path / "mla"), glm5_jax.abstract_params)

  warmup = small_config(steps=3, attention_pattern="D")
  warmup.train.update(dsa_stage="warmup", init_from=str(tmp_path / "mla"))
  summary = train(warmup, str(tmp_path / "warmup"))
  assert summary["last_metrics"]["indexer_kl"] > 0
  dsa_params, _ = ckpt.restore_params_from(str(tmp_path / "warmup"), glm5_jax.abstract_params)

  flat = lambda t: {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(t)[0]}
  mla, dsa = flat(mla_params), flat(dsa_params)
  indexer_keys = [k for k in dsa if "'indexer'" in k]
  assert indexer_keys and not any("'indexer'" in k for k in mla)
  for key, value in mla.items():  # frozen in warm-up, router bias included
    np.testing.assert_array_equal(np.asarray(dsa[key]), np.asarray(value), err_msg=key)
  fresh = flat(glm5_jax.init_params(glm5_jax.ModelConfig.from_config(warmup.model),
                                    jax.random.key(warmup.seed)))
  assert any(not np.array_equal(np.asarray(dsa[k]), np.asarray(fresh[k])) for k in indexer_keys)


@pytest.mark.slow  # end to end: train steps, then three training runs
def test_dense_phase_attends_densely_trains_everything_then_switches_to_top_k(tmp_path):
  from glm5_jax.train.trainer import build_trainer  # pylint: disable=g-import-not-at-top

  # An 8-step schedule, of which 4 steps run: its sparse train step is the one the file's other
  # 8-step runs compile (a cache hit here); a 4-step run was a program of its own.
  config = small_config(steps=8, attention_pattern="D")
  config.train.dsa_dense_steps = 2
  t = build_trainer(config)
  assert t.dense_steps == 2
  state = t.init_state()
  batch = t.to_device(next(t.train_iter))
  model = glm5_jax.ModelConfig.from_config(config.model)
  tokens, positions, segments = (batch[k] for k in ("tokens", "positions", "segment_ids"))
  lm_loss = lambda stage: float(optax.softmax_cross_entropy_with_integer_labels(
      glm5_jax.forward(model, state.params, tokens, positions, segments,
                       mode=glm5_jax.Mode(dsa_stage=stage))
      ["logits"][:, :-1], tokens[:, 1:])[batch["loss_mask"][:, 1:] > 0].mean())
  dense_metrics, _, _ = t.dense_eval_step(state.params, batch)
  sparse_metrics, _, _ = t.eval_step(state.params, batch)
  dense_lm, sparse_lm = lm_loss("dense"), lm_loss("sparse")  # op by op: once each
  np.testing.assert_allclose(dense_metrics["lm_loss"], dense_lm, rtol=1e-5)
  np.testing.assert_allclose(sparse_metrics["lm_loss"], sparse_lm, rtol=1e-5)
  # top-k < seq_len really differs: at init attention is near uniform, so the loss moves by
  # ~1e-3, far above the 1e-5 agreement asserted just above.
  assert abs(dense_lm - sparse_lm) > 1e-4
  assert dense_metrics["indexer_kl"] > 0

  flat = lambda tree: {jax.tree_util.keystr(p): np.array(v)  # copies: the step donates
                       for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
  state, _ = t.dense_train_step(state, batch)  # step 0 runs at warm-up LR 0
  before = flat(state.params)
  after = flat(t.dense_train_step(state, batch)[0].params)
  changed = {k for k in before if not np.array_equal(before[k], after[k])}
  assert any("'indexer'" in k for k in changed)  # learns its KL to the dense attention
  assert any("e_score_correction_bias" in k for k in changed)  # balancing runs
  assert {k for k in before if "'indexer'" not in k and "bias" not in k} <= changed

  # Exact resume across the switch: stop inside the dense phase, resume, cross it.
  straight, interrupted = str(tmp_path / "straight"), str(tmp_path / "interrupted")
  train(config, straight, stop_after_steps=4)
  train(config, interrupted, stop_after_steps=1)
  assert train(config, interrupted, stop_after_steps=3)["steps"] == 4
  expected, got = read_losses(straight), read_losses(interrupted)
  np.testing.assert_allclose([got[s] for s in range(1, 5)], [expected[s] for s in range(1, 5)],
                             rtol=1e-6)


def test_build_trainer_traces_the_params_once(monkeypatch):
  """One shape-only trace gives the optimizer, the shardings and the restore target what they
  need; the only other trace of the init is the one compiled (it used to be four)."""
  from glm5_jax import api  # pylint: disable=g-import-not-at-top
  from glm5_jax.train.trainer import build_trainer  # pylint: disable=g-import-not-at-top

  traces = []
  boxed_init = api._boxed_init  # pylint: disable=protected-access
  monkeypatch.setattr(api, "_boxed_init", lambda *a: traces.append(1) or boxed_init(*a))
  jax.clear_caches()  # the compiled init must be traced here, not found in a cache
  t = build_trainer(small_config(steps=2))
  t.train_iter.close()
  assert len(traces) == 2, f"the params were traced {len(traces)} times"
  assert jax.tree_util.tree_structure(t.abstract_state.params) == jax.tree_util.tree_structure(
      t.params_sharding)


def test_dense_phase_config_errors(tmp_path):
  config = small_config(steps=2, attention_pattern="D")
  config.train.update(dsa_stage="warmup", dsa_dense_steps=1)
  with pytest.raises(ValueError, match="dsa_dense_steps.*sparse stage"):
    train(config, str(tmp_path / "a"))
  config.train.update(dsa_stage="sparse", dsa_dense_steps=-1)
  with pytest.raises(ValueError, match="dsa_dense_steps"):
    train(config, str(tmp_path / "b"))


def test_bad_stage_and_bad_data_path_are_clear_errors(tmp_path):
  config = small_config(steps=2)
  config.train.dsa_stage = "sparse-ish"
  with pytest.raises(ValueError, match="dsa_stage"):
    train(config, str(tmp_path / "a"))
  config = small_config(steps=2)
  config.data.sources = {"mine": {"kind": "text_files", "glob": str(tmp_path / "none/*.txt"),
                                  "weight": 1.0}}
  with pytest.raises(Exception, match="none"):
    train(config, str(tmp_path / "b"))


_SHARDED_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from test_train import small_config, read_losses
from glm5_jax.train.loop import train
config = small_config(steps=8)  # 3 of 8 steps, as the single-device reference
config.mesh.shape.update(json.loads(sys.argv[3]))
train(config, sys.argv[2], stop_after_steps=3)
print(json.dumps(read_losses(sys.argv[2])))
"""


def _run_sharded(devices, mesh_shape, workdir):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=host_devices_xla_flags(devices))
  proc = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT, ROOT, workdir,
                         json.dumps(mesh_shape)], env=env, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two training runs: in this process (1 device), in a subprocess (8)
def test_sharded_training_matches_single_device(tmp_path):
  # The single-device reference runs here, on this process's one CPU device: its train step is
  # test_resume_with_a_different_config_is_refused's (a hit in this process's compilation
  # cache; a subprocess has a cache of its own and compiled it again).
  assert jax.device_count() == 1
  train(small_config(steps=8), str(tmp_path / "one"), stop_after_steps=3)
  single = {str(step): loss for step, loss in read_losses(str(tmp_path / "one")).items()}
  # The 4-row batch splits over fsdp x expert (the batch rule's axes; data has size 1).
  sharded = _run_sharded(8, {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2},
                         str(tmp_path / "eight"))
  assert sorted(single) == sorted(sharded) == ["1", "2", "3"]
  np.testing.assert_allclose([sharded[k] for k in "123"], [single[k] for k in "123"],
                             rtol=2e-5)


def test_target_weights_respect_documents_and_mask():
  segment_ids = jnp.array([[1, 1, 1, 2, 2, 0]])
  loss_mask = jnp.array([[1.0, 1.0, 0.0, 1.0, 1.0, 0.0]])
  # Position i predicts i+1: 0->1 ok, 1->2 masked target, 2->3 crosses documents, 3->4 ok,
  # 4->5 padding.
  np.testing.assert_array_equal(losses.target_weights(segment_ids, loss_mask, 1),
                                [[1.0, 0.0, 0.0, 1.0, 0.0]])
  # MTP depth 1 (offset 2): 0->2 masked, 1->3 crosses, 2->4 crosses, 3->5 padding.
  np.testing.assert_array_equal(losses.target_weights(segment_ids, loss_mask, 2),
                                [[0.0, 0.0, 0.0, 0.0]])
  logits = jax.nn.one_hot(jnp.array([[2, 0, 0]]), 4) * 10.0
  result = losses.cross_entropy(logits, jnp.array([[2, 1, 3]]), jnp.array([[1.0, 1.0, 0.0]]))
  assert float(result["accuracy"]) == 0.5 and float(result["weight"]) == 2.0


# ---------------------------------------------------------------------------------------------
# The step's arithmetic: loss terms and their weights, loss-free balancing direction
# ---------------------------------------------------------------------------------------------


def test_update_balance_bias_moves_exactly_rate_toward_equal_load():
  """Over-loaded experts' bias goes down by exactly `rate`, under-loaded ones' up by exactly
  `rate`, experts at the mean load stay; every MoE block by its own counts, nothing else
  touched."""
  rate = 0.0125
  before = np.array([0.25, -0.5, 0.0, 1.0, 0.125], np.float32)
  params = {"layers_1": {"mlp": {"e_score_correction_bias": jnp.asarray(before),
                                 "gate": jnp.ones((3, 5))}},
            "mtp": {"layer": {"mlp": {"e_score_correction_bias": jnp.asarray(before)}}}}
  counts = {("layers_1", "mlp"): jnp.asarray([9, 1, 4, 4, 2], jnp.int32),  # mean 4
            ("mtp", "layer", "mlp"): jnp.asarray([0, 0, 0, 0, 20], jnp.int32)}
  after = update_balance_bias(params, counts, rate)
  step = np.float32(rate)
  np.testing.assert_array_equal(after["layers_1"]["mlp"]["e_score_correction_bias"],
                                before + step * np.array([-1, 1, 0, 0, 1], np.float32))
  np.testing.assert_array_equal(after["mtp"]["layer"]["mlp"]["e_score_correction_bias"],
                                before + step * np.array([1, 1, 1, 1, -1], np.float32))
  np.testing.assert_array_equal(after["layers_1"]["mlp"]["gate"], np.ones((3, 5)))


def test_train_step_lowers_overloaded_and_raises_underloaded_expert_bias(helpers):
  """Through the real optimizer (which freezes the bias) and train step: after one step each
  MoE block's bias is exactly `before - rate` where that block's load (from the same batch)
  was above the mean and `before + rate` where it was below."""
  model = helpers.config(num_hidden_layers=2, first_k_dense_replace=1, mtp_depths=1,
                         attention_pattern="M", scan_layers=False)  # per-layer [E] counts
  params = helpers.random_params(model)
  optim_config = helpers.load_config_module(os.path.join(ROOT, "configs", "tiny.py")).get_config(
  ).optim
  step_cfg = StepConfig(balance_bias_rate=0.004)
  shapes = glm5_jax.abstract_params(model)
  optimizer, schedule = optim.build_optimizer(
      optim_config, shapes, total_steps=100, trainable=trainable_mask(shapes, "sparse"))
  state = TrainState(step=jnp.ones((), jnp.int32), params=params,
                     opt_state=optimizer.init(params), rng=jnp.zeros((2,), jnp.uint32))
  batch = packed_batch(model.vocab_size)
  new_state, _ = jax.jit(make_train_step(model, step_cfg, optimizer, schedule))(state, batch)
  _, (_, counts, _, _) = jax.jit(compute_loss, static_argnums=(0, 1))(model, step_cfg, params,
                                                                       batch)
  assert set(counts) == {("layers_1", "mlp"), ("mtp", "layer", "mlp")}
  rate = np.float32(step_cfg.balance_bias_rate)
  for path, counts_E in counts.items():
    load = np.asarray(counts_E, np.float64)
    over, under = load > load.mean(), load < load.mean()
    assert over.any() and under.any(), load
    pick = lambda tree: np.asarray(functools.reduce(lambda n, k: n[k], path, tree)[
        "e_score_correction_bias"])
    before, after = pick(params), pick(new_state.params)
    np.testing.assert_array_equal(after[over], before[over] - rate, err_msg=f"{path} over")
    np.testing.assert_array_equal(after[under], before[under] + rate, err_msg=f"{path} under")
    np.testing.assert_array_equal(after[~over & ~under], before[~over & ~under])


def test_compute_loss_weighs_and_sums_its_terms(helpers):
  """total == lm_ce + z_w * z_loss + mtp_w * mean_d(mtp_ce_d) + indexer_w * indexer_kl
  + balance_w * sequence_balance, with distinct weights, each term computed here in float64
  from the forward's outputs (its own target weights: same document, loss mask, no padding)."""
  model = helpers.config(num_hidden_layers=2, first_k_dense_replace=1, mtp_depths=2,
                         scan_layers=False)  # the reference reads each layer's aux
  params = helpers.random_params(model)
  batch = packed_batch(model.vocab_size, seed=1)
  step_cfg = StepConfig(dsa_stage="sparse", mtp_loss_weight=0.37, z_loss_weight=0.013,
                        indexer_loss_weight=1.9, sequence_balance_weight=0.21)
  total, (metrics, _, predictions, token_nll) = jax.jit(compute_loss, static_argnums=(0, 1))(
      model, step_cfg, params, batch)
  out = helpers.forward(model, params, batch["tokens"], batch["positions"], batch["segment_ids"])

  tokens, segments = np.asarray(batch["tokens"]), np.asarray(batch["segment_ids"])
  loss_mask = np.asarray(batch["loss_mask"])

  def ce_and_z(logits, offset):
    logits = np.asarray(logits, np.float64)[:, :-offset]
    weights = (loss_mask[:, offset:] * (segments[:, offset:] == segments[:, :-offset])
               * (segments[:, offset:] != 0))
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    target = np.take_along_axis(logits, tokens[:, offset:, None], -1)[..., 0]
    return ((log_z - target) * weights).sum() / weights.sum(), (log_z ** 2 * weights).sum() / (
        weights.sum())

  lm, z_loss = ce_and_z(out["logits"], 1)
  # The eval outputs are aligned to the tokens (losses.token_logprobs): entry i is token i's;
  # the weighted mean of the nll is the LM cross-entropy.
  token_weights = np.pad(loss_mask[:, 1:] * (segments[:, 1:] == segments[:, :-1])
                         * (segments[:, 1:] != 0), ((0, 0), (1, 0)))
  np.testing.assert_allclose((np.asarray(token_nll) * token_weights).sum() / token_weights.sum(),
                             lm, rtol=1e-5)
  assert (np.asarray(predictions)[:, 0] == -1).all() and (np.asarray(token_nll)[:, 0] == 0).all()
  np.testing.assert_array_equal(np.asarray(predictions)[:, 1:],
                                np.argmax(np.asarray(out["logits"])[:, :-1], -1))
  mtp = [ce_and_z(logits, d + 1)[0]  # depth d predicts token i + d + 1
         for d, logits in enumerate(out["mtp_logits"], start=1)]
  assert len(mtp) == 2
  valid = (segments != 0).astype(np.float64)
  auxes = list(out["aux"]["layers"].values()) + list(out["aux"]["mtp"])
  kl = np.mean([(np.asarray(a["indexer_kl"]) * valid).sum() / valid.sum()
                for a in auxes if "indexer_kl" in a])
  balance = np.mean([float(a["sequence_balance_loss"]) for a in auxes
                     if "sequence_balance_loss" in a])
  for name, term in [("lm_loss", lm), ("z_loss", z_loss), ("mtp_loss", np.mean(mtp)),
                     ("indexer_kl", kl), ("sequence_balance_loss", balance)]:
    assert term > 1e-3, name  # every term present and non-trivial
    np.testing.assert_allclose(metrics[name], term, rtol=1e-5, err_msg=name)
  expected = lm + 0.013 * z_loss + 0.37 * np.mean(mtp) + 1.9 * kl + 0.21 * balance
  np.testing.assert_allclose(total, expected, rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], total)
