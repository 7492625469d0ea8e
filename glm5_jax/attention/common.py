"""Masks and the softmax attention every dense variant shares.

Notation: B batch, L query length, S key length, H query heads, G key/value heads,
K query/key head dim, V value head dim.
"""

import jax
import jax.numpy as jnp

# A large finite negative instead of -inf: a row whose every key is masked gives a uniform
# softmax rather than NaN (such rows cannot occur for causal self-attention, but padding can).
MASKED_LOGIT = -1e30


def causal_segment_mask(segment_ids_BL, num_keys=None, window=None):
  """Boolean `[B, L, S]`: key s is visible to query l iff s <= l, both share a segment, and
  (with a `window`) l - window < s, i.e. the query sees at most its `window` latest keys, itself
  included (sliding-window attention, letter S).

  Packed rows (several documents in one row) carry distinct segment ids, so no query attends
  across a document boundary. `segment_ids_BL` None means one document per row. `window` None
  (or >= L) is plain causal attention.
  """
  if segment_ids_BL is None:
    raise ValueError("segment_ids_BL must be given (use ones for unpacked rows)")
  if window is not None and window < 1:
    raise ValueError(f"window must be >= 1 (model.sliding_window), got {window}")
  length = segment_ids_BL.shape[1]
  num_keys = length if num_keys is None else num_keys
  offset_LS = jnp.arange(length)[:, None] - jnp.arange(num_keys)[None, :]  # l - s
  visible_LS = offset_LS >= 0
  if window is not None:
    visible_LS &= offset_LS < window
  same_segment_BLS = segment_ids_BL[:, :, None] == segment_ids_BL[:, None, :num_keys]
  return visible_LS[None] & same_segment_BLS


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
