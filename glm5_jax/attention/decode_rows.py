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


@jax.tree_util.register_pytree_node_class
class PagedRows:
  """A row-indexed cache array kept in pages and read where it lies (`glm5_jax.infer.paged`).

  `pool` is `[*lead, NP, PG, ...]` (NP pages of PG rows; `lead` = the stacked layers axis of a
  scanned run or the MTP depths, or nothing) and `table_BN` (int32 `[B, N]`) lists each slot's
  pages in row order: row p of slot b is `pool[..., table[b, p // PG], p % PG]`. A decode step
  that reads the cache as this never copies the view `[B, N * PG, ...]` of every paged array
  first: new rows are scattered into their pages, a sparse (DSA) layer gathers only its
  selected rows (`selected_rows`), and only a kind that reads every row gets the gathered view
  (`LayerCache.__getitem__`).
  """

  def __init__(self, pool, table_BN, lead: int):
    self.pool, self.table_BN, self.lead = pool, table_BN, lead

  def tree_flatten(self):
    return (self.pool, self.table_BN), self.lead

  @classmethod
  def tree_unflatten(cls, lead, children):
    return cls(*children, lead)

  @property
  def page_size(self) -> int:
    return self.pool.shape[self.lead + 1]

  @property
  def view_rows(self) -> int:
    """S of the view: N pages of PG rows."""
    return self.table_BN.shape[1] * self.page_size

  def _at(self, layer):
    return () if layer is None else (layer,)

  def view(self, layer=None):
    """The layer's `[B, N * PG, ...]` rows (a gather of every viewed page)."""
    g = self.pool[self._at(layer) + (self.table_BN,)]  # [B, N, PG, ...]
    return g.reshape(g.shape[:1] + (-1,) + g.shape[3:])

  def _pages(self, row_index, keep):
    """(page, row in page) of view rows `row_index` (`[B, ...]`), page NP (dropped) where not
    `keep` or past the view."""
    pg, num_pages = self.page_size, self.pool.shape[self.lead]
    keep = keep & (row_index >= 0) & (row_index < self.view_rows)
    safe = jnp.clip(row_index, 0, self.view_rows - 1)
    b = self.table_BN.shape[0]
    flat_index = safe.reshape(b, -1) // pg
    page = jnp.take_along_axis(self.table_BN, flat_index, axis=1).reshape(safe.shape)
    return jnp.where(keep, page, num_pages), safe % pg

  def write(self, layer, rows_BL, row_index_BL, keep_BL) -> "PagedRows":
    """`write_rows` into the pages: row `row_index_BL[b, l]` of slot b gets `rows_BL[b, l]`
    where `keep_BL` (and inside the view); the others are dropped."""
    page_BL, offset_BL = self._pages(row_index_BL, keep_BL)
    pool = self.pool.at[self._at(layer) + (page_BL, offset_BL)].set(
        rows_BL.astype(self.pool.dtype), mode="drop")
    return PagedRows(pool, self.table_BN, self.lead)

  def selected_rows(self, layer, rows_BQT):
    """The rows `rows_BQT` (view rows; -1 = none) of each slot, `[B, Q * T, ...]` in
    (query, slot) order, and their indices in that array (`[B, Q, T]`, -1 kept): what a sparse
    attention over the selection reads, gathered straight from the pages."""
    b, q, t = rows_BQT.shape
    page_BQT, offset_BQT = self._pages(rows_BQT, rows_BQT >= 0)
    page_BQT = jnp.minimum(page_BQT, self.pool.shape[self.lead] - 1)  # -1 rows read anything
    rows = self.pool[self._at(layer) + (page_BQT, offset_BQT)]  # [B, Q, T, ...]
    index_BQT = jnp.arange(q * t, dtype=jnp.int32).reshape(1, q, t)
    return (rows.reshape((b, q * t) + rows.shape[3:]),
            jnp.where(rows_BQT >= 0, index_BQT, -1))


class LayerCache:
  """One layer's decode cache read and written where it lies: `arrays` `{name: array}` hold
  layer `layer` of a scanned run's stack (`[layers, B, ...]`, `glm5_jax.model.GLM5.
  _scanned_run`; the MTP depths likewise) or, with `layer` None, the layer's own arrays; any of
  them may be `PagedRows` (the paged cache, read through its page table).

  Reading `cache[name]` gives the layer's `[B, ...]` array (a dynamic slice of the stack, which
  XLA may fuse into its consumer; a paged array's gathered view); `with_rows` scatters new rows
  straight into the stack at `[layer, slot, row]` (a paged array: into its pages). A kind that
  updates its cache only through `with_rows` thus writes O(new rows) per step: slicing the
  layer out, updating the slice and writing the whole slice back copied every cached row of
  every layer each decode step (docs/scaling.md "Long-context decode"). Keys, `in` and
  iteration are the arrays' names, as for a layer's dict.
  """

  def __init__(self, arrays: dict, layer=None):
    self.arrays, self.layer = arrays, layer

  def keys(self):
    return self.arrays.keys()

  def __iter__(self):
    return iter(self.arrays)

  def __contains__(self, name) -> bool:
    return name in self.arrays

  def __getitem__(self, name: str):
    x = self.arrays[name]
    if isinstance(x, PagedRows):
      return x.view(self.layer)
    if self.layer is None:
      return x
    return jax.lax.dynamic_index_in_dim(x, self.layer, keepdims=False)

  def paged(self, name: str) -> bool:
    return isinstance(self.arrays[name], PagedRows)

  def selected_rows(self, name: str, rows_BQT):
    """A paged array's `PagedRows.selected_rows` at this layer."""
    return self.arrays[name].selected_rows(self.layer, rows_BQT)


def in_pages(cache, name: str) -> bool:
  """Whether the layer cache's `name` is read through a page table (`PagedRows`)."""
  return isinstance(cache, LayerCache) and cache.paged(name)


def has_paged_rows(layer_cache) -> bool:
  """Whether a layer's cache dict holds any `PagedRows` (then it goes in a `LayerCache`)."""
  return isinstance(layer_cache, dict) and any(isinstance(x, PagedRows)
                                               for x in layer_cache.values())


def with_rows(cache, name: str, rows_BL, row_index_BL, keep_BL):
  """The layer cache (a dict of `[B, S, ...]` arrays, or a `LayerCache`) with
  `write_rows(cache[name], rows_BL, row_index_BL, keep_BL)`, the same type back; a
  `LayerCache` is written in place (its stack, or its pages; rows dropped as `write_rows`
  drops them)."""
  if not isinstance(cache, LayerCache):
    return {**cache, name: write_rows(cache[name], rows_BL, row_index_BL, keep_BL)}
  x = cache.arrays[name]
  if isinstance(x, PagedRows):
    x = x.write(cache.layer, rows_BL, row_index_BL, keep_BL)
  elif cache.layer is None:
    x = write_rows(x, rows_BL, row_index_BL, keep_BL)
  else:
    b, s = x.shape[1:3]
    index_BL = jnp.where(keep_BL, row_index_BL, s)  # s is out of range: dropped
    slot_BL = jnp.broadcast_to(jnp.arange(b)[:, None], index_BL.shape)
    x = x.at[cache.layer, slot_BL, index_BL].set(rows_BL.astype(x.dtype), mode="drop")
  return LayerCache({**cache.arrays, name: x}, cache.layer)
