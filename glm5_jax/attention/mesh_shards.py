"""Running an op per device on its shards of the context mesh, for ops XLA cannot partition.

A `pallas_call` is opaque to XLA's SPMD partitioner: given batch-sharded inputs it gathers every
input to every device and runs the whole batch there (inside the sparse attention backward's
query-block loop that was an all-gather of the whole batch's keys per block, issue 25).
`per_shard` runs such an op under `jax.shard_map` instead: each device calls it on its own batch
rows and heads, as named by the same logical axes and rules (`mesh.logical_axis_rules`) that
shard the model's activations.

Cotangents: an input whose logical axes leave a mesh axis out (the latent rows `[B, S, C]`
have no heads axis, so they are replicated over `tensor`) gets its cotangent summed over that
mesh axis once, at the shard_map boundary: for the sparse attention, the one all-reduce of the
key gradients over the head shards per layer.
"""

import math

import jax
from flax import linen as nn
from jax.sharding import PartitionSpec

from glm5_jax.layers import axes as axes_lib


def _mesh_spec(logical_axes, shape, mesh, what):
  """The mesh PartitionSpec of an array with `logical_axes` under the context rules, checked
  for divisibility."""
  spec = nn.logical_to_mesh_axes(axes_lib.check(logical_axes, what))
  if len(logical_axes) != len(shape):
    raise ValueError(f"{what}: {len(logical_axes)} logical axes {logical_axes} for shape {shape}")
  for dim, (size, axes) in enumerate(zip(shape, spec)):
    axes = axes_lib.spec_axes(axes)
    ways = math.prod(mesh.shape[a] for a in axes)
    if size % ways:
      raise ValueError(f"config.mesh.logical_axis_rules: {what} dim {dim} (logical "
                       f"{logical_axes[dim]!r}, size {size}) is not divisible by mesh axes "
                       f"{axes} ({ways} ways)")
  return spec


def per_shard(fn, in_axes, out_axes, name: str):
  """`fn` run per device under `jax.shard_map` over the context mesh (`jax.set_mesh`, as
  `glm5_jax.sharding.activation_sharding` sets it); `fn` itself outside a mesh.

  Args:
    fn: positional array arguments -> a tuple of arrays; it sees each device's shards.
    in_axes: per argument, its logical axis names (`glm5_jax.layers.axes`, None = replicated).
    out_axes: per result, its logical axis names. An axis the rules split must be one `fn`
      computes shard by shard (batch rows, heads), never one it reduces over.
    name: what the errors name.
  """

  def run(*args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
      return fn(*args)
    if len(args) != len(in_axes):
      raise ValueError(f"{name}: {len(args)} arguments, {len(in_axes)} in_axes")
    in_specs = tuple(_mesh_spec(axes, x.shape, mesh, f"{name} argument {i}")
                     for i, (axes, x) in enumerate(zip(in_axes, args)))
    out_specs = tuple(PartitionSpec(*nn.logical_to_mesh_axes(axes_lib.check(axes, name)))
                      for axes in out_axes)
    # check_vma=False: a custom VJP inside (the sparse attention's) returns key-row cotangents
    # that are per-device partial sums over the local heads; shard_map's transpose then sums
    # them over every mesh axis their input's spec leaves out, which is the reduction wanted.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)

  return run
