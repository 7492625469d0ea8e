"""Train state, which parameters each DSA stage trains, and starting from another stage's params.

DSA stages (docs/reference.md section 3, `train.dsa_stage`):
  dense   ordinary MLA training; indexers (if the pattern has any) are unused and frozen
  warmup  attention dense; only the indexers train (KL to the main attention)
  sparse  top-k attention; every parameter trains (indexers only through their own KL loss)
The router's `e_score_correction_bias` is never trained by gradients (the optimizer freezes
it); the loss-free balancing rule in `glm5_jax.train.step` moves it instead.
"""

from typing import Any

import flax
import jax
from flax import traverse_util

from glm5_jax.attention.mode import DSA_STAGES
from glm5_jax.config import ModelConfig
from glm5_jax.convert.attention_pattern import merge_pattern_params
from glm5_jax.layer_runs import as_layout_of, as_unrolled


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32 key data; training itself is deterministic, kept for extensions


def trainable_mask(params, dsa_stage: str):
  """Bool tree: which parameters the optimizer may change in `dsa_stage` (one of `DSA_STAGES`,
  as `validate_config` checks `train.dsa_stage`)."""
  assert dsa_stage in DSA_STAGES, dsa_stage
  if dsa_stage == "sparse":
    return jax.tree_util.tree_map(lambda _: True, params)
  want_indexer = dsa_stage == "warmup"
  return traverse_util.path_aware_map(lambda path, _: ("indexer" in path) == want_indexer,
                                      params)


def merge_stage_params(fresh, loaded, source: str, *, fresh_model: ModelConfig,
                       loaded_model: ModelConfig):
  """Params for this run from another run's params `loaded`, whose attention pattern may differ
  (an MLA checkpoint into a DSA model, a full-attention one into S / N / L layers, ...).

  Every parameter comes from `loaded`, except the extras of attention kinds a layer converts
  to (a DSA indexer, GDN's convs/gates/norm, SimpleGDN's learned scalars), which keep their
  fresh initialization; extras of kinds a layer converts away from are dropped. The per-kind
  rules live in `glm5_jax.convert.attention_pattern`.

  Args:
    fresh: this model's freshly initialized params.
    loaded: the other run's params.
    source: names `loaded` in error messages (e.g. the checkpoint and its pattern).
    fresh_model, loaded_model: the two models' configs; their layer layouts
      (`model.scan_layers`) may differ, and the result has `fresh_model`'s.
  Raises:
    ValueError: any other parameter missing on either side, or a shape mismatch (the message
      starts with `config.train.init_from` and lists the parameters).
  """
  merged = merge_pattern_params(as_unrolled(fresh, fresh_model),
                                as_unrolled(loaded, loaded_model), source,
                                context="config.train.init_from")
  return as_layout_of(fresh_model, merged)
