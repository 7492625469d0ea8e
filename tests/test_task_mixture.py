"""The RL task mixture (glm5_jax/posttrain/tasks.py, envs/mixture.py): bad input is a
ConfigError naming the field before anything is built, the mixture's draws follow the weights
and rebuild from an index, per-task staleness limits, and a short synchronous run logs
per-task metrics and per-task held-out accuracy."""

import collections
import json

import pytest

from configs import rl_tiny
from glm5_jax.config import ConfigError
from glm5_jax.posttrain import loop, tasks
from glm5_jax.posttrain.envs.mixture import Mixture
from glm5_jax.posttrain.rl_config_checks import validate_rl_experiment
from glm5_jax.rl import staleness


def mixture_config(**entries):
  config = rl_tiny.get_config("recipe=plain")
  config.rl.env = "mixture"
  for name, entry in entries.items():
    config.rl.tasks[name] = entry
  return config


@pytest.mark.parametrize("edit,field,message", [
    (lambda c: c.rl.tasks.update(chess=tasks.task_config()), "rl.tasks.chess",
     "unknown environment 'chess'"),
    (lambda c: c.rl.tasks.addition.update(weight=0.0), "rl.tasks",
     "must sum to a positive number"),
    (lambda c: c.rl.tasks.addition.update(weight=-1.0), "rl.tasks.addition.weight", ">= 0"),
    (lambda c: c.rl.tasks.addition.update(weight=float("nan")), "rl.tasks.addition.weight",
     "finite"),
    (lambda c: c.rl.tasks.addition.options.update(digits=0), "rl.tasks.addition.options",
     "digits"),
    (lambda c: c.rl.tasks.addition.update(max_staleness=2), "rl.tasks.addition.max_staleness",
     "rl.max_staleness=1"),
    (lambda c: c.rl.tasks.addition.update(wieght=1.0), "rl.tasks.addition.wieght",
     "unknown field"),
    (lambda c: c.rl.sandbox.update(wall_seconds=0.0), "rl.sandbox.wall_seconds", "> 0"),
    (lambda c: c.rl.sandbox.update(memory_bytes=-5), "rl.sandbox.memory_bytes", "> 0"),
    (lambda c: c.rl.sandbox.update(processes=0), "rl.sandbox.processes", "> 0"),
    (lambda c: c.rl.update(env="addition"), "rl.tasks", "needs rl.env='mixture'"),
    (lambda c: c.rl.env_options.update(digits=2), "rl.env_options", "rl.tasks.<env>.options"),
    (lambda c: c.rl.tasks.addition.options.update(sandbox={}), "rl.tasks.addition.options",
     "unknown option"),
])
def test_bad_mixture_is_an_error_naming_the_field(edit, field, message):
  config = mixture_config(addition=tasks.task_config(1.0))
  edit(config)
  with pytest.raises(ConfigError, match=f"config.{field}.*{message}"):
    validate_rl_experiment(config)


def test_single_env_errors_name_the_field():
  config = rl_tiny.get_config("recipe=plain")
  config.rl.env = "chess"
  with pytest.raises(ConfigError, match="config.rl.env: unknown environment 'chess'"):
    validate_rl_experiment(config)
  config.rl.env = "mixture"
  with pytest.raises(ConfigError, match="config.rl.tasks: .* needs at least one task"):
    validate_rl_experiment(config)
  config = rl_tiny.get_config("recipe=plain")
  config.rl.env = "code"
  config.rl.env_options.sandbox = {"wall_seconds": 1.0}
  with pytest.raises(ConfigError, match="config.rl.env_options.sandbox: set the sandbox"):
    validate_rl_experiment(config)


def test_mixture_draws_follow_the_weights_and_rebuild_from_the_index():
  config = mixture_config(addition=tasks.task_config(3.0), strings=tasks.task_config(1.0),
                          countdown=tasks.task_config(0.0))
  validate_rl_experiment(config)
  env = tasks.make_env(config.rl)
  assert isinstance(env, Mixture) and env.max_turns == 1
  drawn = [env.task(i, "train") for i in range(2000)]
  counts = collections.Counter(t.env for t in drawn)
  assert counts["countdown"] == 0 and abs(counts["addition"] / 2000 - 0.75) < 0.04, counts
  for t in drawn[:50]:
    assert env.task(t.index, "train") == t == env.envs[t.env].task(t.index, "train")
    solution = env.worked_solution(t)
    assert env.step(t, solution).reward == 1.0
  assert tasks.member_envs(env).keys() == {"addition", "strings", "countdown"}
  with_calc = tasks.make_env(mixture_config(addition=tasks.task_config(),
                                            calculator=tasks.task_config(max_turns=4)).rl)
  assert with_calc.max_turns == 4


def test_per_task_staleness_limits():
  config = mixture_config(addition=tasks.task_config(1.0, max_staleness=0),
                          strings=tasks.task_config(1.0))
  config.rl.max_staleness = 2
  validate_rl_experiment(config)
  assert tasks.staleness_limit(config.rl, "addition") == 0
  assert tasks.staleness_limit(config.rl, "strings") == 2
  single = rl_tiny.get_config("recipe=plain")
  assert tasks.staleness_limit(single.rl, "addition") == single.rl.max_staleness
  admission = staleness.StalenessAdmission(2)
  assert admission.admit(1) and not admission.admit(1, limit=0)
  assert (admission.admitted, admission.rejected) == (1, 1)


@pytest.mark.slow
def test_short_mixture_run_logs_per_task_metrics_and_held_out_accuracy(tmp_path):
  """One step of a two-task mixture: the step's metrics per task, held-out accuracy per task
  (before and after) and their mean."""
  from tests.test_rl_loop import small_config  # pylint: disable=import-outside-toplevel
  # eval_tasks=32: each env's greedy evaluation fills the 32 slots of the rollout engine
  # (4 prompts x 8 samples), so it runs the rollout's compiled programs (an engine's programs
  # are fixed by its slots and max_len); 4 tasks made a 4-slot engine, compiled for it alone.
  config = small_config(steps=1, eval_every_steps=1, eval_tasks=32, eval_samples=0)
  config.rl.env = "mixture"
  config.rl.tasks.addition = tasks.task_config(1.0, digits=1)
  config.rl.tasks.strings = tasks.task_config(1.0, min_len=1, max_len=3)
  summary = loop.rl_train(config, str(tmp_path))
  lines = [json.loads(line) for line in open(summary["metrics_file"])]
  train = [m for m in lines if "loss" in m]
  assert len(train) == 1, lines
  per_task = {k for k in train[0] if "/" in k and k.split("/")[0] in ("addition", "strings")}
  assert {"addition/reward", "addition/accuracy", "addition/samples"} <= per_task, per_task
  assert sum(train[0].get(f"{n}/samples", 0) for n in ("addition", "strings")) == 32
  assert sorted(summary["eval"]) == [0, 1]
  for evals in summary["eval"].values():
    for name in ("addition", "strings"):
      assert 0 <= evals[f"{name}/accuracy"] <= 1
    assert evals["accuracy"] == pytest.approx((evals["addition/accuracy"] +
                                               evals["strings/accuracy"]) / 2)


def test_async_intake_applies_each_tasks_staleness_limit(tmp_path):
  """Rollouts one version old: the task with max_staleness 0 is re-queued, the one that uses
  rl.max_staleness (1) is trained on."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from glm5_jax.rl import async_trainer, trajectories  # pylint: disable=import-outside-toplevel
  from glm5_jax.rl.layout import RunDirs  # pylint: disable=import-outside-toplevel
  from glm5_jax.rl.orchestrator import Orchestrator  # pylint: disable=import-outside-toplevel
  from tests.test_rl_async import small_async_config  # pylint: disable=import-outside-toplevel
  config = small_async_config()
  config.rl.env = "mixture"
  config.rl.tasks.addition = tasks.task_config(1.0, max_staleness=0)
  config.rl.tasks.strings = tasks.task_config(1.0)
  validate_rl_experiment(config)
  orch = Orchestrator(tmp_path, ["w0"], groups_per_step=2, max_staleness=1, total_steps=3,
                      group_size=4)
  intake = async_trainer._Intake(config, RunDirs.at(tmp_path), orch,  # pylint: disable=protected-access
                                 trajectories.TrajectoryLedger(), 0)
  orders = orch.issue(0)
  assert len(orders) == 4
  mask = np.float32([0, 1, 1])
  for k, order in enumerate(orders):
    env_name = "addition" if k < 2 else "strings"
    record = trajectories.TrajectoryRecord(
        np.int32([5, 6, 7]), np.float32([0, -1, -2]), mask, np.int32([-1, 0, 0]), 1.0,
        {"task": order.task, "turns": 1, "env": env_name})
    trajectories.write_batch(RunDirs.at(tmp_path).rollouts, [record], worker=order.worker,
                             batch_index=order.id)
  plan = intake.plan(1, 1)
  names = {o.rollout_name: ("addition" if k < 2 else "strings") for k, o in enumerate(orders)}
  assert sorted(names[n] for n, _, _ in plan["reject"]) == ["addition", "addition"]
  assert all(limit == 0 for _, _, limit in plan["reject"])
  assert sorted(names[n] for n, _ in plan["take"]) == ["strings", "strings"]


def test_a_problem_has_one_split_in_every_env():
  """The code env's functions and repo_repair's repaired ones, addition and the calculator at
  equal digits: a held-out problem of one is never a training problem of the other."""
  from glm5_jax.posttrain import envs  # pylint: disable=import-outside-toplevel
  for a, b in [(envs.make("code"), envs.make("repo_repair")),
               (envs.make("addition"), envs.make("calculator", digits=2, operations="+"))]:
    for x, y in ((a, b), (b, a)):
      eval_keys = {x.task(i, "eval").key for i in range(40)}
      train_keys = {y.task(i, "train").key for i in range(400)}
      assert eval_keys and not eval_keys & train_keys, (x.name, y.name)
      assert {y.split_of_key(k) for k in eval_keys} == {"eval"}


def test_a_mixture_refuses_a_member_whose_split_leaks():
  from glm5_jax.posttrain import envs  # pylint: disable=import-outside-toplevel
  from glm5_jax.posttrain.envs import addition, base  # pylint: disable=import-outside-toplevel
  from glm5_jax.seeds import problem_hash  # pylint: disable=import-outside-toplevel

  class PerNameSplit(addition.Addition):  # the old rule: the env's name in the split hash
    def split_of_key(self, key):
      return "eval" if problem_hash("split", self.name, key) % base.EVAL_SHARE == 0 else "train"

  calc = envs.make("calculator", digits=2, operations="+")
  with pytest.raises(ValueError, match=r"^mixture: splits leak across environments: \d+ of 16 "
                     r"eval problems of 'addition' are train problems of 'calculator'"):
    Mixture({"addition": (PerNameSplit(), 1.0), "calculator": (calc, 1.0)})
  Mixture({"addition": (envs.make("addition"), 1.0), "calculator": (calc, 1.0)})


def test_the_shipped_agentic_mixture_builds():
  from configs import rl_agentic  # pylint: disable=import-outside-toplevel
  from glm5_jax.posttrain import sandbox  # pylint: disable=import-outside-toplevel
  rl = rl_agentic.get_config("task=mixture").rl
  rl.sandbox.allow_unsafe = sandbox.isolation().mode == "none"  # built, never run here
  mixture = tasks.make_env(rl)
  assert set(mixture.envs) == {"code", "repo_repair", "addition"}
