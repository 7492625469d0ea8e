"""A converted checkpoint on disk: `<dir>/config.json` (model config) + `<dir>/params` (orbax).

Written by `tools/convert_hf.py`, read by training / RL runs that start from released weights.
Orbax writes the params into a temporary directory and renames it when complete, and the config
is written (atomically) only after that, so a directory with `config.json` is always whole.
"""

import json
import os

import jax
import ml_collections
import orbax.checkpoint as ocp

from glm5_jax.api import abstract_params
from glm5_jax.config_validation import validate_model_config

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"


def save_converted(directory: str, config: ml_collections.ConfigDict, params) -> None:
  """Writes `config` and `params`; refuses to overwrite an existing conversion."""
  directory = os.path.abspath(directory)
  if os.path.exists(os.path.join(directory, PARAMS_DIR)):
    raise FileExistsError(f"{directory}/{PARAMS_DIR} already exists; choose a new directory")
  os.makedirs(directory, exist_ok=True)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(directory, PARAMS_DIR), params)
  checkpointer.wait_until_finished()
  tmp = os.path.join(directory, CONFIG_FILE + ".tmp")
  with open(tmp, "w") as f:
    f.write(config.to_json(indent=2))
  os.replace(tmp, os.path.join(directory, CONFIG_FILE))


def load_converted(directory: str, shardings=None):
  """Reads `(config, params)` written by `save_converted`.

  Args:
    shardings: optional tree of `jax.sharding.Sharding` (e.g. from
      `glm5_jax.sharding.param_shardings`) to restore each parameter directly sharded.
  """
  config_path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{config_path}: not found; is {directory} a finished conversion?")
  with open(config_path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  validate_model_config(config)
  target = abstract_params(config)
  if shardings is not None:
    target = jax.tree_util.tree_map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), target, shardings)
  params = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(directory,
                                                                            PARAMS_DIR)), target)
  return config, params
