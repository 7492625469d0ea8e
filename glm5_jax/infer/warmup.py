"""Warm-up: every program a request can reach compiled before the engine serves.

`Warmup.warmup` is a method of `Engine` (a mixin, like `infer.admission.Admission`): it runs
the engine's own admission and decode paths on padding rows and idle slots, once per shape
the loop can meet, and leaves the engine as built. A server calls it before it listens, so
that no request compiles anything (`infer.compile_count` counts the compiles that remain).
It drives the engine through `_admit`, `_paged_chunk` and `_fresh_carry` (`Admission`), the
decode programs with the engine's `_slot_arrays`, and restores `stats`.
"""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from glm5_jax.infer import penalties, programs
from glm5_jax.infer.admission import admitted_rows
from glm5_jax.infer.requests import Request


class Warmup:
  """The warm-up of `Engine` (module docstring)."""

  def warmup(self, max_rows: int | None = None, progress=None) -> None:
    """Compiles every program the loop can run (paged cache only: every admitted-rows bucket
    with every page bucket, every decode page bucket), so that no request compiles anything
    later whatever its lengths. `max_rows`: only the page buckets of requests of up to that
    many rows (prompt + max_new_tokens - 1 + k; default max_len). `progress(done, total)` is
    called after each of its `total` parts (a part compiles about one program). Leaves the
    engine as built (stats, pages, slots idle).

    What a request can change is data, not a program: sampling settings, penalties and seeds
    are per-slot arrays (`infer.sampling`, `infer.penalties`), `n` and sessions choose slots
    and prefill rows (the row buckets), stop strings and tools only change the prompt and
    where the server cancels; quantized params are the params. A server's engine fixes the
    rest (speculative steps, top_logprobs, record_routing, return_logits), so these parts are
    every program."""
    if self.pages is None:
      raise ValueError("Engine.warmup needs the paged cache (page_size); the contiguous cache "
                       "compiles its few shapes on first use")
    if any(self.pages.pool.held) or len(self.sessions):
      raise RuntimeError("Engine.warmup: run it before any request")
    buckets = self.pages.buckets(self.max_len if max_rows is None else max_rows)
    row_buckets = sorted({admitted_rows(n, self.slots, self.row_multiple)
                          for n in range(1, self.slots + 1)})
    stats = dataclasses.replace(self.stats)
    token = Request(0, (0,), 1, 0.0, 1.0, 0, 0, ())

    def host_path(rows):  # the whole host path: distinct prompts, then a group
      for admitted in ([(s, dataclasses.replace(token, prompt=(s,)), 0) for s in range(rows)],
                       [(s, token, 0) for s in range(2)] if rows > 1 else []):
        if admitted:
          self._admit(admitted)
        for slot in range(self.slots):
          self.pages.release(slot)

    # The first decode takes the counts as allocated, every later one a program's output (with
    # placed params a committed array: another program, as in `_warm_admission`), so the first
    # bucket's decode runs twice.
    parts = ([functools.partial(self._warm_admission, rows, n, fresh=n == buckets[0])
              for rows in row_buckets for n in buckets]
             + [functools.partial(host_path, rows) for rows in row_buckets]
             + [functools.partial(self._warm_decode, n) for n in buckets[:1] + buckets])
    with self._context():
      for done, part in enumerate(parts, 1):
        part()
        if progress is not None:
          progress(done, len(parts))
    self.stats = stats

  def _warm_decode(self, n: int) -> None:
    """Compiles the decode (or verification) step reading `n` pages per slot, all slots idle."""
    idle = [None] * self.slots
    # Host arrays as the loop passes them: numpy.
    zeros = np.zeros(self.slots, np.int32)
    inactive = np.zeros(self.slots, bool)
    table = self.pages.table(np.arange(self.slots), n * self.pages.page_size)
    if self.k:
      self.cache, self.hidden, _ = programs.speculate_and_sample(
          self.cfg, self.params, self.cache, self.hidden,
          np.zeros((self.slots, self.w + 1), np.int32), zeros, inactive,
          *self._slot_arrays(idle)[:2], zeros, table, self.pages.shared_rows(), k=self.k,
          mtp_cache=self.mtp_cache, return_logits=self.return_logits, paging=self.paging)
    else:
      self.cache, self.counts, *_ = programs.decode_and_sample(
          self.cfg, self.params, self.cache, self.counts, zeros, zeros, inactive,
          *self._slot_arrays(idle), zeros, table, return_logits=self.return_logits,
          record_routing=self.record_routing, top_n=self.top_n, paging=self.paging)

  def _warm_admission(self, rows: int, n: int, fresh: bool) -> None:
    """Compiles the admission program of `rows` prefill rows at page bucket `n`
    (`programs.paged_admit`, on padding rows: nothing written), for a prompt's first chunk
    and for a later one.

    Where the params are placed on a mesh, a program's outputs are committed arrays, and a
    program given them is another program than one given fresh arrays. So (`fresh`: the
    first bucket of a row count) a first call on fresh arrays (the cache as allocated, zeros)
    is made before the programs the loop will use, and the first chunk's zeros are then made
    like the outputs (`jnp.zeros_like` keeps their placement): first and later chunks run one
    program."""
    ids = np.full(rows, self.slots, np.int32)
    zeros = np.zeros(rows, np.int32)
    tokens = np.zeros((rows, self.chunk + self.k), np.int32)
    idle = [None] * self.slots
    first = (np.zeros(self.slots, np.int32), programs.host_settings(idle),
             programs.host_seeds(idle), penalties.host_penalties(idle))

    def chunk(n):
      return (self.pages.table(ids, n * self.pages.page_size), ids, tokens, zeros, zeros)

    if fresh:
      carry, _, _ = self._paged_chunk(chunk(n), self._fresh_carry(rows), first)
      self._carry_zeros[rows] = tuple(jnp.zeros_like(x) for x in carry)
    carry, _, _ = self._paged_chunk(chunk(n), self._fresh_carry(rows), first)
    self._paged_chunk(chunk(n), carry, first)
