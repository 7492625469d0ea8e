"""The sparse stage's attention and indexer KL as one custom VJP, the KL's target taken from the
attention's backward kernel (the GPU Triton kernels, issue 41 item 3; and the XLA attention over
every key, `pallas_kernels.sparse_mla_dense_parts` and, in the expanded form,
`sparse_mla_dense_expanded_parts`, issue 40).

The indexer KL of a query (docs/reference.md section 3) is `KL(p || softmax(I))` over its T
selected keys, p the main attention's head-mean probability there (detached). Its gradient
reaches only the indexer: `dKL / dI = g (softmax(I) - p)` on the valid slots, g the KL's
cotangent. p needs every head's logits at every selected slot: 2 B L H T (C + R) FLOPs, as much
as the attention's own logits. The Triton backward kernel forms exactly those probabilities
(`p = exp(s - lse)`, all heads of each selected slot) for its own gradients, so it writes their
head mean too (`SparseMLAParts.backward`), and the indexer's gradient is formed after it, in
this op's backward. The forward then runs no target sweep, and a remat that reruns the forward
(`model.remat_policy="full"`) reruns none either: the step does 2 x 59.4 TFLOP less at the 3B
config's 8 x 4,096 tokens (docs/performance.md, "The GPU train step's matmul FLOPs").

The price is the KL's VALUE in a differentiated step: its forward rule has no target, so the
per-query KL it returns is 0 there (the gradient is the true one), and the train step leaves
`indexer_kl` out of its metrics (`glm5_jax.train.step.loss_and_grads`). Run forward only (eval
steps, `api.forward`), the op runs its primal: the forward kernel's second sweep gives the
target and the KL its true value.

Same numbers as the path with the forward's target (`mla._sparse_stage_attention`) to float
rounding: the backward's logits sum the latent dims in another order than the forward sweep's.

Notation (docs/design.md): B batch, L queries, S keys, H heads, C latent dim, R RoPE dim,
T top-k slots, J index heads, I index head dim.
"""

import functools

import jax
import jax.numpy as jnp

from glm5_jax.attention.dsa import indexer_kl_per_query
from pallas_kernels.blocking import empty_out_of_range
from pallas_kernels.lightning_indexer import indexer_scores_at
from pallas_kernels.sparse_mla import check_sparse_mla_inputs, named_residuals
from pallas_kernels.sparse_mla_dense_expanded import check_expanded_inputs


def indexer_kl_at_selection(q_BLJI, k_BSI, weights_BLJ, topk_BLT, target_BLT, *,
                            index_scale: float, batch_shards: int = 1,
                            query_block: int | None = None, keys: str = "auto",
                            causal: bool = False):
  """The indexer KL per query, fp32 `[B, L]`: I at the selection (`indexer_scores_at`) against
  `target_BLT`, reduced to the KL inside each query block's checkpoint, so no `[B, L, T]` scores
  outlive a block (`indexer_scores_at`'s `reduce_block`). `batch_shards`: the devices XLA
  splits the batch over (1 per device), which the default query blocks are sized by.
  `causal`: queries and keys are the same positions and the selection causal (the model's
  training sequences, `self_attention_positions`): the scores' query blocks skip the keys after
  them (`indexer_scores_at`)."""
  with jax.named_scope("indexer_scores_at"):
    return indexer_scores_at(
        q_BLJI, k_BSI, weights_BLJ, topk_BLT, scale=index_scale, per_query=[target_BLT],
        batch_shards=batch_shards, query_block=query_block, keys=keys, causal=causal,
        reduce_block=lambda s_BLT, t_BLT, p_BLT: indexer_kl_per_query(s_BLT, p_BLT, t_BLT >= 0))


def self_attention_positions(q_BLX, k_BSX) -> bool:
  """Whether the model's queries and keys are the same positions: L == S. The model's stage
  sees the whole training sequence (L == S) or a part of the queries (a context shard, or new
  tokens after a cached prefix: L < S); its selections are causal by construction."""
  return q_BLX.shape[1] == k_BSX.shape[1]


def sparse_mla_with_indexer_kl(parts, q_latent_BLHC, q_rope_BLHR, ckv_BSC, k_rope_BSR, topk_BLT,
                               index_q_BLJI, index_k_BSI, index_w_BLJ, *, scale: float,
                               index_scale: float, batch_shards: int = 1):
  """Sparse MLA and the indexer KL on its selection, one custom VJP (module docstring).

  Args:
    parts: the kernels (`pallas_kernels.sparse_mla.SparseMLAParts`; the GPU row's
      `DSAOps.sparse_mla_parts()`).
    q_latent_BLHC, q_rope_BLHR, ckv_BSC, k_rope_BSR, topk_BLT: as `sparse_mla_reference`.
    index_q_BLJI, index_k_BSI, index_w_BLJ: the indexer's projections (`LightningIndexer`).
    scale, index_scale: the attention's and the indexer's score scales.
    batch_shards: the devices XLA splits the batch over (1 per device under `shard_map`), which
      the KL's query blocks are sized by (`indexer_kl_at_selection`).
  Returns:
    `(out_BLHC, lse_BLH, kl_BL)`: the attention's output and log-sum-exp, and the KL per query
    (its true value forward only; 0 in a differentiated forward, with the true gradient).
  """
  check_sparse_mla_inputs(q_latent_BLHC, q_rope_BLHR, ckv_BSC, k_rope_BSR, topk_BLT)
  topk_BLT = empty_out_of_range(topk_BLT, ckv_BSC.shape[1])
  return _fused(parts, float(scale), float(index_scale), int(batch_shards),
                (q_latent_BLHC, q_rope_BLHR, ckv_BSC, k_rope_BSR), topk_BLT, index_q_BLJI,
                index_k_BSI, index_w_BLJ)


def expanded_sparse_mla_with_indexer_kl(parts, q_BLHK, k_BSHK, v_BSHV, topk_BLT, index_q_BLJI,
                                        index_k_BSI, index_w_BLJ, *, scale: float,
                                        index_scale: float, batch_shards: int = 1):
  """`sparse_mla_with_indexer_kl` in the expanded form: per-head queries, keys and values
  (`pallas_kernels.sparse_mla_dense_expanded_parts`). Returns `(out_BLHV, lse_BLH, kl_BL)`."""
  check_expanded_inputs(q_BLHK, k_BSHK, v_BSHV, topk_BLT)
  topk_BLT = empty_out_of_range(topk_BLT, k_BSHK.shape[1])
  return _fused(parts, float(scale), float(index_scale), int(batch_shards),
                (q_BLHK, k_BSHK, v_BSHV), topk_BLT, index_q_BLJI, index_k_BSI, index_w_BLJ)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fused(parts, scale, index_scale, batch_shards, attention_inputs, topk_BLT, index_q, index_k,
           index_w):
  out, lse_BLH, target_BLT = parts.forward(*attention_inputs, topk_BLT, scale, head_probs=True)
  kl_BL = indexer_kl_at_selection(index_q, index_k, index_w, topk_BLT, target_BLT,
                                  index_scale=index_scale, batch_shards=batch_shards,
                                  causal=self_attention_positions(index_q, index_k))
  return out, lse_BLH, kl_BL


def _fused_forward(parts, scale, index_scale, batch_shards, attention_inputs, topk_BLT, index_q,
                   index_k, index_w):
  del batch_shards  # the backward's
  out, lse_BLH = parts.forward(*attention_inputs, topk_BLT, scale)
  # Named so that `model.remat_policy="save_attn_lse"` keeps them (`named_residuals`).
  out, lse_BLH = named_residuals(out, lse_BLH)
  kl_BL = jnp.zeros(topk_BLT.shape[:2], jnp.float32)  # no target here: the module docstring
  return (out, lse_BLH, kl_BL), (attention_inputs, topk_BLT, out, lse_BLH, index_q, index_k,
                                 index_w)


def _fused_backward(parts, scale, index_scale, batch_shards, residuals, cotangents):
  attention_inputs, topk_BLT, out, lse_BLH, *index_qkw = residuals
  dout, dlse_BLH, dkl_BL = cotangents
  *grads, target = parts.backward(*attention_inputs, topk_BLT, out, lse_BLH, dout, dlse_BLH,
                                  scale)
  target = jax.lax.stop_gradient(target)
  if parts.indexer_kl_backward is not None:  # the target over every key, the KL's kernels
    index_grads = parts.indexer_kl_backward(*index_qkw, topk_BLT, target, dkl_BL, index_scale)
    return (tuple(grads), None, *index_grads)
  kl = functools.partial(indexer_kl_at_selection, topk_BLT=topk_BLT, target_BLT=target,
                         index_scale=index_scale, batch_shards=batch_shards,
                         causal=self_attention_positions(index_qkw[0], index_qkw[1]))
  _, kl_vjp = jax.vjp(kl, *index_qkw)
  return (tuple(grads), None, *kl_vjp(dkl_BL))


_fused.defvjp(_fused_forward, _fused_backward)
