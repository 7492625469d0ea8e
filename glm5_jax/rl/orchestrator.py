"""The trainer's orchestrator: which orders to issue, to which worker, and when.

State, rebuilt from the run directory at start (`orders` module docstring) and then kept in
memory: the issued orders, the router's pins (orders without an answer yet) and the count of
orders whose rollout was rejected or quarantined (`rejected`, from the trainer's checkpoint).

Admission control (`issue`): AReaL's capacity rule (`staleness.RolloutCapacity`) in groups,
b = `rl.prompts_per_step` groups per train step, s = `rl.max_staleness`: new orders are issued
only while

    live < (v + s + 1) * b,     live = issued - rejected (accepted + still running)

and never beyond the `rl.steps * b` groups the run trains on. Slow (long) rollouts therefore
are never dropped for being slow: the bound holds back NEW orders instead, so at most s versions
separate a group's policy from the trainer's when the trainer consumes in order.

Routing (`routing.Router`): each new order id is placed by consistent hashing with bounded
loads (a worker holding more than (1 + eps) x the mean of the running orders passes it on) and
pinned until its rollout file arrives (`settle`). Only regular workers receive orders; an order
its worker handed to a long-tail worker (`long_tail`) leaves its worker's load when the
hand-off file appears, and stays running until its rollout file arrives.
"""

from glm5_jax.rl import long_tail
from glm5_jax.rl import orders as orders_lib
from glm5_jax.rl.routing import Router


class Orchestrator:
  """Issues and tracks orders for one run directory.

  Args:
    root: the run directory (`layout.RunDirs.root`).
    workers: the names of the workers that receive orders (the regular ones; their order
      files name them).
    groups_per_step: b.
    max_staleness: s.
    total_steps: `rl.steps` (no order beyond `total_steps * b` live groups).
    group_size: samples per order.
    rejected: orders rejected or quarantined so far (from the trainer's checkpoint).
  """

  def __init__(self, root, workers, *, groups_per_step: int, max_staleness: int,
               total_steps: int, group_size: int, rejected: int = 0):
    self.root = root
    self.b, self.s, self.total_steps, self.group_size = (groups_per_step, max_staleness,
                                                         total_steps, group_size)
    self.rejected = rejected
    self.orders = orders_lib.read_orders(root)
    self.next_id, self.next_task = orders_lib.next_ids(self.orders)
    self.requeued = orders_lib.requeued_files(self.orders)
    self.router = Router(list(workers))
    answers = orders_lib.answered(root)
    self._running = {}  # rollout file name -> order
    self.moved = {}  # rollout file name -> long-tail worker, of the running orders handed off
    handed = long_tail.handed_off(root)
    for order in orders_lib.outstanding(self.orders, answers):
      if order.worker not in self.router.workers:
        raise ValueError(f"{root}: order {order.name} is addressed to worker {order.worker!r}, "
                         f"not one of this run's workers that receive orders (the regular ones) "
                         f"{self.router.workers}; "
                         "restart with the same --rollout_workers and "
                         "rl.long_tail.worker_share")
      if order.rollout_name in handed:
        self._running[order.rollout_name] = order
        self.moved[order.rollout_name] = handed[order.rollout_name]
      else:
        self._pin(order)

  def _pin(self, order) -> None:
    self.router.pin(str(order.id), order.worker)  # it stays where its work already is
    self._running[order.rollout_name] = order

  @property
  def running(self) -> int:
    return len(self._running)

  @property
  def live(self) -> int:
    return len(self.orders) - self.rejected

  def capacity(self, version: int) -> int:
    """How many orders may be issued at trainer version `version` (the module docstring)."""
    bound = min((version + self.s + 1) * self.b, self.total_steps * self.b)
    return max(bound - self.live, 0)

  def _issue(self, task: int, version: int, requeue_of: str = "") -> orders_lib.Order:
    worker = self.router.assign(str(self.next_id))
    order = orders_lib.Order(self.next_id, worker, task, self.group_size, version, requeue_of)
    orders_lib.write_order(self.root, order)
    self.orders.append(order)
    self._running[order.rollout_name] = order
    self.next_id += 1
    return order

  def issue(self, version: int) -> list:
    """Issues the new train tasks the capacity rule allows at `version`; returns the orders."""
    return [self._issue(self._take_task(), version) for _ in range(self.capacity(version))]

  def _take_task(self) -> int:
    self.next_task += 1
    return self.next_task - 1

  def settle(self, answers, handed=None) -> None:
    """Unpins the orders whose rollout files (`answers`: names) have arrived, or which their
    worker handed off (`handed`: {rollout file name: long-tail worker}); forgets the answered."""
    for name in sorted(set(handed or {}) & set(self._running) - set(self.moved)):
      self.moved[name] = handed[name]
      self.router.release(str(self._running[name].id))
    for name in set(answers) & set(self._running):
      order = self._running.pop(name)
      if self.moved.pop(name, None) is None:
        self.router.release(str(order.id))

  def order_of(self, rollout_name: str) -> orders_lib.Order | None:
    for order in reversed(self.orders):
      if order.rollout_name == rollout_name:
        return order
    return None

  def requeue(self, rollout_name: str, version: int) -> orders_lib.Order | None:
    """The rollout `rollout_name` was rejected (too stale) or quarantined: counts it and issues
    its task again under a fresh id, unless a previous life of the trainer already did (then
    returns None). The re-queue replaces the rejected group, so `live` is unchanged."""
    self.rejected += 1
    if rollout_name in self.requeued:
      return None
    old = self.order_of(rollout_name)
    if old is None:
      raise ValueError(f"{self.root}: rollout file {rollout_name} answers no issued order")
    self.requeued.add(rollout_name)
    return self._issue(old.task, version, requeue_of=rollout_name)
