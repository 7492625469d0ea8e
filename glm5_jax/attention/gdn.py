"""Gated DeltaNet (letter N): gated-delta-rule linear attention on MLA-shaped projections.

Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (arXiv
2412.06464), as laid out by fla-org/flash-linear-attention's `GatedDeltaNet` layer; the long-
context ablation of docs/reference.md section 3 converts half of a model's layers to it. For
token t, per head h:

  1. q, k, v      = the M layer's projections (`mla_projections.mla_qkv`, no RoPE: position
                    comes from the convolutions and the decay), [H, K], [H, K], [H, V]
  2. q, k, v      = SiLU(causal depthwise conv over the last `gdn_conv_size` positions of the
                    same document), then q, k scaled to unit L2 norm per head
  3. alpha_t      = exp(-exp(A_log) * softplus(x W_a + dt_bias))   in (0, 1], per head
     beta_t       = sigmoid(x W_b)                                in (0, 1), per head
  4. o_t          = gated delta rule (`delta_rule`): S_t = alpha_t (I - beta_t k k^T) S_{t-1}
                    + beta_t k v^T, o_t = S_t^T q_t; chunked form in training, recurrent form
                    with `Mode(form="absorbed")` (the decode form, as for MLA)
  5. y            = o_proj(RMSNorm(o) * SiLU(x W_g))       (RMSNorm over V, shared by heads)

Parameters: the M layer's (`MLA_PARAMS`, same names, shapes and init) plus the kind's
`extra_params` (`glm5_jax.attention.kinds`, letter N): `{q,k,v}_conv1d [W, H, K|V]`,
`a_proj [D, H]`, `b_proj [D, H]`, `A_log [H]`, `dt_bias [H]`, `g_proj [D, H, V]`, `o_norm`
(scale [V]). Converting a trained M layer reuses every MLA weight
and initializes only these. Their init:
  convs    identity on the newest tap (the kernel passes x_t through), so a converted layer
           starts from the pretrained q/k/v and a fresh one learns the mixing from there;
  A_log    log(U[1, 16]) and dt_bias softplus^-1(exp(U[log 1e-3, log 1e-1])) (Mamba2's decay
           init, as in the paper's code);
  a/b/g    N(0, initializer_range) like every other projection; o_norm scale 1.

Decode (`Mode(form="decode")`): the cache holds the delta-rule state (fp32 `[H, K, V]`) and the
last `gdn_conv_size - 1` inputs of each conv (`kinds._gdn_cache`); the L new tokens run
through the same conv and the same recurrence (`delta_rule.gated_delta_rule_recurrent`, the
absorbed form) continued from the cache. A slot whose first real token is at position 0 starts
from zeros (a new sequence, whatever the slot held). Padded tokens leave state and conv inputs
unchanged. With L > 1 the aux also holds `cache_steps`: every cache entry after each new token
(`[B, L, ...]`), from which `glm5_jax.infer.rollback` picks the accepted one.

Notation (docs/design.md): B batch, L length, D hidden, H heads, K key dim (N + R of MLA),
V value dim, W conv taps; locally X is the channel dim of a conv input (K or V).
"""

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.attention import decode_rows, delta_rule
from glm5_jax.attention.mla_projections import mla_output, mla_qkv
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.layers.norms import RMSNorm
from glm5_jax.layers.axes import EMBED, HEAD_DIM, HEADS
from glm5_jax.layers.params import dtypes, kernels, param

CACHE_KEYS = ("state", "conv_q", "conv_k", "conv_v")
A_INIT_RANGE = (1.0, 16.0)
DT_INIT_RANGE = (1e-3, 1e-1)


def identity_conv_init(key, shape, dtype=jnp.float32):
  """`[W, ...]` depthwise kernel that passes the newest input through: tap W-1 is 1."""
  del key
  return jnp.zeros(shape, dtype).at[-1].set(1.0)


def a_log_init(key, shape, dtype=jnp.float32):
  return jnp.log(jax.random.uniform(key, shape, jnp.float32, *A_INIT_RANGE)).astype(dtype)


def dt_bias_init(key, shape, dtype=jnp.float32):
  """softplus^-1(dt), dt log-uniform in DT_INIT_RANGE: softplus(dt_bias) = dt at x = 0."""
  low, high = (math.log(x) for x in DT_INIT_RANGE)
  dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, low, high))
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def causal_depthwise_conv(x_BLHX, kernel_WHX, segment_ids_BL):
  """`y_t = sum_j kernel[W-1-j] * x_{t-j}` over taps j < W whose position t-j >= 0 lies in the
  same run of segment ids as t (no mixing across packed documents). Per channel (depthwise);
  the last tap multiplies the current position (PyTorch `Conv1d` order)."""
  w = kernel_WHX.shape[0]
  length = x_BLHX.shape[1]
  runs_BL = delta_rule.segment_runs(segment_ids_BL)
  y_BLHX = x_BLHX * kernel_WHX[w - 1]
  for j in range(1, min(w, length)):
    shifted_BLHX = jnp.pad(x_BLHX, [(0, 0), (j, 0), (0, 0), (0, 0)])[:, :length]
    shifted_runs_BL = jnp.pad(runs_BL, [(0, 0), (j, 0)], constant_values=-1)[:, :length]
    same_BL = shifted_runs_BL == runs_BL
    y_BLHX = y_BLHX + jnp.where(same_BL[..., None, None], shifted_BLHX, 0) * kernel_WHX[w - 1 - j]
  return y_BLHX


class GatedDeltaNet(nn.Module):
  """Same call signature and aux contract as `MLA` (returns an empty aux dict; decode:
  `cache` and, with more than one new token, `cache_steps`)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT=None, *,
               mode: Mode = Mode(), cache=None):
    """Args as `MLA.__call__`; `prev_topk_BLT` and `mode.dsa_stage` are unused, `positions_BL`
    only marks sequence starts in decode, and `mode.form` "absorbed" selects the recurrent
    (decode) form of the delta rule instead of the chunked one. Returns `(y_BLD, aux)`."""
    del prev_topk_BLT  # no RoPE, no top-k, no indexer
    decode_rows.check_cache("GatedDeltaNet", mode.form, cache, CACHE_KEYS)
    c = self.cfg
    dtype, pdtype = dtypes(c)
    d, h, vd, w = x_BLD.shape[-1], c.num_attention_heads, c.v_head_dim, c.gdn_conv_size
    x_BLD = x_BLD.astype(dtype)
    qkv = dict(zip("qkv", mla_qkv(self, c, x_BLD, positions_BL=None)))
    conv_WHX = {name: param(self, f"{name}_conv1d", (w, h, qkv[name].shape[-1]),
                            (None, HEADS, HEAD_DIM), pdtype, identity_conv_init).astype(dtype)
                for name in "qkv"}

    # Gates in fp32: log alpha = -A * softplus(.) is computed directly in log space.
    kernel = kernels(self, c.initializer_range, pdtype)  # cast per use: gates run in fp32
    x32_BLD = x_BLD.astype(jnp.float32)
    a_log_H = param(self, "A_log", (h,), (HEADS,), jnp.float32, a_log_init)
    dt_bias_H = param(self, "dt_bias", (h,), (HEADS,), jnp.float32, dt_bias_init)
    dt_BLH = jax.nn.softplus(
        jnp.einsum("bld,dh->blh", x32_BLD, kernel("a_proj", (d, h), (EMBED, HEADS))
                   .astype(jnp.float32)) + dt_bias_H)
    log_alpha_BLH = -jnp.exp(a_log_H) * dt_BLH
    beta_BLH = jax.nn.sigmoid(
        jnp.einsum("bld,dh->blh", x32_BLD, kernel("b_proj", (d, h), (EMBED, HEADS))
                   .astype(jnp.float32)))

    aux = {}
    if mode.form == "decode":
      o_BLHV, aux = _decode(qkv, conv_WHX, log_alpha_BLH, beta_BLH, positions_BL,
                            segment_ids_BL, cache)
    else:
      conv = lambda name: jax.nn.silu(causal_depthwise_conv(qkv[name], conv_WHX[name],
                                                            segment_ids_BL))
      o_BLHV, _ = delta_rule.gated_delta_rule(
          delta_rule.l2_normalize(conv("q")), delta_rule.l2_normalize(conv("k")), conv("v"),
          log_alpha_BLH, beta_BLH, segment_ids_BL, recurrent=mode.form == "absorbed",
          chunk_size=c.gdn_chunk_size)
    w_g_DHV = kernel("g_proj", (d, h, vd), (EMBED, HEADS, HEAD_DIM)).astype(dtype)
    gate_BLHV = jax.nn.silu(jnp.einsum("bld,dhv->blhv", x_BLD, w_g_DHV))
    o_BLHV = RMSNorm(c.rms_norm_eps, dtype, pdtype, name="o_norm")(o_BLHV)  # fp32 statistics
    return mla_output(self, c, o_BLHV * gate_BLHV), aux


def conv_decode(x_BLHX, kernel_WHX, inputs_BWHX, real_BL, starts_B):
  """The causal conv of L new tokens continued from the cached inputs: the cached inputs and the
  real new ones, compacted in order (padding may sit anywhere), run through
  `causal_depthwise_conv`.

  Args:
    x_BLHX: the new tokens' conv inputs.
    kernel_WHX: the conv kernel, W taps.
    inputs_BWHX: the cache: the last W - 1 real inputs, oldest first (zeros before a sequence's
      first token, exactly what the training conv sees there).
    real_BL: the real new tokens.
    starts_B: slots where a new sequence starts (the cached inputs are ignored).
  Returns:
    `(y_BLHX, inputs_BLWHX)`: the conv outputs (padded tokens' are meaningless) and the cached
    inputs after each new token (the last is the new cache).
  """
  taps = inputs_BWHX.shape[1]
  b, l = real_BL.shape
  inputs_BWHX = jnp.where(starts_B[:, None, None, None], 0, inputs_BWHX).astype(x_BLHX.dtype)
  rank_BL = jnp.cumsum(real_BL, axis=1, dtype=jnp.int32) - 1  # index among the real tokens
  seq_BSHX = decode_rows.write_rows(
      jnp.concatenate([inputs_BWHX, jnp.zeros_like(x_BLHX)], axis=1), x_BLHX, taps + rank_BL,
      real_BL)
  y_BSHX = causal_depthwise_conv(seq_BSHX, kernel_WHX, jnp.ones((b, taps + l), jnp.int32))
  at = lambda index_BL: jnp.take_along_axis(y_BSHX, index_BL[:, :, None, None], axis=1)
  y_BLHX = at(taps + jnp.maximum(rank_BL, 0))
  # After c real tokens the last `taps` inputs are seq[c : c + taps].
  window_BLW = (rank_BL + 1)[:, :, None] + jnp.arange(taps)
  inputs_BLWHX = seq_BSHX[jnp.arange(b)[:, None, None], window_BLW]
  return y_BLHX, inputs_BLWHX


def _decode(qkv, conv_WHX, log_alpha_BLH, beta_BLH, positions_BL, segment_ids_BL, cache):
  """The decode branch: convs and recurrence continued from `cache`. Returns `(o_BLHV, aux)`."""
  real_BL = decode_rows.real_tokens(segment_ids_BL)
  starts_B = decode_rows.sequence_starts(positions_BL, real_BL)
  conv, inputs_steps = {}, {}
  for name in "qkv":
    cached = cache[f"conv_{name}"]
    # Rounded through the cache dtype now, as later calls will read them: chunking-independent.
    x_BLHX = qkv[name].astype(cached.dtype).astype(qkv[name].dtype)
    y_BLHX, inputs_steps[f"conv_{name}"] = conv_decode(x_BLHX, conv_WHX[name], cached, real_BL,
                                                       starts_B)
    conv[name] = jax.nn.silu(y_BLHX)
  state_BHKV = jnp.where(starts_B[:, None, None, None], 0.0, cache["state"])
  l = real_BL.shape[1]
  o_BLHV, final_BHKV, *states = delta_rule.gated_delta_rule_decode(
      delta_rule.l2_normalize(conv["q"]), delta_rule.l2_normalize(conv["k"]), conv["v"],
      log_alpha_BLH, beta_BLH, real_BL, state_BHKV, return_states=l > 1)
  steps = {"state": states[0] if states else final_BHKV[:, None]}
  for key, inputs_BLWHX in inputs_steps.items():
    steps[key] = inputs_BLWHX.astype(cache[key].dtype)
  aux = {"cache": {key: value[:, -1] for key, value in steps.items()}}
  if l > 1:
    aux["cache_steps"] = steps
  return o_BLHV, aux
