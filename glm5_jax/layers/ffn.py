"""SwiGLU feed-forward: `down(silu(x W_gate) * (x W_up))`."""

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.layers.axes import EMBED, MLP
from glm5_jax.quant.linear import linear


class SwiGLU(nn.Module):
  """Dense SwiGLU FFN (GLM-5's dense layers and shared experts).

  Shapes: x `[B, L, D]` -> `[B, L, D]`; kernels gate/up `[D, F]`, down `[F, D]` (INT8 with
  per-channel scales when `quant` is a quantized format, `glm5_jax.quant.linear`).
  """

  intermediate_size: int
  init_std: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype = jnp.float32
  quant: str = "none"

  @nn.compact
  def __call__(self, x_BLD):
    d, f = x_BLD.shape[-1], self.intermediate_size
    kw = dict(quant=self.quant, std=self.init_std, param_dtype=self.param_dtype, dtype=self.dtype)
    x_BLD = x_BLD.astype(self.dtype)
    h_BLF = (jax.nn.silu(linear(self, "gate_proj", x_BLD, (d, f), (EMBED, MLP), 1, **kw))
             * linear(self, "up_proj", x_BLD, (d, f), (EMBED, MLP), 1, **kw))
    return linear(self, "down_proj", h_BLF, (f, d), (MLP, EMBED), 1, **kw)
