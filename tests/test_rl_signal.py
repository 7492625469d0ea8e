"""What tells RL signal from noise (glm5_jax/posttrain/learning_signal.py), the addition env's checked
reward, the KL penalty's estimator, and the seeds study's intervals and tables
(glm5_jax/sweeps/intervals.py, seeds.py). Host code only: nothing here compiles a model."""

import itertools
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.posttrain import envs, learning_signal
from glm5_jax.posttrain.envs import addition
from glm5_jax.posttrain.rollout import Sample, rollout_metrics
from glm5_jax.sweeps import intervals, seeds


def _sample(group, reward, *, correct=None, reasoning_ok=None, length=4, task=None):
  info = {} if reasoning_ok is None else {"reasoning_ok": reasoning_ok}
  mask = np.ones(length, np.float32)
  return Sample(task=task, group=group, tokens=np.zeros(length, np.int32),
                rollout_logp=np.zeros(length, np.float32), loss_mask=mask, reward=reward,
                correct=bool(reward) if correct is None else correct, turns=1, messages=[],
                info=info)


# ---- the addition env's checked reward ---------------------------------------------------------


def test_checked_reward_pays_only_answers_reached_through_the_worked_columns():
  outcome, checked = envs.make("addition"), envs.make("addition", reward="checked")
  for i in range(20):
    task = outcome.task(i, "train")
    assert checked.task(i, "train") == task  # a scoring option never changes the problem
    solution = outcome.worked_solution(task)
    for env in (outcome, checked):
      step = env.step(task, solution)
      assert step.reward == 1.0 and step.info["reasoning_ok"] and step.info["correct"]
    a, b = task.info["a"], task.info["b"]
    lucky = dict(solution[-1], thinking=addition.addition_steps(a, b).replace(
        f"{a % 10}+{b % 10}=", f"{a % 10}+{b % 10}=x", 1))
    convo = solution[:-1] + [lucky]
    assert outcome.step(task, convo).reward == 1.0
    step = checked.step(task, convo)
    assert step.reward == 0.0 and step.info["correct"] and not step.info["reasoning_ok"]
    wrong = dict(solution[-1], content=str(int(task.answer) + 1))
    step = checked.step(task, solution[:-1] + [wrong])
    assert step.reward == 0.0 and not step.info["correct"] and step.info["reasoning_ok"]
  with pytest.raises(ValueError, match="'reward' must be one of"):
    envs.make("addition", reward="lenient")


def test_carries_match_the_worked_steps():
  for a, b in itertools.product(range(0, 200, 7), range(0, 200, 11)):
    steps = addition.addition_steps(a, b)
    columns = steps.split(": ")[1].split(", ")  # "x+y=t", or "x+y+1=t" after a carry
    expected = sum(bool(re.fullmatch(r"\d\+\d\+1=\d+", c)) for c in columns)
    expected += steps.endswith("carry 1")
    assert addition.carries(a, b, "+") == expected, (a, b, steps)
    big, small = max(a, b), min(a, b)
    assert addition.carries(big, small, "-") == addition.subtraction_steps(big, small).count("b1")
  env = envs.make("addition")
  assert {env.difficulty(env.task(i, "train")) for i in range(50)} == {
      "carries_0", "carries_1", "carries_2"}


# ---- signal metrics, the null control, dynamic sampling -----------------------------------------


def test_shuffle_rewards_permutes_within_each_group_only():
  rewards = np.asarray([1, 0, 0, 1, 1, 1, 0, 0, 0.5, 0], np.float32)
  groups = np.asarray([0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
  seen = set()
  for seed in range(20):
    out = learning_signal.shuffle_rewards(rewards, groups, np.random.default_rng(seed))
    for g in np.unique(groups):
      assert sorted(out[groups == g]) == sorted(rewards[groups == g])
    seen.add(tuple(out))
  assert len(seen) > 3  # it does permute


def test_select_signal_groups_prefers_groups_with_signal_and_keeps_the_shape():
  pool = [_sample(g, r) for g, rs in enumerate([(0, 0), (1, 0), (1, 1), (0, 1), (0, 0)])
          for r in rs]
  kept, with_signal = learning_signal.select_signal_groups(pool, 3)
  assert with_signal == 2 and len(kept) == 6
  assert [s.group for s in kept] == [0, 0, 1, 1, 2, 2]
  assert [s.reward for s in kept] == [1, 0, 0, 1, 0, 0]  # groups 1, 3, then 0 (all equal)
  with pytest.raises(ValueError, match="5 groups generated, 6 needed"):
    learning_signal.select_signal_groups(pool, 6)


def test_batch_signal_metrics_counts_lucky_advantage_and_silent_groups():
  env = envs.make("addition")
  task = env.task(0, "train")
  samples = [_sample(0, 1.0, reasoning_ok=True, length=10, task=task),
             _sample(0, 1.0, reasoning_ok=False, length=30, task=task),  # lucky
             _sample(0, 0.0, reasoning_ok=False, length=5, task=task),
             _sample(1, 0.0, reasoning_ok=True, task=task),
             _sample(1, 0.0, reasoning_ok=True, task=task)]
  advantages = np.asarray([0.5, 0.5, -1.0, 0.0, 0.0])
  m = learning_signal.batch_signal_metrics(samples, advantages, difficulty=env.difficulty)
  assert m["zero_signal_groups"] == 0.5
  assert m["lucky_fraction"] == 0.5
  assert m["lucky_advantage_share"] == pytest.approx(0.5 * 30 / (0.5 * 10 + 0.5 * 30))
  label = env.difficulty(task)
  assert m[f"reward_{label}"] == pytest.approx(0.4) and m[f"samples_{label}"] == 5
  metrics = rollout_metrics(samples)
  assert metrics["lucky"] == pytest.approx(0.2) and metrics["reasoning_ok"] == pytest.approx(0.6)


def test_kl_to_reference_matches_the_exact_kl_in_expectation():
  """k3 over tokens sampled from pi estimates KL(pi || ref); here with many draws of a
  4-way distribution, against the exact sum in float64."""
  rng = np.random.default_rng(0)
  pi, ref = np.asarray([0.5, 0.2, 0.2, 0.1]), np.asarray([0.25, 0.25, 0.25, 0.25])
  tokens = rng.choice(4, size=(200, 100), p=pi)
  estimate = learning_signal.kl_to_reference(np.log(pi)[tokens], np.log(ref)[tokens], np.ones((200, 100)))
  exact = float(np.sum(pi * np.log(pi / ref)))
  assert estimate == pytest.approx(exact, rel=0.05)
  assert learning_signal.kl_to_reference(np.log(pi)[tokens], np.log(pi)[tokens], np.ones((200, 100))) == 0


def test_reference_kl_penalty_is_zero_at_the_reference_and_pulls_toward_it():
  ref = jnp.asarray([[-1.0, -2.0, -0.5, -300.0]])
  mask = jnp.asarray([[1.0, 1.0, 1.0, 0.0]])  # the padding's log-prob never reaches exp
  kl = lambda logp: (learning_signal.k3_kl(logp, ref, mask, xp=jnp) * mask).sum()
  assert float(kl(ref)) == 0.0
  logp = jnp.asarray([[-0.5, -3.0, -0.5, 0.0]])
  grad = jax.grad(kl)(logp)
  assert np.isfinite(np.asarray(grad)).all()
  assert grad[0, 0] > 0 and grad[0, 1] < 0 and grad[0, 2] == 0 and grad[0, 3] == 0


# ---- intervals and the seeds study ---------------------------------------------------------------


def test_t_quantiles_and_intervals():
  # scipy.stats.t.ppf(0.975, df), to 6 decimals
  for df, t in ((1, 12.706205), (2, 4.302653), (5, 2.570582), (30, 2.042272), (31, 2.039513),
                (45, 2.014103), (60, 2.000298), (1000, 1.962339)):
    assert intervals.t_quantile_975(df) == pytest.approx(t, abs=1e-3)
  s = intervals.mean_interval([0.30, 0.40, 0.50])
  assert s["mean"] == pytest.approx(0.4)
  assert s["half_width"] == pytest.approx(4.303 * 0.1 / math.sqrt(3))
  assert intervals.format_interval(s, scale=100) == "40.0 ± 24.8"
  assert intervals.excludes_zero(intervals.mean_interval([0.1, 0.12, 0.14]))
  assert not intervals.excludes_zero(s | {"low": -0.1, "high": 0.2})
  assert intervals.mean_interval([0.2])["half_width"] is None
  with pytest.raises(ValueError, match="finite"):
    intervals.mean_interval([0.1, float("nan")])


def test_seeds_study_plans_shared_starts_and_summarizes_runs(tmp_path):
  runs = seeds.plan_runs(str(tmp_path), [0, 1], [0, 1])
  assert [r.name for r in runs] == ["sft0_rl0", "sft0_rl1", "sft1_rl0", "sft1_rl1"]
  assert runs[1].start_from == runs[0].workdir and runs[0].start_from == ""
  command = seeds.run_command(runs[1], ["--mode=async"])
  assert command[2] == "--mode=async" and "--config.sft.seed=0" in command
  assert f"--config.rl.init_from={runs[0].workdir}/sft" in command
  with pytest.raises(ValueError, match="distinct"):
    seeds.plan_runs(str(tmp_path), [0, 0], [1])
  for run, (before, after) in zip(runs, [(0.3, 0.45), (0.3, 0.41), (0.35, 0.5), (0.35, 0.47)]):
    os.makedirs(os.path.join(run.workdir, "rl"))
    with open(os.path.join(run.workdir, "rl", "metrics.jsonl"), "w") as f:
      for step, acc in ((0, before), (50, (before + after) / 2), (100, after)):
        f.write(json.dumps({"split": "eval", "step": step, "accuracy": acc}) + "\n")
      f.write(json.dumps({"split": "train", "step": 1, "reward": 0.1}) + "\n")
  rows = [seeds.read_result(r) for r in runs]
  assert rows[0]["accuracy_change"] == pytest.approx(0.15) and rows[0]["eval_steps"] == [0, 50, 100]
  summary = seeds.summarize(rows)
  assert list(summary) == ["accuracy"]
  assert summary["accuracy"]["change"]["mean"] == pytest.approx(0.1325)
  assert summary["accuracy"]["change_min"] == pytest.approx(0.11) and summary["accuracy"]["effect"]
  assert summary["accuracy"]["by_sft_seed"] == {0: pytest.approx(0.13), 1: pytest.approx(0.135)}
  table = seeds.markdown(rows, summary)
  assert "| accuracy | 32.5 ± 4.6 | 45.7 ± 6.0 | 13.2 ±" in table and "| sft1_rl1 | 1 | 1 | 35.0 -> 47.0 |" in table
  with open(os.path.join(runs[0].workdir, "rl", "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"split": "eval", "step": 0, "accuracy": 0.3}) + "\n")
  with pytest.raises(ValueError, match="1 held-out evaluation"):
    seeds.read_result(runs[0])


def test_compare_pairs_two_studies_run_by_run():
  row = lambda name, curve: {"run": name, "eval_steps": [0, 50, 100], "accuracy_curve": curve,
                             "accuracy_change": curve[-1] - curve[0]}
  sync = [row("sft0_rl0", [0.3, 0.35, 0.45]), row("sft1_rl0", [0.5, 0.5, 0.6]),
          row("sft2_rl0", [0.2, 0.3, 0.4])]
  # the async runs gain 0.05, 0.07, 0.03 more than their sync twins; sft9_rl0 has no twin
  other = [row("sft0_rl0", [0.3, 0.4, 0.5]), row("sft1_rl0", [0.5, 0.6, 0.67]),
           row("sft2_rl0", [0.2, 0.3, 0.43]), row("sft9_rl0", [0.1, 0.1, 0.9])]
  out = seeds.compare(sync, other)
  assert out["runs"] == ["sft0_rl0", "sft1_rl0", "sft2_rl0"]
  diff = out["accuracy"]["difference"]
  assert diff["mean"] == pytest.approx(0.05) and diff["n"] == 3
  assert diff["half_width"] == pytest.approx(4.303 * 0.02 / math.sqrt(3))
  assert out["accuracy"]["effect"]
  assert [c["mean"] for c in out["accuracy"]["curve"]] == pytest.approx([1 / 3, 1.3 / 3, 1.6 / 3])
  table = seeds.comparison_markdown(out, "sync", "async")
  assert "| accuracy | 15.0 ± 12.4 | 20.0 ± 7.5 | 5.0 ± 5.0 | yes |" in table
  assert "| accuracy (%) at RL step | 0 | 50 | 100 |" in table and "| async | 33.3 ± " in table
  assert "| difference (paired) | 0.0 ± 0.0 | 5.0 ± 12.4 | 5.0 ± 5.0 |" in table
  with pytest.raises(ValueError, match="sft0_rl0 evaluated at steps"):
    seeds.compare(sync, [row("sft0_rl0", [0.3, 0.4, 0.5]) | {"eval_steps": [0, 25, 100]}])
  with pytest.raises(ValueError, match="no run in both"):
    seeds.compare(sync, [row("sft5_rl0", [0.3, 0.4, 0.5])])


def test_seeds_study_of_the_staged_pipeline_reads_pipeline_json(tmp_path):
  """A staged pipeline run is read from its pipeline.json: every checkpoint's accuracy per task,
  and what each stage changed, paired over the runs."""
  from glm5_jax.posttrain import pipeline  # pylint: disable=import-outside-toplevel
  assert seeds.pipeline_seeds.STATE_FILE == pipeline.STATE_FILE
  runs = seeds.plan_runs(str(tmp_path), [0, 1, 2], [0])
  # strings: 0.9 at the start, forgotten by the agentic stage (-0.6, -0.5, -0.55), recovered
  for run, (a, forget) in zip(runs, [(0.90, 0.6), (0.92, 0.5), (0.88, 0.55)]):
    os.makedirs(run.workdir)
    rows = {"sft": {"addition": a, "strings": 0.9}, "agentic": {"addition": a, "strings": 0.9 - forget},
            "general": {"addition": a + 0.02, "strings": 0.99}}
    with open(os.path.join(run.workdir, "pipeline.json"), "w") as f:
      json.dump({"rows": rows, "envs": ["addition", "strings"], "seconds": {}, "stopped": None,
                 "teachers": {"strings": "general"}}, f)
  rows = [seeds.read_result(r) for r in runs]
  assert rows[1]["accuracy"]["agentic"] == {"addition": 0.92, "strings": pytest.approx(0.4),
                                            "mean": pytest.approx(0.66)}
  summary = seeds.summarize(rows)
  assert summary["checkpoints"] == ["sft", "agentic", "general"] and summary["n"] == 3
  forgot = summary["stage"]["agentic"]["strings"]
  assert forgot["mean"] == pytest.approx(-0.55) and forgot["effect"]
  assert forgot["half_width"] == pytest.approx(4.303 * 0.05 / math.sqrt(3))
  assert not summary["stage"]["agentic"]["addition"]["effect"]  # no change at all: no interval
  table = seeds.markdown(rows, summary)
  assert "| sft | 90.0 ± 5.0 | 90.0 ± 0.0 | 90.0 ± 2.5 |" in table
  assert "| agentic | +0.0 ± 0.0 | -55.0 ± 12.4 * | -27.5 ± 6.2 * |" in table
  assert "| sft1_rl0 | 1 | 0 | 91.0 | 66.0 | 96.5 | strings <- general |" in table
  with pytest.raises(ValueError, match="not compared run by run"):
    seeds.compare(rows, rows)
  with open(os.path.join(runs[2].workdir, "pipeline.json"), "w") as f:
    json.dump({"rows": {"sft": {"addition": 0.9, "strings": 0.9}}, "envs": ["addition", "strings"],
               "stopped": "agentic"}, f)
  with pytest.raises(ValueError, match="not finished .*'agentic'"):
    seeds.read_result(runs[2])
  other = dict(rows[2], checkpoints=["sft", "general"], run="sft2_rl0")
  with pytest.raises(ValueError, match="run sft2_rl0 has checkpoints"):
    seeds.summarize(rows[:2] + [other])


def test_score_under_the_null_control_uses_rewards_shuffled_within_groups():
  """`rl_update.score`'s GRPO advantages: of the env's rewards, or under the null control of the
  rewards permuted within each group by a permutation drawn from (rl.seed, step)."""
  from configs import rl_tiny  # pylint: disable=import-outside-toplevel
  from glm5_jax.posttrain import algorithms, rl_update  # pylint: disable=import-outside-toplevel
  config = rl_tiny.get_config("recipe=plain")
  rng = np.random.default_rng(0)
  samples = [_sample(g, float(r), length=3) for g in range(6) for r in rng.integers(0, 2, 4)]
  rewards = np.asarray([s.reward for s in samples], np.float32)
  groups = np.asarray([s.group for s in samples])
  advantages = lambda b: b["advantages"][:, 1]
  plain = rl_update.score(config, samples, step=3)
  expected = algorithms.group_advantages(rewards, groups, normalize_std=True)
  np.testing.assert_allclose(advantages(plain), expected, atol=1e-6)
  config.rl.null_reward_control = True
  null = rl_update.score(config, samples, step=3)
  assert not np.allclose(advantages(null), advantages(plain))
  for g in range(6):  # same advantage sizes per group, reassigned among its samples
    np.testing.assert_allclose(sorted(advantages(null)[groups == g]),
                               sorted(advantages(plain)[groups == g]), atol=1e-6)
  np.testing.assert_array_equal(advantages(rl_update.score(config, samples, step=3)),
                                advantages(null))
