"""The training loop, top to bottom: trainer (mesh, data, abstract state and shardings, jitted
steps) -> init or restore -> loop (metrics, eval, checkpoints) -> summary."""

import time

from absl import logging
import jax
import numpy as np

from glm5_jax import data as data_lib
from glm5_jax.api import abstract_params
from glm5_jax.config import ModelConfig
from glm5_jax.sharding import activation_sharding
from glm5_jax.train import checkpoint as ckpt
from glm5_jax.train.heldout import score_heldout
from glm5_jax.train.metrics import (MetricWriter, flops_per_token, peak_flops_per_device,
                                    progress_line)
from glm5_jax.train.state import merge_stage_params
from glm5_jax.train.stopping import StopSignal, any_process
from glm5_jax.train.workdir_lock import hold_workdir
from glm5_jax.train.trainer import build_trainer


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN/inf loss or gradient; the message names the step."""


def train(config, workdir: str, *, stop_after_steps: int | None = None) -> dict:
  """Trains per `config` in `workdir` (resuming from its latest checkpoint); returns a summary.

  Stopping early: SIGTERM (on any process), a preemption sync point, or `stop_after_steps`
  ends the run after the current step, once that step's checkpoint is committed; a later call
  resumes exactly.

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
  with hold_workdir(workdir, "training"):
    return _train(config, workdir, stop_after_steps)


def _train(config, workdir: str, stop_after_steps: int | None) -> dict:
  t = build_trainer(config)
  model, mesh, rules, train_iter = t.model, t.mesh, t.rules, t.train_iter
  total_steps = config.train.steps
  eval_batches = data_lib.make_eval_batches(
      config.data, num_batches=config.eval.batches, process_index=jax.process_index(),
      process_count=jax.process_count()) if config.eval.every_steps else []
  source_names = data_lib.source_names(config.data)
  answer_sources = {n for n in source_names if config.data.sources[n].kind == "synthetic"}

  # ---------------------------------------------------------------- init or restore
  manager = ckpt.make_manager(workdir, every_steps=config.ckpt.every_steps,
                              keep=config.ckpt.keep, async_save=config.ckpt.async_save)
  try:
    state = _init_or_restore(t, manager, config)
  except BaseException:
    _close_all(manager.close, train_iter.close, raise_first=False)
    raise

  # ---------------------------------------------------------------- loop
  writer = MetricWriter(workdir)
  tokens_per_step = config.data.batch_size * config.data.seq_len
  flops = flops_per_token(model, config.data.seq_len)
  peak = peak_flops_per_device()
  first_loss = last_metrics = eval_metrics = stop_reason = None
  start_step = int(state.step)
  interval_start, interval_steps = time.time(), 0
  pending = None  # (step, metrics) of the last dispatched step, read one step late
  closers = (manager.wait_until_finished, manager.close, writer.close, train_iter.close)
  # SIGTERM is only recorded from here until the last checkpoint is committed.
  with StopSignal() as sigterm:
    try:
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
          # The stop request is read once per step; that one value decides both the save and the
          # break (a SIGTERM arriving later in this step is seen by the next one).
          stop_reason = _stop_reason(
              signalled=any_process(sigterm.take()), preempted=manager.reached_preemption(done),
              budget_spent=stop_after_steps is not None and done - start_step >= stop_after_steps,
          ) if done < total_steps else None
          log_now = done % config.train.log_every_steps == 0 or done == total_steps
          save_now = (done % config.ckpt.every_steps == 0 or done == total_steps
                      or stop_reason is not None)
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
            writer.write(done, last_metrics)
            interval_start, interval_steps = time.time(), 0
          if config.eval.every_steps and (done % config.eval.every_steps == 0
                                          or done == total_steps):
            try:
              eval_metrics = score_heldout(t.dense_eval_step if dense_phase else t.eval_step,
                                           state.params, eval_batches, t.to_device, source_names,
                                           answer_sources)
            except Exception as e:
              e.add_note(f"held-out eval at step {done}")
              raise
            logging.info("eval at step %d: %s", done, _format(eval_metrics))
            writer.write(done, eval_metrics, prefix="eval")
          if save_now:
            try:
              ckpt.save(manager, state, train_iter, config, force=True)
            except Exception as e:
              e.add_note(f"saving step {done} in {manager.directory}")
              raise
          if stop_reason is not None:
            manager.wait_until_finished()  # committed before the log says so
            if manager.latest_step() != done:
              raise RuntimeError(f"stopping at step {done} ({stop_reason}): its checkpoint is not "
                                 f"in {manager.directory} (latest: {manager.latest_step()})")
            logging.warning("stopped early (%s) at step %d of %d: saved step %d in %s; rerun "
                            "with the same workdir to resume", stop_reason, done, total_steps,
                            done, manager.directory)
            break
      if pending is not None:
        last_metrics = _checked(*pending)
    except BaseException:
      # Still commit what can be committed, but never let a second failure (the same full
      # disk, say) replace the first or skip the rest of the cleanup.
      _close_all(*closers, raise_first=False)
      raise
    _close_all(*closers, raise_first=True)

  return {
      "steps": int(state.step), "total_steps": total_steps,
      "stopped_early": stop_reason is not None, "stop_reason": stop_reason,
      "first_loss": first_loss,
      "last_loss": last_metrics["loss"] if last_metrics else None,
      "last_metrics": last_metrics, "eval": eval_metrics,
      "tokens_per_sec": (last_metrics or {}).get("tokens_per_sec"),
      "checkpoints": str(manager.directory), "metrics_file": writer.path,
  }


def _init_or_restore(t, manager, config):
  """The workdir's latest checkpoint (verified); else `train.init_from`'s params; else a fresh
  init."""
  state = ckpt.restore_latest(manager, t.abstract_state, t.train_iter, config,
                              fallback=config.ckpt.restore_fallback)
  if state is not None:
    logging.info("resumed from %s at step %d", manager.directory, int(state.step))
    return state
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


def _close_all(*closers, raise_first: bool) -> None:
  """Calls every closer; then raises the first error (`raise_first`), else logs each."""
  first = None
  for close in closers:
    try:
      close()
    except Exception as e:  # pylint: disable=broad-except
      first = first or e
      if not raise_first:
        logging.error("while stopping after an error, %s also failed: %s",
                      getattr(close, "__qualname__", close), e)
  if first is not None and raise_first:
    raise first


def _stop_reason(*, signalled: bool, preempted: bool, budget_spent: bool) -> str | None:
  """Why the run stops after this step (None: it goes on)."""
  if signalled:
    return "SIGTERM"
  if preempted:
    return "preemption sync point"
  return "stop_after_steps" if budget_spent else None


def _checked(step: int, metrics) -> dict:
  """Host copy of one step's metrics; stops the run on a non-finite loss, gradient or updated
  params (so a checkpoint of this step is never written)."""
  metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
  bad = [k for k in ("loss", "grad_norm", "param_norm") if not np.isfinite(metrics[k])]
  if bad:
    values = ", ".join(f"{k}={metrics[k]}" for k in bad)
    raise NonFiniteLossError(f"step {step + 1}: non-finite {values}; stopping. The last "
                             "checkpoint written before it is intact.")
  return metrics


def _format(metrics: dict) -> str:
  return ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()) if isinstance(v, float))
