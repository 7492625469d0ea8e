"""The RL experiment config: its sections, the `data` section RL reads, and the one check of
the whole config (`validate_rl_experiment`) that `loop.rl_train` runs before building anything.

Sections (configs/rl_tiny.py builds them all):
  model, optim, train, ckpt, mesh   as in pre-training (`train` only for `dsa_stage`,
                                    `balance_bias_rate`, `microbatches` (gradient
                                    accumulation within each update); `optim`'s schedule runs
                                    over `rl.steps` x `rl.minibatches` updates)
  data                              `tokenizer` and `seq_len` (each sample's row: prompt and
                                    every turn must fit it) only: rollouts are the data
  rl                                `glm5_jax.posttrain.config.rl_config`
  sft (optional)                    an SFT experiment config (configs/sft_tiny.py) that
                                    experiments/rl.py runs first when `rl.init_from` is empty
"""

import math

import jax
import ml_collections

from glm5_jax.config import check_fields, require, validate_model_config
from glm5_jax.optim.build import validate_optim_config
from glm5_jax.posttrain.config import validate_rl_config
from glm5_jax.sharding import batch_mesh_axes, validate_mesh_config
from glm5_jax.train.config import validate_ckpt_config, validate_train_config

SECTIONS = ("model", "data", "optim", "train", "ckpt", "mesh", "rl")


def rl_data_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.tokenizer = "byte"  # "byte" or an HF tokenizer.json path, with the chat specials
  c.seq_len = 64  # a sample's row: prompt + generated turns + observations
  c.update(overrides)
  return c


def validate_rl_experiment(config) -> None:
  """Rejects a bad RL experiment config with a `ConfigError` naming the field."""
  defaults = dict(seed=0, sft=ml_collections.ConfigDict(),
                  **{name: ml_collections.ConfigDict() for name in SECTIONS})
  check_fields(config, defaults, "", optional=("sft",))
  validate_model_config(config.model)
  mesh_sizes = validate_mesh_config(config.mesh, jax.device_count())
  validate_train_config(config.train)
  validate_rl_config(config.rl)
  validate_optim_config(config.optim, total_steps=config.rl.steps * config.rl.minibatches)
  validate_ckpt_config(config.ckpt)
  check_fields(config.data, rl_data_config(), "data")
  require(config.data.seq_len >= 2, "data.seq_len", f"must be >= 2, got {config.data.seq_len}")
  axes = batch_mesh_axes(config.mesh.logical_axis_rules)
  ways = math.prod(mesh_sizes[axis] for axis in axes)
  rows = config.rl.prompts_per_step * config.rl.group_size
  minibatches, microbatches = config.rl.minibatches, config.train.microbatches
  require(rows % (ways * minibatches * microbatches) == 0, "rl.prompts_per_step",
          f"prompts_per_step x group_size = {rows} rollout rows do not split into "
          f"rl.minibatches={minibatches} minibatches of train.microbatches={microbatches} "
          f"microbatches over the {ways} data-parallel devices; use a multiple")
