"""INT4 quantization-aware training: fake quantization with per-group scales and a
straight-through gradient (GLM-5 report: INT4 QAT at the SFT stage for the routed experts).

A kernel `w [..., I, O]` (our layout: input axis second to last) is split along I into groups of
`group` rows; each (group, output column) has one scale `s = max|w| / 7` and the weight is
replaced by `clip(round(w / s), -8, 7) * s` in the forward, while the backward passes the
gradient through unchanged (straight-through: `w + stop_gradient(q(w) - w)`), so the optimizer
keeps updating the full-precision weight. Symmetric scales (`amax / 7`) are what the serving
path (`ops.quantize_int4`) stores, so a QAT-trained kernel quantizes at export to exactly the
values it was trained with.

Written by hand rather than with qwix (Google's maintained JAX quantization library, which has
QAT with per-channel / tiled scales): qwix quantizes by intercepting the `dot_general` /
`einsum` calls of a Flax module it wraps (`qwix.quantize_model` with regex rules over module
paths), which (1) needs the model rebuilt through its provider at every place this repo builds
`GLM5` (api.forward, the train and RL steps, the engine), (2) does not see our expert kernels as
weights of a matmul it intercepts (they enter `jax.lax.ragged_dot` after a sort), and (3) would
add a dependency for ~20 lines of arithmetic. qwix is also not installed in this environment.
Imports only jax (it sits on the bottom floor, beside `glm5_jax.layers`).
"""

import jax
import jax.numpy as jnp

INT4_MIN, INT4_MAX = -8, 7


def group_scales(w: jax.Array, group: int) -> jax.Array:
  """Per-group symmetric scales of `w [..., I, O]`: `[..., I // group, O]`, float32, > 0."""
  *lead, i, o = w.shape
  if group < 1 or i % group:
    raise ValueError(f"group size {group} does not divide the input dim {i} of shape {w.shape}")
  amax = jnp.abs(w.astype(jnp.float32)).reshape(*lead, i // group, group, o).max(axis=-2)
  return jnp.where(amax > 0, amax / INT4_MAX, 1.0)


def quantize_groups(w: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
  """`(q int8 [..., I, O] in [-8, 7], scales [..., I // group, O])` with `w ~= q * scale`."""
  scales = group_scales(w, group)
  expanded = jnp.repeat(scales, group, axis=-2)
  q = jnp.clip(jnp.round(w.astype(jnp.float32) / expanded), INT4_MIN, INT4_MAX)
  return q.astype(jnp.int8), scales


def dequantize_groups(q: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
  group = q.shape[-2] // scales.shape[-2]
  return (q.astype(jnp.float32) * jnp.repeat(scales, group, axis=-2)).astype(dtype)


def fake_quant_int4(w: jax.Array, group: int) -> jax.Array:
  """`w` rounded to INT4 per group in the forward, identity in the backward (straight-through).

  Shapes: `w [..., I, O]` -> same shape and dtype."""
  q, scales = quantize_groups(jax.lax.stop_gradient(w), group)
  rounded = dequantize_groups(q, scales, w.dtype)
  return w + jax.lax.stop_gradient(rounded - w)
