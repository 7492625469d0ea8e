"""The attention-kind registry (glm5_jax.attention.kinds): its pattern rules, the MTP kind, and
that the model builds every layer from it; and `Mode` (glm5_jax.attention.mode).
"""

import jax
import jax.numpy as jnp
import pytest

import glm5_jax
from glm5_jax import Mode
from glm5_jax.attention.gqa import GQA
from glm5_jax.attention.kinds import ATTENTION_KINDS, KINDS_BY_NAME, layer_kind, pattern_error
from glm5_jax.attention.mla import MLA
from glm5_jax.attention.modules import ATTENTION_MODULES, build_attention
from glm5_jax.config import ConfigError, model_config, validate_model_config


def test_every_kind_builds_its_module(tiny_cfg):
  for kind in ATTENTION_KINDS.values():
    module = build_attention(kind.name, tiny_cfg, "self_attn")
    assert module.name == "self_attn" and module.cfg is tiny_cfg
    if ATTENTION_MODULES[kind.name][0] is MLA:
      assert isinstance(module, MLA) and module.kind == kind.name
  assert isinstance(build_attention("gqa", tiny_cfg, "x"), GQA)
  assert set(KINDS_BY_NAME) == {k.name for k in ATTENTION_KINDS.values()}


@pytest.mark.parametrize("pattern", ["MDRG", "DRRR", "SNLG", "DRDR"])
def test_valid_patterns(pattern):
  assert pattern_error(pattern) is None
  validate_model_config(model_config(num_hidden_layers=4, attention_pattern=pattern))


@pytest.mark.parametrize("pattern, message", [
    ("RDDD", "layer 0 is 'R'"),
    ("DGRD", "layer 2 is 'R' but layer 1 is 'G'"),
    ("MRDD", "layer 1 is 'R' but layer 0 is 'M'"),
    ("SRDD", "layer 1 is 'R' but layer 0 is 'S'"),  # the window is not a top-k to reuse
    ("DXDD", "unknown letters \\['X'\\]"),
])
def test_invalid_patterns_name_the_layer(pattern, message):
  assert pattern_error(pattern) is not None
  with pytest.raises(ConfigError, match="config.model.attention_pattern: " + message):
    validate_model_config(model_config(num_hidden_layers=4, attention_pattern=pattern))


def test_mtp_layer_kind():
  """The MTP layer runs the last layer's kind, except that an R layer's copy needs an indexer
  (it has no previous DSA layer); the model's params follow it."""
  assert layer_kind("DDRR", 4).letter == "D"
  for letter in "MDGSNL":
    assert layer_kind("DDR" + letter, 4).letter == letter
  for kind in ATTENTION_KINDS.values():
    assert not ATTENTION_KINDS[kind.mtp_letter].needs_prev_topk


def test_model_layers_follow_the_registry(helpers):
  """Each layer's attention params are exactly what its kind builds (the model takes its module
  from the registry, not from a list of its own)."""
  cfg = helpers.config(attention_pattern="DRGN", first_k_dense_replace=4, scan_layers=False)
  params = glm5_jax.abstract_params(cfg)
  assert "indexer" in params["layers_0"]["self_attn"]
  assert "indexer" not in params["layers_1"]["self_attn"]
  assert "q_proj" in params["layers_2"]["self_attn"]
  assert ATTENTION_KINDS["N"].extra_params <= set(params["layers_3"]["self_attn"])
  assert ATTENTION_KINDS["N"].extra_params <= set(params["mtp"]["layer"]["self_attn"])


def test_mode_rejects_unknown_values_and_is_a_static_argument():
  assert Mode() == Mode(form="expanded", dsa_stage="sparse")
  with pytest.raises(ValueError, match=r"Mode.form must be one of \('expanded', 'absorbed', "
                     r"'decode'\), got 'prefill'"):
    Mode(form="prefill")
  assert hash(Mode(form="decode")) == hash(Mode(form="decode"))
  with pytest.raises(ValueError,
                     match=r"Mode.dsa_stage must be one of .*'warmup'.*got 'sparse-ish'"):
    Mode(dsa_stage="sparse-ish")
  with pytest.raises(ValueError, match="Mode.form"):
    Mode(True)  # the old positional `absorbed` boolean is refused, not read as a form
  traces = []
  f = jax.jit(lambda x, mode: (traces.append(mode), x * 2)[1], static_argnames="mode")
  f(jnp.ones(()), mode=Mode(form="absorbed"))
  f(jnp.ones(()), mode=Mode(form="absorbed"))
  f(jnp.ones(()), mode=Mode(dsa_stage="dense"))
  assert traces == [Mode(form="absorbed"), Mode(dsa_stage="dense")]
