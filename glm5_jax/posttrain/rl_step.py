"""The jitted RL train step: token log-probs of a rollout batch, the policy loss (by name from
`glm5_jax.posttrain.algorithms.POLICY_LOSSES`), the
optimizer, loss-free balancing; and the teacher's log-probs for on-policy distillation.

A rollout batch (numpy or device arrays, all `[B, L]`; position i is token i):
  tokens        int32    prompt + response, padded
  positions     int32
  segment_ids   int32    1 real, 0 padding
  loss_mask     float32  1 on generated tokens only (prompts, tool observations, padding: 0);
                         position 0 never (no logits score the first token)
  rollout_logp  float32  the engine's raw (temperature 1) log-prob of token i; 0 off the mask
  advantages    float32  per token (GRPO broadcasts a sample's advantage over its tokens)
  old_logp      float32  optional: the pre-update policy's log-probs, for several updates on one
                         batch; without it old_logp = stopgrad(logp) (one update per batch)
  ref_logp      float32  optional (`rl.kl_coef` > 0): the reference (starting) policy's
                         log-probs; 0 off the mask
  routing_moe   int32    optional `[B, L, N_moe, X]`, with `routing_dsa` `[B, L, N_dsa, T]`:
                         the rollout's routing, replayed by the forward (`rl.routing_replay`,
                         `glm5_jax.routing_replay`; -1 rows are not replayed)
`check_rl_batch` checks one on the host.

What the step trains (docs/reference.md section 4): the policy loss alone, by default. The
MTP head and the DSA indexers are frozen (`rl_trainable_mask`): GRPO's objective has no
auxiliary terms, an O(1) supervised loss at pre-training weight would swamp an advantage-
weighted gradient that is zero-mean per group, and an IcePop-masked token would still get a
gradient through it. Frozen, not merely loss-free: Muon's decoupled weight decay would
otherwise shrink weights no loss holds in place. The indexer's top-k is not differentiable (its
inputs are stop-gradiented), so the policy loss never reaches it anyway. `rl.kl_coef` > 0 adds
GRPO's KL penalty to the reference policy (the one RL started from: DeepSeekMath's k3
estimator per loss token, `kl_coef` x its token mean), which bounds how far noise alone can walk
the policy; GLM-5 trains without it (0, the `rl_config` default). `rl.mtp_loss_weight`
> 0 keeps the MTP head trained (its depths' cross-entropy on the response tokens, the same
mask), since speculative rollouts need a head that predicts the current policy.

The router's correction bias keeps moving after each update as in pre-training
(`glm5_jax.train.step.update_balance_bias`, rate `train.balance_bias_rate`): the policy shifts
which experts its tokens need, and a stale bias would let the load drift out of balance.

Notation (docs/design.md): B batch, L sequence, Y vocab.
"""

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from glm5_jax import optim, routing_replay
from glm5_jax.api import abstract_params_and_axes, check_token_ids, forward
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig, require, require_model_config
from glm5_jax.posttrain import algorithms, learning_signal
from glm5_jax.posttrain.config import resolve_policy_loss
from glm5_jax.sharding import batch_sharding, make_mesh, param_shardings, state_shardings
from glm5_jax.train import losses
from glm5_jax.train.state import TrainState
from glm5_jax.train.step import apply_gradients, split_microbatches

BATCH_KEYS = ("tokens", "positions", "segment_ids", "loss_mask", "rollout_logp", "advantages")
OPTIONAL_KEYS = ("old_logp", "ref_logp")
ROUTING_KEYS = tuple(f"routing_{kind}" for kind in routing_replay.KINDS)


def batch_routing(batch) -> dict | None:
  """The routing to replay from a batch's `routing_*` entries, or None (no replay)."""
  routing = {kind: batch[f"routing_{kind}"] for kind in routing_replay.KINDS
             if f"routing_{kind}" in batch}
  return routing or None


@dataclasses.dataclass(frozen=True)
class RLStepConfig:
  """The fields the RL step needs (hashable, static under jit), from `rl` and `train`."""

  eps_low: float = 0.2
  eps_high: float = 0.28
  icepop_beta: float = 2.0
  icepop: str = "weight"  # kept tokens weighted by k ("weight") or only masked ("mask")
  loss_normalization: str = "token"  # "token" or "sample" (`algorithms.loss_weights`)
  mtp_loss_weight: float = 0.0
  dsa_stage: str = "sparse"  # how DSA layers attend: as the engine does ("sparse"), or "dense"
  balance_bias_rate: float = 1e-3
  microbatches: int = 1  # gradient accumulation (`rl_loss_and_grads`)
  policy_loss: str = "ppo"  # a name of `algorithms.POLICY_LOSSES`: "ppo" or "is"
  kl_coef: float = 0.0  # > 0: the batch carries `ref_logp` and the loss its KL penalty

  @classmethod
  def from_config(cls, config, *, asynchronous: bool = False) -> "RLStepConfig":
    """From the experiment config's `rl` and `train` sections (validated); `asynchronous`
    resolves `rl.policy_loss="auto"` (`posttrain.config.resolve_policy_loss`)."""
    require(config.train.dsa_stage != "warmup", "train.dsa_stage",
            "the warm-up stage trains only the indexers; RL needs 'sparse' (as the engine "
            "attends) or 'dense'")
    rl = config.rl
    return cls(eps_low=rl.eps_low, eps_high=rl.eps_high, icepop_beta=rl.icepop_beta,
               icepop=rl.icepop, loss_normalization=rl.loss_normalization,
               mtp_loss_weight=rl.mtp_loss_weight, dsa_stage=config.train.dsa_stage,
               balance_bias_rate=config.train.balance_bias_rate,
               microbatches=config.train.microbatches,
               policy_loss=resolve_policy_loss(rl, asynchronous), kl_coef=rl.kl_coef)


def policy_logprobs(model: ModelConfig, params, batch, *, dsa_stage: str = "sparse"):
  """Token log-probs `[B, L]` of `batch["tokens"]` under `params` (`losses.token_logprobs`:
  entry i is token i's)."""
  out = forward(model, params, batch["tokens"], batch["positions"], batch["segment_ids"],
                mode=Mode(dsa_stage=dsa_stage), mtp=False, routing=batch_routing(batch))
  return losses.token_logprobs(out["logits"], batch["tokens"])[0]


@functools.partial(jax.jit, static_argnums=0)
def _teacher_logp(teacher_cfg: ModelConfig, teacher_params, tokens_BL, positions_BL,
                  segment_ids_BL):
  batch = {"tokens": tokens_BL, "positions": positions_BL, "segment_ids": segment_ids_BL}
  return policy_logprobs(teacher_cfg, teacher_params, batch)


def teacher_logp(teacher_cfg: ModelConfig, teacher_params, batch):
  """The teacher's log-prob `[B, L]` float32 of each token of a rollout batch (jitted; one
  compilation per teacher config and batch shape), attending as the engine does ("sparse").

  On-policy distillation (docs/reference.md section 4) then takes
  `algorithms.distill_advantages(teacher_logp(...), batch["rollout_logp"])` as the batch's
  advantages:
  the student's log-probs are those it sampled with (token in, token out; no extra forward).
  The teacher must share the student's tokenizer; an id outside its vocabulary is an error.
  """
  check_token_ids(batch["tokens"], teacher_cfg.vocab_size)
  return _teacher_logp(teacher_cfg, teacher_params, batch["tokens"], batch["positions"],
                       batch["segment_ids"])


def rl_loss(model: ModelConfig, step_cfg: RLStepConfig, params, batch, whole=None):
  """`(loss, (metrics, expert_counts))` of one rollout batch: `algorithms.ppo_policy_loss` (PPO +
  IcePop) or, with `step_cfg.policy_loss="is"`, `algorithms.is_policy_loss` (the double-sided
  IS mask against the rollout log-probs: asynchronous RL), + `mtp_loss_weight` x the mean MTP
  cross-entropy on the response tokens.

  `whole` (`rl_denominators` of a larger batch) makes this one microbatch of it: every mean is
  divided by the whole batch's denominators, so the microbatches' losses, gradients and
  metrics add up to the batch's (`rl_loss_and_grads`)."""
  train_mtp = step_cfg.mtp_loss_weight > 0
  out = forward(model, params, batch["tokens"], batch["positions"], batch["segment_ids"],
                mode=Mode(dsa_stage=step_cfg.dsa_stage), mtp=train_mtp,
                routing=batch_routing(batch))
  logp_BL, entropy_BL = losses.token_logprobs(out["logits"], batch["tokens"])
  old_logp_BL = batch.get("old_logp", jax.lax.stop_gradient(logp_BL))
  mask_BL = batch["loss_mask"].astype(jnp.float32)
  mask_batch = {**batch, "loss_mask": mask_BL}
  own = rl_denominators(model, step_cfg, mask_batch)
  whole = own if whole is None else whole
  tokens = whole["tokens"]
  common = dict(eps_low=step_cfg.eps_low, eps_high=step_cfg.eps_high,
                normalization=step_cfg.loss_normalization,
                denominators={"tokens": tokens, "samples": whole["samples"]})
  loss_fn = algorithms.POLICY_LOSSES[step_cfg.policy_loss]
  if step_cfg.policy_loss == "is":
    policy, metrics = loss_fn(logp_BL, batch["rollout_logp"], batch["advantages"], mask_BL,
                              **common)
  else:
    policy, metrics = loss_fn(logp_BL, old_logp_BL, batch["rollout_logp"], batch["advantages"],
                              mask_BL, icepop_beta=step_cfg.icepop_beta, icepop=step_cfg.icepop,
                              **common)
  advantages_BL = batch["advantages"].astype(jnp.float32)
  metrics = {**metrics, "policy_loss": policy,
             "entropy": (entropy_BL * mask_BL).sum() / tokens,
             "advantage_mean": (advantages_BL * mask_BL).sum() / tokens,
             "advantage_abs_mean": (jnp.abs(advantages_BL) * mask_BL).sum() / tokens}
  total = policy
  if step_cfg.kl_coef > 0:
    kl = (learning_signal.k3_kl(logp_BL, batch["ref_logp"], mask_BL, xp=jnp)
          * mask_BL).sum() / tokens
    total = total + step_cfg.kl_coef * kl
    metrics["kl_penalty"] = kl
  if train_mtp:
    depths = losses.mtp_losses(out, mask_batch)
    if depths:
      # `cross_entropy` divides by this batch's targets of each depth; rescale to the whole's
      shares = [a / b for a, b in zip(own["mtp"], whole["mtp"])]
      mtp_loss = jnp.mean(jnp.stack([d["ce"] * w for d, w in zip(depths, shares)]))
      total = total + step_cfg.mtp_loss_weight * mtp_loss
      metrics["mtp_loss"] = mtp_loss
      for d, (m, w) in enumerate(zip(depths, shares), start=1):
        metrics[f"mtp{d}_accuracy"] = m["accuracy"] * w
  metrics["loss"] = total
  return total, (metrics, losses.expert_counts(out))


def rl_denominators(model: ModelConfig, step_cfg: RLStepConfig, batch) -> dict:
  """What `rl_loss`'s means divide by for `batch`: `tokens` (its loss tokens, at least 1),
  `samples` (its rows with a loss token, at least 1; `algorithms.batch_denominators`) and `mtp`
  (each trained MTP depth's targets, `losses.loss_denominators`)."""
  depths = model.mtp_depths if step_cfg.mtp_loss_weight > 0 and model.num_nextn_predict_layers \
      else 0
  mask_BL = batch["loss_mask"].astype(jnp.float32)
  return {**algorithms.batch_denominators(mask_BL),
          "mtp": losses.loss_denominators({**batch, "loss_mask": mask_BL}, depths)["mtp"]}


def rl_loss_and_grads(model: ModelConfig, step_cfg: RLStepConfig, params, batch):
  """`(metrics, expert_counts, grads)` of `rl_loss` on `batch`: in one pass or, with
  `step_cfg.microbatches` = k > 1 (`train.microbatches`), accumulated over k strided
  microbatches (`glm5_jax.train.step.split_microbatches`) in a `lax.scan`, so only one
  microbatch's activations (and its `[B/k, L, Y]` float32 log-softmax) are live at a time.

  Accumulation equals one pass to float rounding: each microbatch divides by the whole batch's
  denominators (`rl_loss`'s `whole`), so losses, gradients and means add up; the maxima
  (`logp_mismatch_max`) take the max; `ratio_mean`, a mean over IcePop's kept tokens, is
  carried as a sum and divided by the total kept once; expert counts add exactly.
  """
  grad_fn = jax.value_and_grad(rl_loss, argnums=2, has_aux=True)
  if step_cfg.microbatches == 1:
    (_, (metrics, counts)), grads = grad_fn(model, step_cfg, params, batch)
    return metrics, counts, grads

  whole = rl_denominators(model, step_cfg, batch)

  def one(microbatch):
    (_, (metrics, counts)), grads = grad_fn(model, step_cfg, params, microbatch, whole)
    metrics = {**metrics, "ratio_mean": metrics["ratio_mean"] * metrics["kept_tokens"]}
    return jax.tree.map(lambda g: g.astype(jnp.float32), grads), metrics, counts

  def accumulate(sums, microbatch):
    grads, metrics, counts = one(microbatch)
    sum_grads, sum_metrics, sum_counts = sums
    sum_metrics = {k: (jnp.maximum(sum_metrics[k], v) if k == "logp_mismatch_max"
                       else sum_metrics[k] + v) for k, v in metrics.items()}
    return (jax.tree.map(jnp.add, sum_grads, grads), sum_metrics,
            jax.tree.map(jnp.add, sum_counts, counts)), None

  microbatches = split_microbatches(batch, step_cfg.microbatches)
  first = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), microbatches)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(one, first))
  (grads, metrics, counts), _ = jax.lax.scan(accumulate, zeros, microbatches)
  metrics["ratio_mean"] = metrics["ratio_mean"] / jnp.maximum(metrics["kept_tokens"], 1.0)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  return metrics, counts, grads


def rl_trainable_mask(params, *, train_mtp: bool):
  """Bool tree like `params`: False on every DSA indexer, and on the MTP layer unless
  `train_mtp` (the module docstring says why). The shared embedding and output head train."""
  return traverse_util.path_aware_map(
      lambda path, _: "indexer" not in path and (train_mtp or path[0] != "mtp"), params)


def build_rl_optimizer(config, params):
  """`(optimizer, schedule)` of `glm5_jax.optim.build_optimizer` from `config.optim`, over
  `rl.steps` x `rl.minibatches` updates (its warm-up counts updates too), with
  `rl_trainable_mask` frozen. `params` may be ShapeDtypeStructs."""
  updates = config.rl.steps * config.rl.minibatches
  require(config.optim.warmup_steps <= updates, "optim.warmup_steps",
          f"{config.optim.warmup_steps} warm-up updates do not fit in rl.steps x "
          f"rl.minibatches = {updates}")
  trainable = rl_trainable_mask(params, train_mtp=config.rl.mtp_loss_weight > 0)
  return optim.build_optimizer(config.optim, params, total_steps=updates, trainable=trainable)


def init_rl_state(params, optimizer, *, seed: int = 0) -> TrainState:
  """A fresh `TrainState` at step 0 for RL from `params` (e.g. an SFT checkpoint's): the
  optimizer state starts anew (the RL optimizer freezes other leaves than pre-training's)."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params),
                    rng=jax.random.key_data(jax.random.key(seed)))


def rl_shardings(config, model: ModelConfig, optimizer, mesh: jax.sharding.Mesh):
  """`(state_sharding, batch_sharding)` for `make_rl_train_step` on `mesh`, as pre-training
  shards its state: params by `config.mesh.logical_axis_rules`, every optimizer moment like its
  param (`glm5_jax.sharding.state_shardings`), batch rows over the data-parallel axes. Place
  the initial state with `jax.device_put(state, state_sharding)` (the step's outputs are placed
  so, and an unplaced first state would compile the step twice) and call the step inside
  `glm5_jax.sharding.activation_sharding(mesh, rules)` so the model's activation constraints
  apply."""
  rules = config.mesh.logical_axis_rules
  shapes, logical_axes = abstract_params_and_axes(require_model_config(model, "rl_shardings"))
  abstract = jax.eval_shape(lambda p: init_rl_state(p, optimizer), shapes)
  return (state_shardings(abstract, param_shardings(shapes, logical_axes, mesh, rules), mesh),
          batch_sharding(mesh, rules))


def make_rl_train_step(config, model: ModelConfig, optimizer, schedule, *, state_sharding=None,
                       batch_sharding=None, asynchronous: bool = False):
  """The jitted `rl_train_step(state, batch) -> (state, metrics)`; donates `state`.

  Args:
    config: the experiment config (validated): `rl` (clip range, IcePop, normalization, MTP
      weight) and `train` (`dsa_stage`, `balance_bias_rate`).
    model: the run's `ModelConfig` (built once, by the caller).
    optimizer, schedule: from `build_rl_optimizer` (schedule only for the logged rate).
    state_sharding, batch_sharding: from `rl_shardings` (the state's, and one for every
      `[B, L]` batch array); None leaves placement to jit (one device).
  Returns:
    the jitted step; metrics are `rl_loss`'s, expert load, grad / update / param norms and the
    learning rate.
  """
  require_model_config(model, "make_rl_train_step")
  step_cfg = RLStepConfig.from_config(config, asynchronous=asynchronous)

  def rl_train_step(state: TrainState, batch):
    metrics, counts, grads = rl_loss_and_grads(model, step_cfg, state.params, batch)
    return apply_gradients(state, grads, counts, metrics, optimizer, schedule,
                           step_cfg.balance_bias_rate)

  if state_sharding is None:
    return jax.jit(rl_train_step, donate_argnums=0)
  return jax.jit(rl_train_step, in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, None), donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class RLTrainer:
  """What an RL run needs to train, built once per run by `build_rl_trainer`."""
  model: ModelConfig  # the run's, converted once (`posttrain.rl_run.build_rl_run`)
  optimizer: Any
  mesh: jax.sharding.Mesh
  state_sharding: Any
  batch_sharding: Any
  train_step: Callable  # jitted (state, batch) -> (state, metrics), donates state
  init_state: Callable  # jitted params -> TrainState at step 0, placed by state_sharding
  policy_logp: Callable  # jitted (params, batch) -> logp_BL (`policy_logprobs`)


def build_rl_trainer(config, model: ModelConfig, shapes, *,
                     asynchronous: bool = False) -> RLTrainer:
  """The optimizer, mesh, shardings and jitted steps of an RL run from its (validated) config,
  its `ModelConfig` and the params' `shapes` (`glm5_jax.api.abstract_params`), as
  `glm5_jax.train.trainer.build_trainer` does for pre-training. Built per run, not cached: a
  second run in the same process traces again and finds the compiled executables in jax's
  persistent compilation cache when one is configured (the tests configure one)."""
  optimizer, schedule = build_rl_optimizer(config, shapes)
  mesh = make_mesh(config.mesh)
  state_sharding, batch_sharding = rl_shardings(config, model, optimizer, mesh)
  train_step = make_rl_train_step(config, model, optimizer, schedule, state_sharding=state_sharding,
                                  batch_sharding=batch_sharding, asynchronous=asynchronous)
  init_state = jax.jit(functools.partial(init_rl_state, optimizer=optimizer, seed=config.rl.seed),
                       out_shardings=state_sharding)
  logp = functools.partial(policy_logprobs, model, dsa_stage=config.train.dsa_stage)
  policy_logp = jax.jit(lambda params, batch: logp(params, batch),
                        in_shardings=(state_sharding.params, batch_sharding))
  return RLTrainer(model, optimizer, mesh, state_sharding, batch_sharding, train_step,
                   init_state, policy_logp)


def check_rl_batch(batch, *, vocab_size: int | None = None) -> None:
  """Raises ValueError naming the key if a host (numpy) rollout batch breaks the convention in
  the module docstring: keys, `[B, L]` shapes, dtypes, a loss mask of 0/1 on real tokens only
  and never at position 0, finite log-probs <= 0 that are 0 off the mask, finite advantages,
  token ids inside `vocab_size` (when given)."""
  missing = [k for k in BATCH_KEYS if k not in batch]
  unknown = sorted(set(batch) - set(BATCH_KEYS) - set(OPTIONAL_KEYS) - set(ROUTING_KEYS))
  if missing or unknown:
    raise ValueError(f"rollout batch: missing keys {missing}, unknown keys {unknown}; expected "
                     f"{BATCH_KEYS} (+ optional {OPTIONAL_KEYS})")
  arrays = {k: np.asarray(v) for k, v in batch.items()}
  shape = arrays["tokens"].shape
  for key in ROUTING_KEYS:
    x = arrays.pop(key, None)
    if x is not None and (x.ndim != 4 or x.shape[:2] != shape
                          or not np.issubdtype(x.dtype, np.integer)):
      raise ValueError(f"rollout batch[{key!r}]: shape {x.shape} dtype {x.dtype}, expected int32 "
                       f"[B, L, layers, k] with [B, L] = {shape}")
  for key, x in arrays.items():
    if x.shape != shape or x.ndim != 2:
      raise ValueError(f"rollout batch[{key!r}]: shape {x.shape}, expected [B, L] = {shape}")
    want_int = key in ("tokens", "positions", "segment_ids")
    if want_int != np.issubdtype(x.dtype, np.integer):
      raise ValueError(f"rollout batch[{key!r}]: dtype {x.dtype}, expected "
                       f"{'int32' if want_int else 'float32'}")
  mask = arrays["loss_mask"]
  if not np.isin(mask, (0.0, 1.0)).all():
    raise ValueError("rollout batch['loss_mask']: values must be 0 or 1")
  if mask[:, 0].any():
    raise ValueError("rollout batch['loss_mask']: position 0 is a loss token, but no logits "
                     "score the first token of a row")
  if (mask.astype(bool) & (arrays["segment_ids"] == 0)).any():
    raise ValueError("rollout batch['loss_mask']: 1 on padding (segment_ids 0)")
  for key in ("rollout_logp", "old_logp", "ref_logp"):
    if key in arrays:
      logp = arrays[key]
      on = mask.astype(bool)
      if not (np.isfinite(logp).all() and (logp[on] <= 0).all()):
        raise ValueError(f"rollout batch[{key!r}]: log-probs must be finite and <= 0")
      if key == "rollout_logp" and (logp[~on] != 0).any():
        raise ValueError("rollout batch['rollout_logp']: must be 0 where loss_mask is 0")
  if not np.isfinite(arrays["advantages"]).all():
    raise ValueError("rollout batch['advantages']: must be finite")
  if vocab_size is not None:
    check_token_ids(arrays["tokens"], vocab_size)
