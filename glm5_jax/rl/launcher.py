"""Starts an asynchronous RL run's processes on one machine and keeps its workers alive.

On a pod every slice starts its own role (`experiments/rl.py --mode=async --role=trainer` on
the trainer slice, `--role=worker --worker=w<i>` on each rollout slice) sharing only the
workdir. On one machine `launch` does the same with subprocesses: the trainer, whose output
goes to the console, and one process per worker, whose output goes to
`<root>/logs/<worker>.log`. A worker that dies (a crash, `kill -9`) is started again under its
name and answers its outstanding orders (`glm5_jax.rl.worker`). When the trainer exits the
workers are stopped: after success they exit by themselves on `control/done`; after a failure
they are terminated, and rerunning the command resumes the trainer from its checkpoint.

The roles die with the launcher: SIGTERM to the launcher is forwarded to every role (the
trainer stops after its current step, whose checkpoint is committed; a worker after its current
generation batch), and on Linux each role asks the kernel for SIGTERM when the launcher dies
(`stopping.die_with_parent`), so even a launcher killed with SIGKILL leaves no orphan holding
the run's locks.
"""

import collections
import os
import signal
import subprocess
import sys
import time

from absl import logging

from glm5_jax.rl.layout import RunDirs
from glm5_jax.train.stopping import StopSignal, die_with_parent

STOP_GRACE_SECONDS = 60


def _last_line(path: str) -> str:
  try:
    with open(path, "rb") as f:
      lines = [l for l in f.read()[-4096:].decode("utf-8", "replace").splitlines() if l.strip()]
    return lines[-1] if lines else "(no output)"
  except OSError:
    return "(no log)"


def launch(command: list[str], root, workers, *, max_restarts: int = 10,
           poll_seconds: float = 0.5) -> dict:
  """Runs `command + ["--role=trainer"]` and, per worker w, `command + ["--role=worker",
  "--worker=w"]` until the trainer exits.

  Args:
    command: the program and its flags, shared by every role (config overrides included).
    root: the run directory (its `logs/` receives the workers' output).
    workers: worker names.
    max_restarts: restarts allowed per worker before the run is stopped as failing.
  Returns:
    {"trainer_returncode", "worker_restarts": {name: count}, "stopped": whether SIGTERM to
    this process stopped the run (forwarded to every role, which were then waited for)}.
  """
  dirs = RunDirs.at(root)
  logs = os.path.join(str(dirs.root), "logs")
  os.makedirs(logs, exist_ok=True)
  dirs.done.unlink(missing_ok=True)  # from an earlier, shorter run of this directory
  restarts = collections.Counter()

  def start_worker(name):
    log = open(os.path.join(logs, f"{name}.log"), "ab")  # pylint: disable=consider-using-with
    try:
      return subprocess.Popen(command + ["--role=worker", f"--worker={name}"], stdout=log,
                              stderr=subprocess.STDOUT, preexec_fn=die_with_parent(os.getpid()))
    finally:
      log.close()

  with StopSignal() as stop:
    trainer = subprocess.Popen(command + ["--role=trainer"],
                               preexec_fn=die_with_parent(os.getpid()))
    procs = {name: start_worker(name) for name in workers}
    logging.info("async RL: trainer pid %d, workers %s (logs in %s)", trainer.pid,
                 {n: p.pid for n, p in procs.items()}, logs)
    stopped = _supervise(trainer, procs, start_worker, stop, dirs, logs, restarts, max_restarts,
                         poll_seconds)
  return {"trainer_returncode": trainer.returncode, "worker_restarts": dict(restarts),
          "stopped": stopped}


def _supervise(trainer, procs, start_worker, stop, dirs, logs, restarts, max_restarts,
               poll_seconds) -> bool:
  """Restarts dead workers until the trainer exits or SIGTERM arrives (then returns True);
  stops every role on the way out."""
  stopped = False
  try:
    while trainer.poll() is None:
      if stop.take():
        stopped = True
        logging.warning("async RL launcher: SIGTERM: stopping the trainer (it saves its current "
                        "step) and the workers; rerun the same command to resume")
        break
      for name, proc in procs.items():
        if proc.poll() is not None and not dirs.done.exists():
          restarts[name] += 1
          logging.warning("worker %s (pid %d) exited with status %s: %s; restarting it "
                          "(restart %d)", name, proc.pid, proc.returncode,
                          _last_line(os.path.join(logs, f"{name}.log")), restarts[name])
          if restarts[name] > max_restarts:
            raise RuntimeError(f"worker {name} died {restarts[name]} times; see "
                               f"{logs}/{name}.log")
          procs[name] = start_worker(name)
      time.sleep(poll_seconds)
  finally:
    _stop(trainer, procs, graceful=trainer.poll() == 0, forward=stopped)
  return stopped


def _stop(trainer, procs, *, graceful: bool, forward: bool = False) -> None:
  """After success, waits for the workers to exit on `control/done`; after SIGTERM to the
  launcher (`forward`), sends it to every role and waits for them to stop by themselves; after
  a failure, terminates them. A role still running after the grace period is killed."""
  if trainer.poll() is None:
    trainer.send_signal(signal.SIGTERM)
  if forward:
    for proc in procs.values():
      if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
  deadline = time.time() + (STOP_GRACE_SECONDS if graceful or forward else 0)
  for proc in procs.values():
    while (graceful or forward) and proc.poll() is None and time.time() < deadline:
      time.sleep(0.2)
    if proc.poll() is None:
      proc.terminate()
  for proc in [trainer, *procs.values()]:
    try:
      proc.wait(timeout=STOP_GRACE_SECONDS if forward else 30)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def describe_exit(returncode: int) -> str:
  """How a role process ended, for the message after it failed: killed by a signal (then it
  printed no error of its own), or its exit status (its error is above)."""
  if returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:
      name = "unknown signal"
    return f"was killed by signal {-returncode} ({name}; it printed no error of its own)"
  return f"exited with status {returncode} (its error is above)"


def python_command(script: str, argv: list[str]) -> list[str]:
  """`[python, script, *argv]` for the role subprocesses, with this interpreter."""
  return [sys.executable, script, *argv]
