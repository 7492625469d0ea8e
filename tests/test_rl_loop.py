"""Rollouts through the engine, the synchronous RL loop and the SFT / RL entry points.

Token-in-token-out rollouts (ids and log-probs are the engine's; observation tokens are the
observation's rendering, masked), exact resume, a short RL run that raises the reward on a
trivially learnable environment, distillation's advantage, and the CLI (slow).
"""

import copy
import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import rl_tiny
from glm5_jax.api import abstract_params
from glm5_jax.config import ModelConfig
from glm5_jax.data import chat, make_tokenizer
from glm5_jax.infer.engine import Engine
from glm5_jax.infer.requests import Request
from glm5_jax.optim.build import validate_optim_config
from glm5_jax.posttrain import envs, loop, rl_run, rl_step, rl_update, rollout
from glm5_jax.posttrain.envs import base
from glm5_jax.train import checkpoint as ckpt
from glm5_jax.train.metrics import MetricWriter
from test_checkpoint_integrity import _flip_bytes as flip_bytes  # pylint: disable=import-error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = make_tokenizer("byte")


def small_config(**rl):
  """configs/rl_tiny.py with a 2-layer model, 32-token rows and 8-token turns; every test's
  rollouts have 4 tasks x 8 samples, so the engine and the train step compile once."""
  config = rl_tiny.get_config("recipe=plain")
  del config["sft"]
  config.model.num_hidden_layers = 2
  config.data.seq_len = 32
  config.rl.update({**dict(group_size=8, prompts_per_step=4, max_new_tokens=8, steps=4,
                          eval_every_steps=0, eval_tasks=0, log_kl=False), **rl})
  config.optim.update(warmup_steps=0, learning_rate=1e-2)
  config.ckpt.update(every_steps=2, async_save=False)
  return config


class StopEarly(base.SingleTurnEnv):
  """Trivially learnable: any answer scores 1, but a turn that never ends scores 0 (the
  rollout's rule), so the reward is the share of turns that end within max_new_tokens."""
  name = "stop_early"
  defaults = {}

  def _options(self, options):
    return {}

  def _problem(self, rng):
    key = str(int(rng.integers(10**9)))
    return key, ({"role": "user", "content": f"hi {key[:3]}"},), "", {}

  def _score(self, task, content):
    return True, None


@pytest.mark.parametrize("sft_steps", [2, 20, 30, 160])
def test_rl_tiny_short_sft_warms_up_within_its_steps(sft_steps):
  """configs/rl_tiny.py:sft_steps <= 30 once failed on a fixed SFT warmup of 30 steps."""
  config = rl_tiny.get_config(f"sft_steps={sft_steps}")
  validate_optim_config(config.sft.optim, total_steps=config.sft.train.steps)
  assert config.sft.optim.warmup_steps == min(30, sft_steps // 2)


@pytest.fixture
def stop_early(monkeypatch):
  monkeypatch.setitem(envs.REGISTRY, "stop_early", StopEarly)


@pytest.fixture(scope="module")
def small(helpers):
  config = small_config()
  return config, helpers.random_params(ModelConfig.from_config(config.model), seed=0)


def test_rollout_batch_is_the_engines_tokens_and_logprobs(small):
  config, params = small
  env = envs.make("addition")
  tasks = [env.task(i, "train") for i in range(4)]
  samples = rollout.generate_samples(config, params, env, tasks, seed=7)
  assert [s.group for s in samples] == [g for g in range(4) for _ in range(8)]
  stops = tuple(chat.stop_ids(TOKENIZER))
  # The same requests, generated alone: the samples hold exactly these ids and raw log-probs.
  requests = [Request(index=k, prompt=tuple(int(i) for i in chat.render_prompt(
      list(s.task.messages), TOKENIZER)), max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0,
      seed=rollout.request_seed(7, s.task, k % 8, 0), stop_tokens=stops)
      for k, s in enumerate(samples)]
  # (The rollout's engine shape: another slot count would change XLA's reductions by an ulp.)
  done = Engine(config.model, params, slots=32, max_len=32,
                prefill_chunk=rollout.PREFILL_CHUNK).run(requests)
  batch = rollout.to_batch(samples, 32, np.arange(32, dtype=np.float32))
  for row, (s, r, c) in enumerate(zip(samples, requests, done)):
    n, p = len(s.tokens), len(r.prompt)
    assert s.tokens.tolist() == list(r.prompt) + c.tokens
    assert s.response_length == len(c.tokens) and s.turns == 1
    np.testing.assert_array_equal(batch["tokens"][row, :n], s.tokens)
    np.testing.assert_array_equal(batch["rollout_logp"][row, p:n],
                                  np.asarray(c.raw_logprobs, np.float32))
    assert not batch["loss_mask"][row, :p].any() and batch["loss_mask"][row, p:n].all()
    assert not batch["segment_ids"][row, n:].any() and batch["segment_ids"][row, :n].all()
    np.testing.assert_array_equal(batch["advantages"][row, p:n], row)
    assert not batch["advantages"][row, :p].any()
  rl_step.check_rl_batch(batch, vocab_size=config.model.vocab_size)
  with pytest.raises(ValueError, match="sample 0 .* more than seq_len=4"):
    rollout.to_batch(samples, 4)


def test_multi_turn_observations_are_rendered_appended_and_masked(small, monkeypatch):
  """A scripted engine plays the calculator's worked solution turn by turn: the episode's ids
  and loss mask are exactly `chat.render` of the whole conversation (observation segments
  rendered alone and appended, masked 0), and it earns reward 1 in 2 turns."""
  config, params = small
  config = small_config()
  config.data.seq_len = 128
  config.rl.max_new_tokens = 48
  env = envs.make("calculator")
  task = env.task(3, "train")
  full = chat.render(env.worked_solution(task), TOKENIZER)

  class Scripted:
    def __init__(self, *args, **kwargs):
      pass

    def release(self, session):  # episodes are engine sessions (multi-turn env)
      return False

    def run(self, requests):
      out = []
      for r in requests:
        p = len(r.prompt)
        assert list(r.prompt) == full.ids[:p].tolist()
        end = p + int(np.argmin(full.loss_mask[p:] > 0)) if (full.loss_mask[p:] == 0).any() \
            else len(full.ids)
        tokens = full.ids[p:end].tolist()
        out.append(type("C", (), dict(tokens=tokens, raw_logprobs=[-0.5] * len(tokens),
                                      routing=None))())
      return out

  monkeypatch.setattr(rollout, "Engine", Scripted)
  [s] = rollout.generate_samples(config, params, env, [task], seed=0, group_size=1)
  assert (s.reward, s.correct, s.turns) == (1.0, True, 2)
  np.testing.assert_array_equal(s.tokens, full.ids)
  np.testing.assert_array_equal(s.loss_mask, full.loss_mask)
  np.testing.assert_array_equal(s.rollout_logp, np.where(full.loss_mask > 0, -0.5, 0.0))
  assert [m["role"] for m in s.messages][-3:] == ["assistant", "observation", "assistant"]


def test_unfinished_turn_scores_zero(small):
  config, params = small
  config = small_config(max_new_tokens=1)
  env = envs.make("addition")
  samples = rollout.generate_samples(config, params, env, [env.task(i, "train") for i in range(4)],
                                     seed=0)
  unfinished = [s for s in samples if s.tokens[-1] not in chat.stop_ids(TOKENIZER)]
  assert unfinished  # random params rarely stop at once
  for s in unfinished:
    assert s.reward == 0 and s.info["truncated"] and "did not end" in s.info["error"]


def run_rl(workdir, params, **kwargs):
  return loop.rl_train(small_config(env="stop_early"), str(workdir), params=params, **kwargs)


@pytest.fixture(scope="module")
def uninterrupted(small, tmp_path_factory):
  """4 RL steps in one go (module-scoped: the resume and distillation tests read it)."""
  mp = pytest.MonkeyPatch()
  mp.setitem(envs.REGISTRY, "stop_early", StopEarly)
  workdir = tmp_path_factory.mktemp("rl_whole")
  summary = run_rl(workdir, small[1])
  mp.undo()
  return workdir, summary


def final_params(workdir, config):
  manager = ckpt.make_manager(str(workdir), every_steps=1, keep=1, async_save=False)
  try:
    step = manager.latest_step()
    meta = manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]
    restored = manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params(config.model))))
  finally:
    manager.close()
  return step, meta, restored["params"]


def test_evaluate_reports_greedy_and_sampled_accuracy(small):
  """Held-out evaluation: greedy metrics, and k samples per task at the rollout temperature
  (`rl.eval_samples`), whose pass@k bounds their mean from above; a rerun is identical."""
  config, params = small
  config = copy.deepcopy(config)
  # 16 tasks x 2 samples: the sampled pass fills the 32 slots of the file's rollout engine
  # (compiled programs reused: an engine's programs are fixed by its slots and max_len).
  config.rl.eval_samples = 2
  config.rl.eval_tasks = 16
  env = envs.make("addition")
  metrics = rl_run.evaluate(config, params, env, TOKENIZER, num_tasks=16)
  assert {"accuracy", "reward", "sampled_accuracy", "sampled_reward", "pass_at_k"} <= set(metrics)
  assert 0 <= metrics["sampled_accuracy"] <= metrics["pass_at_k"] <= 1
  assert rl_run.evaluate(config, params, env, TOKENIZER, num_tasks=16) == metrics
  config.rl.eval_samples = 0
  assert "sampled_accuracy" not in rl_run.evaluate(config, params, env, TOKENIZER, num_tasks=16)


def assert_same_params(workdir_a, workdir_b, step):
  config = small_config(env="stop_early")
  (step_a, _, params_a), (step_b, _, params_b) = (final_params(w, config)
                                                  for w in (workdir_a, workdir_b))
  assert step_a == step_b == step
  for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_resume_is_exact(small, uninterrupted, tmp_path,
                                                            stop_early):
  """A real SIGTERM during step 1 (ckpt.every_steps=2): step 1 is saved all the same, the run
  stops (the CLI exits 75 on `stopped_early`), and the resumed run equals an uninterrupted
  one."""
  whole, summary = uninterrupted
  assert summary["steps"] == 4 and not summary["stopped_early"]
  write = MetricWriter.write

  def write_then_sigterm(self, step, values, prefix="train"):
    write(self, step, values, prefix=prefix)
    if prefix == "train" and step == 1:
      os.kill(os.getpid(), signal.SIGTERM)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(MetricWriter, "write", write_then_sigterm)
    first = run_rl(tmp_path, small[1])
  assert (first["steps"], first["stopped_early"], first["stop_reason"]) == (1, True, "SIGTERM")
  assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()) == [1]
  second = run_rl(tmp_path, small[1])  # resumes at step 1 (params ignored: a checkpoint wins)
  assert second["steps"] == 4 and not second["stopped_early"]
  assert_same_params(whole, tmp_path, 4)
  # The metrics of the resumed steps equal the uninterrupted run's.
  rows = lambda w: [json.loads(line) for line in open(os.path.join(w, "metrics.jsonl"))]
  whole_rows = {r["step"]: r for r in rows(whole)}
  for r in rows(tmp_path):
    assert r["reward"] == whole_rows[r["step"]]["reward"]
    assert r["loss"] == whole_rows[r["step"]]["loss"]


@pytest.mark.slow
def test_restore_fallback_moves_a_damaged_step_aside_and_resumes_the_one_before(
    small, uninterrupted, tmp_path, stop_early):
  """The last step's params damaged: refused by default; with ckpt.restore_fallback the step
  goes to checkpoints_damaged/ and RL resumes from step 2, reaching the uninterrupted params."""
  workdir = tmp_path / "rl"
  shutil.copytree(uninterrupted[0], workdir)
  flip_bytes(workdir / "checkpoints" / "4")
  config = small_config(env="stop_early")
  with pytest.raises(ckpt.CheckpointCorruptError, match="restore_fallback"):
    loop.rl_train(config, str(workdir))
  config.ckpt.restore_fallback = True
  summary = loop.rl_train(config, str(workdir))
  assert summary["steps"] == 4
  assert os.listdir(workdir / "checkpoints_damaged") == ["4"]
  assert_same_params(uninterrupted[0], workdir, 4)


@pytest.mark.slow
def test_minibatches_update_per_minibatch_against_old_logp_and_resume_exactly(small, tmp_path,
                                                                             stop_early):
  """`rl.minibatches=2`: two updates per RL step (the checkpoint counts 2 x steps), the second
  scored against the log-probs from before the first, so its ratio departs from 1 (the first
  update's ratio is 1 to rounding); a run stopped after step 1 and resumed equals a whole run."""
  def run(workdir, **kwargs):
    config = small_config(env="stop_early", steps=2, minibatches=2)
    return loop.rl_train(config, str(workdir), params=small[1], **kwargs), config

  whole, config = run(tmp_path / "whole")
  assert whole["steps"] == 2
  assert run(tmp_path / "parts", stop_after_steps=1)[0]["steps"] == 1
  assert run(tmp_path / "parts")[0]["steps"] == 2
  (step_a, meta, params_a), (step_b, _, params_b) = (final_params(tmp_path / w, config)
                                                     for w in ("whole", "parts"))
  assert step_a == step_b == 2 and meta["updates"] == 4
  for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  rows = [json.loads(line) for line in open(tmp_path / "whole" / "metrics.jsonl")]
  ratio_means = [r["ratio_mean"] for r in rows if r["split"] == "train"]
  # the mean over the two updates: (1 + r2) / 2, with r2 the second update's mean ratio
  assert all(abs(r - 1.0) > 1e-4 for r in ratio_means), ratio_means


@pytest.mark.slow
def test_resume_refuses_a_different_config(small, uninterrupted, stop_early):
  config = small_config(env="stop_early", temperature=0.7)
  with pytest.raises(ckpt.CheckpointMismatchError, match="rl.temperature"):
    loop.rl_train(config, str(uninterrupted[0]))


@pytest.mark.slow
def test_short_rl_run_raises_the_reward(small, tmp_path, stop_early):
  """StopEarly from random params: the share of turns that end within 8 tokens rises, with the
  signal controls of the default recipe on (dynamic sampling, 1 refill round; the KL penalty,
  0 while the policy is the start, growing as it moves).

  Measured (mean reward of steps 1-2 -> steps 11-12, 32 samples a step, lr 1e-2; random params
  of seeds 0..3, this test's being 0), without the controls: 0.11 -> 1.00, 0.13 -> 0.79, 0.14 ->
  0.61, 0.16 -> 1.00. The threshold, +0.25, is about half the smallest rise measured (+0.47)."""
  config = small_config(env="stop_early", steps=12, dynamic_sampling_rounds=1, kl_coef=0.1,
                        log_kl=True)
  summary = loop.rl_train(config, str(tmp_path), params=small[1])
  records = [json.loads(line) for line in open(summary["metrics_file"])]
  rewards = [r["reward"] for r in records]
  assert len(rewards) == 12
  assert np.mean(rewards[-2:]) >= np.mean(rewards[:2]) + 0.25, rewards
  for r in records:
    assert r["generation_rounds"] in (1, 2) and 0 <= r["signal_groups"] <= 4
    assert r["zero_signal_groups"] == pytest.approx(1 - r["signal_groups"] / 4)
  assert abs(records[0]["kl_penalty"]) < 1e-5 and abs(records[0]["kl_to_start"]) < 1e-5
  assert records[-1]["kl_to_start"] > 1e-4 and records[-1]["kl_penalty"] > 1e-4


@pytest.mark.slow
def test_distillation_advantage_is_the_teacher_gap(small, uninterrupted, tmp_path, stop_early,
                                                   helpers):
  """`score` with a teacher: advantage = (teacher logp - rollout logp) on generated tokens, 0
  elsewhere; and one distillation step from the teacher checkpoint runs."""
  config, params = small
  env = envs.make("addition")
  samples = rollout.generate_samples(config, params, env,
                                     [env.task(i, "train") for i in range(32)], seed=1,
                                     group_size=1)
  model = ModelConfig.from_config(config.model)
  teacher_params = helpers.random_params(model, seed=1)
  batch = rl_update.score(config, samples, {rl_update.ANY_TASK: (model, teacher_params)})
  teacher = np.asarray(rl_step.policy_logprobs(model, teacher_params, batch))
  mask = batch["loss_mask"] > 0
  np.testing.assert_allclose(batch["advantages"][mask],
                             (teacher - batch["rollout_logp"])[mask], atol=1e-5)
  assert not batch["advantages"][~mask].any()
  # The teacher likes some sampled tokens more than the student and some less: both signs.
  assert (batch["advantages"][mask] > 0).any() and (batch["advantages"][mask] < 0).any()

  distill = small_config(env="stop_early", loss="distill", group_size=1, prompts_per_step=32,
                         teacher=str(uninterrupted[0]), steps=1)
  summary = loop.rl_train(distill, str(tmp_path), params=params)
  assert summary["steps"] == 1 and np.isfinite(summary["last_metrics"]["loss"])
  assert summary["last_metrics"]["advantage_abs_mean"] > 0


# experiments/rl.py's flags of the CLI tests: a 3-step SFT of a 2-layer model, then 2 RL steps.
TINY_RL_FLAGS = [
    "--config.model.num_hidden_layers=2", "--config.sft.model.num_hidden_layers=2",
    "--config.sft.train.steps=3", "--config.sft.train.dsa_dense_steps=0",
    "--config.sft.optim.warmup_steps=1", "--config.sft.sft.num_per_env=40",
    "--config.sft.data.batch_size=4", "--config.sft.eval.every_steps=0",
    "--config.sft.ckpt.every_steps=3", "--config.sft.train.log_every_steps=1",
    "--config.rl.steps=2", "--config.rl.prompts_per_step=2", "--config.rl.group_size=2",
    "--config.rl.max_new_tokens=8", "--config.rl.eval_tasks=4", "--config.rl.eval_samples=2",
    "--config.rl.eval_every_steps=2", "--config.optim.warmup_steps=0",
    "--config.ckpt.every_steps=2", "--config.data.seq_len=32",
    "--config.rl.dynamic_sampling_rounds=0"]


def _cli_snapshot(workdir):
  """Per stage of an experiments/rl.py workdir: None when its directory does not exist, else
  the checkpoint steps it has saved."""
  def saved(stage):
    if not (workdir / stage).exists():
      return None
    directory = workdir / stage / "checkpoints"
    return sorted(d for d in os.listdir(directory) if d.isdigit()) if directory.is_dir() else []
  return {"sft": saved("sft"), "rl": saved("rl")}


@pytest.fixture(scope="module")
def rl_cli_runs(tmp_path_factory):
  """experiments/rl.py (through tests/train_cli.py) with TINY_RL_FLAGS, four times in one
  workdir, as test_cli_stops_and_resumes_each_stage_and_checks_the_rl_config_first describes:
  a bad RL config, two runs stopped by SIGTERM, one to the end. Returns the workdir and, per
  run, its finished process and `_cli_snapshot` of the workdir right after it.

  Module-scoped: the seeds study's first run (the same command, the same seeds) starts from
  this finished workdir instead of training the same SFT and RL again."""
  workdir = tmp_path_factory.mktemp("rl_cli")
  args = [sys.executable, "tests/train_cli.py", "--script=experiments/rl.py",
          f"--workdir={workdir}", *TINY_RL_FLAGS]
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  runs = []
  for extra, hooks in [(["--config.rl.group_size=1"], []), ([], ["sigterm_after_log:1"]),
                       ([], ["sigterm_after_log:1"]), ([], [])]:
    proc = subprocess.run(args[:2] + [f"--hook={h}" for h in hooks] + args[2:] + extra,
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    runs.append((proc, _cli_snapshot(workdir)))
  return workdir, runs


@pytest.mark.slow
def test_cli_stops_and_resumes_each_stage_and_checks_the_rl_config_first(rl_cli_runs):
  """experiments/rl.py with no rl.init_from: a 3-step SFT, then 2 RL steps from it.

  A bad RL config fails before any SFT step. A SIGTERM during SFT step 1 (after that step's
  stop decision: it stops at step 2, saved) stops the pipeline with exit 75, and RL never
  starts on the partial SFT model; the rerun resumes the SFT, finishes it, starts RL and
  (SIGTERM again, at RL step 1's metrics, before its stop decision) stops after RL step 1 with
  it saved (75); the third run resumes RL, and its "before RL" figure is step 0's evaluation,
  made by the second run."""
  workdir, runs = rl_cli_runs
  (proc, saved) = runs[0]
  assert proc.returncode == 1 and "rl.group_size" in proc.stderr, proc.stderr[-3000:]
  assert saved["sft"] is None

  (proc, saved) = runs[1]
  assert proc.returncode == 75, proc.stderr[-3000:]
  assert "SFT stopped early" in proc.stdout and saved["rl"] is None
  assert saved["sft"] == ["2"]

  (proc, saved) = runs[2]  # SFT writes step 3 only; RL step 1 gets the signal
  assert proc.returncode == 75, proc.stderr[-3000:]
  assert "step 3/3" in proc.stderr and "rl step 1/2" in proc.stderr
  assert "RL stopped early" in proc.stdout and saved["rl"] == ["1"]

  (proc, _) = runs[3]
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["steps"] == 2 and "rl step 2/2" in proc.stderr
  assert "rl step 1/2" not in proc.stderr
  evals = {r["step"]: r for r in map(json.loads, open(workdir / "rl" / "metrics.jsonl"))
           if r["split"] == "eval"}
  assert set(evals) == {0, 2}
  assert result["first_eval"] == evals[0]["accuracy"]
  assert result["first_sampled_eval"] == evals[0]["sampled_accuracy"]
  assert os.path.isfile(workdir / "sft" / "sft_builtin.jsonl")


@pytest.mark.slow
def test_seeds_study_runs_each_rl_seed_from_its_sft_seeds_start(tmp_path, rl_cli_runs):
  """tools/seeds.py, 1 SFT seed x 2 RL seeds of the CLI test's tiny run: the second RL seed
  starts from the first one's SFT run, the table has both rows, and a rerun skips done runs.

  The first run, sft0_rl0, is the CLI test's command with --config.sft.seed=0
  --config.rl.seed=0 (both seeds' defaults): its workdir starts as a copy of the CLI test's
  finished one, which the study resumes (both stages done: a checkpoint restore, no step), so
  the SFT and RL the CLI test trained are not trained again here. That experiments/rl.py trains
  the SFT start of a run without rl.init_from is the CLI test's to prove."""
  workdir, runs = rl_cli_runs
  assert runs[-1][0].returncode == 0, runs[-1][0].stderr[-3000:]
  shutil.copytree(workdir, tmp_path / "sft0_rl0")
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  command = [sys.executable, "tools/seeds.py", f"--root={tmp_path}", "--sft_seeds=0",
             "--rl_seeds=0,1", "--parallel=1", "--", *TINY_RL_FLAGS]
  proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.load(open(tmp_path / "seeds.json"))
  assert [r["run"] for r in out["rows"]] == ["sft0_rl0", "sft0_rl1"]
  assert all(r["eval_steps"] == [0, 2] for r in out["rows"])
  assert os.path.isdir(tmp_path / "sft0_rl0" / "sft") and not os.path.exists(
      tmp_path / "sft0_rl1" / "sft")
  assert f"RL starts from {tmp_path / 'sft0_rl0' / 'sft'} (step 3)" in open(
      tmp_path / "sft0_rl1" / "seeds.log").read()
  assert "| sft0_rl1 | 0 | 1 |" in proc.stdout and "mean ± 95% t" in proc.stdout
  again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0 and "2 runs (2 done)" in again.stderr, again.stderr[-2000:]
