"""The staged post-training pipeline (glm5_jax/posttrain/pipeline.py): its config checks, the
per-task teachers of the distillation's advantages against hand-computed values, and the
stage orchestration (start checkpoints, teacher choice, stop and resume) with the RL runs
replaced by recorders. The real run (SFT, three RL stages, distillation) is docs/posttrain.md's
table; its one-step-per-stage smoke run takes minutes of compilation, over this file's budget."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import rl_staged
from glm5_jax.config import ConfigError
from glm5_jax.posttrain import (algorithms, envs, loop, pipeline, rl_step, rl_update,
                                tasks as tasks_lib)
from glm5_jax.posttrain.config import validate_rl_config
from glm5_jax.posttrain.envs.base import Task
from glm5_jax.posttrain.pipeline_config import (distill_task, stage_config, stage_rl_config,
                                                validate_pipeline)
from glm5_jax.posttrain.rollout import Sample


def _config(tmp_path=None):
  config = rl_staged.get_config("stage_steps=2,distill_steps=2,sft_steps=4,eval_tasks=2,prompts=2")
  if tmp_path is not None:  # start from an existing "checkpoint" directory instead of an SFT
    config.rl.init_from = str(tmp_path / "start")
    (tmp_path / "start").mkdir()
  return config


def test_the_shipped_config_is_valid():
  validate_pipeline(_config())


@pytest.mark.parametrize("edit, field", [
    (lambda c: setattr(c.stages.reasoning, "start", "previous"), "config.stages.reasoning.start"),
    (lambda c: setattr(c.stages.agentic, "start", "general"), "config.stages.agentic.start"),
    (lambda c: setattr(c.stages.agentic, "start", "/nonexistent/wt-stages"),
     "config.stages.agentic.start"),
    (lambda c: setattr(c.distill, "start", "nowhere"), "config.distill.start"),
    (lambda c: setattr(c.stages.agentic.rl, "env", "calculater"),
     "config.stages.agentic.rl.env"),
    (lambda c: c.stages.agentic.rl.update({"steps_": 3}), "config.stages.agentic.rl"),
    (lambda c: setattr(c.stages.general.rl, "steps", 0), "config.stages.general.rl.steps"),
    (lambda c: setattr(c.distill.rl, "steps", -1), "config.distill.rl.steps"),
    (lambda c: setattr(c.distill.tasks.strings, "weight", 0.0),
     "config.distill.tasks.strings.weight"),
    (lambda c: setattr(c.distill.tasks.strings, "weight", -1.0),
     "config.distill.tasks.strings.weight"),
    (lambda c: setattr(c.distill.tasks.strings, "teacher", "tomorrow"),
     "config.distill.tasks.strings.teacher"),
    (lambda c: c.distill.tasks.update({"sudoku": distill_task()}), "config.distill.tasks.sudoku"),
    (lambda c: c.distill.rl.update({"teacher": "/x"}), "config.distill.rl.teacher"),
    (lambda c: setattr(c.pipeline, "stages", "reasoning,general,reasoning"), "config.pipeline.stages"),
    (lambda c: setattr(c.pipeline, "stages", "reasoning,agentic"), "config.stages"),
    (lambda c: c.stages.update({"extra": stage_config("sft", env="addition")}), "config.stages"),
    (lambda c: c.stages.agentic.rl.update({"env_options": {"digits": 0}}),
     "config.stages.agentic.rl.env_options"),
    (lambda c: c.stages.general.rl.update({"env_options": {"max_lenn": 9}}),
     "config.stages.general.rl.env_options"),
    # Two stages training one task with different options: which one would the table show?
    (lambda c: c.stages.general.rl.update({"env": "calculator", "env_options": {"digits": 2}}),
     "config.stages.general.rl.env_options"),
])
def test_bad_pipeline_configs_name_the_field(edit, field):
  config = _config()
  edit(config)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.") + r"\b"):
    validate_pipeline(config)


def test_a_stages_env_options_reach_its_rl_every_rows_evaluation_and_the_distillation():
  config = _config()
  config.stages.agentic.rl.env_options = ml_collections.ConfigDict({"digits": 5})
  config.stages.general.rl.env_options = ml_collections.ConfigDict({"min_len": 12,
                                                                    "max_len": 14})
  config.lock()  # as experiments/rl.py's flags leave it
  validate_pipeline(config)
  stage = stage_rl_config(config, "agentic", init_from="/s")
  distill = stage_rl_config(config, "distill", init_from="/s",
                            teachers={e: "/t" for e in config.distill.tasks})
  evaluated = pipeline.eval_rl_config(config)
  for rl in (stage.rl, distill.rl, evaluated.rl):
    built = tasks_lib.member_envs(tasks_lib.make_env(rl))
    calc = built["calculator"].task(0, "eval")
    assert all(len(x) == 5 for x in re.split(r"[-+*]", calc.info["expression"])), calc
    if "strings" in built:
      assert 12 <= len(built["strings"].task(0, "eval").answer) <= 14
      assert built["addition"].options == envs.make("addition").options  # no stage sets them
  assert distill.rl.tasks.strings.weight == 1.0 and evaluated.rl.tasks.addition.weight == 1.0


def test_a_stage_from_sft_needs_an_sft_section_or_a_checkpoint():
  config = _config()
  del config["sft"]
  with pytest.raises(ConfigError, match=r"config\.stages\.reasoning\.start: is 'sft'"):
    validate_pipeline(config)


def test_run_pipeline_refuses_before_creating_anything(tmp_path):
  config = _config()
  config.distill.tasks.addition.weight = 0.0
  with pytest.raises(ConfigError, match=r"distill\.tasks\.addition\.weight"):
    pipeline.run_pipeline(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_rl_teachers_checks():
  rl = _config().rl
  rl.loss = "distill"
  rl.group_size = 1
  rl.teacher = "/t"
  rl.teachers.addition = "/t2"
  with pytest.raises(ConfigError, match=r"config\.rl\.teacher: .*not both"):
    validate_rl_config(rl)
  rl.teacher = ""
  rl.env = "strings"
  with pytest.raises(ConfigError, match=r"config\.rl\.teachers: needs exactly one teacher per "
                     r"environment of the run \['strings'\]"):
    validate_rl_config(rl)


def _sample(env, tokens, mask, logp):
  task = Task(env=env, index=0, split="train", messages=(), answer="", info={})
  return Sample(task=task, group=0, tokens=np.asarray(tokens, np.int32),
                rollout_logp=np.asarray(logp, np.float32), loss_mask=np.asarray(mask, np.float32),
                reward=0.0, correct=False, turns=1, messages=[], info={})


def test_each_sample_is_scored_by_its_tasks_teacher(monkeypatch):
  """advantage = logp_teacher(of the sample's task) - logp_rollout on its generated tokens;
  the policy loss at ratio 1 is then -(sum of advantages) / loss tokens."""
  monkeypatch.setattr(rl_step, "teacher_logp", lambda cfg, params, batch: np.asarray(params))
  samples = [_sample("addition", [5, 6, 7], [0, 1, 1], [0.0, -1.0, -2.0]),
             _sample("strings", [8, 9], [0, 1], [0.0, -0.5])]
  teacher_a = [[0.0, -0.5, -2.5, 0.0], [0.0, -9.0, 0.0, 0.0]]  # row 1 is not its task
  teacher_s = [[0.0, -7.0, -7.0, 0.0], [0.0, -0.25, 0.0, 0.0]]
  config = _config()
  config.data.seq_len = 4
  batch = rl_update.score(config, samples, {"addition": (None, teacher_a),
                                            "strings": (None, teacher_s)})
  np.testing.assert_allclose(batch["advantages"], [[0, 0.5, -0.5, 0], [0, 0.25, 0, 0]],
                             atol=1e-7)
  loss_fn = lambda logp: algorithms.ppo_policy_loss(
      logp, logp, batch["rollout_logp"], batch["advantages"], batch["loss_mask"])[0]
  logp = jnp.asarray(batch["rollout_logp"])
  np.testing.assert_allclose(loss_fn(logp), -(0.5 - 0.5 + 0.25) / 3, rtol=1e-6)
  # The gradient raises the log-prob of a token the teacher finds likelier, lowers the other.
  np.testing.assert_allclose(jax.grad(loss_fn)(logp), [[0, -0.5 / 3, 0.5 / 3, 0],
                                                       [0, -0.25 / 3, 0, 0]], atol=1e-7)
  # One teacher for every sample (rl.teacher), and a sample whose task has no teacher.
  one = rl_update.score(config, samples, {rl_update.ANY_TASK: (None, teacher_a)})
  np.testing.assert_allclose(one["advantages"], [[0, 0.5, -0.5, 0], [0, -8.5, 0, 0]], atol=1e-6)
  with pytest.raises(ValueError, match="no teacher"):
    rl_update.score(config, samples, {"addition": (None, teacher_a)})


ACCURACY = {"start": (0.3, 0.2, 0.1), "reasoning": (0.6, 0.1, 0.1),
            "agentic": (0.4, 0.5, 0.1), "general": (0.4, 0.3, 0.5), "distill": (0.5, 0.4, 0.4)}


def _recording_pipeline(monkeypatch, tmp_path, stop_once=()):
  calls = []
  stopped = set()

  def rl_train(config, workdir, stop_after_steps=None):
    name = workdir.rsplit("/", 1)[1]
    calls.append((name, config.rl.init_from, dict(config.rl.teachers), config.rl.loss))
    if name in stop_once and name not in stopped:
      stopped.add(name)
      return {"stopped_early": True}
    return {"stopped_early": False}

  def evaluate_all(config, workdir, tokenizer):
    name = "start" if workdir.endswith("start") else workdir.rsplit("/", 1)[1]
    return dict(zip(("addition", "calculator", "strings"), ACCURACY[name]))

  monkeypatch.setattr(loop, "rl_train", rl_train)
  monkeypatch.setattr(pipeline, "evaluate_all", evaluate_all)
  return calls


def test_stages_chain_and_the_best_checkpoint_teaches_each_task(monkeypatch, tmp_path):
  calls = _recording_pipeline(monkeypatch, tmp_path)
  config = _config(tmp_path)
  out = pipeline.run_pipeline(config, str(tmp_path / "run"))
  stages = str(tmp_path / "run" / "stages")
  assert calls == [
      ("reasoning", str(tmp_path / "start"), {}, "grpo"),
      ("agentic", f"{stages}/reasoning", {}, "grpo"),
      ("general", f"{stages}/agentic", {}, "grpo"),
      ("distill", f"{stages}/general", {"addition": f"{stages}/reasoning",
                                        "calculator": f"{stages}/agentic",
                                        "strings": f"{stages}/general"}, "distill")]
  assert out["teachers"] == {"addition": "reasoning", "calculator": "agentic",
                             "strings": "general"}
  assert list(out["rows"]) == ["sft", "reasoning", "agentic", "general", "distill"]
  assert out["stopped"] is None
  table = pipeline.format_table(out)
  assert "| general | 0.400 | 0.300 | 0.500 |" in table


def test_a_stopped_stage_resumes_and_finished_stages_are_skipped(monkeypatch, tmp_path):
  calls = _recording_pipeline(monkeypatch, tmp_path, stop_once=("agentic",))
  config = _config(tmp_path)
  config.distill.tasks.strings.teacher = "sft"  # an explicit teacher instead of "best"
  out = pipeline.run_pipeline(config, str(tmp_path / "run"))
  assert out["stopped"] == "agentic" and "agentic" not in out["rows"]
  assert [c[0] for c in calls] == ["reasoning", "agentic"]
  out = pipeline.run_pipeline(config, str(tmp_path / "run"))
  assert [c[0] for c in calls] == ["reasoning", "agentic", "agentic", "general", "distill"]
  assert out["stopped"] is None and out["teachers"]["strings"] == "sft"
  assert calls[-1][2]["strings"] == str(tmp_path / "start")
