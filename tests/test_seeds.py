"""`glm5_jax.seeds.derive_seed`: stable across processes, distinct per part list, and the seeds
of the engine, rollouts, RL steps and workers are it (their values are unchanged by the move)."""

import hashlib

import pytest

from glm5_jax.infer.engine import request_seed
from glm5_jax.posttrain.loop import step_seed
from glm5_jax.rl.worker import batch_seed
from glm5_jax.seeds import derive_seed


def _blake(key: bytes, size: int = 4) -> int:
  return int.from_bytes(hashlib.blake2b(key, digest_size=size).digest(), "little")


def test_derive_seed_is_blake2b_of_the_joined_parts():
  assert derive_seed(7, 3) == _blake(b"7:3")
  assert derive_seed("rl", 1, 5, bits=64) == _blake(b"rl:1:5", 8)
  assert 0 <= derive_seed(0) < 2**32
  assert len({derive_seed(0, i) for i in range(1000)}) == 1000
  with pytest.raises(ValueError, match="bits"):
    derive_seed(1, bits=12)


def test_the_run_seeds_are_derive_seed():
  assert request_seed(7, 3) == _blake(b"7:3")
  assert step_seed(1, 5) == _blake(b"rl:1:5")
  assert batch_seed(1, "w0", 4) == _blake(b"rollout:1:w0:4")
