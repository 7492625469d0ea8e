"""Lightning indexer scores and deterministic top-k: the jnp reference and the XLA path.

DSA's indexer (docs/reference.md section 2, "Lightning indexer") scores key s for query t as

  I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s] * scale)          (fp32)

over the keys t may see: s <= q_pos[t] (causal, in key-sequence positions) and
k_seg[s] == q_seg[t] (packed documents). Each query keeps its top-k keys, best first, ties to
the earlier position (the contract of `lax.top_k`); slots of queries that see fewer than k keys
hold -1. ReLU makes exact ties common (every all-zero head sum ties), so this rule is part of
the op's contract and every implementation must follow it bit for bit; +0.0 and -0.0 tie too
(`select_topk`).

Signs: the formula holds as written for any sign of `w` and `scale` (package docstring, "Index
contract"). A negative head weight votes against the keys its head matches; a negative scale
flips which dot products pass the ReLU. Scores may be negative, and a visible key with a
negative or zero score is still a candidate, ranked above every invisible (-inf) key.

Queries are addressed by `q_pos_BL`, their own index in the key sequence, separately from the
key count S: training and prefill use `q_pos = arange(L)` with S = L; a decode step puts its
L < S queries at the end of S cached keys (`q_pos = S - L + arange(L)`). Padded queries use
q_pos = -1 and see nothing.

Implementations (same signature, same outputs):
  `indexer_topk_reference`  dense [B, L, S] scores, then `select_topk`.
  `indexer_topk_xla`        the reference per block of queries and key tiles, skipping key
                            tiles after a query block's last position: O(query_block x S)
                            memory.
  `indexer_topk_pallas`     (lightning_indexer_pallas.py) a fused Pallas score kernel per query
                            block, selection by `select_topk`.
  `indexer_topk_decode`     cached decoding's few queries: all keys' scores per query block in
                            one pass, selection by `lax.top_k` (same tie rule, no sort).
`indexer_scores_at` recomputes I at the selected keys only ([B, L, T], differentiable in q, k
and w): the sparse-stage indexer KL needs nothing more, so no path materializes [B, L, S] for
training.

Notation (docs/design.md): B batch, L queries, S keys, J index heads, I index head dim,
T top-k.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.blocking import (causal_key_ranges, default_query_block, gather_rows,
                                     map_query_blocks, op_selection, pad_axis, platform,
                                     query_block_size, round_up, rows_per_device)


def visible_keys(q_pos_BL, q_seg_BL, k_seg_BS, first_key=0):
  """Boolean `[B, L, S]`: key s (at index `first_key + s`) is visible to query l iff
  first_key + s <= q_pos[l] and the segments match."""
  keys_S = first_key + jnp.arange(k_seg_BS.shape[1], dtype=jnp.int32)
  causal_BLS = keys_S[None, None, :] <= q_pos_BL[:, :, None]
  return causal_BLS & (q_seg_BL[:, :, None] == k_seg_BS[:, None, :])


def indexer_scores_reference(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS, *,
                             scale: float, first_key=0):
  """Dense index scores `I` (module docstring), fp32 `[B, L, S]`, -inf at invisible keys.
  `first_key` is the index of `k_BSI`'s first row when it is a block of a longer sequence."""
  head_scores_BLJS = jax.nn.relu(
      jnp.einsum("blji,bsi->bljs", q_BLJI.astype(jnp.float32), k_BSI.astype(jnp.float32))
      * scale)
  scores_BLS = jnp.einsum("blj,bljs->bls", weights_BLJ.astype(jnp.float32), head_scores_BLJS)
  return jnp.where(visible_keys(q_pos_BL, q_seg_BL, k_seg_BS, first_key), scores_BLS, -jnp.inf)


def select_topk(scores_BLS, topk: int):
  """Deterministic top-k of fp32 scores (-inf = invisible).

  Returns:
    `(topk_BLT, values_BLT)`: int32 key indices best first, ties to the earlier position, -1
    where fewer than `topk` keys are visible (T = min(topk, S)); their scores, -inf at -1 slots.
    Indices are distinct: a key is never selected twice.
  """
  # Sorting orders floats totally, +0.0 above -0.0, but they are the same score: which sign a
  # zero sum gets (negative weights times ReLU zeros) depends on how a backend accumulates, so
  # without this the tie rule would differ between paths.
  scores_BLS = jnp.where(scores_BLS == 0, 0.0, scores_BLS)
  # `lax.top_k`'s contract (best first, ties to the lower index) as a stable ascending sort of
  # the negated scores carrying the key positions. Not `lax.top_k` itself: the open-source SPMD
  # partitioner (XLA:CPU, and GPU's is the same) does not split its TopK op over the batch
  # dimensions and all-gathered the whole batch's scores to every device, per query block in
  # `indexer_topk_xla` (issue 25); a sort stays on the batch's devices. The TPU compiler
  # partitions either, and compiles a top-2048 to one sort as well (AOT for v5p, libtpu 0.0.42).
  axis = scores_BLS.ndim - 1
  positions_BLS = jax.lax.broadcasted_iota(jnp.int32, scores_BLS.shape, axis)
  negated_BLS, order_BLS = jax.lax.sort((-scores_BLS, positions_BLS), dimension=axis,
                                        is_stable=True, num_keys=1)
  t = min(topk, scores_BLS.shape[-1])
  values_BLT, indices_BLT = -negated_BLS[..., :t], order_BLS[..., :t]
  invalid_BLT = values_BLT == -jnp.inf
  return jnp.where(invalid_BLT, -1, indices_BLT).astype(jnp.int32), values_BLT


def check_indexer_inputs(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS):
  b, l, heads, i = q_BLJI.shape
  if k_BSI.shape[::2] != (b, i) or weights_BLJ.shape != (b, l, heads):
    raise ValueError(f"indexer shapes disagree: q {q_BLJI.shape} [B, L, J, I], k {k_BSI.shape} "
                     f"[B, S, I], weights {weights_BLJ.shape} [B, L, J]")
  if q_pos_BL.shape != (b, l) or q_seg_BL.shape != (b, l) or k_seg_BS.shape != k_BSI.shape[:2]:
    raise ValueError(f"q_pos {q_pos_BL.shape} and q_seg {q_seg_BL.shape} must be [B, L] = "
                     f"{(b, l)}, k_seg {k_seg_BS.shape} must be [B, S] = {k_BSI.shape[:2]}")


def indexer_topk_reference(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS, *,
                           topk: int, scale: float):
  """Top-k keys of the dense index scores (module docstring); O(L x S) memory.

  Args:
    q_BLJI: index queries (RoPE applied). k_BSI: index keys, one per token, shared by heads.
    weights_BLJ: per-head weights w, any sign (fp32 in the model, the J^-0.5 already folded
      in).
    q_pos_BL: int32 index of each query's own token in the key sequence (-1 = padding).
    q_seg_BL, k_seg_BS: int32 document ids of queries and keys.
    topk: keys to keep per query (T = min(topk, S)). scale: applied inside the ReLU, any sign.
  Returns:
    `(topk_BLT, scores_BLT)`: int32 indices (-1 = empty slot) and their fp32 scores (-inf at
    empty slots). Selection passes no gradient (the inputs are detached); differentiate the
    scores with `indexer_scores_at`.
  """
  check_indexer_inputs(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS)
  q_BLJI, k_BSI, weights_BLJ = jax.lax.stop_gradient((q_BLJI, k_BSI, weights_BLJ))
  return select_topk(indexer_scores_reference(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL,
                                              k_seg_BS, scale=scale), topk)


def indexer_topk_xla(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS, *, topk: int,
                     scale: float, query_block: int | None = None, key_block: int = 512,
                     batch_shards: int = 1):
  """`indexer_topk_reference` per block of queries, keys in blocks with causal skipping.

  For each block of queries a `[query_block, S]` fp32 score buffer starts at -inf and a
  `fori_loop` fills it one `key_block` tile at a time, stopping after the block holding the
  query block's last position (a prefill query block skips every later key, half the work on
  average); then `select_topk` selects from the buffer. Memory: O(query_block x (S +
  J x key_block)); `query_block` None: 512 or what fits (`blocking.default_query_block`) in
  each device's rows (`batch_shards`: the devices XLA splits the batch over). Same results as
  the reference (each score is the same per-pair arithmetic).
  """
  check_indexer_inputs(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS)
  b, s = k_BSI.shape[:2]
  heads = q_BLJI.shape[2]
  key_block = min(key_block, s)
  s_pad = round_up(s, key_block)
  if query_block is None:  # small blocks skip more key tiles and keep top-k cache-friendly
    query_block = default_query_block(
        rows_per_device(b, batch_shards) * (s_pad + key_block * (heads + 2)) * 4, 512, 512)
  q_BLJI, k_BSI, weights_BLJ = jax.lax.stop_gradient((q_BLJI, k_BSI, weights_BLJ))
  # Padded keys sit past every real query position, so causality hides them.
  k_BSI = pad_axis(k_BSI, 1, s_pad, 0)
  k_seg_BS = pad_axis(k_seg_BS, 1, s_pad, 0)

  def one_block(q_BLJI, weights_BLJ, q_pos_BL, q_seg_BL):
    def key_tile(j, scores_BLS):
      first = j * key_block
      tile = lambda x: jax.lax.dynamic_slice_in_dim(x, first, key_block, axis=1)
      scores_tile_BLS = indexer_scores_reference(q_BLJI, tile(k_BSI), weights_BLJ, q_pos_BL,
                                                 q_seg_BL, tile(k_seg_BS), scale=scale,
                                                 first_key=first)
      return jax.lax.dynamic_update_slice_in_dim(scores_BLS, scores_tile_BLS, first, axis=2)

    # Key tiles up to the one holding the block's last position; none for padded queries.
    last_pos = jnp.max(q_pos_BL)
    num_tiles = jnp.where(last_pos < 0, 0, last_pos // key_block + 1)
    empty_BLS = jnp.full(q_pos_BL.shape + (s_pad,), -jnp.inf, jnp.float32)
    scores_BLS = jax.lax.fori_loop(0, jnp.minimum(num_tiles, s_pad // key_block), key_tile,
                                   empty_BLS)
    return select_topk(scores_BLS, min(topk, s))

  return map_query_blocks(one_block, query_block, [q_BLJI, weights_BLJ, q_pos_BL, q_seg_BL],
                          [0, 0, -1, 0])


def indexer_topk_decode(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS, *, topk: int,
                        scale: float, query_block: int | None = None, partial: bool = True):
  """`indexer_topk_reference` for cached decoding: a few queries (a decode token, a prefill
  chunk) against S cached keys, which they mostly all see.

  Per block of queries, the scores of every key in one pass (no key-tile loop: there is little
  causal skipping to gain), then the top-k. `partial` selects with `lax.top_k`, whose
  documented tie rule (the lower index first) is `select_topk`'s, after the same +0.0 / -0.0
  merge, so the selection is identical: O(S) per query where `select_topk`'s stable sort is
  O(S log S) and, on CPU, ~500x slower at S = 8K (measured, docs/scaling.md "Long-context
  decode"). `partial=False` keeps the sort, for a batch split over devices (the SPMD
  partitioner does not split a TopK over its batch and would gather every slot's scores, issue
  25). Memory: O(query_block x J x S); `query_block` None: what fits
  (`blocking.default_query_block`), and a call with fewer queries runs as one unpadded block.
  """
  check_indexer_inputs(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL, k_seg_BS)
  b, l, heads, _ = q_BLJI.shape
  s = k_BSI.shape[1]
  q_BLJI, k_BSI, weights_BLJ = jax.lax.stop_gradient((q_BLJI, k_BSI, weights_BLJ))
  if query_block is None:
    query_block = default_query_block(b * s * (heads + 2) * 4)

  def one_block(q_BLJI, weights_BLJ, q_pos_BL, q_seg_BL):
    scores_BLS = indexer_scores_reference(q_BLJI, k_BSI, weights_BLJ, q_pos_BL, q_seg_BL,
                                          k_seg_BS, scale=scale)
    if not partial:
      return select_topk(scores_BLS, min(topk, s))
    values_BLT, indices_BLT = jax.lax.top_k(jnp.where(scores_BLS == 0, 0.0, scores_BLS),
                                            min(topk, s))
    return jnp.where(values_BLT == -jnp.inf, -1, indices_BLT).astype(jnp.int32), values_BLT

  if l <= query_block:
    return one_block(q_BLJI, weights_BLJ, q_pos_BL, q_seg_BL)
  return map_query_blocks(one_block, query_block, [q_BLJI, weights_BLJ, q_pos_BL, q_seg_BL],
                          [0, 0, -1, 0])


# `indexer_scores_at`'s "auto" form: the scores of every key when there are at most this many
# keys per selected slot. One layer's KL on v5p at the 744B step's per-device shapes, by the TPU
# compiler's estimate (`tools/price_dsa_stage.py --part=indexer_kl --keys=...`): "dense" 27.8
# ms at S = 2 T (it grows with S), "gather" 44.0 ms (it does not): equal near S = 3.2 T.
DENSE_KEYS_PER_SLOT = 3
# The "dense" form's query blocks on an accelerator: at most this many queries. Its per-block
# intermediates (`[B, Lb, J, S]` fp32 scores, ReLU masks, head-weighted sums) are large at any
# Lb; one layer's KL at the 744B step's per-device shapes (B 2, S 4,096) by the TPU compiler's
# estimate (`tools/price_dsa_stage.py --part=indexer_kl --keys=dense --query_block=N`): 40.2 ms
# at 64, 23.4 at 128 and 256, 26.9 at 512, 27.8 at 1,024 (what the 2 GiB budget gave), 28.1 at
# 2,048.
DENSE_QUERY_BLOCK_CAP = 256


def indexer_scores_at(q_BLJI, k_BSI, weights_BLJ, topk_BLT, *, scale: float,
                      query_block: int | None = None, reduce_block=None, per_query=(),
                      batch_shards: int = 1, keys: str = "auto", causal: bool = False):
  """Index scores at the selected keys, `I[t, topk[t, j]]`: fp32 `[B, L, T]`, -inf at empty slots.

  Index contract (package docstring): a slot outside [0, S) (-1 or >= S) is empty (score -inf,
  no gradient); a key selected twice gets its score in both slots and the gradients of both.
  Any sign of `weights` and `scale`.

  The sparse-stage indexer KL lives on the selected keys only, computed per query block in one
  of two forms (`keys`), differentiable in q, k and w; the same per-pair arithmetic, so the
  same scores up to fp32 summation order:
    "gather"  each query's selected rows of k gathered (`take`; the backward scatter-adds into
              k): O(L x T) work, but per query a `[J, I] x [I, T]` product of its own rows,
              which a matrix unit runs at a few percent of peak (the TPU compiler's estimate
              for GLM-5's J = 32: ~5%), and `T x I` gathered values per query;
    "dense"   the block's scores of every key (`[Lb x J, I] x [I, S]`, one matrix product for
              the whole block), then the selected slots picked (`take_along_axis`): O(L x S)
              work at matrix-unit speed, no per-query rows;
    "auto"    "dense" when S <= `DENSE_KEYS_PER_SLOT` x T (the 744B step's S = 4,096 keys for
              T = 2,048 slots: 27.8 ms a layer on v5p where "gather" is 44.0, compiler
              estimates), "gather" for long contexts.
  Blocks are rematerialized in the backward pass, so memory stays O(query_block x T x (J + I))
  ("gather") or O(query_block x J x S) ("dense").

  `causal`: queries and keys are the same L positions, and a slot selecting a key after its
  query is empty (as the model's causal selections never do). "dense" then runs its query
  blocks in `causal_key_ranges` runs, each forming the keys up to its last query only (~56%
  of the `[Lb, J, S]` work at 8 ranges); "gather" is unchanged (it forms only the slots).

  `reduce_block(scores_BLT, topk_BLT, *per_query_blocks)`: applied to each block's scores inside
  its checkpoint, with that block's rows of the `per_query` arrays (`[B, L, ...]`), and its
  result (`[B, L, ...]` pytree) returned instead of the scores: the indexer KL per query. Then
  nothing downstream needs the scores for its own backward, so under an outer `jax.checkpoint`
  (full remat) the blocks run twice in all (forward, and once in the backward for their
  residuals), where returned scores, which the KL's backward needs, are recomputed by the outer
  remat before the block's own checkpoint recomputes them again (docs/performance.md).

  `query_block` None: what fits the platform being traced for in each device's rows
  (`batch_shards`: the devices XLA splits the batch over), at most `DENSE_QUERY_BLOCK_CAP` for
  "dense" on an accelerator, rounded down to a power of two so that it divides the usual
  sequence lengths (no padded queries).
  """
  b, l, heads, i = q_BLJI.shape
  s, t = k_BSI.shape[1], topk_BLT.shape[-1]
  if keys not in ("auto", "gather", "dense"):
    raise ValueError(f"keys={keys!r}: expected 'auto', 'gather' or 'dense'")
  dense = s <= DENSE_KEYS_PER_SLOT * t if keys == "auto" else keys == "dense"
  topk_BLT = op_selection(topk_BLT, q_BLJI, k_BSI, causal, "indexer_scores_at")
  if query_block is None:
    floats = (heads + 1) * s if dense else t * (heads + i)  # per query, besides 2 x T
    fits = default_query_block(rows_per_device(b, batch_shards) * (floats + 2 * t) * 4,
                               accelerator_cap=DENSE_QUERY_BLOCK_CAP if dense else 1024,
                               on_accelerator=platform() != "cpu")
    query_block = 1 << (fits.bit_length() - 1)
  k_BSI = k_BSI.astype(jnp.float32)

  def head_scores(q_BLJI, k_BSI, topk_BLT):
    """ReLU(scale q . k) per index head: `[B, Lb, J, T]` at the slots, or `[B, Lb, J, S]`."""
    q_BLJI = q_BLJI.astype(jnp.float32)
    if dense:
      return jax.nn.relu(jnp.einsum("blji,bsi->bljs", q_BLJI, k_BSI) * scale)
    k_BLTI = gather_rows(k_BSI, jnp.maximum(topk_BLT, 0))
    return jax.nn.relu(jnp.einsum("blji,blti->bljt", q_BLJI, k_BLTI) * scale)

  def block_of_keys(k_BSI):
    @jax.checkpoint
    def one_block(q_BLJI, weights_BLJ, topk_BLT, *per_query_blocks):
      scores_BLX = jnp.einsum("blj,bljx->blx", weights_BLJ.astype(jnp.float32),
                              head_scores(q_BLJI, k_BSI, topk_BLT))
      if dense:  # the selected slots of every key's score
        scores_BLX = jnp.take_along_axis(scores_BLX, jnp.maximum(topk_BLT, 0), axis=-1)
      scores_BLT = jnp.where(topk_BLT >= 0, scores_BLX, -jnp.inf)
      return scores_BLT if reduce_block is None else reduce_block(scores_BLT, topk_BLT,
                                                                  *per_query_blocks)
    return one_block

  per_query_arrays = [q_BLJI, weights_BLJ, topk_BLT, *per_query]
  pads = [0, 0, -1] + [0] * len(per_query)
  ranges = causal_key_ranges(l, s, query_block_size(l, query_block), causal and dense)
  outs = [map_query_blocks(block_of_keys(k_BSI[:, :keys]), query_block,
                           [x[:, start:stop] for x in per_query_arrays], pads)
          for start, stop, keys in ranges]
  if len(outs) == 1:
    return outs[0]
  return jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=1), *outs)
