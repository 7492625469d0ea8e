"""A projection whose kernel is stored quantized when the model is a quantized serving model
(`model.quant`): the one place the model's quantized matmuls are declared and computed.

`model.quant` (`QUANT_FORMATS`):
  "none"   float kernels (`layers.params.kernels`), `x . w` in `dtype`: the model as trained.
  "w8a8"   every kernel declared through `linear` is INT8 per output channel (`<name>` int8 of
           the float kernel's shape, `<name>_scale` float32 `[1.., out...]`), activations INT8
           per token at run time, int32 accumulation (`ops.int8_matmul`).
  "w4a8"   as w8a8, and the routed experts (`moe.ExpertWeights`) INT4 per group of
           `model.quant_group_size` input rows, packed two per byte (`experts_int4`).
The params of a quantized model come from a float model's by `glm5_jax.quant.serve.quantize`.
Which projections are quantized: MLA's q_a, q_b, kv_a and o projections, the dense MLP, the
shared and routed experts. The MLA key/value up-projections (k_b, v_b: multiplied into the query
and the attention output per head in the absorbed and decode forms), the indexer, the router,
the embedding, the LM head and MTP's eh_proj stay as stored (bf16), as in GLM-5's W4A8 serving.
"""

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.layers.params import constrain, kernels, param
from glm5_jax.quant import ops

QUANT_FORMATS = ("none", "w8a8", "w4a8")


def linear(module: nn.Module, name: str, x, shape: tuple, axes: tuple, n_in: int, *,
           quant: str, std: float, param_dtype, dtype):
  """`x [..., in...] . kernel [in..., out...]` (the first `n_in` kernel axes contracted with x's
  last `n_in`), the kernel declared on `module` as `name` (float, or INT8 + `<name>_scale`)."""
  w = linear_kernel(module, name, shape, axes, n_in, quant=quant, std=std,
                    param_dtype=param_dtype, dtype=dtype)
  return apply_linear(x, w, n_in, dtype)


def linear_kernel(module: nn.Module, name: str, shape: tuple, axes: tuple, n_in: int, *,
                  quant: str, std: float, param_dtype, dtype):
  """`linear`'s kernel, declared on `module`: the float kernel in `dtype`, or `(q int8 [shape],
  scale f32 [1.., out...])`; for a caller that does something with it before the product
  (`layers.ffn.SwiGLU`'s `gathered_before`)."""
  if quant == "none":
    return kernels(module, std, param_dtype, dtype)(name, shape, axes)
  q = param(module, name, shape, axes, jnp.int8, nn.initializers.zeros)
  scale = param(module, name + "_scale", (1,) * n_in + tuple(shape[n_in:]),
                (None,) * n_in + tuple(axes[n_in:]), jnp.float32, nn.initializers.ones)
  return constrain(q, axes), scale


def apply_linear(x, w, n_in: int, dtype):
  """`x [..., in...] . w [in..., out...]` for a `linear_kernel` `w` (float, or `(q, scale)`)."""
  if not isinstance(w, tuple):
    return jnp.tensordot(x.astype(dtype), w, n_in)
  q, scale = w
  lead = x.shape[:x.ndim - n_in]
  i, o = math.prod(q.shape[:n_in]), math.prod(q.shape[n_in:])
  y = ops.int8_matmul(x.reshape(*lead, i), q.reshape(i, o), scale.reshape(1, o), dtype)
  return y.reshape(*lead, *q.shape[n_in:]) if q.ndim > n_in else y


def experts_int4(module: nn.Module, name: str, shape: tuple, axes: tuple, group: int):
  """Declares a routed-expert kernel `[E, I, O]` as INT4: `<name>` uint8 `[E, I // 2, O]` and
  `<name>_scale` float32 `[E, I // group, O]`; returns `(packed, scale)`."""
  e, i, o = shape
  packed = param(module, name, (e, i // 2, o), axes, jnp.uint8, nn.initializers.zeros)
  # The group axis is not split (I // group need not divide by the input axis's devices).
  scale = param(module, name + "_scale", (e, i // group, o), (axes[0], None, axes[2]),
                jnp.float32, nn.initializers.ones)
  return packed, scale


def experts_int8(module: nn.Module, name: str, shape: tuple, axes: tuple):
  """A routed-expert kernel `[E, I, O]` as INT8 per (expert, output channel): `(q, scale)`."""
  e, _, o = shape
  q = param(module, name, shape, axes, jnp.int8, nn.initializers.zeros)
  scale = param(module, name + "_scale", (e, 1, o), (axes[0], None, axes[2]), jnp.float32,
                nn.initializers.ones)
  return q, scale


def ragged_int_matmul(xs_PD, q_EIO, scale_EGO, counts_E, rows_expert_P, dtype):
  """Sorted rows `xs [P, I]` (rows of expert e contiguous, `counts_E` of them) times their
  expert's integer kernel `q int8 [E, I, O]` with scales `[E, G, O]` (G = 1: per channel, else
  groups of I // G rows): per-token INT8 activations, `ragged_dot` with int32 accumulation per
  group, each group's sums scaled by the row's expert's group scale. One ragged_dot per group
  (GLM-5 at group 128: 48 for gate / up, 16 for down) keeps every product exact in int32; a
  fused INT4 kernel would do the same in one pass."""
  xq_PI, xs_P1 = ops.quantize_tokens(xs_PD)
  groups, size = scale_EGO.shape[1], q_EIO.shape[1] // scale_EGO.shape[1]
  y_PO = 0.0
  for g in range(groups):  # static: one int32 ragged_dot per group
    rows = slice(g * size, (g + 1) * size)
    acc_PO = jax.lax.ragged_dot(xq_PI[:, rows], q_EIO[:, rows], counts_E,
                                preferred_element_type=jnp.int32)
    y_PO = y_PO + acc_PO.astype(jnp.float32) * scale_EGO[rows_expert_P, g]
  return (y_PO * xs_P1).astype(dtype)
