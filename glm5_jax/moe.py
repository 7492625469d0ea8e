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

Dispatch is dropless: the M*X (token, expert) pairs are sorted by expert and fed to a grouped
matmul (`glm5_jax.grouped_matmul`: `jax.lax.ragged_dot`, or on one GPU our Pallas Triton gmm),
one contiguous group per expert, so no token is ever dropped for capacity.
The router returns per-expert token counts for the balancing-bias update.
`model.moe_impl = "expert_parallel"` moves the pairs to the devices holding their experts
instead (`glm5_jax.moe_parallel`); routing, counts and the balance loss are shared.

Notation (docs/design.md): B batch, L sequence, M tokens (B * L), D hidden, E experts, X experts
per token, F expert intermediate, P = M * X routed pairs.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax import grouped_matmul, moe_parallel, routing_replay
from glm5_jax.config import ModelConfig
from glm5_jax.layers.axes import EMBED, EXPERT, EXPERT_MLP
from glm5_jax.layers.ffn import SwiGLU
from glm5_jax.layers.params import constrain, dtypes, kernels, normal_kernel, param
from glm5_jax.quant.linear import experts_int4, experts_int8, ragged_int_matmul
from glm5_jax.quant.ops import unpack_int4
from glm5_jax.quant.qat import fake_quant_int4


def router_scores(x_MD, w_gate_DE):
  """Sigmoid affinities `[M, E]`, fp32."""
  return jax.nn.sigmoid(x_MD.astype(jnp.float32) @ w_gate_DE.astype(jnp.float32))


def sequence_balance_loss(scores_BLE, chosen_BLE, valid_BL, num_experts_per_tok):
  """DeepSeek-V3's sequence-wise balance loss `sum_e f_e P_e`, averaged over rows.

  f_e = E / (X * n) * (tokens of the row choosing e), P_e = mean over the row's tokens of the
  normalized affinity s_e / sum(s), with n the row's non-padding tokens. Padding tokens count
  in neither.
  """
  e = scores_BLE.shape[-1]
  tokens_B = jnp.maximum(valid_BL.sum(-1), 1)
  f_BE = chosen_BLE.sum(1) * e / (num_experts_per_tok * tokens_B[:, None])
  normalized_BLE = scores_BLE / scores_BLE.sum(-1, keepdims=True) * valid_BL[..., None]
  p_BE = normalized_BLE.sum(1) / tokens_B[:, None]
  return (f_BE * p_BE).sum(-1).mean()


def route(x_MD, w_gate_DE, bias_E, *, num_experts_per_tok, routed_scaling_factor,
          norm_topk_prob=True, n_group=1, topk_group=1, recorded_experts_MX=None):
  """Chooses experts per token.

  `recorded_experts_MX` (routing replay, `glm5_jax.routing_replay`): the experts to use instead
  of the top-X, for every token whose row is not -1; the weights are still the current
  (unbiased) scores at those experts, normalized, so the router keeps its gradient.

  Returns:
    `(weights_MX fp32, experts_MX int32)`.
  """
  scores_ME = router_scores(x_MD, w_gate_DE)
  choice_ME = scores_ME + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
  if n_group > 1:
    m, e = choice_ME.shape
    grouped = choice_ME.reshape(m, n_group, e // n_group)  # [M, groups, experts per group]
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [M, groups]
    _, best_groups = jax.lax.top_k(group_scores, topk_group)
    keep_groups = jnp.zeros_like(group_scores, dtype=bool).at[
        jnp.arange(m)[:, None], best_groups].set(True)
    choice_ME = jnp.where(jnp.repeat(keep_groups, e // n_group, axis=1), choice_ME, -jnp.inf)
  _, experts_MX = jax.lax.top_k(choice_ME, num_experts_per_tok)
  if recorded_experts_MX is not None:
    experts_MX = routing_replay.replay(experts_MX, recorded_experts_MX)
  weights_MX = jnp.take_along_axis(scores_ME, experts_MX, axis=-1)
  if norm_topk_prob:
    weights_MX = weights_MX / (weights_MX.sum(-1, keepdims=True) + 1e-20)
  return weights_MX * routed_scaling_factor, experts_MX.astype(jnp.int32)


def dispatch_experts(x_MD, weights_MX, experts_MX, w_gate_EDF, w_up_EDF, w_down_EFD,
                     matmul="auto"):
  """Applies each token's chosen SwiGLU experts, dropless, with a grouped matmul.

  `matmul` (`model.moe_matmul`): "auto" = `grouped_matmul.global_impl()` (the Triton gmm on one
  GPU, where XLA would run `ragged_dot` dense over all experts; `ragged_dot` elsewhere), or an
  impl of `grouped_matmul.IMPLS`.

  Returns:
    `(y_MD, counts_E)`: the weighted expert mixture and tokens routed to each expert.
  """
  m, x = experts_MX.shape
  num_experts = w_gate_EDF.shape[0]
  flat_experts_P = experts_MX.reshape(-1)
  order_P = jnp.argsort(flat_experts_P, stable=True)
  counts_E = jnp.bincount(flat_experts_P, length=num_experts).astype(jnp.int32)
  xs_PD = x_MD[order_P // x]
  impl = grouped_matmul.global_impl() if matmul == "auto" else matmul
  ys_PD = grouped_matmul.expert_mlp(xs_PD, w_gate_EDF, w_up_EDF, w_down_EFD, counts_E, impl)
  # Un-sort with the inverse permutation and sum over a token's X experts: deterministic,
  # unlike a scatter-add whose accumulation order is unspecified.
  ys_MXD = ys_PD[jnp.argsort(order_P)].reshape(m, x, -1)
  y_MD = jnp.einsum("mxd,mx->md", ys_MXD.astype(jnp.float32), weights_MX)
  return y_MD.astype(x_MD.dtype), counts_E


def dispatch_quantized_experts(x_MD, weights_MX, experts_MX, gate, up, down):
  """`dispatch_experts` over integer expert kernels (`(q int8 [E, I, O], scale [E, G, O])` per
  projection, G = 1 for INT8 per channel, I / group for INT4): INT8 activations per token and
  int32 accumulation (`quant.linear.ragged_int_matmul`). Returns `y_MD`."""
  m, x = experts_MX.shape
  num_experts = gate[0].shape[0]
  flat_experts_P = experts_MX.reshape(-1)
  order_P = jnp.argsort(flat_experts_P, stable=True)
  counts_E = jnp.bincount(flat_experts_P, length=num_experts).astype(jnp.int32)
  rows_expert_P = flat_experts_P[order_P]
  xs_PD = x_MD[order_P // x]
  mm = lambda h, qs: ragged_int_matmul(h, *qs, counts_E, rows_expert_P, x_MD.dtype)
  h_PF = jax.nn.silu(mm(xs_PD, gate)) * mm(xs_PD, up)
  ys_PD = mm(h_PF, down)
  ys_MXD = ys_PD[jnp.argsort(order_P)].reshape(m, x, -1)
  y_MD = jnp.einsum("mxd,mx->md", ys_MXD.astype(jnp.float32), weights_MX)
  return y_MD.astype(x_MD.dtype)


class MoE(nn.Module):
  """Routed experts + shared expert(s). HF names: `gate` (router kernel `[D, E]`),
  `e_score_correction_bias [E]` (fp32), `experts.{gate,up}_proj [E, D, F]`,
  `experts.down_proj [E, F, D]`, `shared_experts` (one SwiGLU of width F * n_shared_experts)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, valid_BL=None, recorded_experts_BLX=None):
    """Args:
      x_BLD: normalized layer input.
      valid_BL: bool, False for padding tokens (they are routed but not counted as load).
      recorded_experts_BLX: int32 experts to replay (`route`), -1 rows choose their own.
    Returns:
      `(y_BLD, aux)` with `expert_counts` int32 `[E]` (non-padding tokens routed to each
      expert, for the loss-free balancing update), `sequence_balance_loss` (scalar, the
      DeepSeek-V3 sequence-wise auxiliary loss before its small weight), `experts` int32
      `[B, L, X]` (the experts used; callers that do not read it let XLA drop it) and, with a
      capacity factor, `moe_dropped_fraction` f32 `[shards]`: the fraction of pairs dropped,
      per token shard of the expert-parallel dispatch (sum it: `train.losses`).
    """
    c = self.cfg
    dtype, pdtype = dtypes(c)
    b, l, d = x_BLD.shape
    e, f = c.n_routed_experts, c.moe_intermediate_size
    w_router_DE = normal_kernel(self, "gate", (d, e), (EMBED, None), c.initializer_range,
                                jnp.float32)
    bias_E = param(self, "e_score_correction_bias", (e,), (None,), jnp.float32,
                   nn.initializers.zeros)
    x_MD = x_BLD.reshape(b * l, d).astype(dtype)
    weights_MX, experts_MX = route(
        x_MD, w_router_DE, bias_E, num_experts_per_tok=c.num_experts_per_tok,
        routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob,
        n_group=c.n_group, topk_group=c.topk_group,
        recorded_experts_MX=None if recorded_experts_BLX is None else
        recorded_experts_BLX.reshape(b * l, -1))
    experts = ExpertWeights(e, f, c.initializer_range, dtype, pdtype, c.qat_int4_group_size,
                            c.quant, c.quant_group_size, name="experts")(d)
    shared_experts = (SwiGLU(f * c.n_shared_experts, c.initializer_range, dtype, pdtype, c.quant,
                             name="shared_experts") if c.n_shared_experts else None)
    valid_BL = jnp.ones((b, l), bool) if valid_BL is None else valid_BL
    chosen_BLE = jax.nn.one_hot(experts_MX, e, dtype=jnp.float32).sum(1).reshape(b, l, e)
    chosen_BLE = chosen_BLE * valid_BL[..., None]
    counts_E = chosen_BLE.sum((0, 1)).astype(jnp.int32)
    balance = sequence_balance_loss(router_scores(x_MD, w_router_DE).reshape(b, l, e),
                                    chosen_BLE, valid_BL, c.num_experts_per_tok)
    shared_BLD = None
    if c.moe_impl == "expert_parallel" and moe_parallel.context_mesh() is not None:
      # The shared experts' kernel gathers and the load counts' all-reduce before any row
      # moves: a synchronous collective issued while the exchanges are in flight waits for
      # them (moe_parallel, "Weights before rows"). The shared experts' products, with no
      # collective left in them, may then run beside the exchanges.
      if shared_experts is not None:
        shared_BLD, x_MD = shared_experts(x_BLD, gathered_before=x_MD)
      # float kernels, or integer ones as (q, scale) per projection
      y_MD, dropped_S, (counts_E, balance) = moe_parallel.expert_parallel_dispatch(
          x_MD, weights_MX, experts_MX, *experts, transport=c.moe_transport,
          matmul=c.moe_matmul, capacity_factor=c.moe_capacity_factor,
          chunks=c.moe_dispatch_chunks, computed_first=(counts_E, balance))
    elif c.quant != "none":  # integer kernels: (q, scale) per projection
      y_MD = dispatch_quantized_experts(x_MD, weights_MX, experts_MX, *experts)
      dropped_S = jnp.zeros((1,), jnp.float32)
    else:  # "ragged", or no mesh in context (init, one device): the same numbers, locally
      y_MD, _ = dispatch_experts(x_MD, weights_MX, experts_MX, *experts, matmul=c.moe_matmul)
      dropped_S = jnp.zeros((1,), jnp.float32)
    y_BLD = y_MD.reshape(b, l, d)
    if shared_experts is not None:
      y_BLD = y_BLD + (shared_experts(x_BLD) if shared_BLD is None else shared_BLD)
    aux = {"expert_counts": counts_E, "sequence_balance_loss": balance,
           "experts": experts_MX.reshape(b, l, -1)}
    if c.moe_capacity_factor:  # pairs dropped for capacity (none without a mesh), per shard
      aux["moe_dropped_fraction"] = dropped_S
    return y_BLD, aux


class ExpertWeights(nn.Module):
  """The stacked expert kernels, stored `[E, in, out]` so each expert is its own matrix; with
  `qat_group_size` > 0 each is fake-quantized to INT4 per group of input rows
  (`glm5_jax.quant.qat`, straight-through gradient) before the cast to `dtype`."""

  num_experts: int
  intermediate_size: int
  init_std: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype
  qat_group_size: int = 0
  quant: str = "none"  # "w8a8": INT8 per channel; "w4a8": INT4 per group, packed
  quant_group_size: int = 128

  @nn.compact
  def __call__(self, hidden_size):
    """Returns the three kernels in `dtype`, or for a quantized model `(q int8 [E, I, O], scale
    [E, G, O])` each (INT4 stored packed, unpacked here)."""
    e, f, d = self.num_experts, self.intermediate_size, hidden_size
    if self.quant != "none":
      return tuple(self._quantized(name, shape, axes) for name, shape, axes in (
          ("gate_proj", (e, d, f), (EXPERT, EMBED, EXPERT_MLP)),
          ("up_proj", (e, d, f), (EXPERT, EMBED, EXPERT_MLP)),
          ("down_proj", (e, f, d), (EXPERT, EXPERT_MLP, EMBED))))
    stored = kernels(self, self.init_std, self.param_dtype)

    def kernel(name, shape, axes):
      w = stored(name, shape, axes)
      if self.qat_group_size:
        w = fake_quant_int4(w, self.qat_group_size)
      return constrain(w.astype(self.dtype), axes)

    return (kernel("gate_proj", (e, d, f), (EXPERT, EMBED, EXPERT_MLP)),
            kernel("up_proj", (e, d, f), (EXPERT, EMBED, EXPERT_MLP)),
            kernel("down_proj", (e, f, d), (EXPERT, EXPERT_MLP, EMBED)))

  def _quantized(self, name, shape, axes):
    if self.quant == "w4a8":
      packed, scale = experts_int4(self, name, shape, axes, self.quant_group_size)
      return unpack_int4(packed), scale
    return experts_int8(self, name, shape, axes)
