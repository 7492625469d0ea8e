"""Train state, which parameters each DSA stage trains, and starting from another stage's params.

DSA stages (GLM5_REFERENCE.md section 3, `train.dsa_stage`):
  dense   ordinary MLA training; indexers (if the pattern has any) are unused and frozen
  warmup  attention dense; only the indexers train (KL to the main attention)
  sparse  top-k attention; every parameter trains (indexers only through their own KL loss)
The router's `e_score_correction_bias` is never trained by gradients (the optimizer freezes
it); the loss-free balancing rule in `glm5_jax.train.step` moves it instead.
"""

from typing import Any

import flax
import jax
import jax.numpy as jnp

DSA_STAGES = ("dense", "warmup", "sparse")


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32 key data; training itself is deterministic, kept for extensions


def _is_indexer(path) -> bool:
  return any(getattr(k, "key", None) == "indexer" for k in path)


def trainable_mask(params, dsa_stage: str):
  """Bool tree: which parameters the optimizer may change in `dsa_stage`."""
  if dsa_stage not in DSA_STAGES:
    raise ValueError(f"config.train.dsa_stage: must be one of {DSA_STAGES}, got {dsa_stage!r}")
  if dsa_stage == "sparse":
    return jax.tree_util.tree_map(lambda _: True, params)
  want_indexer = dsa_stage == "warmup"
  return jax.tree_util.tree_map_with_path(lambda p, _: _is_indexer(p) == want_indexer, params)


def merge_stage_params(fresh, loaded, source: str):
  """Params for this run from another stage's params `loaded` (e.g. an MLA checkpoint into a
  DSA model): every parameter comes from `loaded`, except indexers the source lacks, which keep
  their fresh initialization; indexers the source has but this model lacks are dropped.

  Raises:
    ValueError: any other parameter missing on either side, or a shape mismatch.
  """
  flat_fresh = {tuple(getattr(k, "key", k) for k in p): v
                for p, v in jax.tree_util.tree_flatten_with_path(fresh)[0]}
  flat_loaded = {tuple(getattr(k, "key", k) for k in p): v
                 for p, v in jax.tree_util.tree_flatten_with_path(loaded)[0]}
  problems = []
  for path in sorted(set(flat_loaded) - set(flat_fresh)):
    if "indexer" not in path:
      problems.append(f"{'/'.join(path)} is in {source} but not in this model")
  merged = {}
  for path, value in flat_fresh.items():
    if path not in flat_loaded:
      if "indexer" not in path:
        problems.append(f"{'/'.join(path)} is missing from {source}")
      merged[path] = value
    elif flat_loaded[path].shape != value.shape:
      problems.append(f"{'/'.join(path)} has shape {flat_loaded[path].shape} in {source}, "
                      f"{value.shape} here")
    else:
      merged[path] = jnp.asarray(flat_loaded[path], value.dtype)
  if problems:
    raise ValueError("config.train.init_from: incompatible params:\n  " + "\n  ".join(
        problems[:30]))
  return _unflatten(merged)


def _unflatten(flat: dict) -> dict:
  tree = {}
  for path, value in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree
