"""Admission: the requests that start in an iteration prefilled, and their first tokens.

`Engine.step` hands the requests it placed in slots (`Engine._place`) to `_admit`, as
`(slot, request, start)`: `start` the cache rows a held session kept (`infer.sessions`), else 0.

  1. `_plan` (host): one prefill row per distinct key. Requests admitted together that share a
     fresh prompt (an RL group: one prompt sampled G times) are prefilled once, in the first of
     their slots, and that slot's cache is shared with the others (paged: page references and
     a copy of the partly filled page; contiguous: `programs.copy_slots`); a session's
     continuation is its own row, from its own start. Rows are padded to a power of two (at
     least the mesh's batch shards, `admitted_rows`), so admission compiles at most
     log2(B) + 1 row counts whatever the traffic (paged: times the page buckets).
  2. prefill in chunks of C tokens over the admitted rows only: paged, each chunk is one
     program (`programs.paged_admit`: the rows read and write their pages through a page
     table); contiguous, the rows' caches are gathered out of the whole cache, stepped
     (`programs.prefill_chunk`) and scattered back;
  3. the groups' copy-on-write, then each request's first token from its row's last logits.

`Admission` holds these steps as methods of `Engine` (a mixin: they read and replace the
engine's device state, `cache` and `hidden`, like the decode steps of the host loop). They use
the engine's `cfg`, `params`, `slots`, `chunk`, `k`, `mtp_cache`, `row_multiple`,
`_slot_axes`, `pages` / `paging` (None: contiguous), `record_routing`, `return_logits`,
`top_n`, `stats` and `_rows(request)`, and keep `_carry_zeros` and `_prompt_routing`.

Notation (docs/design.md): B slots, P admitted rows, C prefill chunk, Y vocab, W the
speculative h window, D hidden.
"""

import typing

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.infer import penalties, programs


class Admission:
  """The admission half of `Engine` (module docstring)."""

  def _admit(self, admitted):
    """Prefills the admitted `(slot, request, start)`s from position `start` (one prefill per
    distinct fresh prompt, copied to the group; a session's rows in its own slot) and samples
    their first tokens. Returns `(token, logprob, raw_logprob, logits[, top])` per request.

    Paged, each prefill chunk is one program (`programs.paged_admit`, the same for every
    chunk), so an admission whose prompts fit one chunk is one dispatch, plus one for a
    group's copy-on-write (`programs.share_prefix`). Host arrays go to the programs as numpy
    arrays: jit copies them with the call, where `jnp.asarray` would dispatch an op per
    array."""
    plan = self._plan(admitted)
    requests = [r for _, r, _ in admitted] + [None] * (self.slots - len(admitted))
    first = (plan.rows_B, programs.host_settings(requests), programs.host_seeds(requests),
             penalties.host_penalties(requests))
    prefill = self._contiguous_prefill if self.pages is None else self._paged_prefill
    out, routing = jax.device_get(prefill(plan, first))
    if self.record_routing:
      self._prompt_routing = _prefilled_routing(plan, routing, len(admitted))
    return [programs.sampled_row(out, i) for i in range(len(admitted))]

  def _plan(self, admitted) -> "AdmissionPlan":
    """The host side of an admission: one prefill row per distinct key (a fresh prompt, shared
    by its group, or a session's continuation), its pages reserved (a follower's shared with
    its leader), the prefix stats counted, and the rows' tokens laid out."""
    row_key = []  # per request: its prefill row's key, (prompt, start) or (prompt, slot)
    leaders: dict[tuple, tuple] = {}  # row key -> (slot holding its prefill, start)
    copies = []  # (source slot, destination slot)
    page_copies = []  # paged: (source page, destination page), copied after the prefill
    for slot, request, start in admitted:
      self.stats.prompt_tokens += len(request.prompt)
      # Only fresh prompts (start 0) are shared: a session's rows are its own slot's.
      key = (request.prompt, 0) if start == 0 else (request.prompt, -1 - slot)
      row_key.append(key)
      if key in leaders:
        copies.append((leaders[key][0], slot))
        if self.pages is not None:  # the leader's prompt pages by reference
          page_copies += self.pages.share(leaders[key][0], slot, len(request.prompt),
                                          self._rows(request))
      else:
        leaders[key] = (slot, start)
        if self.pages is not None:
          self.pages.grow(slot, self._rows(request))
    keys = list(leaders)
    rows = admitted_rows(len(keys), self.slots, self.row_multiple)
    # Rows past the prompts use slot id B: gathered as zeros, their scatter dropped.
    slot_ids = np.full(rows, self.slots, np.int32)
    slot_ids[:len(keys)] = [leaders[k][0] for k in keys]
    lengths = np.zeros(rows, np.int32)
    lengths[:len(keys)] = [len(k[0]) for k in keys]
    starts = np.zeros(rows, np.int32)
    starts[:len(keys)] = [leaders[k][1] for k in keys]
    self.stats.prefilled_tokens += int((lengths - starts).sum())
    # Each row holds its tokens from its own start; k tokens of lookahead past each chunk: the
    # MTP depths read t_{i+d}.
    width = round_up(int((lengths - starts).max()), self.chunk)
    tokens = np.zeros((rows, width + self.k), np.int32)
    for i, (prompt, _) in enumerate(keys):
      tokens[i, :lengths[i] - starts[i]] = prompt[starts[i]:]
    row_of = {k: i for i, k in enumerate(keys)}
    rows_B = np.zeros(self.slots, np.int32)  # padding requests read row 0, unused
    rows_B[:len(row_key)] = [row_of[k] for k in row_key]
    return AdmissionPlan(keys, slot_ids, lengths, starts, tokens, rows_B, copies, page_copies)

  def _fresh_carry(self, rows: int):
    """`(last_PY, hidden_PWD)` zeros, what a prompt's first chunk starts from; made once per
    row count and kept (no program donates them), so an admission dispatches no op for them
    (`warmup` remakes them placed like a chunk's outputs: `Warmup._warm_admission`)."""
    if rows not in self._carry_zeros:
      self._carry_zeros[rows] = (
          jnp.zeros((rows, self.cfg.vocab_size), jnp.float32),
          jnp.zeros((rows,) + self.hidden.shape[1:], self.hidden.dtype))
    return self._carry_zeros[rows]

  def _paged_prefill(self, plan, first):
    """`plan`'s prefill on the paged cache, chunk by chunk, with its first tokens (`first`:
    `(rows_B, settings, seeds_B, adjust)` of `programs.first_tokens`, sampled by every chunk,
    kept from the last) and the groups' copy-on-write. Returns device `(first tokens as
    `programs.sample`'s, [routing of each chunk])`."""
    width = plan.tokens.shape[1] - self.k
    carry, routing = self._fresh_carry(len(plan.slot_ids_P)), []
    for offset in range(0, width, self.chunk):
      reach = int(np.minimum(plan.lengths_P, plan.starts_P + offset + self.chunk).max())
      chunk = (self.pages.table(plan.slot_ids_P, reach), plan.slot_ids_P,
               plan.tokens[:, offset:offset + self.chunk + self.k], plan.lengths_P,
               plan.starts_P + offset)
      carry, out, chunk_routing = self._paged_chunk(chunk, carry, first)
      routing.append(chunk_routing)
    if plan.copies:
      self._copy_on_write(plan.page_copies, plan.copies)
    return out, routing

  def _paged_chunk(self, chunk, carry, first):
    """One prefill chunk (`programs.paged_admit`): `chunk` = `(table_PN, slot_ids_P, tokens_PX,
    lengths_P, start_P)`, `carry` = `(last_PY, hidden_PWD)` of the earlier chunks, `first` as
    `_paged_prefill`'s. Returns `(carry, first tokens, routing)`."""
    self.cache, self.hidden, carry, out, routing = programs.paged_admit(
        self.cfg, self.params, self.cache, self.hidden, *chunk, *carry, *first, depths=self.k,
        mtp_cache=self.mtp_cache, record_routing=self.record_routing, paging=self.paging,
        return_logits=self.return_logits, top_n=self.top_n)
    return carry, out, routing

  def _copy_on_write(self, page_copies, copies) -> None:
    """Copies `(source page, destination page)`s and the per-slot state of `(source slot,
    destination slot)`s (`programs.share_prefix`; padded to fixed shapes: one program
    whatever the group sizes)."""
    self.cache, self.hidden = programs.share_prefix(
        self.cache, self.hidden, *self.pages.copy_args(page_copies, copies, self.slots),
        layout=self.paging.layout)

  def _contiguous_prefill(self, plan, first):
    """`_paged_prefill` on the contiguous cache: the rows' slots gathered, stepped chunk by
    chunk, scattered back, then copied to their groups."""
    slot_ids = jnp.asarray(plan.slot_ids_P)
    sub = programs.gather_slots(self.cache, slot_ids, self._slot_axes)
    last_PY, hidden_PWD = self._fresh_carry(len(plan.slot_ids_P))
    routing = []
    for offset in range(0, plan.tokens.shape[1] - self.k, self.chunk):
      sub, last_PY, hidden_PWD, chunk_routing = programs.prefill_chunk(
          self.cfg, self.params, sub, last_PY, hidden_PWD,
          plan.tokens[:, offset:offset + self.chunk + self.k], plan.lengths_P,
          plan.starts_P + offset, depths=self.k, mtp_cache=self.mtp_cache,
          record_routing=self.record_routing)
      routing.append(chunk_routing)
    self.cache = programs.scatter_slots(self.cache, sub, slot_ids, self._slot_axes)
    self.hidden = self.hidden.at[slot_ids].set(hidden_PWD, mode="drop")
    if plan.copies:
      src, dst = (jnp.asarray(x, jnp.int32) for x in zip(*plan.copies))
      self.cache = programs.copy_slots(self.cache, src, dst, self._slot_axes)
      self.hidden = self.hidden.at[dst].set(self.hidden[src])
    return programs.first_tokens(last_PY, *first, return_logits=self.return_logits,
                                 top_n=self.top_n), routing


class AdmissionPlan(typing.NamedTuple):
  """One admission laid out for the device (`Admission._plan`): P prefill rows (a power of two;
  padding rows have slot id B and length 0).

  keys: per real row, its key: `(prompt, 0)` a fresh prompt (its group's one prefill) or
    `(prompt, -1 - slot)` a session's continuation in its own slot.
  slot_ids_P, lengths_P, starts_P: int32 each row's slot, prompt length and first position
    to prefill (a held session's length, else 0).
  tokens: int32 `[P, n * C + k]`, each row's tokens from its start (n chunks), and k
    lookahead tokens past the last chunk (the MTP depths read t_{i+d}), zeros past the prompt.
  rows_B: int32 `[B]` each admitted request's row (its first token's logits), 0 for padding.
  copies: (source slot, destination slot) per group follower.
  page_copies: paged: (source page, destination page) per page a follower copies.
  """
  keys: list
  slot_ids_P: np.ndarray
  lengths_P: np.ndarray
  starts_P: np.ndarray
  tokens: np.ndarray
  rows_B: np.ndarray
  copies: list
  page_copies: list


def _prefilled_routing(plan: AdmissionPlan, chunk_routing: list, admitted: int) -> list:
  """Each of the first `admitted` requests' prompt routing `{kind: [len(prompt), N, k]}` from
  its row of the chunks' `{kind: [P, C, N, k]}`: the rows it prefilled here; a held session's
  earlier rows are -1 (recorded by the turns that fed them)."""
  per_row = []
  for i, (prompt, _) in enumerate(plan.keys):
    start, routing = int(plan.starts_P[i]), {}
    for kind in chunk_routing[0]:
      rows = np.concatenate([r[kind][i] for r in chunk_routing])[:len(prompt) - start]
      full = np.full((len(prompt),) + rows.shape[1:], -1, rows.dtype)
      full[start:] = rows
      routing[kind] = full
    per_row.append(routing)
  return [per_row[row] for row in plan.rows_B[:admitted]]


def bucket(n: int, limit: int) -> int:
  """The smallest power of two >= n, at most `limit` (compiled prefill shapes stay few)."""
  return min(1 << (n - 1).bit_length(), limit) if n > 1 else 1


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def admitted_rows(n: int, slots: int, multiple: int) -> int:
  """Prefill rows for `n` distinct keys: a power of two, rounded up to `multiple` (the mesh's
  batch shards: every shard gets whole rows), at most `slots`."""
  return min(round_up(bucket(n, slots), multiple), slots)
