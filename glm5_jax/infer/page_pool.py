"""The host side of the paged cache (`glm5_jax.infer.paged`): free pages, reference counts and
each slot's page table.

Pages are reference-counted: a page is free when no slot's table holds it. Prefix sharing is
by reference: a group of G samples of one prompt (admitted together) holds the prompt's full
pages once, each follower's table pointing at the leader's; the prompt's partly filled last
page (when its length is not a multiple of the page size) is copied into a page of the
follower's own (copy-on-write, `paged.copy_pages`), because the follower's first generated
rows go into it. With MTP speculation the pages holding the last W prompt rows are copied too
(each step rewrites the rows of its window, `glm5_jax.infer.speculate`). Shared pages are
always full and hold prompt rows that no later step writes, so no write ever needs a copy
after admission; `shared_rows` (rows of a slot in shared pages) lets a step drop any write
below it as a guard. A held session keeps its slot's pages
(`glm5_jax.infer.sessions`); they return to the pool when the request ends without a session,
when it is cancelled, or when the session is released or evicted.

Page 0 is reserved (never handed out): page-table entries past a slot's pages point there.

Notation (docs/design.md): B slots; N the table's width (max_len's pages).
"""

import numpy as np


class PagePool:
  """Free list, reference counts and `[B, N]` page tables of one engine.

  Args:
    num_pages: pages in the pool, page 0 (reserved) included.
    slots: B. max_pages: N, pages a slot can hold (the engine's max_len in pages).
    page_size: rows per page.
  """

  def __init__(self, num_pages: int, slots: int, max_pages: int, page_size: int):
    if num_pages < 2:
      raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
    self.num_pages, self.max_pages, self.page_size = num_pages, max_pages, page_size
    self._refs = np.zeros(num_pages, np.int64)
    self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
    self.table = np.zeros((slots, max_pages), np.int32)
    self.held = [[] for _ in range(slots)]  # each slot's pages, in row order
    self.shared_rows = np.zeros(slots, np.int32)  # rows of the slot in pages it shares

  @property
  def free(self) -> int:
    return len(self._free)

  @property
  def used(self) -> int:
    """Pages some slot holds (a shared page counts once)."""
    return self.num_pages - 1 - len(self._free)

  def pages_of(self, slot: int) -> int:
    return len(self.held[slot])

  def _take(self, n: int) -> list:
    if n > len(self._free):
      raise RuntimeError(f"PagePool: {n} pages asked, {len(self._free)} free (the engine "
                         "checks before admitting; this is a bug)")
    pages = [self._free.pop() for _ in range(n)]
    self._refs[pages] = 1
    return pages

  def _set(self, slot: int, pages: list) -> None:
    if len(pages) > self.max_pages:
      raise ValueError(f"PagePool: slot {slot} would hold {len(pages)} pages, the table has "
                       f"{self.max_pages}")
    self.held[slot] = pages
    self.table[slot] = 0
    self.table[slot, :len(pages)] = pages

  def grow(self, slot: int, pages: int) -> None:
    """Gives `slot` fresh pages until it holds `pages` (a no-op when it holds as many)."""
    extra = pages - len(self.held[slot])
    if extra > 0:
      self._set(slot, self.held[slot] + self._take(extra))

  def share(self, src: int, dst: int, shared: int, copied: int, pages: int) -> list:
    """`dst` (an empty slot) takes references to `src`'s first `shared` pages, then `copied`
    fresh pages that take copies of `src`'s next ones, then fresh pages up to `pages` in all.
    Returns the `(src page, dst page)` pairs to copy (`paged.copy_pages`)."""
    if self.held[dst]:
      raise RuntimeError(f"PagePool: slot {dst} still holds pages")
    refs = self.held[src][:shared]
    copied = min(copied, len(self.held[src]) - shared, pages - shared)
    self._refs[refs] += 1
    self._set(dst, refs + self._take(pages - shared))
    self.shared_rows[dst] = shared * self.page_size
    # The source must not write the shared pages either (its later rows lie past them).
    self.shared_rows[src] = max(self.shared_rows[src], shared * self.page_size)
    return [(self.held[src][shared + i], self.held[dst][shared + i]) for i in range(copied)]

  def release(self, slot: int) -> None:
    """Drops `slot`'s references; pages nobody holds return to the free list."""
    pages = self.held[slot]
    self._refs[pages] -= 1
    self._free.extend(p for p in reversed(pages) if self._refs[p] == 0)
    self._set(slot, [])
    self.shared_rows[slot] = 0
