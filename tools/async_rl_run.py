"""One `experiments/rl.py --mode=async` run as a subprocess, timed: the run the RL benchmarks
(tools/bench_rl.py, tools/bench_long_tail.py) measure and then read from its run directory;
and the flags every such benchmark takes (`define_run_flags`)."""

import os
import subprocess
import sys
import time

from absl import flags

from glm5_jax.rl.layout import RunDirs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define_run_flags(*, workdir: str, runs: str, steps: int, workers: int):
  """`(--workdir, --steps, --rollout_workers)` of an RL benchmark, with its defaults: the
  directory its SFT run (trained once, reused) and its `runs` go under, RL steps of each run,
  rollout worker processes of each asynchronous run."""
  return (flags.DEFINE_string("workdir", workdir, f"SFT (reused) and {runs} go under it; the "
                              "runs are started afresh."),
          flags.DEFINE_integer("steps", steps, "RL steps of each run."),
          flags.DEFINE_integer("rollout_workers", workers,
                               "Rollout worker processes of each asynchronous run."))


def run_async_rl(name: str, workdir: str, workers: int,
                 config_args: list[str]) -> tuple[float, RunDirs]:
  """Runs experiments/rl.py --mode=async in `workdir` with `workers` rollout worker processes and
  the config flags `config_args` (`--config=FILE:ARGS`, `--config.FIELD=VALUE`, ...).

  Returns (wall seconds, process start and compilation included; the run's `RunDirs` at
  `<workdir>/rl`). A run that exits non-zero raises RuntimeError naming the run `name` and
  showing the end of its stderr.
  """
  command = [sys.executable, os.path.join(REPO, "experiments", "rl.py"), "--mode=async",
             f"--rollout_workers={workers}", f"--workdir={workdir}", *config_args]
  start = time.time()
  proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
  wall = time.time() - start
  if proc.returncode != 0:
    raise RuntimeError(f"the {name} run failed ({proc.returncode}); its last lines:\n"
                       + proc.stderr[-3000:])
  return wall, RunDirs.at(os.path.join(workdir, "rl"))
