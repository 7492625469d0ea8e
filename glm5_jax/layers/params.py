"""Parameter declaration with logical axis names.

Every parameter is declared through `param` so it carries the logical axis names that
`glm5_jax.sharding` maps onto the mesh. Projections are plain `einsum`s over these kernels
rather than `nn.Dense`/`nn.DenseGeneral`, so the stored kernel shape is exactly the shape we
document (e.g. the MLA query up-projection `[Q, H, K]`), which the optimizer relies on to treat
each head's slice on its own.
"""

import jax.numpy as jnp
from flax import linen as nn

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def param(module: nn.Module, name: str, shape, axes, dtype, init):
  """Declares `module.<name>` with logical `axes` (one name or None per dimension)."""
  if len(axes) != len(shape):
    raise ValueError(f"{name}: {len(axes)} axis names {axes} for shape {shape}")
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


def normal_kernel(module, name, shape, axes, std, dtype):
  """A weight matrix/tensor initialized N(0, std^2), as HF initializes GLM-5 linears."""
  return param(module, name, shape, axes, dtype, nn.initializers.normal(stddev=std))
