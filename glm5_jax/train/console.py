"""What a training job's console shows people: no per-save library chatter, a line when a first
compile runs long, a readable run summary, and on failure the root cause as the last line.

For entry points (experiments/*.py) only; the library itself never touches global logging.
`run_training_job` is the whole body of the ones that run a training loop (train.py, sft.py).

A disk that fills during an asynchronous save fails in orbax's background threads; the error
then surfaces in the main thread wrapped in several chained tracebacks, and interpreter teardown
adds "Exception ignored in <coroutine ...>" reports for every write still queued, so the real
"No space left on device" ends up mid-log. `exit_on_failure` logs the full traceback once, then
prints the failure and its root cause as the last lines and leaves without that teardown.
"""

import json
import logging as std_logging
import os
import sys
import threading
import time
from typing import Callable

from absl import logging
import jax
from jax import monitoring

from glm5_jax.train.stopping import EXIT_STOPPED_EARLY

EXIT_FAILED = 1
_QUIET_PACKAGES = ("orbax",)
# jax's backend probe: "Unable to initialize backend 'tpu'" at INFO on every machine without one.
_QUIET_FILES = ("xla_bridge.py",)


class _DropLibraryInfo(std_logging.Filter):
  """Drops records below WARNING that come from `_QUIET_PACKAGES` (all libraries log through
  absl's one logger, so only the record's source file tells them apart)."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno >= std_logging.WARNING:
      return True
    parts = record.pathname.split(os.sep)
    return not (any(package in parts for package in _QUIET_PACKAGES)
                or parts[-1] in _QUIET_FILES)


def quiet_library_info() -> None:
  """Hides orbax's INFO lines (about 60 per checkpoint save or restore) and jax's backend probe;
  warnings and errors stay."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _DropLibraryInfo) for f in handler.filters):
    handler.addFilter(_DropLibraryInfo())


# jax (0.10) records this event's start time as a scalar when XLA starts compiling a program and
# its duration when it ends, both with the program's `fun_name` (jax/_src/dispatch.py).
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_ANNOUNCE_AFTER_S = 5.0
_WHY_SLOW = " (XLA compiles each program on its first call: minutes on CPU)"


class CompileNotices:
  """Says "compiling <program> ..." once a compile has run `after_s`, and "compiled <program>
  (N s)" when it ends: a first compile of the train step takes 1-3 min on CPU, and without a
  line the job looks hung. Fast compiles (most: small ops, cache hits) never get a line, so the
  log gets two lines per slow compile, at most two per `after_s` of compiling. Every slow one
  is announced, a program's later variants too (the DSA run's top-k train step has the dense
  phase's name, `jit(train_step)`).
  """

  def __init__(self, after_s: float = _ANNOUNCE_AFTER_S, log=logging.info):
    self.after_s = after_s
    self._log = log
    self._lock = threading.Lock()
    self._pending = {}  # (thread, name) -> start time of the compile running there now
    self._announced = set()  # the pending compiles whose start line is out
    self._hinted = False  # the first start line says why compiles are slow; later ones not

  def started(self, name: str, start: float) -> None:
    """A compile of `name` started at `start` (time.time()) on this thread."""
    with self._lock:
      self._pending[(threading.get_ident(), name)] = start

  def announce_due(self, now: float) -> None:
    """Logs the start line of every pending compile that has run `after_s` by `now`."""
    with self._lock:
      due = [key for key, start in self._pending.items()
             if key not in self._announced and now - start >= self.after_s]
      self._announced.update(due)
      hint = bool(due) and not self._hinted
      self._hinted = self._hinted or hint
    for i, (_, name) in enumerate(due):
      self._log(f"compiling {name} ..." + (_WHY_SLOW if hint and i == 0 else ""))

  def finished(self, name: str, seconds: float) -> None:
    """A compile of `name` on this thread ended after `seconds`."""
    key = (threading.get_ident(), name)
    with self._lock:
      self._pending.pop(key, None)
      if key not in self._announced:
        return
      self._announced.discard(key)
    self._log(f"compiled {name} ({seconds:.0f} s)")

  def _on_start(self, event: str, value: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE_EVENT:
      self.started(str(kwargs.get("fun_name", "a program")), value)

  def _on_duration(self, event: str, seconds: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE_EVENT:
      self.finished(str(kwargs.get("fun_name", "a program")), seconds)

  def listen(self) -> None:
    """Hears jax's compile events from now on (jax.monitoring listeners)."""
    monitoring.register_scalar_listener(self._on_start)
    monitoring.register_event_duration_secs_listener(self._on_duration)

  def stop_listening(self) -> None:
    monitoring.unregister_scalar_listener(self._on_start)
    monitoring.unregister_event_duration_listener(self._on_duration)


_notices: CompileNotices | None = None


def announce_slow_compiles(after_s: float = _ANNOUNCE_AFTER_S, poll_s: float = 1.0,
                           log=logging.info) -> None:
  """Logs "compiling <program> ..." for every compile still running after `after_s`, and
  "compiled <program> (N s)" when it ends (`CompileNotices`), through `log` (one line a call).
  Idempotent; one daemon thread checks the running compiles every `poll_s`."""
  global _notices
  if _notices is not None:
    return
  _notices = notices = CompileNotices(after_s, log)
  notices.listen()

  def watch():
    while True:
      time.sleep(poll_s)
      notices.announce_due(time.time())

  threading.Thread(target=watch, name="compile-notices", daemon=True).start()


def summary_lines(summary: dict, what: str = "training") -> list[str]:
  """A training loop's summary (`glm5_jax.train.loop.train`'s return value) as the lines a
  person reads: steps, loss, throughput, eval metrics, where the checkpoints and metrics are."""
  lines = [f"== {what} summary ==", f"steps: {summary['steps']} of {summary['total_steps']}"]
  if summary["stopped_early"]:
    lines.append(f"stopped early ({summary['stop_reason']}); rerun with the same --workdir to "
                 "resume")
  if summary["first_loss"] is not None:
    lines.append(f"loss: first {summary['first_loss']:.4f} -> last {summary['last_loss']:.4f}")
  if summary["tokens_per_sec"]:
    lines.append(f"throughput: {summary['tokens_per_sec']:,.0f} tokens/s")
  lines += [f"eval {name}: {value:.4f}" for name, value in sorted((summary["eval"] or {}).items())]
  lines += [f"checkpoints: {summary['checkpoints']}",
            f"metrics: {summary['metrics_file']} (and TensorBoard in the same workdir)"]
  return lines


def root_cause(exc: BaseException) -> BaseException:
  """The exception that explains `exc`.

  An exception raised while another was being handled (implicit `__context__`) is a consequence
  of it, so the first one in that chain is taken; below a deliberate `raise ... from` wrapper,
  an operating-system error (`OSError` with an errno: disk full, permission, missing file) is the
  real reason and wins; otherwise the wrapper itself, which names what failed, is the cause.
  """
  first = exc
  while (first.__cause__ is None and first.__context__ is not None
         and not first.__suppress_context__):
    first = first.__context__
  os_error, seen, e = None, set(), first
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno is not None:
      os_error = e
    e = e.__cause__ if e.__cause__ is not None else (
        None if e.__suppress_context__ else e.__context__)
  return os_error or first


def _one_line(exc: BaseException) -> str:
  notes = getattr(exc, "__notes__", None)
  text = f"{type(exc).__name__}: {exc}" + (f" ({'; '.join(notes)})" if notes else "")
  return " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def failure_lines(exc: BaseException, what: str = "training") -> list[str]:
  """The lines to end a failed job's output with; the last is the root cause."""
  cause = root_cause(exc)
  lines = [f"{what} failed: {_one_line(exc)}"] if cause is not exc else []
  return lines + [f"root cause: {_one_line(cause)}"]


def exit_on_failure(exc: BaseException, what: str = "training") -> None:
  """Logs `exc` with its traceback, prints `failure_lines` to stderr as the last output, and
  exits with `EXIT_FAILED` without running interpreter teardown (whose reports of half-written
  async saves would bury the cause). Call it after the job's own cleanup has run."""
  logging.exception("%s failed", what)
  logging.flush()
  sys.stdout.flush()
  sys.stderr.write("\n" + "\n".join(failure_lines(exc, what)) + "\n")
  sys.stderr.flush()
  os._exit(EXIT_FAILED)  # pylint: disable=protected-access


def run_training_job(job: Callable[[], dict], what: str = "training") -> None:
  """The body of an entry point that runs a training loop: library INFO hidden, slow compiles
  announced, the devices logged, then `job()` (a loop returning its summary, as
  `glm5_jax.train.loop.train`). A failure ends the process with its root cause as the last line
  (`exit_on_failure`); otherwise process 0 prints the summary for people and then as one JSON
  line (the last line: scripts read it), and a loop that stopped early (SIGTERM) exits with
  `EXIT_STOPPED_EARLY` (75: its checkpoint is committed, rerun to resume)."""
  quiet_library_info()
  announce_slow_compiles()
  logging.info("devices: %s", jax.devices())
  try:
    summary = job()
  except Exception as e:  # pylint: disable=broad-except
    exit_on_failure(e, what)
  if jax.process_index() == 0:
    print("\n" + "\n".join(summary_lines(summary, what)))
    print(json.dumps({k: v for k, v in summary.items() if k != "last_metrics"}, default=str))
  if summary["stopped_early"]:
    sys.exit(EXIT_STOPPED_EARLY)
