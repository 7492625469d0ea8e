"""Runs experiments/train.py as a user would, in a subprocess, on a 2-layer tiny config; with
optional fault hooks installed first (the tests' way of making a fault land at a chosen moment).

  python tests/train_cli.py [--hook=NAME:ARG ...] [--script=experiments/rl.py] [flags...]

(`--script`: another entry point than experiments/train.py, with its own flags.)

Hooks (test-only, installed by monkeypatching before the script runs):
  sigterm_after_log:N   a real SIGTERM to this process right after step N's metrics are
                        written: after that step's save decision, before its eval and break.
  enospc_on_save:N      `checkpoint.save` of step N raises OSError(ENOSPC), as a full disk does.
  losses_to:DIR         every step's metrics, as the loop reads them back, appended to
                        DIR/losses_<process index>.jsonl (on every process, unlike metrics.jsonl).
  concat_shards:N       one process trains on what N processes would read: each batch is the
                        concatenation of the local batches of processes 0..N-1 (the reference
                        for a multi-process run).
"""

import errno
import os
import runpy
import signal
import subprocess
import sys

import grain
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_FLAGS = (
    "--config=configs/tiny.py", "--config.model.num_hidden_layers=2",
    "--config.model.first_k_dense_replace=1", "--config.model.mtp_depths=2",
    "--config.data.seq_len=256", "--config.data.batch_size=4", "--config.data.prefetch=0",
    "--config.train.log_every_steps=1", "--config.train.dsa_dense_steps=0",
    "--config.optim.warmup_steps=1", "--config.eval.every_steps=0",
)


def command(workdir, *flags, hook=None) -> dict:
  """`subprocess` keyword arguments running experiments/train.py on the small config in
  `workdir`; `flags` override. `hook`: one hook or a sequence of them."""
  hooks = [hook] if isinstance(hook, str) else list(hook or ())
  args = [sys.executable, os.path.abspath(__file__)] + [f"--hook={h}" for h in hooks]
  return dict(args=args + [*SMALL_FLAGS, f"--workdir={workdir}", *flags], cwd=ROOT,
              env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))


def run(workdir, *flags, hook=None, timeout=900) -> subprocess.CompletedProcess:
  """Runs `command(...)` to the end."""
  return subprocess.run(**command(workdir, *flags, hook=hook), capture_output=True, text=True,
                        timeout=timeout)


def _install(hook: str):
  name, arg = hook.split(":", 1)
  if name == "sigterm_after_log":
    from glm5_jax.train import metrics  # pylint: disable=g-import-not-at-top
    write = metrics.MetricWriter.write

    def write_then_sigterm(self, step, values, prefix="train"):
      write(self, step, values, prefix=prefix)
      if prefix == "train" and step == int(arg):
        os.kill(os.getpid(), signal.SIGTERM)

    metrics.MetricWriter.write = write_then_sigterm
  elif name == "enospc_on_save":
    from glm5_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
    save = checkpoint.save

    def failing_save(manager, state, *args, **kwargs):
      if int(state.step) == int(arg):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(manager.directory))
      return save(manager, state, *args, **kwargs)

    checkpoint.save = failing_save
  elif name == "losses_to":
    import json  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    from glm5_jax.train import loop  # pylint: disable=g-import-not-at-top
    checked = loop._checked  # pylint: disable=protected-access

    def checked_and_recorded(step, metrics):
      values = checked(step, metrics)
      path = os.path.join(arg, f"losses_{jax.process_index()}.jsonl")
      with open(path, "a") as f:
        f.write(json.dumps({"step": step + 1, **values}) + "\n")
      return values

    loop._checked = checked_and_recorded  # pylint: disable=protected-access
  elif name == "concat_shards":
    import glm5_jax.data  # pylint: disable=g-import-not-at-top
    make_train_iterator = glm5_jax.data.make_train_iterator

    def concatenated(data_cfg, *, process_index=0, process_count=1):
      assert (process_index, process_count) == (0, 1), "concat_shards is for one process"
      return ConcatShards([make_train_iterator(data_cfg, process_index=i, process_count=int(arg))
                           for i in range(int(arg))])

    glm5_jax.data.make_train_iterator = concatenated
  else:
    raise ValueError(f"unknown hook {hook!r}")


class ConcatShards(grain.DatasetIterator):
  """A checkpointable grain iterator of the row-wise concatenation of its parents' batches."""

  def __next__(self):
    batches = [next(shard) for shard in self._parents]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

  def get_state(self):
    return {"shards": [shard.get_state() for shard in self._parents]}

  def set_state(self, state):
    for shard, shard_state in zip(self._parents, state["shards"]):
      shard.set_state(shard_state)

  def close(self):
    for shard in self._parents:
      shard.close()


if __name__ == "__main__":
  argv = sys.argv[1:]
  while argv and argv[0].startswith("--hook="):
    _install(argv.pop(0).split("=", 1)[1])
  script = "experiments/train.py"
  if argv and argv[0].startswith("--script="):
    script = argv.pop(0).split("=", 1)[1]
  sys.path.insert(0, ROOT)
  sys.argv = [os.path.join(ROOT, script)] + argv
  runpy.run_path(sys.argv[0], run_name="__main__")
