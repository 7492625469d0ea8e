"""One training step (loss, gradients, optimizer, loss-free balancing) and one eval step.

The total loss (docs/reference.md sections 2-3):
  lm_ce + z_loss_weight * z_loss
  + mtp_loss_weight * mean_d(mtp_ce_d)                 shared-parameter MTP depths
  + indexer_loss_weight * indexer_kl                   DSA warm-up / sparse stages
  + sequence_balance_weight * sequence_balance_loss    optional, DeepSeek-V3's small aux loss
After the optimizer update, each MoE layer's correction bias moves by a fixed rate toward equal
load: `b_e += rate * sign(mean_load - load_e)` (loss-free balancing), except in the DSA
warm-up stage, where everything but the indexers is frozen. With `train.microbatches` > 1 the
loss and gradients accumulate over microbatches with the result of one batch (`loss_and_grads`).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from glm5_jax.api import forward
from glm5_jax.attention import context_parallel, mla
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig, require
from glm5_jax.layers.axes import BATCH
from glm5_jax.layers.params import constrain
from glm5_jax.train import losses
from glm5_jax.train.state import TrainState


# The named scope of one microbatch's forward and backward under gradient accumulation
# (`loss_and_grads`); `glm5_jax.planning.op_costs` reads it in op_names.
MICROBATCH_SCOPE = "microbatch"


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """The `train` fields the step needs (hashable, static under jit).

  `dsa_stage` is how DSA layers attend in the forward pass; `trains_main_model` is False only
  in the warm-up stage proper (everything but the indexers frozen). `train.dsa_dense_steps`'s
  dense phase is the warm-up forward with `trains_main_model` True (`dense_phase`).
  """

  dsa_stage: str = "sparse"
  trains_main_model: bool = True
  mtp_loss_weight: float = 0.3
  z_loss_weight: float = 0.0
  indexer_loss_weight: float = 1.0
  sequence_balance_weight: float = 0.0
  balance_bias_rate: float = 1e-3
  microbatches: int = 1  # gradient accumulation: see `loss_and_grads`
  context_layout: str = "contiguous"  # `mesh.context_layout`: see `compute_loss`
  ce_chunk: int = 0  # `train.ce_chunk`: > 0 fuses the LM head into the loss (`losses`)
  ce_grad_in_forward: bool = False  # `train.ce_grad_in_forward`: see `compute_loss`

  @classmethod
  def from_config(cls, train_config, context_layout: str = "contiguous") -> "StepConfig":
    """From the `train` section and `mesh.context_layout`."""
    fields = {f.name: train_config[f.name] for f in dataclasses.fields(cls)
              if f.name not in ("trains_main_model", "context_layout")}
    return cls(**fields, trains_main_model=train_config.dsa_stage != "warmup",
               context_layout=context_layout)

  def dense_phase(self) -> "StepConfig":
    """The step of `train.dsa_dense_steps`: dense attention, indexers learning their KL."""
    return dataclasses.replace(self, dsa_stage="warmup", trains_main_model=True)


def compute_loss(model: ModelConfig, step_cfg: StepConfig, params, batch, shares=None):
  """Returns `(total_loss, (metrics, expert_counts, predictions_BL, token_nll_BL))`:
  the main head's guess (argmax) for token i and token i's negative log-likelihood, `[B, L]`
  aligned to the tokens as `losses.token_logprobs` (column 0: -1 and 0, nothing predicts
  token 0); used by evaluation, ignored by training, so they are compiled away.

  `shares` (gradient accumulation, `loss_and_grads`): the batch is a microbatch and these are
  its shares of the whole batch's denominators; the loss and metrics come back scaled by them
  (`_scale_metrics`), so that they add up over the microbatches.

  `step_cfg.ce_grad_in_forward`: the main head's and the MTP depths' losses run as one fused
  objective whose gradients are formed in the forward pass (`losses.head_losses_with_gradients`);
  their terms in the metrics carry no gradient, and the objective, weighted as `total_loss`
  weighs them (times `shares`), stands in for them in the returned total, so the gradient is
  the logits path's to rounding.

  `step_cfg.context_layout` "striped" with a context axis > 1 in the mesh in context: the
  batch (sequence order) is permuted into the striped layout (`context_parallel.stripe`, int
  ids only) and the model runs `Mode(context_layout="striped")`; its outputs stay striped and
  the losses score each slot against its striped target (`losses.lm_losses(ways=...)`), so no
  `[B, L, Y]` logits are permuted back. The same losses and gradients as the contiguous layout,
  to float rounding (tests/test_context_layout_train.py)."""
  ways = (context_parallel.layout_ways(step_cfg.context_layout)
          if step_cfg.context_layout == "striped" else 1)
  layout = "striped" if ways > 1 else "contiguous"
  inputs = {k: batch[k] if ways == 1 else context_parallel.stripe(batch[k], ways)
            for k in ("tokens", "positions", "segment_ids")}
  out = forward(model, params, inputs["tokens"], inputs["positions"], inputs["segment_ids"],
                mode=Mode(dsa_stage=step_cfg.dsa_stage, context_layout=layout))
  lm, mtp, head_objective = _head_losses(step_cfg, out, batch, ways, shares)
  kl = losses.mean_indexer_kl(out, {**batch, **inputs})
  balance = losses.mean_sequence_balance_loss(out)
  mtp_loss = jnp.mean(jnp.stack([m["ce"] for m in mtp])) if mtp else jnp.zeros(())
  terms = {"lm_loss": lm["ce"], "z_loss": lm["z_loss"],
           "accuracy": lm["accuracy"], "target_tokens": lm["weight"], "mtp_loss": mtp_loss,
           "indexer_kl": kl, "sequence_balance_loss": balance}
  metrics = {"loss": total_loss(step_cfg, terms), **terms}
  if model.moe_capacity_factor:  # the expert-parallel MoE's capacity drops, mean over layers
    metrics["moe_dropped_fraction"] = losses.mean_dropped_fraction(out)
  for d, m in enumerate(mtp, start=1):
    metrics[f"mtp{d}_loss"] = m["ce"]
    metrics[f"mtp{d}_accuracy"] = m["accuracy"]
  if shares is not None:
    metrics = _scale_metrics(step_cfg, metrics, shares)
  total = metrics["loss"]
  if head_objective is not None:  # it stands in for the head terms, which have no gradient
    heads_removed = {**metrics, "lm_loss": 0.0, "z_loss": 0.0, "mtp_loss": 0.0}
    total = total_loss(step_cfg, heads_removed) + head_objective
  if ways == 1:
    predictions_BL = losses.to_tokens(
        jnp.argmax(out["logits"][:, :-1], axis=-1).astype(jnp.int32), -1)
    token_nll_BL = -losses.token_logprobs(out["logits"], batch["tokens"])[0]
  else:  # per slot, then back in sequence order ([B, L] ids and floats, not the logits)
    targets_BL, _ = losses.slot_targets(batch, 1, ways)
    logp_BL = jnp.take_along_axis(jax.nn.log_softmax(out["logits"].astype(jnp.float32)),
                                  targets_BL[..., None], axis=-1)[..., 0]
    guess_BL = jnp.argmax(out["logits"], axis=-1).astype(jnp.int32)
    in_order = lambda x_BL: context_parallel.unstripe(x_BL, ways)[:, :-1]
    predictions_BL = losses.to_tokens(in_order(guess_BL), -1)
    token_nll_BL = -losses.to_tokens(in_order(logp_BL), 0.0)
  return total, (metrics, losses.expert_counts(out), predictions_BL, token_nll_BL)


def _head_losses(step_cfg: StepConfig, out, batch, ways: int, shares):
  """`(lm, mtp, head_objective)`: the main head's and each scored MTP depth's `cross_entropy`
  dicts (`compute_loss`'s args), and with `ce_grad_in_forward` the differentiable objective
  that stands in for them (`losses.head_losses_with_gradients`; each head weighted as
  `total_loss` weighs its CE, times its share of the batch's denominator), else None."""
  if not step_cfg.ce_grad_in_forward:
    lm = losses.lm_losses(out, batch, z_loss_weight=step_cfg.z_loss_weight, ways=ways,
                          chunk=step_cfg.ce_chunk)
    return lm, losses.mtp_losses(out, batch, ways=ways, chunk=step_cfg.ce_chunk), None
  depths = losses.scored_mtp_depths(out, batch, fused=True)
  lm_share, mtp_shares = (1.0, [1.0] * depths) if shares is None else (shares["lm"],
                                                                       shares["mtp"])
  coefficients = [lm_share] + [step_cfg.mtp_loss_weight / depths * s for s in mtp_shares]
  objective, (lm, *mtp) = losses.head_losses_with_gradients(
      out, batch, coefficients, step_cfg.z_loss_weight, ways=ways, chunk=step_cfg.ce_chunk)
  return lm, mtp, objective


def total_loss(step_cfg: StepConfig, metrics):
  """The weighted sum of the loss terms in `metrics` (see the module docstring); linear in
  them, which gradient accumulation relies on."""
  return (metrics["lm_loss"] + step_cfg.z_loss_weight * metrics["z_loss"]
          + step_cfg.mtp_loss_weight * metrics["mtp_loss"]
          + step_cfg.indexer_loss_weight * metrics["indexer_kl"]
          + step_cfg.sequence_balance_weight * metrics["sequence_balance_loss"])


def update_balance_bias(params, counts: dict, rate: float):
  """Loss-free balancing: raise the bias of under-loaded experts, lower it for over-loaded.

  Args:
    params: nested param dict (not modified).
    counts: `{path to an MoE block: tokens routed to each expert [E]}` (`[layers, E]` for a
      scanned run's stacked block: each layer balances its own experts).
  Returns:
    new params, the correction biases of the blocks in `counts` moved.
  """
  flat = traverse_util.flatten_dict(params, keep_empty_nodes=True)
  for path, counts_E in counts.items():
    key = tuple(path) + ("e_score_correction_bias",)
    load = counts_E.astype(jnp.float32)
    flat[key] = flat[key] + rate * jnp.sign(load.mean(-1, keepdims=True) - load).astype(flat[key].dtype)
  return traverse_util.unflatten_dict(flat)


def _expert_load_metrics(counts: dict):
  if not counts:
    return {}
  ratios = [c.astype(jnp.float32) / jnp.maximum(c.astype(jnp.float32).mean(-1, keepdims=True),
                                                1e-9)
            for c in counts.values()]
  return {"expert_load_max": jnp.max(jnp.stack([r.max() for r in ratios])),
          "expert_load_min": jnp.min(jnp.stack([r.min() for r in ratios]))}


def loss_and_grads(model: ModelConfig, step_cfg: StepConfig, params, batch):
  """`(metrics, expert_counts, grads)` of `compute_loss` on `batch`, in one pass or, with
  `step_cfg.microbatches` > 1, accumulated over that many microbatches in a `lax.scan`, so only
  one microbatch's activations are live at a time.

  Accumulation equals one pass over the whole batch, to float rounding, for the loss, every
  metric (accuracies, per-depth MTP losses and accuracies, indexer KL, balance loss, target
  tokens) and the gradients; expert counts (integers) are exactly equal. Every loss term is a
  mean over the batch (of target tokens, non-padding queries or rows), and microbatches can hold
  different numbers of them (padding, loss masks), so a mean of the microbatches' means would be
  wrong: each microbatch's means are scaled by its share of the whole batch's denominator
  (`losses.loss_denominators`) before its gradient is taken, which makes the scaled terms, the
  loss and its gradient add up to the whole batch's. Gradients accumulate in float32 and come
  back in each parameter's dtype (exact for float32 params).
  """
  if step_cfg.microbatches == 1:
    grad_fn = jax.value_and_grad(compute_loss, argnums=2, has_aux=True)
    (_, (metrics, counts, _, _)), grads = grad_fn(model, step_cfg, params, batch)
    return _measured(model, step_cfg, metrics, batch), counts, grads

  mtp_depths = model.mtp_depths if model.num_nextn_predict_layers else 0
  whole = losses.loss_denominators(batch, mtp_depths)

  def scaled_loss(params, microbatch):
    shares = jax.tree.map(jnp.divide, losses.loss_denominators(microbatch, mtp_depths), whole)
    total, (metrics, counts, _, _) = compute_loss(model, step_cfg, params, microbatch, shares)
    return total, (metrics, counts)

  grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

  def accumulate(sums, microbatch):
    # The scope marks the loop's ops apart from the optimizer's own loops (both are
    # `while/body/closed_call/` in op_name), for the planner's categories (`planning.op_costs`).
    with jax.named_scope(MICROBATCH_SCOPE):
      (_, aux), grads = grad_fn(params, microbatch)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return jax.tree.map(jnp.add, sums, (grads, aux)), None

  microbatches = split_microbatches(batch, step_cfg.microbatches)
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), microbatches)
  (_, aux_shapes), _ = jax.eval_shape(grad_fn, params, one)
  zeros = (jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
           jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shapes))
  (grads, (metrics, counts)), _ = jax.lax.scan(accumulate, zeros, microbatches)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  return _measured(model, step_cfg, metrics, batch), counts, grads


def _measured(model: ModelConfig, step_cfg: StepConfig, metrics, batch):
  """`metrics` of a differentiated step less `indexer_kl` where its value was not computed: the
  sparse stage on kernels whose KL target comes from the attention's backward
  (`mla.kl_target_in_backward`) returns a KL of 0 in the forward, with the true gradient, so
  `loss` there holds no indexer term either. Eval steps (forward only) report it."""
  if (step_cfg.dsa_stage == "sparse"
      and mla.kl_target_in_backward(model, seq_len=batch["tokens"].shape[-1])):
    return {k: v for k, v in metrics.items() if k != "indexer_kl"}
  return metrics


def split_microbatches(batch, microbatches: int):
  """`[B, ...]` arrays -> `[microbatches, B / microbatches, ...]`; microbatch k holds rows
  k, k + microbatches, k + 2 * microbatches, ...

  Strided, not contiguous, because the batch's rows are sharded in contiguous blocks over the
  data-parallel devices: with B a multiple of microbatches times those devices (checked by
  `validate_config`), each device's block holds its equal share of every microbatch, so the
  split moves no data between devices and every microbatch keeps all of them busy. A contiguous
  split would put each microbatch on 1/microbatches of the devices. The constraint keeps the
  per-microbatch batch axis on the data-parallel axes (and the scanned axis unsharded) where
  sharding propagation could otherwise pick another layout.
  """
  rows = {x.shape[0] for x in jax.tree.leaves(batch)}
  require(len(rows) == 1 and rows.pop() % microbatches == 0, "train.microbatches",
          f"the batch's {[x.shape[0] for x in jax.tree.leaves(batch)]} rows do not split into "
          f"{microbatches} equal microbatches")

  def split(x):
    x = jnp.swapaxes(x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]), 0, 1)
    return constrain(x, (None, BATCH) + (None,) * (x.ndim - 2))

  return jax.tree.map(split, batch)


def _scale_metrics(step_cfg: StepConfig, metrics, shares):
  """One microbatch's `compute_loss` metrics, each scaled by the microbatch's share of its
  denominator (`shares`: `losses.loss_denominators` of the microbatch over the whole batch's),
  so that they sum over microbatches to the whole batch's; `mtp_loss` and `loss` recomputed from
  the scaled terms (a mean over depths and a weighted sum, both linear)."""
  depths = sorted(int(m[1]) for m in map(re.compile(r"mtp(\d+)_loss").fullmatch, metrics) if m)
  if depths != list(range(1, len(shares["mtp"]) + 1)):
    raise ValueError(f"compute_loss scored MTP depths {depths}, but losses.loss_denominators "
                     f"counted {len(shares['mtp'])}")
  scaled = {}
  for name, value in metrics.items():
    depth = re.fullmatch(r"mtp(\d+)_(loss|accuracy)", name)
    if name in ("loss", "mtp_loss"):
      continue
    elif name in ("lm_loss", "z_loss", "accuracy"):
      share = shares["lm"]
    elif depth:
      share = shares["mtp"][int(depth[1]) - 1]
    elif name == "indexer_kl":
      share = shares["indexer"]
    elif name in ("sequence_balance_loss", "moe_dropped_fraction"):
      share = shares["rows"]
    elif name == "target_tokens":
      share = 1.0  # a count, it simply adds up
    else:
      raise ValueError(f"metric {name!r} of compute_loss has no rule for adding up over "
                       "microbatches; give it one in glm5_jax.train.step._scale_metrics")
    scaled[name] = value * share
  mtp = [scaled[f"mtp{d}_loss"] for d in depths]
  scaled["mtp_loss"] = jnp.mean(jnp.stack(mtp)) if mtp else jnp.zeros(())
  return {"loss": total_loss(step_cfg, scaled), **scaled}


def apply_gradients(state: TrainState, grads, counts, metrics, optimizer, schedule,
                    balance_rate: float | None):
  """The optimizer update, then loss-free balancing of the router biases by `balance_rate`
  (None: the biases stay), with the step's norms, learning rate and expert loads added to
  `metrics`. Shared by pre-training and RL (`glm5_jax.posttrain.rl_step`)."""
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  if balance_rate is not None:
    params = update_balance_bias(params, counts, balance_rate)
  metrics = {**metrics, **_expert_load_metrics(counts),
             "grad_norm": optax.tree.norm(grads),
             "update_norm": optax.tree.norm(updates),
             "param_norm": optax.tree.norm(params),
             "learning_rate": schedule(state.step)}
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_train_step(model: ModelConfig, step_cfg: StepConfig, optimizer, schedule):
  """`train_step(state, batch) -> (state, metrics)`, pure; jit it with shardings."""

  def train_step(state: TrainState, batch):
    metrics, counts, grads = loss_and_grads(model, step_cfg, state.params, batch)
    balance_rate = step_cfg.balance_bias_rate if step_cfg.trains_main_model else None
    return apply_gradients(state, grads, counts, metrics, optimizer, schedule, balance_rate)

  return train_step


def make_eval_step(model: ModelConfig, step_cfg: StepConfig):
  """`eval_step(params, batch) -> (metrics, predictions_BL, token_nll_BL)` (see
  `compute_loss`); host code scores per-source loss and exact match per example."""

  def eval_step(params, batch):
    _, (metrics, _, predictions_BL, token_nll_BL) = compute_loss(model, step_cfg, params, batch)
    return metrics, predictions_BL, token_nll_BL

  return eval_step

