"""Consistent-hash routing with bounded loads (glm5_jax/rl/routing.py)."""

import json
import math
import os
import subprocess
import sys

import pytest

from glm5_jax.rl import routing

KEYS = [f"rollout-{i}" for i in range(4000)]


def ring_change(change) -> tuple[dict, dict, list]:
  """`(owners before, owners after, keys moved)` of KEYS on a ring of w0..w3 when
  `change(router)` adds or removes a worker."""
  router = routing.Router([f"w{i}" for i in range(4)])
  before = {k: router.ring_owner(k) for k in KEYS}
  change(router)
  after = {k: router.ring_owner(k) for k in KEYS}
  return before, after, [k for k in KEYS if before[k] != after[k]]


def test_removing_a_worker_moves_only_its_keys():
  before, after, moved = ring_change(lambda router: router.remove_worker("w2"))
  assert moved == [k for k in KEYS if before[k] == "w2"] and moved
  assert "w2" not in after.values()


def test_adding_a_worker_moves_about_one_in_n_plus_one():
  _, after, moved = ring_change(lambda router: router.add_worker("w4"))
  assert all(after[k] == "w4" for k in moved)  # only to the new worker
  assert 0.12 < len(moved) / len(KEYS) < 0.28, len(moved) / len(KEYS)  # ~1/5


def test_bounded_loads_and_pinning():
  router = routing.Router([f"w{i}" for i in range(4)], eps=0.25)
  # Adversarial ids: plain consistent hashing would put every one of them on w0.
  hot = [k for k in KEYS if router.ring_owner(k) == "w0"][:200]
  for m, key in enumerate(hot, start=1):
    capacity = router.capacity()
    worker = router.assign(key)
    assert router.loads()[worker] <= capacity == math.ceil(1.25 * m / 4)
  assert max(router.loads().values()) <= math.ceil(1.25 * 200 / 4)
  assert router.loads()["w0"] == math.ceil(1.25 * 200 / 4)  # full: the rest passed on
  pins = router.pinned()
  assert all(router.assign(k) == pins[k] for k in hot)  # turns stay where the cache is
  assert router.release(hot[0]) == pins[hot[0]] and sum(router.loads().values()) == 199
  with pytest.raises(KeyError, match="not assigned"):
    router.release(hot[0])


def test_removed_worker_rollouts_are_placed_again_within_the_bound():
  router = routing.Router([f"w{i}" for i in range(3)], eps=0.5)
  for key in KEYS[:90]:
    router.assign(key)
  pins = router.pinned()
  moved = router.remove_worker("w1")
  assert sorted(moved) == sorted(k for k, w in pins.items() if w == "w1")
  assert all(router.pinned()[k] == w for k, w in pins.items() if w != "w1")  # others stay
  assert set(moved.values()) <= {"w0", "w2"} and sum(router.loads().values()) == 90
  assert max(router.loads().values()) <= math.ceil(1.5 * 90 / 2)
  router.add_worker("w1")  # back: pinned rollouts stay, new ones may land on it
  assert router.pinned() == {**pins, **moved} and router.loads()["w1"] == 0


def test_errors():
  router = routing.Router(["a"])
  with pytest.raises(ValueError, match="already on the ring"):
    router.add_worker("a")
  with pytest.raises(KeyError, match=r"'b' is not on the ring \(workers: \['a'\]\)"):
    router.remove_worker("b")
  router.assign("r1")
  assert router.remove_worker("a") == {"r1": None}  # the last worker: unpinned, nowhere to go
  assert router.pinned() == {}
  with pytest.raises(RuntimeError, match="no workers"):
    router.assign("x")


def test_same_mapping_in_every_process():
  # routing.py imports only the standard library: load the file alone (no jax import).
  script = ("import importlib.util, json, sys; "
            f"spec = importlib.util.spec_from_file_location('routing', {str(routing.__file__)!r}); "
            "routing = importlib.util.module_from_spec(spec); spec.loader.exec_module(routing); "
            "r = routing.Router(['w0', 'w1', 'w2']); "
            "print(json.dumps([r.ring_owner(f'rollout-{i}') for i in range(300)]))")
  owners = []
  for seed in ("1", "2"):  # Python's str hash() differs between these processes
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True).stdout
    owners.append(json.loads(out))
  here = routing.Router(["w0", "w1", "w2"])
  assert owners[0] == owners[1] == [here.ring_owner(f"rollout-{i}") for i in range(300)]
