"""Mixture of experts: sigmoid router with a selection-only bias, dropless ragged dispatch.

docs/reference.md section 2 ("MoE router"):

  s = sigmoid(x W_gate)                       fp32 [E]
  experts = top-X of (s + b)                  b: the loss-free-balancing correction bias, which
                                              steers selection only and is never trained by
                                              gradients (training moves it toward equal load)
  weights = s[experts] / sum(s[experts]) * routed_scaling_factor     (unbiased scores)
  y = sum_x weights_x * Expert_x(x) + SharedExperts(x)

With `n_group > 1` (not used by GLM-5) selection is first limited to the `topk_group` groups
whose two best biased scores sum highest, as in HF `GlmMoeDsaTopkRouter`.

Dispatch is dropless: the N*X (token, expert) pairs are sorted by expert and fed to
`jax.lax.ragged_dot`, one contiguous group per expert, so no token is ever dropped for capacity.
The router returns per-expert token counts for the balancing-bias update.

Notation: N tokens, D hidden, E experts, X experts per token, F expert intermediate, P = N * X.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.config import ModelConfig
from glm5_jax.layers.ffn import SwiGLU
from glm5_jax.layers.params import DTYPES, normal_kernel, param


def router_scores(x_ND, w_gate_DE):
  """Sigmoid affinities `[N, E]`, fp32."""
  return jax.nn.sigmoid(x_ND.astype(jnp.float32) @ w_gate_DE.astype(jnp.float32))


def sequence_balance_loss(scores_BLE, chosen_BLE, valid_BL, num_experts_per_tok):
  """DeepSeek-V3's sequence-wise balance loss `sum_e f_e P_e`, averaged over rows.

  f_e = E / (X * T) * (tokens of the row choosing e), P_e = mean over the row's tokens of the
  normalized affinity s_e / sum(s). Padding tokens count in neither.
  """
  e = scores_BLE.shape[-1]
  tokens_B = jnp.maximum(valid_BL.sum(-1), 1)
  f_BE = chosen_BLE.sum(1) * e / (num_experts_per_tok * tokens_B[:, None])
  normalized_BLE = scores_BLE / scores_BLE.sum(-1, keepdims=True) * valid_BL[..., None]
  p_BE = normalized_BLE.sum(1) / tokens_B[:, None]
  return (f_BE * p_BE).sum(-1).mean()


def route(x_ND, w_gate_DE, bias_E, *, num_experts_per_tok, routed_scaling_factor,
          norm_topk_prob=True, n_group=1, topk_group=1):
  """Chooses experts per token.

  Returns:
    `(weights_NX fp32, experts_NX int32)`.
  """
  scores_NE = router_scores(x_ND, w_gate_DE)
  choice_NE = scores_NE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
  if n_group > 1:
    n, e = choice_NE.shape
    grouped_NGM = choice_NE.reshape(n, n_group, e // n_group)
    group_scores_NG = jax.lax.top_k(grouped_NGM, 2)[0].sum(-1)
    _, best_groups = jax.lax.top_k(group_scores_NG, topk_group)
    keep_NG = jnp.zeros_like(group_scores_NG, dtype=bool).at[
        jnp.arange(n)[:, None], best_groups].set(True)
    choice_NE = jnp.where(jnp.repeat(keep_NG, e // n_group, axis=1), choice_NE, -jnp.inf)
  _, experts_NX = jax.lax.top_k(choice_NE, num_experts_per_tok)
  weights_NX = jnp.take_along_axis(scores_NE, experts_NX, axis=-1)
  if norm_topk_prob:
    weights_NX = weights_NX / (weights_NX.sum(-1, keepdims=True) + 1e-20)
  return weights_NX * routed_scaling_factor, experts_NX.astype(jnp.int32)


def dispatch_experts(x_ND, weights_NX, experts_NX, w_gate_EDF, w_up_EDF, w_down_EFD):
  """Applies each token's chosen SwiGLU experts, dropless, with `ragged_dot`.

  Returns:
    `(y_ND, counts_E)`: the weighted expert mixture and tokens routed to each expert.
  """
  n, x = experts_NX.shape
  num_experts = w_gate_EDF.shape[0]
  flat_experts_P = experts_NX.reshape(-1)
  order_P = jnp.argsort(flat_experts_P, stable=True)
  counts_E = jnp.bincount(flat_experts_P, length=num_experts).astype(jnp.int32)
  xs_PD = x_ND[order_P // x]
  h_PF = jax.nn.silu(jax.lax.ragged_dot(xs_PD, w_gate_EDF, counts_E)) * jax.lax.ragged_dot(
      xs_PD, w_up_EDF, counts_E)
  ys_PD = jax.lax.ragged_dot(h_PF, w_down_EFD, counts_E)
  # Un-sort with the inverse permutation and sum over a token's X experts: deterministic,
  # unlike a scatter-add whose accumulation order is unspecified.
  ys_NXD = ys_PD[jnp.argsort(order_P)].reshape(n, x, -1)
  y_ND = jnp.einsum("nxd,nx->nd", ys_NXD.astype(jnp.float32), weights_NX)
  return y_ND.astype(x_ND.dtype), counts_E


class MoE(nn.Module):
  """Routed experts + shared expert(s). HF names: `gate` (router kernel `[D, E]`),
  `e_score_correction_bias [E]` (fp32), `experts.{gate,up}_proj [E, D, F]`,
  `experts.down_proj [E, F, D]`, `shared_experts` (one SwiGLU of width F * n_shared_experts)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, valid_BL=None):
    """Args:
      x_BLD: normalized layer input.
      valid_BL: bool, False for padding tokens (they are routed but not counted as load).
    Returns:
      `(y_BLD, aux)` with `expert_counts` int32 `[E]` (non-padding tokens routed to each
      expert, for the loss-free balancing update) and `sequence_balance_loss` (scalar, the
      DeepSeek-V3 sequence-wise auxiliary loss before its small weight).
    """
    c = self.cfg
    dtype, pdtype = DTYPES[c.dtype], DTYPES[c.param_dtype]
    b, l, d = x_BLD.shape
    e, f = c.n_routed_experts, c.moe_intermediate_size
    w_router_DE = normal_kernel(self, "gate", (d, e), ("embed", None), c.initializer_range,
                                jnp.float32)
    bias_E = param(self, "e_score_correction_bias", (e,), (None,), jnp.float32,
                   nn.initializers.zeros)
    x_ND = x_BLD.reshape(b * l, d).astype(dtype)
    weights_NX, experts_NX = route(
        x_ND, w_router_DE, bias_E, num_experts_per_tok=c.num_experts_per_tok,
        routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob,
        n_group=c.n_group, topk_group=c.topk_group)
    experts = ExpertWeights(e, f, c.initializer_range, dtype, pdtype, name="experts")(d)
    y_ND, _ = dispatch_experts(x_ND, weights_NX, experts_NX, *experts)
    valid_BL = jnp.ones((b, l), bool) if valid_BL is None else valid_BL
    chosen_BLE = jax.nn.one_hot(experts_NX, e, dtype=jnp.float32).sum(1).reshape(b, l, e)
    chosen_BLE = chosen_BLE * valid_BL[..., None]
    counts_E = chosen_BLE.sum((0, 1)).astype(jnp.int32)
    balance = sequence_balance_loss(router_scores(x_ND, w_router_DE).reshape(b, l, e),
                                    chosen_BLE, valid_BL, c.num_experts_per_tok)
    y_BLD = y_ND.reshape(b, l, d)
    if c.n_shared_experts:
      y_BLD = y_BLD + SwiGLU(f * c.n_shared_experts, c.initializer_range, dtype, pdtype,
                             name="shared_experts")(x_BLD)
    return y_BLD, {"expert_counts": counts_E, "sequence_balance_loss": balance}


class ExpertWeights(nn.Module):
  """The stacked expert kernels, stored `[E, in, out]` so each expert is its own matrix."""

  num_experts: int
  intermediate_size: int
  init_std: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, hidden_size):
    e, f, d = self.num_experts, self.intermediate_size, hidden_size
    kernel = lambda name, shape, axes: normal_kernel(
        self, name, shape, axes, self.init_std, self.param_dtype).astype(self.dtype)
    return (kernel("gate_proj", (e, d, f), ("expert", "embed", "expert_mlp")),
            kernel("up_proj", (e, d, f), ("expert", "embed", "expert_mlp")),
            kernel("down_proj", (e, f, d), ("expert", "expert_mlp", "embed")))
