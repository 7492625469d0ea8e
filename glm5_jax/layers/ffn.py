"""SwiGLU feed-forward: `down(silu(x W_gate) * (x W_up))`."""

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.layers.axes import EMBED, MLP
from glm5_jax.layers.params import constrain
from glm5_jax.quant.linear import apply_linear, linear_kernel


def _embedding_whole(w, axes):
  """Kernel `w` (or INT8 `(q, scale)`, the scale `[1, out]`) constrained to `axes` with the
  embedding axis whole."""
  whole = tuple(None if a == EMBED else a for a in axes)
  if isinstance(w, tuple):
    q, scale = w
    return constrain(q, whole), constrain(scale, (None, whole[1]))
  return constrain(w, whole)


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
  def __call__(self, x_BLD, gathered_before=None):
    """`y_BLD`, or with `gathered_before` (any pytree) `(y_BLD, gathered_before)`: the kernels
    are first constrained to their layout with the embedding axis whole (gathered over the axes
    that split it, fsdp) and pass one optimization barrier with `gathered_before`, returned as
    it left the barrier, and the products use them from there (in the backward, the kernels'
    cotangents wait at the barrier for `gathered_before`'s).
    Whatever the caller computes from the returned values then comes after the gathers: the
    MoE's shared experts' gathers come before any expert row moves (a synchronous gather issued
    while a ragged all-to-all is in flight waits for it, `glm5_jax.moe_parallel`), also in the
    backward's rerun of the layer, where only values used past the barrier keep their order."""
    d, f = x_BLD.shape[-1], self.intermediate_size
    kw = dict(quant=self.quant, std=self.init_std, param_dtype=self.param_dtype, dtype=self.dtype)
    shapes = {"gate_proj": ((d, f), (EMBED, MLP)), "up_proj": ((d, f), (EMBED, MLP)),
              "down_proj": ((f, d), (MLP, EMBED))}
    ws = {name: linear_kernel(self, name, shape, axes, 1, **kw)
          for name, (shape, axes) in shapes.items()}
    if gathered_before is not None:
      ws = {name: _embedding_whole(w, shapes[name][1]) for name, w in ws.items()}
      # Both ways: the backward's barrier holds the kernels' cotangents until the cotangent of
      # `gathered_before` exists, so their reduce-scatters (synchronous) come after the MoE's
      # backward exchanges, not queued behind them.
      ws, gathered_before = jax.lax.optimization_barrier((ws, gathered_before))
    x_BLD = x_BLD.astype(self.dtype)
    h_BLF = (jax.nn.silu(apply_linear(x_BLD, ws["gate_proj"], 1, self.dtype))
             * apply_linear(x_BLD, ws["up_proj"], 1, self.dtype))
    y_BLD = apply_linear(h_BLF, ws["down_proj"], 1, self.dtype)
    return y_BLD if gathered_before is None else (y_BLD, gathered_before)
