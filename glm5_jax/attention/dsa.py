"""DeepSeek Sparse Attention: the lightning indexer's projections, selection masks, indexer KL.

Reproduces docs/reference.md section 2 ("Lightning indexer"). For query t and key s:

  1. q_I[t]  = RoPE(cq[t] W_Iq)                 [J heads, I]   (cq: the MLA query latent)
  2. k_I[s]  = RoPE(LayerNorm(x[s] W_Ik))        [I], one key shared by all index heads
     (RoPE is interleaved, on the first `rope_dim` dims of each vector.)
  3. w[t]    = x[t] W_Iw * J^-0.5                [J], fp32
  4. I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s] * I^-0.5), fp32
  5. mask non-causal / cross-document keys to -inf, take the top-k keys per query.

Steps 1-3 are `LightningIndexer` here; steps 4-5 are `pallas_kernels` ops, whose jnp reference
(`indexer_scores_reference`, `select_topk`) is the one definition of the scores and of the
deterministic top-k: ties go to the lower index (`lax.top_k`'s documented contract, which
`select_topk` keeps as a stable sort), i.e. the earlier position, so identical inputs select
identical keys on every call. ReLU makes exact ties common, and RL collapses without this
(report, DSA RL notes).

Notation (docs/design.md): B batch, L queries, S keys, J index heads, I index head dim,
D hidden, Q q latent, T top-k.

`model.dsa_impl` picks how the sparse stage runs (`glm5_jax.attention.mla`), for D and R
layers and for the sliding-window S layers (which run as R layers handed their window):
  "dense_mask"  the reference: dense `[B, L, S]` scores, top-k, and the main attention masked
                to the selection (`topk_mask`), so its cost is still quadratic;
  "xla"         `pallas_kernels` blockwise gather path: scores per block of queries, attention
                over the T selected latent rows only (O(L x T));
  "pallas"      the same with Pallas kernels: TPU (Mosaic) on TPU, GPU (Triton) on GPU, an
                error elsewhere (`pallas_kernels.dsa_ops`);
  "pallas_interpret"  the TPU kernels in Pallas interpret mode on any backend (tests).
All of them select identical keys: same scores, same tie rule (`select_topk`).
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.layers.axes import EMBED, INDEX_HEADS, Q_LORA
from glm5_jax.layers.norms import LayerNorm
from glm5_jax.layers.params import kernels, param
from glm5_jax.layers.rope import apply_interleaved_rope


class LightningIndexer(nn.Module):
  """The indexer's projections (steps 1-3 of the module docstring).

  Params (HF names): `wq_b [Q, J, I]`, `wk [D, I]`, `k_norm` (LayerNorm with bias),
  `weights_proj [D, J]` (kept and applied in fp32).
  """

  n_heads: int
  head_dim: int
  rope_dim: int
  norm_eps: float
  init_std: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BLD, cq_BLQ, cos, sin):
    """Steps 1-3: `(q_BLJI, k_BSI, weights_BLJ)`, q and k in `dtype`, weights fp32 with the
    J^-0.5 folded in. `pallas_kernels` (`indexer_scores_reference`, `indexer_topk_*`) turn
    them into scores."""
    d, q_rank = x_BLD.shape[-1], cq_BLQ.shape[-1]
    j, i = self.n_heads, self.head_dim
    kernel = kernels(self, self.init_std, self.param_dtype, self.dtype)
    w_q_QJI = kernel("wq_b", (q_rank, j, i), (Q_LORA, INDEX_HEADS, None))
    w_k_DI = kernel("wk", (d, i), (EMBED, None))
    w_weights_DJ = param(self, "weights_proj", (d, j), (EMBED, INDEX_HEADS), jnp.float32,
                         nn.initializers.normal(stddev=self.init_std))

    q_BLJI = jnp.einsum("blq,qji->blji", cq_BLQ.astype(self.dtype), w_q_QJI)
    k_BSI = LayerNorm(self.norm_eps, self.dtype, self.param_dtype, name="k_norm")(
        x_BLD.astype(self.dtype) @ w_k_DI)
    q_BLJI = _rope_leading_dims(q_BLJI, cos, sin, self.rope_dim)
    k_BSI = _rope_leading_dims(k_BSI, cos, sin, self.rope_dim)
    weights_BLJ = (x_BLD.astype(jnp.float32) @ w_weights_DJ) * j ** -0.5
    return q_BLJI, k_BSI, weights_BLJ


def _rope_leading_dims(x, cos, sin, rope_dim):
  """Interleaved RoPE on the first `rope_dim` dims of the last axis (layout `[rope | rest]`)."""
  rotated = apply_interleaved_rope(x[..., :rope_dim], cos, sin)
  return jnp.concatenate([rotated, x[..., rope_dim:]], axis=-1)


def restrict_topk_to_visible(topk_BLT, segment_ids_BL, q_index_BL=None, key_segment_ids_BS=None):
  """`topk_BLT` with every slot whose key is not causally visible in the query's document set to
  -1 (queries and keys are the same L tokens; under context parallelism `q_index_BL` is each
  query's sequence index and `key_segment_ids_BS` the whole sequence's document ids, as
  `common.causal_segment_mask` takes them). O(L x T): a selection that did not come from
  this layer's indexer (a sliding window, say) gets the dense path's causal-segment intersection
  without a `[B, L, S]` mask."""
  if key_segment_ids_BS is None:
    key_segment_ids_BS = segment_ids_BL
  if q_index_BL is None:
    q_index_BL = jnp.arange(topk_BLT.shape[1])[None]
  safe_BLT = jnp.clip(topk_BLT, 0, key_segment_ids_BS.shape[1] - 1)
  key_segment_BLT = jax.vmap(lambda seg_S, idx_LT: seg_S[idx_LT])(key_segment_ids_BS, safe_BLT)
  visible_BLT = ((topk_BLT >= 0) & (topk_BLT <= q_index_BL[:, :, None])
                 & (key_segment_BLT == segment_ids_BL[:, :, None]))
  return jnp.where(visible_BLT, topk_BLT, -1)


def topk_mask(topk_BLT, num_keys: int):
  """Boolean `[B, L, S]`, True at the selected keys (-1 slots select nothing)."""
  # -1 -> num_keys, an out-of-range index the scatter drops (negative indices would wrap).
  safe_BLT = jnp.where(topk_BLT < 0, num_keys, topk_BLT)
  b, l, _ = topk_BLT.shape
  mask = jnp.zeros((b, l, num_keys), dtype=bool)
  return mask.at[jnp.arange(b)[:, None, None], jnp.arange(l)[None, :, None], safe_BLT].set(
      True, mode="drop")


def indexer_kl_per_query(index_scores_BLS, target_BLS, keys_BLS):
  """Per-query `KL(p || softmax(I))` over the keys in `keys_BLS` (docs/reference.md section 3).

  The last axis is any key axis: all S keys (dense paths) or the T selected slots (the
  xla / pallas sparse stage, where I and p are only computed at the selection).

  Args:
    index_scores_BLS: indexer scores I (fp32).
    target_BLS: p, the main attention summed over heads and L1-normalized (rows sum to 1 over
      `keys_BLS`; zero elsewhere). The caller detaches it: the main model never learns from
      this loss.
    keys_BLS: the keys the distributions live on: every visible key in the warm-up stage, the
      selected top-k keys in the sparse stage.
  Returns:
    fp32 `[B, L]`.
  """
  log_q_BLS = jax.nn.log_softmax(jnp.where(keys_BLS, index_scores_BLS, -jnp.inf), axis=-1)
  p_BLS = jnp.where(keys_BLS, target_BLS, 0.0)
  p_BLS = p_BLS / jnp.maximum(p_BLS.sum(-1, keepdims=True), 1e-30)
  terms_BLS = jax.scipy.special.xlogy(p_BLS, p_BLS) - jnp.where(p_BLS > 0, p_BLS * log_q_BLS, 0.0)
  return terms_BLS.sum(-1)
