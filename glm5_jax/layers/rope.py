"""Interleaved rotary position embedding (GLM-5 / DeepSeek layout).

GLM-5 rotates adjacent pairs `(x0, x1), (x2, x3), ...`, each pair by one frequency, both in
MLA (q_rope, k_rope) and in the lightning indexer (docs/reference.md section 2). The output
keeps the interleaved layout. HF's implementation writes the rotated pairs out de-interleaved;
since queries and keys are permuted alike, every attention score is the same.
"""

import jax
import jax.numpy as jnp
import numpy as np


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
  shape = cos.shape[:2] + (1,) * (x.ndim - cos.ndim) + (x.shape[-1],)
  cos_R, sin_R = (jnp.repeat(a, 2, axis=-1).reshape(shape) for a in (cos, sin))
  # Each element's pair partner (x[2i+1] to 2i, negated; x[2i] to 2i+1) as a product with a
  # signed permutation: exact (one nonzero term per output, fp32 accumulation), and one MXU pass
  # that fuses with the rotation. Both ways of moving lanes that came before cost the 744B TPU
  # step more than the matmul does: a `[..., R // 2, 2]` view (TPU tiles pad its minor axis of 2
  # to 128 lanes) and shifts along the last axis (`jnp.roll`: the compiler wrote its width-1
  # and width-(R-1) slices to HBM, each padded to 128 lanes; 0.25 s a step, compiler estimate).
  partner = jnp.einsum("...r,rs->...s", x, _pair_swap(x.shape[-1], x.dtype),
                       preferred_element_type=jnp.float32,
                       precision=jax.lax.Precision.HIGHEST)
  return (x.astype(jnp.float32) * cos_R + partner * sin_R).astype(x.dtype)


def _pair_swap(r: int, dtype):
  """`[r, r]` with `x @ P` = each element's rotation partner: `-x[2i+1]` at 2i, `x[2i]` at 2i+1."""
  i = np.arange(r)
  swap = np.zeros((r, r), np.float32)
  swap[i ^ 1, i] = np.where(i % 2 == 0, -1.0, 1.0)
  return jnp.asarray(swap, dtype)
