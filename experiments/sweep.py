"""Run a sweep: named runs (train / training-free eval / SWA search) with dependencies.

  python experiments/sweep.py --sweep=configs/sweeps/attention_conversion.py
  python experiments/sweep.py --sweep=configs/sweeps/muon_split.py --parallel=2
  python experiments/sweep.py --sweep=configs/sweeps/attention_conversion.py:quick \
      --sweep_dir=/tmp/conv_quick                                  # a few steps, end to end
  python experiments/sweep.py --sweep=configs/sweeps/muon_split.py \
      --sweep.size.train_steps=1200 --sweep.suite.examples_per_cell=8
  python experiments/sweep.py --sweep=configs/sweeps/muon_split.py --seeds=0,1,2 --parallel=2

The sweep configs import `configs.common` and name experiment configs as modules
(`configs.tiny`): the `configs` package is installed with `glm5_jax` (setup.cfg). The paths in
the examples above are relative to the repository root.

Runs execute in dependency order (glm5_jax.sweeps.spec), one after another in this process
or, with --parallel=N, up to N worker processes at a time. Everything goes under --sweep_dir
(default workdir/sweeps/<name>, or <name>_<arg> for a sweep config argument such as `:quick`):
one directory per run and the report, `results.json`, `results.md` and plots (accuracy vs
context length per variant, loss curves). Re-running the same command resumes: finished runs
are skipped, a half-trained run continues from its checkpoint. --report_only rewrites the
report from the finished runs, or, in a directory without runs/ (a published report such as
docs/ablations/<name>), from its own results.json, with the sweep's current checks:

  python experiments/sweep.py --sweep=configs/sweeps/muon_split.py --report_only \
      --sweep_dir=docs/ablations/muon_split

--seeds=0,1,2 runs the whole sweep once per seed (each run `x` as `x_seed<s>`, the experiment
config's `seed` = s; glm5_jax.sweeps.spec, "Seeds"), and the report gives every run's mean and
95% t interval over the seeds and decides each check on the seed-paired differences. A seeded
sweep is a different sweep: give it its own --sweep_dir (the default appends `_seeds<...>`).

SIGTERM stops the sweep: a training run saves a checkpoint and stops (in parallel mode the
workers get the SIGTERM forwarded), no further run starts, the interrupted runs are not
recorded as finished, and the command exits non-zero; re-running it resumes them.
"""

import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from glm5_jax.sweeps import report as sweep_report, runner as sweep_runner
from glm5_jax.sweeps.spec import parse_runs
from glm5_jax.train import console

_SWEEP = config_flags.DEFINE_config_file(
    "sweep", None, "Sweep config (configs/sweeps/*.py[:quick]).", lock_config=False)
_SWEEP_DIR = flags.DEFINE_string("sweep_dir", "", "Output directory (default "
                                 "workdir/sweeps/<name>[_<arg>]).")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Runs at a time; > 1 uses worker processes.",
                                 lower_bound=1)
_ONLY = flags.DEFINE_list("only", [], "Run only these runs (and what they depend on).")
_ON_CHANGE = flags.DEFINE_enum("on_change", "error", ["error", "redo"], "A finished run whose "
                               "spec changed: stop with an error, or redo it.")
_SEEDS = flags.DEFINE_list("seeds", [], "Run the sweep once per seed (ints), report means and "
                           "95% t intervals over them.")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Only rewrite the report.")
_RUN_SPEC = flags.DEFINE_string("run_spec", "", "Worker mode: execute this runs/<name>/spec.json"
                                " (written by a parallel sweep) and exit (75: interrupted).")


def main(argv):
  del argv
  console.quiet_library_info()
  console.announce_slow_compiles()
  if _RUN_SPEC.value:
    return sweep_runner.run_worker(_RUN_SPEC.value)
  sweep = _SWEEP.value
  if sweep is None:
    raise app.UsageError("--sweep=configs/sweeps/<name>.py[:quick] is required")
  path, _, arg = config_flags.get_config_filename(flags.FLAGS["sweep"]).partition(":")
  suffix = "_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", arg) if arg else ""
  if _SEEDS.value:
    try:
      sweep.seeds = tuple(int(s) for s in _SEEDS.value)
    except ValueError as e:
      raise app.UsageError(f"--seeds: expected comma-separated ints, got {_SEEDS.value}") from e
    suffix += "_seeds" + "-".join(str(s) for s in sweep.seeds)
  sweep_dir = _SWEEP_DIR.value or os.path.join("workdir", "sweeps", sweep.name + suffix)
  if _REPORT_ONLY.value:
    if not os.path.isdir(sweep_dir):  # a report of nothing; and never create the directory
      raise app.UsageError(f"--report_only: no sweep directory {sweep_dir!r} (run the sweep "
                           "first, or pass its --sweep_dir)")
    runs = parse_runs(sweep)
    if os.path.isdir(os.path.join(sweep_dir, "runs")):
      results = sweep_runner.finished_results(sweep_dir, runs, "error")
    else:  # a published report (docs/ablations/<name>): its own results.json
      results = sweep_report.stored_results(sweep, sweep_dir, runs)
    outcome = sweep_runner.SweepOutcome(runs=runs, results=results, failed={})
  else:
    outcome = sweep_runner.run_sweep(
        sweep, sweep_dir, parallel=_PARALLEL.value, on_change=_ON_CHANGE.value,
        only=_ONLY.value, config_dir=os.path.dirname(os.path.abspath(path)),
        worker_command=[sys.executable, os.path.abspath(__file__), "--run_spec"])
  sweep_report.write_report(sweep, sweep_dir, outcome.runs, outcome.results,
                            failures=outcome.failed)
  results_md = os.path.join(sweep_dir, "results.md")
  with open(results_md) as f:
    print(f.read())
  print(f"report: {results_md} (and results.json, plots) in {os.path.abspath(sweep_dir)}")
  logging.info("sweep %s: %d runs finished, %d failed", sweep.name, len(outcome.results),
               len(outcome.failed))
  outcome.raise_if_failed()


if __name__ == "__main__":
  app.run(main)
