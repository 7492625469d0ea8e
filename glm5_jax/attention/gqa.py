"""Grouped-query attention (the GQA-8 ablation baseline of the report's Table 1).

`H` query heads share `G = num_key_value_heads` key/value heads; interleaved RoPE over the whole
head dim. Kernels: `q_proj [D, H, K]`, `k_proj [D, G, K]`, `v_proj [D, G, K]`, `o_proj [H, K, D]`.
"""

import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.attention.common import attend, causal_segment_mask
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.layers.params import DTYPES, normal_kernel
from glm5_jax.layers.rope import apply_interleaved_rope, rope_angles


class GQA(nn.Module):
  """Same call signature as `MLA`; returns an empty aux dict."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT=None, *,
               mode: Mode = Mode()):
    del prev_topk_BLT, mode  # no selection to reuse, no latent, no indexer: one form
    c = self.cfg
    dtype = DTYPES[c.dtype]
    d, h, g, k = x_BLD.shape[-1], c.num_attention_heads, c.num_key_value_heads, c.gqa_head_dim
    kernel = lambda name, shape, axes: normal_kernel(
        self, name, shape, axes, c.initializer_range, DTYPES[c.param_dtype]).astype(dtype)
    x_BLD = x_BLD.astype(dtype)
    q_BLHK = jnp.einsum("bld,dhk->blhk", x_BLD, kernel("q_proj", (d, h, k),
                                                       ("embed", "heads", "head_dim")))
    k_BSGK = jnp.einsum("bld,dgk->blgk", x_BLD, kernel("k_proj", (d, g, k),
                                                       ("embed", "kv_heads", "head_dim")))
    v_BSGK = jnp.einsum("bld,dgk->blgk", x_BLD, kernel("v_proj", (d, g, k),
                                                       ("embed", "kv_heads", "head_dim")))
    cos, sin = rope_angles(positions_BL, k, c.rope_theta)
    q_BLHK = apply_interleaved_rope(q_BLHK, cos, sin)
    k_BSGK = apply_interleaved_rope(k_BSGK, cos, sin)
    out_BLHK, _ = attend(q_BLHK, k_BSGK, v_BSGK, causal_segment_mask(segment_ids_BL), k ** -0.5)
    w_o_HKD = kernel("o_proj", (h, k, d), ("heads", "head_dim", "embed"))
    return jnp.einsum("blhk,hkd->bld", out_BLHK, w_o_HKD), {}
