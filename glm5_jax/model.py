"""The GLM-5 decoder assembled from config: embedding, decoder layers, final norm, LM head, MTP.

Notation: B batch, L sequence, D hidden, V vocab, T top-k.
"""

import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.decoder import DecoderLayer
from glm5_jax.layers.norms import RMSNorm
from glm5_jax.layers.params import DTYPES, normal_kernel
from glm5_jax.mtp import MTPLayer, shift_tokens_left

ACTIVATION_AXES = ("batch", "length", "embed")


class GLM5(nn.Module):
  """GLM-5 causal LM. Params: `embed_tokens [V, D]`, `layers_{i}`, `norm`, `lm_head [D, V]`
  (untied), and `mtp` when `num_nextn_predict_layers == 1`."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None, *,
               mode: Mode = Mode(), mtp=True):
    """Args:
      tokens_BL: int token ids.
      positions_BL: int positions; default `0..L-1` per row.
      segment_ids_BL: document ids of packed rows; default one document per row.
      mode: how the attention layers compute (`glm5_jax.attention.mode.Mode`): the expanded
        or absorbed (decode) form, and the DSA stage (default: expanded, sparse).
      mtp: also run the MTP depths (when the model has an MTP layer).
    Returns:
      dict with `logits` fp32 `[B, L, V]`; `mtp_logits` fp32 `[mtp_depths, B, L, V]` (depth d
      at position i predicts token i+d+1; absent when MTP is off); `hidden` `[B, L, D]` (after
      the final norm); `aux` = {"layers": {"layers_{i}": aux}, "mtp": [aux per depth]}.
    """
    c = self.cfg
    dtype, pdtype = DTYPES[c.dtype], DTYPES[c.param_dtype]
    b, l = tokens_BL.shape
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    if segment_ids_BL is None:
      segment_ids_BL = jnp.ones((b, l), jnp.int32)

    embedding_VD = normal_kernel(self, "embed_tokens", (c.vocab_size, c.hidden_size),
                                 ("vocab", "embed"), c.initializer_range, pdtype)
    w_head_DV = normal_kernel(self, "lm_head", (c.hidden_size, c.vocab_size),
                              ("embed", "vocab"), c.initializer_range, pdtype).astype(dtype)
    final_norm = RMSNorm(c.rms_norm_eps, dtype, pdtype, name="norm")

    def lm_head(h_BLD):
      return jnp.einsum("bld,dv->blv", h_BLD.astype(dtype), w_head_DV,
                        preferred_element_type=jnp.float32)

    x_BLD = jnp.take(embedding_VD, tokens_BL, axis=0).astype(dtype)
    layer_aux, prev_topk_BLT = {}, None
    for i in range(c.num_hidden_layers):
      x_BLD = nn.with_logical_constraint(x_BLD, ACTIVATION_AXES)
      layer = DecoderLayer(c, c.attention_kind(i), c.is_moe_layer(i), name=f"layers_{i}")
      x_BLD, aux = layer(x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT, mode=mode)
      prev_topk_BLT = aux.get("topk_indices", prev_topk_BLT)
      layer_aux[f"layers_{i}"] = aux
    hidden_BLD = final_norm(x_BLD)
    out = {"logits": lm_head(hidden_BLD), "hidden": hidden_BLD,
           "aux": {"layers": layer_aux, "mtp": []}}

    # Initialization runs one depth (the depths share the layer's params), even when the config
    # has zero depths, so the declared MTP layer's params exist (e.g. to load a checkpoint).
    depths = 1 if self.is_initializing() else c.mtp_depths * mtp
    if c.num_nextn_predict_layers and depths:
      mtp_layer = MTPLayer(c, name="mtp")
      h_BLD, mtp_logits = hidden_BLD, []
      for depth in range(1, depths + 1):
        next_tokens_BL = shift_tokens_left(tokens_BL, depth)
        next_embed_BLD = jnp.take(embedding_VD, next_tokens_BL, axis=0).astype(dtype)
        h_BLD, normed_BLD, aux = mtp_layer(h_BLD, next_embed_BLD, positions_BL, segment_ids_BL,
                                           mode=mode)
        mtp_logits.append(lm_head(normed_BLD))
        out["aux"]["mtp"].append(aux)
      out["mtp_logits"] = jnp.stack(mtp_logits)
    return out
