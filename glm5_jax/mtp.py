"""Multi-token prediction: one MTP layer applied for `mtp_depths` steps with shared parameters.

docs/reference.md section 2 ("MTP"). Depth d = 1..mtp_depths at position i:

  h'      = eh_proj([enorm(emb(t_{i+d})) ; hnorm(h^{d-1}_i)])     (embedding first)
  h^d     = DecoderLayer(h')                                     (the one shared MTP layer)
  logits  = lm_head(shared_head_norm(h^d))                        predicts t_{i+d+1}

`h^0` is the main model's final hidden state after its final norm (as the released inference
engines pass it). Positions whose `t_{i+d}` lies past the end of the row see token 0, and in
packed rows the last d positions of a document see the next document's first tokens; those
predictions have no valid target and training masks them (targets must share the segment).
"""

import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.decoder import DecoderLayer
from glm5_jax.layers.norms import RMSNorm
from glm5_jax.layers.axes import BATCH, EMBED, LENGTH
from glm5_jax.layers.params import constrain, dtypes, kernels


def shift_tokens_left(tokens_BL, d: int):
  """`t_{i+d}` at position i, 0 past the end of the row."""
  return jnp.pad(tokens_BL, ((0, 0), (0, d)))[:, d:]


MTP_DEPTH_OUTPUT = "mtp_depth_output"


class MTPLayer(nn.Module):
  """One MTP step; HF names `enorm`, `hnorm`, `eh_proj` (`[2D, D]`), `shared_head.norm`
  (here `shared_head_norm`) and the decoder layer's own names (here under `layer`)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, h_prev_BLD, next_embed_BLD, positions_BL, segment_ids_BL, *,
               mode: Mode = Mode(), cache=None):
    """Returns `(h_BLD, normed_BLD, aux)`: the depth's output state (input to the next depth)
    and its `shared_head_norm`-ed version for the LM head. In `Mode(form="decode")`, `cache`
    is the layer's attention cache for this depth (`glm5_jax.infer.cache`, "MTP caches") and
    `aux["cache"]` its update."""
    c = self.cfg
    dtype, pdtype = dtypes(c)
    d = h_prev_BLD.shape[-1]
    # The inputs and `eh_proj`'s output stay sharded like the residual stream: left free, the
    # SPMD partitioner took `eh_proj`'s embed sharding (fsdp) for its output and, batch being
    # on fsdp too, replicated the embedding lookup of the whole global batch on every device
    # (`f32[64, 4096, 6144]` x 5 on fsdp 16 x expert 4 x tensor 4; docs/scaling.md).
    next_embed_BLD = constrain(next_embed_BLD, (BATCH, LENGTH, EMBED))
    h_prev_BLD = constrain(h_prev_BLD, (BATCH, LENGTH, EMBED))
    e_BLD = RMSNorm(c.rms_norm_eps, dtype, pdtype, name="enorm")(next_embed_BLD)
    h_BLD = RMSNorm(c.rms_norm_eps, dtype, pdtype, name="hnorm")(h_prev_BLD)
    w_eh_2DD = kernels(self, c.initializer_range, pdtype, dtype)("eh_proj", (2 * d, d),
                                                                 (None, EMBED))
    x_BLD = constrain(jnp.concatenate([e_BLD, h_BLD], axis=-1) @ w_eh_2DD,
                      (BATCH, LENGTH, EMBED))
    # The last layer's kind, or its `mtp_letter` (an 'R' layer's MTP copy needs an indexer).
    layer = DecoderLayer(c, c.attention_kind(c.num_hidden_layers),
                         c.is_moe_layer(c.num_hidden_layers), name="layer")
    x_BLD, aux = layer(x_BLD, positions_BL, segment_ids_BL, None, mode=mode, cache=cache)
    # Kept by every remat policy (`glm5_jax.model`): the depth's output, which the caller holds
    # anyway, is `shared_head_norm`'s input; recomputed, it would rerun the layer's whole FFN
    # (the experts' down projections too) for the norm's backward alone.
    x_BLD = checkpoint_name(x_BLD, MTP_DEPTH_OUTPUT)
    normed_BLD = RMSNorm(c.rms_norm_eps, dtype, pdtype, mix=c.head_norm_mix,
                         name="shared_head_norm")(x_BLD)
    return x_BLD, normed_BLD, aux
