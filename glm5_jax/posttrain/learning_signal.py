"""What tells signal from noise in an RL batch: its metrics, the null-reward control, and dynamic
sampling (DAPO's: groups whose rewards are all equal dropped and refilled).

GRPO's gradient is the advantage-weighted sum over groups, and a group whose rewards are all
equal has advantage 0: it adds nothing but its tokens to the normalizer. When most groups are
like that, or the rewarded samples are right for the wrong reasons, a step is mostly noise,
and the normalized optimizers (Muon Split, AdamW) take a full-size step anyway
(docs/posttrain.md, "Why RL fell"). These functions make that visible and controllable:

  batch_signal_metrics  per step: the share of groups with no signal, reward per difficulty
                        bucket, the share of positive advantage paid to lucky answers (correct,
                        with reasoning the env found wrong), KL to the starting policy
  shuffle_rewards       the null-reward control: each group's rewards permuted among its
                        samples, so advantages keep their sizes but carry no expected signal
  select_signal_groups  dynamic sampling's choice of the groups a step trains on
  refill_task_index     the task that replaces a task's group in a later dynamic-sampling round
  k3_kl                 the per-token KL estimate to the starting policy (the metric and the
                        loss's penalty)

Notation (docs/design.md): N samples, flat; a group is the samples sharing `Sample.group`.
"""

import collections
import dataclasses

import numpy as np


REFILL_STRIDE = 2**40  # refill rounds' task indices: far past any run's own task stream


def refill_task_index(index: int, round_: int) -> int:
  """The train task drawn in dynamic-sampling round `round_` (>= 1) in place of task `index`
  (round 0 is `index` itself). Both loops use it, so a step's tasks depend only on its first
  round's indices, and refills never repeat a task of the run's own stream."""
  return index + round_ * REFILL_STRIDE


def group_rows(samples) -> dict:
  """{group id: [row indices]} in order of first appearance."""
  rows = collections.defaultdict(list)
  for i, s in enumerate(samples):
    rows[s.group].append(i)
  return dict(rows)


def has_signal(rewards) -> bool:
  """Whether a group's rewards differ (GRPO gives an all-equal group advantage 0)."""
  return bool(np.ptp(np.asarray(rewards, np.float64)) > 0)


def shuffle_rewards(rewards_N, group_ids_N, rng: np.random.Generator) -> np.ndarray:
  """The null-reward control: float32 `[N]`, each group's rewards permuted among its samples.

  The advantages keep their sizes and the groups their reward counts, but which sample earned
  a reward is random: any improvement over this control is the reward's signal, and any fall
  under it is what the optimizer does to a model with noise alone."""
  rewards_N = np.asarray(rewards_N, np.float32).copy()
  group_ids_N = np.asarray(group_ids_N)
  for g in np.unique(group_ids_N):
    rows = np.flatnonzero(group_ids_N == g)
    rewards_N[rows] = rewards_N[rng.permutation(rows)]
  return rewards_N


def select_signal_groups(samples, groups: int) -> tuple[list, int]:
  """Dynamic sampling: `(samples of `groups` groups, how many of them carry signal)`.

  The groups whose rewards differ come first, in the order they were generated; when fewer
  than `groups` do, all-equal groups (advantage 0) fill the rest, so a step's batch always has
  the same shape (one compiled train step). The kept groups are renumbered 0..groups-1 in the
  order kept. Raises ValueError when `samples` hold fewer than `groups` groups."""
  by_group = group_rows(samples)
  if len(by_group) < groups:
    raise ValueError(f"select_signal_groups: {len(by_group)} groups generated, {groups} needed")
  signal = [g for g, rows in by_group.items() if has_signal([samples[i].reward for i in rows])]
  rest = [g for g in by_group if g not in set(signal)]
  kept = (signal + rest)[:groups]
  out = [dataclasses.replace(samples[i], group=new) for new, g in enumerate(kept)
         for i in by_group[g]]
  return out, min(len(signal), groups)


def batch_signal_metrics(samples, advantages_N, difficulty=None) -> dict:
  """Per-step signal metrics of a scored batch.

  Args:
    samples: the `rollout.Sample`s trained on (their `reward`, `correct`, `group`, `info`).
    advantages_N: one advantage per sample (GRPO's).
    difficulty: optional `task -> label | None` (`Env.difficulty`).
  Returns:
    `zero_signal_groups`: the share of groups whose rewards are all equal;
    `lucky_fraction` / `lucky_advantage_share` (where the env records `info["reasoning_ok"]`):
      the share of correct samples whose reasoning is wrong, and the share of the positive
      advantage x response tokens that goes to such samples;
    `reward_<label>` and `samples_<label>`: mean reward and count per difficulty bucket.
  """
  advantages_N = np.asarray(advantages_N, np.float64)
  by_group = group_rows(samples)
  out = {"zero_signal_groups": float(np.mean(
      [not has_signal([samples[i].reward for i in rows]) for rows in by_group.values()]))}
  checked = [s for s in samples if "reasoning_ok" in s.info]
  if checked:
    correct = [s for s in checked if s.correct]
    out["lucky_fraction"] = (float(np.mean([not s.info["reasoning_ok"] for s in correct]))
                             if correct else 0.0)
    weight = np.asarray([max(a, 0.0) * s.response_length
                         for s, a in zip(samples, advantages_N)])
    lucky = np.asarray([s.correct and s.info.get("reasoning_ok") is False for s in samples])
    total = weight.sum()
    out["lucky_advantage_share"] = float(weight[lucky].sum() / total) if total else 0.0
  if difficulty is not None:
    buckets = collections.defaultdict(list)
    for s in samples:
      label = difficulty(s.task)
      if label is not None:
        buckets[label].append(s.reward)
    for label, rewards in sorted(buckets.items()):
      out[f"reward_{label}"] = float(np.mean(rewards))
      out[f"samples_{label}"] = float(len(rewards))
  return out


def k3_kl(logp_BL, ref_logp_BL, mask_BL, xp=np):
  """Per-token KL(pi || pi_ref) `[B, L]` by Schulman's k3 estimator on the sampled tokens:
  r - 1 - log r with r = pi_ref / pi (unbiased, never negative; as a loss its gradient pulls
  logp toward ref_logp). 0 off the mask (padding log-probs never reach exp). `xp`: numpy for
  the float64 metric, jax.numpy inside the loss (`rl_step.rl_loss`)."""
  log_r = xp.where(mask_BL > 0, ref_logp_BL - logp_BL, 0.0)
  return xp.exp(log_r) - 1.0 - log_r


def kl_to_reference(rollout_logp_BL, reference_logp_BL, loss_mask_BL) -> float:
  """KL(pi || pi_ref) per loss token (`k3_kl` in float64), pi being the rollout policy."""
  mask = np.asarray(loss_mask_BL, np.float64)
  k3 = k3_kl(np.asarray(rollout_logp_BL, np.float64), np.asarray(reference_logp_BL, np.float64),
             mask) * mask
  return float(k3.sum() / max(mask.sum(), 1.0))
