"""A sweep's report: results.json, results.md (tables and checks) and matplotlib plots.

Over seeds (a sweep with `seeds`, glm5_jax.sweeps.spec): each declared run's metrics as mean
+- the 95% Student t half-width over its seeds' copies (`intervals.mean_interval`), and each
check decided on the seed-paired differences left - right: it holds when the difference's
interval lies on the expected side of 0 ("~": inside +-tolerance), does not hold when it lies
on the other side (outside the tolerance), and is "not shown" when the interval straddles
the boundary: the seeds cannot tell the two runs apart.

Plots are drawn on `matplotlib.figure.Figure`s and saved to files directly: no pyplot, no
backend or display state.
"""

import json
import math
import os

from matplotlib.figure import Figure
import numpy as np

from glm5_jax.eval.report import markdown_table, percent, write_json
from glm5_jax.sweeps import intervals


def _suite_runs(runs: dict) -> list[tuple[str, dict]]:
  return [(name, r) for name, r in runs.items() if r.get("suite")]


LOSS_METRICS = ("text_loss", "heldout_lm_loss")
LOSS_TOLERANCE = 0.02  # nats: "~" on a loss metric without an explicit tolerance


def metric_value(result: dict, metric: str) -> tuple[float | None, int | None]:
  """(value, examples behind it or None) of one run's `metric`: "score" (suite mean),
  "longest" (suite, longest length), "text_loss" or "heldout_lm_loss" (train runs)."""
  if metric in LOSS_METRICS:
    return result.get(metric), None
  suite = result.get("suite")
  if not suite:
    return None, None
  lengths = suite["meta"]["lengths"]
  if metric == "score":
    return suite["score"], suite["meta"]["examples"]
  if metric == "longest":
    return suite["by_length"][str(max(lengths))], suite["meta"]["examples"] // len(lengths)
  raise ValueError(f"check metric {metric!r}: expected 'score', 'longest' or one of "
                   f"{LOSS_METRICS}")


def steps_behind(name: str, runs: dict) -> int | None:
  """Training steps behind run `name`'s params: a train run's own `steps` plus those of the
  run it started from (`init_from`, or an eval / search run's `checkpoint`), followed through
  the sweep's train runs. None when the chain leaves the sweep (an outside checkpoint) or a
  run in it is missing."""
  by_workdir = {os.path.normpath(r["workdir"]): r for r in runs.values() if r.get("workdir")}
  result, total, seen = runs.get(name), 0, set()
  while result is not None and id(result) not in seen:
    seen.add(id(result))
    total += result.get("steps", 0) if result.get("workdir") else 0
    parent = result.get("init_from") or result.get("checkpoint")
    if not parent:
      return total
    result = by_workdir.get(os.path.normpath(parent))
  return None


def _too_short(c: dict, runs: dict) -> str | None:
  """Why check `c` cannot show with these runs (fewer steps than its `min_steps`), or None."""
  steps = [steps_behind(c[side], runs) for side in ("left", "right")]
  if not c.get("min_steps") or None in steps or min(steps) >= c["min_steps"]:
    return None
  return (f"the shorter run has {min(steps)} training steps behind it, the ordering needs "
          f">= {c['min_steps']}")


def seed_copies(runs: dict) -> dict[str, dict[int, str]]:
  """{declared run: {seed: its copy's name}} of a sweep run over seeds ({} without seeds)."""
  out = {}
  for name, r in runs.items():
    if "seed_of" in r:
      out.setdefault(r["seed_of"], {})[r["seed"]] = name
  return out


def _tolerance(c: dict, a: float, b: float, na, nb) -> float:
  """A "~" check's tolerance: its own, else 0.02 nats for a loss, else two standard errors of
  the difference of two binomial means (never below one example)."""
  if c["tolerance"] >= 0:
    return c["tolerance"]
  if na is None:
    return LOSS_TOLERANCE
  tolerance = 2 * math.sqrt(a * (1 - a) / max(na, 1) + b * (1 - b) / max(nb, 1))
  return max(tolerance, 1.0 / max(min(na, nb), 1))


def evaluate_checks(checks, runs: dict) -> list[dict]:
  """Each check with its measured values and whether it holds (None: a value is missing, the
  runs are too short to show it (`too_short` says why), or over seeds the interval of the
  difference straddles the boundary (`not_shown`))."""
  copies = seed_copies(runs)
  out = []
  for c in checks:
    if copies and c["left"] in copies and c["right"] in copies:
      out.append(_seeded_check(c, runs, copies))
      continue
    reason = _too_short(c, runs)
    row = dict(c, too_short=reason) if reason else dict(c)
    (a, na), (b, nb) = (metric_value(runs.get(c["left"], {}), c["metric"]),
                        metric_value(runs.get(c["right"], {}), c["metric"]))
    if a is None or b is None:
      out.append(dict(row, holds=None, detail="not measured"))
      continue
    show = _shower(c["metric"])
    if c["op"] == "~":
      tolerance = _tolerance(c, a, b, na, nb)
      holds = abs(a - b) <= tolerance
      detail = f"|{show(a)} - {show(b)}| <= {show(tolerance)}"
    else:
      holds = a > b if c["op"] == ">" else a < b
      detail = f"{show(a)} {c['op']} {show(b)}"
    out.append(dict(row, left_value=a, right_value=b, detail=detail,
                    holds=None if reason else bool(holds)))
  return out


def _shower(metric: str):
  return percent if metric not in LOSS_METRICS else (lambda v: f"{v:.3f}")


def _seeded_check(c: dict, runs: dict, copies: dict) -> dict:
  """A check between two declared runs of a sweep over seeds: on the seeds both finished, the
  mean and 95% t interval of the paired differences (module docstring)."""
  left, right = copies[c["left"]], copies[c["right"]]
  seeds = sorted(set(left) & set(right))
  first = dict(c, left=left[seeds[0]], right=right[seeds[0]]) if seeds else c
  reason = _too_short(first, runs) if seeds else None
  row = dict(c, too_short=reason) if reason else dict(c)
  pairs = [(metric_value(runs[left[s]], c["metric"]), metric_value(runs[right[s]], c["metric"]))
           for s in seeds]
  pairs = [(a, na, b, nb) for (a, na), (b, nb) in pairs if a is not None and b is not None]
  if not pairs:
    return dict(row, holds=None, seeds=0, detail="not measured")
  a_mean = float(np.mean([p[0] for p in pairs]))
  b_mean = float(np.mean([p[2] for p in pairs]))
  diff = intervals.mean_interval([p[0] - p[2] for p in pairs])
  show = _shower(c["metric"])
  n = len(pairs)
  if diff["half_width"] is None:
    return dict(row, left_value=a_mean, right_value=b_mean, seeds=n, holds=None,
                not_shown="one seed: no interval",
                detail=f"{show(a_mean)} vs {show(b_mean)} (one seed)")
  low, high = diff["low"], diff["high"]
  spread = f"difference {_signed(diff['mean'], show)} ± {show(diff['half_width'])} (95% t, n={n})"
  if c["op"] == "~":
    # Examples behind a mean over n seeds: n times one run's.
    na, nb = pairs[0][1], pairs[0][3]
    tolerance = _tolerance(c, a_mean, b_mean, None if na is None else na * n,
                           None if nb is None else nb * n)
    holds = True if -tolerance <= low and high <= tolerance else (
        False if low > tolerance or high < -tolerance else None)
    detail = f"{show(a_mean)} vs {show(b_mean)}; {spread}; tolerance ± {show(tolerance)}"
  else:
    sign = 1 if c["op"] == ">" else -1
    low_s, high_s = sorted((sign * low, sign * high))
    holds = True if low_s > 0 else (False if high_s < 0 else None)
    detail = f"{show(a_mean)} vs {show(b_mean)}; {spread}"
  out = dict(row, left_value=a_mean, right_value=b_mean, difference=diff, seeds=n, detail=detail,
             holds=None if reason else holds)
  if holds is None and not reason:
    out["not_shown"] = "the interval of the difference straddles " + (
        "the tolerance" if c["op"] == "~" else "0")
  return out


def _signed(value: float, show) -> str:
  return ("+" if value >= 0 else "-") + show(abs(value))


def _check_result(c: dict) -> str:
  if c.get("too_short"):
    return f"too short to show ({c['too_short']})"
  if c.get("not_shown"):
    return f"not shown ({c['not_shown']})"
  return {True: "holds", False: "does not hold", None: "not evaluated"}[c["holds"]]


def sweep_markdown(name: str, runs: dict, checks: list[dict], status: dict,
                   plots: list[str]) -> str:
  parts = [f"# Sweep `{name}`", ""]
  suite_runs = _suite_runs(runs)
  if suite_runs:
    lengths = sorted({n for _, r in suite_runs for n in r["suite"]["meta"]["lengths"]})
    train_length = next((r["suite"]["meta"].get("train_length") for _, r in suite_runs), None)
    label = lambda n: f"{n} ({n / train_length:g}x)" if train_length else str(n)
    rows = []
    for run_name, r in suite_runs:
      by_length = r["suite"]["by_length"]
      rows.append([run_name, r.get("variant", ""), r.get("group", ""),
                   f"`{r['suite']['meta']['attention_pattern']}`"]
                  + [percent(by_length.get(str(n))) for n in lengths]
                  + [percent(r["suite"]["score"]), _loss(r.get("text_loss")),
                     _loss(r.get("heldout_lm_loss"))])
    parts += ["## Retrieval exact match (%) by context length", "",
              "Mean over tasks; teacher-forced argmax on answer tokens. `text loss` is the "
              "held-out Python-stdlib LM loss and `eval loss` the held-out mixture LM loss "
              "at the end of training (train runs only).", "",
              markdown_table(["run", "variant", "group", "pattern"]
                             + [f"L={label(n)}" for n in lengths]
                             + ["mean", "text loss", "eval loss"], rows), ""]
    answer_rows = [[run_name] + [percent(r["suite"].get("answers_by_length", {}).get(str(n)))
                                 for n in lengths]
                   + [percent(r["suite"].get("answer_accuracy"))] for run_name, r in suite_runs]
    parts += ["## Answer accuracy (%) by context length", "",
              "Partial credit: the share of answers (of multi-answer examples) fully right; "
              "mean over tasks.", "",
              markdown_table(["run"] + [f"L={label(n)}" for n in lengths] + ["mean"],
                             answer_rows), ""]
    tasks = list(suite_runs[0][1]["suite"]["by_task_length"])
    task_rows = [[run_name] + [percent(np.mean(list(r["suite"]["by_task_length"][t].values())))
                               if t in r["suite"]["by_task_length"] else "-" for t in tasks]
                 for run_name, r in suite_runs]
    parts += ["## Exact match (%) by task (mean over lengths)", "",
              markdown_table(["run"] + tasks, task_rows), ""]
  searches = [(n, r) for n, r in runs.items() if r.get("kind") == "swa_search"]
  for run_name, r in searches:
    top = ", ".join(f"`{p}` {percent(s)}" for p, s in r["history"][-1][:8])
    parts += [f"## SWA layer search `{run_name}`", "",
              f"`{r['base_pattern']}` -> **`{r['pattern']}`** (score {percent(r['score'])}) "
              f"at length {r['length']}; {r['evaluations']} candidates, beam {r['beam_width']}, "
              f"{r['layers_per_step']} layers/step. Final step: {top}.", ""]
  copies = seed_copies(runs)
  if copies:
    parts += ["## Over seeds", "",
              "Each run's mean ± the 95% Student t half-width over its seeds (n: the seeds "
              "finished); the tables above list every seed's copy.", "",
              markdown_table(["run", "variant", "n", "suite mean (%)", "longest (%)",
                              "text loss", "eval loss"],
                             [_seed_row(base, seeds, runs) for base, seeds in copies.items()]),
              ""]
  if checks:
    rows = [[f"{c['left']} {c['op']} {c['right']}", c["metric"], c.get("detail", ""),
             _check_result(c), c.get("note", "")] for c in checks]
    parts += ["## Expected orderings", ""]
    short = [f"`{c['left']} {c['op']} {c['right']}` ({c['metric']})" for c in checks
             if c.get("too_short")]
    if short:
      parts += [f"These runs are too short to show {len(short)} of the {len(checks)} orderings: "
                f"{', '.join(short)}. Their measured values test the plumbing, not the "
                "ordering; train longer (`--sweep.size.*`) to read them.", ""]
    parts += [markdown_table(["check", "metric", "measured", "result", "note"], rows), ""]
  parts += ["## Runs", "", markdown_table(
      ["run", "kind", "status", "seconds"],
      [[n, runs.get(n, {}).get("kind", ""), s, f"{runs[n]['seconds']:.0f}" if n in runs else "-"]
       for n, s in status.items()]), ""]
  if plots:
    parts += ["## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})"
                                  for p in plots] + [""]
  return "\n".join(parts)


def _seed_row(base: str, seeds: dict, runs: dict) -> list[str]:
  results = [runs[name] for _, name in sorted(seeds.items())]
  cells = []
  for metric, scale, digits in (("score", 100, 1), ("longest", 100, 1), ("text_loss", 1, 3),
                                ("heldout_lm_loss", 1, 3)):
    values = [v for v in (metric_value(r, metric)[0] for r in results) if v is not None]
    cells.append(intervals.format_interval(intervals.mean_interval(values), scale=scale,
                                           digits=digits) if values else "-")
  return [base, results[0].get("variant", ""), str(len(results))] + cells


def _loss(value) -> str:
  return "-" if value is None else f"{value:.3f}"


def plot_accuracy_vs_length(runs: dict, path: str) -> str | None:
  """One panel per group: mean exact match vs context length, one line per run."""
  suite_runs = _suite_runs(runs)
  if not suite_runs:
    return None
  groups = list(dict.fromkeys(r.get("group") or "runs" for _, r in suite_runs))
  if len(groups) > 1 and "baseline" in groups:  # the baseline is drawn in every other panel
    groups.remove("baseline")
  fig = Figure(figsize=(5.5 * len(groups), 4))
  axes = fig.subplots(1, len(groups), squeeze=False)
  for ax, group in zip(axes[0], groups):
    for run_name, r in suite_runs:
      if (r.get("group") or "runs") != group and r.get("group") != "baseline":
        continue
      lengths = r["suite"]["meta"]["lengths"]
      values = [100 * r["suite"]["by_length"][str(n)] for n in lengths]
      style = "k--" if r.get("group") == "baseline" else "o-"
      ax.plot(lengths, values, style, label=r.get("variant") or run_name)
    ax.set_xscale("log", base=2)
    all_lengths = sorted({n for _, r in suite_runs for n in r["suite"]["meta"]["lengths"]})
    ax.set_xticks(all_lengths, [str(n) for n in all_lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("exact match (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(group)
    _finish_axes(ax)
  return _save(fig, path)


def plot_loss_curves(runs: dict, path: str) -> str | None:
  """Training LM loss vs step of every train run (held-out eval points as markers)."""
  train_runs = [(n, r) for n, r in runs.items() if r.get("loss_curve")]
  if not train_runs:
    return None
  fig = Figure(figsize=(7, 4.5))
  ax = fig.subplots()
  for run_name, r in train_runs:
    curve = np.asarray(r["loss_curve"], float)
    (line,) = ax.plot(curve[:, 0], curve[:, 1], "-" if len(curve) > 4 else ".-",
                      label=run_name, linewidth=1)
    points = [(s, v) for s, v, _ in r.get("eval_curve", []) if v is not None]
    if points:
      ax.plot(*zip(*points), "o", color=line.get_color(), markersize=4)
  ax.set_xlabel("step (within the run)")
  ax.set_ylabel("LM loss (line: train, dots: held-out)")
  _finish_axes(ax)
  return _save(fig, path)


def _finish_axes(ax):
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)


def _save(fig, path: str) -> str:
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path


def stored_results(sweep, sweep_dir: str, runs_in_order: list) -> dict:
  """{name: result} from a report's own results.json (a published sweep, docs/ablations/<name>,
  keeps no run directories): what the report was written from, re-read to rewrite it with the
  sweep's current checks and wording. The runs' spec hashes are not compared (a refactor of
  the config names changes them, not the runs); the size must be the report's.

  Raises:
    FileNotFoundError: no results.json in `sweep_dir`. ValueError: a different size.
  """
  path = os.path.join(sweep_dir, "results.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{sweep_dir}: neither runs/ nor results.json to report from")
  with open(path) as f:
    stored = json.load(f)
  size = sweep.size.to_dict()
  if stored.get("size") != size:
    changed = sorted(k for k in {*size, *stored.get("size", {})}
                     if size.get(k) != stored.get("size", {}).get(k))
    raise ValueError(f"{path}: written at size {stored.get('size')}, the sweep is at {size}: "
                     f"pass the report's --sweep.size.* ({', '.join(changed)})")
  return {r.name: stored["runs"][r.name] for r in runs_in_order if r.name in stored["runs"]}


def write_report(sweep, sweep_dir: str, runs_in_order: list, results: dict, *,
                 failures: dict | None = None) -> dict:
  """Writes results.json, results.md and the plots; returns the results.json content."""
  failures = failures or {}
  status = {r.name: "done" if r.name in results else
            ("failed: " + failures[r.name] if r.name in failures else "pending")
            for r in runs_in_order}
  ordered = {r.name: results[r.name] for r in runs_in_order if r.name in results}
  checks = evaluate_checks([dict(c) for c in sweep.get("checks", ())], ordered)
  plots = []
  for plot, filename in ((plot_accuracy_vs_length, "accuracy_vs_length.png"),
                         (plot_loss_curves, "loss_curves.png")):
    written = plot(ordered, os.path.join(sweep_dir, filename))
    if written:
      plots.append(written)
  report = dict(sweep=sweep.name, size=sweep.size.to_dict(), status=status, checks=checks,
                runs=ordered, plots=[os.path.basename(p) for p in plots])
  write_json(os.path.join(sweep_dir, "results.json"), report)
  with open(os.path.join(sweep_dir, "results.md"), "w") as f:
    f.write(sweep_markdown(sweep.name, ordered, checks, status, plots))
  return report
