"""SimpleGDN (letter L): the gated delta rule run directly on an M layer's own q/k/v/o weights.

docs/reference.md section 3 ("Long-context ablation"): "SimpleGDN = gated-delta-rule linear
attention that reuses the pretrained Q/K/V projections, no conv and no new gate modules". Per
token t and head h:

  1. q, k, v  = the M layer's projections with its interleaved RoPE
                (`mla_projections.mla_qkv`), so q . k is the pretrained attention logit up to
                scale; q and k are then scaled to unit L2 norm per head
  2. o_t      = gated delta rule (`delta_rule`) with per-head, data-independent gates:
                S_t = alpha_h (I - beta_h k k^T) S_{t-1} + beta_h k v^T, o_t = S_t^T q_t
                (chunked in training, recurrent with `Mode(form="absorbed")`)
  3. y        = o_proj(o)                       (no output norm or gate)

The report leaves the gates open; `model.simple_gdn_gates` picks one of two:
  "fixed"    no parameters at all: RetNet's per-head decays alpha_h = 1 - 2^(-5-h) (Sun et al.
             2023, "Retentive Network", section 2.2; head 0 forgets fastest, half-life ~22
             tokens, each next head twice as slowly) and beta_h = `model.simple_gdn_beta`.
  "learned"  two scalars per head (the kind's `extra_params`, letter L in
             `glm5_jax.attention.kinds`): log alpha_h = -exp(decay_rate_log_h),
             beta_h = sigmoid(beta_logit_h), initialized to exactly the fixed values, so a
             "learned" layer starts as the "fixed" one and a fixed -> learned conversion
             changes nothing until training moves them.
The parameters are the M layer's (`MLA_PARAMS`) and, in "learned" mode, only those two [H]
vectors.

Decode (`Mode(form="decode")`): the cache is the fp32 delta-rule state `[H, K, V]`
(`kinds._delta_rule_cache`), continued by the same recurrence as the absorbed form; a slot whose
first real token is at position 0 starts from zero; padded tokens leave it unchanged; with
more than one new token the aux also holds `cache_steps` (the state after each, `[B, L, ...]`).

Notation (docs/design.md): B batch, L length, D hidden, H heads, K key dim (N + R of MLA),
V value dim.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from glm5_jax.attention import decode_rows, delta_rule
from glm5_jax.attention.mla_projections import mla_output, mla_qkv
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.layers.axes import HEADS
from glm5_jax.layers.params import param

def retnet_log_decays(num_heads: int) -> np.ndarray:
  """float64 `[H]`: log(1 - 2^(-5-h)), computed with log1p so that heads whose decay rounds to
  1.0 in fp32 still keep their (tiny, nonzero) forgetting rate."""
  return np.log1p(-np.exp2(-5.0 - np.arange(num_heads)))


class SimpleGatedDeltaNet(nn.Module):
  """Same call signature and aux contract as `MLA` (returns an empty aux dict; decode:
  `cache` and, with more than one new token, `cache_steps`)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT=None, *,
               mode: Mode = Mode(), cache=None):
    """Args as `MLA.__call__`; `prev_topk_BLT` and `mode.dsa_stage` are unused, and `mode.form`
    "absorbed" selects the recurrent (decode) form of the delta rule. Returns `(y_BLD, aux)`."""
    del prev_topk_BLT  # no top-k, no indexer
    decode_rows.check_cache("SimpleGatedDeltaNet", mode.form, cache, ("state",))
    c = self.cfg
    h = c.num_attention_heads
    q_BLHK, k_BLHK, v_BLHV = mla_qkv(self, c, x_BLD, positions_BL)
    q_BLHK, k_BLHK = delta_rule.l2_normalize(q_BLHK), delta_rule.l2_normalize(k_BLHK)

    log_decay_H = retnet_log_decays(h)
    if c.simple_gdn_gates == "fixed":
      log_alpha_H = jnp.asarray(log_decay_H, jnp.float32)
      beta_H = jnp.full((h,), c.simple_gdn_beta, jnp.float32)
    elif c.simple_gdn_gates == "learned":
      rate_init = np.log(-log_decay_H)  # log alpha = -exp(rate): exactly the fixed decays
      beta_init = math.log(c.simple_gdn_beta / (1 - c.simple_gdn_beta))  # sigmoid^-1
      rate_H = param(self, "decay_rate_log", (h,), (HEADS,), jnp.float32,
                     lambda *_: jnp.asarray(rate_init, jnp.float32))
      logit_H = param(self, "beta_logit", (h,), (HEADS,), jnp.float32,
                      lambda *_: jnp.full((h,), beta_init, jnp.float32))
      log_alpha_H, beta_H = -jnp.exp(rate_H), jax.nn.sigmoid(logit_H)
    else:
      raise ValueError(f"model.simple_gdn_gates must be 'fixed' or 'learned', got "
                       f"{c.simple_gdn_gates!r}")
    log_alpha_BLH = jnp.broadcast_to(log_alpha_H, q_BLHK.shape[:3])
    beta_BLH = jnp.broadcast_to(beta_H, q_BLHK.shape[:3])

    aux = {}
    if mode.form == "decode":
      real_BL = decode_rows.real_tokens(segment_ids_BL)
      starts_B = decode_rows.sequence_starts(positions_BL, real_BL)
      state_BHKV = jnp.where(starts_B[:, None, None, None], 0.0, cache["state"])
      multi = real_BL.shape[1] > 1
      o_BLHV, state_BHKV, *states = delta_rule.gated_delta_rule_decode(
          q_BLHK, k_BLHK, v_BLHV, log_alpha_BLH, beta_BLH, real_BL, state_BHKV,
          return_states=multi)
      aux["cache"] = {"state": state_BHKV}
      if multi:
        aux["cache_steps"] = {"state": states[0]}
    else:
      o_BLHV, _ = delta_rule.gated_delta_rule(q_BLHK, k_BLHK, v_BLHV, log_alpha_BLH, beta_BLH,
                                              segment_ids_BL, recurrent=mode.form == "absorbed",
                                              chunk_size=c.gdn_chunk_size)
    return mla_output(self, c, o_BLHV), aux
