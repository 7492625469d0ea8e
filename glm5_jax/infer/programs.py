"""The engine's compiled programs: what `Engine` dispatches, and the host arrays they take.

Every function here that carries `jax.jit` is one program family (its static arguments fix the
rest: the cache layout, the chunk, the rows or page bucket), compiled once per shape and
reused whatever the traffic (`Engine.warmup` compiles them all up front):

  - admission (`glm5_jax.infer.admission`): `paged_admit`, one prefill chunk on the paged
    cache with its first tokens; on the contiguous cache `gather_slots`, `prefill_chunk`,
    `scatter_slots`, then `first_tokens`; a group's copy-on-write `share_prefix` (paged) or
    `copy_slots` (contiguous);
  - decoding (`Engine`'s host loop): `decode_and_sample`, one token per slot, or
    `speculate_and_sample`, one MTP verification step per slot;
  - `sample`: the sampler of both, the request's logit_bias and penalties applied
    (`glm5_jax.infer.penalties`).

Host arrays go to the programs as numpy arrays (`host_settings`, `host_seeds`,
`penalties.host_penalties`): jit copies them with the call, where `jnp.asarray` would
dispatch an op per array.

Notation (docs/design.md): B slots, P admitted rows (a power of two <= B), C prefill chunk,
Q tokens per slot in one call, Y vocab, D hidden, W the speculative h window, N pages per
page-table row (in routing: layers), G group copies.
"""

import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.infer import paged, penalties, sampling, speculate
from glm5_jax.infer.step import decode_step


def host_settings(requests) -> sampling.SamplingParams:
  """Per-slot sampling settings as numpy arrays (a program given them copies them with its
  call: no op dispatched per array); None (an idle slot) samples greedily, unused."""
  return sampling.SamplingParams(
      np.array([r.temperature if r else 0.0 for r in requests], np.float32),
      np.array([r.top_k if r else 0 for r in requests], np.int32),
      np.array([r.top_p if r else 1.0 for r in requests], np.float32))


def host_seeds(requests) -> np.ndarray:
  """Per-slot seeds as a numpy array (uint32; 0 for an idle slot)."""
  return np.array([r.seed if r else 0 for r in requests], np.uint32)


def sampled_row(out, i):
  """Request `i`'s `(token, logprob, raw_logprob, logits or None[, (top ids, top raw)])` from
  `sample`'s outputs copied to the host."""
  tokens, logprobs, raw, logits, top = out
  row = (tokens[i], logprobs[i], raw[i], None if logits is None else logits[i])
  return row if top is None else row + ((top[0][i], top[1][i]),)


class Paging(typing.NamedTuple):
  """The static facts a paged step needs: `layout` = `paged.page_layout` of the cache specs,
  and `topk_width`, the DSA selection width of the contiguous cache (min(index_topk,
  max_len)), to which recorded routing is padded whatever the view's width."""
  layout: tuple
  topk_width: int


def pad_topk(routing: dict, width: int) -> dict:
  """Recorded DSA keys `[..., T]` padded with -1 (empty) to `width`: a view narrower than
  index_topk selects fewer slots, all else is the same selection."""
  if "dsa" not in routing:
    return routing
  t = routing["dsa"].shape[-1]
  pad = [(0, 0)] * (routing["dsa"].ndim - 1) + [(0, width - t)]
  return {**routing, "dsa": jnp.pad(routing["dsa"], pad, constant_values=-1)}


@functools.partial(jax.jit, static_argnames=("slot_axes",))
def gather_slots(cache, slot_ids_P, slot_axes):
  """The caches of slots `slot_ids_P` (ids >= B give zeros), the slots axis in place.

  `slot_axes`: each cache leaf's slots axis, in `jax.tree.leaves` order."""
  leaves, tree = jax.tree.flatten(cache)
  return jax.tree.unflatten(tree, [
      jnp.take(x, slot_ids_P, axis=axis, mode="fill", fill_value=0)
      for x, axis in zip(leaves, slot_axes)])


@functools.partial(jax.jit, static_argnames=("slot_axes",), donate_argnames=("cache",))
def scatter_slots(cache, sub, slot_ids_P, slot_axes):
  """`cache` with slots `slot_ids_P` replaced by `sub`'s (ids >= B dropped)."""

  def put(x, rows, axis):
    x, rows = jnp.moveaxis(x, axis, 0), jnp.moveaxis(rows, axis, 0)
    return jnp.moveaxis(x.at[slot_ids_P].set(rows, mode="drop"), 0, axis)

  leaves, tree = jax.tree.flatten(cache)
  return jax.tree.unflatten(tree, [put(x, rows, axis) for x, rows, axis in
                                   zip(leaves, jax.tree.leaves(sub), slot_axes)])


def _prefill_chunk_body(cfg, params, sub, last_PY, hidden_PWD, tokens_PX, lengths_P, start_P, *,
                        depths, mtp_cache, record_routing=False):
  """One prefill chunk of P prompts, row p at positions `start_P[p] .. start_P[p] + C - 1`,
  into their gathered caches `sub` (and, with `depths` = k > 0, the MTP caches:
  `speculate.prefill_mtp`). Rows start where their cache ends: 0 for a fresh prompt, a held
  session's length for its new tokens.

  Args:
    last_PY: fp32 logits at each prompt's last token, where an earlier chunk held it.
    hidden_PWD: h at each prompt's last W positions, where earlier chunks held them.
    tokens_PX: int32 this chunk of each prompt and the k tokens after it (anything past the
      prompt's length), X = C + k.
    lengths_P: int32 prompt lengths (0 for padding rows: nothing written).
    start_P: int32 each row's first position in this chunk.
  Returns:
    `(sub, last_PY, hidden_PWD, routing)`, updated for the prompt positions in this chunk: the
    logits at a prompt's last token predict its first generated token; routing (with
    `record_routing`, else {}) `{kind: [P, C, N, k]}` of the chunk's tokens.
  """
  p, c = tokens_PX.shape[0], tokens_PX.shape[1] - depths
  positions_PC = start_P[:, None] + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (p, c))
  real_PC = positions_PC < lengths_P[:, None]
  out = decode_step(cfg, params, sub, tokens_PX[:, :c], positions_PC, real_PC.astype(jnp.int32),
                    return_routing=record_routing)
  sub = out.cache
  last_P = lengths_P - 1 - start_P
  logits_PY = jnp.take_along_axis(out.logits_BQY, jnp.clip(last_P, 0, c - 1)[:, None, None],
                                  axis=1)[:, 0]
  ends_here_P = (last_P >= 0) & (last_P < c)
  last_PY = jnp.where(ends_here_P[:, None], logits_PY, last_PY)
  if depths:
    sub = speculate.prefill_mtp(cfg, params, sub, out.hidden_BQD, tokens_PX, positions_PC,
                                lengths_P, depths=depths, mtp_cache=mtp_cache)
    w = hidden_PWD.shape[1]
    # Window row of each chunk position (W, dropped, outside the prompt's last W).
    row_PC = positions_PC - (lengths_P[:, None] - w)
    row_PC = jnp.where(real_PC & (row_PC >= 0), row_PC, w)
    hidden_PWD = jax.vmap(lambda h, rows, new: h.at[rows].set(new, mode="drop"))(
        hidden_PWD, row_PC, out.hidden_BQD.astype(hidden_PWD.dtype))
  return sub, last_PY, hidden_PWD, out.routing


prefill_chunk = functools.partial(jax.jit, static_argnames=(
    "cfg", "depths", "mtp_cache", "record_routing"), donate_argnames=("sub",))(
        _prefill_chunk_body)


@functools.partial(jax.jit, static_argnames=("cfg", "depths", "mtp_cache", "record_routing",
                                             "paging", "return_logits", "top_n"),
                   donate_argnames=("cache", "hidden_BWD"))
def paged_admit(cfg, params, cache, hidden_BWD, table_PN, slot_ids_P, tokens_PX, lengths_P,
                start_P, last_PY, hidden_PWD, rows_B, settings, seeds_B, adjust, *, depths,
                mtp_cache, record_routing, paging, return_logits, top_n):
  """One prefill chunk of an admission with all that follows it, one program, so that an
  admission of one chunk costs one dispatch and a longer one reruns the same program:

    1. `prefill_chunk` on the paged cache: rows `slot_ids_P` (ids >= B: padding) read their
       pages through `table_PN` (`glm5_jax.infer.paged.view`), the chunk's prompt rows go
       back into their pages, the per-slot arrays into their slots;
    2. the rows' h windows (`hidden_PWD`, so far) into their slots of `hidden_BWD` (ids >= B
       dropped; a later chunk rewrites them);
    3. `first_tokens` from the prompts' last logits so far (final after the last chunk;
       the caller keeps the last chunk's).

  Returns `(cache, hidden_BWD, (last_PY, hidden_PWD), first tokens as sample's, routing)`,
  routing `{kind: [P, C, N, k]}` padded to the contiguous cache's DSA width (with
  `record_routing`, else {})."""
  sub = paged.view(cache, table_PN, *paging.layout, slot_ids_P)
  sub, last_PY, hidden_PWD, routing = _prefill_chunk_body(
      cfg, params, sub, last_PY, hidden_PWD, tokens_PX, lengths_P, start_P, depths=depths,
      mtp_cache=mtp_cache, record_routing=record_routing)
  c = tokens_PX.shape[1] - depths
  rows_PC = start_P[:, None] + jnp.arange(c, dtype=jnp.int32)
  cache = paged.write_back(cache, sub, table_PN, rows_PC, rows_PC < lengths_P[:, None],
                           *paging.layout, slot_ids_P)
  hidden_BWD = hidden_BWD.at[slot_ids_P].set(hidden_PWD, mode="drop")
  out = first_tokens(last_PY, rows_B, settings, seeds_B, adjust, return_logits=return_logits,
                     top_n=top_n)
  return cache, hidden_BWD, (last_PY, hidden_PWD), out, pad_topk(routing, paging.topk_width)


@functools.partial(jax.jit, static_argnames=("slot_axes",), donate_argnames=("cache",))
def copy_slots(cache, src_G, dst_G, slot_axes):
  """Prefix sharing: slot `dst_G[i]` gets a copy of slot `src_G[i]`'s cache."""
  sub = gather_slots(cache, src_G, slot_axes)
  return scatter_slots(cache, sub, dst_G, slot_axes)


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnames=("cache", "hidden_BWD"))
def share_prefix(cache, hidden_BWD, src_G, dst_G, src_slots_G, dst_slots_G, *, layout):
  """A group's copy-on-write after its leader's prefill: `paged.copy_pages` (pages `src_G` to
  `dst_G`, the per-slot leaves of slots `src_slots_G` to `dst_slots_G`) and the speculative h
  windows of the same slots (ids past the pool / slots: padding, dropped)."""
  cache = paged.copy_pages(cache, src_G, dst_G, src_slots_G, dst_slots_G, *layout)
  hidden_BWD = hidden_BWD.at[dst_slots_G].set(
      jnp.take(hidden_BWD, src_slots_G, axis=0, mode="fill", fill_value=0), mode="drop")
  return cache, hidden_BWD


@functools.partial(jax.jit, static_argnames=("return_logits", "top_n"))
def first_tokens(last_PY, rows_B, settings, seeds_B, adjust, *, return_logits, top_n):
  """Token 0 of each admitted request from the last logits of its prefill row `rows_B`
  (`[B]`, padding rows sample unused tokens; `adjust`: the slots' `penalties.Penalties`, of
  which only the bias acts on a first token); `sample`'s outputs, B rows."""
  return sample(last_PY[rows_B], settings, seeds_B, jnp.zeros(rows_B.shape, jnp.int32),
                adjust, return_logits=return_logits, top_n=top_n)


@functools.partial(jax.jit, static_argnames=("return_logits", "top_n"))
def sample(logits_BY, settings, seeds_B, index_B, adjust, counts_BY=None, *, return_logits,
           top_n=0):
  """Samples one token per row from the logits adjusted by `adjust` (`penalties.adjust`, with
  the generated tokens' `counts_BY`; None: none yet); returns `(tokens, logprobs, raw_logprobs,
  logits or None, top or None)`, top = (ids [B, N], raw log-probs [B, N]) of the N most likely
  tokens. "Raw" log-probs are the adjusted logits' at temperature 1; `logits` the model's own."""
  adjusted_BY = penalties.adjust(logits_BY, adjust, counts_BY)
  out = sampling.sample(adjusted_BY, settings, seeds_B, index_B)
  top = None
  if top_n:
    values, ids = jax.lax.top_k(jax.nn.log_softmax(adjusted_BY, axis=-1), top_n)
    top = (ids, values)
  return (out.tokens, out.logprobs, out.raw_logprobs, logits_BY if return_logits else None,
          top)


@functools.partial(jax.jit, static_argnames=("cfg", "return_logits", "record_routing", "top_n",
                                             "paging"), donate_argnames=("cache", "counts_BY"))
def decode_and_sample(cfg, params, cache, counts_BY, pending_B, fed_B, active_B, settings,
                      seeds_B, adjust, index_B, table_BN=None, *, return_logits,
                      record_routing=False, top_n=0, paging=None):
  """Feeds each active slot's pending token at its next position and samples token
  `index_B` of its request, its logits adjusted by `adjust` and the counts of its generated
  tokens (`counts_BY`, updated with the pending token: `penalties.count_fed`). Returns
  `(cache, counts_BY, (tokens, logprobs, raw_logprobs, logits, top), routing)` (routing
  `{kind: [B, 1, N, k]}` with `record_routing`, else {}). With `paging` (a `Paging`), `cache`
  is paged and each slot reads the N pages of `table_BN`."""
  step_cache = cache if paging is None else paged.read_in_place(cache, table_BN, *paging.layout)
  out = decode_step(cfg, params, step_cache, pending_B[:, None], fed_B[:, None],
                    active_B[:, None].astype(jnp.int32), return_routing=record_routing)
  new_cache, routing = out.cache, out.routing
  if paging is not None:  # the active slots' rows at fed_B went into their pages in place
    new_cache = paged.pools(new_cache)
    routing = pad_topk(routing, paging.topk_width)
  counts_BY = penalties.count_fed(counts_BY, pending_B, index_B, active_B)
  return new_cache, counts_BY, sample(out.logits_BQY[:, 0], settings, seeds_B, index_B, adjust,
                                      counts_BY, return_logits=return_logits,
                                      top_n=top_n), routing


@functools.partial(jax.jit, static_argnames=("cfg", "k", "mtp_cache", "return_logits",
                                             "paging"), donate_argnames=("cache", "hidden_BWD"))
def speculate_and_sample(cfg, params, cache, hidden_BWD, window_BX, fed_B, active_B, settings,
                         seeds_B, index_B, table_BN=None, shared_rows_B=None, *, k, mtp_cache,
                         return_logits, paging=None):
  """`speculate.speculative_step`; returns `(cache, hidden_BWD, (accepted, num_emitted,
  tokens, logprobs, raw_logprobs, logits or None))`. With `paging`, the step reads the pages
  of `table_BN` and writes back the rows F-W .. F+k it may have written (never a row below
  `shared_rows_B`, in pages other slots share)."""
  step_cache = cache if paging is None else paged.view(cache, table_BN, *paging.layout)
  out = speculate.speculative_step(cfg, params, step_cache, hidden_BWD, window_BX, fed_B,
                                   active_B, settings, seeds_B, index_B, k=k,
                                   mtp_cache=mtp_cache)
  new_cache = out.cache
  if paging is not None:
    w = hidden_BWD.shape[1]
    rows_BR = fed_B[:, None] + jnp.arange(-w, k + 1, dtype=jnp.int32)
    keep_BR = active_B[:, None] & (rows_BR >= shared_rows_B[:, None])
    new_cache = paged.write_back(cache, out.cache, table_BN, rows_BR, keep_BR, *paging.layout)
  v = out.verified
  return new_cache, out.hidden_BWD, (v.accepted, v.num_emitted, v.tokens, v.logprobs,
                                     v.raw_logprobs, out.logits_BQY if return_logits else None)
