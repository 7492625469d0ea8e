"""One training step (loss, gradients, optimizer, loss-free balancing) and one eval step.

The total loss (docs/reference.md sections 2-3):
  lm_ce + z_loss_weight * z_loss
  + mtp_loss_weight * mean_d(mtp_ce_d)                 shared-parameter MTP depths
  + indexer_loss_weight * indexer_kl                   DSA warm-up / sparse stages
  + sequence_balance_weight * sequence_balance_loss    optional, DeepSeek-V3's small aux loss
After the optimizer update, each MoE layer's correction bias moves by a fixed rate toward equal
load: `b_e += rate * sign(mean_load - load_e)` (loss-free balancing), except in the DSA
warm-up stage, where everything but the indexers is frozen.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from glm5_jax.api import forward
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.train import losses
from glm5_jax.train.state import TrainState


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

  @classmethod
  def from_config(cls, train_config) -> "StepConfig":
    fields = {f.name: train_config[f.name] for f in dataclasses.fields(cls)
              if f.name != "trains_main_model"}
    return cls(**fields, trains_main_model=train_config.dsa_stage != "warmup")

  def dense_phase(self) -> "StepConfig":
    """The step of `train.dsa_dense_steps`: dense attention, indexers learning their KL."""
    return dataclasses.replace(self, dsa_stage="warmup", trains_main_model=True)


def compute_loss(model: ModelConfig, step_cfg: StepConfig, params, batch):
  """Returns `(total_loss, (metrics, expert_counts, predictions_BL, token_nll_BL))`:
  the main head's argmax and negative log-likelihood of token i+1 at position i (`[B, L-1]`,
  used by evaluation; training ignores them, so they are compiled away)."""
  out = forward(model, params, batch["tokens"], batch["positions"], batch["segment_ids"],
                mode=Mode(dsa_stage=step_cfg.dsa_stage))
  lm = losses.lm_losses(out, batch, z_loss_weight=step_cfg.z_loss_weight)
  mtp = losses.mtp_losses(out, batch)
  kl = losses.mean_indexer_kl(out, batch)
  balance = losses.mean_sequence_balance_loss(out)
  mtp_loss = jnp.mean(jnp.stack([m["ce"] for m in mtp])) if mtp else jnp.zeros(())
  total = (lm["loss"] + step_cfg.mtp_loss_weight * mtp_loss
           + step_cfg.indexer_loss_weight * kl + step_cfg.sequence_balance_weight * balance)
  metrics = {"loss": total, "lm_loss": lm["ce"], "z_loss": lm["z_loss"],
             "accuracy": lm["accuracy"], "target_tokens": lm["weight"], "mtp_loss": mtp_loss,
             "indexer_kl": kl, "sequence_balance_loss": balance}
  for d, m in enumerate(mtp, start=1):
    metrics[f"mtp{d}_loss"] = m["ce"]
    metrics[f"mtp{d}_accuracy"] = m["accuracy"]
  logits_BLY = out["logits"][:, :-1]
  predictions_BL = jnp.argmax(logits_BLY, axis=-1).astype(jnp.int32)
  token_nll_BL = -jnp.take_along_axis(jax.nn.log_softmax(logits_BLY, axis=-1),
                                      batch["tokens"][:, 1:, None], axis=-1)[..., 0]
  return total, (metrics, losses.expert_counts(out), predictions_BL, token_nll_BL)


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


def make_train_step(model: ModelConfig, step_cfg: StepConfig, optimizer, schedule):
  """`train_step(state, batch) -> (state, metrics)`, pure; jit it with shardings."""

  def train_step(state: TrainState, batch):
    grad_fn = jax.value_and_grad(compute_loss, argnums=2, has_aux=True)
    (_, (metrics, counts, _, _)), grads = grad_fn(model, step_cfg, state.params, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if step_cfg.trains_main_model:
      params = update_balance_bias(params, counts, step_cfg.balance_bias_rate)
    metrics = {**metrics, **_expert_load_metrics(counts),
               "grad_norm": optax.tree.norm(grads),
               "update_norm": optax.tree.norm(updates),
               "param_norm": optax.tree.norm(params),
               "learning_rate": schedule(state.step)}
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics

  return train_step


def make_eval_step(model: ModelConfig, step_cfg: StepConfig):
  """`eval_step(params, batch) -> (metrics, predictions_BL, token_nll_BL)` (see
  `compute_loss`); host code scores per-source loss and exact match per example."""

  def eval_step(params, batch):
    _, (metrics, _, predictions_BL, token_nll_BL) = compute_loss(model, step_cfg, params, batch)
    return metrics, predictions_BL, token_nll_BL

  return eval_step

