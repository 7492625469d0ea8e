"""The HF fine-grained FP8 layout (`convert/hf_fp8.py`): loaded by `load_hf` and the streaming
converter, dequantized as read, equal to a float64 numpy dequantization; bad files named.

Tiny random HF models (test_hf_parity's) are quantized here the way the FP8 release is: every
linear weight of attention, dense MLP, shared and routed experts to float8_e4m3fn with a float32
`weight_scale_inv` per block; embeddings, LM head, norms and the router stay float32. Block sizes
the tiny shapes do not divide (and 128 x 128, one partial block) cover the edge blocks.
"""

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import glm5_jax  # noqa: E402
from glm5_jax.convert import hf_fp8, streaming  # noqa: E402
from glm5_jax.convert.converted import load_converted  # noqa: E402
from glm5_jax.convert.hf import CheckpointError, open_hf  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from test_hf_parity import _hf_model, _per_expert_state  # noqa: E402
from test_convert_streaming import assert_trees_equal, one_device_mesh  # noqa: E402

F8 = ml_dtypes.float8_e4m3fn
F8_MAX = float(ml_dtypes.finfo(F8).max)  # 448


def quantize(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
  """Block FP8 as the releases store it: scale_inv = amax / 448 per block of the last 2 axes."""
  m, n = block
  rows, cols = w.shape[-2:]
  grid = hf_fp8.scale_shape(w.shape, block)
  padded = np.zeros(w.shape[:-2] + (grid[-2] * m, grid[-1] * n), np.float64)
  padded[..., :rows, :cols] = w
  blocks = padded.reshape(w.shape[:-2] + (grid[-2], m, grid[-1], n))
  scale = np.abs(blocks).max(axis=(-3, -1)) / F8_MAX
  scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
  return (w / expand(scale, w.shape, block)).astype(F8), scale


def expand(scale, shape, block):
  """float64 reference: each block's scale repeated over its (possibly partial) block."""
  full = np.repeat(np.repeat(scale.astype(np.float64), block[0], -2), block[1], -1)
  return full[..., :shape[-2], :shape[-1]]


def reference(values, scale, block):
  return values.astype(np.float64) * expand(scale, values.shape, block)


def quantized_name(name: str) -> bool:
  """The tensors the release stores in FP8: linear weights, not embeddings/head/norms/router."""
  if "norm" in name or "embed_tokens" in name or name.startswith("lm_head"):
    return False
  if name.endswith("mlp.gate.weight") or "e_score_correction_bias" in name:
    return False
  return name.endswith(".weight") or name.endswith("experts.gate_up_proj") or name.endswith(
      "experts.down_proj")


def write_pair(path, layout, block, shards, seed=0, **hf):
  """An FP8 checkpoint at `path/fp8` and its float64 dequantization (stored float32) at
  `path/ref`. Returns (fp8 state, scales)."""
  model = _hf_model(hf, seed=seed)
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  if layout == "per_expert":
    import torch
    state = {k: v.numpy() for k, v in _per_expert_state(
        {k: torch.from_numpy(v) for k, v in state.items()}).items()}
  fp8, ref = {}, {}
  for name, w in state.items():
    if quantized_name(name):
      values, scale = quantize(w, block)
      fp8[name], fp8[name + "_scale_inv"] = values, scale
      ref[name] = reference(values, scale, block).astype(np.float32)
    else:
      fp8[name] = ref[name] = np.ascontiguousarray(w)
  config = model.config.to_dict()
  quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": list(block)}
  write_state(path / "fp8", {**config, "quantization_config": quant}, fp8, shards)
  write_state(path / "ref", config, ref, 1)
  return fp8


def write_state(path, config, state, shards):
  os.makedirs(path, exist_ok=True)
  (path / "config.json").write_text(json.dumps(config))
  names = sorted(state)
  if shards == 1:
    save_file(state, str(path / "model.safetensors"))
    return
  weight_map = {}
  for i, chunk in enumerate(np.array_split(np.array(names), shards)):
    file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    save_file({n: state[n] for n in chunk}, str(path / file))
    weight_map.update({n: file for n in chunk})
  (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shape,block,rows", [((200, 130), (128, 128), slice(100, 190)),
                                              ((70, 45), (16, 32), slice(5, 37)),
                                              ((3, 70, 45), (16, 32), slice(1, 3))])
def test_dequantize_equals_float64_reference(shape, block, rows, tmp_path):
  rng = np.random.default_rng(0)
  w = rng.standard_normal(shape) * rng.uniform(0.01, 30, shape[:-1] + (1,))
  values, scale = quantize(w, block)
  want = reference(values, scale, block)
  assert np.abs(want - w).max() <= np.abs(w).max() / 8  # e4m3: 3 mantissa bits, scaled per block
  got = hf_fp8.dequantize(values, scale, block)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, want.astype(np.float32))
  # Row ranges through the reader: only those rows (and their block rows of scales) are read.
  save_file({"w": values, "w_scale_inv": scale}, str(tmp_path / "m.safetensors"))
  fmt = hf_fp8.check_fp8_tensors(str(tmp_path), {"w": "m.safetensors",
                                                 "w_scale_inv": "m.safetensors"}, block)
  from glm5_jax.convert.hf_files import TensorReader
  with TensorReader(str(tmp_path), {"w": "m.safetensors", "w_scale_inv": "m.safetensors"},
                    fmt) as reader:
    np.testing.assert_array_equal(reader.read("w", rows), want[rows].astype(np.float32))
    np.testing.assert_array_equal(reader.read("w"), want.astype(np.float32))


@pytest.mark.parametrize("layout,block,shards", [("per_expert", (16, 32), 1),
                                                 ("fused", (128, 128), 3)])
def test_fp8_checkpoint_loads_as_its_dequantization(layout, block, shards, tmp_path):
  fp8 = write_pair(tmp_path, layout, block, shards)
  assert sum(v.dtype == F8 for v in fp8.values()) > 20
  config, params = glm5_jax.load_hf(str(tmp_path / "fp8"), param_dtype="float32")
  ref_config, ref_params = glm5_jax.load_hf(str(tmp_path / "ref"))
  assert config.to_dict() == ref_config.to_dict()
  assert_trees_equal(params, ref_params)
  if layout == "fused":  # streamed, and a fused expert tensor read by expert rows
    out = str(tmp_path / "out")
    streaming.convert_streaming(str(tmp_path / "fp8"), out, mesh=one_device_mesh(),
                                param_dtype="float32", progress=lambda line: None)
    assert_trees_equal(load_converted(out)[1], ref_params)
    checkpoint = open_hf(str(tmp_path / "fp8"), param_dtype="float32")
    leaf = next(l for l in checkpoint.leaves if l.path[-1] == "down_proj" and "experts" in l.path)
    index = (slice(None), slice(2, 5)) + tuple(slice(None) for _ in leaf.shape[2:])
    with checkpoint.reader() as reader:
      got = checkpoint.read(leaf, reader, index)
    path = leaf.path
    want = ref_params
    for key in path:
      want = want[key]
    np.testing.assert_array_equal(got, np.asarray(want)[index])


def test_bad_fp8_checkpoints_name_the_field_or_tensor(tmp_path):
  fp8 = write_pair(tmp_path, "per_expert", (16, 32), 1, num_hidden_layers=2)
  config = json.loads((tmp_path / "fp8" / "config.json").read_text())
  scale = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"

  def load(config_update=None, state=fp8):
    bad = tmp_path / "bad"
    shutil.rmtree(bad, ignore_errors=True)
    write_state(bad, {**config, **(config_update or {})}, state, 1)
    glm5_jax.load_hf(str(bad))

  load()  # the unaltered checkpoint loads
  for quant, match in (({"quant_method": "awq"}, "quant_method is 'awq'"),
                       ({"weight_block_size": [128]}, "weight_block_size is \\[128\\]"),
                       ({"weight_block_size": None}, "weight_block_size is None"),
                       ({"weight_block_size": [0, 128]}, "weight_block_size"),
                       ({"fmt": "e5m2"}, "fmt is 'e5m2'")):
    with pytest.raises(CheckpointError, match=match):
      load({"quantization_config": {**config["quantization_config"], **quant}})
  with pytest.raises(CheckpointError, match="no quantization_config"):
    load({"quantization_config": None})
  missing = {k: v for k, v in fp8.items() if k != scale}
  with pytest.raises(CheckpointError, match=f"q_a_proj.weight has no {scale}"):
    load(state=missing)
  with pytest.raises(CheckpointError, match=f"{scale} has shape \\(1, 1\\)"):
    load(state={**fp8, scale: np.ones((1, 1), np.float32)})
  orphan = {**fp8, "model.layers.0.mlp.gate.weight_scale_inv": np.ones((1, 1), np.float32)}
  with pytest.raises(CheckpointError, match="scales without .*mlp.gate.weight_scale_inv"):
    load(state=orphan)
  jax.clear_caches()
