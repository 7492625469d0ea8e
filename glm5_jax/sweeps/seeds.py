"""One RL experiment over several seeds: SFT seeds and RL seeds apart, runs in parallel, and a
table of means with 95% t intervals (`intervals.mean_interval`) beside every run's row.

Runs: for each SFT seed s and RL seed r, `experiments/rl.py` (its flags as given, `--mode=async`
included) in `<root>/sft<s>_rl<r>` with `--config.sft.seed=s --config.rl.seed=r`. The first RL
seed of each SFT seed trains the SFT start into its own `<run>/sft`; the others wait for it
and start from it (`--config.rl.init_from`), so the RL seeds of one SFT seed share one start,
and the study separates the start's variance from RL's own. A run whose process exits 0 is
done (`<run>/seeds_result.json`); rerunning the command skips done runs and resumes the rest
(experiments/rl.py resumes its stages).

Results of a run: the held-out evaluations of `<run>/rl/metrics.jsonl` (split "eval"): the
first (before RL) and the last (after) of each metric, and their difference. A staged pipeline
config (configs/rl_staged.py) is read from its `pipeline.json` instead (`pipeline_seeds`: every
checkpoint's accuracy per task, and what each stage changed).

The table: per metric, before / after / change as mean +- the 95% t half-width over all runs,
the smallest change (did any run fall), and whether the change's interval excludes 0. The
runs of one SFT seed share a start, so they are not independent draws of "a start"; the
per-SFT-seed means are listed too, and their spread is the start's part of the variance.
"""

import dataclasses
import json
import os
import sys
import time

from absl import logging

from glm5_jax.files import write_atomic
from glm5_jax.sweeps import intervals, pipeline_seeds, workers
from glm5_jax.sweeps.jobs import read_metrics

RESULT_FILE = "seeds_result.json"
METRICS = ("accuracy", "sampled_accuracy", "pass_at_k")  # held-out, `posttrain.rl_run.evaluate`


@dataclasses.dataclass(frozen=True)
class SeedRun:
  sft_seed: int
  rl_seed: int
  workdir: str
  start_from: str = ""  # another run's workdir whose `sft` this run starts from; "": trains it

  @property
  def name(self) -> str:
    return f"sft{self.sft_seed}_rl{self.rl_seed}"


def plan_runs(root: str, sft_seeds, rl_seeds) -> list[SeedRun]:
  """The runs of the study, in launch order (each SFT seed's first run first)."""
  if not sft_seeds or not rl_seeds or len(set(sft_seeds)) < len(sft_seeds) or \
      len(set(rl_seeds)) < len(rl_seeds):
    raise ValueError(f"seeds: needs distinct SFT seeds and RL seeds, got {list(sft_seeds)} and "
                     f"{list(rl_seeds)}")
  runs = []
  for s in sft_seeds:
    first = os.path.join(root, f"sft{s}_rl{rl_seeds[0]}")
    runs.append(SeedRun(s, rl_seeds[0], first))
    runs += [SeedRun(s, r, os.path.join(root, f"sft{s}_rl{r}"), start_from=first)
             for r in rl_seeds[1:]]
  return runs


def run_command(run: SeedRun, rl_args: list[str], python: str = sys.executable) -> list[str]:
  """experiments/rl.py with the user's flags, then this run's (later flags win in absl)."""
  script = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "rl.py")
  command = [python, os.path.abspath(script), *rl_args, f"--workdir={run.workdir}",
             f"--config.sft.seed={run.sft_seed}", f"--config.rl.seed={run.rl_seed}"]
  if run.start_from:
    command.append(f"--config.rl.init_from={os.path.join(run.start_from, 'sft')}")
  return command


def read_result(run: SeedRun, metrics=METRICS) -> dict:
  """The run's row: seeds, the held-out evaluation steps, and for each metric its first
  (`<m>_before`) and last (`<m>_after`) value and `<m>_change`. Raises ValueError naming the
  file when the run logged fewer than two evaluations."""
  if pipeline_seeds.is_pipeline_run(run.workdir):  # a staged pipeline config: its own row
    return pipeline_seeds.read_row(run.workdir, run.name, run.sft_seed, run.rl_seed)
  _, evals = read_metrics(os.path.join(run.workdir, "rl"))
  path = os.path.join(run.workdir, "rl", "metrics.jsonl")
  if len(evals) < 2:
    raise ValueError(f"{path}: {len(evals)} held-out evaluation(s); a seeds study needs the one "
                     "before RL and one after (rl.eval_every_steps > 0)")
  row = {"run": run.name, "sft_seed": run.sft_seed, "rl_seed": run.rl_seed,
         "eval_steps": [e["step"] for e in evals]}
  for m in metrics:
    if m in evals[0] and m in evals[-1]:
      row[f"{m}_before"], row[f"{m}_after"] = evals[0][m], evals[-1][m]
      row[f"{m}_change"] = evals[-1][m] - evals[0][m]
      row[f"{m}_curve"] = [e.get(m) for e in evals]
  return row


def summarize(rows: list[dict], metrics=METRICS) -> dict:
  """{metric: {"before", "after", "change": `mean_interval`s over the rows, "change_min",
  "effect" (the change's interval excludes 0), "by_sft_seed": {seed: mean change}}}; for the
  rows of a staged pipeline, `pipeline_seeds.summarize`'s."""
  if rows and rows[0].get("pipeline"):
    return pipeline_seeds.summarize(rows)
  out = {}
  for m in metrics:
    have = [r for r in rows if f"{m}_change" in r]
    if not have:
      continue
    stats = {k: intervals.mean_interval([r[f"{m}_{k}"] for r in have])
             for k in ("before", "after", "change")}
    by_seed = {}
    for r in have:
      by_seed.setdefault(r["sft_seed"], []).append(r[f"{m}_change"])
    out[m] = {**stats, "change_min": stats["change"]["min"],
              "effect": intervals.excludes_zero(stats["change"]),
              "by_sft_seed": {s: sum(v) / len(v) for s, v in sorted(by_seed.items())}}
  return out


def markdown(rows: list[dict], summary: dict, metrics=METRICS) -> str:
  """The study's tables: the summary (percent, mean ± 95% t half-width over n runs) and every
  run's row."""
  if rows and rows[0].get("pipeline"):
    return pipeline_seeds.markdown(rows, summary)
  pct = lambda s: intervals.format_interval(s, scale=100)
  n = len(rows)
  lines = [f"| held-out metric (%, n = {n} runs, mean ± 95% t) | before RL | after RL | change | "
           "smallest change | effect |", "|---|---|---|---|---|---|"]
  for m, s in summary.items():
    lines.append(f"| {m} | {pct(s['before'])} | {pct(s['after'])} | {pct(s['change'])} | "
                 f"{100 * s['change_min']:+.1f} | {'yes' if s['effect'] else 'no'} |")
  lines += ["", "| run | SFT seed | RL seed | " + " | ".join(
      f"{m} before -> after" for m in metrics if m in summary) + " |",
            "|---|---|---|" + "---|" * len(summary)]
  for r in rows:
    cells = [f"{100 * r[f'{m}_before']:.1f} -> {100 * r[f'{m}_after']:.1f}"
             for m in metrics if m in summary]
    lines.append(f"| {r['run']} | {r['sft_seed']} | {r['rl_seed']} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def read_study(root: str) -> dict:
  """`<root>/seeds.json` of a finished study; ValueError naming the file when it is missing."""
  path = os.path.join(root, "seeds.json")
  if not os.path.exists(path):
    raise ValueError(f"{path}: no such file; a study writes it when all its runs are done")
  with open(path) as f:
    return json.load(f)


def compare(base_rows: list[dict], rows: list[dict], metrics=METRICS) -> dict:
  """Two studies from the same starts (e.g. synchronous vs asynchronous RL), run by run.

  Pairs the runs by name (the same SFT and RL seeds: the same start and seeds), so the start's
  variance cancels. Returns {"runs": [paired names], metric: {"base_change", "change",
  "difference" (this study's change minus the base's, paired): `mean_interval`s, "effect"
  (the difference's interval excludes 0), "steps", "base_curve", "curve", "curve_difference"
  (paired): per evaluation step a `mean_interval` over the runs}}. The curves need both
  studies to evaluate at the same steps; raises ValueError naming the run otherwise, or when
  no run is in both."""
  if any(r.get("pipeline") for r in list(base_rows) + list(rows)):
    raise ValueError("seeds.compare: staged pipeline studies are not compared run by run; "
                     "read each study's seeds.md")
  base = {r["run"]: r for r in base_rows}
  names = [r["run"] for r in rows if r["run"] in base]
  if not names:
    raise ValueError(f"seeds.compare: no run in both studies (base {sorted(base)}, this "
                     f"{[r['run'] for r in rows]})")
  this = {r["run"]: r for r in rows}
  for name in names:
    if this[name]["eval_steps"] != base[name]["eval_steps"]:
      raise ValueError(f"seeds.compare: run {name} evaluated at steps {this[name]['eval_steps']}, "
                       f"its base at {base[name]['eval_steps']}; curves need the same steps")
  out = {"runs": names}
  for m in metrics:
    if not all(f"{m}_change" in this[n] and f"{m}_change" in base[n] for n in names):
      continue
    diff = intervals.mean_interval([this[n][f"{m}_change"] - base[n][f"{m}_change"] for n in names])
    curve = lambda rs: [intervals.mean_interval(v) for v in zip(*(rs[n][f"{m}_curve"]
                                                                    for n in names))]
    paired = [intervals.mean_interval(v) for v in zip(*(
        [a - b for a, b in zip(this[n][f"{m}_curve"], base[n][f"{m}_curve"])] for n in names))]
    out[m] = {"base_change": intervals.mean_interval([base[n][f"{m}_change"] for n in names]),
              "change": intervals.mean_interval([this[n][f"{m}_change"] for n in names]),
              "difference": diff, "effect": intervals.excludes_zero(diff),
              "steps": this[names[0]]["eval_steps"], "base_curve": curve(base),
              "curve": curve(this), "curve_difference": paired}
  return out


def comparison_markdown(comparison: dict, base_label: str, label: str) -> str:
  """`compare`'s tables: the paired difference of the changes, then each metric's curve (mean
  ± 95% t per evaluation step, percent)."""
  pct = lambda s: intervals.format_interval(s, scale=100)
  n = len(comparison["runs"])
  metrics = [m for m in comparison if m != "runs"]
  lines = [f"| held-out metric (%, n = {n} paired runs, mean ± 95% t) | change, {base_label} | "
           f"change, {label} | difference ({label} - {base_label}, paired) | effect |",
           "|---|---|---|---|---|"]
  for m in metrics:
    c = comparison[m]
    lines.append(f"| {m} | {pct(c['base_change'])} | {pct(c['change'])} | {pct(c['difference'])} "
                 f"| {'yes' if c['effect'] else 'no'} |")
  for m in metrics:
    c = comparison[m]
    lines += ["", f"| {m} (%) at RL step | " + " | ".join(str(s) for s in c["steps"]) + " |",
              "|---|" + "---|" * len(c["steps"])]
    for name, curve in ((base_label, c["base_curve"]), (label, c["curve"]),
                        ("difference (paired)", c["curve_difference"])):
      lines.append(f"| {name} | " + " | ".join(pct(s) for s in curve) + " |")
  return "\n".join(lines) + "\n"


def run_study(root: str, sft_seeds, rl_seeds, rl_args: list[str], *, parallel: int = 1,
              poll_seconds: float = 2.0) -> dict:
  """Runs (or resumes) every run of the study, `parallel` processes at a time, then writes
  `<root>/seeds.json` (rows + summary) and `<root>/seeds.md`; returns the JSON's content.

  Raises RuntimeError naming the run and its log's last line when a run fails (the others
  already running finish first)."""
  os.makedirs(root, exist_ok=True)
  runs = plan_runs(root, list(sft_seeds), list(rl_seeds))
  done = {r.name for r in runs if os.path.exists(os.path.join(r.workdir, RESULT_FILE))}
  pending = [r for r in runs if r.name not in done]
  running, failed, start = {}, [], time.time()
  logging.info("seeds study in %s: %d runs (%d done), %d at a time", root, len(runs), len(done),
               parallel)
  while running or (pending and not failed):
    for name, w in list(running.items()):
      code = w.process.poll()
      if code is None:
        continue
      del running[name]
      if code == 0:
        done.add(name)
        run = next(r for r in runs if r.name == name)
        write_atomic(os.path.join(run.workdir, RESULT_FILE), json.dumps(read_result(run)))
        logging.info("seeds: %s done in %.0f s (%d of %d)", name, time.time() - w.started,
                     len(done), len(runs))
      else:
        failed.append(f"{name} (exit {code}): {workers.last_line(w.log_path)}")
    finished = {r.workdir for r in runs if r.name in done}
    ready = [r for r in pending if not r.start_from or r.start_from in finished]
    while ready and len(running) < parallel and not failed:
      run = ready.pop(0)
      pending.remove(run)
      os.makedirs(run.workdir, exist_ok=True)
      log = os.path.join(run.workdir, "seeds.log")
      running[run.name] = workers.launch(run.name, run_command(run, rl_args), log)
      logging.info("seeds: %s started (log %s)", run.name, log)
    time.sleep(poll_seconds if running else 0)
  if failed:
    raise RuntimeError("seeds: runs failed; rerun the same command to resume: " + "; ".join(failed))
  rows = [json.load(open(os.path.join(r.workdir, RESULT_FILE))) for r in runs]
  summary = summarize(rows)
  out = {"root": root, "rl_args": rl_args, "sft_seeds": list(sft_seeds),
         "rl_seeds": list(rl_seeds), "rows": rows, "summary": summary,
         "interval": "95% Student t over runs", "seconds": time.time() - start}
  write_atomic(os.path.join(root, "seeds.json"), json.dumps(out, indent=1))
  write_atomic(os.path.join(root, "seeds.md"), markdown(rows, summary))
  return out
