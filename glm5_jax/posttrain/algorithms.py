"""Every policy loss and advantage of RL, in one place behind name registries (docs/reference.md
section 4). Two losses side by side make their differences visible.

Advantages (`ADVANTAGES`):
  "grpo"     group_advantages    A_n = r_n - mean_g(r), optionally / std_g(r) (population or
                                 Bessel-corrected); no KL term
  "distill"  distill_advantages  A_t = stopgrad(logp_teacher_t - logp_student_t) (group size 1)
Policy losses (`POLICY_LOSSES`):
  "ppo"      ppo_policy_loss     PPO's clipped surrogate against the pre-update policy, eps_low 0.2
                                 / eps_high 0.28, and IcePop against the rollout log-probs: kept
                                 tokens weighted by k = pi_old / pi_rollout (as published, and as
                                 slime's `icepop_function`), or only masked (`icepop="mask"`)
  "is"       is_policy_loss      the asynchronous loss: no pi_old; a double-sided mask on
                                 r = pi_theta / pi_rollout, r * A on the kept tokens
Both normalize the loss per token (sum over the batch's loss tokens / their count) or per
sample (each sample's token mean, then the mean over samples: `normalization="sample"`).

`glm5_jax.posttrain.rl_step` picks a loss by name; `glm5_jax.rl` (asynchronous RL) uses the same
functions, so post-training never imports `rl` (docs/design.md, Dependency direction).

Notation (docs/design.md): B batch (samples), L sequence; N counts samples flattened over
prompts and their groups (as the rows of `glm5_jax.infer.sampling`), a per-sample axis only
here. Position i of a `[B, L]` array is token i: `logp_BL[b, i]` is the log-probability of
token i given tokens < i (`glm5_jax.train.losses.token_logprobs`).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

GROUP_STDS = ("population", "bessel")
ICEPOP_MODES = ("weight", "mask")
NORMALIZATIONS = ("token", "sample")


def group_advantages(rewards_N, group_ids_N, *, normalize_std: bool, std: str = "population",
                     eps: float = 1e-6):
  """GRPO's group-relative advantage of each sample: its reward minus its group's mean reward,
  divided by the group's standard deviation when `normalize_std`.

    A_n = r_n - mu_g                       mu_g = mean of r over group g = group_ids_N[n]
    A_n = (r_n - mu_g) / (sigma_g + eps)   sigma_g = sqrt(mean over g of (r - mu_g)^2)

  `std="population"` divides the squared deviations by the group size G: the group is every
  sample drawn for the prompt, and a normalized group's advantages then have root-mean-square
  exactly 1 whatever G is. `std="bessel"` divides by G - 1, as `torch.std` does in slime's,
  TRL's and verl's GRPO (GLM's own RL scripts): advantages smaller by sqrt((G - 1) / G). A
  group of one sample has no Bessel std; its advantage is 0 either way (constant group).
  Dr. GRPO argues against the division (it up-weights prompts whose rewards barely vary, a
  difficulty bias) and GLM-5 normalizes within each group (docs/reference.md section 4); hence
  the flag. A group whose rewards are all equal carries no signal and gets advantage exactly 0
  (never NaN, and not a rounding residue of `r - mean`), with or without the division.

  Groups are matched by id, so groups may have different sizes and their samples may be
  interleaved in any order; the cost is an `[N, N]` comparison, negligible at RL batch sizes.

  Args:
    rewards_N: float rewards, one per sample.
    group_ids_N: int ids; samples with equal ids form a group (the prompt's G samples).
    normalize_std: divide by the group's std (+ eps).
    std: "population" (divide by G) or "bessel" (by G - 1), `GROUP_STDS`.
    eps: keeps the division finite for a group whose std is tiny but not zero.
  Returns:
    float32 advantages `[N]`.
  """
  if std not in GROUP_STDS:
    raise ValueError(f"group_advantages: std must be one of {GROUP_STDS}, got {std!r}")
  rewards_N = jnp.asarray(rewards_N, jnp.float32)
  group_ids_N = jnp.asarray(group_ids_N)
  if rewards_N.ndim != 1 or rewards_N.shape != group_ids_N.shape:
    raise ValueError(f"group_advantages: rewards_N {rewards_N.shape} and group_ids_N "
                     f"{group_ids_N.shape} must be equal 1-D shapes")
  same_NN = group_ids_N[:, None] == group_ids_N[None, :]
  size_N = same_NN.sum(axis=1).astype(jnp.float32)
  mean_N = jnp.where(same_NN, rewards_N[None, :], 0.0).sum(axis=1) / size_N
  centered_N = rewards_N - mean_N
  group_max_N = jnp.where(same_NN, rewards_N[None, :], -jnp.inf).max(axis=1)
  group_min_N = jnp.where(same_NN, rewards_N[None, :], jnp.inf).min(axis=1)
  constant_N = group_max_N == group_min_N
  if normalize_std:
    deviation_N = rewards_N[None, :] - mean_N[:, None]  # row n: group g(n)'s deviations
    dof_N = jnp.maximum(size_N - 1.0, 1.0) if std == "bessel" else size_N
    variance_N = jnp.where(same_NN, jnp.square(deviation_N), 0.0).sum(axis=1) / dof_N
    centered_N = centered_N / (jnp.sqrt(variance_N) + eps)
  return jnp.where(constant_N, 0.0, centered_N)


def distill_advantages(teacher_logp_BL, student_logp_BL):
  """On-policy distillation's per-token advantage `stopgrad(logp_teacher - logp_student)`
  (docs/reference.md section 4, group size 1): positive where the teacher finds the student's
  sampled token likelier than the student does, so the policy loss raises it. Used as the
  advantage of `policy_loss`, it makes the policy gradient that of the reverse KL
  `KL(student || teacher)` on the student's own samples.

  Returns:
    float32 `[B, L]`, no gradient to either input.
  """
  return jax.lax.stop_gradient(jnp.asarray(teacher_logp_BL, jnp.float32)
                               - jnp.asarray(student_logp_BL, jnp.float32))


def loss_weights(loss_mask_BL, *, normalization: str = "token", denominators=None):
  """Each token's weight in the batch's loss, `[B, L]` float32 (0 off the mask):

    "token":  w_bt = m_bt / T               T = sum_bt m_bt (the loss tokens), at least 1
    "sample": w_bt = m_bt / (T_b * S)       T_b = sum_t m_bt, S = rows with T_b > 0, >= 1

  so a loss `sum_bt w_bt l_bt` is the mean over loss tokens, or the mean over samples of each
  sample's token mean (a long sample then counts as much as a short one, not more).
  `denominators` (`batch_denominators` of a larger batch) makes `loss_mask_BL` one microbatch of
  it (whole rows): the microbatches' weighted sums then add up to the batch's.
  """
  if normalization not in NORMALIZATIONS:
    raise ValueError(f"loss normalization must be one of {NORMALIZATIONS}, got "
                     f"{normalization!r}")
  mask_BL = jnp.asarray(loss_mask_BL, jnp.float32)
  whole = batch_denominators(mask_BL) if denominators is None else denominators
  if normalization == "token":
    return mask_BL / whole["tokens"]
  row_tokens_B1 = jnp.maximum(mask_BL.sum(axis=1, keepdims=True), 1.0)
  return mask_BL / row_tokens_B1 / whole["samples"]


def batch_denominators(loss_mask_BL) -> dict:
  """`{"tokens": loss tokens, "samples": rows with a loss token}`, each at least 1: what the
  losses and their per-token metrics divide by (`loss_weights`)."""
  mask_BL = jnp.asarray(loss_mask_BL, jnp.float32)
  return {"tokens": jnp.maximum(mask_BL.sum(), 1.0),
          "samples": jnp.maximum((mask_BL.sum(axis=1) > 0).sum().astype(jnp.float32), 1.0)}


def _check_shapes(name, **inputs):
  shapes = {key: jnp.shape(x) for key, x in inputs.items()}
  if len(set(shapes.values())) != 1:
    raise ValueError(f"{name}: inputs must share one shape, got {shapes}")


def ppo_policy_loss(logp_BL, old_logp_BL, rollout_logp_BL, advantages_BL, loss_mask_BL, *,
                    eps_low: float = 0.2, eps_high: float = 0.28, icepop_beta: float = 2.0,
                    icepop: str = "weight", normalization: str = "token", denominators=None):
  """Token-level PPO clipped surrogate with IcePop (docs/reference.md section 4).

  Per token t (position t of the `[B, L]` arrays), with A_t its advantage, w_t its loss weight
  (`loss_weights`: m_t / T per token, or per sample):

    r_t    = exp(logp_t - old_logp_t)                    importance ratio to the pre-update
                                                         policy (old_logp: the trainer's own
                                                         log-probs, no gradient)
    l_t    = -min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)     PPO, pessimistic
    k_t    = exp(old_logp_t - rollout_logp_t)            pi_train / pi_rollout, no gradient
    keep_t = 1 if 1/beta <= k_t <= beta else 0           IcePop's band (inclusive; tested in log
                                                         space: |log k_t| <= log beta)
    c_t    = keep_t * k_t  ("weight", as published)  or  keep_t  ("mask")
    loss   = sum_t w_t * c_t * l_t

  IcePop as published (and as slime's `icepop_function`: `pg_loss * where(in band, ratio, 0)`
  with ratio = exp(old - rollout), old being the training engine's log-probs before the update)
  re-weights a kept token by its train/rollout ratio k, which carries no gradient (both
  log-probs are constants); so at k = 1.5, A = 1, r = 1 the token's loss gradient is -1.5 x
  grad logp. "mask" keeps the tokens inside the band unweighted (gradient -1.0 there). Outside
  the band a token's loss and gradient are exactly 0 in both modes, and the others are not
  re-weighted: the weights divide by the ORIGINAL loss-token (or sample) count, taken before
  IcePop. Where the clip is active (A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low)
  the min picks the constant clipped branch and the token has no gradient. GRPO has no KL term.

  With one update per rollout batch (the loop's default) old_logp = stopgrad(logp): r is 1 in
  value (nothing is clipped) and its gradient is that of logp, so the loss is the plain
  policy gradient `-c_t * A_t * grad logp_t` on IcePop's kept tokens; the clip matters when a
  batch is used for several updates (`rl.minibatches` > 1) and old_logp is the log-probs from
  before the first.

  Args:
    logp_BL: the policy's log-probs of each token (differentiable).
    old_logp_BL: the pre-update policy's log-probs (the gradient is stopped here).
    rollout_logp_BL: the inference engine's raw log-probs of the same tokens (no gradient).
    advantages_BL: per-token advantages (no gradient).
    loss_mask_BL: 1 on the tokens trained on (generated tokens), else 0.
    eps_low, eps_high: the asymmetric clip range [1 - eps_low, 1 + eps_high].
    icepop_beta: IcePop's band [1/beta, beta] for k (> 1).
    icepop: "weight" (kept tokens carry k) or "mask" (kept tokens carry 1), `ICEPOP_MODES`.
    normalization, denominators: as `loss_weights`; the per-token metrics always divide by the
      (whole batch's) loss tokens.
  Returns:
    `(loss, metrics)`; metrics (float32 scalars, fractions and means over loss tokens):
      clip_low_fraction, clip_high_fraction: tokens kept by IcePop whose clip is active on the
        low side (A < 0, r < 1 - eps_low) or the high side (A > 0, r > 1 + eps_high);
      icepop_masked_fraction: tokens IcePop zeroed;
      logp_mismatch_mean, logp_mismatch_max: |logp - rollout_logp| (train vs rollout);
      ratio_mean: mean r over the tokens IcePop keeps; loss_tokens: sum of the loss mask;
      kept_tokens: the loss tokens IcePop keeps.
  """
  if icepop not in ICEPOP_MODES:
    raise ValueError(f"ppo_policy_loss: icepop must be one of {ICEPOP_MODES}, got {icepop!r}")
  _check_shapes("ppo_policy_loss", logp_BL=logp_BL, old_logp_BL=old_logp_BL,
                rollout_logp_BL=rollout_logp_BL, advantages_BL=advantages_BL,
                loss_mask_BL=loss_mask_BL)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  logp_BL, mask_BL = f32(logp_BL), f32(loss_mask_BL)
  old_logp_BL = jax.lax.stop_gradient(f32(old_logp_BL))
  rollout_logp_BL = jax.lax.stop_gradient(f32(rollout_logp_BL))
  advantages_BL = jax.lax.stop_gradient(f32(advantages_BL))
  whole = batch_denominators(mask_BL) if denominators is None else denominators
  weights_BL = loss_weights(mask_BL, normalization=normalization, denominators=whole)

  # log space: a ratio of two probabilities is exp(difference); the bound log(beta) is rounded
  # once, so exactly k = beta and k = 1/beta (log k = +-log beta) are kept.
  log_beta = math.log(icepop_beta)
  mismatch_BL = old_logp_BL - rollout_logp_BL
  keep_BL = (mismatch_BL >= -log_beta) & (mismatch_BL <= log_beta)
  active_BL = keep_BL & (mask_BL > 0)
  # Masked tokens get log-ratio 0 through `where`, not a multiply by 0: their ratio could
  # overflow, and 0 * inf in the backward pass would be NaN instead of an exact 0 gradient.
  ratio_BL = jnp.exp(jnp.where(active_BL, logp_BL - old_logp_BL, 0.0))
  clipped_BL = jnp.clip(ratio_BL, 1.0 - eps_low, 1.0 + eps_high)
  token_loss_BL = -jnp.minimum(ratio_BL * advantages_BL, clipped_BL * advantages_BL)
  if icepop == "weight":  # k is a constant (both log-probs are), in [1/beta, beta] where kept
    token_loss_BL = token_loss_BL * jnp.exp(jnp.where(active_BL, mismatch_BL, 0.0))
  loss = jnp.where(active_BL, token_loss_BL * weights_BL, 0.0).sum()

  tokens = whole["tokens"]
  fraction = lambda token_BL: jnp.where(token_BL, mask_BL, 0.0).sum() / tokens
  ratio_value_BL = jax.lax.stop_gradient(ratio_BL)
  gap_BL = jnp.abs(jax.lax.stop_gradient(logp_BL) - rollout_logp_BL)
  metrics = {
      "clip_low_fraction": fraction(active_BL & (advantages_BL < 0)
                                    & (ratio_value_BL < 1.0 - eps_low)),
      "clip_high_fraction": fraction(active_BL & (advantages_BL > 0)
                                     & (ratio_value_BL > 1.0 + eps_high)),
      "icepop_masked_fraction": fraction(~keep_BL),
      "logp_mismatch_mean": (gap_BL * mask_BL).sum() / tokens,
      "logp_mismatch_max": jnp.where(mask_BL > 0, gap_BL, 0.0).max(),
      "ratio_mean": (jnp.where(active_BL, ratio_value_BL * mask_BL, 0.0).sum()
                     / jnp.maximum(jnp.where(active_BL, mask_BL, 0.0).sum(), 1.0)),
      "loss_tokens": mask_BL.sum(),
      "kept_tokens": jnp.where(active_BL, mask_BL, 0.0).sum(),
  }
  return loss, metrics


def _log_bounds(eps_low: float, eps_high: float) -> tuple[float, float]:
  if not (0.0 <= eps_low <= 1.0 and eps_high >= 0.0):
    raise ValueError(f"importance-sampling band: eps_low={eps_low} (expected in [0, 1]), "
                     f"eps_high={eps_high} (expected >= 0)")
  # Rounded once to float32, so that a log-ratio equal to the bound is kept exactly.
  low = -math.inf if eps_low == 1.0 else float(np.float32(math.log1p(-eps_low)))
  return low, float(np.float32(math.log1p(eps_high)))


def is_token_mask(logp_BL, rollout_logp_BL, *, eps_low: float, eps_high: float):
  """True where `r = exp(logp - rollout_logp)` lies in [1 - eps_low, 1 + eps_high] (inclusive;
  tested in log space: log(1 - eps_low) <= logp - rollout_logp <= log(1 + eps_high))."""
  low, high = _log_bounds(eps_low, eps_high)
  delta_BL = (jnp.asarray(logp_BL, jnp.float32) - jnp.asarray(rollout_logp_BL, jnp.float32))
  return (delta_BL >= low) & (delta_BL <= high)


def is_policy_loss(logp_BL, rollout_logp_BL, advantages_BL, loss_mask_BL, *,
                   eps_low: float = 0.2, eps_high: float = 0.28, normalization: str = "token",
                   denominators=None):
  """The asynchronous policy loss with the double-sided IS mask (`glm5_jax.rl.staleness`, 3):

    r_t    = exp(logp_t - rollout_logp_t)
    keep_t = 1 - eps_low <= r_t <= 1 + eps_high
    loss   = -sum_t w_t * keep_t * r_t * A_t           w_t: `loss_weights`

  so a kept token's gradient is `-w_t * r_t * A_t * grad logp_t` and a masked one's exactly 0;
  the weights divide by the original loss-token (or sample) count (masked tokens are not
  re-weighted away). Unlike `ppo_policy_loss`, there is no pi_old, and the mask is double-sided
  whatever the sign of the advantage.

  Returns:
    `(loss, metrics)`: is_masked_fraction, is_low_fraction (r < 1 - eps_low), is_high_fraction
    (r > 1 + eps_high), logp_mismatch_mean (over loss tokens), logp_mismatch_max, ratio_mean
    (over kept tokens), loss_tokens, kept_tokens.
  """
  _check_shapes("is_policy_loss", logp_BL=logp_BL, rollout_logp_BL=rollout_logp_BL,
                advantages_BL=advantages_BL, loss_mask_BL=loss_mask_BL)
  logp_BL = jnp.asarray(logp_BL, jnp.float32)
  rollout_logp_BL = jax.lax.stop_gradient(jnp.asarray(rollout_logp_BL, jnp.float32))
  advantages_BL = jax.lax.stop_gradient(jnp.asarray(advantages_BL, jnp.float32))
  mask_BL = jnp.asarray(loss_mask_BL, jnp.float32)
  whole = batch_denominators(mask_BL) if denominators is None else denominators
  weights_BL = loss_weights(mask_BL, normalization=normalization, denominators=whole)
  keep_BL = is_token_mask(jax.lax.stop_gradient(logp_BL), rollout_logp_BL, eps_low=eps_low,
                          eps_high=eps_high) & (mask_BL > 0)
  # `where` before exp: a masked token's ratio may overflow, and 0 * inf would be NaN.
  ratio_BL = jnp.exp(jnp.where(keep_BL, logp_BL - rollout_logp_BL, 0.0))
  loss = -jnp.where(keep_BL, ratio_BL * advantages_BL * weights_BL, 0.0).sum()
  loss_tokens, tokens = mask_BL.sum(), whole["tokens"]
  kept = jnp.where(keep_BL, mask_BL, 0.0).sum()
  delta_BL = jax.lax.stop_gradient(logp_BL) - rollout_logp_BL
  low, high = _log_bounds(eps_low, eps_high)
  on_BL = mask_BL > 0
  fraction = lambda x_BL: jnp.where(x_BL & on_BL, mask_BL, 0.0).sum() / tokens
  metrics = {"is_masked_fraction": (loss_tokens - kept) / tokens,
             "is_low_fraction": fraction(delta_BL < low),
             "is_high_fraction": fraction(delta_BL > high),
             "logp_mismatch_mean": (jnp.abs(delta_BL) * mask_BL).sum() / tokens,
             "logp_mismatch_max": jnp.where(on_BL, jnp.abs(delta_BL), 0.0).max(),
             "ratio_mean": jnp.where(keep_BL, jax.lax.stop_gradient(ratio_BL) * mask_BL,
                                     0.0).sum() / jnp.maximum(kept, 1.0),
             "loss_tokens": loss_tokens, "kept_tokens": kept}
  return loss, metrics


# name -> function: `rl.loss` picks the advantage, `rl.policy_loss` (resolved) the loss.
ADVANTAGES = {"grpo": group_advantages, "distill": distill_advantages}
POLICY_LOSSES = {"ppo": ppo_policy_loss, "is": is_policy_loss}
