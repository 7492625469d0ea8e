"""Params for evaluation from a training run's workdir, optionally converted to another pattern.

A run's workdir (experiments/train.py) holds orbax checkpoints whose `meta` item records the
config sections `model`, `data` and `optim` (glm5_jax.train.checkpoint). Evaluating it:

  same model          the latest params as trained;
  other attention     training-free conversion (`glm5_jax.convert.attention_pattern`): every
  pattern             parameter the source has keeps its trained value and parts the target
                      adds (e.g. a DSA indexer, GDN gates) start freshly initialized (from
                      `seed`).

Model fields added to `glm5_jax.config.model_config` after a checkpoint was written take their
defaults, so old runs stay loadable.
"""

import dataclasses
import os

import jax
import ml_collections
import orbax.checkpoint as ocp

from glm5_jax.api import abstract_params
from glm5_jax.config import model_config
from glm5_jax.convert.attention_pattern import convert_attention_pattern
from glm5_jax.train import checkpoint as ckpt


@dataclasses.dataclass
class LoadedRun:
  """Params ready for `model`, and where they came from."""

  model: ml_collections.ConfigDict  # the model evaluated (target of any conversion)
  params: dict
  source_model: ml_collections.ConfigDict  # the model the checkpoint was trained as
  step: int
  data: dict  # the run's `data` config section (tokenizer, seq_len, ...)
  converted: bool  # True when the target differs from the trained model


def complete_model_config(model) -> ml_collections.ConfigDict:
  """`model_config()` defaults overlaid with `model` (a dict or ConfigDict)."""
  values = model.to_dict() if hasattr(model, "to_dict") else dict(model)
  full = model_config()
  unknown = sorted(set(values) - set(full.keys()))
  if unknown:
    raise ValueError(f"model config has fields {unknown} that glm5_jax.config.model_config "
                     "does not know")
  full.update(values)
  return full


def apply_model_overrides(model, overrides: dict | None, what: str = "model override"):
  """A copy of `model` with `overrides` ({field: value}); unknown fields are an error."""
  model = ml_collections.ConfigDict(model.to_dict())
  for field, value in (overrides or {}).items():
    if field not in model:
      raise ValueError(f"{what}: model has no field {field!r}; known: {sorted(model.keys())}")
    model[field] = value
  return model


def read_run_meta(workdir: str) -> dict:
  """The `meta` item (step, config sections) of the latest checkpoint under `workdir`."""
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  if not os.path.isdir(directory):  # checked first: a CheckpointManager would create it
    raise FileNotFoundError(f"no checkpoint under {directory} (no such directory; expected a "
                            "workdir written by experiments/train.py)")
  manager = ocp.CheckpointManager(directory)
  try:
    step = manager.latest_step()
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {directory} (expected a workdir written "
                              "by experiments/train.py)")
    return ckpt.read_meta(manager, step, os.path.join(directory, str(step)))
  finally:
    manager.close()


def convert_run_params(params, source, target, *, seed: int = 0,
                       description: str = "checkpoint"):
  """`params` of model `source` as params of model `target` (ConfigDicts, completed): the same
  params when the models are equal, else `convert_attention_pattern` with fresh parts from
  `init_params(target, jax.random.key(seed))`; errors name `description`."""
  if target.to_dict() == source.to_dict():
    return params
  try:
    return convert_attention_pattern(params, source, target, jax.random.key(seed))
  except ValueError as e:
    raise ValueError(f"converting {description} from pattern {source.attention_pattern!r} to "
                     f"{target.attention_pattern!r}: {e}") from e


def load_run(workdir: str, *, target_model=None, model_overrides: dict | None = None,
             seed: int = 0) -> LoadedRun:
  """Latest params of `workdir`, for `target_model` (default: the trained model) with
  `model_overrides` applied (e.g. {"attention_pattern": "SMSM", "sliding_window": 64}).

  Raises:
    FileNotFoundError: no checkpoint in `workdir`.
    ValueError: the checkpoint's params cannot be merged into the target model (the message
      lists the parameters, from `merge_stage_params`).
  """
  meta = read_run_meta(workdir)
  source = complete_model_config(meta["config"]["model"])
  loaded, _ = ckpt.restore_params_from(
      workdir, lambda m: abstract_params(complete_model_config(m)))
  target = complete_model_config(target_model if target_model is not None else source)
  target = apply_model_overrides(target, model_overrides)
  params = convert_run_params(loaded, source, target, seed=seed, description=workdir)
  return LoadedRun(model=target, params=params, source_model=source, step=int(meta["step"]),
                   data=dict(meta["config"].get("data", {})),
                   converted=target.to_dict() != source.to_dict())
