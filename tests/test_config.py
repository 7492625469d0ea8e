"""Config validation names the bad field; every shipped config loads and validates.

(levanter's habit, STYLE.md 10: a test loads every file in configs/ so none rots.)
"""

import pathlib

import jax
import numpy as np
import pytest

import glm5_jax
from glm5_jax.config import ConfigError, ModelConfig, validate_model_config
from glm5_jax.config_validation import validate_config
from glm5_jax.sharding import mesh_config, validate_mesh_config

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
# The config files: the modules of configs/ that define get_config (common.py and overrides.py
# are helpers of the config files and of the entry points).
SHIPPED_CONFIGS = sorted(p for p in CONFIG_DIR.glob("*.py") if "\ndef get_config(" in p.read_text())


@pytest.fixture(scope="module")
def tiny(helpers):
  return helpers.load_config_module(CONFIG_DIR / "tiny.py")


@pytest.fixture(scope="module")
def tiny_model(tiny):
  """`tiny_model(**overrides)`: configs/tiny.py's `model` ConfigDict with overrides."""
  def make(**overrides):
    model = tiny.get_config().model
    model.update(overrides)
    return model
  return make


# (overrides of the tiny model, the field the error must name)
BAD_MODELS = {
    "odd_rope_dim": (dict(qk_rope_head_dim=3), "qk_rope_head_dim"),
    "topk_zero": (dict(index_topk=0), "index_topk"),
    "topk_negative": (dict(index_topk=-4), "index_topk"),
    "unknown_letter": (dict(attention_pattern="DXDD"), "attention_pattern"),
    "pattern_too_short": (dict(attention_pattern="DDD"), "attention_pattern"),
    "pattern_too_long": (dict(attention_pattern="DDDDD"), "attention_pattern"),
    "r_first": (dict(attention_pattern="RDDD"), "attention_pattern"),
    "r_everywhere": (dict(attention_pattern="R"), "attention_pattern"),
    "r_after_gqa": (dict(attention_pattern="DGRD"), "attention_pattern"),
    "too_many_experts_per_token": (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    "n_group_not_dividing": (dict(n_group=3), "n_group"),
    "topk_group_over_n_group": (dict(n_group=4, topk_group=5), "topk_group"),
    "gqa_heads_not_dividing": (dict(attention_pattern="G", num_key_value_heads=3),
                               "num_key_value_heads"),
    "mlp_pattern_length": (dict(mlp_pattern="FEE"), "mlp_pattern"),
    "mlp_pattern_letter": (dict(mlp_pattern="FEXE"), "mlp_pattern"),
    "mtp_without_layer": (dict(num_nextn_predict_layers=0, mtp_depths=2), "mtp_depths"),
    "bad_dtype": (dict(dtype="float64"), "dtype"),
    "zero_hidden": (dict(hidden_size=0), "hidden_size"),
}


@pytest.mark.parametrize("case", sorted(BAD_MODELS))
@pytest.mark.parametrize("entry", ["validate_model_config", "ModelConfig.from_config"])
def test_bad_model_config_names_field(tiny_model, case, entry):
  overrides, field = BAD_MODELS[case]
  check = validate_model_config if entry == "validate_model_config" else ModelConfig.from_config
  with pytest.raises(ConfigError) as error:
    check(tiny_model(**overrides))
  assert f"model.{field}" in str(error.value), (
      f"{case}: error message does not name model.{field}: {error.value}")


def test_validate_config_requires_model_section(tiny):
  config = tiny.get_config()
  del config.model
  with pytest.raises(ConfigError, match=r"config: missing fields \['model'\]"):
    validate_config(config)


def test_valid_patterns_pass(tiny_model):
  for pattern in ("D", "M", "G", "DRRD", "MDRG", "DDRR"):
    cfg = ModelConfig.from_config(tiny_model(attention_pattern=pattern))
    assert len(cfg.attention_pattern) == cfg.num_hidden_layers
  cfg = ModelConfig.from_config(tiny_model(n_routed_experts=12, n_group=4, topk_group=2))
  assert cfg.mlp_pattern == "FEEE"


BAD_MESHES = {
    "product_too_small": (dict(data=2, fsdp=2), 8, "mesh.shape"),
    "product_too_large": (dict(data=4, tensor=4), 8, "mesh.shape"),
    "fill_not_dividing": (dict(data=-1, fsdp=3), 8, "mesh.shape"),
    "two_fills": (dict(data=-1, fsdp=-1), 8, "mesh.shape"),
    "zero_axis": (dict(data=-1, tensor=0), 8, "mesh.shape.tensor"),
    "unknown_axis": (dict(pipeline=2), 8, "mesh.shape"),
}


@pytest.mark.parametrize("case", sorted(BAD_MESHES))
def test_bad_mesh_names_field(case):
  axes, devices, field = BAD_MESHES[case]
  with pytest.raises(ConfigError) as error:
    validate_mesh_config(mesh_config(**axes), devices)
  assert field in str(error.value), f"{case}: message does not name {field}: {error.value}"
  if case == "unknown_axis":
    assert "pipeline" in str(error.value)


def test_mesh_rule_with_unknown_axis():
  mesh = mesh_config()
  mesh.logical_axis_rules = list(mesh.logical_axis_rules) + [("embed", ("fsdp", "pipeline"))]
  with pytest.raises(ConfigError, match="mesh.logical_axis_rules"):
    validate_mesh_config(mesh, 8)


def test_mesh_fill_axis_resolves():
  sizes = validate_mesh_config(mesh_config(data=1, fsdp=-1, tensor=2), 8)
  assert sizes == dict(data=1, fsdp=4, context=1, expert=1, tensor=2)
  assert validate_mesh_config(mesh_config(), 1) == dict(data=1, fsdp=1, context=1, expert=1, tensor=1)


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(helpers, path, tmp_path):
  """Each config is checked by the validator its entry point runs: experiments/rl.py's for a
  staged pipeline or an `rl` section (and the SFT run it makes first), experiments/sft.py's for an `sft` section
  (the training loop's config after the built-in data is written), else the training loop's."""
  from glm5_jax.posttrain import pipeline_config, rl_config_checks, sft
  config = helpers.load_config_module(path).get_config()
  if "pipeline" in config:  # experiments/rl.py runs the staged pipeline's own checks
    pipeline_config.validate_pipeline(config)
    validate_config(sft.training_config(config.sft, str(tmp_path)), num_devices=jax.device_count())
  elif "rl" in config:
    rl_config_checks.validate_rl_experiment(config)
    validate_config(sft.training_config(config.sft, str(tmp_path)), num_devices=jax.device_count())
  elif "sft" in config:
    validate_config(sft.training_config(config, str(tmp_path)), num_devices=jax.device_count())
  else:
    validate_config(config, num_devices=jax.device_count())
  for devices in (1, 8, 256):
    validate_mesh_config(config.mesh, devices)
  cfg = ModelConfig.from_config(config.model)
  assert hash(cfg) == hash(ModelConfig.from_config(config.model))  # usable as a static arg


@pytest.mark.parametrize("variant", ["attention=M", "attention=G", "attention=DRDR"])
def test_tiny_variants_validate_and_build(tiny, variant):
  config = tiny.get_config(variant)
  validate_config(config, num_devices=jax.device_count())
  shapes = glm5_jax.abstract_params(config.model)
  assert "embed_tokens" in shapes and "mtp" in shapes


def test_tiny_is_really_sparse(tiny):
  assert tiny.get_config().model.index_topk < tiny.SEQ_LEN
  with pytest.raises(ValueError, match="configs/tiny.py: unknown argument .atention."):
    tiny.get_config("atention=M")


def test_glm5_744b_matches_the_reference(helpers):
  """configs/glm5_744b.py reproduces docs/reference.md section 1, ~744B params without MTP."""
  model = helpers.load_config_module(CONFIG_DIR / "glm5_744b.py").get_config().model
  cfg = ModelConfig.from_config(model)
  expected = dict(
      num_hidden_layers=78, hidden_size=6144, intermediate_size=12288, vocab_size=154880,
      num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
      qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128,
      index_topk=2048, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
      moe_intermediate_size=2048, routed_scaling_factor=2.5, n_group=1,
      num_nextn_predict_layers=1, mtp_depths=3, rope_theta=1e6,
      max_position_embeddings=202752, rms_norm_eps=1e-5, latent_norm_eps=1e-6)
  assert {k: getattr(cfg, k) for k in expected} == expected
  assert cfg.attention_pattern == "D" * 78
  assert cfg.mlp_pattern == "F" * 3 + "E" * 75
  assert cfg.qk_head_dim == 256
  shapes = glm5_jax.abstract_params(model)
  count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))
  main = count(shapes) - count(shapes["mtp"])
  assert 740e9 < main < 748e9, f"{main / 1e9:.1f}B parameters without MTP, expected ~744B"
  assert set(k for k in shapes if k.startswith("layers_")) == {"layers_0_2", "layers_3_77"}
  routed = count(shapes["layers_3_77"]["mlp"]["experts"])
  assert routed == 75 * 256 * 3 * 6144 * 2048
