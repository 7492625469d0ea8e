"""The asynchronous RL trainer: consumes rollout files, trains, publishes policy versions.

It runs in its own process(es) on its own mesh (`config.mesh`); the rollout workers
(`glm5_jax.rl.worker`) are other processes sharing only the run directory (`layout`). Loop,
at policy version v (= RL steps done):

  1. orchestrate: note the rollout files that arrived, issue new orders within the capacity
     rule at the newest version whose marker is written (an order issued before its version
     is visible would be generated with the one before) and route them
     (`orchestrator.Orchestrator`);
  2. take, in file-name order (order id), the next `rl.prompts_per_step` groups whose samples
     pass staleness admission (v - oldest token version <= `rl.max_staleness`,
     `staleness.StalenessAdmission`); a group that fails is not trained on: it is counted,
     marked consumed and its task re-queued under a fresh id. A damaged file is quarantined
     and its task re-queued. Too few groups: wait `rl.poll_seconds` (idle time); nothing
     moving (no step, no rollout file arriving) for `rl.stall_seconds` is an error naming the
     orders waited for (`TrainerStalledError`);
  3. one RL step on them: GRPO group advantages, the double-sided IS loss against the
     rollout log-probs (`rl.policy_loss="auto"` -> "is"; no pi_old recompute); with
     `rl.routing_replay` the files carry each token's MoE experts and DSA top-k from the
     engine and the step's forward replays them (`glm5_jax.routing_replay`);
  4. checkpoint v + 1: the state, and in the same orbax step the ledger of consumed files, the
     staleness counts and the rejected files (`loop.save`'s `extra`), committed before
  5. publishing v + 1 (`param_sync.PolicyPublisher`, async save + marker). So every published
     version is a checkpointed one: a trainer killed at any point resumes from its newest
     checkpoint at a version >= every published one, and every rollout file carries versions
     the resumed trainer has reached. Files consumed after that checkpoint are pending again
     and are trained on once in the surviving history: nothing lost, nothing counted twice.

Restart repair: a file in the quarantine that the restored ledger does not know (the trainer
was killed after moving it and before a checkpoint recorded it) is recorded and its task
re-queued at start; left alone it would count as a live order that never arrives.

The lock, checkpoints (`ckpt.restore_fallback` included), SIGTERM (stop after the current
step, whose checkpoint every step commits anyway; exit 75 from experiments/rl.py) and metrics
come from the run harness every loop shares (`glm5_jax.train.harness`).

Held-out evaluation (greedy and sampled, `loop.evaluate`) runs in the trainer every
`rl.eval_every_steps`, as in the synchronous loop; the workers keep generating meanwhile.
When v reaches `rl.steps` the trainer writes `control/done` and the workers exit.
"""

import json
import os
import time

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from glm5_jax.config import require
from glm5_jax.posttrain import loop, rollout, tasks
from glm5_jax.posttrain.rl_config_checks import validate_rl_experiment
from glm5_jax.posttrain.rollout import Sample
from glm5_jax.rl import orders as orders_lib
from glm5_jax.rl import long_tail, staleness, trajectories
from glm5_jax.rl.layout import RunDirs, read_json, write_json
from glm5_jax.rl.orchestrator import Orchestrator
from glm5_jax.rl.param_sync import PolicyPublisher
from glm5_jax.sharding import activation_sharding
from glm5_jax.train.harness import RunHarness, check_finite


def validate_async_experiment(config) -> None:
  """`validate_rl_experiment` plus what the asynchronous loop needs (ConfigError naming the
  field)."""
  validate_rl_experiment(config)
  require(config.rl.loss == "grpo", "rl.loss",
          f"the asynchronous loop trains GRPO; got {config.rl.loss!r} (run distillation with "
          "--mode=sync)")
  require(config.ckpt.every_steps == 1, "ckpt.every_steps",
          f"must be 1 in the asynchronous loop (each published policy version is a committed "
          f"checkpoint, so a restarted trainer never lags its workers), got "
          f"{config.ckpt.every_steps}")


def worker_names(n: int) -> list[str]:
  if n < 1:
    raise ValueError(f"--rollout_workers={n}: expected >= 1")
  return [f"w{i}" for i in range(n)]


def _to_samples(batch: trajectories.TrajectoryBatch, env, group: int) -> list:
  out = []
  for r in batch.records:
    out.append(Sample(task=env.task(int(r.meta["task"]), "train"), group=group, tokens=r.tokens,
                      rollout_logp=r.logp, loss_mask=r.loss_mask, reward=r.reward,
                      correct=bool(r.meta.get("correct", False)), turns=int(r.meta["turns"]),
                      messages=[], info={"truncated": r.meta.get("truncated", False),
                                         **({"reasoning_ok": r.meta["reasoning_ok"]}
                                            if "reasoning_ok" in r.meta else {})},
                      routing=r.routing))
  return out


def run_async_trainer(config, root, workers, *, stop_after_steps: int | None = None,
                      params=None) -> dict:
  """Trains asynchronously in the run directory `root` (module docstring), resuming from its
  newest checkpoint, with rollouts from `workers` (names; started elsewhere).

  Args:
    stop_after_steps: stop after this many steps of this call (checkpointed and published),
      as a job time limit would; a later call resumes.
    params: the starting params when `root` has no checkpoint, instead of `rl.init_from`.
  Returns:
    `steps`, `total_steps`, `eval` ({step: held-out metrics}), `first_eval` / `last_eval`,
    `first_sampled_eval` / `last_sampled_eval`, `staleness` (counts and the gap histogram),
    `rejected`, `requeued`, `quarantined`, `versions_published`, `idle_fraction`,
    `metrics_file`, `stopped_early`, `stop_reason`.
  Raises:
    TrainerStalledError: no progress for `rl.stall_seconds` (the message names what is
      missing).
  """
  validate_async_experiment(config)
  loop.hide_run_from_sandbox(config, root)
  # Every step is checkpointed, synchronously: each published version is a committed one.
  with RunHarness(str(root), "asynchronous RL trainer", config.ckpt, total_steps=config.rl.steps,
                  stop_after_steps=stop_after_steps, every_steps=1, async_save=False) as run:
    return _run(config, RunDirs.at(root), list(workers), run, params)


def agree(plan):
  """Process 0's `plan` (JSON-able) on every process; with one process, `plan` itself. A
  collective: every process calls it (the others pass None)."""
  if jax.process_count() == 1:
    return plan
  primary = jax.process_index() == 0
  data = np.frombuffer(json.dumps(plan).encode(), np.uint8) if primary else None
  size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data) if primary else 0)))
  data = multihost_utils.broadcast_one_to_all(data if primary else np.zeros(size, np.uint8))
  return json.loads(np.asarray(data).tobytes().decode())


class TrainerStalledError(RuntimeError):
  """The asynchronous trainer made no progress for `rl.stall_seconds`; the message names what
  it waits for."""


class _Intake:
  """Process 0's side of each iteration: orders, reading and judging the rollout files. Its
  `plan` names what every process then applies (`agree`): files quarantined (unreadable),
  rejected (too stale: their gaps) and taken for the next step (their gaps; empty until
  `rl.prompts_per_step` admissible groups are there)."""

  def __init__(self, config, dirs, orch, ledger, version: int):
    self.rl, self.dirs, self.orch, self.ledger = config.rl, dirs, orch, ledger
    self.read = {}  # rollout file name -> TrajectoryBatch, read and not yet trained or rejected
    self.answers = set()
    self.handed = {}  # rollout file name -> long-tail worker, of every hand-off so far
    self.last_progress = time.time()
    self.repaired = self._repair_quarantine(version)

  def _repair_quarantine(self, version: int) -> dict:
    """Files in the quarantine that the restored ledger does not know: an earlier trainer was
    killed after moving them there and before a checkpoint recorded them (and maybe before
    their re-queue order was written). Unrepaired, they count as live orders that never
    arrive, and the run waits forever at its last step. Recorded (in the first plan) and
    re-queued (idempotent) now."""
    out = {}
    for name in sorted(trajectories.quarantined_names(self.dirs.rollouts)
                       - set(self.ledger.quarantined)):
      out[name] = ("found in the quarantine at restart (an earlier trainer moved it there "
                   "before its checkpoint recorded it)")
      again = self.orch.requeue(name, version)
      logging.warning("rollout %s: %s; its task is re-queued as %s", name, out[name],
                      again.name if again else "(already re-queued)")
    return out

  def progressed(self) -> None:
    self.last_progress = time.time()

  def plan(self, version: int, published: int) -> dict:
    rl, orch = self.rl, self.orch
    answers = orders_lib.answered(self.dirs.root)
    if answers != self.answers:  # a rollout file arrived
      self.answers = answers
      self.progressed()
    self.handed = long_tail.handed_off(self.dirs.root)
    orch.settle(answers, self.handed)
    # New orders wait for the marker of the version they are meant for: issued earlier, a
    # worker would still generate them with the one before.
    orch.issue(published)
    quarantined, self.repaired = self.repaired, {}
    for name in trajectories.pending(self.dirs.rollouts, self.ledger):
      if name not in self.read:
        try:
          self.read[name] = trajectories.read_batch(self.dirs.rollouts / name)
        except trajectories.CorruptTrajectoryError as e:
          trajectories.quarantine(self.dirs.rollouts, name, self.ledger, e)
          quarantined[name] = str(e)
          orch.requeue(name, version)
    take, reject = [], []
    for name in sorted(self.read):
      if len(take) == rl.prompts_per_step:
        break
      records = self.read[name].records
      gaps = [staleness.version_gap(r.versions, r.loss_mask, version) for r in records]
      # A task mixture's task may be stricter than the run (rl.tasks.<env>.max_staleness).
      env_name = records[0].meta.get("env") if records else None
      limit = tasks.staleness_limit(rl, env_name)
      if max(gaps, default=0) > limit:
        reject.append([name, gaps, limit])
        del self.read[name]
        again = orch.requeue(name, version)
        logging.info("rollout %s (%s) is %d versions old (staleness limit %d): not trained on; "
                     "task re-queued as %s", name, env_name, max(gaps), limit,
                     again.name if again else "(already re-queued)")
        continue
      take.append([name, gaps])
    if len(take) < rl.prompts_per_step:
      take = []
    if take or reject or quarantined:
      self.progressed()
    stalled = None
    if not take and rl.stall_seconds and time.time() - self.last_progress > rl.stall_seconds:
      stalled = self.stall_message(version, published, answers)
    return {"quarantined": quarantined, "reject": reject, "take": take, "stalled": stalled}

  def stall_message(self, version: int, published: int, answers) -> str:
    """What the trainer waits for, when nothing has moved for `rl.stall_seconds`."""
    rl, orch = self.rl, self.orch
    waiting = {}
    for order in orders_lib.outstanding(orch.orders, answers):
      waiting.setdefault(orch.moved.get(order.rollout_name, order.worker), []).append(order.id)
    what = (f"rollouts of outstanding orders {waiting} (see the workers' logs, "
            f"{self.dirs.root}/logs, and {self.dirs.workers})" if waiting else
            f"no order is outstanding and none may be issued (live orders {orch.live}, "
            f"rejected {orch.rejected}, capacity {orch.capacity(published)} at published "
            f"version {published}): the run directory's orders and the checkpoint's ledger "
            "disagree")
    return (f"asynchronous RL trainer: no progress for {rl.stall_seconds:g} s "
            f"(rl.stall_seconds) at version {version} of {rl.steps}: it needs "
            f"{rl.prompts_per_step} admissible rollout groups and has {len(self.read)} read; "
            f"waiting for {what}")

  def batch(self, name: str) -> trajectories.TrajectoryBatch:
    return self.read.pop(name)


def _run(config, dirs: RunDirs, workers, run: RunHarness, initial_params):
  rl = config.rl
  primary = jax.process_index() == 0
  require(jax.process_count() == 1 or not rl.eval_every_steps, "rl.eval_every_steps",
          f"must be 0 with a trainer of {jax.process_count()} processes: held-out evaluation "
          "runs the inference engine, which is single-process (evaluate the published "
          "versions from one process instead)")
  tokenizer, env, shapes, t = loop.build_rl_run(config, asynchronous=True)
  writer = run.writer
  state, extra, reference = loop.init_or_restore(config, run, t, shapes, initial_params)
  ledger = trajectories.TrajectoryLedger.from_json(extra["ledger"]) if extra else \
      trajectories.TrajectoryLedger()
  admission = staleness.StalenessAdmission.from_json(extra["admission"]) if extra else \
      staleness.StalenessAdmission(rl.max_staleness)
  admission.max_staleness = rl.max_staleness
  rejected = list(extra.get("rejected", []))
  version = int(state.step) // rl.minibatches
  # Counters carried over restarts (a killed trainer loses only those since its last step).
  stats = {"idle_seconds": 0.0, "busy_seconds": 0.0, "eval_seconds": 0.0, "starts": 0,
           **(read_json(dirs.trainer_stats) or {})}
  stats.update(pid=os.getpid(), version=version, starts=stats["starts"] + 1)
  if primary:
    write_json(dirs.trainer_stats, stats)
  # Several processes publish synchronously: the marker is then written (by process 0) before
  # publish returns on every process, with no pending save to agree on.
  single = jax.process_count() == 1
  publisher = PolicyPublisher(dirs.policy, keep=rl.policy_keep, async_save=single)
  run.on_close(publisher.close)
  if agree(version not in publisher.published_versions() if primary else None):
    publisher.publish(version, state.params, block=True, extra={"step": version})
    logging.info("published policy version %d", version)
  regular, _ = long_tail.split_workers(workers, rl.long_tail.worker_share)
  orch = Orchestrator(dirs.root, regular, groups_per_step=rl.prompts_per_step,
                      max_staleness=rl.max_staleness, total_steps=rl.steps,
                      group_size=rl.group_size,
                      rejected=len(rejected) + len(ledger.quarantined)) if primary else None
  intake = _Intake(config, dirs, orch, ledger, version) if primary else None
  published = version  # the newest version whose marker is written
  evals, stop = {}, None
  with activation_sharding(t.mesh, config.mesh.logical_axis_rules):
    if primary:
      orch.issue(published)
    if version == 0 and rl.eval_every_steps:
      evals[0] = _timed_eval(config, state.params, env, tokenizer, writer, 0, stats)
    wait_start = time.time()
    while version < rl.steps:
      if primary and single:
        published = publisher.poll() or published
      plan = agree(intake.plan(version, published) if primary else None)
      for name, error in plan["quarantined"].items():
        ledger.quarantined.setdefault(name, error)
      for name, gaps, limit in plan["reject"]:
        for gap in gaps:
          admission.admit(gap, limit)
        ledger.mark_consumed(name)
        rejected.append(name)
      if plan["stalled"]:
        raise TrainerStalledError(plan["stalled"])
      if not plan["take"]:
        if run.signalled():  # its last step is committed already (every step is)
          stop = "SIGTERM"
          logging.warning("asynchronous RL trainer stopped early (SIGTERM) while waiting for "
                          "rollouts at step %d of %d; rerun to resume", version, rl.steps)
          break
        time.sleep(rl.poll_seconds)
        continue
      waited = time.time() - wait_start
      stats["idle_seconds"] += waited
      t0 = time.time()
      samples, step_gaps, moved = [], [], 0
      for group, (name, gaps) in enumerate(plan["take"]):
        for gap in gaps:
          admission.admit(gap)
        step_gaps += gaps
        batch = intake.batch(name) if primary else \
            trajectories.read_batch(dirs.rollouts / name)
        moved += bool(batch.records and batch.records[0].meta.get("handed_off_to"))
        samples += _to_samples(batch, env, group)
      batch = loop.score(config, samples, step=version)
      signal_metrics = loop.signal_metrics(config, samples, batch, env)
      if reference is not None:
        loop.add_reference_logp(t, reference, batch, signal_metrics, rl.kl_coef > 0)
      state, metrics = loop.train_on_batch(t, state, batch, rl.minibatches)
      check_finite(version + 1, metrics)
      version += 1
      ledger.mark_consumed([name for name, _ in plan["take"]])
      loop.save(run, state, config, extra={
          "ledger": ledger.to_json(), "admission": admission.to_json(), "rejected": rejected})
      run.manager.wait_until_finished()
      publisher.publish(version, state.params, block=not single, extra={"step": version})
      if not single:
        published = version
      stats["busy_seconds"] += time.time() - t0
      stats["version"] = version
      if primary:
        write_json(dirs.trainer_stats, stats)
      # Trainer idle = waiting for admissible groups; step = wall time from the end of the
      # previous step (or the start) to this step's publish: idle + train + save + publish.
      last = {**rollout.rollout_metrics(samples), **signal_metrics, **metrics,
              "generate_seconds": waited,
              "train_seconds": time.time() - t0, "version_gap_mean": float(np.mean(step_gaps)),
              "trainer/idle_seconds": waited, "trainer/step_seconds": time.time() - wait_start,
              "long_tail/groups_handed_off": float(moved), **admission.metrics()}
      if rl.env == tasks.MIXTURE:
        last.update(rollout.metrics_by_env(samples))
      if primary:
        last.update(orders_running=orch.running, rejected_total=orch.rejected,
                    **{"long_tail/handoffs_total": float(len(intake.handed))})
        logging.info(loop.progress_line(version, rl.steps, last).replace("gen ", "wait ")
                     + f" | gap {last['version_gap_mean']:.2f} running {orch.running}")
      writer.write(version, last)
      if run.due(version, rl.eval_every_steps):
        evals[version] = _timed_eval(config, state.params, env, tokenizer, writer, version,
                                     stats)
      if primary:
        intake.progressed()
      wait_start = time.time()
      stop = run.stop_reason(version)
      if stop:
        run.stopped(version, stop)
        break
  publisher.wait()
  if version >= rl.steps and primary:
    write_json(dirs.done, {"version": version})
  busy, idle = stats["busy_seconds"], stats["idle_seconds"]
  first, last_eval = (evals[min(evals)], evals[max(evals)]) if evals else ({}, {})
  return {"steps": version, "total_steps": rl.steps, "stopped_early": stop is not None,
          "stop_reason": stop, "eval": evals,
          "first_eval": first.get("accuracy"), "last_eval": last_eval.get("accuracy"),
          "first_sampled_eval": first.get("sampled_accuracy"),
          "last_sampled_eval": last_eval.get("sampled_accuracy"),
          "staleness": admission.to_json(), "rejected": len(rejected),
          "requeued": len(orch.requeued) if primary else None,
          "quarantined": len(ledger.quarantined), "versions_published": version + 1,
          "orders": len(orch.orders) if primary else None,
          "idle_fraction": idle / max(idle + busy, 1e-9), "metrics_file": writer.path}


def _timed_eval(config, params, env, tokenizer, writer, step, stats) -> dict:
  t0 = time.time()
  out = loop.evaluate_and_log(config, params, env, tokenizer, writer, step)
  stats["eval_seconds"] += time.time() - t0
  return out
