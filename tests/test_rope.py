"""Interleaved RoPE (`glm5_jax.layers.rope`) against a float64 rotation of each pair."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.layers.rope import apply_interleaved_rope, rope_angles


def _rotated(x, cos, sin):
  """Each pair `(x[2i], x[2i+1])` rotated by the angle of `cos[..., i]`, `sin[..., i]`
  (`[B, L, R / 2]`), in float64."""
  x = np.asarray(x, np.float64)
  spread = lambda a: np.asarray(a, np.float64).reshape(
      a.shape[:2] + (1,) * (x.ndim - 3) + a.shape[-1:])
  cos, sin = spread(cos), spread(sin)
  even, odd = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2] = even * cos - odd * sin
  out[..., 1::2] = even * sin + odd * cos
  return out


def test_angles():
  """`position * theta^(-2i / R)` per pair (small positions: fp32 angles exact to ~1e-6)."""
  positions = jnp.asarray([[0, 1, 7, 50]], jnp.int32)
  cos, sin = rope_angles(positions, 8, 10_000.0)
  angle = np.asarray(positions, np.float64)[..., None] * 10_000.0 ** (-np.arange(0, 8, 2) / 8)
  np.testing.assert_allclose(np.asarray(cos), np.cos(angle), atol=1e-5)
  np.testing.assert_allclose(np.asarray(sin), np.sin(angle), atol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(2, 7, 64), (2, 7, 3, 64), (1, 5, 2, 3, 8)])
def test_rotates_each_pair(dtype, tol, shape):
  positions = jnp.asarray(np.random.default_rng(0).integers(0, 40_000, shape[:2]), jnp.int32)
  x = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
  cos, sin = rope_angles(positions, shape[-1], 10_000.0)
  got = apply_interleaved_rope(x, cos, sin)
  assert got.dtype == dtype and got.shape == shape
  want = _rotated(np.asarray(x.astype(jnp.float32)), cos, sin)
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, atol=tol, rtol=tol)


def test_gradient_is_the_inverse_rotation():
  """A rotation's transpose is its inverse: the cotangent rotated back (angle negated)."""
  shape = (2, 6, 4, 16)
  positions = jnp.tile(jnp.arange(6, dtype=jnp.int32), (2, 1)) * 1_000
  cos, sin = rope_angles(positions, 16, 10_000.0)
  dy = jax.random.normal(jax.random.key(2), shape)
  _, vjp = jax.vjp(lambda x: apply_interleaved_rope(x, cos, sin), jnp.zeros(shape))
  (dx,) = vjp(dy)
  np.testing.assert_allclose(np.asarray(dx), _rotated(dy, cos, -np.asarray(sin)), atol=1e-6)
