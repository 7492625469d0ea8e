"""configs/ is a package: `parse_arg` types `get_config`'s argument and names the config file
and key it rejects; the DSA adaptation config's stages; config files load by path as
ml_collections' `--config=path:arg` does, from the repository root."""

import os
import subprocess
import sys

import pytest

from configs import dsa_adaptation, tiny
from configs.common import parse_arg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_arg_types_flags_and_first_key():
  arg = parse_arg("n=3,rate=0.5,name=x,on", n=1, rate=1.0, name="", on=False, off=True)
  assert (arg.n, arg.rate, arg.name, arg.on, arg.off) == (3, 0.5, "x", True, True)
  assert parse_arg("off=false", on=False, off=True).off is False
  assert parse_arg(None, n=1).n == 1 and parse_arg("", n=1).n == 1
  assert parse_arg("sparse", stage="warmup", quick=False).stage == "sparse"  # first key
  assert parse_arg("quick", quick=False, stage="warmup").quick  # a bool key named bare


@pytest.mark.parametrize("arg, match", [
    ("colour=red", r"test_config_args.py: unknown argument 'colour' in 'colour=red'; it "
                   r"accepts n \(default 1\), quick \(default False\)"),
    ("n=three", r"test_config_args.py: n='three': expected int"),
    ("quick=maybe", r"test_config_args.py: quick='maybe': expected a bool"),
    ("n", r"argument 'n' needs a value"),
])
def test_parse_arg_errors_name_the_file_and_key(arg, match):
  with pytest.raises(ValueError, match=match):
    parse_arg(arg, n=1, quick=False)


def test_config_errors_name_the_config_file():
  with pytest.raises(ValueError, match=r"configs/tiny.py: unknown argument 'attn'"):
    tiny.get_config("attn=G")
  with pytest.raises(ValueError, match=r"configs/dsa_adaptation.py: stage='dense'"):
    dsa_adaptation.get_config("stage=dense")


def test_dsa_adaptation_stages():
  warmup, sparse = dsa_adaptation.get_config("stage=warmup"), dsa_adaptation.get_config("sparse")
  assert dsa_adaptation.get_config().to_dict() == warmup.to_dict()
  assert (warmup.train.dsa_stage, sparse.train.dsa_stage) == ("warmup", "sparse")
  assert warmup.model.attention_pattern == sparse.model.attention_pattern == "D"
  assert warmup.optim.name == "adamw" and sparse.optim.name == tiny.get_config().optim.name
  assert (warmup.train.steps, sparse.train.steps) == (200, 400)
  assert warmup.train.dsa_dense_steps == sparse.train.dsa_dense_steps == 0


def test_param_count_loads_a_config_that_imports_its_siblings_by_path():
  """tools/param_count.py run as the README does, with no PYTHONPATH and no sys.path edit in
  the tool: configs/dsa_adaptation.py imports configs.tiny and configs.common from the
  `configs` package installed with glm5_jax (setup.cfg; `pip install -e .` provides it)."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  proc = subprocess.run([sys.executable, "tools/param_count.py",
                         "--config=configs/dsa_adaptation.py:stage=sparse", "--json"],
                        cwd=ROOT, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
