"""Quantization (`glm5_jax.quant`): INT4 QAT, the integer formats and matmuls, the rotation
folded into the weights, and quantized serving models.

One tiny model (hidden 48 = 2^4 * 3, so the rotation's Hadamard (x) orthogonal block is used; no
MTP; every expert and every key selected, so a quantization error moves logits smoothly instead
of flipping a top-k choice) serves every model-level test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_jax
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.quant import ops, qat, rotation, serve

TOKENS = np.random.default_rng(0).integers(0, 384, (2, 20))


@pytest.fixture(scope="module")
def model(helpers):
  model = helpers.load_config_module(helpers.config.__globals__["CONFIG_DIR"] / "tiny.py")
  model = model.get_config().model
  model.update(hidden_size=48, num_nextn_predict_layers=0, mtp_depths=0, num_hidden_layers=2,
               quant_group_size=16, index_topk=64, num_experts_per_tok=8)
  return model


@pytest.fixture(scope="module")
def params(model, helpers):
  return helpers.random_params(ModelConfig.from_config(model))


@pytest.fixture(scope="module")
def ref_logits(model, params):
  return np.asarray(glm5_jax.logits(model, params, TOKENS))


def test_fake_quant_int4_rounds_per_group_with_a_straight_through_gradient():
  w = jnp.asarray(np.random.default_rng(1).standard_normal((3, 32, 5)), jnp.float32)
  fq = qat.fake_quant_int4(w, 8)
  q, scale = qat.quantize_groups(w, 8)
  assert scale.shape == (3, 4, 5) and int(q.min()) >= -8 and int(q.max()) <= 7
  np.testing.assert_allclose(fq, np.asarray(q, np.float32) * np.repeat(scale, 8, axis=1),
                             rtol=1e-6)
  assert 0 < np.abs(fq - w).max() <= float(scale.max()) / 2 + 1e-6  # round to nearest
  c = jnp.arange(w.size, dtype=jnp.float32).reshape(w.shape)
  np.testing.assert_array_equal(jax.grad(lambda v: (qat.fake_quant_int4(v, 8) * c).sum())(w), c)
  with pytest.raises(ValueError, match="group size 12 does not divide the input dim 32"):
    qat.group_scales(w, 12)


def test_int_formats_and_matmuls_equal_their_float_arithmetic():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((5, 48)) * rng.uniform(0.1, 10, (5, 1)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((48, 24)), jnp.float32)
  xq, xs = ops.quantize_tokens(x)
  x_deq = np.asarray(xq, np.float64) * np.asarray(xs, np.float64)
  q8, s8 = ops.quantize_int8_channels(w)
  want = x_deq @ (np.asarray(q8, np.float64) * np.asarray(s8, np.float64))
  np.testing.assert_allclose(ops.int8_matmul(x, q8, s8, jnp.float32), want, rtol=1e-5, atol=1e-5)
  packed, s4 = ops.quantize_int4_groups(w, 16)
  assert packed.dtype == jnp.uint8 and packed.shape == (24, 24) and s4.shape == (3, 24)
  q4, _ = qat.quantize_groups(w, 16)
  np.testing.assert_array_equal(ops.unpack_int4(packed), q4)
  want4 = x_deq @ np.asarray(qat.dequantize_groups(q4, s4), np.float64)
  np.testing.assert_allclose(ops.int4_matmul(x, packed, s4, jnp.float32), want4, rtol=1e-5,
                             atol=1e-5)
  rel = np.abs(np.asarray(ops.int8_matmul(x, q8, s8, jnp.float32)) - x @ w).max() / np.abs(
      x @ w).max()
  assert rel < 0.02, rel


def test_rotated_fp32_model_equals_the_original(model, params, ref_logits):
  model_r, rotated = rotation.rotate(model, params, seed=3)
  assert not model_r.head_norm_mix  # no MTP: every norm scale folds into its kernel
  q = rotation.hadamard_rotation(48, seed=3)
  np.testing.assert_allclose(q @ q.T, np.eye(48), atol=1e-12)
  got = np.asarray(glm5_jax.logits(model_r, rotated, TOKENS))
  assert np.abs(got - ref_logits).max() <= 1e-5 * max(1.0, np.abs(ref_logits).max())
  layer = rotated["layers_0_0"] if "layers_0_0" in rotated else rotated["layers_0"]
  np.testing.assert_array_equal(layer["input_layernorm"]["scale"], 1.0)  # gamma folded


def test_rotated_fp32_model_with_mtp_equals_the_original(model, helpers):
  """The MTP layer's depths too: the final norm and shared_head_norm keep their (random) scales
  as `mix` matrices, enorm / hnorm fold into eh_proj."""
  mtp = model.copy_and_resolve_references()
  mtp.update(num_nextn_predict_layers=1, mtp_depths=2)
  params = helpers.random_params(ModelConfig.from_config(mtp), seed=4)
  want = glm5_jax.forward(mtp, params, TOKENS)
  model_r, rotated = rotation.rotate(mtp, params, seed=5)
  assert model_r.head_norm_mix and rotated["mtp"]["shared_head_norm"]["mix"].shape == (48, 48)
  got = glm5_jax.forward(model_r, rotated, TOKENS)
  for name in ("logits", "mtp_logits"):
    ref = np.asarray(want[name])
    assert np.abs(np.asarray(got[name]) - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max()), name
  with pytest.raises(ValueError, match="already rotated"):
    rotation.rotate(model_r, rotated)


@pytest.mark.parametrize("fmt", ["w8a8", "w4a8"])
def test_quantized_model_stores_integers_and_tracks_the_float_model(fmt, model, params,
                                                                    ref_logits):
  model_q, params_q = serve.quantize(model, params, fmt)
  leaves = jax.tree_util.tree_leaves_with_path(params_q)
  dtypes = {jax.tree_util.keystr(p): a.dtype for p, a in leaves}
  experts = [k for k in dtypes if "experts']['gate_proj']" in k and "shared" not in k]
  assert dtypes[experts[0]] == (jnp.uint8 if fmt == "w4a8" else jnp.int8)
  assert any("q_a_proj']" in k and d == jnp.int8 for k, d in dtypes.items())
  assert any("lm_head" in k and d == jnp.float32 for k, d in dtypes.items())
  got = np.asarray(glm5_jax.logits(model_q, params_q, TOKENS))
  rel = np.abs(got - ref_logits).max() / np.abs(ref_logits).max()
  agree = (got.argmax(-1) == ref_logits.argmax(-1)).mean()
  print(f"{fmt}: max |logit diff| / scale {rel:.3f}, greedy agreement {agree:.2f}")
  assert rel < (0.06 if fmt == "w8a8" else 0.15) and agree >= 0.85, (rel, agree)


def test_qat_model_exports_and_serves_its_trained_int4_values(model, params):
  qat_model = model.copy_and_resolve_references()
  qat_model.qat_int4_group_size = 16
  exported = serve.export_int4_experts(qat_model, params)
  path = next(k for k in exported if k.endswith("experts/down_proj"))
  model_q, params_q = serve.quantize(qat_model, params, "w4a8")
  stored = params_q
  for key in path.split("/"):
    stored = stored[key]
  np.testing.assert_array_equal(stored, exported[path])
  # The QAT forward uses exactly the INT4 values the export holds.
  keys = path.split("/")
  w = params
  for key in keys:
    w = w[key]
  deq = qat.dequantize_groups(ops.unpack_int4(exported[path]), exported[path + "_scale"])
  np.testing.assert_allclose(qat.fake_quant_int4(w, 16), deq, rtol=1e-6)
  # The QAT forward is the float model with its expert kernels rounded to those INT4 values.
  rounded = jax.tree_util.tree_map_with_path(
      lambda p, w: qat.fake_quant_int4(w, 16) if _is_expert_kernel(p) else w, params)
  np.testing.assert_allclose(glm5_jax.logits(qat_model, params, TOKENS),
                             glm5_jax.logits(model, rounded, TOKENS), rtol=1e-5, atol=1e-5)
  with pytest.raises(ConfigError, match="quant_group_size: 8 differs"):
    serve.quantize(qat_model, params, "w4a8", group_size=8)
  with pytest.raises(ConfigError, match="qat_int4_group_size: 0"):
    serve.export_int4_experts(model, params)


def _is_expert_kernel(path) -> bool:
  keys = [getattr(k, "key", None) for k in path]
  return len(keys) >= 2 and keys[-2] == "experts" and keys[-1] in ("gate_proj", "up_proj",
                                                                   "down_proj")


@pytest.mark.parametrize("field,value,match", [
    ("qat_int4_group_size", 12, "must divide moe_intermediate_size=32"),
    ("qat_int4_group_size", 3, "even group size"),
    ("quant", "w2a2", "must be one of"),
])
def test_bad_quantization_fields_are_named(model, field, value, match):
  bad = model.copy_and_resolve_references()
  bad[field] = value
  with pytest.raises(ConfigError, match=f"model.{field}.*{match}"):
    ModelConfig.from_config(bad)
  bad = model.copy_and_resolve_references()
  bad.update(quant="w4a8", quant_group_size=32)
  with pytest.raises(ConfigError, match="model.quant_group_size.*divide hidden_size=48"):
    ModelConfig.from_config(bad)


@pytest.mark.slow  # compiles the engine's prefill and decode steps (~40 s on a loaded CPU)
def test_engine_serves_a_rotated_w4a8_model_as_its_forward_computes(model, params):
  """The engine's cached decode runs the same quantized projections as the forward: its greedy
  tokens' logits equal the teacher-forced forward's (per-token activation scales make a token's
  numbers independent of how many tokens share its call)."""
  from glm5_jax import infer
  model_q, params_q = serve.quantize(*rotation.rotate(model, params), "w4a8")
  prompts = [list(TOKENS[0, :6])]
  result = infer.generate(model_q, params_q, prompts, max_new_tokens=3, return_logits=True)
  for prompt, tokens, logits in zip(prompts, result.tokens, result.logits):
    full = np.asarray(prompt + list(tokens[:-1]))[None]
    want = np.asarray(glm5_jax.logits(model_q, params_q, full))[0, len(prompt) - 1:]
    np.testing.assert_allclose(np.asarray(logits), want, atol=2e-4 * np.abs(want).max())


def test_load_model_rotates_a_model_with_mtp(helpers):
  """`load_model(rotate=True)` (generate.py / serve.py `--rotate`) keeps the MTP layer."""
  from glm5_jax.infer.loading import load_model
  config = helpers.load_config_module(helpers.config.__globals__["CONFIG_DIR"] / "tiny.py")
  config = config.get_config()
  plain = load_model(random_init_config=config, seed=2)
  rotated = load_model(random_init_config=config, seed=2, rotate=True)
  assert ModelConfig.from_config(plain.model).num_nextn_predict_layers  # the tiny model has MTP
  assert rotated.model.head_norm_mix and "rotated" in rotated.source
  model_r, want = rotation.rotate(plain.model, plain.params, seed=2)  # numbers: the test above
  assert model_r.to_dict() == {**rotated.model.to_dict(), "cache_dtype": model_r.cache_dtype}
  jax.tree_util.tree_map(np.testing.assert_array_equal, rotated.params, want)
