"""The one home of seeds and stable hashes: every value derived from other values (a run seed,
a step, a prompt index, a worker name, a file name) is the same in every process, run and
Python version (unlike `hash`).

`derive_seed` is the derivation new code uses: distinct part lists give unrelated seeds, so
streams derived for different steps, prompts, samples or workers never overlap (as
`seed + index` streams would). Used by the inference engine (per request), the rollouts (per
sample and turn), the RL loop (per step) and the async rollout workers (per batch).

The other three are older derivations kept bit for bit, because their values decide what
existing runs and checkpoints mean: `crc32_seed` the data pipeline's shuffle and packing
seeds and the synthetic tasks' salts (a resumed run must see the same data order);
`unit_hash` which files and documents are held out; `problem_hash` which environment
problems are eval (the train/eval split) and each problem's draw. Changing one would silently
change a resumed run's data or move problems across the split.
"""

import hashlib
import zlib


def derive_seed(*parts, bits: int = 32) -> int:
  """An unsigned `bits`-bit integer from `parts` (ints and strings): the first `bits / 8` bytes,
  little-endian, of blake2b over the parts joined by ":".

  `derive_seed(7, 3) == int.from_bytes(blake2b(b"7:3", digest_size=4).digest(), "little")`.
  """
  if bits % 8 or not 8 <= bits <= 512:
    raise ValueError(f"derive_seed: bits must be a multiple of 8 in [8, 512], got {bits}")
  key = ":".join(str(part) for part in parts).encode("utf-8")
  return int.from_bytes(hashlib.blake2b(key, digest_size=bits // 8).digest(), "little")


def crc32_seed(*parts) -> int:
  """CRC-32 of the parts joined by "/", in [0, 2**32) (grain's seed range).

  `crc32_seed(0, "copy", "train") == zlib.crc32(b"0/copy/train")`.
  """
  return zlib.crc32("/".join(str(part) for part in parts).encode())


def unit_hash(key: str) -> float:
  """`key` hashed into [0, 1): the first 8 bytes of its SHA-1, little-endian, / 2**64."""
  return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "little") / 2.0**64


def problem_hash(*parts) -> int:
  """A 64-bit hash of `repr(parts)`: the first 8 bytes of its SHA-256, little-endian."""
  return int.from_bytes(hashlib.sha256(repr(parts).encode("utf-8")).digest()[:8], "little")
