"""Interleaved rotary position embedding (GLM-5 / DeepSeek layout).

GLM-5 rotates adjacent pairs `(x0, x1), (x2, x3), ...`, each pair by one frequency, both in
MLA (q_rope, k_rope) and in the lightning indexer (docs/reference.md section 2). The output
keeps the interleaved layout. HF's implementation writes the rotated pairs out de-interleaved;
since queries and keys are permuted alike, every attention score is the same.
"""

import jax.numpy as jnp


def rope_angles(positions, dim: int, theta: float):
  """Rotation cos/sin per position and pair.

  Args:
    positions: int `[B, L]` token positions.
    dim: rotated dimension (even).
    theta: RoPE base.
  Returns:
    `(cos, sin)`, each fp32 `[B, L, dim // 2]`.
  """
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(angles), jnp.sin(angles)


def apply_interleaved_rope(x, cos, sin):
  """Rotates interleaved pairs of the last axis of `x`.

  Args:
    x: `[B, L, ..., R]` (any number of head axes between L and R).
    cos, sin: `[B, L, R // 2]` from `rope_angles`.
  Returns:
    `x` rotated, same shape and dtype.
  """
  extra_axes = x.ndim - cos.ndim
  cos = cos.reshape(cos.shape[:2] + (1,) * extra_axes + cos.shape[2:])
  sin = sin.reshape(sin.shape[:2] + (1,) * extra_axes + sin.shape[2:])
  x32 = x.astype(jnp.float32)
  even, odd = x32[..., 0::2], x32[..., 1::2]
  rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
  return rotated.reshape(x.shape).astype(x.dtype)
