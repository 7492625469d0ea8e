"""INT4 quantization-aware training: fake quantization with per-group scales and a
straight-through gradient (GLM-5 report: INT4 QAT at the SFT stage for the routed experts).

A kernel `w [..., I, O]` (our layout: input axis second to last) is split along I into groups of
`group` rows; each (group, output column) has one scale `s = max|w| / 7` and the weight is
replaced by `clip(round(w / s), -8, 7) * s` in the forward, while the backward passes the
gradient through unchanged (straight-through: `w + stop_gradient(q(w) - w)`), so the optimizer
keeps updating the full-precision weight. Symmetric scales (`amax / 7`) are what the serving
path (`ops.quantize_int4_groups`) stores, so a QAT-trained kernel quantizes at export to exactly the
values it was trained with.

Written by hand rather than with qwix (Google's maintained JAX quantization library; checked
against its release 0.1.8, the newest on PyPI here). qwix quantizes by intercepting the
`dot_general` / `einsum` / `ragged_dot` calls of a Flax module it wraps
(`qwix.quantize_model(model, QtProvider([QtRule(...)]))`), and its QAT ragged_dot (the op our
routed experts run through, `moe.dispatch_experts`) quantizes the `[E, I, O]` weight with one
scale per output channel shared by all experts (`RaggedDotQtConfig` takes only qtypes: no
`tile_size`, so no per-group scales, and no per-expert ones), which is not the per-group INT4
of GLM-5's recipe; it would also need the model rebuilt through its provider wherever this repo
builds `GLM5` (api.forward, the train and RL steps, the engine) and a new dependency, for what
is ~20 lines of arithmetic here.
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
