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
  3. one RL step on them, the synchronous loop's update (`posttrain.rl_update.update`): GRPO
     group advantages, the double-sided IS loss against the rollout log-probs
     (`rl.policy_loss="auto"` -> "is"; no pi_old recompute); with `rl.routing_replay` the
     files carry each token's MoE experts and DSA top-k from the engine and the step's
     forward replays them (`glm5_jax.routing_replay`);
  4. checkpoint v + 1: the state, and in the same orbax step the ledger of consumed files, the
     staleness counts and the rejected files (`rl_run.save`'s `extra`), committed before
  5. publishing v + 1 (`param_sync.PolicyPublisher`, async save + marker). So every published
     version is a checkpointed one: a trainer killed at any point resumes from its newest
     checkpoint at a version >= every published one, and every rollout file carries versions
     the resumed trainer has reached. Files consumed after that checkpoint are pending again
     and are trained on once in the surviving history: nothing lost, nothing counted twice.

Restart repair: a file in the quarantine that the restored ledger does not know (the trainer
was killed after moving it and before a checkpoint recorded it) is recorded and its task
re-queued at start; left alone it would count as a live order that never arrives.

The start (`rl_run.start_run`: restore or start from `rl.init_from`), the step's record and the
run's summary are the synchronous loop's too (`glm5_jax.posttrain.rl_run`). The lock,
checkpoints (`ckpt.restore_fallback` included), SIGTERM (stop after the current step, whose
checkpoint every step commits anyway; exit 75 from experiments/rl.py) and metrics come from
the run harness every loop shares (`glm5_jax.train.harness`).

Held-out evaluation (greedy and sampled, `rl_run.HeldOutEval`) runs in the trainer every
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
from glm5_jax.posttrain import rl_run, rl_update, tasks
from glm5_jax.posttrain.rl_config_checks import validate_rl_experiment
from glm5_jax.posttrain.rollout import Sample
from glm5_jax.rl import orders as orders_lib
from glm5_jax.rl import long_tail, staleness, trajectories
from glm5_jax.rl.layout import RunDirs, read_json, write_json
from glm5_jax.rl.orchestrator import Orchestrator
from glm5_jax.rl.param_sync import PolicyPublisher
from glm5_jax.sharding import activation_sharding
from glm5_jax.train.harness import RunHarness


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
  # Every step is checkpointed, synchronously: each published version is a committed one.
  with rl_run.open_run(config, root, "asynchronous RL trainer",
                       stop_after_steps=stop_after_steps, every_steps=1,
                       async_save=False) as run:
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
  require(jax.process_count() == 1 or not config.rl.eval_every_steps, "rl.eval_every_steps",
          f"must be 0 with a trainer of {jax.process_count()} processes: held-out evaluation "
          "runs the inference engine, which is single-process (evaluate the published "
          "versions from one process instead)")
  start = rl_run.start_run(config, run, initial_params, asynchronous=True)
  trainer = _AsyncRun(config, dirs, workers, run, start)
  with activation_sharding(start.trainer.mesh, config.mesh.logical_axis_rules):
    stop = trainer.train()
  return trainer.finish(stop)


class _AsyncRun:
  """One call's trainer (module docstring): the RL run (`rl_run.Start`), the books a checkpoint
  carries (consumed files, staleness counts, rejected files), the publisher and, on process 0,
  the orchestrator and the intake."""

  def __init__(self, config, dirs: RunDirs, workers, run: RunHarness, start: rl_run.Start):
    self.config, self.rl, self.dirs, self.run, self.start = config, config.rl, dirs, run, start
    self.primary = jax.process_index() == 0
    # Several processes publish synchronously: the marker is then written (by process 0)
    # before publish returns on every process, with no pending save to agree on.
    self.single = jax.process_count() == 1
    self.state, self.version = start.state, start.step
    self.ledger, self.admission, self.rejected = _restore_books(self.rl, start.extra)
    self.stats = self._count_start()
    self.eval_seconds_before = self.stats["eval_seconds"]  # of earlier calls
    self.publisher = self._open_publisher()
    self.orch, self.intake = self._orchestrate(workers) if self.primary else (None, None)
    self.published = self.version  # the newest version whose marker is written
    self.held_out = rl_run.HeldOutEval(config, run, start)

  def _count_start(self) -> dict:
    """The trainer's counters, carried over restarts (a killed trainer loses only those since
    its last step), with this start counted."""
    stats = {"idle_seconds": 0.0, "busy_seconds": 0.0, "eval_seconds": 0.0, "starts": 0,
             **(read_json(self.dirs.trainer_stats) or {})}
    stats.update(pid=os.getpid(), version=self.version, starts=stats["starts"] + 1)
    if self.primary:
      write_json(self.dirs.trainer_stats, stats)
    return stats

  def _open_publisher(self) -> PolicyPublisher:
    """The publisher, closed with the run; the starting version published unless it is."""
    publisher = PolicyPublisher(self.dirs.policy, keep=self.rl.policy_keep,
                                async_save=self.single)
    self.run.on_close(publisher.close)
    if agree(self.version not in publisher.published_versions() if self.primary else None):
      publisher.publish(self.version, self.state.params, block=True,
                        extra={"step": self.version})
      logging.info("published policy version %d", self.version)
    return publisher

  def _orchestrate(self, workers) -> tuple[Orchestrator, "_Intake"]:
    rl = self.rl
    regular, _ = long_tail.split_workers(workers, rl.long_tail.worker_share)
    orch = Orchestrator(self.dirs.root, regular, groups_per_step=rl.prompts_per_step,
                        max_staleness=rl.max_staleness, total_steps=rl.steps,
                        group_size=rl.group_size,
                        rejected=len(self.rejected) + len(self.ledger.quarantined))
    return orch, _Intake(self.config, self.dirs, orch, self.ledger, self.version)

  def train(self) -> str | None:
    """Steps until `rl.steps` (or a stop); returns the stop reason, None at the end."""
    if self.primary:
      self.orch.issue(self.published)
    self.held_out.at_start(self.version, self.state.params)
    wait_start = time.time()
    while self.version < self.rl.steps:
      plan = self._next_plan()
      if not plan["take"]:
        if self.run.signalled():  # its last step is committed already (every step is)
          logging.warning("asynchronous RL trainer stopped early (SIGTERM) while waiting for "
                          "rollouts at step %d of %d; rerun to resume", self.version,
                          self.rl.steps)
          return "SIGTERM"
        time.sleep(self.rl.poll_seconds)
        continue
      self._step(plan, wait_start)
      wait_start = time.time()
      stop = self.run.stop_reason(self.version)
      if stop:
        self.run.stopped(self.version, stop)
        return stop
    return None

  def _next_plan(self) -> dict:
    """Process 0's plan (`_Intake.plan`) on every process, its quarantined and rejected files
    recorded in the books; raises `TrainerStalledError` when it says so."""
    if self.primary and self.single:
      self.published = self.publisher.poll() or self.published
    plan = agree(self.intake.plan(self.version, self.published) if self.primary else None)
    for name, error in plan["quarantined"].items():
      self.ledger.quarantined.setdefault(name, error)
    for name, gaps, limit in plan["reject"]:
      for gap in gaps:
        self.admission.admit(gap, limit)
      self.ledger.mark_consumed(name)
      self.rejected.append(name)
    if plan["stalled"]:
      raise TrainerStalledError(plan["stalled"])
    return plan

  def _step(self, plan: dict, wait_start: float) -> None:
    """One RL step on the plan's groups, then its checkpoint, publication and record."""
    waited = time.time() - wait_start
    self.stats["idle_seconds"] += waited
    t0 = time.time()
    samples, step_gaps, moved = self._take(plan["take"])
    self.state, signal, metrics = rl_update.update(
        self.config, self.start.trainer, self.state, samples, self.start.env,
        step=self.version, reference=self.start.reference)
    self.version += 1
    self._commit([name for name, _ in plan["take"]])
    self.stats["busy_seconds"] += time.time() - t0
    self._write_stats()
    # Trainer idle = waiting for admissible groups; step = wall time from the end of the
    # previous step (or the start) to this step's publish: idle + train + save + publish.
    record = rl_run.step_record(self.config, samples, signal, metrics, {
        "generate_seconds": waited, "train_seconds": time.time() - t0,
        "version_gap_mean": float(np.mean(step_gaps)), "trainer/idle_seconds": waited,
        "trainer/step_seconds": time.time() - wait_start,
        "long_tail/groups_handed_off": float(moved), **self.admission.metrics()})
    if self.primary:
      record.update(orders_running=self.orch.running, rejected_total=self.orch.rejected,
                    **{"long_tail/handoffs_total": float(len(self.intake.handed))})
      logging.info(rl_run.progress_line(self.version, self.rl.steps, record)
                   .replace("gen ", "wait ")
                   + f" | gap {record['version_gap_mean']:.2f} running {self.orch.running}")
    self.run.writer.write(self.version, record)
    self.held_out.after_step(self.version, self.state.params)
    if self.primary:
      self.intake.progressed()

  def _take(self, take: list) -> tuple[list, list, int]:
    """`(samples, version gaps, groups handed off)` of the plan's groups, each admitted."""
    samples, step_gaps, moved = [], [], 0
    for group, (name, gaps) in enumerate(take):
      for gap in gaps:
        self.admission.admit(gap)
      step_gaps += gaps
      batch = self.intake.batch(name) if self.primary else \
          trajectories.read_batch(self.dirs.rollouts / name)
      moved += bool(batch.records and batch.records[0].meta.get("handed_off_to"))
      samples += _to_samples(batch, self.start.env, group)
    return samples, step_gaps, moved

  def _commit(self, consumed: list) -> None:
    """Checkpoint the new version with the books, committed before it is published."""
    self.ledger.mark_consumed(consumed)
    rl_run.save(self.run, self.state, self.config, extra={
        "ledger": self.ledger.to_json(), "admission": self.admission.to_json(),
        "rejected": self.rejected})
    self.run.manager.wait_until_finished()
    self.publisher.publish(self.version, self.state.params, block=not self.single,
                           extra={"step": self.version})
    if not self.single:
      self.published = self.version

  def _write_stats(self) -> None:
    self.stats["version"] = self.version
    self.stats["eval_seconds"] = self.eval_seconds_before + self.held_out.seconds
    if self.primary:
      write_json(self.dirs.trainer_stats, self.stats)

  def finish(self, stop: str | None) -> dict:
    """Waits for the last publication, marks the run done at `rl.steps`; the summary."""
    self.publisher.wait()
    if self.version >= self.rl.steps and self.primary:
      write_json(self.dirs.done, {"version": self.version})
    busy, idle = self.stats["busy_seconds"], self.stats["idle_seconds"]
    return rl_run.summary(
        self.config, self.run, steps=self.version, stop=stop, evals=self.held_out.evals,
        staleness=self.admission.to_json(), rejected=len(self.rejected),
        requeued=len(self.orch.requeued) if self.primary else None,
        quarantined=len(self.ledger.quarantined), versions_published=self.version + 1,
        orders=len(self.orch.orders) if self.primary else None,
        idle_fraction=idle / max(idle + busy, 1e-9))


def _restore_books(rl, extra: dict):
  """`(ledger, admission, rejected)` from a checkpoint's `extra`, or fresh ones."""
  ledger = trajectories.TrajectoryLedger.from_json(extra["ledger"]) if extra else \
      trajectories.TrajectoryLedger()
  admission = staleness.StalenessAdmission.from_json(extra["admission"]) if extra else \
      staleness.StalenessAdmission(rl.max_staleness)
  admission.max_staleness = rl.max_staleness
  return ledger, admission, list(extra.get("rejected", []))
