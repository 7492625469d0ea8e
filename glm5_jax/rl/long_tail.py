"""Long-tail hand-off between rollout workers: a group that runs long on a regular worker is
finished by a dedicated long-tail worker, so the regular worker returns to short tasks.

GLM-5's RL infrastructure moves long-tail trajectories to dedicated workers so that short ones
do not wait behind them (docs/reference.md section 4). Here:

Roles (`split_workers`): of the run's rollout workers w0..w(n-1), the last
k = round(`rl.long_tail.worker_share` x n) (at least 1, leaving at least 1) are LONG-TAIL
workers. The orchestrator routes new orders to the regular workers only.

Hand-off. A regular worker plays its generation batch step by step
(`posttrain.handoff.run_turn`); once one of a group's unfinished samples has generated
`rl.long_tail.after_tokens` response tokens, or the batch has run `rl.long_tail.after_seconds`,
it cancels that group's requests and writes, at once, ONE hand-off file
`<root>/handoffs/<to>/<id>-<worker>.npz` (`write_handoff`: the group's G samples as they are,
finished or not: token ids so far, raw log-probs, loss mask, the policy version of every
generated token, and the episode state the environment needs: messages, turns, the tokens of
an unfinished turn; written like a rollout file, atomically and with a checksum). `<to>` is
the long-tail worker with the fewest unanswered hand-offs (ties by a hash of the order id),
`<id>-<worker>.npz` is the name of the order's rollout file. The regular worker then goes on
with the rest of its batch and its next orders.

A long-tail worker serves the hand-offs addressed to it (`pending_for`: those whose rollout
file does not exist yet), up to `rl.worker_groups` at a time: it restores each group's
episodes, continues the unfinished ones with the newest policy it holds (each token keeps the
version that sampled it; the staleness admission uses the oldest, as for any partial rollout)
and writes the whole group as the order's rollout file `<root>/rollouts/<id>-<worker>.npz`
(samples' meta: `handed_off_to`). A damaged hand-off file is logged and its group played again
from its prompt.

Exactly once: the rollout file of an order is written by one process only: its regular worker
when the group was not handed off, else the long-tail worker named by the one hand-off file
(the regular worker never answers an order with a hand-off file: `orders.outstanding_for`
skips it). A regular worker killed before the hand-off file is complete plays the group again
from the start; one killed after it does not touch the group again; a long-tail worker killed
mid-continuation continues it again from the hand-off file. The trainer sees only rollout
files, so its ledger, staleness admission and re-queues are unchanged.
"""

import json

from absl import logging
from etils import epath
import numpy as np

from glm5_jax.config import ConfigError
from glm5_jax.posttrain import rollout
from glm5_jax.rl import trajectories
from glm5_jax.rl.routing import stable_hash

HANDOFFS = "handoffs"


def split_workers(workers, share: float) -> tuple[list, list]:
  """(regular, long-tail) worker names: the last round(share x n) are long-tail (module
  docstring); share 0: all regular. Raises ConfigError naming `rl.long_tail.worker_share` when
  the split leaves no regular worker."""
  workers = list(workers)
  if share <= 0:
    return workers, []
  k = max(1, round(share * len(workers)))
  if k >= len(workers):
    raise ConfigError(f"config.rl.long_tail.worker_share: {share} of {len(workers)} rollout "
                      f"workers leaves no regular worker (it gives {k} long-tail workers); use "
                      "more --rollout_workers or a smaller share")
  return workers[:-k], workers[-k:]


def _dir(root) -> epath.Path:
  return epath.Path(root) / HANDOFFS


def handed_off(root) -> dict:
  """{rollout file name: the long-tail worker it was handed to} of every hand-off written."""
  out = {}
  base = _dir(root)
  for d in base.iterdir() if base.exists() else ():
    for p in d.iterdir() if d.is_dir() else ():
      if p.name.endswith(".npz") and not p.name.startswith("."):
        out[p.name] = d.name
  return out


def pending_for(root, worker: str) -> list[str]:
  """The hand-off file names addressed to `worker` whose rollout file is not written yet, by
  order id."""
  directory = _dir(root) / worker
  rollouts = epath.Path(root) / "rollouts"
  return sorted(p.name for p in (directory.iterdir() if directory.exists() else ())
                if p.name.endswith(".npz") and not p.name.startswith(".")
                and not (rollouts / p.name).exists())


def choose(root, long_tail, order_id: int) -> str:
  """The long-tail worker with the fewest unanswered hand-offs; ties by a hash of the id."""
  return min(long_tail, key=lambda w: (len(pending_for(root, w)),
                                       stable_hash(f"{order_id}#{w}")))


def _state(e, versions) -> trajectories.TrajectoryRecord:
  mask = np.asarray(e.mask, np.float32)
  result = None if e.result is None else [
      e.result[0], e.result[1], json.loads(json.dumps(e.result[2], default=str))]
  meta = {"task": e.task.index, "env": e.task.env, "split": e.task.split, "sample": e.sample,
          "turns": e.turns, "partial": e.partial, "messages": e.messages, "result": result}
  return trajectories.TrajectoryRecord(
      np.asarray(e.tokens, np.int32), np.asarray(e.logp, np.float32) * mask, mask,
      np.asarray(versions, np.int32), 0.0 if e.result is None else float(e.result[0]), meta)


def write_handoff(root, order, to: str, episodes, version: int) -> epath.Path:
  """Writes `order`'s group (`rollout.Episode`s, all generated by policy `version`) for the
  long-tail worker `to` (module docstring)."""
  records = [_state(e, np.where(np.asarray(e.mask) > 0, version, -1)) for e in episodes]
  return trajectories.write_batch(_dir(root) / to, records, worker=order.worker,
                                  batch_index=order.id)


def read_handoff(root, to: str, name: str, env) -> tuple[list, list]:
  """(`rollout.Episode`s of one group, group 0, in sample order; the per-token versions of
  each) from the hand-off file `name` addressed to `to`. Raises CorruptTrajectoryError."""
  batch = trajectories.read_batch(_dir(root) / to / name)
  episodes, versions = [], []
  for r in batch.records:
    m = r.meta
    task = env.task(int(m["task"]), m["split"])
    if task.env != m["env"]:
      raise trajectories.CorruptTrajectoryError(
          f"{name}: task {m['task']} is of env {task.env!r} here, {m['env']!r} in the file "
          "(another run's environments?)")
    e = rollout.Episode(task, 0, int(m["sample"]), [int(t) for t in r.tokens],
                        [float(x) for x in r.logp], [float(x) for x in r.loss_mask],
                        list(m["messages"]), turns=int(m["turns"]), partial=int(m["partial"]))
    if m["result"] is not None:
      e.result = (float(m["result"][0]), bool(m["result"][1]), dict(m["result"][2]))
    episodes.append(e)
    versions.append(np.asarray(r.versions, np.int32))
  return episodes, versions


def continued_versions(before, loss_mask, version: int) -> np.ndarray:
  """int32 [n]: a continued sample's versions: `before` for the ids it was handed over with,
  `version` on the ids generated since (loss mask 1), -1 elsewhere."""
  mask = np.asarray(loss_mask)
  out = np.where(mask > 0, version, -1).astype(np.int32)
  out[:len(before)] = before
  return out


def log_damaged(name: str, error: Exception) -> None:
  logging.warning("hand-off %s is damaged (%s): its group is played again from its prompt",
                  name, error)
