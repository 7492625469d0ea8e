"""`derive_seed`: the one way a seed is derived from other values (a run seed, a step, a prompt
index, a worker name), the same in every process, run and Python version (unlike `hash`).

Distinct part lists give unrelated seeds, so streams derived for different steps, prompts,
samples or workers never overlap (as `seed + index` streams would). Used by the inference
engine (per request), the rollouts (per sample and turn), the RL loop (per step) and the async
rollout workers (per batch).
"""

import hashlib


def derive_seed(*parts, bits: int = 32) -> int:
  """An unsigned `bits`-bit integer from `parts` (ints and strings): the first `bits / 8` bytes,
  little-endian, of blake2b over the parts joined by ":".

  `derive_seed(7, 3) == int.from_bytes(blake2b(b"7:3", digest_size=4).digest(), "little")`.
  """
  if bits % 8 or not 8 <= bits <= 512:
    raise ValueError(f"derive_seed: bits must be a multiple of 8 in [8, 512], got {bits}")
  key = ":".join(str(part) for part in parts).encode("utf-8")
  return int.from_bytes(hashlib.blake2b(key, digest_size=bits // 8).digest(), "little")
