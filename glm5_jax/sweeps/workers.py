"""Process plumbing of a sweep: the SIGTERM stop request, worker processes that die with
their parent, and the worker exit code that means "interrupted, resume me".

A parallel sweep's parent launches each run as `worker_command + [spec.json]`. On Linux every
worker asks the kernel for SIGTERM when its parent dies (`prctl(PR_SET_PDEATHSIG)`), so a
parent killed even by SIGKILL never leaves workers training unsupervised: they stop the way a
SIGTERM stops them (a training run saves a checkpoint first). Until they are gone they hold
their run locks, so a rerun cannot start second copies of their runs.
"""

import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

from absl import logging

EXIT_INTERRUPTED = 75  # a worker's run stopped early (SIGTERM); it resumes on the next attempt
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class StopRequest:
  """A context manager that turns SIGTERM into `requested = True` while it is active (main
  thread only; elsewhere signals cannot be caught and it only carries the flag). The code
  running inside decides where to stop; the previous handler comes back on exit."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self) -> "StopRequest":
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

  def _handle(self, signum, frame):
    del signum, frame
    if not self.requested:
      logging.warning("sweep: SIGTERM received: stopping (running runs stop and resume on the "
                      "next attempt; nothing new starts)")
    self.requested = True


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
                               preexec_fn=_die_with_parent(os.getpid()))
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


def _die_with_parent(parent_pid: int):
  """A `preexec_fn`: SIGTERM this child when `parent_pid` dies (Linux), and at once if the
  parent died before the request took effect. Elsewhere None (workers may outlive a killed
  parent; their run locks still keep a rerun from starting second copies)."""
  if not sys.platform.startswith("linux"):
    logging.warning("sweep: workers do not die with their parent on %s", sys.platform)
    return None
  prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before the fork

  def preexec():
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
      os.kill(os.getpid(), signal.SIGTERM)

  return preexec
