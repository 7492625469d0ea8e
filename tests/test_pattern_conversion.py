"""Converting a checkpoint between attention patterns (glm5_jax.convert.attention_pattern and
glm5_jax.train.state.merge_stage_params): M -> S / N / L / D reuses every MLA weight bit for bit
and keeps the fresh init only for the declared new params; going back drops them; GQA <-> MLA
and any unaccounted parameter are errors that list the parameters.
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

import glm5_jax
from glm5_jax import layer_runs
from glm5_jax.attention.kinds import ATTENTION_KINDS, KINDS_BY_NAME
from glm5_jax.attention.mla_projections import MLA_BIAS_PARAMS, MLA_PARAMS
from glm5_jax.attention.simple_gdn import retnet_log_decays
from glm5_jax.convert.attention_pattern import (convert_attention_pattern, layer_kinds,
                                                merge_pattern_params)
from glm5_jax.train.state import merge_stage_params

SOURCE = "MMMM"
TARGET = "SNLD"  # every layer changes kind; the MTP layer copies the last one (M -> D)


def small(helpers, pattern, **overrides):
  """Tiny config with dense FFNs (fast init) and learned SimpleGDN gates."""
  return helpers.config(**{**dict(attention_pattern=pattern, first_k_dense_replace=4,
                                  simple_gdn_gates="learned", scan_layers=False), **overrides})


def flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(v)
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def converted(helpers):
  """(source config, target config, source params, converted params); the source params are
  random (std 0.1, so no weight equals an init by accident)."""
  source_cfg, target_cfg = small(helpers, SOURCE), small(helpers, TARGET)
  source = helpers.random_params(source_cfg)
  target = convert_attention_pattern(source, source_cfg, target_cfg, jax.random.key(7))
  return source_cfg, target_cfg, source, target


def test_every_reused_weight_is_bit_identical(converted):
  """Every source weight is in the target unchanged; the rest are exactly the declared extras
  at their init (deterministic ones checked by value: identity convs, unit norm scales, the
  SimpleGDN scalars at the fixed gates)."""
  _, target_cfg, source, target = converted
  abstract = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(
      glm5_jax.abstract_params(target_cfg))[0]}
  source, target = flat(source), flat(target)
  assert set(target) == set(abstract)
  kept = set(source) & set(target)
  assert kept == set(source), "M -> S/N/L/D drops nothing"
  for key in kept:
    np.testing.assert_array_equal(target[key], source[key], err_msg=key)
  for key, value in target.items():
    assert value.shape == abstract[key].shape and value.dtype == abstract[key].dtype, key
  new = set(target) - set(source)
  gdn = lambda name: target[f"['layers_1']['self_attn']['{name}']"]
  identity = np.zeros(gdn("q_conv1d").shape, np.float32)
  identity[-1] = 1.0
  np.testing.assert_array_equal(gdn("q_conv1d"), identity)
  np.testing.assert_array_equal(gdn("o_norm']['scale"), np.ones(target_cfg.v_head_dim))
  simple = lambda name: target[f"['layers_2']['self_attn']['{name}']"]
  np.testing.assert_array_equal(simple("beta_logit"), np.zeros(target_cfg.num_attention_heads))
  np.testing.assert_allclose(-np.exp(simple("decay_rate_log")),
                             retnet_log_decays(target_cfg.num_attention_heads), rtol=1e-6)
  for key in new:  # initialized (zeros only where the init is zeros: biases, logit(0.5))
    assert np.any(target[key] != 0) or key.endswith(("['bias']", "['beta_logit']")), key
  declared = {"layers_1": ATTENTION_KINDS["N"].extra_params,
              "layers_2": ATTENTION_KINDS["L"].extra_params,
              "layers_3": ATTENTION_KINDS["D"].extra_params,
              "mtp": ATTENTION_KINDS["D"].extra_params}
  got = {}
  for key in new:
    parts = [p.strip("[]'") for p in key.split("][")]
    owner = parts[0]
    got.setdefault(owner, set()).add(parts[parts.index("self_attn") + 1])
  assert got == declared
  assert target_cfg.attention_pattern == TARGET


def test_converting_back_drops_the_extras(converted):
  source_cfg, target_cfg, source, target = converted
  back = convert_attention_pattern(target, target_cfg, source_cfg, jax.random.key(1))
  for key, value in flat(source).items():
    np.testing.assert_array_equal(flat(back)[key], value, err_msg=key)
  assert set(flat(back)) == set(flat(source))


def test_scanned_layouts_convert_like_unrolled(converted):
  """Scanned params (runs regroup when the pattern changes: MMMM is one run, SNLD four) convert
  to exactly the stacked unrolled result, and merge across layouts (an unrolled checkpoint into
  a scanned run and back)."""
  source_cfg, target_cfg, source, target = converted
  scanned_source_cfg = dataclasses.replace(source_cfg, scan_layers=True)
  scanned_target_cfg = dataclasses.replace(target_cfg, scan_layers=True)
  scanned_source = layer_runs.stack_layers(source, scanned_source_cfg)
  assert "layers_0_3" in scanned_source
  got = convert_attention_pattern(scanned_source, scanned_source_cfg, scanned_target_cfg,
                                  jax.random.key(7))
  assert "layers_1_1" in got and "layers_0_3" not in got
  # Reused weights bit for bit; new ones are the scanned model's own init (nn.scan draws each
  # layer's init from its own key, so they differ from the unrolled model's).
  got = flat(layer_runs.as_unrolled(got, scanned_target_cfg))
  fresh = flat(layer_runs.as_unrolled(glm5_jax.init_params(scanned_target_cfg, jax.random.key(7)),
                                      scanned_target_cfg))
  assert got.keys() == flat(target).keys()
  for key, value in got.items():
    np.testing.assert_array_equal(value, flat(source).get(key, fresh[key]), err_msg=key)
  want = flat(layer_runs.stack_layers(target, scanned_target_cfg))
  merged = merge_stage_params(layer_runs.stack_layers(target, scanned_target_cfg), source, "ckpt",
                              fresh_model=scanned_target_cfg, loaded_model=source_cfg)
  for key, value in flat(merged).items():
    np.testing.assert_array_equal(value, want[key], err_msg=key)


def test_merge_stage_params_is_the_same_rule(converted):
  """train.init_from path: an M checkpoint into an S/N/L/D model; only the new params differ
  from the checkpoint, and a missing shared param is still an error naming it."""
  source_cfg, target_cfg, source, target = converted
  fresh = target  # stands in for the trainer's fresh init: the new params come from it
  models = dict(fresh_model=target_cfg, loaded_model=source_cfg)
  merged = flat(merge_stage_params(fresh, source, "ckpt", **models))
  for key, value in flat(target).items():
    np.testing.assert_array_equal(merged[key], value, err_msg=key)
  broken = jax.tree.map(lambda x: x, source)
  del broken["layers_1"]["self_attn"]["o_proj"]
  with pytest.raises(ValueError, match=r"config.train.init_from(.|\n)*layers_1/self_attn/o_proj "
                     "is missing from ckpt"):
    merge_stage_params(fresh, broken, "ckpt", **models)


def test_same_kind_missing_extra_is_an_error(converted):
  """Extras are fresh only when their kind arrives: a GDN checkpoint missing one conv is not a
  conversion but a broken checkpoint."""
  _, _, _, target = converted
  broken = jax.tree.map(lambda x: x, target)
  del broken["layers_1"]["self_attn"]["q_conv1d"]
  with pytest.raises(ValueError, match="layers_1/self_attn/q_conv1d is missing"):
    merge_pattern_params(target, broken, "ckpt")


def test_incompatible_sources_are_clear_errors(helpers, converted):
  source_cfg, _, source, _ = converted
  gqa_cfg = small(helpers, "MGMM")
  with pytest.raises(ValueError, match=r"layers_1: mla -> gqa"):
    convert_attention_pattern(source, source_cfg, gqa_cfg, jax.random.key(0))
  with pytest.raises(ValueError, match="incompatible params(.|\n)*q_proj is missing"):
    merge_stage_params(glm5_jax.abstract_params(gqa_cfg), source, "ckpt", fresh_model=gqa_cfg,
                       loaded_model=source_cfg)
  wider = small(helpers, "SNLD", kv_lora_rank=8)
  kv_a = source["layers_0"]["self_attn"]["kv_a_proj_with_mqa"].shape
  with pytest.raises(ValueError, match=re.escape(f"kv_a_proj_with_mqa has shape {kv_a} in")):
    convert_attention_pattern(source, source_cfg, wider, jax.random.key(0))
  with pytest.raises(ValueError, match="do not match source_model_config"):
    convert_attention_pattern(source, small(helpers, "DMMM"), wider, jax.random.key(0))


def test_registry_matches_the_modules(helpers):
  """Every attention kind's params are its family's shared params plus (a subset of) its
  declared extras, with and without attention biases."""
  assert len(KINDS_BY_NAME) == len(ATTENTION_KINDS), "kind names must be unique"
  for bias in (False, True):
    shared = set(MLA_PARAMS) | (set(MLA_BIAS_PARAMS) if bias else set())
    for pattern in ("MDSN", "DGLL", "DRRM"):
      c = small(helpers, pattern, attention_bias=bias)
      params = glm5_jax.abstract_params(c)
      for layer, kind in layer_kinds(c).items():
        names = set(params[layer]["self_attn"] if layer != "mtp"
                    else params["mtp"]["layer"]["self_attn"])
        rule = KINDS_BY_NAME[kind]
        if rule.family == "mla":
          assert names == shared | rule.extra_params, (layer, kind, names)
