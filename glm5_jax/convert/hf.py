"""Import a GLM-5 HF checkpoint directory (`model_type: glm_moe_dsa`) as (config, params).

Reads `config.json` and safetensors (one file, or shards with `model.safetensors.index.json`),
tensor by tensor: each tensor is read, transposed/reshaped into our layout, cast and put on the
device before the next is read, so the model never exists twice in host memory. Both expert
layouts are accepted: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (the released
files) and fused `mlp.experts.gate_up_proj [E, 2F, D]` / `mlp.experts.down_proj [E, D, F]`
(what recent transformers writes). The MTP layer `model.layers.{num_hidden_layers}.*` is loaded
when present. Every tensor in the files must be used and every parameter filled; otherwise
the error lists what was missing or unexpected.

HF linears store `[out, in]`; our kernels are `[in, out]` with per-head axes split out
(see the layer docstrings for each kernel's layout).
"""

import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from safetensors import safe_open

from glm5_jax.api import abstract_params
from glm5_jax.config import ModelConfig, model_config

INDEX_FILE = "model.safetensors.index.json"
# Fields copied verbatim from config.json when present (same names as our model config).
_SAME_NAME_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "attention_bias", "index_topk", "index_n_heads",
    "index_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
    "moe_intermediate_size", "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group",
    "first_k_dense_replace", "max_position_embeddings", "rms_norm_eps", "initializer_range",
)
_FLOAT_FIELDS = ("routed_scaling_factor", "rms_norm_eps", "initializer_range")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class CheckpointError(ValueError):
  """The checkpoint directory does not hold a loadable GLM-5 checkpoint; says what and where."""


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
  """
  hf_config = _read_json(os.path.join(path, "config.json"))
  _check_supported(hf_config)
  files_by_name = _tensor_files(path)
  config = config_from_hf(hf_config, tensor_names=files_by_name.keys(), mtp_depths=mtp_depths)
  stored = _stored_dtype(path, files_by_name, "model.embed_tokens.weight")
  config.param_dtype = param_dtype or stored
  config.dtype = dtype or stored
  cfg = ModelConfig.from_config(config)

  plan = _load_plan(cfg, files_by_name)
  needed = {n for _, names, _ in plan for n in names}
  missing = sorted(needed - files_by_name.keys())
  unexpected = sorted(set(files_by_name) - needed - set(_ignorable(cfg, files_by_name)))
  if missing or unexpected:
    raise CheckpointError(
        f"{path}: checkpoint does not match its config.json.\n"
        f"  missing tensors ({len(missing)}): {_head(missing)}\n"
        f"  unexpected tensors ({len(unexpected)}): {_head(unexpected)}")

  shapes = abstract_params(cfg)
  params = {}
  with _TensorReader(path, files_by_name) as reader:
    for dest, names, build in plan:
      want = _lookup(shapes, dest)
      array = build(reader.read, want.dtype)
      if array.shape != want.shape:
        raise CheckpointError(
            f"{path}: {names[0]} gives {'/'.join(dest)} shape {array.shape}, but config.json "
            f"implies {want.shape}")
      _assign(params, dest, jnp.asarray(array, dtype=want.dtype))
      del array
  leaves = {'/'.join(str(k.key) for k in kp) for kp, _ in
            jax.tree_util.tree_flatten_with_path(shapes)[0]}
  filled = {'/'.join(str(k.key) for k in kp) for kp, _ in
            jax.tree_util.tree_flatten_with_path(params)[0]}
  if leaves != filled:
    raise CheckpointError(f"{path}: params left unfilled: {_head(sorted(leaves - filled))}")
  return config, params


def config_from_hf(hf: dict, tensor_names=(), mtp_depths: int = 3) -> ml_collections.ConfigDict:
  """Model ConfigDict from a `glm_moe_dsa` config.json dict (HF defaults where absent)."""
  _check_supported(hf)
  config = model_config()
  for name in _SAME_NAME_FIELDS:
    if name in hf:
      config[name] = float(hf[name]) if name in _FLOAT_FIELDS else hf[name]
  rope = hf.get("rope_parameters") or {}
  config.rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))

  num_layers = config.num_hidden_layers
  config.attention_pattern = "".join(
      {"full": "D", "shared": "R"}[t] for t in _indexer_types(hf, num_layers))
  mlp_types = hf.get("mlp_layer_types")
  if mlp_types is not None:
    if len(mlp_types) != num_layers or set(mlp_types) - {"dense", "sparse"}:
      raise CheckpointError(f"config.json: mlp_layer_types must list 'dense'/'sparse' for each "
                            f"of {num_layers} layers, got {mlp_types}")
    config.mlp_pattern = "".join("F" if t == "dense" else "E" for t in mlp_types)

  has_mtp_tensors = any(n.startswith(f"model.layers.{num_layers}.") for n in tensor_names)
  config.num_nextn_predict_layers = int(hf.get("num_nextn_predict_layers", 0) or has_mtp_tensors)
  if config.num_nextn_predict_layers and not has_mtp_tensors and tensor_names:
    # config.json declares an MTP layer the files lack: transformers drops it on load, so any
    # checkpoint re-saved from transformers looks like this. Load the main model and say so.
    logging.warning("config.json declares num_nextn_predict_layers=%d but no tensor "
                    "model.layers.%d.* exists; loading without the MTP layer",
                    config.num_nextn_predict_layers, num_layers)
    config.num_nextn_predict_layers = 0
  config.mtp_depths = mtp_depths if config.num_nextn_predict_layers else 0
  return config


def _check_supported(hf: dict) -> None:
  """Rejects config.json files describing something other than a plain GLM-5."""
  if hf.get("model_type") != "glm_moe_dsa":
    raise CheckpointError(f"config.json: model_type is {hf.get('model_type')!r}, expected "
                          "'glm_moe_dsa' (GLM-5)")
  if hf.get("quantization_config"):
    raise CheckpointError("config.json: quantization_config is set (e.g. the FP8 release); "
                          "load a bf16/fp32 checkpoint instead")
  # DeepSeek-style routing keys some exports carry; GLM-5's values are the only ones supported.
  for key, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
    if hf.get(key, expected) != expected:
      raise CheckpointError(f"config.json: {key} is {hf[key]!r}; GLM-5 routes with {expected!r}")
  rope = hf.get("rope_parameters") or {}
  if rope.get("rope_type", rope.get("type", "default")) != "default" or hf.get("rope_scaling"):
    raise CheckpointError(f"config.json: RoPE scaling (rope_scaling / rope_parameters "
                          f"{rope or hf.get('rope_scaling')}) is not supported; GLM-5 uses plain "
                          "RoPE")
  if hf.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"config.json: hidden_act {hf['hidden_act']!r}; GLM-5 uses 'silu'")
  if hf.get("tie_word_embeddings", False):
    raise CheckpointError("config.json: tie_word_embeddings=true, but GLM-5 unties its "
                          "embedding and LM head")
  if hf.get("q_lora_rank", 1) is None:
    raise CheckpointError("config.json: q_lora_rank is null; GLM-5's MLA and indexer need a "
                          "query latent")


def _indexer_types(hf: dict, num_layers: int) -> list[str]:
  """Per-layer "full"/"shared", resolved the way `GlmMoeDsaConfig.__post_init__` does."""
  types = hf.get("indexer_types")
  if types is None:
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
      types = [{"F": "full", "S": "shared"}[ch] for ch in pattern] if isinstance(
          pattern, str) else list(pattern)
    else:
      freq = max(hf.get("index_topk_freq", 1), 1)
      offset = hf.get("index_skip_topk_offset", 2)
      types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
               for i in range(num_layers)]
  if len(types) != num_layers or set(types) - {"full", "shared"}:
    raise CheckpointError(f"config.json: indexer types must be 'full'/'shared' for each of "
                          f"{num_layers} layers, got {types}")
  return types


# ----------------------------------------------------------------------------- load plan
# A plan entry is (destination path in params, HF tensor names it reads, build(read, dtype)).
# The helpers below return a `Source`: the names a parameter is made from and how.

Build = Callable[[Callable[[str], np.ndarray], np.dtype], np.ndarray]
Source = tuple[list[str], Build]


def _linear(name: str) -> Source:
  """HF `[out, in]` -> our `[in, out]`."""
  return [name], lambda read, dtype: np.ascontiguousarray(read(name).T, dtype=dtype)


def _copy(name: str) -> Source:
  return [name], lambda read, dtype: np.asarray(read(name), dtype=dtype)


def _per_head_in(name: str, heads: int) -> Source:
  """HF `[H * K, in]` -> `[in, H, K]`."""
  def build(read, dtype):
    w = read(name)
    return np.ascontiguousarray(w.reshape(heads, -1, w.shape[-1]).transpose(2, 0, 1), dtype)
  return [name], build


def _kv_b(name: str, heads: int, nope: int, value: bool) -> Source:
  """HF `kv_b_proj [H * (N + V), C]` (per head: N key rows, then V value rows) -> `[C, H, N|V]`."""
  def build(read, dtype):
    w = read(name)
    w = w.reshape(heads, -1, w.shape[-1])
    w = w[:, nope:] if value else w[:, :nope]
    return np.ascontiguousarray(w.transpose(2, 0, 1), dtype)
  return [name], build


def _o_proj(name: str, heads: int) -> Source:
  """HF `o_proj [D, H * V]` -> `[H, V, D]`."""
  def build(read, dtype):
    w = read(name)
    return np.ascontiguousarray(w.reshape(w.shape[0], heads, -1).transpose(1, 2, 0), dtype)
  return [name], build


def _stacked_experts(names: list[str]) -> Source:
  """Per-expert HF `[out, in]` -> `[E, in, out]`, filled expert by expert."""
  def build(read, dtype):
    first = read(names[0])
    out = np.empty((len(names),) + first.shape[::-1], dtype)
    out[0] = first.T
    for e, name in enumerate(names[1:], start=1):
      out[e] = read(name).T
    return out
  return names, build


def _fused_gate_up(name: str, up: bool) -> Source:
  """Fused HF `gate_up_proj [E, 2F, D]` (gate rows first) -> `[E, D, F]`."""
  def build(read, dtype):
    w = read(name)
    f = w.shape[1] // 2
    return np.ascontiguousarray((w[:, f:] if up else w[:, :f]).transpose(0, 2, 1), dtype)
  return [name], build


def _fused_down(name: str) -> Source:
  """Fused HF `down_proj [E, D, F]` -> `[E, F, D]`."""
  return [name], lambda read, dtype: np.ascontiguousarray(read(name).transpose(0, 2, 1), dtype)


def _layer_plan(cfg: ModelConfig, hf_layer: int, dest: tuple, attention_kind: str, moe: bool,
                available) -> list:
  p = f"model.layers.{hf_layer}."
  h = cfg.num_attention_heads
  plan = [
      (dest + ("input_layernorm", "scale"), _copy(p + "input_layernorm.weight")),
      (dest + ("post_attention_layernorm", "scale"), _copy(p + "post_attention_layernorm.weight")),
  ]
  a, ad = p + "self_attn.", dest + ("self_attn",)
  plan += [
      (ad + ("q_a_proj",), _linear(a + "q_a_proj.weight")),
      (ad + ("q_a_layernorm", "scale"), _copy(a + "q_a_layernorm.weight")),
      (ad + ("q_b_proj",), _per_head_in(a + "q_b_proj.weight", h)),
      (ad + ("kv_a_proj_with_mqa",), _linear(a + "kv_a_proj_with_mqa.weight")),
      (ad + ("kv_a_layernorm", "scale"), _copy(a + "kv_a_layernorm.weight")),
      (ad + ("k_b_proj",), _kv_b(a + "kv_b_proj.weight", h, cfg.qk_nope_head_dim, False)),
      (ad + ("v_b_proj",), _kv_b(a + "kv_b_proj.weight", h, cfg.qk_nope_head_dim, True)),
      (ad + ("o_proj",), _o_proj(a + "o_proj.weight", h)),
  ]
  if cfg.attention_bias:
    plan += [(ad + (f"{n}_bias",), _copy(a + f"{n}.bias"))
             for n in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")]
  if attention_kind == "dsa":
    i, idd = a + "indexer.", ad + ("indexer",)
    plan += [
        (idd + ("wq_b",), _per_head_in(i + "wq_b.weight", cfg.index_n_heads)),
        (idd + ("wk",), _linear(i + "wk.weight")),
        (idd + ("k_norm", "scale"), _copy(i + "k_norm.weight")),
        (idd + ("k_norm", "bias"), _copy(i + "k_norm.bias")),
        (idd + ("weights_proj",), _linear(i + "weights_proj.weight")),
    ]
  m, md = p + "mlp.", dest + ("mlp",)
  if not moe:
    return plan + [(md + (n,), _linear(m + f"{n}.weight"))
                   for n in ("gate_proj", "up_proj", "down_proj")]
  plan += [
      (md + ("gate",), _linear(m + "gate.weight")),
      (md + ("e_score_correction_bias",), _copy(m + "gate.e_score_correction_bias")),
  ]
  ed = md + ("experts",)
  if m + "experts.gate_up_proj" in available:
    plan += [
        (ed + ("gate_proj",), _fused_gate_up(m + "experts.gate_up_proj", up=False)),
        (ed + ("up_proj",), _fused_gate_up(m + "experts.gate_up_proj", up=True)),
        (ed + ("down_proj",), _fused_down(m + "experts.down_proj")),
    ]
  else:
    plan += [(ed + (n,), _stacked_experts(
        [m + f"experts.{e}.{n}.weight" for e in range(cfg.n_routed_experts)]))
             for n in ("gate_proj", "up_proj", "down_proj")]
  if cfg.n_shared_experts:
    plan += [(md + ("shared_experts", n), _linear(m + f"shared_experts.{n}.weight"))
             for n in ("gate_proj", "up_proj", "down_proj")]
  return plan


def _load_plan(cfg: ModelConfig, available) -> list:
  """[(dest, [hf names], build)] for every parameter of `cfg`."""
  plan = [
      (("embed_tokens",), _copy("model.embed_tokens.weight")),
      (("norm", "scale"), _copy("model.norm.weight")),
      (("lm_head",), _linear("lm_head.weight")),
  ]
  for i in range(cfg.num_hidden_layers):
    plan += _layer_plan(cfg, i, (f"layers_{i}",), cfg.attention_kind(i), cfg.is_moe_layer(i),
                        available)
  if cfg.num_nextn_predict_layers:
    n = cfg.num_hidden_layers
    p = f"model.layers.{n}."
    plan += _layer_plan(cfg, n, ("mtp", "layer"), cfg.attention_kind(n),
                        cfg.is_moe_layer(n), available)
    plan += [
        (("mtp", "eh_proj"), _linear(p + "eh_proj.weight")),
        (("mtp", "enorm", "scale"), _copy(p + "enorm.weight")),
        (("mtp", "hnorm", "scale"), _copy(p + "hnorm.weight")),
        (("mtp", "shared_head_norm", "scale"), _copy(p + "shared_head.norm.weight")),
    ]
  return [(dest, names, build) for dest, (names, build) in plan]


def _ignorable(cfg: ModelConfig, names) -> list[str]:
  """Known tensors we deliberately skip: the MTP layer's copies of the embedding and LM head
  (DeepSeek-style exports; the model uses its main ones) and cached RoPE frequencies."""
  mtp = f"model.layers.{cfg.num_hidden_layers}."
  skip = (mtp + "embed_tokens.weight", mtp + "shared_head.head.weight")
  return [n for n in names if n in skip or n.endswith("rotary_emb.inv_freq")]


# ----------------------------------------------------------------------------- file access

def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    raise CheckpointError(f"{path}: not found (expected an HF checkpoint directory)")
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def _tensor_files(path: str) -> dict[str, str]:
  """Tensor name -> safetensors file, from the index if present, else from the files."""
  index = os.path.join(path, INDEX_FILE)
  if os.path.isfile(index):
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index}: has no 'weight_map' object")
    absent = sorted({f for f in weight_map.values()
                     if not os.path.isfile(os.path.join(path, f))})
    if absent:
      raise CheckpointError(f"{index}: names shards that do not exist: {_head(absent)}")
    return dict(weight_map)
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
  names = {}
  for file in files:
    with safe_open(os.path.join(path, file), framework="numpy") as f:
      for name in f.keys():
        if name in names:
          raise CheckpointError(f"{path}: tensor {name} is in both {names[name]} and {file}")
        names[name] = file
  return names


def _stored_dtype(path: str, files_by_name: dict[str, str], name: str) -> str:
  if name not in files_by_name:
    raise CheckpointError(f"{path}: no tensor {name}")
  with safe_open(os.path.join(path, files_by_name[name]), framework="numpy") as f:
    stored = f.get_slice(name).get_dtype()
  if stored not in _SAFETENSORS_DTYPES:
    raise CheckpointError(f"{path}: {name} is stored as {stored}; expected one of "
                          f"{sorted(_SAFETENSORS_DTYPES)} (dequantize FP8 checkpoints first)")
  return _SAFETENSORS_DTYPES[stored]


class _TensorReader:
  """Opens each shard once and reads single tensors as numpy arrays."""

  def __init__(self, path: str, files_by_name: dict[str, str]):
    self._path, self._files_by_name, self._open = path, files_by_name, {}

  def read(self, name: str) -> np.ndarray:
    file = self._files_by_name[name]
    if file not in self._open:
      self._open[file] = safe_open(os.path.join(self._path, file), framework="numpy")
      self._open[file].__enter__()
    return self._open[file].get_tensor(name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    for handle in self._open.values():
      handle.__exit__(None, None, None)
    self._open.clear()


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


def _head(items: list, limit: int = 20) -> str:
  shown = ", ".join(items[:limit])
  return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "") or "none"
