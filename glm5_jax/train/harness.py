"""The run harness every training loop shares: pre-training and SFT (`train.loop`), synchronous
RL (`posttrain.loop`) and the asynchronous RL trainer (`rl.async_trainer`).

A loop supplies only its own step and batches; the harness owns what every run needs around
them (after levanter's one `Trainer` with hooks and nanodo's `do_step` plus periodic actions):

  * the workdir lock (`workdir_lock.hold_workdir`), held for the whole run;
  * the SIGTERM flag (`stopping.StopSignal`), installed before anything is built, so a signal
    that arrives while the run builds or compiles stops it at its first step;
  * the orbax checkpoint manager with fingerprints and `ckpt.restore_fallback`
    (`checkpoint.save` / `restore_latest`);
  * the one stop decision per step (`stop_reason`: SIGTERM on any process, a preemption sync
    point, or the caller's step budget), its save and the check that the stopped step is
    committed (`stopped`); the entry points exit with `stopping.EXIT_STOPPED_EARLY` (75);
  * the NaN stop (`check_finite`), the save / eval cadence (`save_due`, `due`);
  * the metrics writer (`writer`, `<workdir>/metrics.jsonl` and TensorBoard);
  * closing everything on the way out, committing what can be committed and never letting a
    second failure hide the first.

    with RunHarness(workdir, "RL", config.ckpt, total_steps=n) as run:
      restored = run.restore(abstract_state, None, config, fingerprint=fp)
      for step in range(start, n):
        state, metrics = ...                  # the loop's own step
        done = step + 1
        stop = run.stop_reason(done)          # once per step, the same on every process
        if run.save_due(done, stop):
          run.save(state, None, config, step=done, fingerprint=fp)
        if stop:
          run.stopped(done, stop)
          break
"""

import contextlib

from absl import logging
import numpy as np

from glm5_jax.train import checkpoint as ckpt
from glm5_jax.train.metrics import MetricWriter
from glm5_jax.train.stopping import StopSignal, any_process
from glm5_jax.train.workdir_lock import hold_workdir


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN/inf loss or gradient; the message names the step."""


def check_finite(done: int, metrics: dict, keys=("loss",)) -> dict:
  """Stops the run on a non-finite value of `keys` in step `done`'s host `metrics` (so a
  checkpoint of that step is never written); returns `metrics`."""
  bad = [k for k in keys if not np.isfinite(metrics[k])]
  if bad:
    values = ", ".join(f"{k}={metrics[k]}" for k in bad)
    raise NonFiniteLossError(f"step {done}: non-finite {values}; stopping. The last "
                             "checkpoint written before it is intact.")
  return metrics


def close_all(*closers, raise_first: bool) -> None:
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


class RunHarness:
  """A context manager holding one run's lock, stop flag, checkpoint manager and metrics.

  Args:
    workdir: the run's directory (checkpoints under `<workdir>/checkpoints`).
    role: names the run in the lock file ("training", "RL", ...).
    ckpt_config: the `ckpt` section (every_steps, keep, async_save, restore_fallback).
    total_steps: the run's last step (it always saves; no stop decision after it).
    stop_after_steps: stop after this many steps of this call, as a job time limit would.
    every_steps / async_save: override the section's values (the asynchronous RL trainer
      checkpoints every step, synchronously).
  """

  def __init__(self, workdir: str, role: str, ckpt_config, *, total_steps: int,
               stop_after_steps: int | None = None, every_steps: int | None = None,
               async_save: bool | None = None):
    self.workdir, self.role, self.total_steps = workdir, role, total_steps
    self.stop_after_steps = stop_after_steps
    self.every_steps = ckpt_config.every_steps if every_steps is None else every_steps
    self.async_save = ckpt_config.async_save if async_save is None else async_save
    self.keep, self.fallback = ckpt_config.keep, ckpt_config.restore_fallback
    self._manager = self._writer = self.signal = None
    self._closers = []
    self._stack = contextlib.ExitStack()
    self._steps_taken = 0  # calls of stop_reason: steps of this call

  def __enter__(self) -> "RunHarness":
    with contextlib.ExitStack() as stack:  # unwound here only when something below fails
      stack.enter_context(hold_workdir(self.workdir, self.role))
      self.signal = stack.enter_context(StopSignal())
      self._stack = stack.pop_all()  # the lock and the flag, released by __exit__
    return self

  # The checkpoint manager and the metrics writer are made on first use, after the loop has
  # built (and so validated) its run: a config refused while building leaves no
  # `checkpoints/` or metrics behind in the workdir.
  @property
  def manager(self):
    """The workdir's orbax CheckpointManager (`checkpoint.make_manager`)."""
    if self._manager is None:
      self._manager = ckpt.make_manager(self.workdir, every_steps=self.every_steps,
                                        keep=self.keep, async_save=self.async_save)
    return self._manager

  @property
  def writer(self) -> MetricWriter:
    """The workdir's metrics writer (metrics.jsonl, TensorBoard)."""
    if self._writer is None:
      self._writer = MetricWriter(self.workdir)
    return self._writer

  def on_close(self, close) -> None:
    """Registers `close()` to run when the harness exits (after the checkpoint manager's last
    save is committed and it is closed, and the metrics writer is closed)."""
    self._closers.append(close)

  def __exit__(self, exc_type, exc, tb) -> None:
    # Still commit what can be committed after a failure, but never let a second failure (the
    # same full disk, say) replace the first or skip the rest of the cleanup.
    try:
      made = [c for c in (self._manager, self._writer) if c is not None]
      waits = [self._manager.wait_until_finished] if self._manager is not None else []
      close_all(*waits, *(c.close for c in made), *self._closers,
                raise_first=exc_type is None)
    finally:
      self._stack.close()

  # ---------------------------------------------------------------- checkpoints

  def restore(self, abstract_state, data_iterator, config, *, fingerprint: dict | None = None):
    """The workdir's latest intact checkpoint: `(TrainState, meta)` or None
    (`checkpoint.restore_latest`, with `ckpt.restore_fallback`)."""
    restored = ckpt.restore_latest(self.manager, abstract_state, data_iterator, config,
                                   fallback=self.fallback, fingerprint=fingerprint)
    if restored is not None:
      logging.info("resumed from %s at step %d (%s)", self.manager.directory,
                   restored[1]["step"], self.role)
    return restored

  def save(self, state, data_iterator, config, **kwargs) -> None:
    """`checkpoint.save` now (forced); an error names the step and directory."""
    step = kwargs.get("step", int(state.step))
    try:
      ckpt.save(self.manager, state, data_iterator, config, force=True, **kwargs)
    except Exception as e:
      e.add_note(f"saving step {step} in {self.manager.directory}")
      raise

  # ---------------------------------------------------------------- the stop decision

  def stop_reason(self, done: int) -> str | None:
    """Why the run stops after step `done` (None: it goes on). Call it once per step, on every
    process (a collective on several): the one value decides both the save and the break (a
    SIGTERM arriving later in this step is seen by the next one)."""
    self._steps_taken += 1
    if done >= self.total_steps:
      return None
    if any_process(self.signal.take()):
      return "SIGTERM"
    if self.manager.reached_preemption(done):
      return "preemption sync point"
    if self.stop_after_steps is not None and self._steps_taken >= self.stop_after_steps:
      return "stop_after_steps"
    return None

  def signalled(self) -> bool:
    """Whether any process saw SIGTERM (a collective on several processes), for a loop that
    waits between steps (the asynchronous trainer waiting for rollouts)."""
    return any_process(self.signal.take())

  def due(self, done: int, every: int) -> bool:
    """Whether a periodic action of cadence `every` (0: never) runs after step `done`: every
    `every` steps and after the last."""
    return bool(every) and (done % every == 0 or done == self.total_steps)

  def save_due(self, done: int, stop_reason: str | None) -> bool:
    return self.due(done, self.every_steps) or stop_reason is not None

  def stopped(self, done: int, stop_reason: str) -> None:
    """Waits for step `done`'s checkpoint to be committed before the log says so."""
    self.manager.wait_until_finished()
    if self.manager.latest_step() != done:
      raise RuntimeError(f"stopping at step {done} ({stop_reason}): its checkpoint is not "
                         f"in {self.manager.directory} (latest: {self.manager.latest_step()})")
    logging.warning("%s stopped early (%s) at step %d of %d: saved step %d in %s; rerun with "
                    "the same workdir to resume", self.role, stop_reason, done, self.total_steps,
                    done, self.manager.directory)
