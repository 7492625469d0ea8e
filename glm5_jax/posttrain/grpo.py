"""Policy-gradient math of reasoning RL: GRPO advantages, on-policy distillation advantages, and
the token-level clipped policy loss with IcePop (docs/reference.md section 4).

The pieces, each a pure jnp function:

  group_advantages     A_n = r_n - mean_g(r)            (optionally / std_g(r)), no KL term
  distill_advantages   A_t = stopgrad(logp_teacher_t - logp_student_t)   (group size 1)
  policy_loss          PPO's clipped surrogate, eps_low 0.2 / eps_high 0.28, IcePop masking,
                       divided by the original number of loss tokens

Notation (docs/design.md): B batch (samples), L sequence; N counts samples flattened over
prompts and their groups (as the rows of `glm5_jax.infer.sampling`), a per-sample axis only
here. Position i of a `[B, L]` array is token i: `logp_BL[b, i]` is the log-probability of
token i given tokens < i.
"""

import math

import jax
import jax.numpy as jnp


def group_advantages(rewards_N, group_ids_N, *, normalize_std: bool, eps: float = 1e-6):
  """GRPO's group-relative advantage of each sample: its reward minus its group's mean reward,
  divided by the group's standard deviation when `normalize_std`.

    A_n = r_n - mu_g                       mu_g = mean of r over group g = group_ids_N[n]
    A_n = (r_n - mu_g) / (sigma_g + eps)   sigma_g = sqrt(mean over g of (r - mu_g)^2)

  sigma is the population standard deviation (divide by the group size G, not G - 1): the
  group is every sample drawn for the prompt, not an estimate of a wider population, and it
  makes a normalized group's advantages have root-mean-square exactly 1 whatever G is (TRL and
  verl call `torch.std`, Bessel-corrected, whose advantages are smaller by sqrt((G-1)/G)).
  Dr. GRPO argues against the division (it up-weights prompts whose rewards barely vary, a
  difficulty bias) and GLM-5 normalizes within each group (docs/reference.md section 4); hence
  the flag. A group whose rewards are all equal carries no signal and gets advantage exactly 0
  (never NaN, and not a rounding residue of `r - mean`), with or without the division.

  Groups are matched by id, so groups may have different sizes and their samples may be
  interleaved in any order; the cost is an `[N, N]` comparison, negligible at RL batch sizes.

  Args:
    rewards_N: float rewards, one per sample.
    group_ids_N: int ids; samples with equal ids form a group (the prompt's G samples).
    normalize_std: divide by the group's population std (+ eps).
    eps: keeps the division finite for a group whose std is tiny but not zero.
  Returns:
    float32 advantages `[N]`.
  """
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
    variance_N = jnp.where(same_NN, jnp.square(deviation_N), 0.0).sum(axis=1) / size_N
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


def policy_loss(logp_BL, old_logp_BL, rollout_logp_BL, advantages_BL, loss_mask_BL, *,
                eps_low: float = 0.2, eps_high: float = 0.28, icepop_beta: float = 2.0,
                denominator=None):
  """Token-level PPO clipped surrogate with IcePop masking (docs/reference.md section 4).

  Per token t (position t of the `[B, L]` arrays), with A_t its advantage and m_t its loss mask:

    r_t    = exp(logp_t - old_logp_t)                     importance ratio to the pre-update
                                                          policy (old_logp: the trainer's own
                                                          log-probs, no gradient)
    l_t    = -min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)     PPO, pessimistic
    k_t    = exp(old_logp_t - rollout_logp_t)             training / inference mismatch
    keep_t = 1 if 1/beta <= k_t <= beta else 0            IcePop (bounds inclusive; tested in
                                                          log space: |log k_t| <= log beta)
    loss   = sum_t m_t * keep_t * l_t / max(sum_t m_t, 1)

  GRPO has no KL term. A token outside IcePop's band is masked, not clipped: its loss and its
  gradient are exactly 0, and the others are not re-weighted, since the denominator is the
  ORIGINAL loss-token count `sum_t m_t` (taken before IcePop; the reference keeps it as the
  denominator). Where the clip is active (A > 0 and r > 1 + eps_high, or A < 0 and
  r < 1 - eps_low) the min picks the constant clipped branch and the token has no gradient.

  With one update per rollout batch (the loop's default) old_logp = stopgrad(logp): r is 1 in
  value (nothing is clipped) and its gradient is that of logp, so the loss is the plain
  policy gradient `-A_t * grad logp_t` on IcePop's kept tokens; the clip matters when a batch
  is used for several updates (`rl.minibatches` > 1, `loop.train_on_batch`) and old_logp is
  the log-probs from before the first.

  Args:
    logp_BL: the policy's log-probs of each token (differentiable).
    old_logp_BL: the pre-update policy's log-probs (the gradient is stopped here).
    rollout_logp_BL: the inference engine's raw log-probs of the same tokens (no gradient).
    advantages_BL: per-token advantages (no gradient).
    loss_mask_BL: 1 on the tokens trained on (generated tokens), else 0.
    eps_low, eps_high: the asymmetric clip range [1 - eps_low, 1 + eps_high].
    icepop_beta: IcePop's band [1/beta, beta] for k (> 1).
    denominator: what the loss and the per-token means divide by; None: this batch's
      `max(sum_t m_t, 1)`. A microbatch of a larger batch passes the whole batch's, so the
      microbatches' losses and metrics add up to the batch's (`rl_step.rl_loss_and_grads`).
  Returns:
    `(loss, metrics)`; metrics (float32 scalars, fractions and means over loss tokens):
      clip_low_fraction, clip_high_fraction: tokens kept by IcePop whose clip is active on the
        low side (A < 0, r < 1 - eps_low) or the high side (A > 0, r > 1 + eps_high);
      icepop_masked_fraction: tokens IcePop zeroed;
      logp_mismatch_mean, logp_mismatch_max: |logp - rollout_logp| (train vs rollout);
      ratio_mean: mean r over the tokens IcePop keeps; loss_tokens: sum of the loss mask;
      kept_tokens: the loss tokens IcePop keeps.
  """
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  inputs = {"logp_BL": logp_BL, "old_logp_BL": old_logp_BL, "rollout_logp_BL": rollout_logp_BL,
            "advantages_BL": advantages_BL, "loss_mask_BL": loss_mask_BL}
  shapes = {name: jnp.shape(x) for name, x in inputs.items()}
  if len(set(shapes.values())) != 1:
    raise ValueError(f"policy_loss: inputs must share one shape, got {shapes}")
  logp_BL, mask_BL = f32(logp_BL), f32(loss_mask_BL)
  old_logp_BL = jax.lax.stop_gradient(f32(old_logp_BL))
  rollout_logp_BL = jax.lax.stop_gradient(f32(rollout_logp_BL))
  advantages_BL = jax.lax.stop_gradient(f32(advantages_BL))

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
  loss_tokens = mask_BL.sum()
  denominator = jnp.maximum(loss_tokens, 1.0) if denominator is None else denominator
  loss = jnp.where(active_BL, token_loss_BL * mask_BL, 0.0).sum() / denominator

  def fraction(token_BL):
    return jnp.where(token_BL, mask_BL, 0.0).sum() / denominator

  ratio_value_BL = jax.lax.stop_gradient(ratio_BL)
  gap_BL = jnp.abs(jax.lax.stop_gradient(logp_BL) - rollout_logp_BL)
  metrics = {
      "clip_low_fraction": fraction(active_BL & (advantages_BL < 0)
                                    & (ratio_value_BL < 1.0 - eps_low)),
      "clip_high_fraction": fraction(active_BL & (advantages_BL > 0)
                                     & (ratio_value_BL > 1.0 + eps_high)),
      "icepop_masked_fraction": fraction(~keep_BL),
      "logp_mismatch_mean": (gap_BL * mask_BL).sum() / denominator,
      "logp_mismatch_max": jnp.where(mask_BL > 0, gap_BL, 0.0).max(),
      "ratio_mean": (jnp.where(active_BL, ratio_value_BL * mask_BL, 0.0).sum()
                     / jnp.maximum(jnp.where(active_BL, mask_BL, 0.0).sum(), 1.0)),
      "loss_tokens": loss_tokens,
      "kept_tokens": jnp.where(active_BL, mask_BL, 0.0).sum(),
  }
  return loss, metrics
