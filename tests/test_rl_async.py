"""The asynchronous RL system (glm5_jax/rl): orders and the orchestrator, a trainer with two
workers in one process, restart repair and stall detection, and (slow) the launcher's
processes killed with SIGKILL or stopped with SIGTERM: a worker is restarted and the run
completes; a rerun after the trainer's death or stop resumes it; roles stop with (and die with)
the launcher. In every case each rollout file answers one order, and each file is trained on
(or rejected) exactly once.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import rl_tiny
from glm5_jax.config import ModelConfig
from glm5_jax.posttrain import learning_signal
from glm5_jax.rl import async_trainer, launcher, orders, trajectories, worker
from glm5_jax.rl.layout import RunDirs, read_json
from glm5_jax.rl.orchestrator import Orchestrator
from glm5_jax.train import checkpoint as ckpt
from glm5_jax.train.state import TrainState
from test_multihost import _free_port, _run_together  # pylint: disable=import-error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_async_config(**rl):
  """configs/rl_tiny.py with a 2-layer model, 32-token rows, groups of 4, 2 groups per step."""
  config = rl_tiny.get_config("recipe=plain")
  del config["sft"]
  config.model.num_hidden_layers = 2
  config.data.seq_len = 32
  config.rl.update({**dict(group_size=4, prompts_per_step=2, max_new_tokens=8, steps=3,
                          eval_every_steps=0, eval_tasks=0, eval_samples=0, worker_groups=2,
                          max_staleness=1, poll_seconds=0.05), **rl})
  config.optim.update(warmup_steps=0, learning_rate=1e-2)
  config.ckpt.update(every_steps=1, async_save=False)
  return config


def _record(version, reward=1.0):
  mask = np.float32([0, 1, 1])
  return trajectories.TrajectoryRecord(np.int32([5, 6, 7]), np.float32([0, -1, -2]), mask,
                                       np.where(mask > 0, version, -1).astype(np.int32), reward,
                                       {"task": 0, "turns": 1})


def _answer(root, order, version=0):
  trajectories.write_batch(RunDirs.at(root).rollouts, [_record(version)], worker=order.worker,
                           batch_index=order.id)


def test_capacity_rule_and_state_rebuilt_from_disk(tmp_path):
  make = lambda rejected=0: Orchestrator(tmp_path, ["w0", "w1"], groups_per_step=2,
                                         max_staleness=1, total_steps=3, group_size=4,
                                         rejected=rejected)
  orch = make()
  issued = orch.issue(0)  # (0 + 1 + 1) * 2 groups may be live at version 0
  assert [o.id for o in issued] == [0, 1, 2, 3] and [o.task for o in issued] == [0, 1, 2, 3]
  assert orch.issue(0) == [] and orch.capacity(0) == 0
  assert len(orch.issue(1)) == 2  # one more step of room
  assert orch.issue(5) == []  # never beyond rl.steps x b = 6 groups
  loads = orch.router.loads()
  assert sum(loads.values()) == 6 and max(loads.values()) <= 4  # bounded loads
  for order in issued[:3]:
    _answer(tmp_path, order)
  orch.settle(orders.answered(tmp_path))
  assert orch.running == 3
  # A new orchestrator (a restarted trainer) rebuilds ids, tasks and pins from the directory.
  again = make()
  assert (again.next_id, again.next_task, again.running) == (6, 6, 3)
  assert again.router.pinned() == {str(o.id): o.worker for o in orch.orders[3:]}
  for w in ("w0", "w1"):
    assert [o.id for o in orders.outstanding_for(tmp_path, w)] == \
        [o.id for o in orch.orders[3:] if o.worker == w]


def test_requeue_is_counted_and_idempotent_across_restarts(tmp_path):
  make = lambda rejected=0: Orchestrator(tmp_path, ["w0"], groups_per_step=1, max_staleness=0,
                                         total_steps=4, group_size=4, rejected=rejected)
  orch = make()
  (first,) = orch.issue(0)
  _answer(tmp_path, first)
  orch.settle(orders.answered(tmp_path))
  again = orch.requeue(first.rollout_name, 1)
  assert (again.id, again.task, again.requeue_of) == (1, first.task, first.rollout_name)
  assert orch.live == 1 and orch.capacity(0) == 0  # the re-queue takes the rejected one's place
  # A trainer restarted from a checkpoint older than the rejection rejects the file again: it
  # is counted again (the checkpoint did not count it) but not issued twice.
  restarted = make(rejected=0)
  assert restarted.requeue(first.rollout_name, 1) is None
  assert len(restarted.orders) == 2 and restarted.live == 1
  assert restarted.next_task == 1  # re-queues do not consume new tasks
  with pytest.raises(ValueError, match="answers no issued order"):
    restarted.requeue("0000000099-w0.npz", 1)


def test_orders_refuse_reuse_and_unknown_workers(tmp_path):
  order = orders.Order(0, "w0", 3, 4, 0)
  orders.write_order(tmp_path, order)
  with pytest.raises(FileExistsError, match="order id 0 was already issued"):
    orders.write_order(tmp_path, orders.Order(0, "w1", 4, 4, 0))
  with pytest.raises(ValueError, match="not one of this run's workers"):
    Orchestrator(tmp_path, ["w5"], groups_per_step=1, max_staleness=0, total_steps=1,
                 group_size=4)
  (tmp_path / "orders" / "0000000001-w0.json").write_text("{not json")
  with pytest.raises(ValueError, match="0000000001-w0.json: not a rollout order"):
    orders.read_orders(tmp_path)


def _final_meta(root):
  with ocp.CheckpointManager(os.path.join(root, "checkpoints")) as manager:
    step = manager.latest_step()
    return manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]


def _check_exactly_once(root, config):
  """Every rollout file answers one issued order; the final ledger consumed each file once,
  trained rl.steps x b groups, and the rest were rejected as stale (and re-queued)."""
  rl = config.rl
  issued = orders.read_orders(root)
  files = sorted(orders.answered(root))
  assert set(files) <= {o.rollout_name for o in issued}
  meta = _final_meta(root)
  extra = meta["extra"]
  consumed = extra["ledger"]["consumed"]
  assert len(consumed) == len(set(consumed))
  rejected = extra["rejected"]
  assert set(rejected) <= set(consumed)
  assert len(consumed) - len(rejected) == rl.steps * rl.prompts_per_step
  assert set(consumed) == set(files)  # nothing answered is left untrained at the end
  assert {o.requeue_of for o in issued if o.requeue_of} == set(rejected)
  hist = {int(g): c for g, c in extra["admission"]["histogram"].items()}
  assert extra["admission"]["admitted"] == rl.steps * rl.prompts_per_step * rl.group_size
  return meta, hist


def test_trainer_and_two_workers_in_threads(tmp_path, helpers):
  """Also with routing replay on: the files carry each token's routing into the train step;
  and with the signal controls: a worker replays each silent group once on its refill task
  (random params answer nothing right: every group is silent), the trainer logs the KL to
  the start and trains its penalty."""
  config = small_async_config(routing_replay=True, dynamic_sampling_rounds=1, kl_coef=0.1,
                              log_kl=True)
  params = helpers.random_params(ModelConfig.from_config(config.model), seed=0)
  root = str(tmp_path / "rl")
  errors = []

  def serve(name):
    try:
      worker.run_worker(config, root, name)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in ("w0", "w1")]
  for t in threads:
    t.start()
  summary = async_trainer.run_async_trainer(config, root, ["w0", "w1"], params=params)
  for t in threads:
    t.join(timeout=60)
  assert not errors, errors
  assert not any(t.is_alive() for t in threads)  # they stopped on control/done
  assert summary["steps"] == 3 and summary["versions_published"] == 4
  _, hist = _check_exactly_once(root, config)
  assert max(hist) <= config.rl.max_staleness + (1 if summary["rejected"] else 0)
  loaded = [v for w in ("w0", "w1")
            for v in read_json(RunDirs.at(root).worker_stats(w))["versions_loaded"]]
  assert 0 in loaded and max(loaded) >= 1  # the workers switched versions during the run
  files = sorted(orders.answered(root))
  record = trajectories.read_batch(RunDirs.at(root).rollouts / files[0]).records[0]
  assert set(record.routing) == {"moe", "dsa"}
  assert record.meta["task"] >= learning_signal.REFILL_STRIDE  # the refill round's task
  assert record.routing["moe"].shape[0] == len(record.tokens)
  with open(os.path.join(root, "metrics.jsonl")) as f:
    first = json.loads(f.readline())
  # Step 1 trains version-0 samples at version 0 with their routing replayed: the trainer's
  # log-probs are the engine's.
  assert first["logp_mismatch_max"] < 1e-4
  assert abs(first["kl_to_start"]) < 1e-4 and "kl_penalty" in first and "zero_signal_groups" in first


# ---- processes killed with SIGKILL (slow) -------------------------------------------------------


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory, helpers):
  """The run the RL runs below start from (`rl.init_from`): a checkpoint of random params of the
  2-layer SFT model, saved as the trainer saves one (`ckpt.save`, config and fingerprints in
  its meta). RL reads only the model config and the params of that run (`load_run`), and what
  these tests prove does not depend on their values; RL from a trained SFT run is
  test_rl_loop.py's CLI test. (A 2-step SFT run here compiled two train programs: ~70 s.)"""
  config = rl_tiny.get_config("recipe=plain").sft
  config.model.num_hidden_layers = 2
  params = helpers.random_params(ModelConfig.from_config(config.model), seed=0)
  workdir = str(tmp_path_factory.mktemp("sft"))
  manager = ckpt.make_manager(workdir, every_steps=1, keep=1, async_save=False)
  state = TrainState(step=jnp.int32(2), params=params, opt_state={"count": jnp.zeros(())},
                     rng=jax.random.key_data(jax.random.key(0)))
  ckpt.save(manager, state, None, config, force=True)
  manager.wait_until_finished()
  manager.close()
  return workdir


def _command(workdir, sft, steps):
  return [sys.executable, "experiments/rl.py", "--mode=async", "--rollout_workers=2",
          f"--workdir={workdir}", f"--config.rl.init_from={sft}",
          "--config.model.num_hidden_layers=2", "--config.data.seq_len=32",
          f"--config.rl.steps={steps}", "--config.rl.prompts_per_step=2",
          "--config.rl.group_size=4", "--config.rl.max_new_tokens=8",
          "--config.rl.eval_every_steps=0", "--config.rl.eval_tasks=0",
          "--config.rl.eval_samples=0", "--config.rl.worker_groups=1",
          "--config.rl.poll_seconds=0.05", "--config.optim.warmup_steps=0",
          "--config.ckpt.async_save=False"]


def _env():
  return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")


def _wait_for(predicate, proc, timeout=600):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    if proc.poll() is not None:
      raise AssertionError(f"the launcher exited early ({proc.returncode}):\n"
                           + proc.stderr.read()[-3000:])
    time.sleep(0.2)
  raise AssertionError("timed out")


def _config_of(steps):
  config = small_async_config(steps=steps, worker_groups=1)
  return config


@pytest.mark.slow
def test_killed_or_signalled_roles_and_reruns_complete_the_run(tmp_path, sft_dir):
  """SIGKILL to the trainer: the launcher says so (no error of its own is above) and a rerun
  resumes; SIGTERM to the trainer: it saves its current step and the command exits 75; the
  last rerun completes although a worker is killed (it is restarted), every rollout file
  trained on exactly once."""
  steps = 5
  root = RunDirs.at(tmp_path / "rl")
  command = _command(tmp_path, sft_dir, steps)
  trainer = lambda: read_json(root.trainer_stats) or {}

  def run_until(version, signum):
    proc = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: trainer().get("version", 0) >= version, proc)
    os.kill(trainer()["pid"], signum)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err

  code, err = run_until(2, signal.SIGKILL)
  assert code == 1 and "the trainer was killed by signal 9 (SIGKILL" in err, err[-3000:]
  assert "rerun the same command to resume" in err
  code, err = run_until(3, signal.SIGTERM)
  assert code == 75, err[-3000:]
  assert "resumed from " in err and "stopped early (SIGTERM)" in err
  stopped_at = trainer()["version"]
  assert stopped_at < steps and _final_meta(str(root.root))["step"] == stopped_at
  proc = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  w1 = lambda: read_json(root.worker_stats("w1")) or {}
  _wait_for(lambda: w1().get("starts", 0) == 3, proc)  # this run's w1 is up
  os.kill(w1()["pid"], signal.SIGKILL)
  out, err = proc.communicate(timeout=900)
  assert proc.returncode == 0, err[-3000:]
  assert "worker w1" in err and "restarting it (restart 1)" in err
  assert "worker restarts: {'w1': 1}" in out
  result = json.loads(out.strip().splitlines()[-1])
  assert result["steps"] == steps
  assert trainer()["starts"] == 3 and w1()["starts"] == 4
  _check_exactly_once(str(root.root), _config_of(steps))


def test_a_worker_launched_as_several_processes_is_refused(tmp_path):
  env = dict(_env(), JAX_COORDINATOR_ADDRESS="localhost:1", JAX_NUM_PROCESSES="2",
             JAX_PROCESS_ID="0")
  proc = subprocess.run([sys.executable, "experiments/rl.py", "--mode=async", "--role=worker",
                         "--worker=w0", f"--workdir={tmp_path}"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].endswith(
      "only --mode=async --role=trainer runs on several (a rollout worker is one JAX process: "
      "a single-host slice, its mesh over that host's devices)")


@pytest.mark.slow
def test_trainer_of_two_processes_and_a_worker(tmp_path):
  """The trainer as two JAX processes (one CPU device each, a 2-device mesh): process 0 plans,
  both train on the same groups, one summary; every file consumed once."""
  steps, port = 3, _free_port()
  command = _command(tmp_path, "", steps)
  command = [c.replace("--rollout_workers=2", "--rollout_workers=1") for c in command]
  # No compilation cache for the trainer's processes (tests/test_multihost.py's _env says why).
  base = {k: v for k, v in _env().items()
          if not k.startswith("JAX_") or k in ("JAX_PLATFORMS", "JAX_DISABLE_MOST_OPTIMIZATIONS")}
  commands = [(command + ["--role=trainer"],
               dict(base, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                    JAX_PROCESS_ID=str(i))) for i in range(2)]
  # The worker exits on control/done; a failed process stops the others.
  _run_together(commands + [(command + ["--role=worker", "--worker=w0"], _env())], tmp_path,
                "async_two_process_trainer")
  root = str(tmp_path / "rl")
  assert read_json(RunDirs.at(root).root / "summary.json")["steps"] == steps
  _check_exactly_once(root, _config_of(steps))


def test_metric_writer_on_a_remote_workdir(tmp_path, monkeypatch):
  """A gs:// workdir (etils' mock file system here): metrics.jsonl is rewritten whole after each
  record, a reopened writer continues it, a torn last line is dropped."""
  from etils import epath  # pylint: disable=import-outside-toplevel
  from etils.epath import testing  # pylint: disable=import-outside-toplevel
  from glm5_jax.train.metrics import MetricWriter  # pylint: disable=import-outside-toplevel
  monkeypatch.chdir(tmp_path)  # the mock maps gs://bucket/... to ./gs:/bucket/...
  with testing.mock_epath():
    writer = MetricWriter("gs://bucket/run")
    writer.write(1, {"loss": 1.5})
    writer.close()
    path = epath.Path("gs://bucket/run/metrics.jsonl")
    path.write_text(path.read_text() + '{"step": 2, "spl')  # a writer died mid-upload
    writer = MetricWriter("gs://bucket/run")
    writer.write(2, {"loss": 1.25})
    records = [json.loads(line) for line in path.read_text().splitlines()]
  assert [(r["step"], r["loss"]) for r in records] == [(1, 1.5), (2, 1.25)]


# ---- restart repair and stall detection (no JAX) -------------------------------------------------


def _intake(root, ledger, version=0, **rl):
  config = small_async_config(**rl)
  orch = Orchestrator(root, ["w0"], groups_per_step=2, max_staleness=1, total_steps=3,
                      group_size=4, rejected=len(ledger.quarantined))
  return async_trainer._Intake(config, RunDirs.at(root), orch, ledger, version), orch  # pylint: disable=protected-access


def test_a_quarantined_file_the_ledger_missed_is_recorded_and_requeued_on_restart(tmp_path):
  """The issue's repro: the trainer is killed after quarantining a file and before writing its
  re-queue order (and before a checkpoint records it). Unrepaired, the last step's group never
  arrives and the run waits forever; at restart the intake records it and re-queues its task."""
  intake, orch = _intake(tmp_path, trajectories.TrajectoryLedger())
  first = orch.issue(0)
  for order in first:
    _answer(tmp_path, order)
  rollouts = RunDirs.at(tmp_path).rollouts
  (rollouts / trajectories.QUARANTINE).mkdir()
  (rollouts / first[0].rollout_name).rename(rollouts / trajectories.QUARANTINE /
                                            first[0].rollout_name)
  ledger = trajectories.TrajectoryLedger()  # as restored from the checkpoint before it
  intake, orch = _intake(tmp_path, ledger)
  assert orch.rejected == 1 and first[0].rollout_name in orch.requeued
  requeue = [o for o in orch.orders if o.requeue_of == first[0].rollout_name]
  assert len(requeue) == 1 and requeue[0].task == first[0].task
  plan = intake.plan(0, 0)
  assert set(plan["quarantined"]) == {first[0].rollout_name} and plan["stalled"] is None
  # A second restart before any checkpoint: the same repair, no second re-queue.
  _, orch = _intake(tmp_path, trajectories.TrajectoryLedger())
  assert orch.rejected == 1 and len([o for o in orch.orders if o.requeue_of]) == 1


def test_no_progress_for_stall_seconds_names_the_missing_orders(tmp_path, monkeypatch):
  intake, _ = _intake(tmp_path, trajectories.TrajectoryLedger(), stall_seconds=5.0)
  now = [1000.0]
  monkeypatch.setattr(async_trainer.time, "time", lambda: now[0])
  intake.progressed()
  assert intake.plan(0, 0)["stalled"] is None  # orders issued, nothing arrived yet
  now[0] += 6
  stalled = intake.plan(0, 0)["stalled"]
  assert "no progress for 5 s (rl.stall_seconds) at version 0 of 3" in stalled
  assert "outstanding orders {'w0': [0, 1, 2, 3]}" in stalled


# ---- the launcher's roles die with it and stop on its SIGTERM (stand-in roles, no JAX) ---------

# A role that records its pid, and on SIGTERM records that and exits 75 as the real roles do.
_FAKE_ROLE = r"""
import os, signal, sys, time
out, role = sys.argv[1], sys.argv[2].split("=")[1]
name = sys.argv[3].split("=")[1] if role == "worker" else "trainer"
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
open(os.path.join(out, name + ".pid"), "w").write(str(os.getpid()))
while not stop:
  time.sleep(0.02)
open(os.path.join(out, name + ".stopped"), "w").write("")
sys.exit(75)
"""
_NAMES = ("trainer", "w0", "w1")


def _wait_for_files(out, suffix, timeout=60):
  deadline = time.time() + timeout
  while not all((out / f"{n}{suffix}").exists() for n in _NAMES):
    assert time.time() < deadline, f"timed out waiting for {suffix}: {os.listdir(out)}"
    time.sleep(0.05)


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
    return f.read().split(")")[-1].split()[0] != "Z"


def test_sigterm_to_the_launcher_is_forwarded_and_every_role_stops(tmp_path):
  out = tmp_path / "out"
  out.mkdir()

  def signal_when_started():
    _wait_for_files(out, ".pid")
    os.kill(os.getpid(), signal.SIGTERM)

  threading.Thread(target=signal_when_started, daemon=True).start()
  result = launcher.launch([sys.executable, "-c", _FAKE_ROLE, str(out)], tmp_path / "rl",
                           ["w0", "w1"], poll_seconds=0.05)
  assert result["stopped"] and result["trainer_returncode"] == 75
  assert not result["worker_restarts"]
  _wait_for_files(out, ".stopped", timeout=1)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_roles_die_with_a_launcher_killed_by_sigkill(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  script = ("import sys; from glm5_jax.rl import launcher; launcher.launch(sys.argv[1:-1], "
            "sys.argv[-1], ['w0', 'w1'], poll_seconds=0.05)")
  parent = subprocess.Popen([sys.executable, "-c", script, sys.executable, "-c", _FAKE_ROLE,
                             str(out), str(tmp_path / "rl")], cwd=REPO, env=_env())
  try:
    _wait_for_files(out, ".pid")
  finally:
    parent.kill()
    parent.wait()
  _wait_for_files(out, ".stopped")  # each got SIGTERM from the kernel, and stopped
  pids = [int((out / f"{n}.pid").read_text()) for n in _NAMES]
  deadline = time.time() + 30
  while any(_alive(p) for p in pids):
    assert time.time() < deadline, "orphaned roles still running"
    time.sleep(0.05)


def test_a_role_killed_by_a_signal_is_described_as_such():
  assert launcher.describe_exit(-9).startswith("was killed by signal 9 (SIGKILL")
  assert launcher.describe_exit(1) == "exited with status 1 (its error is above)"
