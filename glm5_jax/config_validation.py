"""`validate_config`: every section of an experiment config checked once, before anything is
built, and the `model` section's own checks.

Each section's checks live beside its defaults and raise `ConfigError` naming
`config.<section>.<field>`:

  model              `validate_model_config` (below; defaults in `glm5_jax.config`)
  mesh               `glm5_jax.sharding.validate_mesh_config`
  optim              `glm5_jax.optim.validate_optim_config`
  data               `glm5_jax.data.validate_data_config` (and each source's options)
  train, ckpt, eval  `glm5_jax.train.config.validate_{train,ckpt,eval}_config`

`validate_config` calls them all and adds the checks that span sections. `build_trainer` calls
it first thing, so a bad field fails in seconds, before any compile or checkpoint write. The
optimizer and train-state builders after it do not check again; `make_mesh`, the data pipeline
and `ModelConfig.from_config` run their own section's check, because they are entry points of
their own (and resolve the mesh sizes and the sources' defaults in the same pass).
"""

import math

import ml_collections

from glm5_jax.attention.kinds import ATTENTION_KINDS, pattern_error
from glm5_jax.config import (DSA_IMPLS, LATER_FIELDS, MLP_LETTERS, MOE_IMPLS,
                             MOE_TRANSPORTS, SIMPLE_GDN_GATES, check_fields, expand_pattern,
                             model_config, require as _require, with_later_field_defaults)
from glm5_jax.data.pipeline import validate_data_config
from glm5_jax.layers.params import DTYPES
from glm5_jax.layers.remat import REMAT_POLICIES
from glm5_jax.optim.build import validate_optim_config
from glm5_jax.sharding import batch_mesh_axes, validate_mesh_config
from glm5_jax.train.config import (validate_ckpt_config, validate_eval_config,
                                   validate_train_config)

# The experiment config's top level: `seed` and these sections (configs/tiny.py builds them all).
SECTIONS = ("model", "mesh", "optim", "data", "train", "ckpt", "eval")


def validate_config(config, num_devices: int | None = None, *, process_count: int = 1) -> None:
  """Rejects an experiment config with any bad field, naming it (`ConfigError`).

  Checks every section (see the module docstring), a misspelt or missing field in any of them,
  and across sections: the optimizer's warm-up fits in `train.steps`; `data.batch_size` splits
  evenly over the processes and over the data-parallel devices (the mesh axes the `batch` rule
  of `mesh.logical_axis_rules` maps to), and so does each of its `train.microbatches`;
  evaluation has held-out data to read.

  Args:
    config: the experiment ConfigDict (`get_config()` of a configs/*.py file).
    num_devices: the devices the mesh spans (`jax.device_count()`); None skips the checks that
      need it (the mesh's size and the batch split over devices).
    process_count: the processes sharing the global batch (`jax.process_count()`).
  """
  _require(isinstance(config, (ml_collections.ConfigDict, dict)), "",
           f"an experiment config must be a ConfigDict, got {type(config).__name__}")
  check_fields(config, dict(seed=0, **{name: ml_collections.ConfigDict() for name in SECTIONS}),
               "")
  validate_model_config(config.model)
  mesh_sizes = validate_mesh_config(config.mesh, num_devices)
  validate_train_config(config.train)
  validate_optim_config(config.optim, total_steps=config.train.steps)
  sources = validate_data_config(config.data, process_count=process_count)
  validate_ckpt_config(config.ckpt)
  validate_eval_config(config.eval)

  microbatches = config.train.microbatches
  _require(config.data.batch_size % microbatches == 0, "train.microbatches",
           f"data.batch_size={config.data.batch_size} rows do not split into {microbatches} "
           "equal microbatches; use a divisor of it")
  if num_devices is not None:
    axes = batch_mesh_axes(config.mesh.logical_axis_rules)
    ways = math.prod(mesh_sizes[axis] for axis in axes)
    _require(config.data.batch_size % ways == 0, "data.batch_size",
             f"{config.data.batch_size} rows per step do not split over the {ways} data-parallel "
             f"devices (mesh axes {axes} of the 'batch' rule in config.mesh.logical_axis_rules, "
             f"sizes {[mesh_sizes[a] for a in axes]}); use a multiple of {ways}")
    # Each microbatch spreads over all data-parallel devices (`train.step.split_microbatches`).
    _require(config.data.batch_size % (ways * microbatches) == 0, "train.microbatches",
             f"data.batch_size={config.data.batch_size} rows do not split into {microbatches} "
             f"microbatches spread evenly over the {ways} data-parallel devices; batch_size must "
             f"be a multiple of microbatches * {ways} = {microbatches * ways}")
  if config.eval.every_steps:
    held_out = [name for name, spec in sources.items()
                if spec["kind"] == "synthetic" or spec["holdout_fraction"] > 0]
    _require(held_out, "eval.every_steps", "evaluation reads held-out data, but every source in "
             "config.data.sources has holdout_fraction 0 and none is synthetic; set "
             "eval.every_steps=0 or hold some data out")


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
    _require(isinstance(m[name], int) and m[name] >= 1, f"model.{name}",
             f"must be a positive integer, got {m[name]!r}")
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
  _require(m.routed_scaling_factor > 0, "model.routed_scaling_factor",
           f"must be > 0, got {m.routed_scaling_factor}")
  _require(m.initializer_range >= 0, "model.initializer_range",
           f"the init std must be >= 0, got {m.initializer_range}")
  for name in ("rms_norm_eps", "latent_norm_eps", "indexer_norm_eps"):
    _require(m[name] > 0, f"model.{name}", f"must be > 0, got {m[name]}")
  _require(m.dsa_impl in DSA_IMPLS, "model.dsa_impl", f"must be one of {DSA_IMPLS}, got "
           f"{m.dsa_impl!r}")
  _require(m.remat_policy in REMAT_POLICIES, "model.remat_policy",
           f"must be one of {REMAT_POLICIES}, got {m.remat_policy!r}")
  _require(m.moe_impl in MOE_IMPLS, "model.moe_impl", f"must be one of {MOE_IMPLS}, got "
           f"{m.moe_impl!r}")
  _require(m.moe_transport in MOE_TRANSPORTS, "model.moe_transport",
           f"must be one of {MOE_TRANSPORTS}, got {m.moe_transport!r}")
  for name in ("dtype", "param_dtype", "cache_dtype"):
    _require(m[name] in DTYPES, f"model.{name}", f"must be one of {sorted(DTYPES)}, got "
             f"{m[name]!r}")
  _require(m.simple_gdn_gates in SIMPLE_GDN_GATES, "model.simple_gdn_gates",
           f"must be one of {SIMPLE_GDN_GATES}, got {m.simple_gdn_gates!r}")
  # Strictly inside (0, 1): the learned gate starts at sigmoid^-1(simple_gdn_beta).
  _require(0 < m.simple_gdn_beta < 1,
           "model.simple_gdn_beta", f"the update gate must lie in (0, 1), got "
           f"{m.simple_gdn_beta!r}")

  pattern = m.attention_pattern
  _require(isinstance(pattern, str) and len(pattern) in (1, m.num_hidden_layers),
           "model.attention_pattern", f"needs one letter per layer ({m.num_hidden_layers}) or a "
           f"single letter for all layers, got {pattern!r}")
  pattern = expand_pattern(pattern, m.num_hidden_layers)
  problem = pattern_error(pattern)
  _require(problem is None, "model.attention_pattern", problem)

  if any(ATTENTION_KINDS[letter].family == "gqa" for letter in pattern):  # GQA-only fields
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
