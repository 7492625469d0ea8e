"""The staged post-training pipeline (configs/rl_staged.py) over seeds: each run's
`pipeline.json` as a row, the forgetting / recovery table as means with 95% t intervals.

`seeds.run_study` runs a pipeline config as it runs any `experiments/rl.py` config (one workdir
per SFT seed x RL seed, the RL seeds of an SFT seed sharing its SFT start through
`rl.init_from`); a run that wrote `pipeline.json` is read here instead of from its RL metrics.
A row holds every checkpoint's (the start, each stage, the distillation) held-out greedy
accuracy per task, and their mean over the tasks.

Tables (`markdown`): the accuracy of every checkpoint (mean ± 95% t over the runs), what each
stage did (its checkpoint minus the one before it, paired run by run: the runs share nothing
but their config, and pairing removes each start's level), and every run's row. A change is an
effect only where its interval excludes 0.
"""

import json
import os

from glm5_jax.sweeps import intervals

STATE_FILE = "pipeline.json"  # `glm5_jax.posttrain.pipeline.STATE_FILE` (not imported: jax-free)
MEAN = "mean"  # the column of the mean over the tasks


def is_pipeline_run(workdir: str) -> bool:
  return os.path.exists(os.path.join(workdir, STATE_FILE))


def read_row(workdir: str, name: str, sft_seed: int, rl_seed: int) -> dict:
  """The run's row: `checkpoints` (in pipeline order), `envs`, `accuracy` {checkpoint: {env or
  MEAN: greedy accuracy}}, `seconds` {checkpoint: wall time}. Raises ValueError naming the file
  when the pipeline stopped early or recorded no stage."""
  path = os.path.join(workdir, STATE_FILE)
  with open(path) as f:
    state = json.load(f)
  if state.get("stopped") or len(state.get("rows", {})) < 2:
    raise ValueError(f"{path}: the pipeline is not finished (stopped at "
                     f"{state.get('stopped')!r}, rows {list(state.get('rows', {}))}); rerun "
                     "the study to resume it")
  envs = list(state["envs"])
  accuracy = {}
  for checkpoint, row in state["rows"].items():
    missing = [e for e in envs if e not in row]
    if missing:
      raise ValueError(f"{path}: checkpoint {checkpoint!r} has no accuracy for {missing}")
    accuracy[checkpoint] = {**{e: row[e] for e in envs}, MEAN: sum(row[e] for e in envs) / len(envs)}
  return {"run": name, "sft_seed": sft_seed, "rl_seed": rl_seed, "pipeline": True,
          "checkpoints": list(state["rows"]), "envs": envs, "accuracy": accuracy,
          "seconds": state.get("seconds", {}), "teachers": state.get("teachers", {})}


def _layout(rows: list[dict]) -> tuple[list[str], list[str]]:
  """The checkpoints and columns every row shares; ValueError naming a run that differs."""
  checkpoints, envs = rows[0]["checkpoints"], rows[0]["envs"]
  for r in rows[1:]:
    if r["checkpoints"] != checkpoints or r["envs"] != envs:
      raise ValueError(f"pipeline seeds: run {r['run']} has checkpoints {r['checkpoints']} and "
                       f"tasks {r['envs']}, run {rows[0]['run']} {checkpoints} and {envs}: one "
                       "study runs one pipeline config")
  return checkpoints, envs + [MEAN]


def summarize(rows: list[dict]) -> dict:
  """{"checkpoints", "columns", "accuracy": {checkpoint: {column: `mean_interval`}}, "stage":
  {checkpoint (not the first): {column: {**`mean_interval` of the paired change over the
  checkpoint before it, "effect"}}}, "n"}."""
  checkpoints, columns = _layout(rows)
  accuracy = {c: {k: intervals.mean_interval([r["accuracy"][c][k] for r in rows])
                  for k in columns} for c in checkpoints}
  stage = {}
  for before, after in zip(checkpoints, checkpoints[1:]):
    stage[after] = {}
    for k in columns:
      change = intervals.mean_interval(
          [r["accuracy"][after][k] - r["accuracy"][before][k] for r in rows])
      stage[after][k] = {**change, "effect": intervals.excludes_zero(change)}
  return {"checkpoints": checkpoints, "columns": columns, "accuracy": accuracy, "stage": stage,
          "n": len(rows)}


def _signed(stats: dict) -> str:
  """"+12.3 ± 4.5" points (a fraction times 100), or "+12.3" for one run."""
  half = stats["half_width"]
  return f"{100 * stats['mean']:+.1f}" + ("" if half is None else f" ± {100 * half:.1f}")


def markdown(rows: list[dict], summary: dict) -> str:
  """The tables of the module docstring (percent)."""
  pct = lambda s: intervals.format_interval(s, scale=100)
  n, columns = summary["n"], summary["columns"]
  header = " | ".join(columns)
  rule = "|---|" + "---|" * len(columns)
  lines = [f"| held-out greedy accuracy (%, n = {n} runs, mean ± 95% t) after | {header} |", rule]
  for c in summary["checkpoints"]:
    lines.append(f"| {c} | " + " | ".join(pct(summary["accuracy"][c][k]) for k in columns) + " |")
  lines += ["", f"| what the stage did (points, its checkpoint - the one before, paired, n = {n};"
            f" * = effect) | {header} |", rule]
  for c, changes in summary["stage"].items():
    cells = [_signed(changes[k]) + (" *" if changes[k]["effect"] else "") for k in columns]
    lines.append(f"| {c} | " + " | ".join(cells) + " |")
  lines += ["", "| run | SFT seed | RL seed | " + " | ".join(
      f"{c} ({MEAN})" for c in summary["checkpoints"]) + " | teachers |",
            "|---|---|---|" + "---|" * (len(summary["checkpoints"]) + 1)]
  for r in rows:
    cells = [f"{100 * r['accuracy'][c][MEAN]:.1f}" for c in summary["checkpoints"]]
    teachers = ", ".join(f"{e} <- {t}" for e, t in r.get("teachers", {}).items())
    lines.append(f"| {r['run']} | {r['sft_seed']} | {r['rl_seed']} | " + " | ".join(cells)
                 + f" | {teachers} |")
  return "\n".join(lines) + "\n"
