"""Device mesh from config, the `mesh` config section, and logical-axis -> mesh-axis mapping.

Every parameter carries logical axis names (`glm5_jax.layers.params.param`), and the model
constrains its residual stream to `("batch", "length", "embed")` at layer boundaries. The
`mesh.logical_axis_rules` of the config map those names onto the mesh axes
`data, fsdp, context, expert, tensor`; names without a rule stay replicated. `context` splits
the sequence (`length`) of one row over devices (context parallelism, docs/scaling.md; which
attention kinds support it: `glm5_jax.context_parallel`). The same program then runs
on 1 CPU, 8 simulated CPU devices, a GPU, or a multi-host TPU pod.

  mesh = make_mesh(config.mesh)
  shapes, logical_axes = abstract_params_and_axes(config.model)  # one shape-only trace
  shardings = param_shardings(shapes, logical_axes, mesh, config.mesh.logical_axis_rules)
  params = jax.device_put(params, shardings)
  with activation_sharding(mesh, config.mesh.logical_axis_rules):
    out = jax.jit(forward_fn)(params, tokens)
"""

import contextlib
import math

import jax
import ml_collections
import numpy as np
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from glm5_jax import device_layout
from glm5_jax.attention.mode import CONTEXT_LAYOUTS
from glm5_jax.config import ConfigError, check_fields, require
from glm5_jax.layers import axes as logical_axes

MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")


def mesh_config(**axis_sizes) -> ml_collections.ConfigDict:
  """Mesh axis sizes (-1 on one axis takes the remaining devices) and logical-axis rules."""
  c = ml_collections.ConfigDict()
  c.shape = ml_collections.ConfigDict(dict(data=-1, fsdp=1, context=1, expert=1, tensor=1))
  c.shape.update(axis_sizes)
  c.logical_axis_rules = default_logical_axis_rules()
  # How a sequence's tokens lie over the `context` axis in training: "contiguous" (device i
  # holds the i-th L / context positions) or "striped" (load-balanced causal work,
  # `glm5_jax.attention.context_parallel.stripe`); no effect while mesh.shape.context is 1.
  c.context_layout = "contiguous"
  # Which TPU chip holds each mesh position, as parts of the torus dimensions per mesh axis
  # (`glm5_jax.device_layout`, e.g. "expert=x8,y4:2;fsdp=y2,z16"); "" = jax's placement.
  c.device_layout = ""
  return c


def default_logical_axis_rules():
  """Logical axis name -> mesh axes. Names not listed stay replicated."""
  return [
      # The expert axis carries tokens too (as in DeepSeek / MaxText): an expert-parallel MoE
      # then exchanges tokens inside the expert axis instead of gathering the layer's output.
      (logical_axes.BATCH, ("data", "fsdp", "expert")),
      # Context parallelism: the residual stream's sequence axis, so every token-wise op (norms,
      # projections, FFN, MoE) stays token-parallel on its own positions; attention gathers its
      # keys over `context` (`glm5_jax.context_parallel`).
      (logical_axes.LENGTH, "context"),
      # Parameters are sharded over `context` as well as `fsdp` (ZeRO-3 over both: a context
      # shard needs every weight, as a data shard does). Without it a long-context layout
      # holds `context` copies of the params and optimizer state (GLM-5 at context 16: 16x).
      # An activation [B, L, D] has `fsdp` and `context` on B and L already, so its D takes
      # neither (flax skips a rule whose mesh axes are in use and tries the next one).
      (logical_axes.EMBED, ("fsdp", "context")),
      (logical_axes.EMBED, "fsdp"),
      # MLA's and the indexer's up-projections ([Q, H, K], [C, H, N], [Q, J, I]) have no embed
      # dimension; without these rules they were replicated on every device (16.5 of
      # GLM-5's 28 GiB of fp32 params per device on fsdp 64 x expert 4). A kernel that also has
      # an embed dimension keeps fsdp there (a mesh axis shards one dimension at most).
      (logical_axes.Q_LORA, ("fsdp", "context")),
      (logical_axes.Q_LORA, "fsdp"),
      (logical_axes.KV_LORA, ("fsdp", "context")),
      (logical_axes.KV_LORA, "fsdp"),
      (logical_axes.VOCAB, "tensor"),
      (logical_axes.MLP, "tensor"),
      (logical_axes.HEADS, "tensor"),
      (logical_axes.KV_HEADS, "tensor"),
      (logical_axes.INDEX_HEADS, "tensor"),
      (logical_axes.EXPERT, "expert"),
      (logical_axes.EXPERT_MLP, "tensor"),
  ]


def validate_mesh_config(mesh, num_devices: int | None = None) -> dict[str, int]:
  """Checks the `mesh` section (against the device count, when given).

  Returns:
    mesh axis name -> size, the `-1` axis resolved to the remaining devices (left -1 when
    `num_devices` is None).
  """
  check_fields(mesh, mesh_config(), "mesh", optional=("device_layout",))
  shape = dict(mesh.shape)
  extra = sorted(set(shape) - set(MESH_AXES))
  require(not extra, "mesh.shape", f"unknown axes {extra}; allowed {MESH_AXES}")
  sizes = {axis: shape.get(axis, 1) for axis in MESH_AXES}
  for axis, size in sizes.items():
    require(isinstance(size, int) and not isinstance(size, bool) and (size == -1 or size >= 1),
            f"mesh.shape.{axis}", f"must be an int >= 1 or -1, got {size!r}")
  fill = [a for a, s in sizes.items() if s == -1]
  require(len(fill) <= 1, "mesh.shape", f"at most one axis may be -1, got {fill}")
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if num_devices is not None and fill:
    require(num_devices % fixed == 0, "mesh.shape", f"fixed axes multiply to {fixed}, which "
            f"does not divide the {num_devices} available devices")
    sizes[fill[0]] = num_devices // fixed
  elif num_devices is not None:
    require(fixed == num_devices, "mesh.shape", f"axes {sizes} multiply to {fixed} but there "
            f"are {num_devices} devices")
  if mesh.get("device_layout", ""):
    device_layout.parse_device_layout(mesh.device_layout, MESH_AXES)
  require(mesh.context_layout in CONTEXT_LAYOUTS, "mesh.context_layout",
          f"must be one of {CONTEXT_LAYOUTS}, got {mesh.context_layout!r}")
  for rule in mesh.logical_axis_rules:
    require(isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str),
            "mesh.logical_axis_rules", f"each rule is (logical name, mesh axes), got {rule!r}")
    targets = rule[1] if isinstance(rule[1], (tuple, list)) else (rule[1],)
    bad = [t for t in targets if t is not None and t not in MESH_AXES]
    require(not bad, "mesh.logical_axis_rules", f"rule {tuple(rule)} names unknown mesh axes "
            f"{bad}; allowed {MESH_AXES}")
  return sizes


def make_mesh(mesh_config, devices=None) -> Mesh:
  """A mesh with axes `data, fsdp, context, expert, tensor` sized by `mesh_config.shape`.

  Args:
    mesh_config: the config's `mesh` section (`-1` on one axis takes the remaining devices;
      `device_layout`, when set, places the devices: `glm5_jax.device_layout`).
    devices: defaults to all devices (every process's, on multi-host).
  """
  devices = jax.devices() if devices is None else list(devices)
  sizes = validate_mesh_config(mesh_config, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  # Auto axes: XLA's sharding propagation fills in what the logical constraints leave open.
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  if mesh_config.get("device_layout", ""):
    grid = device_layout.device_grid(devices, sizes, mesh_config.device_layout)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)
  if devices == jax.devices():  # topology-aware device order on TPU/GPU
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types)
  if devices[0].platform == "tpu":  # an ahead-of-time TPU slice (glm5_jax.planning.aot_targets)
    # Along the torus; a mesh axis may take part of a physical dimension (e.g. `tensor` 4 on a
    # v5p 8x8x16 slice), which jax.make_mesh refuses.
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
    grid = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def _rules(rules):
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)


def logical_to_mesh_spec(logical_spec: PartitionSpec, rules) -> PartitionSpec:
  """Logical names -> mesh axes; unnamed or unruled dimensions are replicated."""
  return nn.logical_to_mesh_axes(tuple(logical_spec), _rules(rules))


def batch_mesh_axes(rules) -> tuple[str, ...]:
  """The mesh axes the `batch` rule splits a batch over (its data-parallel axes)."""
  return logical_axes.spec_axes(logical_to_mesh_spec(PartitionSpec(logical_axes.BATCH), rules)[0])


def batch_sharding(mesh: Mesh, rules, ndim: int = 2) -> NamedSharding:
  """Sharding of a `[batch, ...]` input array: the batch axis per the `batch` rule."""
  spec = logical_to_mesh_spec(PartitionSpec(logical_axes.BATCH, *([None] * (ndim - 1))), rules)
  return NamedSharding(mesh, spec)


def param_mesh_specs(shapes, logical_axes, mesh_shape: dict[str, int], rules):
  """Mesh-axis PartitionSpec for every parameter, from its logical axes.

  Args:
    shapes: the params' `jax.ShapeDtypeStruct` tree and
    logical_axes: their logical-axis `PartitionSpec`s, both from
      `glm5_jax.api.abstract_params_and_axes` (one shape-only trace of the model).
    mesh_shape: mesh axis name -> size (`mesh.shape`).
  Raises:
    ConfigError: a parameter dimension is not divisible by the mesh axes it maps to (names
      the parameter, the dimension and its logical axis).
  """

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
      mesh_spec, logical_axes, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_shardings(shapes, logical_axes, mesh: Mesh, rules):
  """NamedSharding for every parameter (see `param_mesh_specs`)."""
  specs = param_mesh_specs(shapes, logical_axes, dict(mesh.shape), rules)
  return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs,
                                is_leaf=lambda x: isinstance(x, PartitionSpec))


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules):
  """Enables the model's logical activation constraints on `mesh` (no-op outside it)."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(_rules(rules)):
    yield


def state_shardings(abstract_state, params_sharding, mesh):
  """Shardings of a train state (any pytree holding `params` and optimizer state) from its
  params' shardings: every leaf that mirrors a param (same trailing path, same shape: the
  params themselves, Muon momenta, Adam moments) shares its sharding; counters and scalars are
  replicated.

  Stated explicitly because XLA does not carry a param's sharding to `zeros_like(param)`: a
  jitted `optimizer.init` left to propagation replicates every moment on every device.
  """
  path_names = lambda path: tuple(str(getattr(k, "key", getattr(k, "name", getattr(
      k, "idx", k)))) for k in path)
  params = {path_names(p): (s, leaf.shape) for (p, s), leaf in zip(
      jax.tree_util.tree_flatten_with_path(params_sharding)[0],
      jax.tree_util.tree_leaves(abstract_state.params))}
  replicated = NamedSharding(mesh, PartitionSpec())

  def pick(path, leaf):
    names = path_names(path)
    for start in range(len(names)):
      hit = params.get(names[start:])
      if hit and hit[1] == leaf.shape:
        return hit[0]
    return replicated

  return jax.tree_util.tree_map_with_path(pick, abstract_state)
