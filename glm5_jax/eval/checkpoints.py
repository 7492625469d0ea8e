"""Params for evaluation from a training run's workdir, optionally converted to another pattern.

A run's workdir (experiments/train.py) holds orbax checkpoints whose `meta` item records the
config sections `model`, `data` and `optim` (glm5_jax.train.checkpoint). Evaluating it:

  same model          the latest params as trained;
  other attention     training-free conversion: fresh params of the target model (init from
  pattern             `seed`) merged with the checkpoint's by `merge_stage_params`, so every
                      parameter the source has keeps its trained value and parts the target adds
                      (e.g. a DSA indexer, GDN gates) start freshly initialized.

Model fields added to `glm5_jax.config.model_config` after a checkpoint was written take their
defaults, so old runs stay loadable.
"""

import dataclasses
import os

import jax
import ml_collections
import orbax.checkpoint as ocp

from glm5_jax.api import abstract_params, init_params
from glm5_jax.config import model_config
from glm5_jax.train import checkpoint as ckpt
from glm5_jax.train.state import merge_stage_params


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
  manager = ocp.CheckpointManager(directory)
  try:
    step = manager.latest_step()
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {directory} (expected a workdir written "
                              "by experiments/train.py)")
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  finally:
    manager.close()


def convert_params(params, source, target, *, seed: int = 0, description: str = "checkpoint"):
  """`params` of model `source` as params of model `target` (ConfigDicts, completed).

  Identical models return `params` unchanged. Otherwise `merge_stage_params` merges them into
  the target's abstract shapes (so its errors come before any compilation); parameters the
  source lacks come back as shapes and are then taken from `init_params(target, seed)`
  (bit for bit; only those leaves are computed).
  """
  if target.to_dict() == source.to_dict():
    return params
  try:
    merged = merge_stage_params(abstract_params(target), params,
                                f"{description} (pattern {source.attention_pattern})")
  except ValueError as e:
    raise ValueError(f"converting {description} from pattern {source.attention_pattern!r} to "
                     f"{target.attention_pattern!r}: {e}") from e
  leaves, treedef = jax.tree_util.tree_flatten(merged)
  new = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.ShapeDtypeStruct)]
  if new:
    fresh_def = jax.tree_util.tree_structure(abstract_params(target))
    if fresh_def != treedef:
      raise ValueError(f"{description}: merged params and a fresh init of the target model "
                       "have different structures")
    # Under one jit XLA drops the init of every parameter that is not new.
    new_leaves = jax.jit(lambda key: [jax.tree_util.tree_leaves(init_params(target, key))[i]
                                      for i in new])(jax.random.key(seed))
    for i, leaf in zip(new, new_leaves):
      leaves[i] = leaf
  return jax.tree_util.tree_unflatten(treedef, leaves)


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
  params = convert_params(loaded, source, target, seed=seed, description=workdir)
  return LoadedRun(model=target, params=params, source_model=source, step=int(meta["step"]),
                   data=dict(meta["config"].get("data", {})),
                   converted=target.to_dict() != source.to_dict())
