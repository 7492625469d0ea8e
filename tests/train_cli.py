"""Runs experiments/train.py as a user would, in a subprocess, on a 2-layer tiny config; with
optional fault hooks installed first (the tests' way of making a fault land at a chosen moment).

  python tests/train_cli.py [--hook=NAME:ARG] [experiments/train.py flags...]

Hooks (test-only, installed by monkeypatching before the script runs):
  sigterm_after_log:N   a real SIGTERM to this process right after step N's metrics are
                        written: after that step's save decision, before its eval and break.
  enospc_on_save:N      `checkpoint.save` of step N raises OSError(ENOSPC), as a full disk does.
"""

import errno
import os
import runpy
import signal
import subprocess
import sys

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
  `workdir`; `flags` override."""
  args = [sys.executable, os.path.abspath(__file__)] + ([f"--hook={hook}"] if hook else [])
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
  else:
    raise ValueError(f"unknown hook {hook!r}")


if __name__ == "__main__":
  argv = sys.argv[1:]
  if argv and argv[0].startswith("--hook="):
    _install(argv.pop(0).split("=", 1)[1])
  sys.path.insert(0, ROOT)
  sys.argv = [os.path.join(ROOT, "experiments", "train.py")] + argv
  runpy.run_path(sys.argv[0], run_name="__main__")
