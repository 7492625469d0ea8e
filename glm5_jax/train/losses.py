"""Training losses: next-token cross-entropy (+ z-loss), MTP depths, DSA indexer KL, balance.

Batch convention (from `glm5_jax.data`): `tokens`, `segment_ids` (0 = padding), `positions`,
`loss_mask` (1 where a token is a training target). Position i's main logits predict token i+1;
MTP depth d at position i predicts token i+d+1. A prediction counts only when its target is a
training target of the same document as position i (so nothing is predicted across packed
documents or from padding).

Per-token log-probs have one function and one alignment, `token_logprobs`: index i of a
`[B, L]` array is token i (its log-prob given tokens < i, from position i - 1's logits; index 0,
which nothing predicts, holds 0). The RL losses, the trainer's held-out scoring and the tools
all use it; `cross_entropy` is the fused training loss over `[B, L - offset]` position-aligned
slices (position i's logits against token i + offset), which never leave this module.

Notation (docs/design.md): B batch, L sequence, Y vocab.
"""

import jax
import jax.numpy as jnp

from glm5_jax.attention import context_parallel
from glm5_jax.train import fused_ce


def token_logprobs(logits_BLY, tokens_BL):
  """Log-prob and entropy of the main head's distribution for each token, float32, aligned to
  the tokens (module docstring).

  Position i's logits score token i + 1, so token i's entry comes from position i - 1; token 0
  has none and gets 0 (it is never a loss or a scored token).

  Returns:
    `(logp_BL, entropy_BL)`: `logp_BL[:, i] = log softmax(logits[:, i-1])[tokens[:, i]]`,
    `entropy_BL[:, i]` the entropy of that distribution (no gradient; a metric).
  """
  logprobs_BLY = jax.nn.log_softmax(logits_BLY[:, :-1].astype(jnp.float32), axis=-1)
  logp_BL = jnp.take_along_axis(logprobs_BLY, tokens_BL[:, 1:, None], axis=-1)[..., 0]
  probs_BLY = jax.lax.stop_gradient(jnp.exp(logprobs_BLY))
  entropy_BL = -(probs_BLY * jax.lax.stop_gradient(logprobs_BLY)).sum(-1)
  return to_tokens(logp_BL, 0.0), to_tokens(entropy_BL, 0.0)


def to_tokens(x_BL, fill):
  """A `[B, L - 1]` array of position i's prediction of token i + 1, re-indexed by token:
  `[B, L]`, column 0 (no prediction) holding `fill`."""
  return jnp.pad(x_BL, ((0, 0), (1, 0)), constant_values=fill)


def target_weights(segment_ids_BL, loss_mask_BL, offset: int):
  """Weights `[B, L - offset]` of predicting token i+offset at position i."""
  same_document = segment_ids_BL[:, offset:] == segment_ids_BL[:, :-offset]
  real = segment_ids_BL[:, offset:] != 0
  return loss_mask_BL[:, offset:] * (same_document & real)


def cross_entropy(logits_BLY, targets_BL, weights_BL, z_loss_weight: float = 0.0):
  """Weighted mean cross-entropy, z-loss and accuracy over the weighted positions.

  Returns:
    dict with `loss` (CE + z_loss_weight * mean(logsumexp^2)), `ce`, `z_loss`, `accuracy`,
    `weight` (number of counted positions).
  """
  logits_BLY = logits_BLY.astype(jnp.float32)
  log_z_BL = jax.nn.logsumexp(logits_BLY, axis=-1)
  target_logit_BL = jnp.take_along_axis(logits_BLY, targets_BL[..., None], axis=-1)[..., 0]
  correct_BL = jnp.argmax(logits_BLY, axis=-1) == targets_BL
  return _ce_terms(log_z_BL, target_logit_BL, correct_BL, weights_BL, z_loss_weight)


def fused_cross_entropy(h_BLD, w_DY, targets_BL, weights_BL, z_loss_weight: float = 0.0, *,
                        chunk: int):
  """`cross_entropy` of the logits `h_BLD @ w_DY`, which are never formed whole: the LM head
  and the loss's statistics run `chunk` positions at a time (`fused_ce.head_statistics`)."""
  log_z_BL, target_logit_BL, argmax_BL = fused_ce.head_statistics(h_BLD, w_DY, targets_BL, chunk)
  return _ce_terms(log_z_BL, target_logit_BL, argmax_BL == targets_BL, weights_BL, z_loss_weight)


def _ce_terms(log_z_BL, target_logit_BL, correct_BL, weights_BL, z_loss_weight: float):
  """`cross_entropy`'s dict from its per-position statistics (fp32 `[B, L]`)."""
  weight = weights_BL.sum()
  denominator = jnp.maximum(weight, 1.0)
  ce = ((log_z_BL - target_logit_BL) * weights_BL).sum() / denominator
  z_loss = (jnp.square(log_z_BL) * weights_BL).sum() / denominator
  accuracy = (correct_BL * weights_BL).sum() / denominator
  return {"loss": ce + z_loss_weight * z_loss, "ce": ce, "z_loss": z_loss,
          "accuracy": accuracy, "weight": weight}


def _scored(out, batch, index: int, ways: int, fused: bool):
  """`(x_BL_, targets_BL, weights_BL)` of head `index` (0: the main head, d: MTP depth d), which
  predicts token i + index + 1 at position i: `x` the head's input (`fused`, `GLM5`'s
  `head_inputs`) or its logits, in the positions that have a target. `ways` > 1: `out` is in
  the striped layout for that many context devices, `batch` in sequence order
  (`slot_targets`)."""
  name = "head_inputs" if fused else "logits"
  x_BL_ = out[name] if index == 0 else out[f"mtp_{name}"][index - 1]
  offset = index + 1
  if ways > 1:
    return (x_BL_, *slot_targets(batch, offset, ways))
  weights_BL = target_weights(batch["segment_ids"], batch["loss_mask"], offset)
  return x_BL_[:, :-offset], batch["tokens"][:, offset:], weights_BL


def scored_mtp_depths(out, batch, fused: bool) -> int:
  """How many MTP depths `mtp_losses` scores: those whose target offset fits in the sequence."""
  depths = len(out.get("mtp_head_inputs" if fused else "mtp_logits", ()))
  return min(depths, max(batch["tokens"].shape[1] - 2, 0))


def _head_loss(out, batch, index: int, z_loss_weight, ways: int, chunk: int):
  """`cross_entropy` of head `index` (`_scored`): from the logits, or with `chunk` > 0 fused
  from the head's input and kernel (`fused_cross_entropy`)."""
  x_BL_, targets_BL, weights_BL = _scored(out, batch, index, ways, fused=chunk > 0)
  if chunk:
    return fused_cross_entropy(x_BL_, out["head_kernel"], targets_BL, weights_BL,
                               z_loss_weight, chunk=chunk)
  return cross_entropy(x_BL_, targets_BL, weights_BL, z_loss_weight)


def slot_targets(batch, offset: int, ways: int):
  """`(targets_BL, weights_BL)` in the striped layout for `ways` context devices
  (`context_parallel.stripe`): for the slot holding sequence index i, token i + offset and
  `target_weights`' weight of predicting it (0 for the last `offset` indices, which have no
  target). `batch` is in sequence order."""
  pad = ((0, 0), (0, offset))
  targets_BL = jnp.pad(batch["tokens"][:, offset:], pad)
  weights_BL = jnp.pad(target_weights(batch["segment_ids"], batch["loss_mask"], offset), pad)
  return (context_parallel.stripe(targets_BL, ways), context_parallel.stripe(weights_BL, ways))


def lm_losses(out, batch, *, z_loss_weight=0.0, ways: int = 1, chunk: int = 0):
  """Main-head next-token loss. `ways` > 1: `out` is in the striped layout for that many
  context devices, `batch` in sequence order (`slot_targets`). `chunk` > 0: the fused,
  chunked head + loss (`fused_cross_entropy`, `train.ce_chunk`)."""
  return _head_loss(out, batch, 0, z_loss_weight, ways, chunk)


def mtp_losses(out, batch, *, ways: int = 1, chunk: int = 0):
  """Per-depth MTP losses: a list of `cross_entropy` dicts, depth 1 first (`ways`, `chunk`: as
  `lm_losses`)."""
  return [_head_loss(out, batch, d, 0.0, ways, chunk)
          for d in range(1, scored_mtp_depths(out, batch, fused=chunk > 0) + 1)]


def head_losses_with_gradients(out, batch, coefficients, z_loss_weight=0.0, *, ways: int = 1,
                               chunk: int):
  """The main head's and the MTP depths' losses in one fused pass that forms their gradients in
  the forward (`fused_ce.loss_with_gradients`, `train.ce_grad_in_forward`).

  Args:
    coefficients: the weight of each head's loss in the objective, the main head first, then
      one per scored MTP depth (`scored_mtp_depths`).
    z_loss_weight, ways, chunk: as `lm_losses` (the z-loss is the main head's).
  Returns:
    `(objective, results)`: `objective` = sum_k coefficients[k] * results[k]["loss"], an fp32
    scalar whose gradients in the head inputs and kernel were formed in the forward pass;
    `results` the `cross_entropy` dicts of `lm_losses` and `mtp_losses`, main head first,
    without gradient (metrics).
  """
  heads, weights = [], []
  for index, coefficient in enumerate(coefficients):
    h_BLD, targets_BL, weights_BL = _scored(out, batch, index, ways, fused=True)
    ce_weights_BL = weights_BL * (coefficient / jnp.maximum(weights_BL.sum(), 1.0))
    z_weights_BL = ce_weights_BL * (z_loss_weight if index == 0 else 0.0)
    heads.append((h_BLD, targets_BL, ce_weights_BL, z_weights_BL))
    weights.append(weights_BL)
  objective, statistics = fused_ce.loss_with_gradients(heads, out["head_kernel"], chunk)
  results = [_ce_terms(log_z_BL, target_logit_BL, argmax_BL == head[1], weights_BL,
                       z_loss_weight if index == 0 else 0.0)
             for index, ((log_z_BL, target_logit_BL, argmax_BL), head, weights_BL)
             in enumerate(zip(statistics, heads, weights))]
  return objective, results


def _all_layer_aux(out):
  """Every layer's aux: one dict per unrolled layer or MTP depth, one per scanned run (its
  entries stacked on a leading layers axis)."""
  return list(out["aux"]["layers"].values()) + list(out["aux"]["mtp"])


def _per_layer(out, name: str, rank: int):
  """`[layers]`: aux entry `name` of every layer that has it, each of `rank` dims per layer
  (a scanned run's entry has one more, leading), flattened to `[n, *shape]` and concatenated."""
  values = [aux[name] for aux in _all_layer_aux(out) if name in aux]
  return jnp.concatenate([v.reshape((-1,) + v.shape[v.ndim - rank:]) for v in values]
                         ) if values else None


def mean_indexer_kl(out, batch):
  """Mean indexer KL over DSA layers (main and MTP) and non-padding queries; 0 without any."""
  valid_BL = (batch["segment_ids"] != 0).astype(jnp.float32)
  kl_nBL = _per_layer(out, "indexer_kl", rank=2)
  if kl_nBL is None:
    return jnp.zeros((), jnp.float32)
  return jnp.mean((kl_nBL * valid_BL).sum((1, 2)) / jnp.maximum(valid_BL.sum(), 1.0))


def mean_sequence_balance_loss(out):
  """Mean over MoE layers (main and MTP) of the sequence-wise balance loss
  (`moe.sequence_balance_loss`, in each layer's aux); 0 without MoE."""
  losses_n = _per_layer(out, "sequence_balance_loss", rank=0)
  return jnp.zeros((), jnp.float32) if losses_n is None else jnp.mean(losses_n)


def mean_dropped_fraction(out):
  """Mean over MoE layers of the fraction of (token, expert) pairs the expert-parallel dispatch
  dropped for capacity (`model.moe_capacity_factor`); 0 without any. Each layer's aux holds it
  per token shard (`[shards]`): summed here, once a step, not in every layer."""
  dropped_nS = _per_layer(out, "moe_dropped_fraction", rank=1)
  return jnp.zeros((), jnp.float32) if dropped_nS is None else jnp.mean(dropped_nS.sum(-1))


def expert_counts(out):
  """`{path to the MoE block: counts [E]}` (`[layers, E]` for a scanned run, whose block holds
  the stacked biases; the MTP layer's counts summed over depths)."""
  counts = {(name, "mlp"): aux["expert_counts"]
            for name, aux in out["aux"]["layers"].items() if "expert_counts" in aux}
  mtp = [aux["expert_counts"] for aux in out["aux"]["mtp"] if "expert_counts" in aux]
  if mtp:
    counts[("mtp", "layer", "mlp")] = sum(mtp)
  return counts


def loss_denominators(batch, mtp_depths: int):
  """What the means above divide by for `batch`, each a float32 scalar, clamped as they clamp.

  Returns:
    dict: `lm` (`cross_entropy`'s target weight of the main head: its CE, z-loss and accuracy),
    `mtp` (a list, the same for each MTP depth `mtp_losses` scores), `indexer` (non-padding
    queries, `mean_indexer_kl`), `rows` (the sequence balance loss averages over rows).
  Gradient accumulation scales each microbatch's means by its share of the batch's denominators
  (`glm5_jax.train.step`), so these must stay in step with the functions above.
  """
  segment_ids_BL, loss_mask_BL = batch["segment_ids"], batch["loss_mask"]
  length = segment_ids_BL.shape[1]

  def clamped(weights_BL):
    return jnp.maximum(weights_BL.sum().astype(jnp.float32), 1.0)

  return {"lm": clamped(target_weights(segment_ids_BL, loss_mask_BL, 1)),
          "mtp": [clamped(target_weights(segment_ids_BL, loss_mask_BL, d + 1))
                  for d in range(1, mtp_depths + 1) if d + 1 < length],
          "indexer": clamped((segment_ids_BL != 0).astype(jnp.float32)),
          "rows": jnp.asarray(segment_ids_BL.shape[0], jnp.float32)}
