"""Small pieces every kind's decode branch shares (`Mode(form="decode")`).

In decode, a call feeds L new tokens per slot (B slots): `positions_BL` are absolute positions
in each slot's sequence and `segment_ids_BL` is 1 for a real token and 0 for padding (a slot
with fewer than L new tokens this call, or none). A padded token changes no cache entry that a
later real token reads: its rows are scattered to an out-of-range index and dropped.

Notation (docs/design.md): B slots, L new tokens this call, S cache rows.
"""

import jax
import jax.numpy as jnp


def check_cache(name: str, form: str, cache, expected_keys):
  """A clear error for a cache passed outside decode, or missing / malformed in decode."""
  if form != "decode":
    if cache is not None:
      raise ValueError(f"{name}: `cache` is only read in Mode(form='decode'), got form {form!r}")
    return
  if cache is None:
    raise ValueError(f"{name}: Mode(form='decode') needs `cache=` (this layer's cache dict, "
                     "from AttentionKind.decode_cache)")
  if set(cache) != set(expected_keys):
    raise ValueError(f"{name}: decode cache has keys {sorted(cache)}, expected "
                     f"{sorted(expected_keys)}")


def real_tokens(segment_ids_BL):
  """bool `[B, L]`: the real (non-padding) new tokens."""
  return segment_ids_BL != 0


def sequence_starts(positions_BL, real_BL):
  """bool `[B]`: the slot's first real token this call is at position 0, i.e. a new sequence
  starts in this slot; a recurrent state then restarts from zero whatever the slot held."""
  first_BL = real_BL & (jnp.cumsum(real_BL, axis=1) == 1)
  return jnp.any(first_BL & (positions_BL == 0), axis=1)


def write_rows(cache_BS, rows_BL, row_index_BL, keep_BL):
  """`cache_BS` (`[B, S, ...]`) with `rows_BL` (`[B, L, ...]`) written at rows `row_index_BL`
  where `keep_BL`; the others are dropped (never read: no padded token leaves a trace). Kept
  indices must be distinct within a slot."""
  b, s = cache_BS.shape[:2]
  index_BL = jnp.where(keep_BL, row_index_BL, s)  # s is out of range: dropped
  slot_BL = jnp.broadcast_to(jnp.arange(b)[:, None], index_BL.shape)
  return cache_BS.at[slot_BL, index_BL].set(rows_BL.astype(cache_BS.dtype), mode="drop")


class StackedLayerCache:
  """Layer `layer` of a scanned run's stacked decode cache, `arrays` `{name: [layers, B, ...]}`
  (`glm5_jax.model.GLM5._scanned_run`), read and written where it lies.

  Reading `cache[name]` gives the layer's `[B, ...]` array (a dynamic slice of the stack, which
  XLA may fuse into its consumer); `with_rows` scatters new rows straight into the stack at
  `[layer, slot, row]`. A kind that updates its cache only through `with_rows` thus writes
  O(new rows) per step: slicing the layer out, updating the slice and writing the whole slice
  back copied every cached row of every layer each decode step (docs/scaling.md "Long-context
  decode"). Keys, `in` and iteration are the arrays' names, as for a layer's dict.
  """

  def __init__(self, arrays: dict, layer):
    self.arrays, self.layer = arrays, layer

  def keys(self):
    return self.arrays.keys()

  def __iter__(self):
    return iter(self.arrays)

  def __contains__(self, name) -> bool:
    return name in self.arrays

  def __getitem__(self, name: str):
    return jax.lax.dynamic_index_in_dim(self.arrays[name], self.layer, keepdims=False)


def with_rows(cache, name: str, rows_BL, row_index_BL, keep_BL):
  """The layer cache (a dict of `[B, S, ...]` arrays, or a `StackedLayerCache`) with
  `write_rows(cache[name], rows_BL, row_index_BL, keep_BL)`, the same type back; the stacked
  form scatters into the stack in place (rows dropped as `write_rows` drops them)."""
  if not isinstance(cache, StackedLayerCache):
    return {**cache, name: write_rows(cache[name], rows_BL, row_index_BL, keep_BL)}
  stack = cache.arrays[name]
  b, s = stack.shape[1:3]
  index_BL = jnp.where(keep_BL, row_index_BL, s)  # s is out of range: dropped
  slot_BL = jnp.broadcast_to(jnp.arange(b)[:, None], index_BL.shape)
  stack = stack.at[cache.layer, slot_BL, index_BL].set(rows_BL.astype(stack.dtype), mode="drop")
  return StackedLayerCache({**cache.arrays, name: stack}, cache.layer)
