"""The files of an HF checkpoint directory: JSON (`config.json`, the shard index) and safetensors
shards, read tensor by tensor. Every error names the file (or shard) it is about.

A directory holds one `*.safetensors` file or several shards with `model.safetensors.index.json`
(`weight_map`: tensor name -> shard file). With an index, each shard's header is read up front
and must hold every tensor the index maps to it, so a missing shard, a truncated or corrupt
one, or an index that disagrees with its shards fails before any tensor is loaded.
"""

import json
import os

import numpy as np
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class CheckpointError(ValueError):
  """The checkpoint directory does not hold a loadable GLM-5 checkpoint; says what and where."""


def read_json(path: str) -> dict:
  if not os.path.isfile(path):
    raise CheckpointError(f"{path}: not found (expected an HF checkpoint directory)")
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def open_safetensors(path: str):
  """`safe_open(path)` (numpy); a truncated or corrupt file raises `CheckpointError` naming it."""
  try:
    return safe_open(path, framework="numpy")
  except (SafetensorError, OSError) as e:
    raise CheckpointError(f"{path}: not a readable safetensors file ({e}); re-download or "
                          "re-save it") from e


def tensor_files(path: str) -> dict[str, str]:
  """Tensor name -> safetensors file (relative to `path`), from the index if present, else from
  the files' headers."""
  index = os.path.join(path, INDEX_FILE)
  if os.path.isfile(index):
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index}: has no 'weight_map' object")
    absent = sorted({f for f in weight_map.values()
                     if not os.path.isfile(os.path.join(path, f))})
    if absent:
      raise CheckpointError(f"{index}: names shards that do not exist: {head(absent)}")
    names_by_file = {}
    for name, file in weight_map.items():
      names_by_file.setdefault(file, []).append(name)
    for file, names in sorted(names_by_file.items()):
      with open_safetensors(os.path.join(path, file)) as f:
        missing = sorted(set(names) - set(f.keys()))
      if missing:
        raise CheckpointError(f"{os.path.join(path, file)}: does not hold {len(missing)} "
                              f"tensors that {INDEX_FILE} maps to it: {head(missing)}")
    return dict(weight_map)
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
  names = {}
  for file in files:
    with open_safetensors(os.path.join(path, file)) as f:
      for name in f.keys():
        if name in names:
          raise CheckpointError(f"{path}: tensor {name} is in both {names[name]} and {file}")
        names[name] = file
  return names


def stored_dtype(path: str, files_by_name: dict[str, str], name: str) -> str:
  """The dtype (our name) tensor `name` is stored in."""
  if name not in files_by_name:
    raise CheckpointError(f"{path}: no tensor {name}")
  file = os.path.join(path, files_by_name[name])
  with open_safetensors(file) as f:
    stored = f.get_slice(name).get_dtype()
  if stored not in SAFETENSORS_DTYPES:
    raise CheckpointError(f"{file}: {name} is stored as {stored}; expected one of "
                          f"{sorted(SAFETENSORS_DTYPES)}")
  return SAFETENSORS_DTYPES[stored]


def check_finite(values: np.ndarray, file: str, name: str) -> np.ndarray:
  """`values`, or a CheckpointError naming the file and tensor when any is NaN or infinite (a
  corrupt or badly converted tensor: loaded, it makes every forward NaN)."""
  if values.dtype.kind in "fV" or values.dtype.name in ("bfloat16",):
    bad = int(values.size - np.count_nonzero(np.isfinite(values.astype(np.float32, copy=False))))
    if bad:
      raise CheckpointError(f"{file}: tensor {name} has {bad} non-finite values (NaN or inf) of "
                            f"{values.size}; pass allow_nonfinite=True to load it anyway")
  return values


class TensorReader:
  """Opens each shard once and reads single tensors (or row ranges of them) as numpy arrays;
  with `fp8` (an `hf_fp8.Fp8Format`), its FP8 tensors come back dequantized, float32. A NaN or
  infinite value (a weight, an FP8 scale, a dequantized weight) is a CheckpointError naming
  the file and tensor unless `allow_nonfinite`."""

  def __init__(self, path: str, files_by_name: dict[str, str], fp8=None,
               allow_nonfinite: bool = False):
    self._path, self._files_by_name, self._open = path, files_by_name, {}
    self._fp8, self._allow_nonfinite = fp8, allow_nonfinite

  def read(self, name: str, rows: slice | None = None) -> np.ndarray:
    """Tensor `name`, or only `tensor[rows]` (a slice of its first axis; only those bytes are
    read)."""
    file = os.path.join(self._path, self._files_by_name[name])
    values = self._read(file, name, rows)
    return values if self._allow_nonfinite else check_finite(values, file, name)

  def _read(self, file: str, name: str, rows: slice | None) -> np.ndarray:
    if self._fp8 is not None and name in self._fp8.shapes:
      return self._fp8.read(self.read, file, name, rows)
    if file not in self._open:
      self._open[file] = open_safetensors(file)
      self._open[file].__enter__()
    try:
      if rows is None or rows == slice(None):
        return self._open[file].get_tensor(name)
      return self._open[file].get_slice(name)[rows]
    except SafetensorError as e:
      raise CheckpointError(f"{file}: cannot read tensor {name} ({e})") from e

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    for handle in self._open.values():
      handle.__exit__(None, None, None)
    self._open.clear()


def head(items: list, limit: int = 20) -> str:
  """`items` joined for an error message, at most `limit` of them."""
  shown = ", ".join(items[:limit])
  return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "") or "none"
