"""RMSNorm and LayerNorm with fp32 statistics."""

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.layers.axes import EMBED, NORM
from glm5_jax.layers.params import param


class RMSNorm(nn.Module):
  """`x / sqrt(mean(x^2) + eps) * scale`, statistics in fp32, result in `dtype`.

  Matches HF `GlmMoeDsaRMSNorm`: normalize in fp32, cast back to the input dtype, then scale.
  With `mix`, the result is then multiplied by a `[D, D]` param `mix` (identity at init): a
  rotated model's norm scale that could not be folded into the next kernel
  (`model.head_norm_mix`, `glm5_jax.quant.rotation`).
  """

  eps: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype = jnp.float32
  mix: bool = False

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    scale = param(self, "scale", (d,), (NORM,), self.param_dtype, nn.initializers.ones)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    out = (normed.astype(x.dtype) * scale).astype(self.dtype)
    if not self.mix:
      return out
    mix_DD = param(self, "mix", (d, d), (None, EMBED), self.param_dtype,
                   lambda key, shape, dtype: jnp.eye(shape[0], dtype=dtype))
    return out @ mix_DD.astype(self.dtype)


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
