"""Import a GLM-5 HF checkpoint directory (`model_type: glm_moe_dsa`) as (config, params).

Reads `config.json` and safetensors (one file, or shards with `model.safetensors.index.json`),
tensor by tensor: each tensor is read, transposed/reshaped into our layout, cast and put on the
device before the next is read, so the model never exists twice in host memory. Every tensor in
the files must be used and every parameter filled; otherwise the error lists what was missing
or unexpected. The parts:

  hf_config.py   config.json -> our model ConfigDict (`config_from_hf`)
  hf_files.py    the directory's files: the shard index, safetensors headers and tensors
  hf_layout.py   which HF tensors each parameter is built from, and how (the load plan)
"""

import os

import jax
import jax.numpy as jnp

from glm5_jax.api import abstract_params
from glm5_jax.config import ModelConfig
from glm5_jax.convert.hf_config import check_supported, config_from_hf
from glm5_jax.convert.hf_files import (INDEX_FILE, CheckpointError, TensorReader, head,
                                       read_json, stored_dtype, tensor_files)
from glm5_jax.convert.hf_layout import ignorable_tensors, load_plan

__all__ = ["load_hf", "config_from_hf", "CheckpointError", "INDEX_FILE"]


def load_hf(path: str, *, param_dtype: str | None = None, dtype: str | None = None,
            mtp_depths: int = 3):
  """Reads a GLM-5 HF checkpoint directory.

  Args:
    path: directory with `config.json` and `*.safetensors`.
    param_dtype: dtype of the returned params; default: the dtype the embedding is stored in.
      The router kernel, its correction bias and the indexer's `weights_proj` stay fp32.
    dtype: compute dtype recorded in the config; default: the stored dtype, as for params.
    mtp_depths: MTP prediction depths sharing the checkpoint's MTP layer (if it has one).
  Returns:
    `(config, params)`: the model ConfigDict (as `get_config().model`) and a nested dict of
    arrays matching `glm5_jax.init_params(config, rng)`.
  Raises:
    CheckpointError: naming the file (config.json, the index or a shard) and what is wrong.
  """
  hf_config = read_json(os.path.join(path, "config.json"))
  check_supported(hf_config)
  files_by_name = tensor_files(path)
  config = config_from_hf(hf_config, tensor_names=files_by_name.keys(), mtp_depths=mtp_depths)
  stored = stored_dtype(path, files_by_name, "model.embed_tokens.weight")
  config.param_dtype = param_dtype or stored
  config.dtype = dtype or stored
  cfg = ModelConfig.from_config(config)

  plan = load_plan(cfg, files_by_name)
  needed = {n for _, names, _ in plan for n in names}
  missing = sorted(needed - files_by_name.keys())
  unexpected = sorted(set(files_by_name) - needed - set(ignorable_tensors(cfg, files_by_name)))
  if missing or unexpected:
    raise CheckpointError(
        f"{path}: checkpoint does not match its config.json.\n"
        f"  missing tensors ({len(missing)}): {head(missing)}\n"
        f"  unexpected tensors ({len(unexpected)}): {head(unexpected)}")

  shapes = abstract_params(cfg)
  params = {}
  with TensorReader(path, files_by_name) as reader:
    for dest, names, build in plan:
      want = _lookup(shapes, dest)
      array = build(reader.read, want.dtype)
      if array.shape != want.shape:
        raise CheckpointError(
            f"{path}: {names[0]} gives {'/'.join(dest)} shape {array.shape}, but config.json "
            f"implies {want.shape}")
      _assign(params, dest, jnp.asarray(array, dtype=want.dtype))
      del array
  leaves = {jax.tree_util.keystr(kp, simple=True, separator="/")
            for kp, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]}
  filled = {jax.tree_util.keystr(kp, simple=True, separator="/")
            for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
  if leaves != filled:
    raise CheckpointError(f"{path}: params left unfilled: {head(sorted(leaves - filled))}")
  return config, params


def _lookup(tree, path):
  for key in path:
    if key not in tree:
      raise CheckpointError(f"internal: no parameter {'/'.join(path)} in the model")
    tree = tree[key]
  return tree


def _assign(tree: dict, path: tuple, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value
