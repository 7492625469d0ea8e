"""Stopping a run early: the one home of signal handling in this repository.

The SIGTERM flag, the one-per-step stop decision across processes, children that die with
their parent, and the exit code of a stopped run.

A scheduler preempts a job with SIGTERM and a grace period. The handler only sets a flag (it
may run between any two bytecodes of the main thread, where logging, which takes locks, could
deadlock); the loops read it once per step (`StopSignal.take`) and use that one value for both
the save decision and the break, so a signal that lands between them is seen by the next step
instead of being logged as saved when it was not.

The flag is one per process, shared by nested `StopSignal`s: a sweep (or the RL pipeline)
holds one around the runs it starts, and the run's own loop holds another. A SIGTERM that
arrives while the run is still building or compiling, before its loop installed anything, is
therefore not lost: the loop finds the flag set at its first step and stops there. The flag is
cleared when the outermost `StopSignal` exits.

On several processes the flag is per host (the scheduler may signal one host first), but the
checkpoint is collective: a host that stops alone would leave the others waiting at orbax's
barrier. So the decision is `any_process(flag)`: every process stops at the first step at which
any of them saw a signal.
"""

import ctypes
import os
import signal
import sys
import threading

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

# The entry points exit with this when a run stopped before its last step (SIGTERM or a step
# budget) after committing the checkpoint of the step it stopped at: rerun to resume. It is
# sysexits.h's EX_TEMPFAIL ("temporary failure; the user is invited to retry").
EXIT_STOPPED_EARLY = os.EX_TEMPFAIL  # 75
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class StopSignal:
  """Records SIGTERM while active (a context manager; the previous handler comes back on exit).

  Nestable: every instance reads and sets the one per-process flag (module docstring). Outside
  the main thread, where Python cannot install handlers, it only carries the flag.
  """

  _requested = False  # one flag per process, shared by every (nested) instance
  _depth = 0

  def __init__(self):
    self._previous = None
    self._installed = False

  @staticmethod
  def _handle(signum, frame):
    del signum, frame
    StopSignal._requested = True  # only this: no logging, no locks (module docstring)

  def take(self) -> bool:
    """Whether SIGTERM has arrived (or `request` was called) since the outermost `StopSignal`
    was entered; read it once per step and use that value throughout."""
    return StopSignal._requested

  def request(self) -> None:
    """Asks the code inside to stop, as a SIGTERM would (e.g. a sweep whose run stopped)."""
    StopSignal._requested = True

  def __enter__(self) -> "StopSignal":
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, StopSignal._handle)
      self._installed = True
    StopSignal._depth += 1
    return self

  def __exit__(self, *exc) -> None:
    if self._installed:
      signal.signal(signal.SIGTERM, self._previous)
      self._installed = False
    StopSignal._depth -= 1
    if StopSignal._depth == 0:
      StopSignal._requested = False


def any_process(flag: bool, *, process_count: int | None = None, allgather=None) -> bool:
  """True on every process when `flag` is true on any; all processes get the same answer.

  One process: `flag` itself, with no communication. Several: one `process_allgather` of the
  flags, a small collective that waits for the device work dispatched before it (so on
  multi-host runs the host stops running one step ahead of the devices at this point).

  Args:
    flag: this process's value.
    process_count: default `jax.process_count()`.
    allgather: default `jax.experimental.multihost_utils.process_allgather` (tests pass a fake).
  """
  process_count = jax.process_count() if process_count is None else process_count
  if process_count == 1:
    return bool(flag)
  allgather = allgather or multihost_utils.process_allgather
  return bool(np.asarray(allgather(np.int32(bool(flag)))).any())


def die_with_parent(parent_pid: int):
  """A `subprocess.Popen` `preexec_fn`: the child gets SIGTERM when `parent_pid` dies (Linux
  `prctl(PR_SET_PDEATHSIG)`), so a parent killed even by SIGKILL never leaves children running
  unsupervised (they stop as a SIGTERM stops them), and at once if the parent died before the
  request took effect. Elsewhere None, with a warning: children may outlive a killed parent
  (their workdir locks still keep a rerun from starting second copies)."""
  if not sys.platform.startswith("linux"):
    logging.warning("child processes do not die with their parent on %s", sys.platform)
    return None
  prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before the fork

  def preexec():
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
      os.kill(os.getpid(), signal.SIGTERM)

  return preexec
