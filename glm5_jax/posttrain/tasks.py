"""The RL run's environment: one (`rl.env`) or a weighted task mixture (`rl.tasks`), and the
sandbox limits of the environments that run model-written code (`rl.sandbox`).

  rl.env = "mixture"
  rl.tasks.code = task_config(weight=2.0)                       # options as keywords
  rl.tasks.repo_repair = task_config(weight=1.0, max_staleness=0, max_turns=4)
  rl.tasks.addition = task_config(weight=1.0, digits=2)
  rl.sandbox.wall_seconds = 5.0                                 # sandbox_config's fields

Checks (`validate_tasks`, run by `validate_rl_config` before anything is built or compiled;
each a ConfigError naming the field): `rl.env` "mixture" exactly when `rl.tasks` is non-empty;
every task names a known environment; weights finite, >= 0 and summing to a positive number;
a task's `max_staleness` -1 (use `rl.max_staleness`) or in [0, rl.max_staleness] (the
orchestrator's capacity rule uses the run's bound, so a task can only be stricter); every
sandbox limit > 0; a code-running environment only where the sandbox works (or with
`rl.sandbox.allow_unsafe`); and each environment is built once with its options (an unknown or bad
option is named under `rl.tasks.<env>.options` or `rl.env_options`).

Per-task metrics: `rollout.metrics_by_env` (`<env>/<metric>`), and `mean_over_envs`.
"""

import dataclasses
import math

import ml_collections
import numpy as np

from glm5_jax.config import ConfigError, check_fields, require
from glm5_jax.posttrain import envs, sandbox
from glm5_jax.posttrain.envs.mixture import Mixture

MIXTURE = "mixture"


def task_config(weight: float = 1.0, max_staleness: int = -1, **options):
  """One entry of `rl.tasks`: its sampling weight, its staleness limit in asynchronous RL
  (-1: `rl.max_staleness`), and the environment's options."""
  c = ml_collections.ConfigDict()
  c.weight = float(weight)
  c.max_staleness = max_staleness
  c.options = ml_collections.ConfigDict(options)
  return c


def sandbox_config(**overrides) -> ml_collections.ConfigDict:
  """`rl.sandbox`: `glm5_jax.posttrain.sandbox.Limits`' fields, and `allow_unsafe` (run where
  no sandbox works (bubblewrap missing), with resource limits only; see the sandbox module)."""
  c = ml_collections.ConfigDict({f.name: f.default for f in dataclasses.fields(sandbox.Limits)})
  c.allow_unsafe = False
  c.update(overrides)
  return c


def _sandbox_option(rl) -> dict:
  return dict(rl.sandbox.to_dict())


def make_one(name: str, options: dict, rl, field: str) -> envs.Env:
  """Environment `name` with `options` (and `rl.sandbox`'s limits where it runs code); a bad
  option is a ConfigError naming `config.<field>`."""
  env_cls = envs.REGISTRY[name]
  if "sandbox" in env_cls.defaults:
    require("sandbox" not in options, f"{field}.sandbox",
            "set the sandbox limits in rl.sandbox (one place for every environment)")
    options = {**options, "sandbox": _sandbox_option(rl)}
    iso = sandbox.isolation() if not rl.sandbox.allow_unsafe else None
    require(iso is None or iso.mode != "none", "rl.sandbox.allow_unsafe",
            f"environment {name!r} runs model-written code and this machine has no sandbox "
            f"({iso and iso.reason}); set it to True only to run that code unconfined")
  try:
    return envs.make(name, **options)
  except ValueError as e:
    raise ConfigError(f"config.{field}: {e}") from None


def validate_tasks(rl) -> None:
  """The checks of the module docstring (ConfigError naming the field)."""
  check_fields(rl.sandbox, sandbox_config(), "rl.sandbox")
  for field in dataclasses.fields(sandbox.Limits):
    value = rl.sandbox[field.name]
    require(math.isfinite(value) and value > 0, f"rl.sandbox.{field.name}",
            f"must be a finite number > 0, got {value!r}")
  if rl.env != MIXTURE:
    require(not rl.tasks, "rl.tasks", f"a task mixture needs rl.env={MIXTURE!r}, got rl.env="
            f"{rl.env!r} with rl.tasks {sorted(rl.tasks)}")
    require(rl.env in envs.REGISTRY, "rl.env", f"unknown environment {rl.env!r}; expected one "
            f"of {tuple(envs.REGISTRY)} or {MIXTURE!r} (with rl.tasks)")
    make_env(rl)
    return
  require(bool(rl.tasks), "rl.tasks", f"rl.env={MIXTURE!r} needs at least one task, e.g. "
          "rl.tasks.code = tasks.task_config(weight=1.0)")
  require(not rl.env_options, "rl.env_options", f"with rl.env={MIXTURE!r} each task's options "
          "go in rl.tasks.<env>.options")
  for name, task in rl.tasks.items():
    require(name in envs.REGISTRY, f"rl.tasks.{name}",
            f"unknown environment {name!r}; expected one of {tuple(envs.REGISTRY)}")
    check_fields(task, task_config(), f"rl.tasks.{name}")
    require(math.isfinite(task.weight) and task.weight >= 0, f"rl.tasks.{name}.weight",
            f"must be a finite number >= 0, got {task.weight}")
    s = task.max_staleness
    require(s == -1 or 0 <= s <= rl.max_staleness, f"rl.tasks.{name}.max_staleness",
            f"must be -1 (rl.max_staleness) or in [0, rl.max_staleness={rl.max_staleness}], "
            f"got {s}")
  total = sum(task.weight for task in rl.tasks.values())
  require(total > 0, "rl.tasks", "the task weights "
          f"{ {n: t.weight for n, t in rl.tasks.items()} } must sum to a positive number")
  make_env(rl)


def make_env(rl) -> envs.Env:
  """The run's environment: `rl.env` with `rl.env_options`, or the mixture of `rl.tasks`."""
  if rl.env != MIXTURE:
    return make_one(rl.env, rl.env_options.to_dict(), rl, "rl.env_options")
  return Mixture({name: (make_one(name, task.options.to_dict(), rl, f"rl.tasks.{name}.options"),
                         task.weight) for name, task in rl.tasks.items()}, seed=rl.seed)


def staleness_limit(rl, env_name: str) -> int:
  """The staleness limit of `env_name`'s rollouts: its task's, else `rl.max_staleness`."""
  task = rl.tasks.get(env_name) if rl.env == MIXTURE else None
  return rl.max_staleness if task is None or task.max_staleness < 0 else task.max_staleness


def member_envs(env) -> dict:
  """{name: env} of a mixture's members, or {env.name: env}."""
  return dict(env.envs) if isinstance(env, Mixture) else {env.name: env}


def mean_over_envs(per_env: dict, metric: str) -> float:
  """The unweighted mean of `<env>/<metric>` over the environments in `per_env`."""
  values = [v for k, v in per_env.items() if k.endswith("/" + metric)]
  return float(np.mean(values)) if values else float("nan")
