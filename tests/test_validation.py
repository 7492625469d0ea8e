"""`validate_config` checks every field of every section up front, naming it.

Two levels: each bad field through `validate_config` (fast, one case per check), and the
defects a user met (issue 13 item 4) through the training entry point itself, which must
refuse them with `ConfigError` before compiling anything or writing a checkpoint.
"""

import os
import subprocess
import sys

import jax
import ml_collections
import pytest

from glm5_jax.config import ConfigError
from glm5_jax.config_validation import validate_config
from glm5_jax.train import loop
from tests.conftest import host_devices_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(helpers):
  return helpers.load_config_module(os.path.join(ROOT, "configs", "tiny.py"))


def with_field(config, path: str, value):
  """`config` with `path` ("section.field" or "field") set to `value` without ConfigDict's type
  coercion (the section is rebuilt from a dict, as a config read from JSON would be)."""
  *sections, field = path.split(".")
  if not sections:
    return ml_collections.ConfigDict({**{k: config[k] for k in config.keys()}, field: value})
  parent = config
  for name in sections[:-1]:
    parent = parent[name]
  section = parent[sections[-1]].to_dict()
  section[field] = value
  parent[sections[-1]] = ml_collections.ConfigDict(section)
  return config


# (field path, bad value, the text the error must contain)
BAD_FIELDS = {
    "top_level_typo": ("sed", 0, "config.sed: unknown field (did you mean 'seed'?)"),
    "seed_type": ("seed", "0", "config.seed: must be an int"),
    "train_typo": ("train.stpes", 10, "config.train.stpes: unknown field (did you mean 'steps'?)"
                   "; known fields: ['balance_bias_rate'"),
    "train_steps_zero": ("train.steps", 0, "config.train.steps: must be >= 1"),
    "train_steps_float": ("train.steps", 10.0, "config.train.steps: must be an int"),
    "train_steps_bool": ("train.steps", True, "config.train.steps: must be an int"),
    "dsa_stage": ("train.dsa_stage", "sparse-ish", "config.train.dsa_stage: must be one of"),
    "dense_steps_negative": ("train.dsa_dense_steps", -1, "config.train.dsa_dense_steps"),
    "loss_weight_negative": ("train.mtp_loss_weight", -0.1, "config.train.mtp_loss_weight"),
    "loss_weight_nan": ("train.indexer_loss_weight", float("nan"),
                        "config.train.indexer_loss_weight"),
    "ce_grad_without_chunk": ("train.ce_grad_in_forward", True,
                              "config.train.ce_grad_in_forward: needs the fused head "
                              "(train.ce_chunk > 0)"),
    "log_every_zero": ("train.log_every_steps", 0, "config.train.log_every_steps: must be >= 1"),
    "init_from_type": ("train.init_from", None, "config.train.init_from: must be a string"),
    "ckpt_keep_zero": ("ckpt.keep", 0, "config.ckpt.keep: must be >= 1"),
    "ckpt_every_zero": ("ckpt.every_steps", 0, "config.ckpt.every_steps: must be >= 1"),
    "ckpt_async_int": ("ckpt.async_save", 1, "config.ckpt.async_save: must be a bool"),
    "ckpt_async_str": ("ckpt.async_save", "yes", "config.ckpt.async_save: must be a bool"),
    "eval_every_negative": ("eval.every_steps", -5, "config.eval.every_steps: must be >= 0"),
    "eval_batches_zero": ("eval.batches", 0, "config.eval.batches: must be >= 1"),
    "eval_typo": ("eval.every_step", 1, "config.eval.every_step: unknown field"),
    "optim_warmup": ("optim.warmup_steps", 600, "config.optim.warmup_steps"),
    "optim_typo": ("optim.lr", 1e-3, "config.optim.lr: unknown field"),
    "data_seq_len_type": ("data.seq_len", "256", "config.data.seq_len: must be an int"),
    "data_missing_field": ("data.batch_size", None, "config.data.batch_size: must be an int"),
    "source_weight": ("data.sources.copy.weight", 0.0, "config.data.sources.copy.weight"),
    "source_typo": ("data.sources.copy.min_lenght", 3,
                    "config.data.sources.copy.min_lenght: unknown field (did you mean "
                    "'min_length'?)"),
    "source_kind": ("data.sources.copy.kind", "webtext",
                    "config.data.sources.copy.kind: unknown source kind 'webtext'"),
    "model_typo": ("model.hiden_size", 64, "config.model.hiden_size: unknown field (did you "
                   "mean 'hidden_size'?)"),
    "model_bool_type": ("model.attention_bias", 0, "config.model.attention_bias: must be a bool"),
    "model_dtype": ("model.param_dtype", "float64", "config.model.param_dtype: must be one of"),
    "mesh_typo": ("mesh.shap", {}, "config.mesh.shap: unknown field"),
    "mesh_rule": ("mesh.logical_axis_rules", [("batch", "pipeline")],
                  "config.mesh.logical_axis_rules"),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_bad_field_is_named(tiny, case):
  path, value, expected = BAD_FIELDS[case]
  config = with_field(tiny.get_config(), path, value)
  with pytest.raises(ConfigError) as error:
    validate_config(config, num_devices=1)
  assert expected in str(error.value), f"{case}: {error.value}"


def test_the_shipped_tiny_config_passes(tiny):
  validate_config(tiny.get_config(), num_devices=1)
  validate_config(tiny.get_config(), num_devices=8)  # batch 8 over 8 data-parallel devices
  config = tiny.get_config()
  config.eval.update(every_steps=0, batches=0)  # no evaluation: no eval batches needed
  validate_config(config, num_devices=1)


def test_dense_phase_needs_the_sparse_stage(tiny):
  config = tiny.get_config()
  config.train.update(dsa_stage="warmup", dsa_dense_steps=1)
  with pytest.raises(ConfigError, match="train.dsa_dense_steps: a dense phase comes before the "
                     "sparse stage only"):
    validate_config(config)


@pytest.mark.parametrize("rule,mesh,devices,ways", [
    (("data", "fsdp"), dict(data=-1), 2, 2),
    (("data", "fsdp"), dict(data=2, fsdp=2), 4, 4),
    ("fsdp", dict(data=2, fsdp=-1), 8, 4),  # the `batch` rule decides, not the mesh size
])
def test_batch_must_split_over_the_data_parallel_devices(tiny, rule, mesh, devices, ways):
  config = tiny.get_config()
  config.mesh.shape.update(mesh)
  config.mesh.logical_axis_rules = [("batch", rule)] + [
      r for r in config.mesh.logical_axis_rules if r[0] != "batch"]
  config.data.batch_size = ways * 3
  validate_config(config, num_devices=devices)
  config.data.batch_size = ways * 3 + 1
  with pytest.raises(ConfigError, match=rf"config.data.batch_size: {ways * 3 + 1} rows per step "
                     rf"do not split over the {ways} data-parallel devices"):
    validate_config(config, num_devices=devices)


def test_batch_must_split_over_processes(tiny):
  config = tiny.get_config()
  config.data.batch_size = 6
  validate_config(config, num_devices=1, process_count=3)
  with pytest.raises(ConfigError, match="config.data.batch_size: 6 is not divisible by "
                     "process_count 4"):
    validate_config(config, num_devices=1, process_count=4)


def test_eval_needs_held_out_data(tiny):
  config = tiny.get_config()
  config.data.sources = dict(text=dict(kind="python_stdlib", holdout_fraction=0.0))
  with pytest.raises(ConfigError, match="config.eval.every_steps: evaluation reads held-out"):
    validate_config(config)
  config.eval.every_steps = 0
  validate_config(config)


# --------------------------------------------------------------------------------------------
# The defects of issue 13 item 4, as a user meets them: the training entry point must refuse
# the config before it compiles anything or writes a checkpoint.
# --------------------------------------------------------------------------------------------


@pytest.fixture
def no_compile(monkeypatch):
  """Makes any `jax.jit` call fail the test: validation must come before the first compile."""
  def refuse(*args, **kwargs):
    raise AssertionError("jax.jit was called before the config was validated")
  monkeypatch.setattr(jax, "jit", refuse)


@pytest.mark.parametrize("path,value", [
    ("ckpt.keep", 0),  # used to delete every checkpoint and exit 0
    ("ckpt.every_steps", 0),  # used to raise ZeroDivisionError after a compiled step
    ("train.log_every_steps", 0),  # the same
])
def test_train_refuses_before_compiling(tiny, tmp_path, no_compile, path, value):
  config = tiny.get_config()
  section, field = path.split(".")
  config[section][field] = value
  with pytest.raises(ConfigError, match=rf"config\.{section}\.{field}: must be >= 1"):
    loop.train(config, str(tmp_path / "workdir"))
  assert not os.path.exists(tmp_path / "workdir" / "checkpoints")


def test_train_cli_refuses_a_batch_the_devices_cannot_split(tmp_path):
  """experiments/train.py on 2 devices with 3 rows per step: a ConfigError naming the field,
  not a sharding error after compiling."""
  workdir = tmp_path / "workdir"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=host_devices_xla_flags(2))
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
       f"--config={os.path.join(ROOT, 'configs', 'tiny.py')}", f"--workdir={workdir}",
       "--config.data.batch_size=3"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode != 0
  assert "ConfigError: config.data.batch_size: 3 rows per step do not split over the 2 " \
         "data-parallel devices" in proc.stderr, proc.stderr[-3000:]
  assert not os.path.exists(workdir / "checkpoints")
