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

Notation (docs/design.md): B batch, L length, D hidden, H heads, K key dim (N + R of MLA),
V value dim, W conv taps; locally X is the channel dim of a conv input (K or V).
"""

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.attention import delta_rule
from glm5_jax.attention.mla_projections import mla_output, mla_qkv
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.layers.norms import RMSNorm
from glm5_jax.layers.axes import EMBED, HEAD_DIM, HEADS
from glm5_jax.layers.params import dtypes, kernels, param

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
  """Same call signature and aux contract as `MLA` (returns an empty aux dict)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT=None, *,
               mode: Mode = Mode()):
    """Args as `MLA.__call__`; `positions_BL`, `prev_topk_BLT` and `mode.dsa_stage` are unused,
    and `mode.form` "absorbed" selects the recurrent (decode) form of the delta rule instead of
    the chunked one. Returns `(y_BLD, {})`."""
    del positions_BL, prev_topk_BLT  # no RoPE, no top-k, no indexer
    c = self.cfg
    dtype, pdtype = dtypes(c)
    d, h, vd, w = x_BLD.shape[-1], c.num_attention_heads, c.v_head_dim, c.gdn_conv_size
    x_BLD = x_BLD.astype(dtype)
    q_BLHK, k_BLHK, v_BLHV = mla_qkv(self, c, x_BLD, positions_BL=None)

    def conv(name, x_BLHX):
      kernel_WHX = param(self, name, (w, h, x_BLHX.shape[-1]), (None, HEADS, HEAD_DIM),
                         pdtype, identity_conv_init).astype(dtype)
      return jax.nn.silu(causal_depthwise_conv(x_BLHX, kernel_WHX, segment_ids_BL))

    q_BLHK = delta_rule.l2_normalize(conv("q_conv1d", q_BLHK))
    k_BLHK = delta_rule.l2_normalize(conv("k_conv1d", k_BLHK))
    v_BLHV = conv("v_conv1d", v_BLHV)

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

    o_BLHV, _ = delta_rule.gated_delta_rule(q_BLHK, k_BLHK, v_BLHV, log_alpha_BLH, beta_BLH,
                                            segment_ids_BL, recurrent=mode.form == "absorbed",
                                            chunk_size=c.gdn_chunk_size)
    w_g_DHV = kernel("g_proj", (d, h, vd), (EMBED, HEADS, HEAD_DIM)).astype(dtype)
    gate_BLHV = jax.nn.silu(jnp.einsum("bld,dhv->blhv", x_BLD, w_g_DHV))
    o_BLHV = RMSNorm(c.rms_norm_eps, dtype, pdtype, name="o_norm")(o_BLHV)  # fp32 statistics
    return mla_output(self, c, o_BLHV * gate_BLHV), {}
