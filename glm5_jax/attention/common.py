"""Masks and the softmax attention every dense variant shares.

Notation: B batch, L query length, S key length, H query heads, G key/value heads,
K query/key head dim, V value head dim.
"""

import jax
import jax.numpy as jnp

# A large finite negative instead of -inf: a row whose every key is masked gives a uniform
# softmax rather than NaN (such rows cannot occur for causal self-attention, but padding can).
MASKED_LOGIT = -1e30


def causal_segment_mask(segment_ids_BL, num_keys=None, window=None, *, q_index_BL=None,
                        key_segment_ids_BS=None):
  """Boolean `[B, L, S]`: key s is visible to query l iff s <= l, both share a segment, and
  (with a `window`) l - window < s, i.e. the query sees at most its `window` latest keys, itself
  included (sliding-window attention, letter S).

  Packed rows (several documents in one row) carry distinct segment ids, so no query attends
  across a document boundary. `segment_ids_BL` None means one document per row. `window` None
  (or >= L) is plain causal attention.

  Context parallelism (`glm5_jax.attention.context_parallel`): `q_index_BL` is each query's
  sequence index (default l) and `key_segment_ids_BS` the whole sequence's document ids in
  sequence order (default `segment_ids_BL`), for queries that are one device's share of the
  sequence, in any order.
  """
  if segment_ids_BL is None:
    raise ValueError("segment_ids_BL must be given (use ones for unpacked rows)")
  if window is not None and window < 1:
    raise ValueError(f"window must be >= 1 (model.sliding_window), got {window}")
  if key_segment_ids_BS is None:
    key_segment_ids_BS = segment_ids_BL
  num_keys = key_segment_ids_BS.shape[1] if num_keys is None else num_keys
  if q_index_BL is None:
    q_index_BL = jnp.arange(segment_ids_BL.shape[1])[None]
  offset_BLS = q_index_BL[:, :, None] - jnp.arange(num_keys)[None, None, :]  # l - s
  visible_BLS = offset_BLS >= 0
  if window is not None:
    visible_BLS &= offset_BLS < window
  same_segment_BLS = segment_ids_BL[:, :, None] == key_segment_ids_BS[:, None, :num_keys]
  return visible_BLS & same_segment_BLS


def attend(q_BLHK, k_BSGK, v_BSGV, mask_BLS, scale: float):
  """Softmax attention with grouped KV heads (G divides H); logits and softmax in fp32.

  Returns:
    `(out_BLHV, probs_BLS)`: the output in the dtype of `v`, and the attention distribution
    averaged over heads (fp32, rows sum to 1), which the DSA indexer learns to imitate.
  """
  b, l, h, k = q_BLHK.shape
  g = k_BSGK.shape[2]
  q_BLGRK = q_BLHK.reshape(b, l, g, h // g, k)
  logits_BGRLS = jnp.einsum("blgrk,bsgk->bgrls", q_BLGRK, k_BSGK,
                            preferred_element_type=jnp.float32) * scale
  logits_BGRLS = jnp.where(mask_BLS[:, None, None], logits_BGRLS, MASKED_LOGIT)
  probs_BGRLS = jax.nn.softmax(logits_BGRLS, axis=-1)
  out_BLGRV = jnp.einsum("bgrls,bsgv->blgrv", probs_BGRLS.astype(v_BSGV.dtype), v_BSGV)
  return out_BLGRV.reshape(b, l, h, v_BSGV.shape[-1]), probs_BGRLS.mean(axis=(1, 2))


def attend_flash(q_BLHK, k_BSHK, v_BSHV, causal_mask_BLS, scale: float, implementation: str):
  """`attend`'s output through `jax.nn.dot_product_attention(implementation=...)`, no probs.

  "cudnn" is cuDNN's flash attention (GPU, bf16 / fp16): nothing `[B, H, L, S]` in HBM; "xla"
  is jax's XLA version of the same call (what a CPU test compares with `attend`).

  Head dims: the call takes one head dim for q, k and v, so the q.k width K and the value width
  V are zero-padded to D = max(K, V) rounded up to 8 (cuDNN needs a multiple of 8, at most 256
  on Hopper): zero columns add nothing to any logit (the scale is passed, not derived from D),
  and the output is cut back to V. GLM-5's MLA has K = N + R = 192 + 64 = 256 = V: nothing is
  padded. The mask goes in as the call's boolean `[B, 1, L, S]` mask together with
  `is_causal=True` (cuDNN skips the blocks above the diagonal); jax turns the mask into an
  additive bf16 bias `[B, 1, L, S]` that cuDNN reads (and, in the backward, writes a bias
  gradient of that shape, unused): the cost of supporting packed documents, `B x L x S` values
  in HBM rather than a per-head score matrix. (`tools/device_suite.py`'s cuDNN baseline, one
  document per row, passes `is_causal` alone.)

  Args:
    q_BLHK, k_BSHK, v_BSHV: one K/V head per query head (G = H); same dtype.
    causal_mask_BLS: visible keys; must be causal (s <= l), as every mask of the model is.
    scale: the softmax scale (MLA: K^-0.5 of the unpadded K).
  Returns:
    `out_BLHV` in q's dtype.
  """
  k, v = q_BLHK.shape[-1], v_BSHV.shape[-1]
  d = -(-max(k, v) // 8) * 8
  pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, d - x.shape[-1])]) if x.shape[-1] < d else x
  out_BLHD = jax.nn.dot_product_attention(
      pad(q_BLHK), pad(k_BSHK), pad(v_BSHV), mask=causal_mask_BLS[:, None], scale=scale,
      is_causal=True, implementation=implementation)
  return out_BLHD[..., :v]
