"""Import a GLM-5 HF checkpoint directory (`model_type: glm_moe_dsa`) as (config, params).

Reads `config.json` and safetensors (one file, or shards with `model.safetensors.index.json`),
leaf by leaf: each param leaf (in the unrolled or the scanned layout, `config.scan_layers`) is
built from its HF tensors (transposed/reshaped into our layout, cast; a stacked leaf layer by
layer into one buffer) and put on the device before the next is read, so the model never exists
twice in host memory. Every tensor in the files must be used and every parameter filled;
otherwise the error lists what was missing or unexpected. The parts:

  hf_config.py   config.json -> our model ConfigDict (`config_from_hf`)
  hf_files.py    the directory's files: the shard index, safetensors headers and tensors
  hf_fp8.py      the FP8 release: block-scaled float8_e4m3fn tensors, dequantized as read
  hf_layout.py   which HF tensors each parameter is built from, and how (the load plan)
  hf_leaves.py   the plan per leaf of the chosen layout; any slice of a leaf read alone
  streaming.py   conversion to a sharded orbax checkpoint, one group of leaves at a time
"""

import dataclasses
import os

import jax.numpy as jnp
import ml_collections

from glm5_jax.api import abstract_params
from glm5_jax.config import ModelConfig
from glm5_jax.convert.hf_config import check_supported, config_from_hf
from glm5_jax.convert.hf_fp8 import Fp8Format, block_size, check_fp8_tensors
from glm5_jax.convert.hf_files import (INDEX_FILE, CheckpointError, TensorReader, head,
                                       read_json, stored_dtype, tensor_files)
from glm5_jax.convert.hf_layout import ignorable_tensors, load_plan
from glm5_jax.convert.hf_leaves import LeafSource, leaf_sources, read_slice

__all__ = ["load_hf", "open_hf", "HFCheckpoint", "config_from_hf", "CheckpointError",
           "INDEX_FILE"]


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
  """A checked HF checkpoint directory: its model config and the leaves to build, none read."""

  path: str
  config: ml_collections.ConfigDict  # as `get_config().model`
  files_by_name: dict[str, str]
  leaves: list[LeafSource]  # in tree order, in the layout `config.scan_layers` selects
  fp8: Fp8Format | None = None  # an FP8 checkpoint's block size and quantized tensors
  allow_nonfinite: bool = False  # load NaN / inf values instead of refusing them

  def reader(self) -> TensorReader:
    """Reads tensors by name; an FP8 tensor comes back dequantized (float32); a non-finite
    value is a CheckpointError naming the tensor unless `allow_nonfinite`."""
    return TensorReader(self.path, self.files_by_name, self.fp8, self.allow_nonfinite)

  def read(self, leaf: LeafSource, reader: TensorReader, index=None):
    """`leaf[index]` (default: all of it) as a numpy array of the param dtype."""
    index = index if index is not None else tuple(slice(None) for _ in leaf.shape)
    return read_slice(leaf, reader.read, index, self.path)


def open_hf(path: str, *, param_dtype: str | None = None, dtype: str | None = None,
            mtp_depths: int = 3, scan_layers: bool = True, cache_dtype: str | None = None,
            allow_nonfinite: bool = False) -> HFCheckpoint:
  """Reads config.json and the safetensors headers and checks every tensor is accounted for.

  Args: as `load_hf`.
  Raises:
    CheckpointError: naming the file (config.json, the index or a shard) and what is wrong.
  """
  hf_config = read_json(os.path.join(path, "config.json"))
  check_supported(hf_config)
  files_by_name = tensor_files(path)
  fp8 = check_fp8_tensors(path, files_by_name, block_size(hf_config))
  config = config_from_hf(hf_config, tensor_names=files_by_name.keys(), mtp_depths=mtp_depths)
  stored = stored_dtype(path, files_by_name, "model.embed_tokens.weight")
  config.param_dtype = param_dtype or stored
  config.dtype = dtype or stored
  # The decode cache holds what the forward computes in: a narrower cache makes cached decode
  # leave the full forward from the first token (docs/inference.md, "Cache dtype").
  config.cache_dtype = cache_dtype or config.dtype
  config.scan_layers = scan_layers
  cfg = ModelConfig.from_config(config)

  plan = load_plan(cfg, files_by_name)
  needed = {n for _, names, _ in plan for n in names}
  missing = sorted(needed - files_by_name.keys())
  scales = set(fp8.scale_names()) if fp8 else set()  # read with their FP8 tensors
  unexpected = sorted(set(files_by_name) - needed - scales
                      - set(ignorable_tensors(cfg, files_by_name)))
  if missing or unexpected:
    raise CheckpointError(
        f"{path}: checkpoint does not match its config.json.\n"
        f"  missing tensors ({len(missing)}): {head(missing)}\n"
        f"  unexpected tensors ({len(unexpected)}): {head(unexpected)}")
  leaves = leaf_sources(cfg, plan, abstract_params(cfg), path)
  return HFCheckpoint(path, config, files_by_name, leaves, fp8, allow_nonfinite)


def load_hf(path: str, *, param_dtype: str | None = None, dtype: str | None = None,
            mtp_depths: int = 3, scan_layers: bool = True, cache_dtype: str | None = None,
            allow_nonfinite: bool = False):
  """Reads a GLM-5 HF checkpoint directory into memory (see `streaming.py` for models larger
  than one host's memory).

  Args:
    path: directory with `config.json` and `*.safetensors`.
    param_dtype: dtype of the returned params; default: the dtype the embedding is stored in
      (bf16 in the FP8 release, whose FP8 tensors are dequantized, `hf_fp8`). The router kernel, its correction bias and the indexer's `weights_proj` stay fp32.
    dtype: compute dtype recorded in the config; default: the stored dtype, as for params.
    cache_dtype: the decode cache's dtype (`model.cache_dtype`); default: `dtype`, so cached
      decode equals the full forward (bfloat16 under an fp32 forward halves the cache and
      rounds every cached latent / key: docs/inference.md).
    mtp_depths: MTP prediction depths sharing the checkpoint's MTP layer (if it has one).
    scan_layers: the param layout (recorded as `config.scan_layers`): stacked runs
      `layers_{a}_{b}` (True) or `layers_{i}` (False); see `glm5_jax.layer_runs`.
    allow_nonfinite: load NaN / inf weights and FP8 scales; default: a CheckpointError naming
      the file and tensor (a NaN anywhere makes every forward NaN).
  Returns:
    `(config, params)`: the model ConfigDict (as `get_config().model`) and a nested dict of
    arrays matching `glm5_jax.init_params(config, rng)`.
  Raises:
    CheckpointError: naming the file (config.json, the index or a shard) and what is wrong.
  """
  checkpoint = open_hf(path, param_dtype=param_dtype, dtype=dtype, mtp_depths=mtp_depths,
                       scan_layers=scan_layers, cache_dtype=cache_dtype,
                       allow_nonfinite=allow_nonfinite)
  params = {}
  with checkpoint.reader() as reader:
    for leaf in checkpoint.leaves:  # each leaf goes to the device before the next is read
      _assign(params, leaf.path, jnp.asarray(checkpoint.read(leaf, reader), dtype=leaf.dtype))
  return checkpoint.config, params


def _assign(tree: dict, path: tuple, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value
