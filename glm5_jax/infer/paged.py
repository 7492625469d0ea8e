"""The paged decode cache: row-indexed caches in a pool of fixed-size pages, read per slot
through a page table.

Which arrays are paged. A cache array whose slots axis is followed by a `cache_length` axis
(row p = position p: the MLA / DSA latent `ckv`, `k_rope`, the DSA indexer keys `index_k`, GQA
`k` / `v`, in the main layers and the MTP caches) grows with the context; it is stored as a
pool `[..., NP, PG, ...]` of NP pages of PG rows (the slots and rows axes replaced), one pool
per array, all indexed by the same page ids. Every other array stays per slot `[..., B, ...]`
as in `glm5_jax.infer.cache`: the sliding-window ring (`kinds._swa_cache`, O(window) rows per
slot) and the recurrent states of the N / L kinds (O(1) per slot) are already bounded by the
window or constant, so paging them would save nothing.

A slot's page table `table_BN` (int32 `[B, N]`) lists its pages in row order: row p of the
slot lives in page `table[b, p // PG]`, row `p % PG`. Page 0 is never handed out (the pool
reserves it, `glm5_jax.infer.page_pool`): table entries past a slot's pages point there, so a
view of N pages is always defined. Nothing writes page 0 (a real row always lies in a page its
slot holds; every other write is dropped), so it stays empty; it is only read at rows past a
query's position, or by idle slots, whose outputs nobody reads.

A decode step reads the pages where they lie (`read_in_place`: each paged array a
`decode_rows.PagedRows`): new rows are scattered into their pages, a sparse (DSA) layer
gathers only its selected rows, and a kind that reads every row (dense MLA, GQA, the indexer's
keys) gathers its layer's view. A prefill chunk and a speculative step read `view` instead:
each paged array gathered through the table into the contiguous layout the attention kinds
already take (`[..., B, N * PG, ...]`), the per-slot arrays as they are; the model runs
unchanged on it (`glm5_jax.infer.step.decode_step`), and `write_back` scatters the rows the
step wrote (positions given by the caller) into their pages (a speculative step must not write
rows of pages other slots share, which `write_back`'s mask enforces). N is the caller's
bucket: the pages of the longest live slot rounded up to a power of two, so a step reads (and
the DSA indexer scores) rows of live pages only, with a bounded set of compiled shapes, and
never `max_len` rows. Attention over the view equals attention over the contiguous cache:
rows are positions in both, and a query reads rows 0..p only.

Notation (docs/design.md): B slots (or admitted rows), S rows of the view (N * PG); here NP
pool pages, PG rows per page, N pages per slot in one view, R rows written back per slot.
"""

import functools

import jax
import jax.numpy as jnp

from glm5_jax.attention.cache_spec import CacheSpec
from glm5_jax.attention.decode_rows import PagedRows
from glm5_jax.layers.axes import BATCH, CACHE_LENGTH


def _is_spec(x) -> bool:
  return isinstance(x, CacheSpec)


def is_paged(spec: CacheSpec) -> bool:
  """A row-indexed array: its slots axis is followed by a `cache_length` axis."""
  a = spec.axes.index(BATCH)
  return a + 1 < len(spec.axes) and spec.axes[a + 1] == CACHE_LENGTH


def page_layout(specs) -> tuple[tuple[bool, ...], tuple[int, ...]]:
  """`(paged, slot_axes)` per leaf of a `cache_specs` tree, in `jax.tree.leaves` order: whether
  the leaf is paged, and its slots axis (a paged leaf's pages axis sits there)."""
  leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
  return (tuple(is_paged(s) for s in leaves), tuple(s.axes.index(BATCH) for s in leaves))


def paged_specs(specs, page_size: int, num_pages: int):
  """The `cache_specs` tree with each paged leaf's `[B, S]` dims replaced by
  `[num_pages, page_size]` (logical axes None: a page belongs to no fixed slot)."""

  def one(s: CacheSpec) -> CacheSpec:
    if not is_paged(s):
      return s
    a = s.axes.index(BATCH)
    return CacheSpec(s.shape[:a] + (num_pages, page_size) + s.shape[a + 2:], s.dtype,
                     s.axes[:a] + (None, None) + s.axes[a + 2:], s.fill)

  return jax.tree.map(one, specs, is_leaf=_is_spec)


def _lead(axis: int) -> tuple:
  return (slice(None),) * axis


def view(cache, table_BN, paged, slot_axes, slot_ids_B=None):
  """The contiguous cache a step reads: paged leaves gathered through `table_BN`
  (`[..., B, N * PG, ...]`), the others per slot, taken at `slot_ids_B` when given (ids past
  the slots give zeros: padding rows), else whole."""
  leaves, tree = jax.tree.flatten(cache)
  out = []
  for x, is_pool, a in zip(leaves, paged, slot_axes):
    if is_pool:
      g = jnp.take(x, table_BN, axis=a)  # [..., B, N, PG, ...]
      out.append(g.reshape(g.shape[:a + 1] + (-1,) + g.shape[a + 3:]))
    elif slot_ids_B is None:
      out.append(x)
    else:
      out.append(jnp.take(x, slot_ids_B, axis=a, mode="fill", fill_value=0))
  return jax.tree.unflatten(tree, out)


def read_in_place(cache, table_BN, paged, slot_axes):
  """The cache with each paged leaf as a `decode_rows.PagedRows` over `table_BN`, for a decode
  step that reads and writes the pages where they lie (`glm5_jax.model.GLM5` hands them to
  the layers in a `decode_rows.LayerCache`): no view is copied, a sparse layer gathers only
  its selected rows and new rows are scattered into their pages. `pools` turns the step's
  returned tree back into arrays."""
  leaves, tree = jax.tree.flatten(cache)
  return jax.tree.unflatten(tree, [PagedRows(x, table_BN, a) if is_pool else x
                                   for x, is_pool, a in zip(leaves, paged, slot_axes)])


def pools(cache):
  """`read_in_place`'s tree back as arrays (each `PagedRows` its pool)."""
  return jax.tree.map(lambda x: x.pool if isinstance(x, PagedRows) else x, cache,
                      is_leaf=lambda x: isinstance(x, PagedRows))


def write_back(cache, stepped, table_BN, rows_BR, keep_BR, paged, slot_axes, slot_ids_B=None):
  """`cache` with a step's results: for paged leaves, the view rows `rows_BR` of each slot
  where `keep_BR` written into their pages (the rest dropped: a row a slot shares with another
  must never be written, `keep_BR` false there); the per-slot leaves replaced by `stepped`'s,
  at `slot_ids_B` when given (ids past the slots dropped)."""
  leaves, tree = jax.tree.flatten(cache)
  new = jax.tree.leaves(stepped)
  out = []
  b, r = rows_BR.shape
  slot_BR = jnp.broadcast_to(jnp.arange(b)[:, None], (b, r))
  for x, y, is_pool, a in zip(leaves, new, paged, slot_axes):
    if is_pool:
      page_size, view_rows = x.shape[a + 1], y.shape[a + 1]
      keep_here_BR = keep_BR & (rows_BR >= 0) & (rows_BR < view_rows)
      safe_BR = jnp.clip(rows_BR, 0, view_rows - 1)
      values = y[_lead(a) + (slot_BR, safe_BR)]  # [..., B, R, ...]
      page_BR = jnp.take_along_axis(table_BN, safe_BR // page_size, axis=1)
      page_BR = jnp.where(keep_here_BR, page_BR, x.shape[a])  # out of range: dropped
      out.append(x.at[_lead(a) + (page_BR, safe_BR % page_size)].set(values, mode="drop"))
    elif slot_ids_B is None:
      out.append(y)
    else:
      out.append(x.at[_lead(a) + (slot_ids_B,)].set(y, mode="drop"))
  return jax.tree.unflatten(tree, out)


@functools.partial(jax.jit, static_argnames=("paged", "slot_axes"), donate_argnames=("cache",))
def copy_pages(cache, src_G, dst_G, src_slots_G, dst_slots_G, paged, slot_axes):
  """Copy-on-write at admission: page `dst_G[i]` gets a copy of page `src_G[i]` (a shared
  prompt's partly filled last page; ids >= NP dropped), and per-slot leaves of slot
  `dst_slots_G[i]` a copy of slot `src_slots_G[i]`'s (the ring, the recurrent states)."""
  leaves, tree = jax.tree.flatten(cache)
  out = []
  for x, is_pool, a in zip(leaves, paged, slot_axes):
    src, dst = (src_G, dst_G) if is_pool else (src_slots_G, dst_slots_G)
    out.append(x.at[_lead(a) + (dst,)].set(jnp.take(x, src, axis=a, mode="fill", fill_value=0),
                                           mode="drop"))
  return jax.tree.unflatten(tree, out)


def pages_for(rows: int, page_size: int) -> int:
  """Pages that hold `rows` rows."""
  return -(-rows // page_size)


def page_bucket(rows: int, page_size: int, max_pages: int) -> int:
  """N, the pages a step views for slots of up to `rows` rows: a power of two (at least one
  page), at most `max_pages`, so a run compiles at most log2(max_pages) + 2 view widths."""
  n = max(pages_for(rows, page_size), 1)
  return min(1 << (n - 1).bit_length(), max_pages)
