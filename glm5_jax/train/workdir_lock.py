"""An exclusive lock per working directory: one process writes a workdir at a time.

Two processes training (or sweeping, or serving as the same RL role) in one workdir would
interleave checkpoints and metrics and corrupt both runs; it happens when a parallel sweep's
parent is killed and its workers train on, and a rerun starts second copies. So every process
that writes a workdir holds `<workdir>/.lock` for as long as it writes:

    with WorkdirLock(workdir, "training"):
      ...

The lock is a POSIX `flock` on that file, which the kernel releases when the holder exits for
any reason (kill -9 included): a lock left by a dead process is never in the way, and nothing
needs cleaning up. The file's text names the current holder (pid, host, role, start time), so
a refused process says who holds it. `flock` only covers processes that see the same local
file system; for a remote path (`gs://...`) there is no lock, and `WorkdirLock` says so once in
the log rather than pretending.

A multi-process run (one workdir on a shared file system) holds it from process 0 only, and
every process fails together when it is taken: `hold_workdir(workdir, role)`.
"""

import contextlib
import datetime
import fcntl
import json
import os
import socket

from absl import logging
import jax

from glm5_jax.train.stopping import any_process

LOCK_FILE = ".lock"


class WorkdirLockedError(RuntimeError):
  """Another live process holds the workdir; the message names its pid, host and role."""


def _is_remote(path: str) -> bool:
  return "://" in path


class WorkdirLock:
  """Exclusive, non-blocking lock on `workdir` (created if absent); a context manager.

  Args:
    workdir: the directory to lock.
    role: what the holder does there ("training", "sweep", "rl trainer", ...), for messages.
  Raises (on entry):
    WorkdirLockedError: another live process holds it.
  """

  def __init__(self, workdir: str, role: str):
    self.workdir = workdir
    self.role = role
    self.path = os.path.join(os.path.abspath(workdir), LOCK_FILE) if not _is_remote(workdir) \
        else None
    self._fd = None

  def acquire(self) -> "WorkdirLock":
    if self.path is None:
      logging.warning("%s: no workdir lock on a remote file system; make sure no other process "
                      "writes this workdir", self.workdir)
      return self
    if self._fd is not None:
      raise RuntimeError(f"{self.path}: this WorkdirLock is already held")
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _describe(os.pread(fd, 4096, 0))
      os.close(fd)
      raise WorkdirLockedError(
          f"{self.workdir} is in use by {holder}; stop that process (or use another workdir) "
          f"before starting {self.role} here") from None
    holder = dict(pid=os.getpid(), host=socket.gethostname(), role=self.role,
                  since=datetime.datetime.now().isoformat(timespec="seconds"))
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    os.ftruncate(fd, 0)  # the next reader of a free lock finds no stale holder
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _describe(text: bytes) -> str:
  try:
    h = json.loads(text.decode())
    return f"pid {h['pid']} on host {h['host']} ({h['role']}, since {h['since']})"
  except (ValueError, KeyError, TypeError):
    return "another process (its lock file names no holder)"


@contextlib.contextmanager
def hold_workdir(workdir: str, role: str):
  """`WorkdirLock(workdir, role)` held by process 0 for the duration; on a refusal every process
  raises `WorkdirLockedError` (so none waits for the others at a collective)."""
  lock = WorkdirLock(workdir, role)
  error = None
  if jax.process_index() == 0:
    try:
      lock.acquire()
    except WorkdirLockedError as e:
      error = e
  if any_process(error is not None):
    raise error or WorkdirLockedError(f"{workdir}: process 0 could not lock it (see its log)")
  try:
    yield lock
  finally:
    lock.release()
