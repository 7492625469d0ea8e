"""Stopping a run early: the SIGTERM flag, the one-per-step stop decision, and its exit code.

A scheduler preempts a job with SIGTERM and a grace period. The handler only sets a flag; the
training loop reads it once per step (`StopSignal.take`) and uses that one value for both the
save decision and the break, so a signal that lands between them is seen by the next step
instead of being logged as saved when it was not.

On several processes the flag is per host (the scheduler may signal one host first), but the
checkpoint is collective: a host that stops alone would leave the others waiting at orbax's
barrier. So the decision is `any_process(flag)`: every process stops at the first step at which
any of them saw a signal.
"""

import os
import signal

import jax
from jax.experimental import multihost_utils
import numpy as np

# experiments/train.py exits with this when it stopped before `train.steps` (SIGTERM or a step
# budget) after committing the checkpoint of the step it stopped at: rerun to resume. It is
# sysexits.h's EX_TEMPFAIL ("temporary failure; the user is invited to retry").
EXIT_STOPPED_EARLY = os.EX_TEMPFAIL  # 75


class StopSignal:
  """Records SIGTERM while active (a context manager; the previous handler comes back on exit).

  The handler does nothing but set a flag: it may run between any two bytecodes of the main
  thread, where logging (which takes locks) could deadlock.
  """

  def __init__(self, signum: int = signal.SIGTERM):
    self.signum = signum
    self._received = False
    self._previous = None

  def _handle(self, signum, frame):
    del signum, frame
    self._received = True

  def take(self) -> bool:
    """Whether the signal has arrived; read it once per step and use that value throughout."""
    return self._received

  def __enter__(self) -> "StopSignal":
    self._previous = signal.signal(self.signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    signal.signal(self.signum, self._previous)


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
