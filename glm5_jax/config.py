"""Model config: defaults (the released GLM-5), the typed view the layers get, ConfigError.

`model_config()` is the single source of defaults; `configs/*.py` overlay it. Field names follow
HF `GlmMoeDsaConfig` wherever it has one, so a released `config.json` reads the same here.
Everything below `glm5_jax` receives a frozen `ModelConfig` (hashable, so it can be a static
jit argument), never the experiment ConfigDict (STYLE habit 4).

Per-layer attention pattern (`attention_pattern`): one letter per layer (or one letter for every
layer) out of M D R G S N L; what each letter is, and every fact about it, lives in its
`AttentionKind` entry in `glm5_jax.attention.kinds`.
The long-context ablation (docs/reference.md section 3) converts half the layers of a
full-attention model to S / N / L; `interleave_pattern` writes such patterns.

The `model` section's checks (`validate_model_config`) live here, beside `ModelConfig`, which
runs them. Every section of an experiment config is validated once, up front, by
`glm5_jax.config_validation.validate_config`; `ConfigError`, `require` and `check_fields` here
are what each section's validator raises with.
"""

import dataclasses
import difflib
from typing import Any

import ml_collections

from glm5_jax.attention.kinds import ATTENTION_KINDS, layer_kind, pattern_error
from glm5_jax.layers.params import DTYPES
from glm5_jax.layers.remat import REMAT_POLICIES
from glm5_jax.quant.linear import QUANT_FORMATS

SIMPLE_GDN_GATES = ("fixed", "learned")
MLP_LETTERS = {"F": "dense", "E": "moe"}
DSA_IMPLS = ("dense_mask", "xla", "pallas", "pallas_interpret")
DSA_ATTENTION_KEYS = ("gather", "dense", "auto")
ATTENTION_IMPLS = ("xla", "cudnn")
MOE_IMPLS = ("ragged", "expert_parallel")
MOE_TRANSPORTS = ("ragged_all_to_all", "all_to_all")
MOE_MATMULS = ("auto", "ragged_dot", "megablox", "triton_gmm")


class ConfigError(ValueError):
  """A config field is missing, unknown or holds an impossible value; the message names it as
  `config.<section>.<field>` and says what was expected."""


def require(ok: bool, field: str, message: str) -> None:
  """Raises `ConfigError("config.<field>: <message>")` unless `ok` ("" names the top level)."""
  if not ok:
    raise ConfigError(f"config{'.' if field else ''}{field}: {message}")


def check_fields(section, defaults, name: str, *, optional=(), nullable=()) -> None:
  """Checks a config section's field names and value types against its defaults.

  A field the defaults lack is a typo (the error lists the known fields); a field they have
  must be present (unless in `optional`) with a value of its default's type: a bool for a
  bool, an int (not a bool) for an int, an int or float for a float, a str for a str. None is
  allowed where the default is None (a placeholder) or the field is in `nullable`. Nested
  sections are left to their own checks.

  Args:
    section: the ConfigDict (or dict) to check.
    defaults: the section's defaults (e.g. `train_config()`).
    name: the section's path under `config`, e.g. "train" or "data.sources.copy" ("" for the
      top level).
  """
  where = lambda field: f"{name}.{field}" if name else field
  require(isinstance(section, (ml_collections.ConfigDict, dict)), name,
          f"must be a ConfigDict section, got {type(section).__name__}")
  known = sorted(defaults.keys())
  for field in sorted(set(section.keys()) - set(known)):
    close = difflib.get_close_matches(field, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"config.{where(field)}: unknown field{hint}; known fields: {known}")
  missing = [field for field in known if field not in section and field not in optional]
  require(not missing, name, f"missing fields {missing}")
  for field in known:
    if field not in section:
      continue
    value, default = section[field], defaults[field]
    expected = (defaults.get_type(field) if isinstance(defaults, ml_collections.ConfigDict)
                else type(default))
    if value is None:
      require(default is None or field in nullable, where(field),
              f"must be {_type_name(expected)}, got None")
    elif not _has_type(value, expected):
      require(False, where(field), f"must be {_type_name(expected)}, got {value!r} "
              f"({type(value).__name__})")


def _has_type(value, expected: type) -> bool:
  if expected is bool:
    return isinstance(value, bool)
  if expected is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if expected is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if expected in (tuple, list):
    return isinstance(value, (tuple, list))
  if expected in (dict, ml_collections.ConfigDict):
    return isinstance(value, (dict, ml_collections.ConfigDict))
  return expected is type(None) or isinstance(value, expected)


def _type_name(expected: type) -> str:
  names = {bool: "a bool", int: "an int", float: "a number", str: "a string",
           tuple: "a tuple", list: "a list", ml_collections.ConfigDict: "a ConfigDict"}
  return names.get(expected, expected.__name__)


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
  # DSA sparse stage: "dense_mask" (reference, [L, S] mask), "xla" (O(L x T) gather path),
  # "pallas" (the TPU kernels on TPU, the GPU kernels on GPU; an error on CPU) or
  # "pallas_interpret" (the TPU kernels in interpret mode anywhere: slow, tests); see
  # pallas_kernels/dispatch.py
  c.dsa_impl = "dense_mask"
  # How the sparse stage's attention (not the indexer) of "xla" / "pallas*" reaches the selected
  # keys in training and prefill: "gather" (the impl's O(L x T) gather path), "dense" (every
  # key's logits, the selection as per-key counts: pallas_kernels/sparse_mla_dense.py, XLA on
  # any backend, no gather or scatter), "auto" ("dense" where it forms no more logits than the
  # gather: causal self-attention without context parallelism and S <= 2 T). Decode gathers.
  c.dsa_attention_keys = "gather"
  # Dense attention of MLA-family layers in the expanded form (training, prefill: dense MLA, the
  # DSA warm-up stage, "dense_mask"): "xla" (einsums + softmax) or "cudnn" (cuDNN flash
  # attention through jax.nn.dot_product_attention; GPU only, an error elsewhere). The absorbed
  # and decode forms stay XLA: their latent q.k width C + R = 576 passes cuDNN's 256 limit.
  c.attention_impl = "xla"
  c.sliding_window = 4096  # S layers: keys each query sees, itself included
  c.gdn_conv_size = 4  # N layers: taps of the causal depthwise conv on q, k and v
  c.gdn_chunk_size = 64  # N and L layers: chunk length of the parallel (WY) training form
  c.simple_gdn_gates = "fixed"  # L layers: "fixed" (no params) or "learned" (2 scalars / head)
  c.simple_gdn_beta = 0.5  # L layers: the fixed update gate, and the learned one's init
  c.dtype = "bfloat16"  # activations / matmuls
  c.param_dtype = "float32"
  # Decode caches (MLA latent, indexer keys, K / V): `glm5_jax.infer.cache`. Recurrent state
  # stays fp32 whatever this says.
  c.cache_dtype = "bfloat16"
  # Decoder layers run as one `nn.scan` per run of identical layers (`glm5_jax.layer_runs`),
  # params stacked `[layers, ...]`: compile time flat in depth. False: a Python loop over
  # `layers_{i}` (debugging; same numbers, different param layout).
  c.scan_layers = True
  # What each decoder layer keeps for the backward pass: a name in
  # `glm5_jax.layers.remat.REMAT_POLICIES` ("none" keeps everything).
  c.remat_policy = "none"
  # Routed-expert dispatch: "ragged" (one global ragged_dot; XLA decides the collectives) or
  # "expert_parallel" (shard_map: tokens travel to the devices holding their experts).
  c.moe_impl = "ragged"
  # How "expert_parallel" moves (token, expert) pairs between devices: "ragged_all_to_all"
  # (exact-size messages; TPU/GPU, XLA:CPU cannot compile it) or "all_to_all" (dense buffers
  # padded to the dropless worst case, expert-axis-size times the bytes; runs everywhere).
  c.moe_transport = "ragged_all_to_all"
  # The experts' grouped matmul (`glm5_jax.grouped_matmul`): "auto" = expert-parallel: megablox's
  # Pallas gmm/tgmm on TPU (whose compiler makes ragged_dot's weight gradient dense over the local
  # experts), our Pallas Triton gmm/tgmm on GPU (XLA GPU runs ragged_dot dense over all experts),
  # ragged_dot elsewhere; "ragged": the Triton gmm on one GPU, else ragged_dot. Or force one:
  # "ragged_dot", "megablox" (interpreted off TPU), "triton_gmm" (interpreted off GPU).
  c.moe_matmul = "auto"
  # "expert_parallel" receive-buffer capacity: 0 = dropless (buffers for the worst case, n times
  # the average); c > 0 = at most ceil(c * pairs per device) rows received per device, the rest
  # dropped (`glm5_jax.moe_parallel`; the fraction is the `moe_dropped_fraction` metric).
  c.moe_capacity_factor = 0.0
  # "expert_parallel": each device's tokens go through the exchange -> grouped matmul -> exchange
  # back in this many independent chunks, so that the compiler can run one chunk's all-to-all
  # while another's experts compute (the exchanges are otherwise exposed: nothing else is ready
  # to run). Capacity (above) applies per chunk. 1 = one pass.
  c.moe_dispatch_chunks = 1
  # INT4 quantization-aware training of the routed experts (`glm5_jax.quant.qat`): 0 = off, else
  # the group size along each expert kernel's input axis (one scale per group and output
  # column); must be even and divide hidden_size and moe_intermediate_size (GLM-5 report: INT4
  # QAT at the SFT stage). Applies wherever the model runs (pre-training, SFT, RL, eval).
  c.qat_int4_group_size = 0
  # Quantized serving (`glm5_jax.quant.linear`): "none", "w8a8" (INT8 weights per output
  # channel, INT8 activations per token, int32 accumulation) or "w4a8" (w8a8, with the routed
  # experts INT4 per group of `quant_group_size` input rows, packed). A quantized model's params
  # are made from a float model's by `glm5_jax.quant.serve.quantize`; it serves, never trains.
  c.quant = "none"
  c.quant_group_size = 128
  # The final norm and the MTP layer's `shared_head_norm` end with a `[D, D]` matrix `mix`. Set by
  # `glm5_jax.quant.rotation.rotate` for a model with an MTP layer: both norms feed the one shared
  # lm_head, which cannot absorb two different norm scales, so each keeps its scale as
  # `Q^T diag(scale) Q` (one D x D matmul per token). False everywhere else.
  c.head_norm_mix = False
  c.update(overrides)
  return c


class _ModelConfigMethods:
  """What `ModelConfig` adds to its fields (which are `model_config()`'s)."""

  @classmethod
  def from_config(cls, config: Any) -> "ModelConfig":
    """Builds from a `model` ConfigDict (or an existing ModelConfig), validating first."""
    if isinstance(config, cls):
      return config
    validate_model_config(config)
    config = with_later_field_defaults(config)
    values = {f.name: config[f.name] for f in dataclasses.fields(cls)}
    values["attention_pattern"] = expand_pattern(config.attention_pattern, config.num_hidden_layers)
    values["mlp_pattern"] = mlp_layer_pattern(config)
    return cls(**values)

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  def attention_kind(self, layer: int) -> str:
    return layer_kind(self.attention_pattern, layer).name

  def is_moe_layer(self, layer: int) -> bool:
    """MTP layers (index >= num_hidden_layers) are MoE whenever the model has experts."""
    if layer >= self.num_hidden_layers:
      return "E" in self.mlp_pattern
    return self.mlp_pattern[layer] == "E"


_MODEL_CONFIG_DOC = """Typed, validated, hashable view of the `model` ConfigDict.

One field per `model_config()` field, typed by its default, so a field added there needs
nothing here. Frozen, hence hashable: a static jit argument. `attention_pattern` and
`mlp_pattern` hold one letter per layer (`from_config` expands them).
"""
ModelConfig = dataclasses.make_dataclass(
    "ModelConfig", [(name, type(value)) for name, value in model_config().items()],
    bases=(_ModelConfigMethods,), namespace={"__module__": __name__, "__doc__": _MODEL_CONFIG_DOC},
    frozen=True)


def require_model_config(model, where: str) -> "ModelConfig":
  """`model` itself if it is a `ModelConfig`, else a TypeError naming `where`.

  Below the entry points (experiments/, tools/, `glm5_jax.api`, the builders' public entries)
  everything takes the `ModelConfig` built once by `ModelConfig.from_config`, never the `model`
  ConfigDict (docs/design.md, Dependency direction): validating and expanding it again in every
  function is what this refuses.
  """
  if not isinstance(model, ModelConfig):
    raise TypeError(f"{where}: expected the ModelConfig built at the entry point "
                    f"(ModelConfig.from_config(config.model)), got {type(model).__name__}")
  return model


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
    if value not in ATTENTION_KINDS:
      raise ValueError(f"interleave_pattern: {name} {value!r} is not one of "
                       f"{sorted(ATTENTION_KINDS)}")
  return "".join(letter if i % every == offset else base for i in range(num_layers))


# Fields added after checkpoints and converted configs were first written: a `model` section
# without them (read back from an older checkpoint's meta or config.json) means the defaults of
# `model_config()`, which cannot change what an older model computes (they only configure the
# S / N / L layers, which such a model has none of; `scan_layers`, `remat_policy`,
# `moe_impl`, `moe_transport` and `moe_matmul` change the param layout, memory, collectives or
# kernels, never the numbers; `moe_capacity_factor` is 0, dropless, for older models;
# `moe_dispatch_chunks` changes only the schedule (and, with a capacity, where it drops);
# `dsa_attention_keys` only how the sparse attention reaches its keys (the same math);
# `cache_dtype` only the decode cache; `attention_impl` only which kernel computes attention;
# `qat_int4_group_size` is 0, off, for older models; `head_norm_mix` is False: no rotated model
# predates it).
LATER_FIELDS = ("sliding_window", "gdn_conv_size", "gdn_chunk_size", "simple_gdn_gates",
                "simple_gdn_beta", "scan_layers", "remat_policy", "moe_impl",
                "moe_transport", "cache_dtype", "attention_impl", "qat_int4_group_size", "quant",
                "quant_group_size", "head_norm_mix", "moe_matmul", "moe_capacity_factor",
                "moe_dispatch_chunks", "dsa_attention_keys")
# Where the behaviour before a field existed differs from its default: checkpoints written
# before `scan_layers` hold unrolled `layers_{i}` params.
LATER_FIELD_OLD_VALUES = {"scan_layers": False}


def with_later_field_defaults(m) -> ml_collections.ConfigDict:
  """`m` itself when it has every `LATER_FIELDS` entry, else a copy with the defaults filled."""
  absent = [name for name in LATER_FIELDS if name not in m]
  if not absent:
    return m
  filled = ml_collections.ConfigDict(m.to_dict())
  defaults = {**model_config(), **LATER_FIELD_OLD_VALUES}
  for name in absent:
    filled[name] = defaults[name]
  return filled


def mlp_layer_pattern(config) -> str:
  if config.mlp_pattern:
    return config.mlp_pattern
  n_dense = min(config.first_k_dense_replace, config.num_hidden_layers)
  return "F" * n_dense + "E" * (config.num_hidden_layers - n_dense)


def validate_model_config(m) -> None:
  """Rejects impossible model configs with a `ConfigError` naming the field.

  Args:
    m: the `model` ConfigDict (as from `model_config()` or `glm5_jax.load_hf`).
  """
  check_fields(m, model_config(), "model", optional=LATER_FIELDS)
  m = with_later_field_defaults(m)
  positive = [
      "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "gqa_head_dim", "q_lora_rank",
      "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
      "index_head_dim", "n_routed_experts", "moe_intermediate_size", "n_group", "topk_group",
      "max_position_embeddings", "sliding_window", "gdn_conv_size", "gdn_chunk_size",
  ]
  for name in positive:
    require(isinstance(m[name], int) and m[name] >= 1, f"model.{name}",
             f"must be a positive integer, got {m[name]!r}")
  require(isinstance(m.index_topk, int) and m.index_topk >= 1, "model.index_topk",
           f"top-k must be an integer >= 1, got {m.index_topk!r}")
  require(m.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim",
           f"RoPE rotates pairs of dims, so it must be even, got {m.qk_rope_head_dim}")
  require(m.index_head_dim >= m.qk_rope_head_dim, "model.index_head_dim",
           f"the indexer applies RoPE to its first qk_rope_head_dim={m.qk_rope_head_dim} dims, "
           f"so index_head_dim must be at least that, got {m.index_head_dim}")
  require(1 <= m.num_experts_per_tok <= m.n_routed_experts, "model.num_experts_per_tok",
           f"must be in [1, n_routed_experts={m.n_routed_experts}], got {m.num_experts_per_tok}")
  require(m.n_shared_experts >= 0, "model.n_shared_experts",
           f"must be >= 0, got {m.n_shared_experts}")
  require(m.n_routed_experts % m.n_group == 0, "model.n_group",
           f"must divide n_routed_experts={m.n_routed_experts}, got {m.n_group}")
  require(1 <= m.topk_group <= m.n_group, "model.topk_group",
           f"must be in [1, n_group={m.n_group}], got {m.topk_group}")
  if m.n_group > 1:
    per_group = m.n_routed_experts // m.n_group
    require(per_group >= 2, "model.n_group", "group-limited routing scores a group by its top-2 "
             f"experts, so each group needs >= 2 experts; got {per_group}")
    require(m.num_experts_per_tok <= m.topk_group * per_group, "model.num_experts_per_tok",
             f"cannot pick {m.num_experts_per_tok} experts from topk_group={m.topk_group} groups "
             f"of {per_group}")
  require(0 <= m.first_k_dense_replace, "model.first_k_dense_replace",
           f"must be >= 0, got {m.first_k_dense_replace}")
  require(m.num_nextn_predict_layers in (0, 1), "model.num_nextn_predict_layers",
           f"GLM-5 stores one MTP layer shared by all depths; 0 or 1 supported, got "
           f"{m.num_nextn_predict_layers}")
  require(m.mtp_depths >= 0, "model.mtp_depths", f"must be >= 0, got {m.mtp_depths}")
  require(m.mtp_depths == 0 or m.num_nextn_predict_layers == 1, "model.mtp_depths",
           "MTP depths need an MTP layer: set num_nextn_predict_layers=1 or mtp_depths=0")
  require(m.rope_theta > 0, "model.rope_theta", f"must be > 0, got {m.rope_theta}")
  require(m.routed_scaling_factor > 0, "model.routed_scaling_factor",
           f"must be > 0, got {m.routed_scaling_factor}")
  require(m.initializer_range >= 0, "model.initializer_range",
           f"the init std must be >= 0, got {m.initializer_range}")
  for name in ("rms_norm_eps", "latent_norm_eps", "indexer_norm_eps"):
    require(m[name] > 0, f"model.{name}", f"must be > 0, got {m[name]}")
  require(m.dsa_impl in DSA_IMPLS, "model.dsa_impl", f"must be one of {DSA_IMPLS}, got "
           f"{m.dsa_impl!r}")
  require(m.dsa_attention_keys in DSA_ATTENTION_KEYS, "model.dsa_attention_keys",
           f"must be one of {DSA_ATTENTION_KEYS}, got {m.dsa_attention_keys!r}")
  require(m.attention_impl in ATTENTION_IMPLS, "model.attention_impl",
           f"must be one of {ATTENTION_IMPLS}, got {m.attention_impl!r}")
  require(m.remat_policy in REMAT_POLICIES, "model.remat_policy",
           f"must be one of {REMAT_POLICIES}, got {m.remat_policy!r}")
  group = m.qat_int4_group_size
  require(isinstance(group, int) and not isinstance(group, bool) and group >= 0
          and group % 2 == 0, "model.qat_int4_group_size",
          f"must be 0 (off) or an even group size (INT4 packs two per byte), got {group!r}")
  for dim in ("hidden_size", "moe_intermediate_size"):
    require(not group or m[dim] % group == 0, "model.qat_int4_group_size",
            f"group size {group} must divide {dim}={m[dim]} (the expert kernels' input dims)")
  require(isinstance(m.head_norm_mix, bool), "model.head_norm_mix",
          f"must be True or False, got {m.head_norm_mix!r}")
  require(m.quant in QUANT_FORMATS, "model.quant",
          f"must be one of {QUANT_FORMATS}, got {m.quant!r}")
  if m.quant == "w4a8":
    group = m.quant_group_size
    require(isinstance(group, int) and group >= 2 and group % 2 == 0, "model.quant_group_size",
            f"must be an even positive group size (INT4 packs two per byte), got {group!r}")
    for dim in ("hidden_size", "moe_intermediate_size"):
      require(m[dim] % group == 0, "model.quant_group_size",
              f"group size {group} must divide {dim}={m[dim]} (the expert kernels' input dims)")
  require(m.moe_impl in MOE_IMPLS, "model.moe_impl", f"must be one of {MOE_IMPLS}, got "
           f"{m.moe_impl!r}")
  require(m.moe_transport in MOE_TRANSPORTS, "model.moe_transport",
           f"must be one of {MOE_TRANSPORTS}, got {m.moe_transport!r}")
  require(m.moe_capacity_factor == 0 or (m.moe_capacity_factor >= 1 and
                                          m.moe_impl == "expert_parallel"),
          "model.moe_capacity_factor", "must be 0 (dropless) or >= 1 with "
          f"moe_impl='expert_parallel', got {m.moe_capacity_factor!r} with {m.moe_impl!r}")
  require(isinstance(m.moe_dispatch_chunks, int) and m.moe_dispatch_chunks >= 1,
          "model.moe_dispatch_chunks", f"must be an int >= 1, got {m.moe_dispatch_chunks!r}")
  require(m.moe_matmul in MOE_MATMULS, "model.moe_matmul",
          f"must be one of {MOE_MATMULS}, got {m.moe_matmul!r}")
  for name in ("dtype", "param_dtype", "cache_dtype"):
    require(m[name] in DTYPES, f"model.{name}", f"must be one of {sorted(DTYPES)}, got "
             f"{m[name]!r}")
  require(m.simple_gdn_gates in SIMPLE_GDN_GATES, "model.simple_gdn_gates",
           f"must be one of {SIMPLE_GDN_GATES}, got {m.simple_gdn_gates!r}")
  # Strictly inside (0, 1): the learned gate starts at sigmoid^-1(simple_gdn_beta).
  require(0 < m.simple_gdn_beta < 1,
           "model.simple_gdn_beta", f"the update gate must lie in (0, 1), got "
           f"{m.simple_gdn_beta!r}")

  pattern = m.attention_pattern
  require(isinstance(pattern, str) and len(pattern) in (1, m.num_hidden_layers),
           "model.attention_pattern", f"needs one letter per layer ({m.num_hidden_layers}) or a "
           f"single letter for all layers, got {pattern!r}")
  pattern = expand_pattern(pattern, m.num_hidden_layers)
  problem = pattern_error(pattern)
  require(problem is None, "model.attention_pattern", problem)

  if any(ATTENTION_KINDS[letter].family == "gqa" for letter in pattern):  # GQA-only fields
    require(m.gqa_head_dim % 2 == 0, "model.gqa_head_dim",
             f"RoPE rotates pairs of dims, so it must be even, got {m.gqa_head_dim}")
    require(m.num_attention_heads % m.num_key_value_heads == 0, "model.num_key_value_heads",
             f"must divide num_attention_heads={m.num_attention_heads}, got "
             f"{m.num_key_value_heads}")

  mlp = m.mlp_pattern
  if mlp:
    require(len(mlp) == m.num_hidden_layers, "model.mlp_pattern",
             f"needs one letter per layer ({m.num_hidden_layers}), got {len(mlp)}")
    unknown = sorted(set(mlp) - set(MLP_LETTERS))
    require(not unknown, "model.mlp_pattern", f"unknown letters {unknown}; allowed "
             f"{MLP_LETTERS}")
