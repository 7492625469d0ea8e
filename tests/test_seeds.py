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


def test_the_data_and_split_hashes_keep_their_values():
  """Moved into seeds.py bit for bit: data order, held-out files and env splits of existing
  runs depend on these values (pinned here as the formulas they had in their old homes)."""
  import zlib  # pylint: disable=import-outside-toplevel

  from glm5_jax.data.sources import shuffle_seed  # pylint: disable=import-outside-toplevel
  from glm5_jax.posttrain.envs.base import EVAL_SHARE, split_of  # pylint: disable=import-outside-toplevel
  from glm5_jax.seeds import crc32_seed, problem_hash, unit_hash  # pylint: disable=import-outside-toplevel

  assert crc32_seed(0, "copy", "train") == zlib.crc32(b"0/copy/train")
  assert shuffle_seed(3, "stdlib", "heldout") == zlib.crc32(b"3/stdlib/heldout")
  assert crc32_seed("needle") == zlib.crc32(b"needle")
  assert unit_hash("a.py") == int.from_bytes(hashlib.sha1(b"a.py").digest()[:8], "little") / 2**64
  assert problem_hash("split", "addition", "3+5") == int.from_bytes(
      hashlib.sha256(repr(("split", "addition", "3+5")).encode()).digest()[:8], "little")
  # The split of a problem is its key's alone, in every env (issue 43; it took the env's name
  # before, so each env's held-out set moved once then).
  for key in ("3+5", "12+40", "7*9", "digit_sum b=7"):
    digest = hashlib.sha256(repr(("split", key)).encode()).digest()[:8]
    held_out = int.from_bytes(digest, "little") % EVAL_SHARE == 0
    assert split_of(key) == ("eval" if held_out else "train")
