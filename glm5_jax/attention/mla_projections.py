"""MLA's query/key/value and output projections: the one definition of those weights.

`mla.MLA` (softmax, dense or DSA) declares its projections here, and the linear-attention
layers (N: `gdn.GatedDeltaNet`, L: `simple_gdn.SimpleGatedDeltaNet`) read
their q, k, v and output projection from exactly the parameters an M layer stores, under the
same names, shapes, logical axes and initialization, so a trained M layer converts to them with
every one of these weights reused as is (`glm5_jax.convert.attention_pattern`):

  cq      = RMSNorm(x q_a_proj) [+ q_a_proj_bias]                       q_a_layernorm   [Q]
  q       = cq q_b_proj                                                [H, N + R]
  c, kr   = split(x kv_a_proj_with_mqa, [C, R]);  c = RMSNorm(c)        kv_a_layernorm  [C], [R]
  k       = [c k_b_proj | kr broadcast to every head]                  [H, N + R]
  v       = c v_b_proj                                                 [H, V]
  y       = o o_proj, summed over [H, V] [+ o_proj_bias]                [D]

(docs/reference.md section 2, "MLA".) With `positions_BL`, q's rope part and kr get the same
interleaved RoPE as in MLA, so q . k equals the MLA logit times (N + R)^0.5; without, they are
left unrotated.

Notation (docs/design.md): B batch, L length, D hidden, H heads, Q q latent, C kv latent, N nope
head dim, R rope dim, K = N + R, V value head dim.
"""

import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.config import ModelConfig
from glm5_jax.layers.norms import RMSNorm
from glm5_jax.layers.axes import EMBED, HEAD_DIM, HEADS, KV_LORA, Q_LORA
from glm5_jax.layers.params import constrain, dtypes, kernels, param
from glm5_jax.quant.linear import apply_linear, linear, linear_kernel
from glm5_jax.layers.rope import apply_interleaved_rope, rope_angles

# The parameters (children of `self_attn`) an M layer stores; `attention_bias` adds the `_bias`
# entries. A layer built on `mla_qkv` + `mla_output` has exactly these plus its own extras.
MLA_PARAMS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
              "k_b_proj", "v_b_proj", "o_proj")
MLA_BIAS_PARAMS = ("q_a_proj_bias", "kv_a_proj_with_mqa_bias", "o_proj_bias")


def _kernel(module: nn.Module, cfg: ModelConfig, name, shape, axes):
  dtype, pdtype = dtypes(cfg)
  return kernels(module, cfg.initializer_range, pdtype, dtype)(name, shape, axes)


def _linear(module: nn.Module, cfg: ModelConfig, name, x, shape, axes, n_in: int = 1):
  """`x . kernel` over the kernel's first `n_in` axes; INT8 W8A8 when `cfg.quant` says so."""
  dtype, pdtype = dtypes(cfg)
  return linear(module, name, x, shape, axes, n_in, quant=cfg.quant, std=cfg.initializer_range,
                param_dtype=pdtype, dtype=dtype)


def _bias(module: nn.Module, cfg: ModelConfig, name, size, axis):
  if not cfg.attention_bias:
    return 0.0
  dtype, pdtype = dtypes(cfg)
  return param(module, name, (size,), (axis,), pdtype, nn.initializers.zeros).astype(dtype)


def mla_latents(module: nn.Module, cfg: ModelConfig, x_BLD):
  """Declares MLA's input-side projections on `module` (call from its compact method) and
  returns the un-rotated pieces every layer on these weights builds on. The softmax layer
  (`mla.MLA`) needs the latents themselves for its absorbed and sparse forms; `mla_qkv` expands
  them per head for the linear-attention layers.

  Args:
    x_BLD: the normalized layer input.
  Returns:
    `(q_BLHK, cq_BLQ, ckv_BLC, k_rope_BLR, w_kb_CHN, w_vb_CHV)` in `cfg.dtype`: per-head queries
    (rope part not yet rotated), the normed query latent, the normed kv latent, the shared rope
    key (not yet rotated), and the key/value up-projections.
  """
  c = cfg
  dtype, pdtype = dtypes(c)
  d, h = x_BLD.shape[-1], c.num_attention_heads
  n, r, v, k = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.qk_head_dim
  x_BLD = x_BLD.astype(dtype)

  cq_BLQ = (_linear(module, c, "q_a_proj", x_BLD, (d, c.q_lora_rank), (EMBED, Q_LORA))
            + _bias(module, c, "q_a_proj_bias", c.q_lora_rank, Q_LORA))
  cq_BLQ = RMSNorm(c.latent_norm_eps, dtype, pdtype, name="q_a_layernorm")(cq_BLQ)
  w_qb = linear_kernel(module, "q_b_proj", (c.q_lora_rank, h, k), (Q_LORA, HEADS, HEAD_DIM), 1,
                       quant=c.quant, std=c.initializer_range, param_dtype=pdtype, dtype=dtype)
  if not isinstance(w_qb, tuple):
    # Gathered over the query latent's (fsdp) axes, as the product needs it anyway, and named so
    # a remat policy can keep the gathered copy (`save_selections_o_proj`): the backward's rerun
    # and its input gradient then gather it no more.
    w_qb = checkpoint_name(constrain(w_qb, (None, HEADS, HEAD_DIM)), "q_b_proj_gathered")
  q_BLHK = checkpoint_name(apply_linear(cq_BLQ, w_qb, 1, dtype), "query_proj")

  ckv_BLC = (_linear(module, c, "kv_a_proj_with_mqa", x_BLD, (d, c.kv_lora_rank + r),
                     (EMBED, KV_LORA))
             + _bias(module, c, "kv_a_proj_with_mqa_bias", c.kv_lora_rank + r, KV_LORA))
  # The shared latent is MLA's key and value projection (`model.remat_policy` save_qkv_*).
  ckv_BLC = checkpoint_name(ckv_BLC, "key_proj")
  ckv_BLC, k_rope_BLR = ckv_BLC[..., :c.kv_lora_rank], ckv_BLC[..., c.kv_lora_rank:]
  ckv_BLC = RMSNorm(c.latent_norm_eps, dtype, pdtype, name="kv_a_layernorm")(ckv_BLC)
  w_kb_CHN = _kernel(module, c, "k_b_proj", (c.kv_lora_rank, h, n), (KV_LORA, HEADS, HEAD_DIM))
  w_vb_CHV = _kernel(module, c, "v_b_proj", (c.kv_lora_rank, h, v), (KV_LORA, HEADS, HEAD_DIM))
  return q_BLHK, cq_BLQ, ckv_BLC, k_rope_BLR, w_kb_CHN, w_vb_CHV


def mla_qkv(module: nn.Module, cfg: ModelConfig, x_BLD, positions_BL=None):
  """Per-head q, k, v from MLA's projections, declared on `module` (call from its compact method).

  Args:
    x_BLD: the normalized layer input.
    positions_BL: int positions for RoPE on the rope dims, or None for no RoPE.
  Returns:
    `(q_BLHK, k_BLHK, v_BLHV)` in `cfg.dtype`.
  """
  c = cfg
  n, r = c.qk_nope_head_dim, c.qk_rope_head_dim
  q_BLHK, _, ckv_BLC, k_rope_BLR, w_kb_CHN, w_vb_CHV = mla_latents(module, c, x_BLD)
  k_nope_BLHN = jnp.einsum("blc,chn->blhn", ckv_BLC, w_kb_CHN)
  v_BLHV = jnp.einsum("blc,chv->blhv", ckv_BLC, w_vb_CHV)

  if positions_BL is not None:
    cos, sin = rope_angles(positions_BL, r, c.rope_theta)
    q_BLHK = jnp.concatenate(
        [q_BLHK[..., :n], apply_interleaved_rope(q_BLHK[..., n:], cos, sin)], axis=-1)
    k_rope_BLR = apply_interleaved_rope(k_rope_BLR, cos, sin)
  k_rope_BLHR = jnp.broadcast_to(k_rope_BLR[:, :, None, :], k_nope_BLHN.shape[:3] + (r,))
  k_BLHK = jnp.concatenate([k_nope_BLHN, k_rope_BLHR.astype(k_nope_BLHN.dtype)], axis=-1)
  return q_BLHK, k_BLHK, v_BLHV


def mla_output(module: nn.Module, cfg: ModelConfig, out_BLHV):
  """MLA's output projection `o_proj [H, V, D]` (+ `o_proj_bias`), declared on `module`."""
  c = cfg
  h, v = out_BLHV.shape[-2:]
  d = c.hidden_size
  out_BLHV = checkpoint_name(out_BLHV.astype(dtypes(c)[0]), "attention_out")
  return (_linear(module, c, "o_proj", out_BLHV, (h, v, d), (HEADS, HEAD_DIM, EMBED), 2)
          + _bias(module, c, "o_proj_bias", d, EMBED))
