"""The engine's paged-cache bookkeeping: the pool, its page tables, and the bucketed tables a
step reads (`glm5_jax.infer.paged` for the layout, `page_pool` for the host pool).

`PagedSlots` is what `glm5_jax.infer.engine.Engine` holds when it pages (`page_size` set):

  reserve  pages a request needs are taken at admission, for all its rows at once
           (`len(prompt) + max_new_tokens - 1 + k`), so a running request never runs out;
           a request waits in the queue while the free pages do not cover it
  share    a group's followers reference the leader's full prompt pages (copy-on-write of
           the rest, `PagePool.share`)
  release  a request that ends without a session, is cancelled, or whose held session is
           released or evicted gives its pages back
  tables   the `[B, N]` table a step reads, N bucketed (`paged.page_bucket`) by the longest
           live slot: a step costs what the live rows cost, whatever max_len is

Notation (docs/design.md): B slots, P admitted rows, N pages per slot in one step.
"""

import jax.numpy as jnp
import numpy as np

from glm5_jax.infer import paged
from glm5_jax.infer.page_pool import PagePool


class PagedSlots:
  """Pages of one engine (module docstring).

  Args:
    specs: the engine's contiguous `cache_specs` tree (its layout is paged from it).
    slots, max_len: the engine's B and rows per slot.
    page_size: rows per page. num_pages: pool pages (page 0 reserved included); None: enough
      for every slot at max_len (`slots * ceil(max_len / page_size) + 1`).
    window: rows before a step's first fed position it rewrites (MTP speculation's W; 0
      plain), whose pages a group copies instead of sharing.
  """

  def __init__(self, specs, *, slots: int, max_len: int, page_size: int,
               num_pages: int | None, window: int):
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
      raise ValueError(f"Engine: page_size must be None (contiguous cache) or an int >= 1, "
                       f"got {page_size!r}")
    self.page_size, self.window = page_size, window
    self.max_pages = paged.pages_for(max_len, page_size)
    if num_pages is None:
      num_pages = slots * self.max_pages + 1
    if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 2:
      raise ValueError(f"Engine: num_pages must be None or an int >= 2 (page 0 is reserved), "
                       f"got {num_pages!r}")
    self.layout = paged.page_layout(specs)
    self.specs = paged.paged_specs(specs, page_size, num_pages)
    self.pool = PagePool(num_pages, slots, self.max_pages, page_size)

  @property
  def used(self) -> int:
    """Pages some slot holds (a shared page once)."""
    return self.pool.used

  def pages_needed(self, rows: int) -> int:
    return paged.pages_for(rows, self.page_size)

  def check_fits(self, index, rows: int) -> None:
    """A request of `rows` rows must fit the whole pool, else it could never start."""
    if self.pages_needed(rows) > self.pool.num_pages - 1:
      raise ValueError(f"request {index}: {rows} cache rows need {self.pages_needed(rows)} "
                       f"pages of {self.page_size}; the engine's num_pages "
                       f"{self.pool.num_pages} holds {self.pool.num_pages - 1} (page 0 is "
                       "reserved)")

  def new_pages(self, slot: int, rows: int) -> int:
    """Fresh pages `slot` needs to hold `rows` rows (a held session keeps its own)."""
    return max(self.pages_needed(rows) - self.pool.pages_of(slot), 0)

  def grow(self, slot: int, rows: int) -> None:
    self.pool.grow(slot, self.pages_needed(rows))

  def share(self, leader: int, follower: int, prompt_len: int, rows: int) -> list:
    """The follower's pages: the leader's full prompt pages below the rewritten window by
    reference, copies of the leader's other prompt pages, fresh ones for the rest. Returns the
    page pairs to copy."""
    shared = max(prompt_len - self.window, 0) // self.page_size
    copied = self.pages_needed(prompt_len) - shared
    return self.pool.share(leader, follower, shared, copied, self.pages_needed(rows))

  def release(self, slot: int) -> None:
    self.pool.release(slot)

  def table(self, slot_ids, rows: int):
    """int32 `[len(slot_ids), N]` table of `slot_ids` (ids >= B: padding rows, all page 0), N =
    the bucket of `rows`, the most rows any of them reads. A numpy array: the jitted step
    copies it with its call (cheaper on the host than a `jnp.asarray` of its own)."""
    n = paged.page_bucket(rows, self.page_size, self.max_pages)
    ids = np.asarray(slot_ids)
    out = np.zeros((len(ids), n), np.int32)
    real = ids < self.pool.table.shape[0]
    out[real] = self.pool.table[ids[real], :n]
    return out

  def shared_rows(self):
    return jnp.asarray(self.pool.shared_rows)

  def buckets(self, rows: int) -> list[int]:
    """Every N a step of slots of up to `rows` rows may read, smallest first (warm-up
    compiles each)."""
    last = paged.page_bucket(rows, self.page_size, self.max_pages)
    out, n = [], 1
    while n < last:
      out.append(n)
      n *= 2
    return out + [last]

  def copy_args(self, pairs, slot_pairs, slots: int):
    """`paged.copy_pages`'s index arrays (numpy, as `table`), padded to fixed lengths (one
    compiled shape): ids past the pool / slots are dropped."""
    width = slots * (self.pages_needed(self.window + 1) + 1)
    pages = np.full((2, width), self.pool.num_pages, np.int32)
    if pairs:
      pages[:, :len(pairs)] = np.asarray(pairs, np.int32).T
    slot_ids = np.full((2, slots), slots, np.int32)
    if slot_pairs:
      slot_ids[:, :len(slot_pairs)] = np.asarray(slot_pairs, np.int32).T
    return pages[0], pages[1], slot_ids[0], slot_ids[1]
