"""Optimizers: Muon Split + AdamW (docs/reference.md section 3), built from the `optim` config.

Public API:
  optim_config(**overrides) -> ConfigDict          the `optim` section's defaults
  build_optimizer(optim_cfg, params, *, total_steps, trainable=None, logical_axes=None)
                                                   -> (tx, schedule)
  muon_dimension_numbers(params, split=True)       per-leaf Muon layout, None = AdamW
  param_labels(params, name, trainable)            per-leaf group: "muon" / "adam" / "frozen"
  weight_decay_mask(params)                        per-leaf: decoupled weight decay or not
  lr_schedule(peak, warmup_steps, total_steps, min_lr_ratio)
"""

from glm5_jax.optim.build import build_optimizer, lr_schedule, optim_config, validate_optim_config
from glm5_jax.optim.muon_split import (
    UnknownParamError, muon_dimension_numbers, param_labels, weight_decay_mask)

__all__ = [
    "optim_config", "build_optimizer", "validate_optim_config", "lr_schedule",
    "muon_dimension_numbers", "param_labels", "weight_decay_mask", "UnknownParamError",
]
