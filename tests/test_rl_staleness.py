"""Staleness admission, AReaL's capacity rule and the double-sided IS mask at their boundaries
(glm5_jax/rl/staleness.py)."""

import json

import numpy as np
import pytest

from glm5_jax.rl import staleness as st


def test_version_gap_uses_the_oldest_generated_token():
  mask = np.array([0, 0, 1, 1, 1])
  assert st.version_gap([-1, -1, 3, 4, 5], mask, trainer_version=6) == 3  # partial rollout
  assert st.version_gap([-1, -1, 6, 6, 6], mask, trainer_version=6) == 0
  assert st.version_gap([-1, -1], [0, 0], trainer_version=6) == 0
  with pytest.raises(ValueError, match=r"versions 3\.\.7, but the trainer is at version 6"):
    st.version_gap([-1, -1, 3, 4, 7], mask, trainer_version=6)


def test_admission_at_the_boundary():
  admission = st.StalenessAdmission(max_staleness=2)
  assert [admission.admit(g) for g in (0, 1, 2, 2, 3, 7)] == [True] * 4 + [False] * 2
  metrics = admission.metrics()
  assert (metrics["staleness/admitted"], metrics["staleness/rejected"]) == (4, 2)
  assert metrics["staleness/gap_2"] == 2 and metrics["staleness/gap_max"] == 7
  assert metrics["staleness/gap_mean"] == pytest.approx(15 / 6)
  restored = st.StalenessAdmission.from_json(json.loads(json.dumps(admission.to_json())))
  assert restored == admission
  assert st.StalenessAdmission(max_staleness=0).admit(1) is False
  with pytest.raises(ValueError, match="rl.max_staleness=-1"):
    st.StalenessAdmission(max_staleness=-1)


def test_capacity_rule_at_the_boundary():
  capacity = st.RolloutCapacity(batch_size=4, max_staleness=1)
  assert capacity.capacity(0) == 8  # (0 + 1 + 1) * 4
  capacity.launch(0, 8)
  assert capacity.capacity(0) == 0
  with pytest.raises(RuntimeError, match="exceeds the capacity 0"):
    capacity.launch(0)
  capacity.finish(accepted=True)
  assert capacity.capacity(0) == 0  # a finished, kept rollout still counts
  capacity.finish(accepted=False)
  assert capacity.capacity(0) == 1  # a rejected one gives its place back
  assert capacity.capacity(1) == 5
  capped = st.RolloutCapacity(batch_size=4, max_staleness=3, max_running=2)
  capped.launch(0, 2)
  assert capped.capacity(5) == 0
  sync = st.RolloutCapacity(batch_size=3, max_staleness=0)  # s = 0: the synchronous loop
  sync.launch(0, 3)
  for _ in range(3):
    sync.finish(accepted=True)
  assert sync.capacity(0) == 0 and sync.capacity(1) == 3


def test_capacity_rule_bounds_the_gap_of_in_order_consumption():
  """A simulated run: long-tailed rollout durations, launches as the rule allows, the trainer
  takes the oldest b samples once they are done. Every gap is <= s, and s is reached (the rule
  lets generation run ahead as far as the bound, no further)."""
  rng = np.random.default_rng(0)
  b, s = 4, 2
  capacity = st.RolloutCapacity(batch_size=b, max_staleness=s)
  version, launched, gaps = 0, [], []  # launched: [launch version, finish time]
  for tick in range(400):
    for _ in range(capacity.capacity(version)):
      capacity.launch(version)
      launched.append([version, tick + int(rng.pareto(1.5) * 3) + 1])
    for item in launched:
      if item[1] == tick:
        capacity.finish(accepted=True)
    start = version * b
    batch = launched[start:start + b]
    if len(batch) == b and all(done <= tick for _, done in batch):
      gaps += [version - v for v, _ in batch]
      version += 1
  assert version > 20 and max(gaps) <= s and s in gaps


