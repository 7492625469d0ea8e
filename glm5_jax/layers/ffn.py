"""SwiGLU feed-forward: `down(silu(x W_gate) * (x W_up))`."""

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.layers.axes import EMBED, MLP
from glm5_jax.layers.params import kernels


class SwiGLU(nn.Module):
  """Dense SwiGLU FFN (GLM-5's dense layers and shared experts).

  Shapes: x `[B, L, D]` -> `[B, L, D]`; kernels gate/up `[D, F]`, down `[F, D]`.
  """

  intermediate_size: int
  init_std: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BLD):
    d, f = x_BLD.shape[-1], self.intermediate_size
    kernel = kernels(self, self.init_std, self.param_dtype, self.dtype)
    w_gate_DF = kernel("gate_proj", (d, f), (EMBED, MLP))
    w_up_DF = kernel("up_proj", (d, f), (EMBED, MLP))
    w_down_FD = kernel("down_proj", (f, d), (MLP, EMBED))
    x_BLD = x_BLD.astype(self.dtype)
    h_BLF = jax.nn.silu(x_BLD @ w_gate_DF) * (x_BLD @ w_up_DF)
    return h_BLF @ w_down_FD
