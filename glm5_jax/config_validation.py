"""`validate_config`: every section of an experiment config checked once, before anything is
built.

Each section's checks live beside its defaults and raise `ConfigError` naming
`config.<section>.<field>`:

  model              `glm5_jax.config.validate_model_config` (beside `ModelConfig`)
  mesh               `glm5_jax.sharding.validate_mesh_config`
  optim              `glm5_jax.optim.validate_optim_config`
  data               `glm5_jax.data.validate_data_config` (and each source's options)
  train, ckpt, eval  `glm5_jax.train.config.validate_{train,ckpt,eval}_config`

`validate_config` calls them all and adds the checks that span sections. `build_trainer` calls
it first thing, so a bad field fails in seconds, before any compile or checkpoint write. The
optimizer and train-state builders after it do not check again; `make_mesh`, the data pipeline
and `ModelConfig.from_config` run their own section's check, because they are entry points of
their own (and resolve the mesh sizes and the sources' defaults in the same pass).

This module sits above every section's validator (it imports them); nothing below
`glm5_jax.train.trainer` and the entry points imports it (docs/design.md, Dependency direction).
"""

import math

import ml_collections

from glm5_jax.config import check_fields, expand_pattern, require as _require, validate_model_config
from glm5_jax.data.pipeline import validate_data_config
from glm5_jax.optim.build import validate_optim_config
from glm5_jax.attention.context_parallel import check_context_parallel
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
  # A long-context stage (docs/scaling.md) must stay inside the positions the model has RoPE for.
  _require(config.data.seq_len <= config.model.max_position_embeddings, "data.seq_len",
           f"{config.data.seq_len} tokens per sequence exceed "
           f"model.max_position_embeddings={config.model.max_position_embeddings}; shorten the "
           "sequence or raise max_position_embeddings (with the stage's RoPE settings)")
  # Sizes left -1 resolve only against a device count; a -1 context axis is then checked there.
  if mesh_sizes["context"] > 1:
    check_context_parallel(expand_pattern(config.model.attention_pattern,
                                          config.model.num_hidden_layers),
                           mesh_sizes["context"], config.data.seq_len, "data.seq_len",
                           layout=config.mesh.context_layout)
  if config.eval.every_steps:
    held_out = [name for name, spec in sources.items()
                if spec["kind"] == "synthetic" or spec["holdout_fraction"] > 0]
    _require(held_out, "eval.every_steps", "evaluation reads held-out data, but every source in "
             "config.data.sources has holdout_fraction 0 and none is synthetic; set "
             "eval.every_steps=0 or hold some data out")
