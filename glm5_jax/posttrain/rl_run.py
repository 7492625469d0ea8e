"""An RL run, whichever loop drives it: what the synchronous loop (`loop.rl_train`) and the
asynchronous trainer (`glm5_jax.rl.async_trainer`) both do around their steps.

  open_run      hides the run from sandboxed programs, then the run harness every loop shares
                (`glm5_jax.train.harness.RunHarness`: lock, SIGTERM, orbax checkpoints)
  start_run     the tokenizer, `rl.env`, the trainer (`build_rl_run`) and the state: the
                workdir's latest checkpoint and its `extra`, else the starting params
                (`params`, `rl.init_from`'s latest, or (tests only) a fresh init from
                `config.seed`), and the starting policy's params when the run keeps them
  save          checkpoint `<RL step>` with the RL fingerprint (`rl_fingerprint`) and `extra`
  HeldOutEval   held-out accuracy (`evaluate`: greedy and `rl.eval_samples` sampled) before
                the first step, every `rl.eval_every_steps` and after the last
  step_record   a step's metrics: the rollouts', each loop's own, per env of a mixture
  progress_line a step's log line
  summary       what a run returns: steps, stop reason, the held-out evaluations

How samples are gathered and trained on differs by loop only in the gathering: both train with
`rl_update.update`.
"""

import dataclasses
import json
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from glm5_jax.api import abstract_params, init_params
from glm5_jax.config import ModelConfig
from glm5_jax.data import check_vocab, make_tokenizer
from glm5_jax.eval.checkpoints import load_run
from glm5_jax.posttrain import rollout, rl_step, sandbox
from glm5_jax.posttrain import tasks as tasks_lib
from glm5_jax.train.harness import RunHarness
from glm5_jax.train.state import TrainState

EVAL_SEED = 0  # greedy decoding draws nothing; the seed only names the requests
# Fields of `rl` a resume may change: they decide how long and how often, not what is computed.
RESUMABLE_RL_FIELDS = ("steps", "eval_every_steps", "eval_tasks", "eval_samples", "init_from",
                       "policy_keep", "worker_groups", "worker_warmup", "poll_seconds",
                       "stall_seconds", "log_kl")


def rl_fingerprint(config) -> dict:
  """What a resume must match: model, optimizer, data (tokenizer, seq_len), and the rl section
  except `RESUMABLE_RL_FIELDS`."""
  rl = {k: v for k, v in json.loads(config.rl.to_json()).items() if k not in RESUMABLE_RL_FIELDS}
  return {"model": json.loads(config.model.to_json()), "optim": json.loads(config.optim.to_json()),
          "data": {"tokenizer": config.data.tokenizer, "seq_len": config.data.seq_len},
          "rl": rl, "seed": config.seed}


# ---- opening and starting a run ------------------------------------------------------------


def hide_run_from_sandbox(config, workdir) -> None:
  """Model-written code (the code envs) must not see the run: its workdir, the checkpoint it
  starts from and its teacher are hidden from every sandboxed program of this process."""
  sandbox.hide_in_this_process(workdir, config.rl.init_from, config.rl.teacher,
                               *config.rl.teachers.values())


def open_run(config, workdir: str, role: str, *, stop_after_steps: int | None,
             **harness_options) -> RunHarness:
  """The run's harness over `workdir` (`RunHarness`; `harness_options`: its keywords), the run
  hidden from sandboxed programs first. Enter it (`with`) to take the lock."""
  hide_run_from_sandbox(config, workdir)
  return RunHarness(str(workdir), role, config.ckpt, total_steps=config.rl.steps,
                    stop_after_steps=stop_after_steps, **harness_options)


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


@dataclasses.dataclass
class Start:
  """Where a run starts: its pieces (`build_rl_run`) and state (`init_or_restore`)."""
  tokenizer: Any
  env: Any
  trainer: rl_step.RLTrainer
  state: TrainState
  extra: dict  # saved with the restored checkpoint ({} on a fresh start)
  reference: Any  # the starting policy's params, or None (`wants_reference`)
  step: int  # RL steps done (`state.step` counts updates, `rl.minibatches` per RL step)


def start_run(config, run: RunHarness, params=None, *, asynchronous: bool = False) -> Start:
  """The run built (`build_rl_run`) and its state restored or started (`init_or_restore`)."""
  tokenizer, env, shapes, t = build_rl_run(config, asynchronous=asynchronous)
  state, extra, reference = init_or_restore(config, run, t, shapes, params)
  return Start(tokenizer, env, t, state, extra, reference,
               step=int(state.step) // config.rl.minibatches)


def wants_reference(config) -> bool:
  """Whether the run keeps the starting policy's params: `kl_to_start` (`rl.log_kl`) and the
  KL penalty (`rl.kl_coef`) both read them."""
  return bool(config.rl.log_kl or config.rl.kl_coef > 0)


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


def save(run: RunHarness, state: TrainState, config, extra: dict | None = None) -> None:
  """Saves the RL state as checkpoint `<RL step>` (`state.step` counts optimizer updates,
  `rl.minibatches` per RL step; the meta item records both): params, optimizer state, and as
  in pre-training the config fingerprint (`rl_fingerprint`) and array checksums
  (`glm5_jax.train.checkpoint.save`); there is no data iterator, the rollouts being a function
  of the step. `extra` (JSON-able) is stored in the meta item too: the synchronous loop's
  held-out evaluations so far, and the asynchronous trainer's ledger of consumed rollout files
  and staleness counts (`glm5_jax.rl.async_trainer`)."""
  run.save(state, None, config, step=int(state.step) // config.rl.minibatches,
           fingerprint=rl_fingerprint(config), extra=extra or {})


# ---- held-out evaluation -------------------------------------------------------------------


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


def evaluate_and_log(config, params, env, tokenizer, writer, step) -> dict:
  """`evaluate` on `rl.eval_tasks` tasks, logged and written as split "eval" at `step`, with
  its wall time as `seconds`."""
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


class HeldOutEval:
  """The run's held-out evaluation schedule: before the first step of a fresh run and after
  every `rl.eval_every_steps` steps and the last (none with 0). `evals`: {step: metrics}, those
  a resumed run was given included; `seconds`: the wall time of this call's evaluations."""

  def __init__(self, config, run: RunHarness, start: Start, evals: dict | None = None):
    self.config, self.run, self.env, self.tokenizer = config, run, start.env, start.tokenizer
    self.evals = dict(evals or {})
    self.seconds = 0.0

  def at_start(self, step: int, params) -> None:
    if step == 0 and self.config.rl.eval_every_steps:
      self._evaluate(0, params)

  def after_step(self, done: int, params) -> None:
    if self.run.due(done, self.config.rl.eval_every_steps):
      self._evaluate(done, params)

  def _evaluate(self, step: int, params) -> None:
    t0 = time.time()
    self.evals[step] = evaluate_and_log(self.config, params, self.env, self.tokenizer,
                                        self.run.writer, step)
    self.seconds += time.time() - t0


# ---- each step's record, and the run's ------------------------------------------------------


def step_record(config, samples, *parts: dict) -> dict:
  """A step's metrics: the rollouts' (`rollout.rollout_metrics`), then each of `parts` in order
  (the loop's own: signal, train step, timings), then a task mixture's per environment."""
  record = rollout.rollout_metrics(samples)
  for part in parts:
    record.update(part)
  if config.rl.env == tasks_lib.MIXTURE:
    record.update(rollout.metrics_by_env(samples))
  return record


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


def summary(config, run: RunHarness, *, steps: int, stop: str | None, evals: dict,
            **more) -> dict:
  """What a run returns: `steps`, `total_steps`, `stopped_early`, `stop_reason`, `eval`
  ({step: held-out metrics}), `first_eval` / `last_eval` (greedy accuracy),
  `first_sampled_eval` / `last_sampled_eval` (sampled accuracy; None without
  `rl.eval_samples`), the loop's own (`more`) and `metrics_file`."""
  first, last = (evals[min(evals)], evals[max(evals)]) if evals else ({}, {})
  return {"steps": steps, "total_steps": config.rl.steps, "stopped_early": stop is not None,
          "stop_reason": stop, "eval": evals,
          "first_eval": first.get("accuracy"), "last_eval": last.get("accuracy"),
          "first_sampled_eval": first.get("sampled_accuracy"),
          "last_sampled_eval": last.get("sampled_accuracy"),
          **more, "metrics_file": run.writer.path}
