"""Multi-process training on one machine: 2 CPU processes with 2 simulated devices each (4
global devices) joined through `jax.distributed` on localhost (gloo collectives).

- Data: each process reads only its shard, and the global batch assembled with
  `jax.make_array_from_process_local_data` is the two local batches stacked in process order.
- Training through experiments/train.py: both processes see the same loss at every step, equal
  to one process with 4 devices trained on the concatenated local batches (the pipeline shards
  the document stream per process, so 2 processes read different data than 1 would).
- Checkpoints: a SIGTERM to one process (not the coordinator) stops both at the same step with
  a checkpoint written by both; rerunning both resumes where they stopped (tests/test_stop.py
  covers the stop protocol on one process).
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import train_cli
from glm5_jax import data as data_lib
from test_train import small_config
from tests.conftest import host_devices_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSES = 2
DEVICES_PER_PROCESS = 2
# One MoE layer and one MTP depth: what is tested here is the processes' data, steps and
# checkpoints, not the model, and every run compiles its programs afresh (no compilation cache,
# see `_env`), so compile time is most of this file's time.
ONE_LAYER = ("--config.model.num_hidden_layers=1", "--config.model.first_k_dense_replace=0",
             "--config.model.mtp_depths=1")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(process_id=None, port=None, devices=DEVICES_PER_PROCESS) -> dict:
  """The worker environment: CPU only, `devices` simulated devices, and (with `process_id`)
  the coordinates of a `PROCESSES`-process run. Proxy variables are dropped: gRPC would route
  the coordinator's localhost traffic through them. So is the session's compilation cache
  (conftest.py): jax writes it from process 0 only and on CPU the key differs by process, so
  process 0 would load a step that process 1 still compiles, and wait at the first collective
  longer than gloo's 30 s setup deadline. (The suite's JAX_DISABLE_MOST_OPTIMIZATIONS stays:
  every process of a comparison compiles alike.)"""
  env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()
         and (not k.startswith("JAX_") or k == "JAX_DISABLE_MOST_OPTIMIZATIONS")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=host_devices_xla_flags(devices))
  if process_id is not None:
    env.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(PROCESSES),
               JAX_PROCESS_ID=str(process_id))
  return env


def _run_together(commands, tmp_path, name, timeout=900) -> list[subprocess.CompletedProcess]:
  """Runs one process per `(args, env)` in `commands` at once; returns when all have exited.

  Output goes to files (a full pipe would block a worker). As soon as one fails, or at
  `timeout`, every other is killed (a peer of a dead process waits at its next collective)
  and the assertion shows each one's stderr tail.
  """
  procs, logs = [], []
  for i, (args, env) in enumerate(commands):
    out = open(tmp_path / f"{name}_{i}.out", "w+")
    err = open(tmp_path / f"{name}_{i}.err", "w+")
    logs.append((out, err))
    procs.append(subprocess.Popen(args, env=env, cwd=ROOT, stdout=out, stderr=err))
  deadline = time.time() + timeout
  failed = None
  try:
    while any(p.poll() is None for p in procs):
      bad = [i for i, p in enumerate(procs) if p.returncode not in (None, 0, 75)]
      if bad:
        failed = f"process {bad[0]} exited with {procs[bad[0]].returncode}"
        break
      if time.time() > deadline:
        failed = f"timed out after {timeout} s"
        break
      time.sleep(0.5)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  results = []
  for (args, _), p, (out, err) in zip(commands, procs, logs):
    out.seek(0), err.seek(0)
    results.append(subprocess.CompletedProcess(args, p.returncode, out.read(), err.read()))
    out.close(), err.close()
  if failed or any(r.returncode not in (0, 75) for r in results):
    report = "\n".join(f"--- {name} process {i}: exit {r.returncode}, stderr tail:\n"
                       f"{r.stderr[-3000:]}" for i, r in enumerate(results))
    raise AssertionError(f"{name}: {failed or 'a process failed'}\n{report}")
  return results


@pytest.mark.slow  # two processes through jax.distributed
def test_each_process_reads_its_shard_and_the_global_batch_stacks_them(tmp_path):
  port = _free_port()
  script = os.path.join(ROOT, "tests", "multihost_data_worker.py")
  _run_together([([sys.executable, script, str(tmp_path), "2"], _env(i, port))
                 for i in range(PROCESSES)], tmp_path, "data", timeout=300)
  saved = [dict(np.load(tmp_path / f"data_{i}.npz")) for i in range(PROCESSES)]
  data_cfg = small_config().data
  global_rows, local_rows = data_cfg.batch_size, data_cfg.batch_size // PROCESSES
  # Each process's devices hold one contiguous block of rows, in process order.
  assert saved[0]["device_rows"].tolist() == [[0, 1], [1, 2]]
  assert saved[1]["device_rows"].tolist() == [[2, 3], [3, 4]]
  for i in range(PROCESSES):
    # Exactly what this process's shard of the pipeline yields, read here in one process.
    iterator = data_lib.make_train_iterator(data_cfg, process_index=i, process_count=PROCESSES)
    expected = [next(iterator) for _ in range(2)]
    iterator.close()
    for step in range(2):
      for key, value in expected[step].items():
        local = saved[i][f"local/{step}/{key}"]
        assert local.shape == (local_rows, data_cfg.seq_len), (key, local.shape)
        np.testing.assert_array_equal(local, value, err_msg=f"process {i} step {step} {key}")
  for step in range(2):
    # Disjoint shards: no packed row of one process appears in the other's batch.
    rows = [{r.tobytes() for r in saved[i][f"local/{step}/tokens"]} for i in range(PROCESSES)]
    assert not rows[0] & rows[1]
    for key in expected[0]:
      stacked = np.concatenate([saved[i][f"local/{step}/{key}"] for i in range(PROCESSES)])
      for i in range(PROCESSES):
        assert saved[i][f"global_shape/{step}/{key}"].tolist() == [global_rows,
                                                                     data_cfg.seq_len]
        np.testing.assert_array_equal(saved[i][f"global/{step}/{key}"], stacked,
                                      err_msg=f"global {key} on process {i}, step {step}")


def _read_losses(directory, process_index) -> dict[int, float]:
  with open(os.path.join(directory, f"losses_{process_index}.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in records}


def _train_together(tmp_path, name, workdir, steps, *, hooks=((), ()), flags=()):
  """experiments/train.py in `PROCESSES` processes sharing `workdir` (fsdp over processes:
  params and optimizer state are split between them, so each checkpoint holds both halves)."""
  port = _free_port()
  losses_dir = tmp_path / name
  losses_dir.mkdir()
  commands = []
  for i in range(PROCESSES):
    cmd = train_cli.command(workdir, f"--config.train.steps={steps}", *ONE_LAYER,
                            "--config.mesh.shape.data=2", "--config.mesh.shape.fsdp=2",
                            "--config.ckpt.every_steps=100", *flags,
                            hook=[f"losses_to:{losses_dir}", *hooks[i]])
    commands.append((cmd["args"], _env(i, port)))
  results = _run_together(commands, tmp_path, name)
  return results, [_read_losses(losses_dir, i) for i in range(PROCESSES)]


@pytest.mark.slow  # two-process training runs and a one-process reference, ~several minutes
def test_two_process_training_stops_together_resumes_and_matches_one_process(tmp_path):
  """Two processes train 6 steps in two runs: a SIGTERM to process 1 alone (not the
  coordinator; checkpoints saved asynchronously) stops both at the same step with a checkpoint
  holding both halves, and the rerun resumes both to the end. The joined losses equal one
  process with 4 devices fed both processes' local batches concatenated."""
  steps = 6
  # ---- SIGTERM after step 3's log: both stop at 3 (or 4 when the signal lands after step 3's
  # stop decision) and save it.
  workdir = str(tmp_path / "interrupted")
  first, first_losses = _train_together(tmp_path, "interrupted", workdir, steps,
                                        hooks=([], ["sigterm_after_log:3"]),
                                        flags=["--config.ckpt.async_save=True"])
  assert [r.returncode for r in first] == [75, 75], [r.stderr[-2000:] for r in first]
  stopped = max(first_losses[0])
  assert stopped in (3, 4) and sorted(first_losses[0]) == sorted(first_losses[1]) == list(
      range(1, stopped + 1))
  saved = os.path.join(workdir, "checkpoints", str(stopped), "data")
  assert sorted(os.listdir(saved)) == ["commit_success.txt", "process_0-of-2.json",
                                       "process_1-of-2.json"]

  # ---- the rerun resumes both processes at the saved step and trains to the end.
  second, second_losses = _train_together(tmp_path, "resumed", workdir, steps)
  assert all(r.returncode == 0 for r in second)
  summary = json.loads(second[0].stdout.strip().splitlines()[-1])
  assert summary["steps"] == steps, summary
  assert "training summary" not in second[1].stdout  # printed by process 0 only
  losses = []
  for i in range(PROCESSES):
    assert sorted(second_losses[i]) == list(range(stopped + 1, steps + 1))
    joined = {**first_losses[i], **second_losses[i]}
    losses.append([joined[s] for s in range(1, steps + 1)])
  assert losses[0] == losses[1]  # every process computes the same global loss
  assert losses[0][-1] < losses[0][0]

  # ---- one process, 4 devices, fed both processes' local batches concatenated
  reference_dir = tmp_path / "reference"
  reference_dir.mkdir()
  cmd = train_cli.command(str(tmp_path / "reference_work"), f"--config.train.steps={steps}",
                          *ONE_LAYER, "--config.mesh.shape.data=2", "--config.mesh.shape.fsdp=2",
                          "--config.ckpt.every_steps=100",
                          hook=[f"losses_to:{reference_dir}", f"concat_shards:{PROCESSES}"])
  _run_together([(cmd["args"], _env(devices=PROCESSES * DEVICES_PER_PROCESS))], tmp_path,
                "reference")
  reference = _read_losses(reference_dir, 0)
  np.testing.assert_allclose(losses[0], [reference[s] for s in range(1, steps + 1)], rtol=1e-5)


def test_each_process_checks_its_own_data_position(monkeypatch):
  """A checkpoint's meta (written by process 0) records every process's data position; each
  process checks only its own on restore."""
  from glm5_jax.train import integrity
  states = [{"next_index": 7}, {"next_index": 6}]  # two shards rarely stand at the same index
  saved = [integrity.data_fingerprint(s) for s in states]
  assert integrity.process_data_fingerprints(states[0]) == saved[0]  # one process: a string
  assert integrity.data_position_matches(saved[0], states[0])
  monkeypatch.setattr(integrity.jax, "process_count", lambda: 2)
  for index in range(2):
    monkeypatch.setattr(integrity.jax, "process_index", lambda index=index: index)
    assert integrity.data_position_matches(saved, states[index])
    assert not integrity.data_position_matches(saved, states[1 - index])
    assert not integrity.data_position_matches(saved[index], states[index])  # 1-process ckpt
    assert not integrity.data_position_matches(saved + saved[:1], states[index])  # 3 processes
