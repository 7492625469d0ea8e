"""Sweep configs: named runs with dependencies, built by configs/sweeps/*.py.

A sweep config (`get_config(arg)` -> ConfigDict; `arg` "quick" is the few-step size that
`experiments/sweep.py --sweep=configs/sweeps/<name>.py:quick` and the tests run) has:

  name         the sweep's name
  base_config  the experiment config train runs start from, as a config reference (below)
  size         the numbers that set the sweep's cost (steps, examples, ...); runs take them by
               `FieldReference` (`size.get_ref("continue_steps")`), so `--sweep.size.X=...`
               changes every run that uses X
  suite        the retrieval suite (`glm5_jax.eval.suite.suite_config`) every evaluation uses
  runs         {name: run}; see `train_run`, `eval_run`, `search_run` below
  checks       comparisons the report marks as holding, not holding or too short to
               show (see `check`)

Config references (`base_config`, a train run's `config`): a module of the `configs` package
(`"configs.tiny:attention=M"`, imported; the part after `:` is `get_config`'s argument) or a
file (`"configs/tiny.py:attention=M"`: relative to the working directory, else to the sweep
config's directory; or absolute). The shipped sweeps use modules, imported from the `configs`
package installed with `glm5_jax` (setup.cfg).

Run kinds:
  train       experiments/train.py's `train(config, workdir)` on `config` (default
              base_config) with `overrides` (a nested dict over the experiment config), then the
              suite on its final checkpoint when `evaluate`. It is finished only when training
              reached `config.train.steps`.
  eval        the suite on `checkpoint`'s params converted training-free to the model with
              `model` overrides (e.g. another attention pattern).
  swa_search  the beam search of `glm5_jax.eval.swa_search` on `checkpoint`.

Seeds: `seeds` (optional; a tuple of distinct ints >= 0, e.g. `--sweep.seeds="(0, 1, 2)"` or
experiments/sweep.py's `--seeds=0,1,2`) runs the whole sweep once per seed: every run `x` becomes
`x_seed<s>` (seed-major order, so the first seed's sweep completes first), a train run gets the
experiment config's `seed` = s (its init and data order), and each copy's references and
`after` point to the same seed's copies. The report then gives each run's mean and 95% t
interval over the seeds and decides each check on the seed-paired differences
(glm5_jax.sweeps.report). Without `seeds` the runs keep their names and configs.

Dependencies: any string in a run may name another run's result as `{run.field}` (fields:
`workdir` of a train run, `pattern` of a search, any other top-level result key); the run then
waits for that run and gets the value substituted (a string that is exactly one reference takes
the value's own type). `after` adds ordering-only dependencies. Cycles and unknown names are
errors naming the run.
"""

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import re

import ml_collections

RUN_KINDS = ("train", "eval", "swa_search")
REFERENCE = re.compile(r"\{([A-Za-z_]\w*)\.([A-Za-z_]\w*)\}")


def train_run(*, overrides: dict | None = None, config: str = "", evaluate: bool = True,
              group: str = "", variant: str = "", after: tuple = ()) -> dict:
  """A train run: `config` (default the sweep's base_config) with `overrides`, trained in the
  run's directory, then evaluated on the suite when `evaluate`."""
  return dict(kind="train", config=config, overrides=overrides or {}, evaluate=evaluate,
              group=group, variant=variant, after=tuple(after), suite={})


def eval_run(*, checkpoint: str, model: dict | None = None, group: str = "",
             variant: str = "", after: tuple = (), suite: dict | None = None) -> dict:
  """Training-free evaluation of `checkpoint` (a workdir, usually `"{run.workdir}"`) with
  `model` overrides, e.g. {"attention_pattern": "SMSM", "sliding_window": 64}."""
  return dict(kind="eval", checkpoint=checkpoint, model=model or {}, group=group,
              variant=variant, after=tuple(after), suite=suite or {})


def search_run(*, checkpoint: str, model: dict | None = None, num_convert: int = -1,
               beam_width: int = 8, layers_per_step: int = 2, length: int = 0,
               letter: str = "S", after: tuple = (), suite: dict | None = None) -> dict:
  """SWA layer search on `checkpoint`; `length` 0 = 4x its training length, `num_convert` -1 =
  half the layers. Its result's `pattern` is referenced as `"{name.pattern}"`."""
  return dict(kind="swa_search", checkpoint=checkpoint, model=model or {},
              num_convert=num_convert, beam_width=beam_width, layers_per_step=layers_per_step,
              length=length, letter=letter, group="", variant="", after=tuple(after),
              suite=suite or {})


def check(left: str, op: str, right: str, *, metric: str = "score", tolerance: float = -1.0,
          note: str = "", min_steps: int = 0) -> dict:
  """A comparison of two runs' results for the report. `op`: ">" , "<", or "~" (within
  `tolerance`; -1 = two standard errors of the difference of two binomial means for suite
  metrics, 0.02 for losses). `metric`: "score" (suite mean over lengths), "longest" (suite at
  the longest length), "text_loss" (held-out Python-stdlib LM loss) or "heldout_lm_loss".
  `min_steps`: the training steps behind both runs (their own plus those of the runs they
  started from) below which the ordering cannot show, e.g. retrieval before the model
  retrieves at all; shorter runs (a `:quick` sweep) get "too short to show", not a verdict."""
  if op not in (">", "<", "~"):
    raise ValueError(f"check {left} {op} {right}: op must be '>', '<' or '~'")
  return dict(left=left, op=op, right=right, metric=metric, tolerance=tolerance, note=note,
              min_steps=min_steps)


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of a sweep, references unresolved."""

  name: str
  spec: dict  # the run dict (FieldReferences resolved, `{run.field}` references not)
  depends_on: tuple[str, ...]
  spec_hash: str

  @property
  def base(self) -> str:
    """The declared run this one is a seed's copy of (its own name without `seeds`)."""
    return self.spec.get("seed_of", self.name)


SEED_SUFFIX = "_seed"


def seeded_name(name: str, seed: int) -> str:
  return f"{name}{SEED_SUFFIX}{seed}"


def sweep_seeds(sweep) -> tuple[int, ...]:
  """The sweep's `seeds` (() when it has none). Raises ValueError naming `sweep.seeds`."""
  seeds = tuple(sweep.get("seeds", None) or ())
  if any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in seeds) or \
      len(set(seeds)) < len(seeds):
    raise ValueError(f"sweep.seeds: must be distinct ints >= 0, got {seeds}")
  return seeds


def replicate_over_seeds(runs_dict: dict, seeds) -> dict:
  """`{x_seed<s>: run}` for every run x and seed s, seed-major (module docstring, "Seeds")."""
  names = set(runs_dict)
  rename = lambda m: ("{" + seeded_name(m.group(1), seed) + "." + m.group(2) + "}"
                      if m.group(1) in names else m.group(0))

  def renamed(value):
    if isinstance(value, str):
      return REFERENCE.sub(rename, value)
    if isinstance(value, dict):
      return {k: renamed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return type(value)(renamed(v) for v in value)
    return value

  out = {}
  for seed in seeds:
    for name, spec in runs_dict.items():
      copy = renamed(spec)
      copy["after"] = [seeded_name(a, seed) if a in names else a for a in spec.get("after", ())]
      if copy.get("kind") == "train":
        overrides = copy.setdefault("overrides", {})
        if "seed" in overrides:
          raise ValueError(f"sweep.runs.{name}.overrides.seed: sweep.seeds sets each copy's "
                           "seed; drop one of the two")
        overrides["seed"] = seed
      copy.update(seed=seed, seed_of=name)
      out[seeded_name(name, seed)] = copy
  return out


def resolve_config_ref(ref: str, config_dir: str | None = None, where: str = "config") -> str:
  """A config reference (see the module docstring) made independent of the working directory:
  a module reference as given, a file reference with its path made absolute.

  Args:
    config_dir: the sweep config's directory, where a relative path not found from the working
      directory is looked up.
    where: names the reference in errors (e.g. `sweep.runs.baseline.config`).
  Raises:
    FileNotFoundError: a file reference found in neither place (the message lists both).
  """
  target, sep, arg = ref.partition(":")
  if not _is_path(target):
    return ref
  candidates = [target] if os.path.isabs(target) else [os.path.abspath(target)] + (
      [os.path.abspath(os.path.join(config_dir, target))] if config_dir else [])
  for path in candidates:
    if os.path.isfile(path):
      return path + sep + arg
  raise FileNotFoundError(f"{where}: config file {target!r} not found (looked for "
                          f"{' and '.join(candidates)}); give a path relative to the working "
                          "directory or the sweep config, or a module such as 'configs.tiny'")


def load_config(ref: str, where: str = "config") -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config reference (`"configs.tiny:attention=M"`, or a file path as
  returned by `resolve_config_ref`).

  Raises:
    ModuleNotFoundError / FileNotFoundError: the module or file does not exist (the message
      names `where` and the reference; an import error inside the config propagates as is).
  """
  target, sep, arg = ref.partition(":")
  if _is_path(target):
    if not os.path.isfile(target):
      raise FileNotFoundError(f"{where}: config file {target!r} not found")
    spec = importlib.util.spec_from_file_location(
        "sweep_config_" + os.path.splitext(os.path.basename(target))[0], target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  else:
    try:
      module = importlib.import_module(target)
    except ModuleNotFoundError as e:
      if e.name is None or not target.startswith(e.name):
        raise  # the config itself imports something missing
      raise ModuleNotFoundError(
          f"{where}: config module {target!r} not found ({e}); the `configs` package is "
          "installed with glm5_jax (`pip install -e .` in the repository root; reinstall after "
          "pulling a setup.cfg that added it)") from e
  return module.get_config(arg) if sep else module.get_config()


def _is_path(target: str) -> bool:
  return target.endswith(".py") or os.sep in target or "/" in target


def references(value) -> set[str]:
  """Names of runs referenced as `{run.field}` anywhere inside `value`."""
  if isinstance(value, str):
    return {m.group(1) for m in REFERENCE.finditer(value)}
  if isinstance(value, dict):
    return set().union(*(references(v) for v in value.values())) if value else set()
  if isinstance(value, (list, tuple)):
    return set().union(*(references(v) for v in value)) if value else set()
  return set()


def substitute(value, results: dict, where: str):
  """`value` with every `{run.field}` replaced from `results[run][field]`."""
  if isinstance(value, dict):
    return {k: substitute(v, results, f"{where}.{k}") for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return type(value)(substitute(v, results, where) for v in value)
  if not isinstance(value, str):
    return value

  def lookup(match):
    run, field = match.groups()
    if field not in results.get(run, {}):
      raise KeyError(f"{where}: {match.group(0)}: run {run!r} has no result field {field!r} "
                     f"(has {sorted(results.get(run, {}))})")
    return results[run][field]

  whole = REFERENCE.fullmatch(value)
  if whole:
    return lookup(whole)
  return REFERENCE.sub(lambda m: str(lookup(m)), value)


def parse_runs(sweep) -> list[Run]:
  """The sweep's runs in execution order (dependencies first, else declaration order).

  Raises:
    ValueError: an unknown run kind, reference or `after` name, or a dependency cycle.
  """
  # to_json keeps declaration order (to_dict sorts) and resolves FieldReferences.
  runs_dict = json.loads(sweep.runs.to_json())
  seeds = sweep_seeds(sweep)
  if seeds:
    runs_dict = replicate_over_seeds(runs_dict, seeds)
  suite = json.loads(sweep.suite.to_json())
  base = sweep.base_config
  runs = {}
  for name, spec in runs_dict.items():
    if spec.get("kind") not in RUN_KINDS:
      raise ValueError(f"sweep.runs.{name}.kind: must be one of {RUN_KINDS}, got "
                       f"{spec.get('kind')!r}")
    if spec["kind"] == "train" and not spec.get("config"):
      spec["config"] = base
    deps = references(spec) | set(spec.get("after", ()))
    unknown = sorted(deps - set(runs_dict))
    if unknown:
      raise ValueError(f"sweep.runs.{name}: depends on unknown runs {unknown}; runs: "
                       f"{list(runs_dict)}")
    hashed = json.dumps(dict(spec=spec, suite=suite), sort_keys=True, default=str)
    runs[name] = Run(name, spec, tuple(sorted(deps)),
                     hashlib.sha1(hashed.encode()).hexdigest()[:16])
  order, state = [], {}

  def visit(name, chain):
    if state.get(name) == "done":
      return
    if state.get(name) == "visiting":
      raise ValueError(f"sweep.runs: dependency cycle {' -> '.join(chain + [name])}")
    state[name] = "visiting"
    for dep in runs[name].depends_on:
      visit(dep, chain + [name])
    state[name] = "done"
    order.append(runs[name])

  for name in runs:
    visit(name, [])
  return order


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict, where: str) -> None:
  """Sets nested `overrides` on `config` in place; a field `config` lacks is an error naming
  it (`where` prefixes the message), so a typo never silently does nothing."""
  for key, value in overrides.items():
    path = f"{where}.{key}"
    if key not in config:
      raise ValueError(f"{path}: the experiment config has no such field; known: "
                       f"{sorted(config.keys())}")
    if isinstance(value, dict) and isinstance(config[key], ml_collections.ConfigDict):
      apply_overrides(config[key], value, path)
    else:
      try:
        config[key] = value
      except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: cannot set {value!r}: {e}") from e
