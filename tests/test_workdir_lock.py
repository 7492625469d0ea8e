"""One process trains in a workdir at a time: a second is refused naming the holder; a holder
killed with SIGKILL leaves nothing in the way."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from glm5_jax.train.loop import train
from glm5_jax.train.workdir_lock import LOCK_FILE, WorkdirLockedError
from test_train import small_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_cli  # pylint: disable=g-import-not-at-top,wrong-import-position


def _wait_for_holder(workdir, pid, timeout=300):
  path = os.path.join(workdir, LOCK_FILE)
  deadline = time.time() + timeout
  while time.time() < deadline:
    try:
      with open(path) as f:
        if json.loads(f.read() or "{}").get("pid") == pid:
          return
    except (FileNotFoundError, ValueError):
      pass
    time.sleep(0.2)
  pytest.fail(f"process {pid} never took {path}")


@pytest.mark.slow
def test_second_run_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path):
  workdir = str(tmp_path)
  holder = subprocess.Popen(**train_cli.command(workdir, "--config.train.steps=100000"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    _wait_for_holder(workdir, holder.pid)
    config = small_config(steps=2)
    with pytest.raises(WorkdirLockedError,
                       match=rf"in use by pid {holder.pid} on host {socket.gethostname()} "
                             r"\(training, since"):
      train(config, workdir)
  finally:
    holder.kill()  # SIGKILL: no cleanup runs in the holder
    holder.wait()
  assert os.path.exists(os.path.join(workdir, LOCK_FILE))  # still names the dead holder
  summary = train(config, workdir)
  assert summary["steps"] == 2
