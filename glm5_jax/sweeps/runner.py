"""Runs a sweep's runs in dependency order, in-process or as parallel processes, resumably.

Sweep directory layout:
  sweep.json               the sweep config as run (size included)
  .lock                    held by the process running the sweep (`WorkdirLock`, role "sweep")
  locks/<name>/.lock       held by the process executing run <name> ("sweep run <name>")
  runs/<name>/             a train run's workdir (checkpoints/, metrics.jsonl, tensorboard/)
  runs/<name>/spec.json    the run with references resolved (what a worker process executes)
  runs/<name>/result.json  written last, atomically: the run is finished; holds `spec_hash`
  runs/<name>/eval.{json,md}  suite results of the run, when it has any
  runs/<name>/error.txt    the traceback of a failed attempt (removed when it later succeeds)
  runs/<name>/log.txt      a worker process's output (parallel mode)
  results.json, results.md, *.png   the report (glm5_jax.sweeps.report)

Resume: a run with a `result.json` of the same `spec_hash` is finished and never redone; one
whose hash differs (the sweep config changed) stops the sweep, naming the run, unless
`on_change="redo"`. A half-finished train run resumes from its latest checkpoint (the training
loop does that itself). A failed run blocks only the runs that depend on it; the others still
run, and the sweep reports every failure at the end.

Finished means complete: a train run whose training stopped before `config.train.steps`
(SIGTERM, preemption) raises `RunInterrupted` and writes no result. SIGTERM to the sweep stops
it: the running runs are interrupted (training saves a checkpoint; parallel workers get the
SIGTERM forwarded), nothing new starts, and `SweepOutcome.raise_if_failed` raises.

Locks: the sweep directory is locked for the whole sweep and each run while it executes, so
a second copy of the sweep, or a rerun while workers of a killed sweep still live, is refused
with the holder's pid and host. Run locks live under `locks/`, not in the run directory, which
is the train workdir that the training loop locks itself.
"""

import dataclasses
import json
import os
import shutil
import time
import traceback

from absl import logging
import ml_collections

from glm5_jax.eval.report import write_json, write_suite_results
from glm5_jax.sweeps import jobs, workers
from glm5_jax.sweeps.jobs import RunInterrupted
from glm5_jax.sweeps.spec import Run, apply_overrides, parse_runs, resolve_config_ref, substitute
from glm5_jax.train.stopping import StopSignal
from glm5_jax.train.workdir_lock import WorkdirLock

RESULT_FILE = "result.json"


class SweepError(RuntimeError):
  """Some runs failed, were blocked or were interrupted; the message lists them."""


def run_dir(sweep_dir: str, name: str) -> str:
  return os.path.join(os.path.abspath(sweep_dir), "runs", name)


def run_lock_dir(sweep_dir: str, name: str) -> str:
  return os.path.join(os.path.abspath(sweep_dir), "locks", name)


def read_result(sweep_dir: str, name: str) -> dict | None:
  path = os.path.join(run_dir(sweep_dir, name), RESULT_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def finished_results(sweep_dir: str, runs: list[Run], on_change: str = "error") -> dict:
  """{name: result} of the runs already finished with their current spec."""
  done = {}
  for run in runs:
    result = read_result(sweep_dir, run.name)
    if result is None:
      continue
    if result.get("spec_hash") == run.spec_hash:
      done[run.name] = result
    elif on_change == "redo":
      logging.warning("sweep: run %s changed since it finished; redoing it", run.name)
      shutil.rmtree(run_dir(sweep_dir, run.name))
    else:
      raise SweepError(
          f"run {run.name!r} finished with a different spec (the sweep config changed since): "
          f"{run_dir(sweep_dir, run.name)}. Delete that directory, use another --sweep_dir, "
          "or pass --on_change=redo")
  return done


def resolved_spec(sweep, run: Run, results: dict, sweep_dir: str,
                  config_dir: str | None = None) -> dict:
  """Everything a worker needs to execute `run`: references substituted, the config reference
  made independent of the working directory, suite merged."""
  spec = substitute(run.spec, results, f"sweep.runs.{run.name}")
  if spec["kind"] == "train":
    spec["config"] = resolve_config_ref(spec["config"], config_dir,
                                        f"sweep.runs.{run.name}.config")
  suite = ml_collections.ConfigDict(sweep.suite.to_dict())
  apply_overrides(suite, spec.get("suite") or {}, f"sweep.runs.{run.name}.suite")
  return dict(name=run.name, spec=spec, spec_hash=run.spec_hash, suite=suite.to_dict(),
              workdir=run_dir(sweep_dir, run.name), sweep=sweep.name,
              lock_dir=run_lock_dir(sweep_dir, run.name))


def execute_run(job: dict) -> dict:
  """Executes one resolved run (`resolved_spec`) in this process under its run lock; writes and
  returns its result (`result.json` last, so a crash never leaves a run looking finished).

  Raises:
    WorkdirLockedError: another live process executes this run.
    RunInterrupted: the run stopped before finishing (no result written).
  """
  with WorkdirLock(job["lock_dir"], f"sweep run {job['name']}"):
    spec, workdir = job["spec"], job["workdir"]
    os.makedirs(workdir, exist_ok=True)
    write_json(os.path.join(workdir, "spec.json"), job)
    error_path = os.path.join(workdir, "error.txt")
    start = time.time()
    try:
      suite = ml_collections.ConfigDict(job["suite"])
      if spec["kind"] == "train":
        result = jobs.train_job(job["name"], spec, suite, workdir)
      elif spec["kind"] == "eval":
        result = jobs.eval_job(spec, suite)
      else:
        result = jobs.search_job(spec, suite)
    except Exception:
      with open(error_path, "w") as f:
        f.write(traceback.format_exc())
      raise
    if "suite" in result:
      write_suite_results(result["suite"], workdir, "eval",
                          title=f"{job['name']}: retrieval suite")
    result.update(name=job["name"], kind=spec["kind"], group=spec.get("group", ""),
                  variant=spec.get("variant", ""), spec_hash=job["spec_hash"],
                  **{k: spec[k] for k in ("seed", "seed_of") if k in spec},
                  seconds=time.time() - start, workdir=result.get("workdir", workdir))
    if os.path.exists(error_path):
      os.remove(error_path)
    write_json(os.path.join(workdir, RESULT_FILE), result)
    return result


def run_worker(spec_path: str) -> int:
  """Worker-process mode (`experiments/sweep.py --run_spec=...`): executes the run; returns the
  exit code, `workers.EXIT_INTERRUPTED` when it stopped early. Failures raise."""
  try:
    execute_run(load_job(spec_path))
  except RunInterrupted as e:
    logging.warning("sweep worker: %s", e)
    return workers.EXIT_INTERRUPTED
  return 0


@dataclasses.dataclass
class SweepOutcome:
  runs: list[Run]  # the runs considered, in execution order
  results: dict  # {name: result} of every finished run
  failed: dict  # {name: why} of runs that failed, were blocked by a failure or interrupted
  interrupted: bool = False  # SIGTERM (or an interrupted run) stopped the sweep early

  def raise_if_failed(self):
    if self.failed or self.interrupted:
      note = ("sweep stopped early (SIGTERM); rerun the same command to resume.\n"
              if self.interrupted else "")
      raise SweepError(note + "sweep runs did not finish:\n  " + "\n  ".join(
          f"{name}: {why}" for name, why in self.failed.items()))


def run_sweep(sweep, sweep_dir: str, *, parallel: int = 1, on_change: str = "error",
              only: list[str] | None = None, worker_command: list[str] | None = None,
              config_dir: str | None = None) -> SweepOutcome:
  """Runs every unfinished run of `sweep` (or just `only` and what they need).

  Args:
    parallel: 1 runs in this process, one after another; N > 1 runs up to N at a time, each
      as `worker_command + [spec.json path]` (experiments/sweep.py --run_spec=...).
    config_dir: the sweep config's directory, where relative config paths not found from the
      working directory are looked up (`glm5_jax.sweeps.spec.resolve_config_ref`).
  Returns:
    the runs, their results and failures; runs blocked by a failed one are not attempted, all
    others are, unless SIGTERM or an interrupted run stops the sweep first
    (`SweepOutcome.raise_if_failed` raises `SweepError` listing what did not finish).
  Raises:
    WorkdirLockedError: another live process runs a sweep in `sweep_dir`.
  """
  runs = parse_runs(sweep)
  if only:
    runs = _needed(runs, only)
  if parallel > 1 and not worker_command:
    raise ValueError("parallel > 1 needs a worker command (experiments/sweep.py provides it)")
  os.makedirs(sweep_dir, exist_ok=True)
  with WorkdirLock(sweep_dir, "sweep"), StopSignal() as stop:
    write_json(os.path.join(sweep_dir, "sweep.json"), json.loads(sweep.to_json()))
    results = finished_results(sweep_dir, runs, on_change)
    if results:
      logging.info("sweep %s: %d/%d runs already finished: %s", sweep.name, len(results),
                   len(runs), ", ".join(results))
    failed, pending = {}, [r for r in runs if r.name not in results]
    started = list(results)  # for the [i/n] progress count
    running = {}  # name -> workers.Worker
    job = lambda run: resolved_spec(sweep, run, results, sweep_dir, config_dir)
    stopping = False
    while pending or running:
      if stop.take() and not stopping:
        stopping = True
        logging.warning("sweep: stop requested (SIGTERM, or a run stopped early): running runs "
                        "stop and resume on the next attempt; nothing new starts")
        workers.interrupt(running.values())
      if not stopping:
        ready = _ready(pending, results, failed)
        if not ready and not running:
          for run in pending:  # cannot happen with a valid dependency order; never loop forever
            failed[run.name] = f"never became runnable (waits on {list(run.depends_on)})"
          break
        for run in ready[:max(parallel - len(running), 0) if parallel > 1 else 1]:
          pending.remove(run)
          _log_start(sweep, runs, started, run)
          if parallel > 1:
            _start_worker(run, job, worker_command, running, failed)
          else:
            _run_here(run, job, results, failed, stop)
      elif not running:
        break
      _collect_workers(running, sweep_dir, results, failed, stop, stopping)
    interrupted = stop.take()  # read inside: the outermost StopSignal clears it on exit
  return SweepOutcome(runs=runs, results=results, failed=failed, interrupted=interrupted)


def _ready(pending: list[Run], results: dict, failed: dict) -> list[Run]:
  """The pending runs whose dependencies all finished; runs blocked by a failed dependency
  leave `pending` for `failed`."""
  for run in [r for r in pending if any(d in failed for d in r.depends_on)]:
    failed[run.name] = f"blocked by {[d for d in run.depends_on if d in failed]}"
    pending.remove(run)
  return [r for r in pending if all(d in results for d in r.depends_on)]


def _run_here(run: Run, job, results: dict, failed: dict, stop: StopSignal) -> None:
  try:
    results[run.name] = execute_run(job(run))
    logging.info("sweep: finished %s in %.0f s", run.name, results[run.name]["seconds"])
  except RunInterrupted as e:
    logging.warning("sweep: run %s interrupted: %s", run.name, e)
    failed[run.name] = f"interrupted: {e}"
    stop.request()
  except Exception as e:  # pylint: disable=broad-except
    logging.error("sweep: run %s failed: %s", run.name, e)
    failed[run.name] = f"{type(e).__name__}: {e}"


def _start_worker(run: Run, job, worker_command: list[str], running: dict,
                  failed: dict) -> None:
  try:
    spec = job(run)
    os.makedirs(spec["workdir"], exist_ok=True)
    spec_path = os.path.join(spec["workdir"], "spec.json")
    write_json(spec_path, spec)  # execute_run in the worker rewrites it, identically
    running[run.name] = workers.launch(run.name, worker_command + [spec_path],
                                       os.path.join(spec["workdir"], "log.txt"))
  except Exception as e:  # pylint: disable=broad-except
    logging.error("sweep: run %s could not start: %s", run.name, e)
    failed[run.name] = f"{type(e).__name__}: {e}"


def _collect_workers(running: dict, sweep_dir: str, results: dict, failed: dict,
                     stop: StopSignal, stopping: bool) -> None:
  """Waits a moment, then moves every exited worker's run to `results` (exit 0 and a result)
  or `failed`; an interrupted worker (or any, once stopping) stops the sweep."""
  if running:
    time.sleep(0.5)
  for name, worker in list(running.items()):
    code = worker.process.poll()
    if code is None:
      continue
    del running[name]
    result = read_result(sweep_dir, name)
    if code == 0 and result is not None:
      results[name] = result
      logging.info("sweep: finished %s in %.0f s", name, time.time() - worker.started)
      continue
    reason = workers.last_line(worker.log_path)
    if code == workers.EXIT_INTERRUPTED or stopping:
      failed[name] = f"interrupted (worker exit code {code}): {reason}"
      stop.request()
    else:
      failed[name] = f"worker exited with {code}: {reason} (see {worker.log_path})"
    logging.error("sweep: run %s: %s", name, failed[name])


def _needed(runs: list[Run], only: list[str]) -> list[Run]:
  """`only`'s runs and what they depend on; a declared name stands for all its seeds' copies."""
  by_name = {r.name: r for r in runs}
  copies = {}
  for r in runs:
    copies.setdefault(r.base, []).append(r.name)
  unknown = sorted(set(only) - set(by_name) - set(copies))
  if unknown:
    raise ValueError(f"--only: unknown runs {unknown}; runs: {list(by_name)}")
  wanted, stack = set(), [n for name in only for n in ([name] if name in by_name
                                                        else copies[name])]
  while stack:
    name = stack.pop()
    if name not in wanted:
      wanted.add(name)
      stack.extend(by_name[name].depends_on)
  return [r for r in runs if r.name in wanted]


def _log_start(sweep, runs, started, run):
  started.append(run.name)
  logging.info("sweep %s: [%d/%d] starting %s (%s)", sweep.name, len(started), len(runs),
               run.name, run.spec["kind"])


def load_job(spec_path: str) -> dict:
  with open(spec_path) as f:
    return json.load(f)

