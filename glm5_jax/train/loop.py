"""The training loop, top to bottom: trainer (mesh, data, abstract state and shardings, jitted
steps) -> init or restore -> loop (metrics, eval, checkpoints) -> summary."""

import time

from absl import logging
import jax

from glm5_jax import data as data_lib
from glm5_jax.api import abstract_params
from glm5_jax.config import ModelConfig
from glm5_jax.sharding import activation_sharding
from glm5_jax.train import checkpoint as ckpt
from glm5_jax.train.heldout import score_heldout
# NonFiniteLossError: raised by train (callers import it from here).
from glm5_jax.train.harness import NonFiniteLossError, RunHarness, check_finite  # noqa: F401
from glm5_jax.train.metrics import flops_per_token, peak_flops_per_device, progress_line
from glm5_jax.train.state import merge_stage_params
from glm5_jax.train.trainer import build_trainer


def train(config, workdir: str, *, stop_after_steps: int | None = None) -> dict:
  """Trains per `config` in `workdir` (resuming from its latest checkpoint); returns a summary.

  Stopping early: SIGTERM (on any process, also while the run is still being built), a
  preemption sync point, or `stop_after_steps` ends the run after the current step, once that
  step's checkpoint is committed; a later call resumes exactly (`harness.RunHarness`).

  Args:
    stop_after_steps: stop after this many steps of this invocation, as a job time limit would.
  Returns:
    `steps` (reached), `total_steps` (`train.steps`), `stopped_early` and `stop_reason`
    ("SIGTERM", "preemption sync point", "stop_after_steps" or None), `first_loss`,
    `last_loss`, `last_metrics`, `eval` (the last held-out scores), `tokens_per_sec`,
    `checkpoints` (directory) and `metrics_file`.
  Raises:
    WorkdirLockedError: another live process trains (or sweeps) in `workdir`; the message
      names its pid and host. The lock is held until this call returns.
  Multi-host: call `jax.distributed.initialize()` first (experiments/train.py does).
  """
  with RunHarness(workdir, "training", config.ckpt, total_steps=config.train.steps,
                  stop_after_steps=stop_after_steps) as run:
    return _train(config, run)


def _train(config, run: RunHarness) -> dict:
  t = build_trainer(config)
  model, mesh, rules, train_iter = t.model, t.mesh, t.rules, t.train_iter
  run.on_close(train_iter.close)
  total_steps = config.train.steps
  eval_batches = data_lib.make_eval_batches(
      config.data, num_batches=config.eval.batches, process_index=jax.process_index(),
      process_count=jax.process_count()) if config.eval.every_steps else []
  source_names = data_lib.source_names(config.data)
  answer_sources = {n for n in source_names if config.data.sources[n].kind == "synthetic"}
  state = _init_or_restore(t, run, config)

  # ---------------------------------------------------------------- loop
  tokens_per_step = config.data.batch_size * config.data.seq_len
  flops = flops_per_token(model, config.data.seq_len)
  peak = peak_flops_per_device()
  first_loss = last_metrics = eval_metrics = stop_reason = None
  start_step = int(state.step)
  interval_start, interval_steps = time.time(), 0
  pending = None  # (step, metrics) of the last dispatched step, read one step late
  with activation_sharding(mesh, rules):
    for step in range(start_step, total_steps):
      dense_phase = step < t.dense_steps
      if step == t.dense_steps and t.dense_steps:
        logging.info("step %d: DSA dense phase over, top-k attention on", step)
      train_step = t.dense_train_step if dense_phase else t.train_step
      state, metrics = train_step(state, t.to_device(next(train_iter)))
      if pending is not None:  # never wait on the step just dispatched (STYLE habit 7)
        last_metrics = _checked(*pending)
        first_loss = last_metrics["loss"] if first_loss is None else first_loss
      pending, interval_steps = (step, metrics), interval_steps + 1
      done = step + 1
      stop_reason = run.stop_reason(done)
      log_now = done % config.train.log_every_steps == 0 or done == total_steps
      save_now = run.save_due(done, stop_reason)
      if log_now or save_now:  # these need this step's numbers: sync once
        last_metrics = _checked(*pending)
        first_loss = last_metrics["loss"] if first_loss is None else first_loss
        pending = None
      if log_now:
        elapsed = time.time() - interval_start
        last_metrics["tokens_per_sec"] = tokens_per_step * interval_steps / elapsed
        last_metrics["tflops_per_sec"] = last_metrics["tokens_per_sec"] * flops / 1e12
        last_metrics["mfu"] = (last_metrics["tflops_per_sec"] * 1e12 / (
            peak * jax.device_count()) if peak else None)
        logging.info(progress_line(done, total_steps, last_metrics))
        run.writer.write(done, last_metrics)
        interval_start, interval_steps = time.time(), 0
      if run.due(done, config.eval.every_steps):
        try:
          eval_metrics = score_heldout(t.dense_eval_step if dense_phase else t.eval_step,
                                       state.params, eval_batches, t.to_device, source_names,
                                       answer_sources)
        except Exception as e:
          e.add_note(f"held-out eval at step {done}")
          raise
        logging.info("eval at step %d: %s", done, _format(eval_metrics))
        run.writer.write(done, eval_metrics, prefix="eval")
      if save_now:
        run.save(state, train_iter, config)
      if stop_reason is not None:
        run.stopped(done, stop_reason)
        break
  if pending is not None:
    last_metrics = _checked(*pending)

  return {
      "steps": int(state.step), "total_steps": total_steps,
      "stopped_early": stop_reason is not None, "stop_reason": stop_reason,
      "first_loss": first_loss,
      "last_loss": last_metrics["loss"] if last_metrics else None,
      "last_metrics": last_metrics, "eval": eval_metrics,
      "tokens_per_sec": (last_metrics or {}).get("tokens_per_sec"),
      "checkpoints": str(run.manager.directory), "metrics_file": run.writer.path,
  }


def _init_or_restore(t, run: RunHarness, config):
  """The workdir's latest checkpoint (verified); else `train.init_from`'s params; else a fresh
  init."""
  restored = run.restore(t.abstract_state, t.train_iter, config)
  if restored is not None:
    return restored[0]
  state = t.init_state()
  if config.train.init_from:
    loaded, source_model = ckpt.restore_params_from(config.train.init_from, abstract_params)
    params = merge_stage_params(state.params, loaded, f"{config.train.init_from} "
                                f"(pattern {source_model['attention_pattern']})",
                                fresh_model=t.model,
                                loaded_model=ModelConfig.from_config(source_model))
    params = jax.device_put(params, t.params_sharding)
    opt_state = jax.jit(t.optimizer.init, out_shardings=t.state_sharding.opt_state)(params)
    state = state.replace(params=params, opt_state=opt_state)
    logging.info("initialized params from %s", config.train.init_from)
  return state


def _checked(step: int, metrics) -> dict:
  """Host copy of one step's metrics; stops the run on a non-finite loss, gradient or updated
  params (so a checkpoint of this step is never written)."""
  metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
  return check_finite(step + 1, metrics, ("loss", "grad_norm", "param_norm"))


def _format(metrics: dict) -> str:
  return ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()) if isinstance(v, float))
