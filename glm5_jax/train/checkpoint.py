"""Orbax checkpoints of the whole training state, with exact resume.

One checkpoint per saved step under `<workdir>/checkpoints/<step>/`, items:
  params     the model params (StandardSave; restored directly into their shardings)
  opt_state  the optimizer state (StandardSave)
  meta       JSON: step, RNG key data, and the config sections that must match on resume
  data       the grain iterator position (grain's own checkpoint handler)
Orbax writes each step to a temporary directory and renames it when every item is complete,
so a checkpoint is whole or absent. Saves are asynchronous: training continues while the last
step is written.

Resume order: the latest checkpoint in the workdir wins; else `train.init_from` (params only,
from another run, e.g. a dense MLA run into a DSA stage); else a fresh init.
"""

import json
import os

import grain
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from glm5_jax.train.state import TrainState

# Sections that must be identical to resume exactly (train.* may change, e.g. more steps).
RESUME_SECTIONS = ("model", "data", "optim")


class CheckpointMismatchError(ValueError):
  """The workdir's checkpoint was written by an incompatible config (or is unreadable)."""


def make_manager(workdir: str, *, every_steps: int, keep: int, async_save: bool = True):
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every_steps,
                                           enable_async_checkpointing=async_save,
                                           create=True),
  )


def config_fingerprint(config) -> dict:
  """The sections of the experiment config that a resume must match, as plain JSON data."""
  return {name: json.loads(config[name].to_json()) for name in RESUME_SECTIONS if name in config}


def save(manager, state: TrainState, data_iterator, config, *, force: bool = False) -> bool:
  """Saves `state` at `state.step` if due (or `force`); returns whether a save started."""
  step = int(state.step)
  meta = {"step": step, "rng": np.asarray(state.rng).tolist(),
          "config": config_fingerprint(config)}
  return manager.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(state.params),
      opt_state=ocp.args.StandardSave(state.opt_state),
      meta=ocp.args.JsonSave(meta),
      data=grain.checkpoint.CheckpointSave(data_iterator),
  ), force=force)


def _differences(saved, current, prefix=""):
  if isinstance(saved, dict) and isinstance(current, dict):
    out = []
    for key in sorted(set(saved) | set(current)):
      out += _differences(saved.get(key, "<absent>"), current.get(key, "<absent>"),
                          f"{prefix}{key}.")
    return out
  return [] if saved == current else [f"{prefix.rstrip('.')}: checkpoint {saved!r} vs now "
                                      f"{current!r}"]


def restore_latest(manager, abstract_state: TrainState, data_iterator, config):
  """Restores the latest checkpoint into `abstract_state`'s structure and shardings.

  Returns:
    the restored `TrainState`, or None when the workdir has no checkpoint. `data_iterator` is
    moved to the saved position in place.
  Raises:
    CheckpointMismatchError: the checkpoint's config differs, or it cannot be read.
  """
  step = manager.latest_step()
  if step is None:
    return None
  where = os.path.join(str(manager.directory), str(step))
  try:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except Exception as e:  # orbax raises many types for a damaged directory
    raise CheckpointMismatchError(f"{where}: unreadable checkpoint ({e}); move it away to "
                                  "resume from an earlier step") from e
  differences = _differences(meta.get("config", {}), config_fingerprint(config))
  if differences:
    raise CheckpointMismatchError(
        f"{where} was written with a different config; resuming would not be exact. Use a new "
        "--workdir, or restore the old values:\n  " + "\n  ".join(differences[:30]))
  try:
    restored = manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_state.params),
        opt_state=ocp.args.StandardRestore(abstract_state.opt_state),
        data=grain.checkpoint.CheckpointRestore(data_iterator),
    ))
  except Exception as e:
    raise CheckpointMismatchError(f"{where}: could not restore ({e})") from e
  return TrainState(step=jax.numpy.asarray(meta["step"], jax.numpy.int32),
                    params=restored["params"], opt_state=restored["opt_state"],
                    rng=jax.numpy.asarray(meta["rng"], jax.numpy.uint32))


def restore_params_from(workdir: str, abstract_params_fn):
  """Latest params of another run's workdir, for `train.init_from`.

  Args:
    abstract_params_fn: `model ConfigDict -> ShapeDtypeStruct tree` of that run's params.
  Returns:
    `(params, that run's model ConfigDict)`.
  """
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  manager = ocp.CheckpointManager(directory)
  step = manager.latest_step()
  if step is None:
    raise FileNotFoundError(f"config.train.init_from: no checkpoint under {directory}")
  meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  model = ml_collections.ConfigDict(meta["config"]["model"])
  params = manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract_params_fn(model))))["params"]
  manager.close()
  return params, model
