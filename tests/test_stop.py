"""Stopping early: SIGTERM (or a step budget) saves the step it stops at, says so truthfully,
exits with the documented code, and resumes there; all processes agree on the stop step (the
protocol here; two real processes in tests/test_multihost.py)."""

import os
import re
import signal
import sys

import ml_collections
import pytest

from glm5_jax.train import stopping
from glm5_jax.train.harness import RunHarness

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_cli  # pylint: disable=g-import-not-at-top,wrong-import-position


def _steps_on_disk(workdir):
  return sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())


@pytest.mark.slow
def test_sigterm_between_save_decision_and_break_saves_that_step(tmp_path):
  workdir = str(tmp_path)
  # every_steps 100: no save is due on its own, so only the stop itself can write one.
  flags = ("--config.train.steps=8", "--config.ckpt.every_steps=100")
  stopped = train_cli.run(workdir, *flags, hook="sigterm_after_log:3")
  log = stopped.stdout + stopped.stderr
  assert stopped.returncode == stopping.EXIT_STOPPED_EARLY, log[-3000:]
  claims = [int(s) for s in re.findall(r"saved step (\d+)", log)]
  assert claims, log[-3000:]
  assert claims[-1] in _steps_on_disk(workdir)  # the log line is true
  assert claims[-1] in (3, 4)  # the step it was at, or the next one: never a later one
  assert '"stopped_early": true' in stopped.stdout

  resumed = train_cli.run(workdir, *flags)
  log = resumed.stdout + resumed.stderr
  assert resumed.returncode == 0, log[-3000:]
  assert re.search(rf"resumed from \S+ at step {claims[-1]}\b", log), log[-3000:]
  assert '"steps": 8' in resumed.stdout and '"stopped_early": false' in resumed.stdout


def test_harness_stop_decision_sees_a_signal_from_before_it_existed(tmp_path):
  """The one stop decision of every loop (`RunHarness.stop_reason`): a SIGTERM that arrived
  while an enclosing StopSignal was active (a sweep, the RL pipeline) and the run was still
  being built stops the run at its first step; the last step never stops early; a step budget
  counts the steps of this call; nested handlers are restored and the flag cleared."""
  ckpt = ml_collections.ConfigDict(dict(every_steps=4, keep=1, async_save=False,
                                        restore_fallback=False))
  handler = signal.getsignal(signal.SIGTERM)
  with stopping.StopSignal():
    os.kill(os.getpid(), signal.SIGTERM)
    with RunHarness(str(tmp_path / "a"), "test", ckpt, total_steps=3) as run:
      assert run.stop_reason(1) == "SIGTERM" and run.save_due(1, "SIGTERM")
      assert run.stop_reason(3) is None
  assert signal.getsignal(signal.SIGTERM) is handler
  with RunHarness(str(tmp_path / "b"), "test", ckpt, total_steps=10, stop_after_steps=2) as run:
    assert run.stop_reason(5) is None and run.stop_reason(6) == "stop_after_steps"
    assert run.due(8, 4) and run.due(10, 4) and not run.due(9, 4) and not run.due(10, 0)
    assert run.save_due(4, None) and not run.save_due(5, None)


def test_one_process_stop_flag_needs_no_communication():
  def allgather(_):
    raise AssertionError("a single process must not communicate")

  assert stopping.any_process(True, process_count=1, allgather=allgather)
  assert not stopping.any_process(False, process_count=1, allgather=allgather)


def test_every_process_stops_when_any_host_was_signalled():
  # Three hosts; only host 1 got SIGTERM. Each gathers every host's flag and reaches the
  # same decision, so no host waits alone at the checkpoint barrier.
  local_flags = [False, True, False]
  gathered = []

  def allgather(flag):
    gathered.append(int(flag))
    return local_flags  # what the collective returns on every host

  decisions = [stopping.any_process(f, process_count=3, allgather=allgather)
               for f in local_flags]
  assert decisions == [True, True, True] and gathered == [0, 1, 0]
  assert not any(stopping.any_process(False, process_count=3, allgather=lambda _: [0, 0, 0])
                 for _ in range(3))
