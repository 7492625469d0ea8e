"""Parameter counts per component, active parameters per token, KV-cache bytes per token.

Works on `jax.ShapeDtypeStruct` trees from `glm5_jax.abstract_params`, so nothing is allocated.
Used by `tools/param_count.py` and by training's FLOPs/MFU estimate.

What is counted (docs/reference.md section 1):
  total_params                      every parameter, MTP layer included
  total_params_without_mtp          the main model only
  active_params                     per token, main model: every non-routed-expert parameter
                                    plus num_experts_per_tok / n_routed_experts of the routed ones
  active_params_without_embeddings  active_params minus the embedding table and the LM head

Components are read off the param-tree paths: `embed_tokens`, `lm_head`, `norm`,
`layers_{i}/{input_layernorm, post_attention_layernorm, self_attn[/indexer], mlp/...}` (or a
scanned run `layers_{i}_{j}/...`, whose stacked leaves count every layer of the run) and
`mtp/{eh_proj, enorm, hnorm, shared_head_norm, layer/...}`. Norms inside the attention block
(`q_a_layernorm`, `kv_a_layernorm`, the indexer's `k_norm`) count with attention / indexer;
`norms` holds the layer pre-norms and final norms. The router's `e_score_correction_bias` is
in the params tree (never trained by gradients) and counts with the router.

KV cache per token (bf16, summed over the main layers; the MTP layer's cache is left out): each
layer's `AttentionKind.cache_numbers_per_token` (glm5_jax.attention.kinds), by cache part:
`mla_latent` (M/D/R: `kv_lora_rank + qk_rope_head_dim`), `dsa_indexer_keys` (D: its indexer key
`index_head_dim`), `swa_latent` (S: the same latent, but only for the last `sliding_window`
tokens: bytes per token while the context fits the window, a constant `sliding_window` times that
beyond), `gqa_kv` (G: `2 * num_key_value_heads * gqa_head_dim`). N and L layers keep no
per-token cache: their fixed-size state (`AttentionKind.recurrent_state_bytes`, per sequence) is
reported apart. For comparison, a GQA-8 model with head dim 128 stores `2 * 8 * 128` per layer.
"""

import collections
import math

import jax
from flax import traverse_util

from glm5_jax.api import abstract_params
from glm5_jax.attention.kinds import ATTENTION_KINDS, CACHE_BYTES_PER_NUMBER
from glm5_jax.config import ModelConfig

# Main-model components, in table order; `mtp` is the whole MTP subtree.
COMPONENTS = ("embedding", "lm_head", "attention", "indexer", "dense_ffn", "router",
              "routed_experts", "shared_experts", "norms")
MTP_COMPONENTS = COMPONENTS + ("mtp_eh_proj",)
TOP_LEVEL = {"embed_tokens": "embedding", "lm_head": "lm_head", "norm": "norms"}
MTP_TOP_LEVEL = {"eh_proj": "mtp_eh_proj", "enorm": "norms", "hnorm": "norms",
                 "shared_head_norm": "norms"}
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
ROUTER = ("gate", "e_score_correction_bias")  # MoE `mlp/gate` is the router kernel
DENSE_FFN = ("gate_proj", "up_proj", "down_proj")  # dense `mlp/{gate,up,down}_proj`

CACHE_PARTS = ("mla_latent", "swa_latent", "dsa_indexer_keys", "gqa_kv")
GQA8_NUMBERS_PER_LAYER = 2 * 8 * 128  # K and V, 8 KV heads, head dim 128


def param_paths(params) -> list[tuple[tuple[str, ...], int]]:
  """`(path names, element count)` of every leaf of a nested param dict; leaves need only a
  `.shape`."""
  return [(path, math.prod(leaf.shape))
          for path, leaf in traverse_util.flatten_dict(params).items()]


def layer_component(names: tuple[str, ...]) -> str | None:
  """Component of a parameter inside one decoder layer (`names` start after `layers_{i}`)."""
  if names[0] in LAYER_NORMS:
    return "norms"
  if names[0] == "self_attn":
    return "indexer" if names[1] == "indexer" else "attention"
  if names[0] == "mlp":
    if names[1] == "experts":
      return "routed_experts"
    if names[1] == "shared_experts":
      return "shared_experts"
    if names[1] in ROUTER:
      return "router"
    if names[1] in DENSE_FFN or names[1].removesuffix("_scale") in DENSE_FFN:
      return "dense_ffn"  # `<kernel>_scale`: a quantized model's scales (glm5_jax.quant)
  return None


def component(names: tuple[str, ...]) -> str:
  """Component of the parameter at path `names` (for `mtp/...`, its part of the MTP layer).

  Raises:
    ValueError: for a path this tool does not know, so no parameter goes uncounted.
  """
  if names[0] == "mtp":
    inner = names[1:]
    found = layer_component(inner[1:]) if inner[0] == "layer" else MTP_TOP_LEVEL.get(inner[0])
  elif names[0].startswith("layers_"):
    found = layer_component(names[1:])
  else:
    found = TOP_LEVEL.get(names[0])
  if found is None:
    raise ValueError(f"param_count: no component for parameter {'/'.join(names)}")
  return found


def component_counts(params) -> tuple[dict[str, int], dict[str, int]]:
  """`(main, mtp)`: parameter counts per component of the main model and of the MTP subtree."""
  main, mtp = collections.Counter(), collections.Counter()
  for names, size in param_paths(params):
    (mtp if names[0] == "mtp" else main)[component(names)] += size
  return ({c: main[c] for c in COMPONENTS},
          {c: mtp[c] for c in MTP_COMPONENTS if mtp[c]})


def active_params(main: dict[str, int], cfg: ModelConfig) -> int:
  """Per-token parameters of the main model: routed experts count top-k of n_routed_experts.

  Every routed-expert kernel has a leading experts axis, so the product is an exact integer.
  """
  routed = main["routed_experts"]
  routed_active = routed * cfg.num_experts_per_tok // cfg.n_routed_experts
  return sum(main.values()) - routed + routed_active


def kv_cache_bytes_per_token(cfg: ModelConfig) -> dict[str, int | float]:
  """Per-token KV-cache bytes (bf16) of the main layers, and a GQA-8 model's for comparison."""
  numbers = collections.Counter()
  for letter in cfg.attention_pattern:
    numbers.update(ATTENTION_KINDS[letter].cache_numbers_per_token(cfg))
  unknown = set(numbers) - set(CACHE_PARTS)
  if unknown:
    raise ValueError(f"kv_cache_bytes_per_token: cache parts {sorted(unknown)} are not in "
                     f"CACHE_PARTS {CACHE_PARTS}")
  out = {name: numbers[name] * CACHE_BYTES_PER_NUMBER for name in CACHE_PARTS}
  out["total"] = sum(out.values())
  out["gqa8_equivalent"] = (cfg.num_hidden_layers * GQA8_NUMBERS_PER_LAYER
                            * CACHE_BYTES_PER_NUMBER)
  ratio = lambda denominator: (out["gqa8_equivalent"] / denominator if denominator
                               else float("inf"))  # every layer linear: no per-token cache
  out["gqa8_ratio"] = ratio(out["total"])
  out["gqa8_ratio_without_indexer"] = ratio(out["total"] - out["dsa_indexer_keys"])
  return out


def recurrent_state_bytes(cfg: ModelConfig) -> int:
  """Per-sequence bytes of the constant-size decoding state of the main layers (N / L: the fp32
  delta-rule state, and for N the conv inputs; `AttentionKind.recurrent_state_bytes`)."""
  return sum(ATTENTION_KINDS[letter].recurrent_state_bytes(cfg)
             for letter in cfg.attention_pattern)


def summarize(model_config) -> dict:
  """All counts for a `model` ConfigDict (or `ModelConfig`), as one JSON-ready dict."""
  cfg = ModelConfig.from_config(model_config)
  shapes = abstract_params(cfg)
  main, mtp = component_counts(shapes)
  without_mtp = sum(main.values())
  active = active_params(main, cfg)
  return {
      "total_params": without_mtp + sum(mtp.values()),
      "total_params_without_mtp": without_mtp,
      "active_params": active,
      "active_params_without_embeddings": active - main["embedding"] - main["lm_head"],
      "breakdown": {**main, "mtp": sum(mtp.values())},
      "mtp_breakdown": mtp,
      "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg),
      "recurrent_state_bytes": recurrent_state_bytes(cfg),
      "num_hidden_layers": cfg.num_hidden_layers,
      # What the params occupy as stored, by dtype: with `model.quant` (glm5_jax.quant) the
      # counts above count stored elements (a packed INT4 byte is one, scales included).
      "param_bytes_by_dtype": param_bytes_by_dtype(shapes),
  }


def param_bytes_by_dtype(shapes) -> dict[str, int]:
  """Bytes of a params (or ShapeDtypeStruct) tree per dtype name, plus "total"."""
  out: dict[str, int] = {}
  for leaf in jax.tree_util.tree_leaves(shapes):
    name = leaf.dtype.name
    out[name] = out.get(name, 0) + math.prod(leaf.shape) * leaf.dtype.itemsize
  return {**dict(sorted(out.items())), "total": sum(out.values())}
