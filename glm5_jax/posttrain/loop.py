"""The synchronous RL loop: generate -> score -> one train step, with checkpoints and exact
resume.

Each step n:
  1. rollouts: `rl.prompts_per_step` train tasks (indices n*P .. n*P + P - 1 of the env), G =
     `rl.group_size` samples each, through the engine with the current params
     (`rollout.generate_samples`, seed `step_seed(rl.seed, n)`); with dynamic sampling
     (`rl.dynamic_sampling_rounds` = R > 0) rounds r = 1..R draw the same P slots' refill
     tasks (`learning_signal.refill_task_index`) until P groups carry signal
     (`learning_signal.select_signal_groups`);
  2. scoring: GRPO's group advantages of the rewards (`algorithms.group_advantages`; with
     `rl.null_reward_control` the rewards shuffled within each group first), or, with
     `rl.loss="distill"`, the teacher's per-token gap `stopgrad(logp_teacher - logp_rollout)`
     (`algorithms.distill_advantages`, the teacher being `rl.teacher`'s latest checkpoint);
     the starting policy's log-probs of the batch when `rl.log_kl` or `rl.kl_coef` > 0;
  3. one update (`rl_step.make_rl_train_step`).
Held-out accuracy (the first `rl.eval_tasks` eval-split tasks: greedy, one sample per task,
and `rl.eval_samples` samples per task at the rollout temperature; `evaluate`) is measured
before the first step, every `rl.eval_every_steps` and after the last.

Exact resume: the rollouts of step n are a function of (rl.seed, n, params) only, and the state
(params, optimizer state, step) is checkpointed with orbax (`<workdir>/checkpoints/<step>`,
through the run harness every loop shares, `glm5_jax.train.harness`: fingerprints,
`ckpt.restore_fallback`, the workdir lock, SIGTERM), so a run stopped after step k and resumed
reaches the params of an uninterrupted run.

Start: the workdir's latest checkpoint; else `rl.init_from`'s latest params (an SFT run, loaded
into `config.model`); else (tests only) a fresh init from `config.seed`.

Metrics per step go to `<workdir>/metrics.jsonl` (and TensorBoard) with a progress line:
reward and accuracy, response length, turns, truncated share, the step's metrics (policy loss,
clip fractions, IcePop-masked fraction, entropy, the train/rollout log-prob mismatch, gradient
and update norms), what tells signal from noise (`learning_signal.batch_signal_metrics`: groups
with no signal, lucky answers' share of the positive advantage, reward per difficulty;
`kl_to_start`),
and generation and train seconds; held-out accuracy as split "eval".
"""

import dataclasses
import json
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from glm5_jax.api import abstract_params, init_params
from glm5_jax.config import ModelConfig, require
from glm5_jax.data import check_vocab, make_tokenizer
from glm5_jax.eval.checkpoints import load_run
from glm5_jax.posttrain import algorithms, learning_signal, rollout, rl_step, sandbox
from glm5_jax.posttrain import tasks as tasks_lib
from glm5_jax.posttrain.rl_config_checks import validate_rl_experiment
from glm5_jax.seeds import derive_seed
from glm5_jax.sharding import activation_sharding
from glm5_jax.train import integrity
from glm5_jax.train.harness import RunHarness, check_finite
from glm5_jax.train.state import TrainState

EVAL_SEED = 0  # greedy decoding draws nothing; the seed only names the requests
# Fields of `rl` a resume may change: they decide how long and how often, not what is computed.
RESUMABLE_RL_FIELDS = ("steps", "eval_every_steps", "eval_tasks", "eval_samples", "init_from",
                       "policy_keep", "worker_groups", "worker_warmup", "poll_seconds",
                       "stall_seconds", "log_kl")


def step_seed(seed: int, step: int) -> int:
  """The rollout seed of step `step` (a hash: steps never share sampling streams)."""
  return derive_seed("rl", seed, step)


def rl_fingerprint(config) -> dict:
  """What a resume must match: model, optimizer, data (tokenizer, seq_len), and the rl section
  except `RESUMABLE_RL_FIELDS`."""
  rl = {k: v for k, v in json.loads(config.rl.to_json()).items() if k not in RESUMABLE_RL_FIELDS}
  return {"model": json.loads(config.model.to_json()), "optim": json.loads(config.optim.to_json()),
          "data": {"tokenizer": config.data.tokenizer, "seq_len": config.data.seq_len},
          "rl": rl, "seed": config.seed}


def evaluate(config, params, env, tokenizer, *, num_tasks: int) -> dict:
  """Held-out metrics on the first `num_tasks` eval tasks: greedy (one sample per task:
  `accuracy`, `reward`, `response_length`, ...) and, with `rl.eval_samples` = k > 0, k samples
  per task at the rollout temperature: `sampled_accuracy` (their mean, what RL maximizes),
  `sampled_reward` and `pass_at_k` (a task solved by any of its k samples).

  A task mixture is evaluated per environment (`num_tasks` eval tasks of each, weight 0
  included): each one's metrics as `<env>/<metric>`, and the unweighted means over the
  environments under the plain names."""
  members = tasks_lib.member_envs(env)
  if len(members) == 1 and next(iter(members.values())) is env:
    return _evaluate_env(config, params, env, tokenizer, num_tasks=num_tasks)
  out = {}
  for name, member in members.items():
    metrics = _evaluate_env(config, params, member, tokenizer, num_tasks=num_tasks)
    out.update({f"{name}/{k}": v for k, v in metrics.items()})
  for metric in {k.split("/", 1)[1] for k in out}:
    out[metric] = tasks_lib.mean_over_envs(out, metric)
  return out


def _evaluate_env(config, params, env, tokenizer, *, num_tasks: int) -> dict:
  tasks = [env.task(i, "eval") for i in range(num_tasks)]
  greedy = rollout.generate_samples(config, params, env, tasks, seed=EVAL_SEED, group_size=1,
                                    temperature=0.0, tokenizer=tokenizer)
  metrics = rollout.rollout_metrics(greedy)
  k = config.rl.eval_samples
  if k:
    sampled = rollout.generate_samples(config, params, env, tasks, seed=EVAL_SEED, group_size=k,
                                       tokenizer=tokenizer)
    correct_NK = np.asarray([s.correct for s in sampled], np.float32).reshape(num_tasks, k)
    metrics.update(sampled_accuracy=float(correct_NK.mean()),
                   sampled_reward=float(np.mean([s.reward for s in sampled])),
                   pass_at_k=float(correct_NK.max(axis=1).mean()))
  return metrics


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
  hide_run_from_sandbox(config, workdir)
  with RunHarness(workdir, "RL", config.ckpt, total_steps=config.rl.steps,
                  stop_after_steps=stop_after_steps) as run:
    return _rl_train(config, run, params)


def hide_run_from_sandbox(config, workdir) -> None:
  """Model-written code (the code envs) must not see the run: its workdir, the checkpoint it
  starts from and its teacher are hidden from every sandboxed program of this process."""
  sandbox.hide_in_this_process(workdir, config.rl.init_from, config.rl.teacher,
                               *config.rl.teachers.values())


def build_rl_run(config, *, asynchronous: bool = False):
  """`(tokenizer, env, shapes, trainer)` of an RL run: the tokenizer (checked against the
  model's vocabulary), `rl.env`, the params' shapes and `rl_step.build_rl_trainer`'s trainer."""
  model = ModelConfig.from_config(config.model)  # validated and expanded once per run
  tokenizer = make_tokenizer(config.data.tokenizer)
  check_vocab(tokenizer, model.vocab_size)
  env = tasks_lib.make_env(config.rl)
  shapes = abstract_params(model)
  return tokenizer, env, shapes, rl_step.build_rl_trainer(config, model, shapes,
                                                          asynchronous=asynchronous)


def _rl_train(config, run: RunHarness, initial_params):
  rl = config.rl
  tokenizer, env, shapes, t = build_rl_run(config)
  teacher = load_teachers(rl, tokenizer) if rl.loss == "distill" else None
  state, extra, reference = init_or_restore(config, run, t, shapes, initial_params)
  start = int(state.step) // rl.minibatches
  # Earlier calls' evaluations come with the checkpoint: "before RL" is step 0's on a resume.
  evals = {int(k): v for k, v in extra.get("evals", {}).items()}
  last_metrics = stop = None
  with activation_sharding(t.mesh, config.mesh.logical_axis_rules):
    if start == 0 and rl.eval_every_steps:
      evals[0] = evaluate_and_log(config, state.params, env, tokenizer, run.writer, 0)
    for step in range(start, rl.steps):
      t0 = time.time()
      samples, step_metrics = step_samples(config, state.params, env, step, tokenizer, t.model)
      t1 = time.time()
      batch = score(config, samples, teacher, step=step)
      step_metrics.update(signal_metrics(config, samples, batch, env))
      if reference is not None:
        add_reference_logp(t, reference, batch, step_metrics, rl.kl_coef > 0)
      state, metrics = train_on_batch(t, state, batch, rl.minibatches)
      t2 = time.time()
      done = step + 1
      check_finite(done, metrics)
      last_metrics = {**rollout.rollout_metrics(samples), **step_metrics, **metrics,
                      "generate_seconds": t1 - t0, "train_seconds": t2 - t1}
      if rl.env == tasks_lib.MIXTURE:
        last_metrics.update(rollout.metrics_by_env(samples))
      logging.info(progress_line(done, rl.steps, last_metrics))
      run.writer.write(done, last_metrics)
      if run.due(done, rl.eval_every_steps):
        evals[done] = evaluate_and_log(config, state.params, env, tokenizer, run.writer, done)
      stop = run.stop_reason(done)
      if run.save_due(done, stop):
        save(run, state, config, extra={"evals": evals})
      if stop:
        run.stopped(done, stop)
        break
  first, last = (evals[min(evals)], evals[max(evals)]) if evals else ({}, {})
  return {"steps": int(state.step) // rl.minibatches, "total_steps": rl.steps,
          "stopped_early": stop is not None, "stop_reason": stop, "eval": evals,
          "first_eval": first.get("accuracy"), "last_eval": last.get("accuracy"),
          "first_sampled_eval": first.get("sampled_accuracy"),
          "last_sampled_eval": last.get("sampled_accuracy"),
          "last_metrics": last_metrics, "checkpoints": str(run.manager.directory),
          "metrics_file": run.writer.path}


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


def signal_metrics(config, samples, batch, env) -> dict:
  """`learning_signal.batch_signal_metrics` of a GRPO batch (per-sample advantages read back
  from its per-token ones); {} for distillation, whose advantages are per token."""
  if config.rl.loss != "grpo":
    return {}
  mask = batch["loss_mask"]
  advantages = (batch["advantages"] * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1.0)
  return learning_signal.batch_signal_metrics(samples, advantages, difficulty=env.difficulty)


def wants_reference(config) -> bool:
  """Whether the run keeps the starting policy's params: `kl_to_start` (`rl.log_kl`) and the
  KL penalty (`rl.kl_coef`) both read them."""
  return bool(config.rl.log_kl or config.rl.kl_coef > 0)


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


def progress_line(step: int, total: int, m: dict) -> str:
  """`rl step 3/100 | reward 0.41 acc 0.39 | len 31.2 | loss ... | gen 1.2s train 0.4s`"""
  return " | ".join([
      f"rl step {step}/{total}", f"reward {m['reward']:.3f} acc {m['accuracy']:.3f}",
      f"len {m['response_length']:.1f}", f"loss {m['loss']:.4f}", f"entropy {m['entropy']:.3f}",
      *([f"is-masked {m['is_masked_fraction']:.3f}"] if "is_masked_fraction" in m else
        [f"clip {m['clip_low_fraction']:.3f}/{m['clip_high_fraction']:.3f}",
         f"icepop {m['icepop_masked_fraction']:.3f}"]),
      f"mismatch {m['logp_mismatch_mean']:.1e}",
      f"gnorm {m['grad_norm']:.2f} update {m['update_norm']:.3f}",
      *([f"no-signal {m['zero_signal_groups']:.2f}"] if "zero_signal_groups" in m else []),
      *([f"kl {m['kl_to_start']:.4f}"] if "kl_to_start" in m else []),
      f"gen {m['generate_seconds']:.1f}s train {m['train_seconds']:.1f}s"])


def evaluate_and_log(config, params, env, tokenizer, writer, step) -> dict:
  t0 = time.time()
  metrics = evaluate(config, params, env, tokenizer, num_tasks=config.rl.eval_tasks)
  metrics["seconds"] = time.time() - t0
  sampled = ""
  if "sampled_accuracy" in metrics:
    sampled = (f"; sampled (T={config.rl.temperature:g}, {config.rl.eval_samples} per task) "
               f"{metrics['sampled_accuracy']:.3f}, pass@{config.rl.eval_samples} "
               f"{metrics['pass_at_k']:.3f}")
  logging.info("rl eval at step %d on %d %s eval tasks: greedy accuracy %.3f%s; response "
               "length %.1f", step, config.rl.eval_tasks, env.name, metrics["accuracy"], sampled,
               metrics["response_length"])
  writer.write(step, metrics, prefix="eval")
  return metrics


ANY_TASK = "*"  # the key of `rl.teacher`, the one teacher of every sample


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


# ---- checkpoints -------------------------------------------------------------------------------


def save(run: RunHarness, state: TrainState, config, extra: dict | None = None) -> None:
  """Saves the RL state as checkpoint `<RL step>` (`state.step` counts optimizer updates,
  `rl.minibatches` per RL step; the meta item records both): params, optimizer state, and as
  in pre-training the config fingerprint (`rl_fingerprint`) and array checksums
  (`glm5_jax.train.checkpoint.save`); there is no data iterator, the rollouts being a function
  of the step. `extra` (JSON-able) is stored in the meta item too: the held-out evaluations so
  far, and the asynchronous trainer's ledger of consumed rollout files and staleness counts
  (`glm5_jax.rl.async_trainer`)."""
  run.save(state, None, config, step=int(state.step) // config.rl.minibatches,
           fingerprint=rl_fingerprint(config), extra=extra or {})


def init_or_restore(config, run: RunHarness, t: rl_step.RLTrainer, shapes,
                    params=None) -> tuple[TrainState, dict, Any]:
  """`(state, extra, reference)`: the workdir's latest intact checkpoint (with
  `ckpt.restore_fallback`, a damaged latest step is moved aside and the one before resumed) and
  the `extra` saved with it; else `params`, `rl.init_from`'s latest params or (tests only) a
  fresh init, and {}. `reference`: the starting policy's params placed as the state's, for
  `kl_to_start` and the KL penalty (None unless `wants_reference`): a copy of the fresh state's
  params, loaded again (`starting_params`) only on a resume, so a resumed run has the same one."""
  abstract = jax.eval_shape(lambda p: rl_step.init_rl_state(p, t.optimizer), shapes)
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          abstract, t.state_sharding)
  restored = run.restore(abstract, None, config, fingerprint=rl_fingerprint(config))
  if restored is not None:  # placed as `abstract` is: as the step's outputs
    state, meta = restored
    reference = (jax.device_put(starting_params(config, params), t.state_sharding.params)
                 if wants_reference(config) else None)
    return state, meta.get("extra", {}), reference
  # Placed first: the params come from one process's devices (a fresh init, or restored).
  placed = jax.device_put(starting_params(config, params, log=True), t.state_sharding.params)
  # A copy: the state's params may be these very buffers, and the train step donates the state.
  reference = jax.tree.map(lambda x: x.copy(), placed) if wants_reference(config) else None
  return t.init_state(placed), {}, reference


def starting_params(config, params=None, *, log: bool = False):
  """The params a fresh RL run starts from: `params` (a caller's own), else `rl.init_from`'s
  latest params, else (tests only) a fresh init from `config.seed`."""
  if params is not None:
    if config.rl.init_from:
      raise ValueError(f"rl_train: params given and rl.init_from={config.rl.init_from!r}; give "
                       "one starting point")
    return params
  if config.rl.init_from:
    source = load_run(config.rl.init_from, target_model=config.model)
    if log:
      logging.info("RL starts from %s (step %d)", config.rl.init_from, source.step)
    return source.params
  if log:
    logging.warning("rl.init_from is empty: RL starts from freshly initialized params (seed %d)",
                    config.seed)
  return init_params(config.model, jax.random.key(config.seed))
