"""What a training job's console shows people: no per-save library chatter, and on failure the
root cause as the last line.

For entry points (experiments/*.py) only; the library itself never touches global logging.

A disk that fills during an asynchronous save fails in orbax's background threads; the error
then surfaces in the main thread wrapped in several chained tracebacks, and interpreter teardown
adds "Exception ignored in <coroutine ...>" reports for every write still queued, so the real
"No space left on device" ends up mid-log. `exit_on_failure` logs the full traceback once, then
prints the failure and its root cause as the last lines and leaves without that teardown.
"""

import logging as std_logging
import os
import sys

from absl import logging

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
