"""The optimizer from the `optim` config: Muon Split (or Muon, or AdamW) + AdamW, one schedule.

docs/reference.md section 3. One update, in order:

  1. frozen leaves (`trainable` False, `e_score_correction_bias`) get zero gradient, so they
     count for nothing below;
  2. clip by global norm (over the trainable gradients) to `grad_clip_norm`;
  3. per group (`muon_split.param_labels`):
       muon:   Nesterov momentum (`momentum`), Newton-Schulz orthogonalization of each matrix
               slice (`ns_steps`, `ns_coeffs`) by `optax.contrib.scale_by_muon`, in fp32 or, with
               `ns_dtype` bfloat16, bf16 (`ns_precision`), rescaled to RMS
               `consistent_rms` (Moonlight: sqrt(max(fan_in, fan_out)) * 0.2, so one learning
               rate suits Muon and AdamW), + weight_decay * param, x -lr(t);
       adam:   AdamW (b1, b2, eps; decoupled weight decay on `lm_head` only, see
               `muon_split.weight_decay_mask`), x -adam_lr(t);
       frozen: exactly zero, and no optimizer state.

Weight decay follows optax (and PyTorch): it is multiplied by the scheduled learning rate.

Why not `optax.contrib.muon` itself: it is the same Muon chain, but its Adam branch reuses the
Muon `nesterov` flag (so it would be NAdam) and decays every Adam leaf or none (no mask), and it
has no frozen group. We reuse its `scale_by_muon` (momentum + Newton-Schulz) unchanged and
assemble the groups with `optax.partition`; `tests/test_optim.py` checks that the Muon group
matches `optax.contrib.muon` exactly.
"""

import math

import jax
import jax.numpy as jnp
import ml_collections
import optax
from ml_collections import config_dict
from optax.contrib import MuonDimensionNumbers

from glm5_jax.config import ConfigError, check_fields
from glm5_jax.optim import muon_split
from glm5_jax.optim.muon_split import ADAM, FROZEN, MUON
from glm5_jax.optim.ns_precision import NS_DTYPES
from glm5_jax.optim.whole_matrices import whole_expert_matrices, whole_layer_matrices


def optim_config(**overrides) -> ml_collections.ConfigDict:
  """The `optim` section's defaults (tiny-model scale), with `overrides` applied."""
  c = ml_collections.ConfigDict()
  c.name = "muon_split"  # "muon_split" | "muon" (whole-matrix) | "adamw"
  c.learning_rate = 3e-3  # peak LR (Muon group; every group under "adamw")
  # Peak LR of the AdamW group in the Muon variants; None or 0 = learning_rate, the Moonlight
  # choice: consistent_rms makes Muon's update RMS match AdamW's, so one LR fits both.
  c.adam_learning_rate = config_dict.placeholder(float)
  c.warmup_steps = 100  # linear 0 -> peak over these steps
  c.min_lr_ratio = 0.1  # cosine from peak to peak * min_lr_ratio at total_steps
  c.weight_decay = 0.1  # decoupled; matrices only (see muon_split.weight_decay_mask)
  c.b1 = 0.9  # AdamW
  c.b2 = 0.95
  c.eps = 1e-8
  c.momentum = 0.95  # Muon
  c.nesterov = True
  c.ns_steps = 5
  c.ns_coeffs = (3.4445, -4.7750, 2.0315)
  # The Newton-Schulz matmuls' dtype; the momentum stays fp32 either way. "bfloat16" is the
  # usual Muon practice and runs at the bf16 rate on a GPU (fp32 is TF32 there): ns_precision.
  c.ns_dtype = "float32"
  c.consistent_rms = 0.2  # None: optax's width scaling sqrt(max(1, fan_out / fan_in))
  c.grad_clip_norm = 1.0  # 0 disables
  c.update(overrides)
  return c


def _require(ok: bool, field: str, message: str):
  if not ok:
    raise ConfigError(f"config.optim.{field}: {message}")


def validate_optim_config(c, total_steps: int) -> None:
  """Rejects impossible optimizer settings with a `ConfigError` naming the field.

  Args:
    c: the `optim` section.
    total_steps: the schedule's length (`train.steps`).
  """
  check_fields(c, optim_config(), "optim", nullable=("consistent_rms",))
  _require(c.name in muon_split.OPTIMIZER_NAMES, "name",
           f"must be one of {muon_split.OPTIMIZER_NAMES}, got {c.name!r}")
  _require(c.learning_rate > 0, "learning_rate", f"must be > 0, got {c.learning_rate}")
  _require(c.adam_learning_rate is None or c.adam_learning_rate >= 0, "adam_learning_rate",
           f"must be >= 0 (0 or None = learning_rate), got {c.adam_learning_rate}")
  if not (isinstance(total_steps, int) and total_steps >= 1):
    raise ConfigError(f"config.train.steps: must be a positive integer, got {total_steps!r}")
  _require(0 <= c.warmup_steps < total_steps, "warmup_steps",
           f"must be in [0, train.steps={total_steps}), got {c.warmup_steps}")
  _require(0 <= c.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {c.min_lr_ratio}")
  _require(c.weight_decay >= 0, "weight_decay", f"must be >= 0, got {c.weight_decay}")
  for name in ("b1", "b2", "momentum"):
    _require(0 <= c[name] < 1, name, f"must be in [0, 1), got {c[name]}")
  _require(c.eps > 0, "eps", f"must be > 0, got {c.eps}")
  _require(c.ns_steps >= 1, "ns_steps", f"must be a positive integer, got {c.ns_steps}")
  _require(len(c.ns_coeffs) == 3 and all(
      isinstance(x, (int, float)) and not isinstance(x, bool) for x in c.ns_coeffs),
           "ns_coeffs", f"must be 3 numbers (a, b, c), got {c.ns_coeffs!r}")
  _require(c.ns_dtype in NS_DTYPES, "ns_dtype", f"must be one of {NS_DTYPES}, got {c.ns_dtype!r}")
  _require(c.consistent_rms is None or c.consistent_rms > 0, "consistent_rms",
           f"must be > 0 or None, got {c.consistent_rms}")
  _require(c.grad_clip_norm >= 0, "grad_clip_norm", f"must be >= 0 (0 disables), got "
           f"{c.grad_clip_norm}")


def lr_schedule(peak: float, warmup_steps: int, total_steps: int, min_lr_ratio: float):
  """Linear warmup from 0 at step 0 to `peak` at `warmup_steps`, then cosine decay to
  `peak * min_lr_ratio` at `total_steps`, constant after."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup_steps, decay_steps=total_steps,
      end_value=peak * min_lr_ratio)


def build_optimizer(optim_cfg, params, *, total_steps: int, trainable=None, logical_axes=None):
  """Builds the optimizer the config names.

  Args:
    optim_cfg: the `optim` ConfigDict (`optim_config()` with overrides).
    params: the model params, arrays or `jax.ShapeDtypeStruct`s (only paths and shapes used).
    total_steps: the schedule's length (its cosine ends here).
    trainable: optional bool tree (params' structure or a prefix of it); False leaves get
      exactly zero updates and carry no optimizer state.
    logical_axes: the params' logical axes (`PartitionSpec`s of logical names, as
      `glm5_jax.abstract_params_and_axes` gives them), or None. With them, under a mesh, the
      split matrices of a scanned run are orthogonalized whole, layers spread over the devices
      (`whole_matrices.whole_layer_matrices`); the numbers and the state are the same.
  Returns:
    `(tx, schedule)`: an `optax.GradientTransformation` and the step -> learning-rate schedule
    of the Muon group (every group under "adamw"), for logging.
  `optim_cfg` is assumed valid: `validate_config` (or `validate_optim_config`) checks it.

  Raises:
    UnknownParamError: a param path with no rule.
  """
  c = optim_cfg
  schedule = lr_schedule(c.learning_rate, c.warmup_steps, total_steps, c.min_lr_ratio)
  adam_schedule = schedule
  if c.name != "adamw" and c.adam_learning_rate:
    adam_schedule = lr_schedule(c.adam_learning_rate, c.warmup_steps, total_steps,
                                c.min_lr_ratio)

  labels = muon_split.param_labels(params, c.name, trainable)
  decay_mask = muon_split.weight_decay_mask(params)
  groups = {
      FROZEN: optax.set_to_zero(),
      ADAM: optax.adamw(adam_schedule, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay,
                        mask=decay_mask),
  }
  if c.name != "adamw":
    dims = muon_split.muon_dimension_numbers(params, split=c.name == "muon_split")

    muon_args = dict(ns_coeffs=tuple(c.ns_coeffs), ns_steps=c.ns_steps, beta=c.momentum,
                     nesterov=c.nesterov)

    def after_muon(group_dims):
      return (scale_by_shape(group_dims, c.consistent_rms),
              optax.add_decayed_weights(c.weight_decay, mask=decay_mask),
              optax.scale_by_learning_rate(schedule))

    # Muon kernels of a scanned run form a group of their own, run layer by layer (`layer_map`),
    # with each layer's own (unshifted) matrix layout; their split matrices are orthogonalized
    # whole (`whole_matrices`: spread over the devices with the run's layers).
    labels = muon_split.per_run_muon_labels(labels)
    for label in sorted(set(jax.tree.leaves(labels))):
      if label == MUON:
        group_dims = muon_split.masked_dimension_numbers(dims, labels, label)
        groups[MUON] = optax.chain(
            whole_expert_matrices(c.ns_dtype, **muon_args, weight_dimension_numbers=group_dims),
            *after_muon(group_dims))
      elif label.startswith(MUON + "/"):
        run_dims = muon_split.masked_dimension_numbers(dims, labels, label)
        layer_dims = muon_split.masked_dimension_numbers(
            muon_split.per_layer_dimension_numbers(dims), labels, label)
        group_axes = None if logical_axes is None else jax.tree.map(
            lambda got, axes: axes if got == label else optax.MaskedNode(), labels,
            logical_axes)
        groups[label] = whole_layer_matrices(
            c.ns_dtype, **muon_args, run_dims=run_dims, layer_dims=layer_dims,
            rest=after_muon(layer_dims), logical_axes=group_axes)

  frozen = jax.tree.map(lambda label: label == FROZEN, labels)
  steps = [optax.masked(optax.set_to_zero(), frozen)]  # frozen grads out of the global norm
  if c.grad_clip_norm:
    steps.append(optax.clip_by_global_norm(c.grad_clip_norm))
  steps.append(optax.partition(groups, labels))
  return optax.chain(*steps), schedule


def _fans(shape, dims: MuonDimensionNumbers) -> tuple[int, int]:
  """(fan_in, fan_out): products of the reduction and of the output axes' sizes."""
  as_tuple = lambda axes: (axes,) if isinstance(axes, int) else tuple(axes)
  fan_in = math.prod(shape[a] for a in as_tuple(dims.reduction_axis))
  fan_out = math.prod(shape[a] for a in as_tuple(dims.output_axis))
  return fan_in, fan_out


def scale_by_shape(dims, consistent_rms: float | None) -> optax.GradientTransformation:
  """Rescales orthogonalized updates by their matrix shape (as optax.contrib.muon does).

  An orthogonal `[fan_in, fan_out]` matrix has RMS `1 / sqrt(max(fan_in, fan_out))`, so with
  `consistent_rms` the update is scaled by `sqrt(max(fan_in, fan_out)) * consistent_rms` and has
  RMS `consistent_rms` whatever its shape (Liu et al. 2025, "Muon is Scalable for LLM
  Training"). With None: `sqrt(max(1, fan_out / fan_in))` (Keller Jordan's width scaling).
  Batch axes (heads, experts) do not enter the fans: each slice is its own matrix.

  Args:
    dims: tree of `MuonDimensionNumbers` (with `optax.MaskedNode` where not Muon).
    consistent_rms: target RMS, or None.
  """

  def scale(update, d):
    fan_in, fan_out = _fans(update.shape, d)
    if consistent_rms is None:
      factor = math.sqrt(max(1.0, fan_out / fan_in))
    else:
      factor = math.sqrt(max(fan_in, fan_out)) * consistent_rms
    return update * jnp.asarray(factor, update.dtype)

  def update_fn(updates, state, params=None):
    del params
    is_dims = lambda x: isinstance(x, MuonDimensionNumbers)
    return jax.tree.map(scale, updates, dims, is_leaf=is_dims), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
