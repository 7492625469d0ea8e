"""Whether a server takes requests yet: not before its engine compiled every program.

experiments/serve.py listens at once, so that `/health` can say where start-up is, but answers
503 (`{"status": "warming"}` on `/health`, code "warming" on the API, with Retry-After) until
`warm` has run the engine's `warmup` (`infer.Engine.warmup` in this process, or
`serve.engine_process.EngineProcess.warmup` in the engine's): a request then compiles nothing
(`/metrics` counts the engine process's compilations: `glm5_engine_compiles_total`).
"""

import threading
import time


class Readiness:
  """`ready` once the engine is warm; `progress`, a line saying how far warm-up got;
  `compiles()`, the compilations counted in the engine's own process so far (None: not
  counted), for `/metrics`."""

  def __init__(self, ready: bool = False, compiles=None):
    self.ready = ready
    self.progress = "done" if ready else "not started"
    self._compiles = compiles
    self.failed: BaseException | None = None

  def compiles(self) -> int | None:
    return None if self._compiles is None else self._compiles()


def warm(engine, readiness: Readiness, *, max_rows: int | None = None, log=print) -> None:
  """Compiles every program of `engine` (its `warmup(max_rows, progress)`), logging a progress
  line per part, then marks `readiness` ready. A warm-up that raises leaves it not ready,
  with the error in `readiness.failed` (and raises it)."""
  start = time.perf_counter()
  compiles_before = readiness.compiles()

  def progress(done, total):
    readiness.progress = f"{done}/{total} programs, {time.perf_counter() - start:.1f} s"
    log(f"warming {total} programs ... {done}/{total} ({time.perf_counter() - start:.1f} s)")

  log("warming the engine: compiling every program a request can reach before taking any")
  try:
    engine.warmup(max_rows, progress=progress)
  except BaseException as e:
    readiness.failed, readiness.progress = e, f"failed: {type(e).__name__}: {e}"
    raise
  compiled = readiness.compiles()
  counted = ("" if compiled is None else
             f", {compiled - (compiles_before or 0)} compilations in the engine's process")
  readiness.progress, readiness.ready = "done", True
  log(f"warm: ready after {time.perf_counter() - start:.1f} s{counted}")


def warm_in_background(engine, readiness: Readiness, *, max_rows: int | None = None,
                       log=print, then=None, on_error=None) -> threading.Thread:
  """`warm` on a thread of its own (the server listens meanwhile), then `then()` (e.g. start
  following a policy directory: nothing else may call the engine before it is warm); a
  warm-up that raises calls `on_error(e)` (a server exits: it would never be ready)."""

  def run():
    try:
      warm(engine, readiness, max_rows=max_rows, log=log)
    except BaseException as e:  # pylint: disable=broad-except
      if on_error is None:
        raise
      on_error(e)
      return
    if then is not None:
      then()

  thread = threading.Thread(target=run, name="engine-warmup", daemon=True)
  thread.start()
  return thread
