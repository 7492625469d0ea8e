"""The GLM-5 decoder assembled from config: embedding, decoder layers, final norm, LM head, MTP.

Notation (docs/design.md): B batch, L sequence, D hidden, Y vocab, T top-k, U MTP depths.
"""

import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.decoder import DecoderLayer
from glm5_jax.layers.norms import RMSNorm
from glm5_jax.layers.axes import BATCH, EMBED, LENGTH, VOCAB
from glm5_jax.layers.params import constrain, dtypes, kernels, normal_kernel
from glm5_jax.mtp import MTPLayer, shift_tokens_left

ACTIVATION_AXES = (BATCH, LENGTH, EMBED)


class GLM5(nn.Module):
  """GLM-5 causal LM. Params: `embed_tokens [Y, D]`, `layers_{i}`, `norm`, `lm_head [D, Y]`
  (untied), and `mtp` when `num_nextn_predict_layers == 1`.

  Token ids outside `[0, vocab_size)`: `glm5_jax.forward` and `glm5_jax.logits` refuse them on
  concrete inputs. Traced (under jit) they cannot be refused, so they are contained: such an id
  embeds as the zero vector (never another token's row: negative ids do not wrap), and every
  logit row that reads it directly is NaN: the main logits at its position and, for MTP depth d,
  the positions i whose t_i or t_{i+d} it is. Other positions stay finite (later ones attend to
  the zero embedding), so one bad id marks itself instead of turning the whole row to NaN.
  """

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
      dict with `logits` fp32 `[B, L, Y]`; `mtp_logits` fp32 `[U, B, L, Y]` (depth d
      at position i predicts token i+d+1; absent when MTP is off); `hidden` `[B, L, D]` (after
      the final norm); `aux` = {"layers": {"layers_{i}": aux}, "mtp": [aux per depth]}.
    """
    c = self.cfg
    dtype, pdtype = dtypes(c)
    b, l = tokens_BL.shape
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    if segment_ids_BL is None:
      segment_ids_BL = jnp.ones((b, l), jnp.int32)

    embedding_YD = normal_kernel(self, "embed_tokens", (c.vocab_size, c.hidden_size),
                                 (VOCAB, EMBED), c.initializer_range, pdtype)
    w_head_DY = kernels(self, c.initializer_range, pdtype, dtype)(
        "lm_head", (c.hidden_size, c.vocab_size), (EMBED, VOCAB))
    final_norm = RMSNorm(c.rms_norm_eps, dtype, pdtype, name="norm")

    def embed(tokens_BL, valid_BL):
      rows_BLD = jnp.take(embedding_YD, jnp.where(valid_BL, tokens_BL, 0), axis=0)
      return jnp.where(valid_BL[..., None], rows_BLD, 0).astype(dtype)

    def lm_head(h_BLD, valid_BL):
      # NaN in the [B, L, D] input, not the [B, L, Y] output: the matmul spreads it over the
      # row at no extra cost.
      h_BLD = jnp.where(valid_BL[..., None], h_BLD.astype(dtype), jnp.nan)
      return jnp.einsum("bld,dy->bly", h_BLD, w_head_DY, preferred_element_type=jnp.float32)

    valid_BL = (tokens_BL >= 0) & (tokens_BL < c.vocab_size)
    x_BLD = embed(tokens_BL, valid_BL)
    layer_aux, prev_topk_BLT = {}, None
    for i in range(c.num_hidden_layers):
      x_BLD = constrain(x_BLD, ACTIVATION_AXES)
      layer = DecoderLayer(c, c.attention_kind(i), c.is_moe_layer(i), name=f"layers_{i}")
      x_BLD, aux = layer(x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT, mode=mode)
      prev_topk_BLT = aux.get("topk_indices", prev_topk_BLT)
      layer_aux[f"layers_{i}"] = aux
    hidden_BLD = final_norm(x_BLD)
    out = {"logits": lm_head(hidden_BLD, valid_BL), "hidden": hidden_BLD,
           "aux": {"layers": layer_aux, "mtp": []}}

    # Initialization runs one depth (the depths share the layer's params), even when the config
    # has zero depths, so the declared MTP layer's params exist (e.g. to load a checkpoint).
    depths = 1 if self.is_initializing() else c.mtp_depths * mtp
    if c.num_nextn_predict_layers and depths:
      mtp_layer = MTPLayer(c, name="mtp")
      h_BLD, mtp_logits = hidden_BLD, []
      for depth in range(1, depths + 1):
        next_tokens_BL = shift_tokens_left(tokens_BL, depth)
        next_valid_BL = (next_tokens_BL >= 0) & (next_tokens_BL < c.vocab_size)
        h_BLD, normed_BLD, aux = mtp_layer(h_BLD, embed(next_tokens_BL, next_valid_BL),
                                           positions_BL, segment_ids_BL, mode=mode)
        mtp_logits.append(lm_head(normed_BLD, valid_BL & next_valid_BL))
        out["aux"]["mtp"].append(aux)
      out["mtp_logits"] = jnp.stack(mtp_logits)
    return out
