"""Entry points refuse bad command lines before doing anything: one line naming the flag or field
and what was expected, exit status 1, no traceback, nothing created."""

import os
import subprocess
import sys

import pytest

from configs import overrides
from glm5_jax.sharding import mesh_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_unknown_field_names_the_field_and_the_known_ones():
  config = mesh_config()
  argv = ["prog", "--config.mesh.shape.fsdp=2", "--config.shape.pipeline=2", "--other.x=1"]
  error = overrides.unknown_field("config", dict(mesh=config), argv[:2] + argv[3:])
  assert error is None
  error = overrides.unknown_field("config", config, argv)
  assert str(error) == ("config.mesh: unknown field (--config.mesh.shape.fsdp=2); known fields: "
                        "['context_layout', 'device_layout', 'logical_axis_rules', 'shape']")
  error = overrides.unknown_field("config", config, ["prog", "--config.shape.pipeline=2"])
  assert str(error) == ("config.shape.pipeline: unknown field (--config.shape.pipeline=2); "
                        "known fields: ['context', 'data', 'expert', 'fsdp', 'tensor']")


def _run(script, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, os.path.join(ROOT, script), *flags], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # subprocesses, each importing jax
def test_bad_command_lines_are_refused(tmp_path):
  missing = tmp_path / "missing"
  cases = [
      (("experiments/train.py", "--config.mesh.shape.pipeline=2", f"--workdir={missing}"),
       "ConfigError: config.mesh.shape.pipeline: unknown field (--config.mesh.shape.pipeline=2);"
       " known fields: ['context', 'data', 'expert', 'fsdp', 'tensor']"),
      (("experiments/train.py", "--config=configs/tiny.py", "--config.mesh.shape.pipeline=2",
        f"--workdir={missing}"), "ConfigError: config.mesh.shape.pipeline: unknown field"),
      (("experiments/eval.py", f"--workdir={missing}"), f"no checkpoint under {missing}"),
      (("experiments/train.py", "--config=configs/nope.py", f"--workdir={missing}"),
       "ConfigError: --config=configs/nope.py: cannot load the config file 'configs/nope.py' "
       "([Errno 2] No such file or directory"),
      (("experiments/sweep.py", "--sweep=configs/sweeps/muon_split.py:quick", "--parallel=0",
        f"--sweep_dir={missing}"), "--parallel=0: 0 is not a positive integer"),
      (("experiments/sweep.py", "--sweep=configs/sweeps/muon_split.py:quick", "--report_only",
        f"--sweep_dir={missing}"), f"--report_only: no sweep directory '{missing}'"),
      (("tools/convert_hf.py", f"--hf_dir={missing}", f"--out_dir={missing}", "--group_mb=-1"),
       "--group_mb must be > 0"),
      (("tools/convert_hf.py", f"--hf_dir={missing}", f"--out_dir={missing}",
        "--mtp_depths=-1"), "-1 is not a non-negative integer"),
  ]
  for args, message in cases:
    proc = _run(*args)
    assert proc.returncode == 1, (args, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, (args, proc.stderr[-3000:])
    assert message in proc.stderr, (args, proc.stderr[-3000:])
    assert not missing.exists(), args
