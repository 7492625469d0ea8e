"""One RL update on a step's samples, host side: scoring and the train steps, whichever loop
(the synchronous `loop`, the asynchronous `glm5_jax.rl.async_trainer`) gathered the samples.

`update` = `score` (the batch and its advantages: GRPO's group advantages of the rewards, with
`rl.null_reward_control` shuffled within each group first, or distillation's per-token teacher
gap) -> `signal_metrics` (what tells signal from noise) -> the starting policy's log-probs when
the run keeps them (`add_reference_logp`: `kl_to_start`, and the KL penalty's `ref_logp`) ->
`train_on_batch` (`rl.minibatches` jitted updates, `rl_step.make_rl_train_step`) -> a finite
loss (`check_finite`).
"""

from absl import logging
import jax
import numpy as np

from glm5_jax.config import ModelConfig
from glm5_jax.data import check_vocab
from glm5_jax.eval.checkpoints import load_run
from glm5_jax.posttrain import algorithms, learning_signal, rollout, rl_step
from glm5_jax.seeds import derive_seed
from glm5_jax.train import integrity
from glm5_jax.train.harness import check_finite
from glm5_jax.train.state import TrainState

ANY_TASK = "*"  # the key of `rl.teacher`, the one teacher of every sample


def update(config, t: rl_step.RLTrainer, state: TrainState, samples, env, *, step: int,
           teacher=None, reference=None) -> tuple[TrainState, dict, dict]:
  """RL step `step` (0-based) on `samples`: `(state, signal, metrics)`, `signal` being
  `signal_metrics` (and `kl_to_start` with a `reference`), `metrics` the train steps'
  (`train_on_batch`). Raises `NonFiniteLossError` naming step `step + 1` on a non-finite loss."""
  batch = score(config, samples, teacher, step=step)
  signal = signal_metrics(config, samples, batch, env)
  if reference is not None:
    add_reference_logp(t, reference, batch, signal, config.rl.kl_coef > 0)
  state, metrics = train_on_batch(t, state, batch, config.rl.minibatches)
  check_finite(step + 1, metrics)
  return state, signal, metrics


def score(config, samples, teacher=None, *, step: int = 0) -> dict:
  """The rollout batch of `samples` with its advantages: GRPO's per-sample group advantages
  (with `rl.null_reward_control`, of the rewards shuffled within each group, a permutation
  drawn from (rl.seed, `step`)), or, with `teacher` ({env name or ANY_TASK: (model config,
  params)}, `load_teachers`), distillation's per-token gap `stopgrad(logp_teacher -
  logp_rollout)` where each sample's teacher is that of its task (`sample.task.env`), else the
  ANY_TASK one."""
  if teacher is None:
    rewards = np.asarray([s.reward for s in samples], np.float32)
    groups = np.asarray([s.group for s in samples], np.int32)
    if config.rl.null_reward_control:
      rng = np.random.default_rng(derive_seed("null_reward", config.rl.seed, step))
      rewards = learning_signal.shuffle_rewards(rewards, groups, rng)
    advantages = np.asarray(algorithms.group_advantages(
        rewards, groups, normalize_std=config.rl.normalize_std, std=config.rl.group_std))
    return rollout.to_batch(samples, config.data.seq_len, advantages)
  batch = rollout.to_batch(samples, config.data.seq_len)
  owner = np.asarray([s.task.env if s.task.env in teacher else ANY_TASK for s in samples])
  missing = sorted(set(owner) - set(teacher))
  if missing:
    raise ValueError(f"score: samples of tasks {sorted({s.task.env for s in samples})} have "
                     f"no teacher; teachers: {sorted(teacher)}")
  gap = np.zeros_like(batch["rollout_logp"])
  for name in sorted(set(owner)):
    # The whole batch through each teacher (one compiled shape), its own rows kept.
    teacher_cfg, teacher_params = teacher[name]
    teacher_logp = rl_step.teacher_logp(teacher_cfg, teacher_params, batch)
    rows = np.asarray(algorithms.distill_advantages(teacher_logp, batch["rollout_logp"]))
    gap[owner == name] = rows[owner == name]
  batch["advantages"] = (gap * batch["loss_mask"]).astype(np.float32)
  return batch


def signal_metrics(config, samples, batch, env) -> dict:
  """`learning_signal.batch_signal_metrics` of a GRPO batch (per-sample advantages read back
  from its per-token ones); {} for distillation, whose advantages are per token."""
  if config.rl.loss != "grpo":
    return {}
  mask = batch["loss_mask"]
  advantages = (batch["advantages"] * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1.0)
  return learning_signal.batch_signal_metrics(samples, advantages, difficulty=env.difficulty)


def add_reference_logp(t: rl_step.RLTrainer, reference, batch, metrics: dict,
                       into_batch: bool) -> None:
  """The starting policy's log-probs of `batch`: `kl_to_start` into `metrics` (the rollout
  policy's KL to it per loss token, `learning_signal.kl_to_reference`), and into the batch as
  `ref_logp` when `into_batch` (the loss's KL penalty)."""
  ref_logp = integrity.to_host(t.policy_logp(reference, put_batch(t, batch)))
  metrics["kl_to_start"] = learning_signal.kl_to_reference(batch["rollout_logp"], ref_logp,
                                                           batch["loss_mask"])
  if into_batch:
    batch["ref_logp"] = (ref_logp * batch["loss_mask"]).astype(np.float32)


def train_on_batch(t: rl_step.RLTrainer, state: TrainState, batch, minibatches: int):
  """The updates of one RL step on a host rollout `batch` (`rl.minibatches`, in `rl_config`).

  With one minibatch: one update on the whole batch, old_logp = stopgrad(logp). With k > 1: the
  policy's log-probs of the batch before any update become `old_logp`, and the rows are split
  into k strided minibatches (rows m, m + k, ...: a prompt's samples spread over all of them),
  one update each; from the second on, the ratio to old_logp departs from 1 and PPO's clip
  binds. Returns `(state, metrics)`: float means over the updates, except `loss_tokens` (the
  sum) and `logp_mismatch_max` (the max).
  """
  put = lambda b: put_batch(t, b)
  if minibatches > 1:
    old_logp = integrity.to_host(t.policy_logp(state.params, put(batch)))
    batch = {**batch, "old_logp": (old_logp * batch["loss_mask"]).astype(np.float32)}
  per_update = []
  for m in range(minibatches):
    state, metrics = t.train_step(state, put({k: v[m::minibatches] for k, v in batch.items()}))
    per_update.append({k: float(v) for k, v in jax.device_get(metrics).items()})
  metrics = {k: float(np.mean([u[k] for u in per_update])) for k in per_update[0]}
  metrics["loss_tokens"] = float(sum(u["loss_tokens"] for u in per_update))
  metrics["logp_mismatch_max"] = max(u["logp_mismatch_max"] for u in per_update)
  return state, metrics


def put_batch(t: rl_step.RLTrainer, batch) -> dict:
  """A host batch on the trainer's devices: every process holds the whole host batch; each
  device takes its rows (several processes included: a trainer launched as one JAX process
  per host)."""
  return {k: jax.make_array_from_callback(v.shape, t.batch_sharding, lambda index, v=v: v[index])
          for k, v in batch.items()}


def load_teachers(rl, tokenizer) -> dict:
  """{env name: (model config, params)} of `rl.teachers`, or {ANY_TASK: ...} of `rl.teacher`;
  a checkpoint named by several tasks is loaded once."""
  paths = dict(rl.teachers) if rl.teachers else {ANY_TASK: rl.teacher}
  loaded = {path: _load_teacher(path, tokenizer) for path in sorted(set(paths.values()))}
  return {name: loaded[path] for name, path in paths.items()}


def _load_teacher(workdir: str, tokenizer):
  run = load_run(workdir)
  check_vocab(tokenizer, run.model.vocab_size)
  logging.info("distillation teacher: %s, step %d", workdir, run.step)
  return ModelConfig.from_config(run.model), run.params
