"""Parameter declaration with logical axis names, and the model's dtypes.

Every parameter is declared through `param` so it carries the logical axis names
(`glm5_jax.layers.axes`) that `glm5_jax.sharding` maps onto the mesh. Projections are plain
`einsum`s over these kernels rather than `nn.Dense`/`nn.DenseGeneral`, so the stored kernel
shape is exactly the shape we document (e.g. the MLA query up-projection `[Q, H, K]`), which
the optimizer relies on to treat each head's slice on its own.
"""

from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from glm5_jax.layers import axes as axes_lib

# `model.dtype` / `model.param_dtype` names -> dtypes; config validation accepts these keys.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtypes(cfg) -> tuple[jnp.dtype, jnp.dtype]:
  """`(dtype, param_dtype)` of a `ModelConfig`: activations / matmuls, and stored params."""
  return DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]


def param(module: nn.Module, name: str, shape, axes, dtype, init):
  """Declares `module.<name>` with logical `axes` (one `layers.axes` name or None per dim)."""
  if len(axes) != len(shape):
    raise ValueError(f"{name}: {len(axes)} axis names {axes} for shape {shape}")
  axes = axes_lib.check(axes, f"parameter {name}")
  return module.param(name, nn.with_logical_partitioning(init, axes), tuple(shape), dtype)


def normal_kernel(module, name, shape, axes, std, dtype):
  """A weight matrix/tensor initialized N(0, std^2), as HF initializes GLM-5 linears."""
  return param(module, name, shape, axes, dtype, nn.initializers.normal(stddev=std))


def kernels(module: nn.Module, std: float, param_dtype,
            dtype=None) -> Callable[[str, tuple, tuple], jax.Array]:
  """`kernel(name, shape, axes)`: declares an N(0, std^2) weight on `module` (call from its
  compact method), stored in `param_dtype` and returned cast to `dtype` (as stored if None).

  The cast is pinned to the param's own sharding (`constrain` with its logical axes): left free,
  XLA's open-source SPMD partitioner (CPU; GPU uses the same) gave the convert the sharding its
  consumer wants and all-gathered the fp32 param over fsdp before casting (issue 25: the routed
  experts). Pinned, an all-gather a consumer needs moves `dtype`. (The TPU compiler already
  gathered bf16 either way: AOT compile for v5p, libtpu 0.0.42.)"""

  def kernel(name, shape, axes):
    w = normal_kernel(module, name, shape, axes, std, param_dtype)
    return w if dtype is None else constrain(w.astype(dtype), axes)

  return kernel


def constrain(x, axes):
  """`nn.with_logical_constraint` with the names checked against `layers.axes`."""
  return nn.with_logical_constraint(x, axes_lib.check(axes, "activation constraint"))


def context_split(name: str) -> int:
  """How many ways the context mesh (`jax.set_mesh`, as `glm5_jax.sharding.activation_sharding`
  sets it) and logical axis rules split logical axis `name`; 1 outside a mesh or without a rule.
  For code that must size a layout to the split, e.g. the sparse attention backward's head
  groups (`pallas_kernels.sparse_mla_xla`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return 1
  axes = nn.logical_to_mesh_axes(axes_lib.check((name,), "context_split"))[0]
  axes = axes_lib.spec_axes(axes)
  split = 1
  for axis in axes:
    split *= mesh.shape[axis]
  return split
