"""Grouped-query attention (the GQA-8 ablation baseline of the report's Table 1).

`H` query heads share `G = num_key_value_heads` key/value heads; interleaved RoPE over the whole
head dim. Kernels: `q_proj [D, H, K]`, `k_proj [D, G, K]`, `v_proj [D, G, K]`, `o_proj [H, K, D]`.

Notation (docs/design.md): B batch, L queries, S keys, D hidden, H query heads, G KV heads,
K head dim (`gqa_head_dim`).

Decode (`Mode(form="decode")`): the cache holds K (rotated) and V per position, row p =
position p (`kinds._gqa_cache`); the new tokens' rows are written first, then each query
attends to rows 0..p. Rows beyond p (a rejected draft, an earlier request) are never read, and
every row <= p was written by this sequence, so neither a rollback nor a reset is needed.
"""

import functools

import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.attention import context_parallel, decode_rows
from glm5_jax.attention.common import attend, causal_segment_mask
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.layers.axes import EMBED, HEAD_DIM, HEADS, KV_HEADS
from glm5_jax.layers.params import dtypes, kernels
from glm5_jax.layers.rope import apply_interleaved_rope, rope_angles


class GQA(nn.Module):
  """Same call signature as `MLA`; returns an empty aux dict (decode: `{"cache": ...}`)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT=None, *,
               mode: Mode = Mode(), cache=None):
    del prev_topk_BLT  # no selection to reuse, no latent, no indexer: one form besides decode
    decode_rows.check_cache("GQA", mode.form, cache, ("k", "v"))
    c = self.cfg
    dtype, pdtype = dtypes(c)
    d, h, g, k = x_BLD.shape[-1], c.num_attention_heads, c.num_key_value_heads, c.gqa_head_dim
    kernel = kernels(self, c.initializer_range, pdtype, dtype)
    x_BLD = x_BLD.astype(dtype)
    q_BLHK = jnp.einsum("bld,dhk->blhk", x_BLD,
                        kernel("q_proj", (d, h, k), (EMBED, HEADS, HEAD_DIM)))
    k_BSGK = jnp.einsum("bld,dgk->blgk", x_BLD,
                        kernel("k_proj", (d, g, k), (EMBED, KV_HEADS, HEAD_DIM)))
    v_BSGK = jnp.einsum("bld,dgk->blgk", x_BLD,
                        kernel("v_proj", (d, g, k), (EMBED, KV_HEADS, HEAD_DIM)))
    cos, sin = rope_angles(positions_BL, k, c.rope_theta)
    q_BLHK = apply_interleaved_rope(q_BLHK, cos, sin)
    k_BSGK = apply_interleaved_rope(k_BSGK, cos, sin)
    q_BLHK = checkpoint_name(q_BLHK, "query_proj")  # names for `model.remat_policy` save_qkv_*
    k_BSGK = checkpoint_name(k_BSGK, "key_proj")
    v_BSGK = checkpoint_name(v_BSGK, "value_proj")
    aux = {}
    if mode.form == "decode":
      out_BLHK, aux["cache"] = _decode_attention(q_BLHK, k_BSGK, v_BSGK, positions_BL,
                                                 segment_ids_BL, cache, k ** -0.5)
    else:
      # Context parallelism: queries stay local; K and V (2 G K numbers per token) and the
      # keys' document ids are gathered in sequence order (`context_parallel.whole_sequence`).
      keys = functools.partial(context_parallel.whole_sequence, layout=mode.context_layout)
      visible_BLS = causal_segment_mask(
          segment_ids_BL, q_index_BL=context_parallel.query_index(*segment_ids_BL.shape,
                                                                  mode.context_layout),
          key_segment_ids_BS=keys(segment_ids_BL))
      out_BLHK, _ = attend(q_BLHK, keys(k_BSGK), keys(v_BSGK), visible_BLS, k ** -0.5)
    out_BLHK = checkpoint_name(out_BLHK, "attention_out")
    w_o_HKD = kernel("o_proj", (h, k, d), (HEADS, HEAD_DIM, EMBED))
    return jnp.einsum("blhk,hkd->bld", out_BLHK, w_o_HKD), aux


def _decode_attention(q_BLHK, k_BLGK, v_BLGK, positions_BL, segment_ids_BL, cache, scale):
  """Writes the real new tokens' K / V at their positions, then attends each query to the cache
  rows at positions <= its own. Returns `(out_BLHK, new cache)`."""
  real_BL = decode_rows.real_tokens(segment_ids_BL)
  new = decode_rows.with_rows(cache, "k", k_BLGK, positions_BL, real_BL)
  new = decode_rows.with_rows(new, "v", v_BLGK, positions_BL, real_BL)
  rows_S = jnp.arange(new["k"].shape[1])
  visible_BLS = rows_S[None, None, :] <= positions_BL[:, :, None]
  out_BLHK, _ = attend(q_BLHK, new["k"].astype(q_BLHK.dtype), new["v"].astype(q_BLHK.dtype),
                       visible_BLS, scale)
  return out_BLHK, new
