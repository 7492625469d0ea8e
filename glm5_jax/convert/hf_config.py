"""GLM-5's HF `config.json` (`model_type: glm_moe_dsa`) -> our model ConfigDict.

Field names are HF's wherever `model_config()` has the same field. The per-layer patterns are
resolved as `transformers`' `GlmMoeDsaConfig.__post_init__` does: `indexer_types` ("full" -> D,
"shared" -> R) and `mlp_layer_types` ("dense" -> F, "sparse" -> E). Anything that is not a
plain GLM-5 (another model type, a quantization other than block FP8, RoPE scaling, tied
embeddings, ...) is refused with a `CheckpointError` naming the key; the FP8 release's
`quantization_config` is checked by `hf_fp8.block_size`.
"""

import ml_collections
from absl import logging

from glm5_jax.config import model_config
from glm5_jax.convert.hf_files import CheckpointError
from glm5_jax.convert.hf_fp8 import block_size

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
_BOOL_FIELDS = ("attention_bias", "norm_topk_prob")
# The sizes that make a model: never taken from the 744B defaults when config.json lacks them.
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _checked_value(hf: dict, name: str):
  """config.json's `name`, of the type our field has; CheckpointError naming it otherwise."""
  value = hf[name]
  if name in _FLOAT_FIELDS:
    ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    value = float(value) if ok else value
  elif name in _BOOL_FIELDS:
    ok, want = isinstance(value, bool), "true or false"
  else:
    ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 0, (
        "an integer >= 0")
  if not ok:
    raise CheckpointError(f"config.json: {name} is {value!r} ({type(value).__name__}); expected "
                          f"{want}")
  return value


def config_from_hf(hf: dict, tensor_names=(), mtp_depths: int = 3) -> ml_collections.ConfigDict:
  """Model ConfigDict from a `glm_moe_dsa` config.json dict (HF defaults where absent)."""
  check_supported(hf)
  config = model_config()
  for name in _SAME_NAME_FIELDS:
    if name in hf:
      config[name] = _checked_value(hf, name)
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


def check_supported(hf: dict) -> None:
  """Rejects config.json files describing something other than a plain GLM-5."""
  if hf.get("model_type") != "glm_moe_dsa":
    raise CheckpointError(f"config.json: model_type is {hf.get('model_type')!r}, expected "
                          "'glm_moe_dsa' (GLM-5)")
  block_size(hf)  # a quantization_config other than block FP8 is refused, naming the field
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
  if missing := [name for name in _REQUIRED_FIELDS if name not in hf]:
    raise CheckpointError(f"config.json: no {', '.join(missing)}; a glm_moe_dsa config.json "
                          f"states the model's sizes ({', '.join(_REQUIRED_FIELDS)})")
  for name in _SAME_NAME_FIELDS:
    if name in hf:
      _checked_value(hf, name)


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
