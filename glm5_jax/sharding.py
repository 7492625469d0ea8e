"""Device mesh from config and logical-axis -> mesh-axis mapping.

Every parameter carries logical axis names (`glm5_jax.layers.params.param`), and the model
constrains its residual stream to `("batch", "length", "embed")` at layer boundaries. The
`mesh.logical_axis_rules` of the config map those names onto the mesh axes
`data, fsdp, expert, tensor`; names without a rule stay replicated. The same program then runs
on 1 CPU, 8 simulated CPU devices, a GPU, or a multi-host TPU pod.

  mesh = make_mesh(config.mesh)
  shardings = param_shardings(config.model, mesh, config.mesh.logical_axis_rules)
  params = jax.device_put(params, shardings)
  with activation_sharding(mesh, config.mesh.logical_axis_rules):
    out = jax.jit(forward_fn)(params, tokens)
"""

import contextlib
import math

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from glm5_jax.api import abstract_params, param_logical_axes
from glm5_jax.config import MESH_AXES, ConfigError, validate_mesh_config
from glm5_jax.layers.axes import BATCH


def make_mesh(mesh_config, devices=None) -> Mesh:
  """A mesh with axes `data, fsdp, expert, tensor` sized by `mesh_config.shape`.

  Args:
    mesh_config: the config's `mesh` section (`-1` on one axis takes the remaining devices).
    devices: defaults to all devices (every process's, on multi-host).
  """
  devices = jax.devices() if devices is None else list(devices)
  sizes = validate_mesh_config(mesh_config, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  # Auto axes: XLA's sharding propagation fills in what the logical constraints leave open.
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  if devices == jax.devices():  # topology-aware device order on TPU/GPU
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def _rules(rules):
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)


def logical_to_mesh_spec(logical_spec: PartitionSpec, rules) -> PartitionSpec:
  """Logical names -> mesh axes; unnamed or unruled dimensions are replicated."""
  return nn.logical_to_mesh_axes(tuple(logical_spec), _rules(rules))


def batch_sharding(mesh: Mesh, rules, ndim: int = 2) -> NamedSharding:
  """Sharding of a `[batch, ...]` input array: the batch axis per the `batch` rule."""
  spec = logical_to_mesh_spec(PartitionSpec(BATCH, *([None] * (ndim - 1))), rules)
  return NamedSharding(mesh, spec)


def param_mesh_specs(model_config, mesh_shape: dict[str, int], rules):
  """Mesh-axis PartitionSpec for every parameter, from its logical axes.

  Args:
    mesh_shape: mesh axis name -> size (`mesh.shape`).
  Raises:
    ConfigError: a parameter dimension is not divisible by the mesh axes it maps to (names
      the parameter, the dimension and its logical axis).
  """
  logical = param_logical_axes(model_config)
  shapes = abstract_params(model_config)

  def mesh_spec(path, spec, shape):
    mesh_spec = logical_to_mesh_spec(spec, rules)
    for dim, (size, axes) in enumerate(zip(shape.shape, mesh_spec)):
      if axes is None:
        continue
      axes = axes if isinstance(axes, tuple) else (axes,)
      ways = math.prod(mesh_shape[a] for a in axes)
      if size % ways:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        raise ConfigError(
            f"config.mesh.logical_axis_rules: parameter {name} dim {dim} (logical "
            f"{spec[dim]!r}, size {size}) is not divisible by mesh axes {axes} ({ways} ways)")
    return mesh_spec

  return jax.tree_util.tree_map_with_path(
      mesh_spec, logical, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_shardings(model_config, mesh: Mesh, rules):
  """NamedSharding for every parameter (see `param_mesh_specs`)."""
  specs = param_mesh_specs(model_config, dict(mesh.shape), rules)
  return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs,
                                is_leaf=lambda x: isinstance(x, PartitionSpec))


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules):
  """Enables the model's logical activation constraints on `mesh` (no-op outside it)."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(_rules(rules)):
    yield
