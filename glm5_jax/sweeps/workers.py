"""Process plumbing of a sweep: worker processes that die with their parent, and the worker
exit code that means "interrupted, resume me" (the SIGTERM flag itself is
`glm5_jax.train.stopping.StopSignal`).

A parallel sweep's parent launches each run as `worker_command + [spec.json]`. On Linux every
worker asks the kernel for SIGTERM when its parent dies (`prctl(PR_SET_PDEATHSIG)`), so a
parent killed even by SIGKILL never leaves workers training unsupervised: they stop the way a
SIGTERM stops them (a training run saves a checkpoint first). Until they are gone they hold
their run locks, so a rerun cannot start second copies of their runs.
"""

import dataclasses
import os
import signal
import subprocess
import time

from glm5_jax.train.stopping import EXIT_STOPPED_EARLY, die_with_parent

# A worker's run stopped early (SIGTERM); it resumes on the next attempt.
EXIT_INTERRUPTED = EXIT_STOPPED_EARLY


@dataclasses.dataclass
class Worker:
  name: str
  process: subprocess.Popen
  log_path: str
  started: float


def launch(name: str, command: list[str], log_path: str) -> Worker:
  """Starts `command` with its output appended to `log_path`; on Linux it gets SIGTERM when
  this process dies."""
  with open(log_path, "a") as log:  # the child keeps its own copy of the descriptor
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               preexec_fn=die_with_parent(os.getpid()))
  return Worker(name, process, log_path, time.time())


def interrupt(workers) -> None:
  """Forwards SIGTERM to every worker still running."""
  for worker in workers:
    if worker.process.poll() is None:
      worker.process.send_signal(signal.SIGTERM)


def last_line(path: str) -> str:
  """The last non-empty line of a worker's log (its error, usually), or ""."""
  try:
    with open(path, errors="replace") as f:
      lines = [line.strip() for line in f.readlines()[-50:] if line.strip()]
  except OSError:
    return ""
  return lines[-1] if lines else ""
