"""tools/quant_eval.py's table over several runs (e.g. a seeds study's): each format's mean and
95% Student t half-width over the runs, and its accuracy change against the first format,
paired by run (an effect only where that interval excludes 0).

  over_runs(tables) -> str     tables[r][f]: run r's row of format f (`format`, `heldout_loss`,
                               `accuracy`, `agreement`), formats in the same order in every run
"""

from glm5_jax.sweeps import intervals


def over_runs(tables: list[list[dict]]) -> str:
  """The table (module docstring) as text, one line per format under a header."""
  n = len(tables)
  first = tables[0][0]["format"]
  lines = [f"\nover {n} runs: mean ± 95% t half-width (n = {n})",
           f"{'format':<16}{'held-out loss':>20}{'accuracy':>16}{'accuracy - ' + first:>26}"
           f"{'agreement':>16}"]
  show = lambda values, digits=3: intervals.format_interval(intervals.mean_interval(values),
                                                            digits=digits)
  for i, row in enumerate(tables[0]):
    rows = [t[i] for t in tables]
    if any(r["format"] != row["format"] for r in rows):
      raise ValueError(f"over_runs: row {i} is {[r['format'] for r in rows]} across the runs; "
                       "every run must list the same formats in the same order")
    change = intervals.mean_interval([r["accuracy"] - t[0]["accuracy"]
                                      for r, t in zip(rows, tables)])
    effect = " (effect)" if intervals.excludes_zero(change) else ""
    lines.append(f"{row['format']:<16}{show([r['heldout_loss'] for r in rows], digits=4):>20}"
                 f"{show([r['accuracy'] for r in rows]):>16}"
                 f"{intervals.format_interval(change, digits=3) + effect:>26}"
                 f"{show([r['agreement'] for r in rows]):>16}")
  return "\n".join(lines)
