"""HF fine-grained FP8 checkpoints (GLM-5's FP8 release): found, checked, and dequantized as read.

The layout (transformers' `FineGrainedFP8Config`, DeepSeek-V3's release format):
  - `config.json` holds `quantization_config = {"quant_method": "fp8", "weight_block_size":
    [m, n], ...}` (GLM-5 / DeepSeek-V3: [128, 128]; `fmt: "e4m3"`, `activation_scheme:
    "dynamic"` concern the FP8 matmul at run time, not the stored weights).
  - A quantized tensor `x` is stored as `float8_e4m3fn` (safetensors `F8_E4M3`) beside a float
    `x_scale_inv` (`name.weight` -> `name.weight_scale_inv`; a fused expert tensor
    `...experts.gate_up_proj` -> `...experts.gate_up_proj_scale_inv`) with one value per
    m x n block of the last two axes: shape `lead + (ceil(rows / m), ceil(cols / n))`. Edge
    blocks are partial (the block grid is the ceiling, its last row/column covers what is
    left), and the value is `x[..., i, j] = fp8[..., i, j] * scale_inv[..., i // m, j // n]`.
  - Which tensors are quantized is read from the files, not assumed: in the releases the linear
    weights of attention, dense MLP and experts are FP8, while embeddings, the LM head, norms,
    the router (`mlp.gate.weight`, its `e_score_correction_bias`) and biases stay bf16/fp32.
    Every FP8 tensor must have its scale and every scale its FP8 tensor.

safetensors' numpy reader has no float8 type (numpy has none), so FP8 tensors are read here
from the file's header offsets through `np.memmap` as `ml_dtypes.float8_e4m3fn`; a row range
(one device's experts of a fused tensor) reads only those bytes. Dequantization happens per
tensor (or row range) as the importer reads it, so the model never exists in host memory whole.
"""

import dataclasses
import functools
import json
import os
import struct

import ml_dtypes
import numpy as np

from glm5_jax.convert.hf_files import CheckpointError, head, open_safetensors

SCALE_SUFFIX = "_scale_inv"
FP8_STORED = "F8_E4M3"
_SCALE_STORED = ("F32", "BF16", "F16")


@dataclasses.dataclass(frozen=True)
class Fp8Format:
  """A checked FP8 checkpoint: its block size and the quantized tensors with their shapes."""

  block: tuple[int, int]
  shapes: dict  # quantized tensor name -> its shape (the scale is `name + SCALE_SUFFIX`)

  def scale_names(self) -> list[str]:
    return [n + SCALE_SUFFIX for n in self.shapes]

  def read(self, read, file: str, name: str, rows: slice | None) -> np.ndarray:
    """FP8 `name[rows]` of `file` times its block scales (read with `read(name, rows)`, the
    `TensorReader`'s): a >= 3-D tensor's rows are leading-axis (expert) indices, whole blocks;
    a 2-D tensor's rows take the block rows that cover them."""
    shape, m = self.shapes[name], self.block[0]
    start, stop, _ = (rows or slice(None)).indices(shape[0])
    values = read_fp8(file, name, slice(start, stop))
    if len(shape) > 2:
      return dequantize(values, read(name + SCALE_SUFFIX, slice(start, stop)), self.block)
    scales = read(name + SCALE_SUFFIX, slice(start // m, -(-stop // m)))
    return dequantize(values, scales, self.block, row_offset=start)


def block_size(hf_config: dict) -> tuple[int, int] | None:
  """`quantization_config.weight_block_size` of config.json, or None without quantization.

  Raises:
    CheckpointError: another `quant_method`, or a block size that is not two positive ints
      (per-tensor FP8, `weight_block_size: null`, is a different layout and not read).
  """
  quant = hf_config.get("quantization_config")
  if not quant:
    return None
  method = quant.get("quant_method")
  if method != "fp8":
    raise CheckpointError(f"config.json: quantization_config.quant_method is {method!r}; only "
                          "'fp8' (fine-grained block FP8) checkpoints are read")
  fmt = quant.get("fmt", "e4m3")
  if fmt != "e4m3":
    raise CheckpointError(f"config.json: quantization_config.fmt is {fmt!r}; only 'e4m3' "
                          "(float8_e4m3fn weights) is read")
  block = quant.get("weight_block_size")
  if (not isinstance(block, (list, tuple)) or len(block) != 2
      or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
    raise CheckpointError(f"config.json: quantization_config.weight_block_size is {block!r}; "
                          "expected two positive integers [rows, cols] (e.g. [128, 128])")
  return int(block[0]), int(block[1])


def check_fp8_tensors(path: str, files_by_name: dict[str, str],
                      block: tuple[int, int] | None) -> Fp8Format | None:
  """Pairs every FP8 tensor with its scale and checks the scale's shape and dtype.

  Raises:
    CheckpointError: naming the tensor: FP8 tensors without `quantization_config`, an FP8
      tensor without its scale (or a scale without its tensor), a scale of the wrong shape or
      dtype, an FP8 tensor of rank < 2.
  """
  stored, shapes = {}, {}
  by_file = {}
  for name, file in files_by_name.items():
    by_file.setdefault(file, []).append(name)
  for file, names in by_file.items():
    with open_safetensors(os.path.join(path, file)) as f:
      for name in names:
        view = f.get_slice(name)
        stored[name], shapes[name] = view.get_dtype(), tuple(view.get_shape())
  fp8 = sorted(n for n, d in stored.items() if d == FP8_STORED)
  if not fp8:
    if block is not None:
      raise CheckpointError(f"{path}: config.json sets quantization_config but no tensor is "
                            f"stored as {FP8_STORED}")
    return None
  if block is None:
    raise CheckpointError(f"{path}: {len(fp8)} tensors are stored as {FP8_STORED} ({head(fp8)}) "
                          "but config.json has no quantization_config (weight_block_size)")
  scales = sorted(n for n in stored if n.endswith(SCALE_SUFFIX))
  orphans = sorted(s for s in scales if s[: -len(SCALE_SUFFIX)] not in fp8)
  if orphans:
    raise CheckpointError(f"{path}: scales without an {FP8_STORED} tensor: {head(orphans)}")
  for name in fp8:
    scale, shape = name + SCALE_SUFFIX, shapes[name]
    if scale not in stored:
      raise CheckpointError(f"{path}: {FP8_STORED} tensor {name} has no {scale}")
    if len(shape) < 2:
      raise CheckpointError(f"{path}: {FP8_STORED} tensor {name} has shape {shape}; block "
                            "scales need at least 2 axes")
    want = scale_shape(shape, block)
    if shapes[scale] != want:
      raise CheckpointError(f"{path}: {scale} has shape {shapes[scale]}, but {name} "
                            f"{shape} in blocks of {list(block)} needs {want}")
    if stored[scale] not in _SCALE_STORED:
      raise CheckpointError(f"{path}: {scale} is stored as {stored[scale]}; expected one of "
                            f"{list(_SCALE_STORED)}")
  return Fp8Format(block, {n: shapes[n] for n in fp8})


def scale_shape(shape: tuple, block: tuple[int, int]) -> tuple:
  """The block-scale shape of a tensor of `shape`: the ceiling block grid of its last 2 axes."""
  return tuple(shape[:-2]) + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def dequantize(values: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
               row_offset: int = 0) -> np.ndarray:
  """`values * scale_inv` broadcast over blocks, in float32 (exact: an e4m3 value has 4
  significant bits, so the float32 product is the correctly rounded float64 product).

  Args:
    values: `lead + (r, c)` FP8 (any float dtype) rows `row_offset ...` of a 2-D tensor, or a
      leading-axis slice of a >= 3-D one (`row_offset` 0: its last 2 axes are whole).
    scale_inv: the scales covering `values`: `lead + (R, ceil(c / n))`, R block rows starting
      at block row `row_offset // m`.
  """
  m, n = block
  rows, cols = values.shape[-2:]
  row_block = (np.arange(row_offset, row_offset + rows) // m) - row_offset // m
  expanded = scale_inv.astype(np.float32)[..., row_block, :][..., np.arange(cols) // n]
  return values.astype(np.float32) * expanded


@functools.lru_cache(maxsize=4)  # a shard's header is parsed once while its tensors are read
def _header(file: str) -> tuple[int, dict]:
  with open(file, "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    return size, json.loads(f.read(size))


def read_fp8(file: str, name: str, rows: slice | None = None) -> np.ndarray:
  """FP8 tensor `name` of safetensors `file` (or `tensor[rows]`) as `float8_e4m3fn`, through a
  memmap of its bytes (only the rows asked for are read)."""
  size, header = _header(file)
  entry = header[name]
  begin, end = entry["data_offsets"]
  shape = tuple(entry["shape"])
  if entry["dtype"] != FP8_STORED or end - begin != int(np.prod(shape, dtype=np.int64)):
    raise CheckpointError(f"{file}: {name} is {entry['dtype']} {shape} over {end - begin} bytes; "
                          f"expected {FP8_STORED}, one byte per value")
  if begin == end:
    return np.zeros(shape, ml_dtypes.float8_e4m3fn)[rows if rows is not None else ...]
  data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + size + begin, shape=(end - begin,))
  array = data.view(ml_dtypes.float8_e4m3fn).reshape(shape)
  return np.array(array if rows is None else array[rows])
