"""Sweeps never call an unfinished run finished, stop on SIGTERM, and never run twice at once:

- a train run whose training stopped early writes no result, stops the sweep (nothing new
  starts), makes it fail, and the next attempt finishes it;
- SIGTERM to an in-process sweep lets the running run finish and starts nothing else; one
  that lands while a run builds stops that run;
- SIGTERM to a parallel sweep's parent is forwarded to its workers;
- a parallel sweep's workers die with a parent killed by SIGKILL, and until they are gone
  their run locks refuse a rerun's second copies (naming pid and host); then a rerun works;
- a second sweep in a locked sweep directory is refused;
- a torn last line of metrics.jsonl is skipped (and cut by the writer on resume); a corrupt
  line in the middle is an error naming the file and line.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import ml_collections
import pytest

from glm5_jax.sweeps import jobs, runner, spec
from glm5_jax.train.metrics import MetricWriter
from glm5_jax.train.stopping import StopSignal
from glm5_jax.train.workdir_lock import WorkdirLock, WorkdirLockedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_sweep(**runs):
  sweep = ml_collections.ConfigDict(dict(name="t", base_config="configs.tiny", size={},
                                         suite={}))
  sweep.runs = ml_collections.ConfigDict(runs)
  return sweep


def result_exists(sweep_dir, name):
  return os.path.exists(os.path.join(sweep_dir, "runs", name, runner.RESULT_FILE))


def test_interrupted_train_run_is_not_finished_and_resumes(tmp_path, monkeypatch):
  sweep_dir = str(tmp_path / "sweep")
  train = lambda steps: spec.train_run(overrides=dict(train=dict(steps=steps)), evaluate=False)
  sweep = make_sweep(first=train(3), second=train(4))
  reached = {"first": 1}  # training stops at step 1 of 3, as SIGTERM makes it do
  monkeypatch.setattr(jobs, "train", lambda config, workdir: dict(
      steps=reached.get(os.path.basename(workdir), config.train.steps)))
  outcome = runner.run_sweep(sweep, sweep_dir)
  assert outcome.interrupted and set(outcome.failed) == {"first"}
  assert "training stopped at step 1 of 3" in outcome.failed["first"]
  assert not result_exists(sweep_dir, "first")
  assert not os.path.exists(os.path.join(sweep_dir, "runs", "second"))  # never started
  with pytest.raises(runner.SweepError, match="stopped early"):
    outcome.raise_if_failed()

  reached.clear()  # the next attempt trains to the end
  outcome = runner.run_sweep(sweep, sweep_dir)
  outcome.raise_if_failed()
  assert (outcome.results["first"]["steps"], outcome.results["second"]["steps"]) == (3, 4)


def test_sigterm_stops_an_in_process_sweep_after_the_running_run(tmp_path, monkeypatch):
  sweep_dir = str(tmp_path / "sweep")
  sweep = make_sweep(a=spec.eval_run(checkpoint="x"), b=spec.eval_run(checkpoint="y"))

  def eval_job(job_spec, suite):
    os.kill(os.getpid(), signal.SIGTERM)  # arrives while this run executes
    return dict(score=0.5)

  monkeypatch.setattr(jobs, "eval_job", eval_job)
  handler = signal.getsignal(signal.SIGTERM)
  outcome = runner.run_sweep(sweep, sweep_dir)
  assert signal.getsignal(signal.SIGTERM) is handler  # restored
  assert outcome.interrupted and set(outcome.results) == {"a"} and not outcome.failed
  assert result_exists(sweep_dir, "a") and not result_exists(sweep_dir, "b")
  with pytest.raises(runner.SweepError, match="stopped early"):
    outcome.raise_if_failed()


def test_sigterm_while_an_in_process_run_builds_stops_that_run(tmp_path, monkeypatch):
  """A SIGTERM that lands while a run is still building or compiling (before its training loop
  installs its own handler) once went to the sweep's handler alone, and the run trained on to
  train.steps. The flag is one per process (`StopSignal`): the run's loop sees it at once."""
  sweep_dir = str(tmp_path / "sweep")
  train = lambda steps: spec.train_run(overrides=dict(train=dict(steps=steps)), evaluate=False)
  sweep = make_sweep(first=train(3), second=train(4))

  def fake_train(config, workdir):
    os.kill(os.getpid(), signal.SIGTERM)  # "while building": before the loop's StopSignal
    with StopSignal() as stop:  # what train() installs around its loop
      reached = 1 if stop.take() else config.train.steps
    return dict(steps=reached)

  monkeypatch.setattr(jobs, "train", fake_train)
  outcome = runner.run_sweep(sweep, sweep_dir)
  assert outcome.interrupted and set(outcome.failed) == {"first"}
  assert "training stopped at step 1 of 3" in outcome.failed["first"]
  assert not os.path.exists(os.path.join(sweep_dir, "runs", "second"))  # never started
  with StopSignal() as stop:  # the flag is cleared once the sweep's handler is gone
    assert not stop.take()


def test_a_locked_sweep_dir_is_refused(tmp_path):
  sweep_dir = str(tmp_path / "sweep")
  with WorkdirLock(sweep_dir, "sweep"):
    with pytest.raises(WorkdirLockedError, match=f"in use by pid {os.getpid()} on host "):
      runner.run_sweep(make_sweep(a=spec.eval_run(checkpoint="x")), sweep_dir)


# A parallel sweep of three runs, two at a time, in a process of its own.
_PARENT = r"""
import sys
import ml_collections
from glm5_jax.sweeps import runner, spec
sweep = ml_collections.ConfigDict(dict(name="t", base_config="configs.tiny", size={}, suite={}))
sweep.runs = ml_collections.ConfigDict({n: spec.eval_run(checkpoint=n) for n in "abc"})
outcome = runner.run_sweep(sweep, sys.argv[1], parallel=2, worker_command=sys.argv[2:])
print("failed:", outcome.failed, flush=True)
outcome.raise_if_failed()
"""

# A worker whose run stands in for training: on SIGTERM it goes on (saving a checkpoint, say)
# until the file argv[1] exists, then stops early.
_WORKER = r"""
import os, signal, sys, time
from glm5_jax.sweeps import jobs, runner

def slow_run(job_spec, suite):
  stop = []
  signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
  print("started", flush=True)
  while not stop:
    time.sleep(0.05)
  print("got SIGTERM", flush=True)
  while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
  raise runner.RunInterrupted("stopped early")

jobs.eval_job = slow_run
sys.exit(runner.run_worker(sys.argv[2]))
"""


@pytest.fixture
def parallel_sweep(tmp_path):
  """(parent process, sweep dir, release file, {run: worker pid}) once runs a and b started;
  on teardown nothing of it is left running, whatever the test did."""
  sweep_dir, release = str(tmp_path / "sweep"), str(tmp_path / "release")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  parent = subprocess.Popen([sys.executable, "-c", _PARENT, sweep_dir, sys.executable, "-c",
                             _WORKER, release], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
  try:
    wait_for_logs(sweep_dir, "ab", "started", parent)
    yield parent, sweep_dir, release, {name: lock_holder_pid(sweep_dir, name) for name in "ab"}
  finally:
    open(release, "w").close()
    parent.kill()
    parent.communicate()
    for name in "ab":  # a worker still holding its run lock is alive: its pid is current
      try:
        WorkdirLock(runner.run_lock_dir(sweep_dir, name), "test").acquire().release()
      except WorkdirLockedError:
        os.kill(lock_holder_pid(sweep_dir, name), signal.SIGKILL)


def wait_for_logs(sweep_dir, names, text, parent=None, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline:
    logs = {}
    for name in names:
      path = os.path.join(sweep_dir, "runs", name, "log.txt")
      logs[name] = open(path).read() if os.path.exists(path) else ""
    if all(text in log for log in logs.values()):
      return
    if parent is not None and parent.poll() is not None:
      pytest.fail(f"the sweep exited early: {parent.stdout.read()[-3000:]}")
    time.sleep(0.2)
  pytest.fail(f"no {text!r} in the workers' logs after {timeout} s: {logs}")


def lock_holder_pid(sweep_dir, name):
  with open(os.path.join(runner.run_lock_dir(sweep_dir, name), ".lock")) as f:
    return json.load(f)["pid"]


def wait_until_unlocked(sweep_dir, names, timeout=120):
  deadline = time.time() + timeout
  for name in names:
    while True:
      try:
        WorkdirLock(runner.run_lock_dir(sweep_dir, name), "test").acquire().release()
        break
      except WorkdirLockedError:
        assert time.time() < deadline, f"run {name} still locked after {timeout} s"
        time.sleep(0.2)


def test_sigterm_to_a_parallel_sweep_is_forwarded_to_its_workers(parallel_sweep):
  parent, sweep_dir, release, _ = parallel_sweep
  parent.send_signal(signal.SIGTERM)  # the parent only, not its process group
  wait_for_logs(sweep_dir, "ab", "got SIGTERM", timeout=60)
  open(release, "w").close()
  output, _ = parent.communicate(timeout=120)
  assert parent.returncode != 0, output[-3000:]
  assert "sweep stopped early (SIGTERM)" in output and "a: interrupted" in output
  assert not os.path.exists(os.path.join(sweep_dir, "runs", "c"))  # never started
  assert not result_exists(sweep_dir, "a") and not result_exists(sweep_dir, "b")


def test_killed_parent_takes_its_workers_and_their_locks_keep_out_a_rerun(parallel_sweep,
                                                                          monkeypatch):
  parent, sweep_dir, release, pids = parallel_sweep
  parent.kill()  # SIGKILL: no handler runs in the parent
  parent.communicate(timeout=60)
  wait_for_logs(sweep_dir, "ab", "got SIGTERM", timeout=60)  # PR_SET_PDEATHSIG

  # While the old workers live (still saving), a rerun cannot run their runs a second time.
  monkeypatch.setattr(jobs, "eval_job", lambda job_spec, suite: dict(score=1.0))
  sweep = make_sweep(**{n: spec.eval_run(checkpoint=n) for n in "abc"})
  outcome = runner.run_sweep(sweep, sweep_dir)
  assert set(outcome.failed) == {"a", "b"} and set(outcome.results) == {"c"}
  for name, pid in pids.items():
    assert outcome.failed[name].startswith("WorkdirLockedError")
    assert f"in use by pid {pid} on host {socket.gethostname()}" in outcome.failed[name]
    assert f"sweep run {name}" in outcome.failed[name]
  assert not result_exists(sweep_dir, "a") and not result_exists(sweep_dir, "b")

  open(release, "w").close()  # the old workers finish stopping and exit
  wait_until_unlocked(sweep_dir, "ab")
  outcome = runner.run_sweep(sweep, sweep_dir)
  outcome.raise_if_failed()
  assert set(outcome.results) == set("abc")


def write_lines(path, *lines, end="\n"):
  with open(path, "w") as f:
    f.write("\n".join(lines) + end)


def record(step, split="train", **values):
  return json.dumps(dict(step=step, split=split, lm_loss=1.0 / step, loss=2.0 / step, **values))


def test_read_metrics_skips_a_torn_last_line_and_names_a_corrupt_one(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  write_lines(path, record(1), record(1, "eval"), record(2), '{"step": 3, "spl', end="")
  train_records, eval_records = jobs.read_metrics(str(tmp_path))
  assert [r["step"] for r in train_records] == [1, 2] and len(eval_records) == 1
  write_lines(path, record(1), '{"step": 2, "spl', record(3))
  with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
    jobs.read_metrics(str(tmp_path))


def test_metric_writer_cuts_a_torn_last_line_when_it_resumes(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  write_lines(path, record(1), record(2), '{"step": 3, "split": "tr', end="")
  writer = MetricWriter(str(tmp_path))
  writer.write(3, dict(lm_loss=0.3, loss=0.6))
  writer.close()
  train_records, _ = jobs.read_metrics(str(tmp_path))
  assert [r["step"] for r in train_records] == [1, 2, 3]
  with open(path) as f:
    assert all(json.loads(line) for line in f)
