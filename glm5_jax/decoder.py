"""One pre-norm decoder layer: attention variant from the pattern letter, then FFN or MoE."""

from flax import linen as nn

from glm5_jax.attention.kinds import KINDS_BY_NAME
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.layers.ffn import SwiGLU
from glm5_jax.layers.norms import RMSNorm
from glm5_jax.layers.params import dtypes
from glm5_jax.moe import MoE


class DecoderLayer(nn.Module):
  """`x + Attn(norm(x))`, then `+ FFN(norm(.))`; HF names `input_layernorm`, `self_attn`,
  `post_attention_layernorm`, `mlp`.

  `attention_kind` (a name in `glm5_jax.attention.kinds`) and `moe` are resolved by the caller
  from the config's per-layer patterns.
  """

  cfg: ModelConfig
  attention_kind: str
  moe: bool

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT=None, *,
               mode: Mode = Mode(), cache=None):
    """Returns `(x_BLD, aux)`; aux merges the attention's and the MoE's named outputs.

    In `Mode(form="decode")`, `cache` is this layer's attention cache (a dict of `[B, ...]`
    arrays, `glm5_jax.infer.cache`), handed to the attention module, and `aux["cache"]` is its
    update; the FFN / MoE has no cache (padded tokens, segment id 0, are masked out of the
    MoE's routing as in training)."""
    c = self.cfg
    dtype, pdtype = dtypes(c)
    h_BLD = RMSNorm(c.rms_norm_eps, dtype, pdtype, name="input_layernorm")(x_BLD)
    attention = KINDS_BY_NAME[self.attention_kind].build(c, "self_attn")
    # Only decode passes `cache=`: the training forward calls every kind exactly as before.
    extra = {"cache": cache} if mode.form == "decode" else {}
    attn_BLD, aux = attention(h_BLD, positions_BL, segment_ids_BL, prev_topk_BLT, mode=mode,
                              **extra)
    x_BLD = x_BLD + attn_BLD
    h_BLD = RMSNorm(c.rms_norm_eps, dtype, pdtype, name="post_attention_layernorm")(x_BLD)
    if self.moe:
      ffn_BLD, moe_aux = MoE(c, name="mlp")(h_BLD, segment_ids_BL != 0)
      aux = {**aux, **moe_aux}
    else:
      ffn_BLD = SwiGLU(c.intermediate_size, c.initializer_range, dtype, pdtype, name="mlp")(h_BLD)
    return x_BLD + ffn_BLD, aux
