"""RMSNorm and LayerNorm with fp32 statistics."""

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.layers.axes import NORM
from glm5_jax.layers.params import param


class RMSNorm(nn.Module):
  """`x / sqrt(mean(x^2) + eps) * scale`, statistics in fp32, result in `dtype`.

  Matches HF `GlmMoeDsaRMSNorm`: normalize in fp32, cast back to the input dtype, then scale.
  """

  eps: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = param(self, "scale", (x.shape[-1],), (NORM,), self.param_dtype, nn.initializers.ones)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed.astype(x.dtype) * scale).astype(self.dtype)


class LayerNorm(nn.Module):
  """Mean/variance LayerNorm with scale and bias (the DSA indexer's key norm), fp32 statistics."""

  eps: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    features = (x.shape[-1],)
    scale = param(self, "scale", features, (NORM,), self.param_dtype, nn.initializers.ones)
    bias = param(self, "bias", features, (NORM,), self.param_dtype, nn.initializers.zeros)
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)
