"""tools/quant_eval.py over several runs (glm5_jax.sweeps.quant_table): each format's mean and
95% t interval over the runs, and its accuracy change against the first format, paired by run
(no model: made-up rows)."""

from glm5_jax.sweeps import quant_table


def test_over_runs_table_pairs_each_formats_accuracy_with_the_first_format_by_run():
  row = lambda fmt, loss, acc, agree: dict(format=fmt, heldout_loss=loss, accuracy=acc,
                                           agreement=agree)
  # w4a8 is 1-3 points under float on every run though the runs differ by 40 points.
  tables = [[row("float", 0.08, 0.25, 1.0), row("w4a8", 0.09, 0.23, 0.8)],
            [row("float", 0.07, 0.80, 1.0), row("w4a8", 0.08, 0.79, 0.9)],
            [row("float", 0.06, 0.77, 1.0), row("w4a8", 0.07, 0.74, 0.85)]]
  lines = quant_table.over_runs(tables).splitlines()
  assert lines[1] == "over 3 runs: mean ± 95% t half-width (n = 3)"
  float_row, w4a8_row = lines[3].split(), lines[4].split()
  assert float_row[:4] == ["float", "0.0700", "±", "0.0248"]
  assert float_row[7:10] == ["0.000", "±", "0.000"]
  # -2 ± 2.5 points: the interval includes 0, so no effect is claimed.
  assert w4a8_row[7:10] == ["-0.020", "±", "0.025"] and "(effect)" not in lines[4]
  tables[2][1]["accuracy"] = 0.755  # now -2.0, -1.0, -1.5: one sign, a narrow interval
  assert quant_table.over_runs(tables).splitlines()[4].split()[7:11] == ["-0.015", "±", "0.012",
                                                                     "(effect)"]
