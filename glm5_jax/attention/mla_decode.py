"""MLA's decode form (`Mode(form="decode")`): attention of new tokens over a latent cache.

The cache of an MLA-family layer (M, D, R; `kinds._mla_decode_cache` / `_dsa_decode_cache`)
holds row p = position p of each slot:

  ckv      [B, S, C]   the normed kv latent          (values and, through W_kb, keys)
  k_rope   [B, S, R]   the shared RoPE key, rotated
  index_k  [B, S, I]   D only: the lightning indexer's key, rotated

A call brings Q new tokens per slot at absolute `positions_BQ` (segment id 0 = padding). Their
rows are written first (a padded token's row index is S, out of range, and the scatter drops
it), then each query at position p attends to rows 0..p, in the absorbed form (W_kb folded into
the query, W_vb after attention). Rows past p (an earlier request's, a rejected draft's) are
never read, so a slot is reused and a speculative step rolled back without touching the cache.

DSA (sparse stage): the indexer scores the new queries against every cached indexer key with
`q_pos` = the query's position (`pallas_kernels`: key row s visible iff s <= q_pos; padded
queries get q_pos -1 and see nothing), takes the deterministic top-k (the training tie rule,
`select_topk`; "xla" scores and selects with `pallas_kernels.indexer_topk_decode`: one pass
over the keys and a partial top-k, the same selection), and attends over the selected latent
rows through `model.dsa_impl`'s `sparse_mla` ("xla", "pallas", "pallas_interpret"), or masks
the dense absorbed attention ("dense_mask"). An R layer reuses the previous layer's selection
(cache rows), restricted to rows <= q_pos. The training forward and decode see the same keys
with the same scores, so they select the same top-k (the selection has T = min(index_topk, S)
slots here against min(index_topk, L) in training: the extra slots are empty).

Nothing training-only runs here (no indexer KL, no `index_scores`).

Notation (docs/design.md): B slots, Q new tokens per slot, S cache rows (max_len), H heads,
C kv latent, R RoPE dim, N nope head dim, V value head dim, J index heads, I index head dim,
T top-k.
"""

import jax.numpy as jnp

import pallas_kernels
from glm5_jax.attention.decode_rows import in_pages, with_rows
from glm5_jax.attention.dsa import topk_mask
from glm5_jax.layers.axes import BATCH
from glm5_jax.layers.params import context_split


def restrict_rows_to_positions(topk_BQT, q_pos_BQ):
  """A selection of cache rows with every row a query may not read (outside 0..q_pos) set to
  -1: the decode counterpart of `dsa.restrict_topk_to_visible`."""
  ok_BQT = (topk_BQT >= 0) & (topk_BQT <= q_pos_BQ[:, :, None])
  return jnp.where(ok_BQT, topk_BQT, -1)


def decode_attention(c, latents, scale, positions_BQ, segment_ids_BQ, index_qkw, given_topk_BQT,
                     cache: dict, dsa_stage: str, attend_absorbed):
  """One MLA-family layer's cached attention (module docstring).

  Args:
    c: the `ModelConfig`.
    latents: `mla._Latents` of the Q new tokens (RoPE applied).
    scale: the softmax scale.
    positions_BQ: absolute int positions; segment_ids_BQ: 1 real, 0 padding.
    index_qkw: the indexer's `(q_BQJI, k_BQI, weights_BQJ)` of a D layer that selects, or None.
    given_topk_BQT: an R layer's selection from the previous layer (cache rows), or None.
    cache: this layer's `{"ckv", "k_rope"[, "index_k"]}`, a dict or a `decode_rows.
      LayerCache` (a scanned run's layer, or paged arrays), written in place; a paged sparse
      layer reads only its selected rows from the pages.
    dsa_stage: `Mode.dsa_stage`; only "sparse" restricts attention to the selection.
    attend_absorbed: `mla._absorbed_attention` (latents over the cache, mask, scale).
  Returns:
    `(out_BQHV, aux)`: aux holds `cache` (updated, same type, keys, shapes and dtypes) and,
    when a selection exists, `topk_indices [B, Q, T]` (cache rows, -1 = empty).
  """
  missing = sorted({"ckv", "k_rope"} - set(cache) | ({"index_k"} - set(cache)
                                                      if index_qkw is not None else set()))
  if missing:
    raise ValueError(f"MLA decode: the layer cache lacks {missing} (has {sorted(cache)}); build "
                     "it with glm5_jax.infer.cache.init_cache")
  real_BQ = segment_ids_BQ != 0
  q_pos_BQ = jnp.where(real_BQ, positions_BQ, -1).astype(jnp.int32)
  new_cache = with_rows(cache, "ckv", latents.ckv_BSC, positions_BQ, real_BQ)
  new_cache = with_rows(new_cache, "k_rope", latents.k_rope_BSR, positions_BQ, real_BQ)
  dtype = latents.q_nope_BLHN.dtype

  sparse_ops = dsa_stage == "sparse" and c.dsa_impl != "dense_mask"
  topk_BQT = given_topk_BQT
  if index_qkw is not None:
    q_BQJI, k_BQI, weights_BQJ = index_qkw
    new_cache = with_rows(new_cache, "index_k", k_BQI, positions_BQ, real_BQ)
    index_k_BSI = new_cache["index_k"].astype(k_BQI.dtype)
    # Every cached row belongs to the slot's one sequence: causality by position is the mask.
    q_seg_BQ = jnp.ones_like(q_pos_BQ)
    k_seg_BS = jnp.ones(index_k_BSI.shape[:2], jnp.int32)
    index_scale = c.index_head_dim ** -0.5
    if sparse_ops and c.dsa_impl == "xla":
      # Few queries over every cached key: one scoring pass and a partial top-k, not the
      # training path's key-tile loop and sort (`indexer_topk_decode`; the same selection).
      # The sort stays where the slots are split over devices (its docstring).
      topk_BQT, _ = pallas_kernels.indexer_topk_decode(
          q_BQJI, index_k_BSI, weights_BQJ, q_pos_BQ, q_seg_BQ, k_seg_BS, topk=c.index_topk,
          scale=index_scale, partial=context_split(BATCH) == 1)
    elif sparse_ops:
      topk_BQT, _ = pallas_kernels.dsa_ops(c.dsa_impl).indexer_topk(
          q_BQJI, index_k_BSI, weights_BQJ, q_pos_BQ, q_seg_BQ, k_seg_BS, topk=c.index_topk,
          scale=index_scale)
    else:
      scores_BQS = pallas_kernels.indexer_scores_reference(
          q_BQJI, index_k_BSI, weights_BQJ, q_pos_BQ, q_seg_BQ, k_seg_BS, scale=index_scale)
      topk_BQT, _ = pallas_kernels.select_topk(scores_BQS, c.index_topk)

  aux = {"cache": new_cache}
  if topk_BQT is not None:
    aux["topk_indices"] = topk_BQT
  if topk_BQT is not None and sparse_ops:
    visible_topk_BQT = restrict_rows_to_positions(topk_BQT, q_pos_BQ)
    q_latent_BQHC = jnp.einsum("bqhn,chn->bqhc", latents.q_nope_BLHN, latents.w_kb_CHN)
    if in_pages(new_cache, "ckv"):
      # Only the selected rows leave the pages (`[B, Q * T, ...]`), not every viewed row.
      ckv_BSC, rows_BQT = new_cache.selected_rows("ckv", visible_topk_BQT)
      k_rope_BSR, _ = new_cache.selected_rows("k_rope", visible_topk_BQT)
    else:
      ckv_BSC, k_rope_BSR, rows_BQT = new_cache["ckv"], new_cache["k_rope"], visible_topk_BQT
    out_latent_BQHC, _ = pallas_kernels.dsa_ops(c.dsa_impl).sparse_mla(
        q_latent_BQHC, latents.q_rope_BLHR, ckv_BSC.astype(dtype), k_rope_BSR.astype(dtype),
        rows_BQT, scale=scale)
    return jnp.einsum("bqhc,chv->bqhv", out_latent_BQHC, latents.w_vb_CHV), aux

  ckv_BSC = new_cache["ckv"].astype(dtype)
  k_rope_BSR = new_cache["k_rope"].astype(dtype)
  num_rows = ckv_BSC.shape[1]
  visible_BQS = jnp.arange(num_rows)[None, None, :] <= q_pos_BQ[:, :, None]
  if topk_BQT is not None and dsa_stage == "sparse":
    visible_BQS &= topk_mask(topk_BQT, num_rows)
  out_BQHV, _ = attend_absorbed(latents._replace(ckv_BSC=ckv_BSC, k_rope_BSR=k_rope_BSR),
                                visible_BQS, scale)
  return out_BQHV, aux
