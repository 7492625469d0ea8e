"""Checkpoint fingerprints: per-array checksums stored beside the arrays, checked on restore.

Orbax stores no checksum: a few flipped bytes in a saved array file restore silently into
different weights. So every checkpoint's `meta` item records, per leaf of `params` and
`opt_state`, two 32-bit checksums of the leaf's bits, computed on device from the arrays being
saved (before the asynchronous write, so they describe exactly what is written):

  words w_i   the leaf's elements as unsigned integers of their own width (bitcast), in uint32
  sum         sum_i w_i                 mod 2^32   (any single flipped bit changes it)
  weighted    sum_i w_i * (2 i + 1)     mod 2^32   (moved or swapped words change it too)

Integer sums are exact and independent of the reduction order, so the value does not depend on
the sharding: on several processes the jitted reduction runs over the global arrays and every
process gets the same numbers. The cost is one read of the state per save and per restore.
The data iterator's position is fingerprinted by a hash of its JSON state (one per process).
"""

import hashlib
import json

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np


def _checksums(x) -> jax.Array:
  """uint32 [2]: (sum, weighted sum) of `x`'s elements' bits (see the module docstring)."""
  width = jnp.dtype(x.dtype).itemsize
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  else:
    words = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32,
                                             8: jnp.uint32}[width]).astype(jnp.uint32)
  words = words.reshape(-1)
  index = jnp.arange(words.shape[0], dtype=jnp.uint32)
  return jnp.stack([words.sum(dtype=jnp.uint32),
                    (words * (2 * index + 1)).sum(dtype=jnp.uint32)])


@jax.jit
def _all_checksums(leaves):
  return jnp.stack([_checksums(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def to_host(x: jax.Array) -> np.ndarray:
  """The whole of global array `x` on this host (a collective when other processes hold parts
  of it: every process calls it)."""
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def tree_fingerprint(tree) -> dict[str, list[int]]:
  """`{keystr(path): [sum, weighted]}` for every array leaf of `tree` (global arrays)."""
  paths_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  sums = to_host(_all_checksums([leaf for _, leaf in paths_leaves]))
  return {jax.tree_util.keystr(path): [int(a), int(b)]
          for (path, _), (a, b) in zip(paths_leaves, sums)}


def data_fingerprint(data_state) -> str:
  """sha256 of a data iterator's JSON-able state."""
  return hashlib.sha256(json.dumps(data_state, sort_keys=True).encode()).hexdigest()


def process_data_fingerprints(data_state) -> str | list[str]:
  """What a checkpoint records for the data position: `data_fingerprint(data_state)` on one
  process; on several, every process's, in process order, since each reads its own shard (so
  positions differ) and the checkpoint's meta is written by process 0 alone. A collective there:
  every process calls it."""
  local = data_fingerprint(data_state)
  if jax.process_count() == 1:
    return local
  digests = multihost_utils.process_allgather(np.frombuffer(bytes.fromhex(local), np.uint8))
  return [bytes(d).hex() for d in np.asarray(digests).reshape(jax.process_count(), -1)]


def data_position_matches(saved: str | list[str], data_state) -> bool:
  """Whether this process's iterator `data_state` is the position `saved` (from
  `process_data_fingerprints` at save time) records for it. No collective."""
  if isinstance(saved, str):
    return jax.process_count() == 1 and saved == data_fingerprint(data_state)
  return (len(saved) == jax.process_count()
          and saved[jax.process_index()] == data_fingerprint(data_state))


def mismatches(saved: dict, actual: dict) -> list[str]:
  """Leaf paths whose saved and recomputed checksums differ (or exist on one side only)."""
  return sorted(k for k in set(saved) | set(actual) if saved.get(k) != actual.get(k))
