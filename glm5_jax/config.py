"""Model config: defaults (the released GLM-5), a typed view for the layers, and validation.

`model_config()` is the single source of defaults; `configs/*.py` overlay it. Field names follow
HF `GlmMoeDsaConfig` wherever it has one, so a released `config.json` reads the same here.
Everything below `glm5_jax` receives a frozen `ModelConfig` (hashable, so it can be a static
jit argument), never the experiment ConfigDict (STYLE habit 4).

Per-layer attention pattern, one letter per layer (or one letter for every layer):
  M  dense MLA
  D  DSA: MLA restricted to the top-k keys chosen by this layer's lightning indexer
  R  DSA that reuses the previous layer's top-k selection and has no indexer of its own
     (HF `indexer_types = "shared"`)
  G  grouped-query attention with `num_key_value_heads` KV heads (the GQA-8 baseline)
  S  sliding-window MLA: the M layer's params and math, each query sees its `sliding_window`
     latest keys (itself included)
  N  Gated DeltaNet (Yang et al. 2024, arXiv 2412.06464): gated-delta-rule linear attention
     with short causal convs (`gdn_conv_size`) on q/k/v, data-dependent decay and update gates
     and a gated output norm; q/k/v/o come from MLA-shaped projections (the M layer's names
     and sizes: H = num_attention_heads, K = qk_nope_head_dim + qk_rope_head_dim,
     V = v_head_dim), so a trained M layer converts to N by adding only the new parts
  L  SimpleGDN: the gated delta rule directly on the M layer's own q/k/v/o projections, no
     conv, no gate modules; per-head decay and update gates fixed (RetNet-style decays,
     `simple_gdn_beta`) or two learned scalars per head (`simple_gdn_gates`)
The long-context ablation (docs/reference.md section 3) converts half the layers of a
full-attention model to S / N / L; `interleave_pattern` writes such patterns.
"""

import dataclasses
from typing import Any

import ml_collections

ATTENTION_LETTERS = {
    "M": "mla",
    "D": "dsa",
    "R": "dsa_shared_topk",
    "G": "gqa",
    "S": "swa",
    "N": "gdn",
    "L": "simple_gdn",
}
SIMPLE_GDN_GATES = ("fixed", "learned")
MLP_LETTERS = {"F": "dense", "E": "moe"}
DSA_IMPLS = ("dense_mask", "xla", "pallas")
DTYPES = ("float32", "bfloat16", "float16")
MESH_AXES = ("data", "fsdp", "expert", "tensor")


def model_config(**overrides) -> ml_collections.ConfigDict:
  """The released GLM-5 (docs/reference.md section 1), with `overrides` applied."""
  c = ml_collections.ConfigDict()
  c.vocab_size = 154880
  c.hidden_size = 6144
  c.intermediate_size = 12288
  c.num_hidden_layers = 78
  c.num_attention_heads = 64
  c.num_key_value_heads = 8  # used by G layers only; MLA has one shared latent
  c.gqa_head_dim = 128  # used by G layers only
  c.q_lora_rank = 2048
  c.kv_lora_rank = 512
  c.qk_nope_head_dim = 192
  c.qk_rope_head_dim = 64
  c.v_head_dim = 256
  c.attention_bias = False
  c.index_topk = 2048
  c.index_n_heads = 32
  c.index_head_dim = 128
  c.n_routed_experts = 256
  c.num_experts_per_tok = 8
  c.n_shared_experts = 1
  c.moe_intermediate_size = 2048
  c.routed_scaling_factor = 2.5
  c.norm_topk_prob = True
  c.n_group = 1
  c.topk_group = 1
  c.first_k_dense_replace = 3
  c.mlp_pattern = ""  # "" = derived from first_k_dense_replace; else one F/E letter per layer
  c.num_nextn_predict_layers = 1  # MTP layers stored (0 or 1)
  c.mtp_depths = 3  # prediction depths sharing the one MTP layer
  c.rope_theta = 1_000_000.0
  c.max_position_embeddings = 202752
  c.rms_norm_eps = 1e-5
  c.latent_norm_eps = 1e-6  # q_a_layernorm / kv_a_layernorm
  c.indexer_norm_eps = 1e-6  # indexer k_norm (LayerNorm)
  c.initializer_range = 0.02
  c.attention_pattern = "D"
  # DSA sparse stage: "dense_mask" (reference, [L, S] mask), "xla" (O(L x T) gather path)
  # or "pallas" (TPU kernels, interpret mode elsewhere); see pallas_kernels/__init__.py
  c.dsa_impl = "dense_mask"
  c.sliding_window = 4096  # S layers: keys each query sees, itself included
  c.gdn_conv_size = 4  # N layers: taps of the causal depthwise conv on q, k and v
  c.gdn_chunk_size = 64  # N and L layers: chunk length of the parallel (WY) training form
  c.simple_gdn_gates = "fixed"  # L layers: "fixed" (no params) or "learned" (2 scalars / head)
  c.simple_gdn_beta = 0.5  # L layers: the fixed update gate, and the learned one's init
  c.dtype = "bfloat16"  # activations / matmuls
  c.param_dtype = "float32"
  c.update(overrides)
  return c


def mesh_config(**axis_sizes) -> ml_collections.ConfigDict:
  """Mesh axis sizes (-1 on one axis takes the remaining devices) and logical-axis rules."""
  c = ml_collections.ConfigDict()
  c.shape = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1))
  c.shape.update(axis_sizes)
  c.logical_axis_rules = default_logical_axis_rules()
  return c


def default_logical_axis_rules():
  """Logical axis name -> mesh axes. Names not listed stay replicated."""
  return [
      ("batch", ("data", "fsdp")),
      ("embed", "fsdp"),
      ("vocab", "tensor"),
      ("mlp", "tensor"),
      ("heads", "tensor"),
      ("kv_heads", "tensor"),
      ("index_heads", "tensor"),
      ("expert", "expert"),
      ("expert_mlp", "tensor"),
  ]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Typed, validated, hashable view of the `model` ConfigDict."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  gqa_head_dim: int
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  attention_bias: bool
  index_topk: int
  index_n_heads: int
  index_head_dim: int
  n_routed_experts: int
  num_experts_per_tok: int
  n_shared_experts: int
  moe_intermediate_size: int
  routed_scaling_factor: float
  norm_topk_prob: bool
  n_group: int
  topk_group: int
  first_k_dense_replace: int
  mlp_pattern: str
  num_nextn_predict_layers: int
  mtp_depths: int
  rope_theta: float
  max_position_embeddings: int
  rms_norm_eps: float
  latent_norm_eps: float
  indexer_norm_eps: float
  initializer_range: float
  attention_pattern: str
  dsa_impl: str
  dtype: str
  param_dtype: str
  sliding_window: int
  gdn_conv_size: int
  gdn_chunk_size: int
  simple_gdn_gates: str
  simple_gdn_beta: float

  @classmethod
  def from_config(cls, config: Any) -> "ModelConfig":
    """Builds from a `model` ConfigDict (or an existing ModelConfig), validating first."""
    if isinstance(config, ModelConfig):
      return config
    validate_model_config(config)
    config = with_later_field_defaults(config)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {n: config[n] for n in names}
    values["attention_pattern"] = expand_pattern(config.attention_pattern, config.num_hidden_layers)
    values["mlp_pattern"] = mlp_layer_pattern(config)
    return cls(**values)

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  def attention_kind(self, layer: int) -> str:
    return ATTENTION_LETTERS[self.attention_pattern[layer]]

  def is_moe_layer(self, layer: int) -> bool:
    """MTP layers (index >= num_hidden_layers) are MoE whenever the model has experts."""
    if layer >= self.num_hidden_layers:
      return "E" in self.mlp_pattern
    return self.mlp_pattern[layer] == "E"


def expand_pattern(pattern: str, num_layers: int) -> str:
  return pattern * num_layers if len(pattern) == 1 else pattern


def interleave_pattern(num_layers: int, every: int, letter: str, base: str,
                       offset: int = 0) -> str:
  """A per-layer pattern: layer i is `letter` when `i % every == offset`, else `base`.

  `interleave_pattern(4, 2, "S", "M") == "SMSM"` (half the layers SWA, as in the report's
  interleaved long-context ablation); `interleave_pattern(8, 4, "M", "N", offset=3)` keeps
  every fourth layer full attention in a GDN model.
  """
  if every < 1 or not 0 <= offset < every:
    raise ValueError(f"interleave_pattern: need every >= 1 and 0 <= offset < every, got "
                     f"every={every}, offset={offset}")
  for name, value in (("letter", letter), ("base", base)):
    if value not in ATTENTION_LETTERS:
      raise ValueError(f"interleave_pattern: {name} {value!r} is not one of "
                       f"{sorted(ATTENTION_LETTERS)}")
  return "".join(letter if i % every == offset else base for i in range(num_layers))


# Fields added after checkpoints and converted configs were first written: a `model` section
# without them (read back from an older checkpoint's meta or config.json) means the defaults of
# `model_config()`, which cannot change what an older model computes (they only configure the
# S / N / L layers, which such a model has none of).
LATER_FIELDS = ("sliding_window", "gdn_conv_size", "gdn_chunk_size", "simple_gdn_gates",
                "simple_gdn_beta")


def with_later_field_defaults(m) -> ml_collections.ConfigDict:
  """`m` itself when it has every `LATER_FIELDS` entry, else a copy with the defaults filled."""
  absent = [name for name in LATER_FIELDS if name not in m]
  if not absent:
    return m
  filled = ml_collections.ConfigDict(m.to_dict())
  defaults = model_config()
  for name in absent:
    filled[name] = defaults[name]
  return filled


def mlp_layer_pattern(config) -> str:
  if config.mlp_pattern:
    return config.mlp_pattern
  n_dense = min(config.first_k_dense_replace, config.num_hidden_layers)
  return "F" * n_dense + "E" * (config.num_hidden_layers - n_dense)


class ConfigError(ValueError):
  """A config field holds an impossible value; the message names the field."""


def _require(ok: bool, field: str, message: str):
  if not ok:
    raise ConfigError(f"config.{field}: {message}")


def validate_model_config(m) -> None:
  """Rejects impossible model configs with a `ConfigError` naming the field.

  Args:
    m: the `model` ConfigDict (as from `model_config()` or `glm5_jax.load_hf`).
  """
  missing = [f.name for f in dataclasses.fields(ModelConfig)
             if f.name not in m and f.name not in LATER_FIELDS]
  _require(not missing, "model", f"missing fields {missing}")
  m = with_later_field_defaults(m)
  positive = [
      "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "gqa_head_dim", "q_lora_rank",
      "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
      "index_head_dim", "n_routed_experts", "moe_intermediate_size", "n_group", "topk_group",
      "max_position_embeddings", "sliding_window", "gdn_conv_size", "gdn_chunk_size",
  ]
  for name in positive:
    _require(isinstance(m[name], int) and m[name] >= 1, f"model.{name}",
             f"must be a positive integer, got {m[name]!r}")
  for name in ("num_experts_per_tok", "n_shared_experts", "first_k_dense_replace", "mtp_depths",
               "num_nextn_predict_layers"):
    _require(isinstance(m[name], int), f"model.{name}", f"must be an integer, got {m[name]!r}")
  _require(isinstance(m.index_topk, int) and m.index_topk >= 1, "model.index_topk",
           f"top-k must be an integer >= 1, got {m.index_topk!r}")
  _require(m.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim",
           f"RoPE rotates pairs of dims, so it must be even, got {m.qk_rope_head_dim}")
  _require(m.index_head_dim >= m.qk_rope_head_dim, "model.index_head_dim",
           f"the indexer applies RoPE to its first qk_rope_head_dim={m.qk_rope_head_dim} dims, "
           f"so index_head_dim must be at least that, got {m.index_head_dim}")
  _require(1 <= m.num_experts_per_tok <= m.n_routed_experts, "model.num_experts_per_tok",
           f"must be in [1, n_routed_experts={m.n_routed_experts}], got {m.num_experts_per_tok}")
  _require(m.n_shared_experts >= 0, "model.n_shared_experts",
           f"must be >= 0, got {m.n_shared_experts}")
  _require(m.n_routed_experts % m.n_group == 0, "model.n_group",
           f"must divide n_routed_experts={m.n_routed_experts}, got {m.n_group}")
  _require(1 <= m.topk_group <= m.n_group, "model.topk_group",
           f"must be in [1, n_group={m.n_group}], got {m.topk_group}")
  if m.n_group > 1:
    per_group = m.n_routed_experts // m.n_group
    _require(per_group >= 2, "model.n_group", "group-limited routing scores a group by its top-2 "
             f"experts, so each group needs >= 2 experts; got {per_group}")
    _require(m.num_experts_per_tok <= m.topk_group * per_group, "model.num_experts_per_tok",
             f"cannot pick {m.num_experts_per_tok} experts from topk_group={m.topk_group} groups "
             f"of {per_group}")
  _require(0 <= m.first_k_dense_replace, "model.first_k_dense_replace",
           f"must be >= 0, got {m.first_k_dense_replace}")
  _require(m.num_nextn_predict_layers in (0, 1), "model.num_nextn_predict_layers",
           f"GLM-5 stores one MTP layer shared by all depths; 0 or 1 supported, got "
           f"{m.num_nextn_predict_layers}")
  _require(m.mtp_depths >= 0, "model.mtp_depths", f"must be >= 0, got {m.mtp_depths}")
  _require(m.mtp_depths == 0 or m.num_nextn_predict_layers == 1, "model.mtp_depths",
           "MTP depths need an MTP layer: set num_nextn_predict_layers=1 or mtp_depths=0")
  _require(m.rope_theta > 0, "model.rope_theta", f"must be > 0, got {m.rope_theta}")
  for name in ("rms_norm_eps", "latent_norm_eps", "indexer_norm_eps"):
    _require(m[name] > 0, f"model.{name}", f"must be > 0, got {m[name]}")
  _require(m.dsa_impl in DSA_IMPLS, "model.dsa_impl", f"must be one of {DSA_IMPLS}, got "
           f"{m.dsa_impl!r}")
  for name in ("dtype", "param_dtype"):
    _require(m[name] in DTYPES, f"model.{name}", f"must be one of {DTYPES}, got {m[name]!r}")
  _require(m.simple_gdn_gates in SIMPLE_GDN_GATES, "model.simple_gdn_gates",
           f"must be one of {SIMPLE_GDN_GATES}, got {m.simple_gdn_gates!r}")
  # Strictly inside (0, 1): the learned gate starts at sigmoid^-1(simple_gdn_beta).
  _require(isinstance(m.simple_gdn_beta, (int, float)) and 0 < m.simple_gdn_beta < 1,
           "model.simple_gdn_beta", f"the update gate must lie in (0, 1), got "
           f"{m.simple_gdn_beta!r}")

  pattern = m.attention_pattern
  _require(isinstance(pattern, str) and len(pattern) in (1, m.num_hidden_layers),
           "model.attention_pattern", f"needs one letter per layer ({m.num_hidden_layers}) or a "
           f"single letter for all layers, got {pattern!r}")
  unknown = sorted(set(pattern) - set(ATTENTION_LETTERS))
  _require(not unknown, "model.attention_pattern",
           f"unknown letters {unknown}; allowed: {ATTENTION_LETTERS}")
  pattern = expand_pattern(pattern, m.num_hidden_layers)
  _require(pattern[0] != "R", "model.attention_pattern",
           "layer 0 is 'R' (reuse the previous layer's top-k) but has no previous layer")
  for i in range(1, len(pattern)):
    _require(pattern[i] != "R" or pattern[i - 1] in "DR", "model.attention_pattern",
             f"layer {i} is 'R' but layer {i - 1} is {pattern[i - 1]!r}, not a DSA layer")

  if "G" in pattern:  # GQA-only fields; MLA layers ignore them
    _require(m.gqa_head_dim % 2 == 0, "model.gqa_head_dim",
             f"RoPE rotates pairs of dims, so it must be even, got {m.gqa_head_dim}")
    _require(m.num_attention_heads % m.num_key_value_heads == 0, "model.num_key_value_heads",
             f"must divide num_attention_heads={m.num_attention_heads}, got "
             f"{m.num_key_value_heads}")

  mlp = m.mlp_pattern
  if mlp:
    _require(len(mlp) == m.num_hidden_layers, "model.mlp_pattern",
             f"needs one letter per layer ({m.num_hidden_layers}), got {len(mlp)}")
    unknown = sorted(set(mlp) - set(MLP_LETTERS))
    _require(not unknown, "model.mlp_pattern", f"unknown letters {unknown}; allowed "
             f"{MLP_LETTERS}")


def validate_mesh_config(mesh, num_devices: int) -> dict[str, int]:
  """Checks mesh axis sizes against the device count; returns the resolved sizes."""
  shape = dict(mesh.shape)
  extra = sorted(set(shape) - set(MESH_AXES))
  _require(not extra, "mesh.shape", f"unknown axes {extra}; allowed {MESH_AXES}")
  sizes = {axis: int(shape.get(axis, 1)) for axis in MESH_AXES}
  fill = [a for a, s in sizes.items() if s == -1]
  _require(len(fill) <= 1, "mesh.shape", f"at most one axis may be -1, got {fill}")
  for axis, size in sizes.items():
    _require(size == -1 or size >= 1, f"mesh.shape.{axis}", f"must be >= 1 or -1, got {size}")
  fixed = 1
  for size in sizes.values():
    fixed *= size if size != -1 else 1
  if fill:
    _require(num_devices % fixed == 0, "mesh.shape", f"fixed axes multiply to {fixed}, which "
             f"does not divide the {num_devices} available devices")
    sizes[fill[0]] = num_devices // fixed
  else:
    _require(fixed == num_devices, "mesh.shape", f"axes {sizes} multiply to {fixed} but there "
             f"are {num_devices} devices")
  for rule in mesh.logical_axis_rules:
    targets = rule[1] if isinstance(rule[1], (tuple, list)) else (rule[1],)
    bad = [t for t in targets if t is not None and t not in MESH_AXES]
    _require(not bad, "mesh.logical_axis_rules", f"rule {tuple(rule)} names unknown mesh axes "
             f"{bad}; allowed {MESH_AXES}")
  return sizes


def validate_config(config, num_devices: int | None = None) -> None:
  """Validates an experiment config: its `model` section and, given a device count, its mesh."""
  _require("model" in config, "model", "experiment config has no `model` section")
  validate_model_config(config.model)
  if num_devices is not None and "mesh" in config:
    validate_mesh_config(config.mesh, num_devices)

