"""One pre-norm decoder layer: attention variant from the pattern letter, then FFN or MoE."""

from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.attention.mode import Mode
from glm5_jax.attention.modules import build_attention
from glm5_jax.config import ModelConfig
from glm5_jax.layers import ordering
from glm5_jax.layers.ffn import SwiGLU
from glm5_jax.layers.norms import RMSNorm
from glm5_jax.layers.params import dtypes
from glm5_jax.moe import MoE
from glm5_jax.routing_replay import selects_own_topk


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
               mode: Mode = Mode(), cache=None, routing=None, return_routing=False):
    """Returns `(x_BLD, aux)`; aux merges the attention's and the MoE's named outputs.

    Routing replay (`glm5_jax.routing_replay`): `routing` is this layer's `{"moe": [B, L, X],
    "dsa": [B, L, T]}` (either may be absent) to replay; `return_routing` adds the choices this
    layer used as `aux["routing"]` with the same keys (only the kinds this layer has: "moe" for
    an MoE FFN, "dsa" for a layer that selects its own top-k outside the "dense" stage).

    In `Mode(form="decode")`, `cache` is this layer's attention cache (a dict of `[B, ...]`
    arrays, `glm5_jax.infer.cache`), handed to the attention module, and `aux["cache"]` is its
    update; the FFN / MoE has no cache (padded tokens, segment id 0, are masked out of the
    MoE's routing as in training)."""
    c = self.cfg
    dtype, pdtype = dtypes(c)
    h_BLD = RMSNorm(c.rms_norm_eps, dtype, pdtype, name="input_layernorm")(x_BLD)
    attention = build_attention(self.attention_kind, c, "self_attn")
    # Only decode passes `cache=`: the training forward calls every kind exactly as before.
    extra = {"cache": cache} if mode.form == "decode" else {}
    routing = routing or {}
    if "dsa" in routing:
      extra["recorded_topk_BLT"] = routing["dsa"]
    attn_BLD, aux = attention(h_BLD, positions_BL, segment_ids_BL, prev_topk_BLT, mode=mode,
                              **extra)
    # Named for `model.remat_policy` save_selections_o_proj (glm5_jax.layers.remat). The sum
    # `x + attn` named instead failed the TPU compiler's memory-space assignment (744B
    # headline: "requires allocation in the alternate memory"); the projection's own output
    # compiles, at the same B L D numbers a layer.
    # Written whole before the residual add (`ordering.in_order`): fused into the projection
    # with the add and the next norm's sum of squares, the TPU compiler's estimate put the
    # product at 73% of the matrix unit's peak against 88% for its gradient (744B headline,
    # docs/scaling.md).
    (attn_BLD,) = ordering.in_order((attn_BLD,))
    x_BLD = x_BLD + checkpoint_name(attn_BLD, "o_proj_out")
    h_BLD = RMSNorm(c.rms_norm_eps, dtype, pdtype, name="post_attention_layernorm")(x_BLD)
    used = {}
    if return_routing and selects_own_topk(self.attention_kind) and "topk_indices" in aux:
      used["dsa"] = aux["topk_indices"]
    if self.moe:
      ffn_BLD, moe_aux = MoE(c, name="mlp")(h_BLD, segment_ids_BL != 0, routing.get("moe"))
      experts_BLX = moe_aux.pop("experts")
      if return_routing:
        used["moe"] = experts_BLX
      aux = {**aux, **moe_aux}
    else:
      ffn_BLD = SwiGLU(c.intermediate_size, c.initializer_range, dtype, pdtype, c.quant,
                       name="mlp")(h_BLD)
    if return_routing:
      aux["routing"] = used
    return x_BLD + ffn_BLD, aux
