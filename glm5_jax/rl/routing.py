"""DP-aware routing of multi-turn rollouts to rollout workers: consistent hashing with bounded
loads (docs/reference.md section 4).

A rollout's turns should all run on one worker, which keeps the rollout's KV cache between
turns so that the next turn prefills only its new tokens. So the orchestrator pins each rollout
id to a worker (`Router.assign`) until the rollout ends (`Router.release`).

The ring. Each worker is hashed onto a 64-bit ring at `vnodes` points (virtual nodes: with v
points per worker the workers' shares of the ring deviate from 1/n by about 1/sqrt(v)); a key
belongs to the first worker point clockwise from the key's hash (`ring_owner`). Adding a worker
takes over only the arcs before its points (about 1/(n + 1) of the keys, all moving to it);
removing one hands only its own keys to the next points. Hashes are blake2b of the UTF-8 name,
never Python's `hash()` (salted per process), so every process computes the same ring.

Bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA
2018, arXiv 1608.01350). With m rollouts active once the new one is placed and n workers, each
worker's capacity is ceil((1 + eps) * m / n); the new rollout walks clockwise from its hash and
goes to the first worker below capacity, so a worker over (1 + eps) times the average passes
keys on. Since the capacities sum to more than m, the walk always ends. Pinned rollouts are
never moved while their worker lives (moving one throws its cache away), so the bound holds
at each assignment; after many releases a worker can stay above the current bound until its
rollouts end. When a worker is removed, its rollouts are placed again by the same walk.

Hand-written: the algorithm is a few dozen lines, and its state (pins and loads) belongs to
the orchestrator, which must see and restore it.
"""

import bisect
import hashlib
import math


def stable_hash(text: str) -> int:
  """A 64-bit hash of `text`, the same in every process and on every host."""
  return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


class Router:
  """Rollout id -> worker, pinned, by consistent hashing with bounded loads.

  Args:
    workers: the initial worker names (unique strings).
    vnodes: points per worker on the ring.
    eps: the load bound's slack: no worker receives a rollout while it holds
      ceil((1 + eps) * m / n) or more (m active rollouts counting the new one, n workers).
  """

  def __init__(self, workers=(), *, vnodes: int = 128, eps: float = 0.25):
    if vnodes < 1 or eps <= 0:
      raise ValueError(f"Router: vnodes={vnodes} (expected >= 1), eps={eps} (expected > 0)")
    self.vnodes = vnodes
    self.eps = eps
    self._points: list[tuple[int, str]] = []  # sorted (hash, worker)
    self._load: dict[str, int] = {}
    self._pinned: dict[str, str] = {}  # rollout id -> worker
    for worker in workers:
      self.add_worker(worker)

  @property
  def workers(self) -> list[str]:
    return sorted(self._load)

  def loads(self) -> dict[str, int]:
    return dict(sorted(self._load.items()))

  def pinned(self) -> dict[str, str]:
    return dict(self._pinned)

  def add_worker(self, worker: str) -> None:
    """Adds `worker` to the ring. Pinned rollouts stay where their caches are; new rollouts
    whose keys now fall on its arcs go to it."""
    if not isinstance(worker, str) or not worker:
      raise ValueError(f"worker name {worker!r}: expected a non-empty string")
    if worker in self._load:
      raise ValueError(f"worker {worker!r} is already on the ring")
    self._load[worker] = 0
    for i in range(self.vnodes):
      bisect.insort(self._points, (stable_hash(f"{worker}#{i}"), worker))

  def remove_worker(self, worker: str) -> dict[str, str | None]:
    """Takes `worker` off the ring (it died, or is drained) and places its pinned rollouts
    again; returns {rollout id: new worker} for them (their caches must be rebuilt there).
    When it was the last worker they stay unpinned, mapped to None (assign them again once a
    worker is back)."""
    if worker not in self._load:
      raise KeyError(f"worker {worker!r} is not on the ring (workers: {self.workers})")
    del self._load[worker]
    self._points = [p for p in self._points if p[1] != worker]
    orphans = sorted(r for r, w in self._pinned.items() if w == worker)
    for rollout_id in orphans:
      del self._pinned[rollout_id]
    if not self._load:
      return dict.fromkeys(orphans)
    return {rollout_id: self.assign(rollout_id) for rollout_id in orphans}

  def _walk(self, key: str):
    """The distinct workers in ring order, clockwise from `key`'s hash."""
    if not self._points:
      raise RuntimeError("Router: no workers on the ring")
    start = bisect.bisect_left(self._points, (stable_hash(key), ""))
    seen = set()
    for i in range(len(self._points)):
      worker = self._points[(start + i) % len(self._points)][1]
      if worker not in seen:
        seen.add(worker)
        yield worker

  def ring_owner(self, rollout_id: str) -> str:
    """The worker plain consistent hashing gives `rollout_id` (loads ignored)."""
    return next(self._walk(rollout_id))

  def capacity(self) -> int:
    """The most rollouts a worker may hold when the next one is placed."""
    if not self._load:
      raise RuntimeError("Router: no workers on the ring")
    m = len(self._pinned) + 1
    return math.ceil((1 + self.eps) * m / len(self._load))

  def assign(self, rollout_id: str) -> str:
    """The worker of `rollout_id`: where it is pinned, else the first worker clockwise from its
    hash that is below `capacity()` (then pinned there)."""
    if rollout_id in self._pinned:
      return self._pinned[rollout_id]
    capacity = self.capacity()
    worker = next(w for w in self._walk(rollout_id) if self._load[w] < capacity)
    self._pinned[rollout_id] = worker
    self._load[worker] += 1
    return worker

  def pin(self, rollout_id: str, worker: str) -> None:
    """Pins `rollout_id` to `worker` as an earlier assignment did (an orchestrator restoring
    its running rollouts: they stay where their work already is)."""
    if worker not in self._load:
      raise KeyError(f"worker {worker!r} is not on the ring (workers: {self.workers})")
    if rollout_id in self._pinned:
      raise ValueError(f"rollout {rollout_id!r} is already pinned to {self._pinned[rollout_id]!r}")
    self._pinned[rollout_id] = worker
    self._load[worker] += 1

  def release(self, rollout_id: str) -> str:
    """The rollout ended: unpins it (its worker may drop the cache); returns that worker."""
    try:
      worker = self._pinned.pop(rollout_id)
    except KeyError:
      raise KeyError(f"rollout {rollout_id!r} is not assigned") from None
    self._load[worker] -= 1
    return worker
