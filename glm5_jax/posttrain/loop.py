"""The synchronous RL loop: generate -> score -> one train step, with checkpoints and exact
resume.

Each step n:
  1. rollouts: `rl.prompts_per_step` train tasks (indices n*P .. n*P + P - 1 of the env), G =
     `rl.group_size` samples each, through the engine with the current params
     (`rollout.generate_samples`, seed `step_seed(rl.seed, n)`); with dynamic sampling
     (`rl.dynamic_sampling_rounds` = R > 0) rounds r = 1..R draw the same P slots' refill
     tasks (`learning_signal.refill_task_index`) until P groups carry signal
     (`learning_signal.select_signal_groups`);
  2. scoring (`rl_update.score`): GRPO's group advantages of the rewards
     (`algorithms.group_advantages`; with `rl.null_reward_control` the rewards shuffled
     within each group first), or, with
     `rl.loss="distill"`, the teacher's per-token gap `stopgrad(logp_teacher - logp_rollout)`
     (`algorithms.distill_advantages`, the teacher being `rl.teacher`'s latest checkpoint);
     the starting policy's log-probs of the batch when `rl.log_kl` or `rl.kl_coef` > 0;
  3. one update (`rl_update.update` -> `rl_step.make_rl_train_step`).
Steps 2-3, the start, the checkpoints, the held-out evaluation and the step's record are those
the asynchronous trainer runs too (`rl_update`, `rl_run`); only step 1 is this loop's own.
Held-out accuracy (the first `rl.eval_tasks` eval-split tasks: greedy, one sample per task,
and `rl.eval_samples` samples per task at the rollout temperature; `rl_run.evaluate`) is
measured before the first step, every `rl.eval_every_steps` and after the last.

Exact resume: the rollouts of step n are a function of (rl.seed, n, params) only, and the state
(params, optimizer state, step) is checkpointed with orbax (`<workdir>/checkpoints/<step>`,
through the run harness every loop shares, `glm5_jax.train.harness`: fingerprints,
`ckpt.restore_fallback`, the workdir lock, SIGTERM; `rl_run.save`), so a run stopped after
step k and resumed reaches the params of an uninterrupted run.

Start (`rl_run.start_run`): the workdir's latest checkpoint; else `rl.init_from`'s latest
params (an SFT run, loaded into `config.model`); else (tests only) a fresh init from
`config.seed`.

Metrics per step go to `<workdir>/metrics.jsonl` (and TensorBoard) with a progress line:
reward and accuracy, response length, turns, truncated share, the step's metrics (policy loss,
clip fractions, IcePop-masked fraction, entropy, the train/rollout log-prob mismatch, gradient
and update norms), what tells signal from noise (`learning_signal.batch_signal_metrics`: groups
with no signal, lucky answers' share of the positive advantage, reward per difficulty;
`kl_to_start`),
and generation and train seconds; held-out accuracy as split "eval".
"""

import dataclasses
import time

from absl import logging
import numpy as np

from glm5_jax.config import require
from glm5_jax.posttrain import learning_signal, rl_run, rl_update, rollout
from glm5_jax.posttrain.rl_config_checks import validate_rl_experiment
from glm5_jax.seeds import derive_seed
from glm5_jax.sharding import activation_sharding
from glm5_jax.train.harness import RunHarness


def step_seed(seed: int, step: int) -> int:
  """The rollout seed of step `step` (a hash: steps never share sampling streams)."""
  return derive_seed("rl", seed, step)


def rl_train(config, workdir: str, *, stop_after_steps: int | None = None,
             params=None) -> dict:
  """Runs RL per `config` in `workdir` (resuming from its latest checkpoint).

  Stopping early (`glm5_jax.train.harness.RunHarness`): SIGTERM (also while the run is being
  built), a preemption sync point or `stop_after_steps` ends the run after the current step,
  once that step's checkpoint is committed; a later call resumes exactly.

  Args:
    stop_after_steps: stop after this many steps of this call, as a job time limit would.
    params: the starting params when the workdir has no checkpoint, instead of `rl.init_from`
      (which must then be empty); e.g. a caller's own model, or tests' random params.
  Returns:
    `steps`, `total_steps`, `stopped_early`, `stop_reason`, `eval` ({step: held-out metrics},
    those of earlier calls included), `first_eval` / `last_eval` (greedy accuracy),
    `first_sampled_eval` / `last_sampled_eval` (sampled accuracy; None without
    `rl.eval_samples`), `last_metrics`, `checkpoints` and `metrics_file`.
  """
  validate_rl_experiment(config)
  require(config.rl.rollout_via == "engine", "rl.rollout_via",
          f"the synchronous loop plays its rollouts on its own engine; got "
          f"{config.rl.rollout_via!r}, which the asynchronous rollout workers run "
          "(experiments/rl.py --mode=async)")
  with rl_run.open_run(config, workdir, "RL", stop_after_steps=stop_after_steps) as run:
    return _rl_train(config, run, params)


def _rl_train(config, run: RunHarness, initial_params):
  rl = config.rl
  start = rl_run.start_run(config, run, initial_params)
  t, env, tokenizer = start.trainer, start.env, start.tokenizer
  teacher = rl_update.load_teachers(rl, tokenizer) if rl.loss == "distill" else None
  # Earlier calls' evaluations come with the checkpoint: "before RL" is step 0's on a resume.
  held_out = rl_run.HeldOutEval(config, run, start,
                                {int(k): v for k, v in start.extra.get("evals", {}).items()})
  state, last_metrics, stop = start.state, None, None
  with activation_sharding(t.mesh, config.mesh.logical_axis_rules):
    held_out.at_start(start.step, state.params)
    for step in range(start.step, rl.steps):
      t0 = time.time()
      samples, step_metrics = step_samples(config, state.params, env, step, tokenizer, t.model)
      t1 = time.time()
      state, signal, metrics = rl_update.update(config, t, state, samples, env, step=step,
                                                teacher=teacher, reference=start.reference)
      t2 = time.time()
      step_metrics.update(signal)
      done = step + 1
      last_metrics = rl_run.step_record(config, samples, step_metrics, metrics, {
          "generate_seconds": t1 - t0, "train_seconds": t2 - t1})
      logging.info(rl_run.progress_line(done, rl.steps, last_metrics))
      run.writer.write(done, last_metrics)
      held_out.after_step(done, state.params)
      stop = run.stop_reason(done)
      if run.save_due(done, stop):
        rl_run.save(run, state, config, extra={"evals": held_out.evals})
      if stop:
        run.stopped(done, stop)
        break
  return rl_run.summary(config, run, steps=int(state.step) // rl.minibatches, stop=stop,
                        evals=held_out.evals, last_metrics=last_metrics,
                        checkpoints=str(run.manager.directory))


def step_samples(config, params, env, step: int, tokenizer, model) -> tuple[list, dict]:
  """`(samples, metrics)` of step `step`'s rollouts (module docstring, step 1): one round of
  `rl.prompts_per_step` tasks, or with dynamic sampling up to 1 + `rl.dynamic_sampling_rounds`
  rounds until that many groups carry signal. Metrics: `generation_rounds`, `signal_groups`
  and the generated samples' `generated_reward` (dynamic sampling only)."""
  rl = config.rl
  rounds = 1 + rl.dynamic_sampling_rounds
  pool, signal_groups, metrics = [], 0, {}
  for r in range(rounds):
    tasks = [env.task(learning_signal.refill_task_index(step * rl.prompts_per_step + i, r), "train")
             for i in range(rl.prompts_per_step)]
    seed = step_seed(rl.seed, step) if r == 0 else derive_seed("rl", rl.seed, step, "round", r)
    samples = rollout.generate_samples(config, params, env, tasks, seed=seed,
                                       tokenizer=tokenizer, model=model)
    if rounds == 1:
      return samples, metrics
    pool += [dataclasses.replace(s, group=s.group + r * rl.prompts_per_step) for s in samples]
    kept, signal_groups = learning_signal.select_signal_groups(pool, rl.prompts_per_step)
    if signal_groups == rl.prompts_per_step:
      break
  metrics.update(generation_rounds=float(r + 1), signal_groups=float(signal_groups),
                 generated_reward=float(np.mean([s.reward for s in pool])))
  return kept, metrics
