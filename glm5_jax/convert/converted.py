"""A converted checkpoint on disk: `<dir>/config.json` (model config) + `<dir>/params` (orbax).

Written by `tools/convert_hf.py`, read by training / RL runs that start from released weights.
Two forms of `params`:
  streamed (`streaming.py`): `params/groups.json` + one orbax checkpoint per group of leaves;
  whole (`save_converted`): one orbax checkpoint of the whole tree (needs the model in memory).
Both are written into a temporary directory renamed when complete, and the config is written
(atomically) only after that, so a directory with `config.json` is always whole. Params are in
the layout `config.scan_layers` names (`glm5_jax.layer_runs`). `load_converted` restores either
form onto any mesh: orbax reads each device's slice from the tensorstore arrays, so a checkpoint
written with one mesh restores resharded onto another.
"""

import json
import os

import jax
import ml_collections
import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec

from glm5_jax import layer_runs
from glm5_jax.api import abstract_params_and_axes
from glm5_jax.config import ModelConfig, validate_model_config
from glm5_jax.files import write_atomic
from glm5_jax.layers.axes import LAYERS
from glm5_jax.sharding import default_logical_axis_rules, param_shardings

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
GROUPS_FILE = "groups.json"  # in PARAMS_DIR, for the streamed form


def layout_shapes_and_axes(config):
  """`(shapes, logical_axes)` of the params in the layout `config.scan_layers` selects.

  Works whether or not the model itself already builds that layout: stacked leaves gain the
  leading `layers` axis (logical name `LAYERS`, replicated by the default rules).
  """
  cfg = ModelConfig.from_config(config)
  shapes, axes = abstract_params_and_axes(cfg)
  if cfg.scan_layers and not layer_runs.is_scanned(shapes):
    unrolled = axes
    axes = {k: v for k, v in unrolled.items() if not layer_runs.is_layer_module(k)}
    for run in layer_runs.layer_runs(cfg):
      axes[run.name] = jax.tree_util.tree_map(
          lambda spec: PartitionSpec(LAYERS, *spec), unrolled[layer_runs.unrolled_name(run.first)],
          is_leaf=lambda x: isinstance(x, PartitionSpec))
  elif not cfg.scan_layers and layer_runs.is_scanned(shapes):
    raise ValueError("abstract_params gave the scanned layout for scan_layers=False")
  return layer_runs.as_layout_of(cfg, shapes), axes


def layout_shardings(config, mesh: jax.sharding.Mesh, rules=None):
  """`NamedSharding` per param (the `config.scan_layers` layout) on `mesh` under `rules`
  (default: `glm5_jax.sharding.default_logical_axis_rules()`)."""
  shapes, axes = layout_shapes_and_axes(config)
  return param_shardings(shapes, axes, mesh, rules or default_logical_axis_rules())


def save_converted(directory: str, config: ml_collections.ConfigDict, params) -> None:
  """Writes `config` and an in-memory `params` tree; refuses to overwrite a conversion."""
  directory = os.path.abspath(directory)
  if os.path.exists(os.path.join(directory, PARAMS_DIR)):
    raise FileExistsError(f"{directory}/{PARAMS_DIR} already exists; choose a new directory")
  os.makedirs(directory, exist_ok=True)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(directory, PARAMS_DIR), params)
  checkpointer.wait_until_finished()
  write_config(directory, config)


def write_config(directory: str, config: ml_collections.ConfigDict) -> None:
  """`<directory>/config.json`, atomically (the marker of a finished conversion)."""
  write_atomic(os.path.join(directory, CONFIG_FILE), config.to_json(indent=2))


def load_converted(directory: str, shardings=None, *, mesh: jax.sharding.Mesh | None = None,
                   rules=None):
  """Reads `(config, params)` of a conversion (either form).

  Args:
    shardings: optional tree of `jax.sharding.Sharding`, the params' structure (e.g. from
      `layout_shardings`), to restore each parameter directly sharded.
    mesh: instead of `shardings`: restore sharded on `mesh` by the logical axis `rules`
      (default: the default rules). With neither, params land on the default device.
  """
  if shardings is not None and mesh is not None:
    raise ValueError("load_converted: pass shardings or mesh, not both")
  config_path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{config_path}: not found; is {directory} a finished conversion?")
  with open(config_path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  validate_model_config(config)
  target, _ = layout_shapes_and_axes(config)
  if mesh is not None:
    shardings = layout_shardings(config, mesh, rules)
  elif shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree_util.tree_map(lambda _: device, target)
  target = jax.tree_util.tree_map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), target, shardings)
  params_dir = os.path.abspath(os.path.join(directory, PARAMS_DIR))
  groups_file = os.path.join(params_dir, GROUPS_FILE)
  if not os.path.isfile(groups_file):
    return config, ocp.StandardCheckpointer().restore(params_dir, target)
  with open(groups_file) as f:
    groups = json.load(f)["groups"]
  params = {}
  with ocp.StandardCheckpointer() as checkpointer:
    for group in groups:
      paths = [tuple(name.split("/")) for name in group["leaves"]]
      subtree = {}
      for path in paths:
        _assign(subtree, path, _lookup(target, path, groups_file))
      restored = checkpointer.restore(os.path.join(params_dir, group["dir"]), subtree)
      for path in paths:
        _assign(params, path, _lookup(restored, path, groups_file))
  missing = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(target)} - {
      jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
  if missing:
    raise ValueError(f"{groups_file}: no group holds {sorted(missing)[:10]}")
  return config, params


def _lookup(tree, path: tuple, where: str):
  for key in path:
    if not isinstance(tree, dict) or key not in tree:
      raise ValueError(f"{where}: names parameter {'/'.join(path)}, which the model (config.json)"
                       " does not have")
    tree = tree[key]
  return tree


def _assign(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value
