"""Orbax checkpoints of the whole training state, with exact resume.

One checkpoint per saved step under `<workdir>/checkpoints/<step>/`, items:
  params     the model params (StandardSave; restored directly into their shardings)
  opt_state  the optimizer state (StandardSave)
  meta       JSON: step, RNG key data, the config fields that must match on resume, and the
             fingerprint of params, opt_state and data (`glm5_jax.train.integrity`)
  data       the grain iterator position (grain's own checkpoint handler); absent in RL runs,
             whose rollouts are a function of the step (RL saves through the same `save` /
             `restore_latest` with its own fingerprint, numbers checkpoints by RL step and
             records the optimizer updates and its `extra` state in `meta`)
Orbax writes each step to a temporary directory and renames it when every item is complete,
so a checkpoint is whole or absent. Saves are asynchronous: training continues while the last
step is written.

Restore verifies the fingerprint and refuses a damaged step (`CheckpointCorruptError` naming
its directory). With `ckpt.restore_fallback=True` it instead moves the damaged step to
`<workdir>/checkpoints_damaged/<step>` (with a warning naming it) and tries the step before.

Resume order: the latest checkpoint in the workdir wins; else `train.init_from` (params only,
from another run, e.g. a dense MLA run into a DSA stage); else a fresh init.
"""

import json
import os
import shutil

from absl import logging
import grain
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from glm5_jax import config as config_lib
from glm5_jax.train import integrity
from glm5_jax.train.state import TrainState
from glm5_jax.train.stopping import any_process

# Sections that must be identical to resume exactly (train.* may change, e.g. more steps)...
RESUME_SECTIONS = ("model", "data", "optim")
# ... and single fields of other sections: the DSA stage decides which parameter groups the
# optimizer freezes, so it changes the optimizer state's structure.
RESUME_FIELDS = (("train", "dsa_stage"),)
# Fields added to a fingerprinted section after checkpoints were written, each with the value
# that reproduces the behaviour from before: a checkpoint without the field resumes under that
# value (and only under it). The model section's are `config.LATER_FIELDS`, at the values
# `config.with_later_field_defaults` gives a model config without them.
ADDED_FIELDS = {("optim", "ns_dtype"): "float32",
                **{("model", name): value for name, value in
                   config_lib.with_later_field_defaults(ml_collections.ConfigDict()).items()}}
DAMAGED_DIR = "checkpoints_damaged"


class CheckpointMismatchError(ValueError):
  """The workdir's checkpoint was written by an incompatible config (or is unreadable)."""


class CheckpointCorruptError(CheckpointMismatchError):
  """A checkpoint step cannot be read, or its arrays differ from the fingerprint saved with
  them; the message names the step directory (and the arrays)."""


def brief(e: BaseException, limit: int = 300) -> str:
  """`e` as one short line: its type and its message's first line (tensorstore's errors for a
  torn file run to hundreds of lines of spec and context)."""
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  text = lines[0] if lines else ""
  text = text if len(text) <= limit else text[:limit] + "..."
  more = f" (+{len(lines) - 1} more lines)" if len(lines) > 1 else ""
  return f"{type(e).__name__}: {text}{more}"


def read_meta(manager, step: int, where: str) -> dict:
  """The step's JSON `meta` item; CheckpointCorruptError naming the step when unreadable."""
  try:
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except Exception as e:  # orbax raises many types (JSONDecodeError, KeyError, ...)
    raise CheckpointCorruptError(f"{where}: unreadable checkpoint metadata ({brief(e)})") from None


def make_manager(workdir: str, *, every_steps: int, keep: int, async_save: bool = True):
  # A remote workdir (gs://...) is orbax's to resolve; abspath would turn it into a local path.
  directory = (f"{workdir.rstrip('/')}/checkpoints" if "://" in workdir
               else os.path.join(os.path.abspath(workdir), "checkpoints"))
  return ocp.CheckpointManager(
      directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every_steps,
                                           enable_async_checkpointing=async_save,
                                           create=True),
  )


def config_fingerprint(config) -> dict:
  """The parts of the experiment config that a resume must match, as plain JSON data."""
  out = {name: json.loads(config[name].to_json()) for name in RESUME_SECTIONS if name in config}
  for section, field in RESUME_FIELDS:
    if section in config and field in config[section]:
      out.setdefault(section, {})[field] = config[section][field]
  return out


def save(manager, state: TrainState, data_iterator, config, *, force: bool = False,
         step: int | None = None, fingerprint: dict | None = None,
         extra: dict | None = None) -> bool:
  """Saves `state` as checkpoint `step` if due (or `force`); returns whether a save started.

  Args:
    data_iterator: the grain iterator saved with the state, or None (RL: its rollouts are a
      function of the step, there is no data position).
    config: the experiment config; `config_fingerprint(config)` is what a resume must match,
      unless `fingerprint` (JSON) is given instead (RL's `rl_fingerprint`).
    step: the checkpoint's number when it is not `state.step` (RL counts RL steps, `state.step`
      optimizer updates; the meta item records both, and restore returns `state.step` as saved).
    extra: JSON-able, stored in the meta item (restored as `meta["extra"]`).
  """
  updates = int(state.step)
  step = updates if step is None else step
  if not (force or manager.should_save(step)):
    return False
  prints = {"params": integrity.tree_fingerprint(state.params),
            "opt_state": integrity.tree_fingerprint(state.opt_state)}
  items = dict(params=ocp.args.StandardSave(state.params),
               opt_state=ocp.args.StandardSave(state.opt_state))
  if data_iterator is not None:
    prints["data"] = integrity.process_data_fingerprints(data_iterator.get_state())
    items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
  meta = {"step": step, "rng": np.asarray(state.rng).tolist(),
          "config": config_fingerprint(config) if fingerprint is None else fingerprint,
          "fingerprint": prints}
  if step != updates:
    meta["updates"] = updates
  if extra is not None:
    meta["extra"] = extra
  return manager.save(step, args=ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta)),
                      force=force)


def _differences(saved, current, prefix=""):
  if isinstance(saved, dict) and isinstance(current, dict):
    out = []
    for key in sorted(set(saved) | set(current)):
      out += _differences(saved.get(key, "<absent>"), current.get(key, "<absent>"),
                          f"{prefix}{key}.")
    return out
  return [] if saved == current else [f"{prefix.rstrip('.')}: checkpoint {saved!r} vs now "
                                      f"{current!r}"]


def restore_latest(manager, abstract_state: TrainState, data_iterator, config, *,
                   fallback: bool = False, fingerprint: dict | None = None):
  """Restores the latest checkpoint into `abstract_state`'s structure and shardings, verified
  against its fingerprint.

  Args:
    data_iterator: moved to the saved position in place; None when the run has none (`save`).
    fallback: when the latest step is damaged, move it to `<workdir>/checkpoints_damaged/`
      (logging a warning that names it) and try the step before, and so on.
    fingerprint: what the checkpoint's config must match, when not `config_fingerprint(config)`
      (as given to `save`).
  Returns:
    `(TrainState, meta)` of the restored step (meta: the JSON item `save` wrote; `extra` in
    it), or None when the workdir has no checkpoint.
  Raises:
    CheckpointMismatchError: the checkpoint's config differs.
    CheckpointCorruptError: the step cannot be read or fails its fingerprint (and `fallback` is
      off, or no earlier step is intact).
  """
  steps = sorted(manager.all_steps(), reverse=True)
  for i, step in enumerate(steps):
    where = os.path.join(str(manager.directory), str(step))
    error = None
    try:
      restored = _restore_step(manager, step, where, abstract_state, data_iterator,
                               config_fingerprint(config) if fingerprint is None else fingerprint)
    except CheckpointCorruptError as e:
      error = e
    # Every process must take the same branch (a damaged shard may be read by one host only).
    if not any_process(error is not None):
      if i:
        logging.warning("ckpt.restore_fallback: resumed from step %d, the latest intact one",
                        step)
      return restored
    error = error or CheckpointCorruptError(f"{where}: damaged on another process")
    if not fallback:
      hint = ("To resume from the step before it, set --config.ckpt.restore_fallback=True (the "
              "damaged step is then moved aside), or move it away yourself." if i + 1 < len(steps)
              else "It is the only step: move it away to start the run afresh.")
      raise CheckpointCorruptError(f"{error}\n{hint}") from error
    if i + 1 == len(steps):
      raise CheckpointCorruptError(f"{error}\nckpt.restore_fallback: no earlier intact step "
                                   f"in {manager.directory}") from error
    moved = _set_aside(manager, step)
    logging.warning("ckpt.restore_fallback: skipping damaged step %d (moved to %s): %s", step,
                    moved, error)
  return None


def with_added_fields(saved: dict) -> dict:
  """A saved fingerprint with each `ADDED_FIELDS` entry its section lacks set to the old
  behaviour's value (a copy; `saved` is not changed)."""
  out = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
  for (section, field), value in ADDED_FIELDS.items():
    if isinstance(out.get(section), dict):
      out[section].setdefault(field, value)
  return out


def _restore_step(manager, step, where, abstract_state, data_iterator, current: dict):
  meta = read_meta(manager, step, where)
  # Both sides: a section written by hand (tests, tools) may lack the added field too.
  saved_config, current = with_added_fields(meta.get("config", {})), with_added_fields(current)
  for section, _ in RESUME_FIELDS:  # a checkpoint from before that field was recorded
    if section not in saved_config:
      current.pop(section, None)
  differences = _differences(saved_config, current)
  if differences:
    raise CheckpointMismatchError(
        f"{where} was written with a different config; resuming would not be exact. Use a new "
        "--workdir, or restore the old values:\n  " + "\n  ".join(differences[:30]))
  try:
    items = dict(params=ocp.args.StandardRestore(abstract_state.params),
                 opt_state=ocp.args.StandardRestore(abstract_state.opt_state))
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    restored = manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as e:  # tensorstore / orbax errors for missing or undecodable files
    raise CheckpointCorruptError(f"{where}: could not restore ({brief(e)})") from None
  _verify(meta, where, restored["params"], restored["opt_state"], data_iterator)
  state = TrainState(step=_placed(meta.get("updates", meta["step"]), abstract_state.step),
                     params=restored["params"], opt_state=restored["opt_state"],
                     rng=_placed(meta["rng"], abstract_state.rng))
  return state, meta


def _placed(value, like: jax.ShapeDtypeStruct) -> jax.Array:
  """Host `value` as a global array of `like`'s dtype and sharding (replicated on the mesh, like
  the train step's output): an uncommitted array there made the first step after a resume
  compile the train step a second time (its input sharding differed from the step's output)."""
  host = np.asarray(value, like.dtype).reshape(like.shape)
  if like.sharding is None:
    return jax.numpy.asarray(host)
  return jax.make_array_from_callback(like.shape, like.sharding, lambda index: host[index])


def _verify(meta, where, params, opt_state, data_iterator=None):
  """Raises `CheckpointCorruptError` naming the arrays whose checksums differ from `meta`'s."""
  saved = meta.get("fingerprint")
  if saved is None:
    logging.warning("%s has no fingerprint (written before fingerprints existed): restored "
                    "without verifying its arrays", where)
    return
  bad = [f"params{k}" for k in integrity.mismatches(
      saved["params"], integrity.tree_fingerprint(params))]
  if opt_state is not None:
    bad += [f"opt_state{k}" for k in integrity.mismatches(
        saved["opt_state"], integrity.tree_fingerprint(opt_state))]
  if data_iterator is not None and not integrity.data_position_matches(
      saved["data"], data_iterator.get_state()):
    bad.append("data (iterator position)")
  if bad:
    raise CheckpointCorruptError(
        f"{where}: damaged checkpoint: {len(bad)} item(s) differ from the fingerprint saved "
        f"with them: {', '.join(bad[:10])}{', ...' if len(bad) > 10 else ''}")


def _set_aside(manager, step: int) -> str:
  """Moves a damaged step out of the checkpoint directory (so this run can save that step
  again) to `<workdir>/checkpoints_damaged/<step>`; returns where."""
  source = os.path.join(str(manager.directory), str(step))
  target = os.path.join(os.path.dirname(str(manager.directory)), DAMAGED_DIR, str(step))
  if jax.process_index() == 0:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.exists(target):
      target = f"{target}.{len(os.listdir(os.path.dirname(target)))}"
    shutil.move(source, target)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"glm5 set aside damaged step {step}")
  manager.reload()
  return target


def restore_params_from(workdir: str, abstract_params_fn):
  """Latest params of another run's workdir, for `train.init_from`.

  Args:
    abstract_params_fn: `model ConfigDict -> ShapeDtypeStruct tree` of that run's params.
  Returns:
    `(params, that run's model ConfigDict)`.
  Raises:
    FileNotFoundError: no checkpoint there.
    CheckpointCorruptError: its latest step cannot be read or fails its fingerprint.
  """
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  manager = ocp.CheckpointManager(directory)
  try:
    step = manager.latest_step()
    if step is None:
      raise FileNotFoundError(f"config.train.init_from: no checkpoint under {directory}")
    where = os.path.join(directory, str(step))
    try:
      meta = read_meta(manager, step, where)
      model = ml_collections.ConfigDict(meta["config"]["model"])
      params = manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(abstract_params_fn(model))))["params"]
    except CheckpointCorruptError:
      raise
    except Exception as e:  # tensorstore / orbax errors for missing or undecodable files
      raise CheckpointCorruptError(f"{where}: could not restore params ({brief(e)})") from None
  finally:
    manager.close()
  _verify(meta, where, params, None)
  return params, model
