"""The staged post-training pipeline's config: its sections and their checks.

An RL experiment config (configs/rl_tiny.py's sections: model, data, optim, train, ckpt, mesh,
rl, sft) plus three sections (configs/rl_staged.py):

  pipeline.stages = "reasoning,agentic,general"    the RL stages, in order
  pipeline.eval_tasks = 64                         held-out tasks of every task, per table row
  stages.<name> = stage_config(start, **rl)        each stage: where it starts, and its `rl`
                                                   fields over the config's `rl` (env,
                                                   env_options, tasks, steps, ...)
  distill = distill_config(start, tasks, **rl)     on-policy distillation into the final
                                                   student: tasks {env: distill_task(weight,
                                                   teacher)} and `rl` fields (steps, ...)

A stage's `start`: "sft" (`rl.init_from`, or the `sft` section trained first into
<workdir>/sft), "previous" (the stage before it), the name of an earlier stage, or a checkpoint
workdir (a path that exists, or a gs:// URL). The distillation's `start` is the same ("previous":
the last stage). A task's `teacher`: "best" (of the start checkpoint and the stages, the one
with the highest held-out accuracy on that task when the stages finished), "sft", or a stage
name. A task's environment options are those of the stage that trains it (`task_options`):
the table's evaluation of that task after every stage and its distillation build it with them,
so every row measures the version of the task its stage trained. Every stage and the
distillation is an ordinary RL run (`stage_rl_config` builds its config,
`glm5_jax.posttrain.loop.rl_train` runs it).

`validate_pipeline` rejects a bad pipeline before anything is built or compiled, each a
ConfigError naming the field: an unknown or repeated stage, a stage without a checkpoint to
start from, a stage or teacher naming a later stage, an unknown environment, a distillation
weight that is not > 0, a bad environment option (`stages.<name>.rl.env_options` or
`...rl.tasks.<env>.options`), two stages building one environment with different options, and
(prefixed by the stage) anything `validate_rl_experiment` rejects in a stage's or the
distillation's RL config.
"""

import copy
import math
import os

import ml_collections

from glm5_jax.config import ConfigError, check_fields, require
from glm5_jax.posttrain import envs, tasks as tasks_lib
from glm5_jax.posttrain.config import rl_config
from glm5_jax.posttrain.rl_config_checks import validate_rl_experiment

PIPELINE_SECTIONS = ("pipeline", "stages", "distill")
START = "sft"  # the start checkpoint's name (table row, teacher)
PREVIOUS = "previous"
BEST = "best"
DISTILL = "distill"


def pipeline_section(stages=("reasoning", "agentic", "general"), eval_tasks: int = 64):
  c = ml_collections.ConfigDict()
  c.stages = ",".join(stages)
  c.eval_tasks = eval_tasks
  return c


def stage_config(start: str = PREVIOUS, **rl) -> ml_collections.ConfigDict:
  """One RL stage: `start` (module docstring) and `rl` fields over the config's `rl`."""
  c = ml_collections.ConfigDict()
  c.start = start
  c.rl = ml_collections.ConfigDict(rl)
  return c


def distill_task(weight: float = 1.0, teacher: str = BEST) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.weight = float(weight)
  c.teacher = teacher
  return c


def distill_config(tasks: dict, start: str = PREVIOUS, **rl) -> ml_collections.ConfigDict:
  """The distillation: the student starts from `start`, samples `tasks` ({env: distill_task})
  and is trained on each sample against its task's teacher; `rl` fields over the config's
  `rl` (loss "distill" and the task mixture are set by `stage_rl_config`)."""
  c = stage_config(start, **rl)
  c.tasks = ml_collections.ConfigDict(tasks)
  return c


def stage_names(config) -> list[str]:
  return [n for n in config.pipeline.stages.split(",") if n]


def base_config(config):
  """A copy of `config` without the pipeline's sections: an RL experiment config."""
  base = copy.deepcopy(config)
  with base.unlocked():
    for name in PIPELINE_SECTIONS:
      if name in base:
        del base[name]
  return base


def stage_rl_config(config, name: str, init_from: str, teachers: dict | None = None):
  """The RL experiment config of stage `name` (or DISTILL, with `teachers` {env: workdir}):
  the base config with the stage's `rl` fields, `rl.init_from`, and the optimizer's warmup and
  `train.steps` fitted to the stage's steps."""
  stage = config.distill if name == DISTILL else config.stages[name]
  c = base_config(config)
  with c.unlocked():
    _set_over(c.rl, stage.rl)
    if name == DISTILL:
      options = task_options(config)
      c.rl.loss = DISTILL
      c.rl.env = tasks_lib.MIXTURE
      c.rl.env_options = ml_collections.ConfigDict()
      c.rl.tasks = ml_collections.ConfigDict(
          {env: tasks_lib.task_config(weight=t.weight, **options.get(env, {}))
           for env, t in stage.tasks.items()})
      c.rl.teachers = ml_collections.ConfigDict(teachers or {})
    c.rl.init_from = init_from
    c.train.steps = c.rl.steps
    c.optim.warmup_steps = min(c.optim.warmup_steps, c.rl.steps // 2)
  return c


def stage_envs(rl) -> list[str]:
  """The environments an `rl` section trains on."""
  return sorted(rl.tasks) if rl.env == tasks_lib.MIXTURE else [rl.env]


def pipeline_envs(config) -> list[str]:
  """Every task of the pipeline (the table's columns): the stages' and the distillation's."""
  names = set(config.distill.tasks)
  for name in stage_names(config):
    names.update(stage_envs(_merged_rl(config, name)))
  return sorted(names)


def task_options(config) -> dict:
  """{env: options} of every environment a stage trains: the options that stage's RL builds
  it with (`rl.env_options`, or `rl.tasks.<env>.options` of a mixture). The table's
  evaluation and the distillation build each task with them (an environment no stage trains:
  its defaults). `validate_pipeline` checks that stages training one environment agree."""
  return {env: options for env, (options, _) in _task_options(config).items()}


def _task_options(config) -> dict:
  """{env: (options, field of the first stage that sets them)}."""
  out = {}
  for name in stage_names(config):
    rl = _merged_rl(config, name)
    if rl.env == tasks_lib.MIXTURE:
      found = {env: (t.options.to_dict(), f"stages.{name}.rl.tasks.{env}.options")
               for env, t in rl.tasks.items()}
    else:
      found = {rl.env: (rl.env_options.to_dict(), f"stages.{name}.rl.env_options")}
    for env, (options, field) in found.items():
      if env in out:
        require(out[env][0] == options, field, f"builds {env!r} with {options}, but "
                f"config.{out[env][1]} builds it with {out[env][0]}: the table and the "
                "distillation evaluate one version of each task")
      else:
        out[env] = (options, field)
  return out


def _check_task_options(config) -> None:
  """Stages training one environment agree on its options, and each builds (its field)."""
  for env, (options, field) in _task_options(config).items():
    tasks_lib.make_one(env, options, config.rl, field)


def _set_over(rl, fields) -> None:
  """Sets each of `fields` in `rl`, a nested section (env_options, tasks) replaced whole: a
  stage's options for its environment do not merge into the base's for another. Works on a
  locked config (experiments/rl.py's flags lock it)."""
  with rl.unlocked():
    for key, value in fields.items():
      rl[key] = copy.deepcopy(value)


def _merged_rl(config, name):
  rl = copy.deepcopy(config.rl)
  _set_over(rl, config.stages[name].rl)
  return rl


def _check_start(config, field: str, start, earlier: list[str]) -> None:
  require(isinstance(start, str) and bool(start), field,
          f"must be 'sft', 'previous', an earlier stage or a checkpoint workdir, got {start!r}")
  if start == PREVIOUS:
    require(bool(earlier), field, "is 'previous' but no stage comes before it: it has no "
            "checkpoint to start from (use 'sft' or a checkpoint workdir)")
  elif start == START:
    require(bool(config.rl.init_from) or "sft" in config, field,
            "is 'sft' but rl.init_from is empty and the config has no `sft` section to train: "
            "no checkpoint to start from")
  elif start not in earlier:
    require(start not in config.stages, field, f"names stage {start!r}, which does not run "
            f"before it (stages in order: {stage_names(config)}): no checkpoint to start from")
    require("://" in start or os.path.isdir(start), field,
            f"is neither 'sft', 'previous', an earlier stage {earlier} nor an existing "
            f"checkpoint workdir: {start!r}")


def _check_envs(rl, field: str) -> None:
  """Environment names first, each under its own field (before the RL checks build them)."""
  if rl.env != tasks_lib.MIXTURE:
    require(rl.env in envs.REGISTRY, f"{field}.env", f"unknown environment {rl.env!r}; "
            f"expected one of {envs.NAMES} or {tasks_lib.MIXTURE!r} (with tasks)")
  for env in rl.tasks:
    require(env in envs.REGISTRY, f"{field}.tasks.{env}",
            f"unknown environment {env!r}; expected one of {envs.NAMES}")


def _check_rl(config, name: str, field: str) -> None:
  """`validate_rl_experiment` of the stage's RL config, its error prefixed by the stage."""
  try:
    validate_rl_experiment(stage_rl_config(config, name, init_from="<start>",
                                           teachers={e: "<teacher>" for e in config.distill.tasks}))
  except ConfigError as e:
    raise ConfigError(f"config.{field} (over config.rl): {e}") from None


def validate_pipeline(config) -> None:
  """The checks of the module docstring (ConfigError naming the field)."""
  for section in PIPELINE_SECTIONS:
    require(section in config, section, "a staged pipeline config needs sections "
            f"{PIPELINE_SECTIONS} (configs/rl_staged.py)")
  check_fields(config.pipeline, pipeline_section(), "pipeline")
  require(config.pipeline.eval_tasks >= 1, "pipeline.eval_tasks",
          f"must be >= 1, got {config.pipeline.eval_tasks}")
  names = stage_names(config)
  require(bool(names), "pipeline.stages", "names no stage; e.g. 'reasoning,agentic,general'")
  for i, name in enumerate(names):
    require(name not in names[:i], "pipeline.stages", f"names stage {name!r} twice: {names}")
    require(name in config.stages, "pipeline.stages", f"names stage {name!r}, which has no "
            f"config.stages.{name} (stages: {sorted(config.stages)})")
    require(name not in (START, DISTILL, PREVIOUS, BEST), "pipeline.stages",
            f"{name!r} is reserved (a start or teacher name)")
  unused = sorted(set(config.stages) - set(names))
  require(not unused, "stages", f"{unused} are not in pipeline.stages {names}")
  rl_fields = rl_config()
  for i, name in enumerate(names):
    field = f"stages.{name}"
    check_fields(config.stages[name], stage_config(), field)
    unknown = sorted(set(config.stages[name].rl) - set(rl_fields))
    require(not unknown, f"{field}.rl", f"unknown fields {unknown}; expected fields of "
            f"config.rl: {sorted(rl_fields)}")
    _check_start(config, f"{field}.start", config.stages[name].start, names[:i])
    rl = _merged_rl(config, name)
    require(rl.loss == "grpo", f"{field}.rl.loss", f"a stage trains GRPO, got {rl.loss!r}")
    require(rl.steps >= 1, f"{field}.rl.steps", f"must be >= 1, got {rl.steps}")
    _check_envs(rl, f"{field}.rl")
  _check_task_options(config)
  _validate_distill(config, names)
  for name in names:
    _check_rl(config, name, f"stages.{name}.rl")
  _check_rl(config, DISTILL, "distill.rl")


def _validate_distill(config, names: list[str]) -> None:
  d = config.distill
  check_fields(d, distill_config({}), "distill")
  unknown = sorted(set(d.rl) - set(rl_config()))
  require(not unknown, "distill.rl", f"unknown fields {unknown}; expected fields of config.rl")
  for key in ("loss", "env", "env_options", "tasks", "teacher", "teachers", "init_from"):
    require(key not in d.rl, f"distill.rl.{key}", "is set by the pipeline (distillation from "
            "distill.tasks' teachers, starting from distill.start)")
  _check_start(config, "distill.start", d.start, names)
  steps = d.rl.get("steps", config.rl.steps)
  require(steps >= 1, "distill.rl.steps", f"must be >= 1, got {steps}")
  require(bool(d.tasks), "distill.tasks", "needs at least one task, e.g. "
          "distill.tasks.addition = distill_task(weight=1.0, teacher='best')")
  known = set(envs.REGISTRY)
  for env, task in d.tasks.items():
    field = f"distill.tasks.{env}"
    require(env in known, field, f"unknown environment {env!r}; expected one of {envs.NAMES}")
    check_fields(task, distill_task(), field)
    require(math.isfinite(task.weight) and task.weight > 0, f"{field}.weight",
            f"must be a finite number > 0 (each task is distilled), got {task.weight}")
    require(task.teacher in (BEST, START, *names), f"{field}.teacher",
            f"must be 'best', 'sft' or a stage of {names}, got {task.teacher!r}")
