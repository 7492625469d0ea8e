"""Rollout orders from the trainer to the workers: which task, on which worker, under which id.

The trainer is the orchestrator. Each GRPO group (one train task, `rl.group_size` samples) is
one ORDER, a small JSON file `<workdir>/orders/<id>-<worker>.json` (`write_order`: atomic, see
`glm5_jax.files.write_atomic`), and one answer: the rollout file `<workdir>/rollouts/<id>-<worker>.npz`
(`trajectories.write_batch` with batch_index = id). The order id is the rollout id: the
router pins it to the worker named in the file (consistent hashing, `routing.Router`), and that
worker plays every turn of it with the rollout's cache kept between turns.

Everything the orchestrator needs to know survives on disk, so a restarted trainer rebuilds it
from the directory instead of from a checkpoint (which may be older than the newest orders):
  * issued orders: the order files (never deleted during a run);
  * running: orders without a rollout file, in `rollouts/` or its quarantine;
  * the next id: 1 + the highest id issued; the next train task: 1 + the highest task index of
    an order that is not a re-queue.
An order whose rollout was rejected (too stale, or its file damaged) is RE-QUEUED: the same
task under a fresh id, with `requeue_of` naming the rejected file. Re-queuing is idempotent
(`requeued_files`): a trainer restarted from an older checkpoint rejects the same file again
and finds its re-queue already issued.

A restarted worker simply continues: its outstanding orders are those files without an answer,
in id order, so a worker killed mid-batch answers the same orders again and nothing is lost.
"""

import dataclasses
import json
import re

from etils import epath

from glm5_jax.rl import trajectories
from glm5_jax.files import write_atomic

ORDERS = "orders"
_NAME = re.compile(r"^(\d{10})-([A-Za-z0-9_]+)\.json$")


@dataclasses.dataclass(frozen=True)
class Order:
  """One rollout group: `task` (a train-split task index of `rl.env`) played `group_size` times
  by `worker`. `issued_version`: the trainer's policy version when it was issued;
  `requeue_of`: the rollout file name this order replaces ("" for a new task)."""
  id: int
  worker: str
  task: int
  group_size: int
  issued_version: int
  requeue_of: str = ""

  @property
  def name(self) -> str:
    return f"{self.id:010d}-{self.worker}.json"

  @property
  def rollout_name(self) -> str:
    return trajectories.batch_name(self.worker, self.id)


def write_order(workdir, order: Order) -> None:
  """Writes `order` (atomically). Raises FileExistsError when its id was issued before."""
  directory = epath.Path(workdir) / ORDERS
  directory.mkdir(parents=True, exist_ok=True)
  trajectories.batch_name(order.worker, order.id)  # validates worker name and id
  if any(p.name.startswith(f"{order.id:010d}-") for p in directory.iterdir()):
    raise FileExistsError(f"{directory}: order id {order.id} was already issued")
  write_atomic(directory / order.name, json.dumps(dataclasses.asdict(order)))


def read_orders(workdir) -> list[Order]:
  """Every order issued in `workdir`, by id. Raises ValueError naming a damaged order file (they
  are written atomically, so one is damaged only by hand)."""
  directory = epath.Path(workdir) / ORDERS
  out = []
  for p in directory.iterdir() if directory.exists() else ():
    m = _NAME.match(p.name)
    if not m:
      continue
    try:
      order = Order(**json.loads(p.read_text()))
    except (ValueError, TypeError) as e:
      raise ValueError(f"{p}: not a rollout order ({e})") from e
    if order.name != p.name:
      raise ValueError(f"{p}: its contents name order {order.name}")
    out.append(order)
  return sorted(out, key=lambda o: o.id)


def answered(workdir) -> set[str]:
  """Names of the rollout files written so far (quarantined ones included)."""
  rollouts = epath.Path(workdir) / "rollouts"
  out = set()
  for d in (rollouts, rollouts / trajectories.QUARANTINE):
    out.update(p.name for p in (d.iterdir() if d.exists() else ()) if p.name.endswith(".npz")
               and not p.name.startswith("."))
  return out


def outstanding(orders, answers: set[str], worker: str | None = None) -> list[Order]:
  """The orders (of `worker`, or all) with no rollout file yet, by id."""
  return [o for o in orders if o.rollout_name not in answers
          and (worker is None or o.worker == worker)]


def next_ids(orders) -> tuple[int, int]:
  """(next order id, next new train task index) after `orders`."""
  new_tasks = [o.task for o in orders if not o.requeue_of]
  return (max((o.id for o in orders), default=-1) + 1, max(new_tasks, default=-1) + 1)


def requeued_files(orders) -> set[str]:
  return {o.requeue_of for o in orders if o.requeue_of}


def outstanding_for(workdir, worker: str, handed=()) -> list[Order]:
  """`worker`'s orders with no rollout file yet, by id, except those handed to a long-tail
  worker (`handed`: their rollout file names, `long_tail.handed_off`): only their files are
  parsed (a worker polls this often, while the orders of a long run number thousands)."""
  directory = epath.Path(workdir) / ORDERS
  answers = answered(workdir) | set(handed)
  out = []
  for p in directory.iterdir() if directory.exists() else ():
    m = _NAME.match(p.name)
    if m and m.group(2) == worker and f"{m.group(1)}-{worker}.npz" not in answers:
      order = Order(**json.loads(p.read_text()))
      out.append(order)
  return sorted(out, key=lambda o: o.id)
