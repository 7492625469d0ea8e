"""The long-context attention variants (docs/reference.md section 3): S (sliding-window MLA),
N (Gated DeltaNet), L (SimpleGDN), and the gated delta rule under N and L.

Delta rule: recurrent == the paper's equation (numpy), chunked == recurrent with odd lengths,
packed documents and a carried-in state; stable under strong decays. SWA: the mask at window
edges and document boundaries, window >= L is exactly M, a query's output equals MLA on its
window alone. Every new letter: causal and document-local (exact zero Jacobian blocks); decode
(recurrent) form == training (chunked) form; params are the M layer's plus the declared extras;
a model with every letter trains a step; config fields, FLOPs and param stats accept them.

Notation: B batch, L length, H heads, K key dim, V value dim, D hidden.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glm5_jax
from glm5_jax.attention import delta_rule
from glm5_jax.attention.common import causal_segment_mask
from glm5_jax.attention.gdn import GatedDeltaNet
from glm5_jax.attention.kinds import ATTENTION_KINDS
from glm5_jax.attention.mla import MLA
from glm5_jax.attention.mla_projections import MLA_PARAMS
from glm5_jax.attention.simple_gdn import SimpleGatedDeltaNet
from glm5_jax.attention.swa import SlidingWindowMLA, sliding_window_keys
from configs import tiny
from glm5_jax.config import ConfigError, ModelConfig, interleave_pattern
from glm5_jax.optim import build_optimizer, optim_config, param_labels, weight_decay_mask
from glm5_jax.param_stats import summarize
from glm5_jax.sharding import default_logical_axis_rules, param_mesh_specs
from glm5_jax.train.metrics import flops_per_token
from glm5_jax.train.state import TrainState
from glm5_jax.train.step import StepConfig, make_train_step

B, H, K, V = 2, 3, 5, 4
LENGTH = 23  # odd, not a multiple of any chunk size used
SEGMENTS = np.array([[1] * 7 + [2] * 9 + [3] * 7,  # three packed documents
                     [1] * 5 + [0] * 18])  # a document, then padding
EVERY_LETTER = "DRMSNLG"


def variant_config(helpers, pattern, **overrides):
  """configs/tiny.py with one layer per letter, dense FFNs (fast to compile), 1 MTP depth, and
  small chunk / window so that the tests cross chunk and window edges; unrolled layers
  (`layers_{i}`), which the tests address one by one."""
  base = dict(attention_pattern=pattern, num_hidden_layers=len(pattern),
              first_k_dense_replace=len(pattern), mtp_depths=1, gdn_chunk_size=8,
              sliding_window=6, simple_gdn_gates="learned", scan_layers=False)
  return helpers.config(**{**base, **overrides})


def delta_rule_inputs(seed=0, length=LENGTH, strong_decay=False):
  rng = np.random.default_rng(seed)
  q = delta_rule.l2_normalize(rng.standard_normal((B, length, H, K)))
  k = delta_rule.l2_normalize(rng.standard_normal((B, length, H, K)))
  v = jnp.asarray(rng.standard_normal((B, length, H, V)), jnp.float32)
  high = 60.0 if strong_decay else 1.5
  log_alpha = -jnp.asarray(rng.uniform(0, high, (B, length, H)), jnp.float32)
  beta = jnp.asarray(rng.uniform(0.05, 0.95, (B, length, H)), jnp.float32)
  return q, k, v, log_alpha, beta


# ---------------------------------------------------------------------------------------------
# 1. The gated delta rule
# ---------------------------------------------------------------------------------------------


def paper_recurrence(q, k, v, log_alpha, beta, segments):
  """numpy, the paper's layout (arXiv 2412.06464 eq. 10): S [V, K],
  S_t = S_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T, o_t = S_t q_t; S = 0 at
  every change of segment id."""
  q, k, v, alpha, beta = (np.asarray(x, np.float64) for x in (q, k, v, np.exp(log_alpha), beta))
  out = np.zeros(v.shape)
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      s = np.zeros((v.shape[-1], k.shape[-1]))
      for t in range(q.shape[1]):
        if t and segments[b, t] != segments[b, t - 1]:
          s = np.zeros_like(s)
        kt = k[b, t, h][:, None]
        s = s @ (alpha[b, t, h] * (np.eye(kt.shape[0]) - beta[b, t, h] * kt @ kt.T)) \
            + beta[b, t, h] * v[b, t, h][:, None] @ kt.T
        out[b, t, h] = s @ q[b, t, h]
  return out


def test_recurrent_form_is_the_papers_equation():
  inputs = delta_rule_inputs()
  o, _ = jax.jit(delta_rule.gated_delta_rule_recurrent)(*inputs, SEGMENTS)
  np.testing.assert_allclose(o, paper_recurrence(*inputs, SEGMENTS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [4, 8, 64])
def test_chunked_equals_recurrent(chunk):
  """Odd length 23 (chunks 4 and 8 leave a partial last chunk; 64 > L is one chunk), packed
  documents whose boundaries fall inside chunks, and a carried-in state (continuing the first
  run only: row 0's later documents and row 1's padding start from zero)."""
  inputs = delta_rule_inputs()
  state = jnp.asarray(np.random.default_rng(1).standard_normal((B, H, K, V)), jnp.float32)
  o_rec, final_rec = jax.jit(delta_rule.gated_delta_rule_recurrent)(*inputs, SEGMENTS, state)
  chunked = jax.jit(delta_rule.gated_delta_rule_chunked, static_argnums=6)
  o_chunk, final_chunk = chunked(*inputs, SEGMENTS, chunk, state)
  np.testing.assert_allclose(o_chunk, o_rec, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(final_chunk, final_rec, rtol=1e-5, atol=1e-5)


def test_chunked_is_stable_under_strong_decay():
  """log alpha down to -60 per step (exp(-60 * 8) underflows; a form dividing cumulative decays
  would give inf/NaN): outputs and gradients stay finite and match the recurrence."""
  inputs = delta_rule_inputs(strong_decay=True)
  o_rec, _ = delta_rule.gated_delta_rule_recurrent(*inputs, SEGMENTS)

  def loss(q, k, v, log_alpha, beta):
    o, state = delta_rule.gated_delta_rule_chunked(q, k, v, log_alpha, beta, SEGMENTS, 8)
    return jnp.sum(o ** 2) + jnp.sum(state ** 2), o

  grads, o_chunk = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*inputs)
  np.testing.assert_allclose(o_chunk, o_rec, rtol=1e-5, atol=1e-5)
  assert all(np.all(np.isfinite(g)) for g in grads)


# ---------------------------------------------------------------------------------------------
# 2. Sliding-window mask
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3, 7, 40])
def test_window_mask_edges_and_documents(window):
  got = np.asarray(causal_segment_mask(jnp.asarray(SEGMENTS), window=window))
  expected = np.zeros((B, LENGTH, LENGTH), bool)
  for b in range(B):
    for l in range(LENGTH):
      for s in range(LENGTH):
        expected[b, l, s] = l - window < s <= l and SEGMENTS[b, l] == SEGMENTS[b, s]
  np.testing.assert_array_equal(got, expected)
  if window <= 3:  # query 10 of doc 2 (which starts at 7): the window's first key and the next
    assert got[0, 10, 11 - window] and not got[0, 10, 10 - window]
  else:  # the window reaches past the document start: key 7 is the first visible
    assert got[0, 10, 7] and not got[0, 10, 6]
  np.testing.assert_array_equal(causal_segment_mask(jnp.asarray(SEGMENTS), window=LENGTH),
                                causal_segment_mask(jnp.asarray(SEGMENTS)))
  keys = np.asarray(sliding_window_keys(LENGTH, window))
  assert keys.shape == (LENGTH, min(window, LENGTH))
  np.testing.assert_array_equal(keys[LENGTH - 1], np.arange(LENGTH - keys.shape[1], LENGTH))
  assert np.all(keys[0, :-1] == -1) and keys[0, -1] == 0


def module_inputs(cfg, length=LENGTH, seed=0):
  x = jnp.asarray(np.random.default_rng(seed).standard_normal((1, length, cfg.hidden_size)),
                  jnp.float32)
  positions = jnp.arange(length, dtype=jnp.int32)[None]
  return x, positions


def module_params(helpers, module, x, positions, segments):
  shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), x, positions, segments))
  return helpers.random_tree(shapes, std=0.2)


def test_swa_query_sees_exactly_its_window(helpers):
  """S at query l == dense MLA on keys [l - W + 1, l] alone (positions kept), including the
  edge queries l < W; absorbed == expanded."""
  cfg = variant_config(helpers, "S")
  window = cfg.sliding_window
  x, positions = module_inputs(cfg)
  ones = jnp.ones_like(positions)
  swa, mla = SlidingWindowMLA(cfg), MLA(cfg, kind="mla")
  params = module_params(helpers, swa, x, positions, ones)
  assert (jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
      module_params(helpers, mla, x, positions, ones)))
  y, aux = jax.jit(lambda: swa.apply(params, x, positions, ones))()
  assert aux == {}
  y_absorbed, _ = jax.jit(lambda: swa.apply(params, x, positions, ones,
                                            mode=glm5_jax.Mode(form="absorbed")))()
  np.testing.assert_allclose(y_absorbed, y, rtol=1e-5, atol=1e-5)
  dense = jax.jit(lambda x, p: mla.apply(params, x, p, jnp.ones_like(p))[0])
  for l in (0, window - 2, window - 1, window, LENGTH - 1):
    first = max(0, l - window + 1)
    alone = dense(x[:, first:l + 1], positions[:, first:l + 1])
    np.testing.assert_allclose(y[:, l], alone[:, -1], rtol=1e-5, atol=1e-5,
                               err_msg=f"query {l}: S != MLA over its window alone")


def test_swa_with_window_over_length_is_mla(helpers):
  """Model level, params shared: S with window >= L gives bit-identical logits to M, and a
  window < L changes them."""
  cfg_s = variant_config(helpers, "SS", sliding_window=LENGTH)
  cfg_m = variant_config(helpers, "MM")
  params = helpers.random_params(cfg_m)
  tokens = np.random.default_rng(0).integers(1, cfg_m.vocab_size, (B, LENGTH))
  out_s = helpers.forward(cfg_s, params, tokens, segment_ids_BL=SEGMENTS)
  out_m = helpers.forward(cfg_m, params, tokens, segment_ids_BL=SEGMENTS)
  np.testing.assert_array_equal(out_s["logits"], out_m["logits"])
  np.testing.assert_array_equal(out_s["mtp_logits"], out_m["mtp_logits"])
  narrow = helpers.forward(variant_config(helpers, "SS"), params, tokens,
                           segment_ids_BL=SEGMENTS)["logits"]
  assert np.abs(narrow - out_m["logits"]).max() > 1e-3  # the window matters


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_swa_follows_dsa_impl(helpers, impl):
  """`model.dsa_impl` also drives S layers (they run as shared-top-k DSA layers handed their
  window, see the S entry of `glm5_jax.attention.kinds`): the O(L x W) gather paths give the
  dense-mask logits, main and MTP (whose layer is S too), for a window < L over packed rows."""
  cfg = variant_config(helpers, "SMS", dsa_impl="dense_mask")
  assert cfg.sliding_window < LENGTH
  params = helpers.random_params(cfg)
  tokens = np.random.default_rng(3).integers(1, cfg.vocab_size, (B, LENGTH))
  want = helpers.forward(cfg, params, tokens, segment_ids_BL=SEGMENTS)
  got = helpers.forward(variant_config(helpers, "SMS", dsa_impl=impl), params, tokens,
                        segment_ids_BL=SEGMENTS)
  for name in ("logits", "mtp_logits"):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4,
                               err_msg=f"S layers under dsa_impl={impl!r}: {name}")


# ---------------------------------------------------------------------------------------------
# 3. Causality and document locality of every new letter
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("letter", ["S", "N", "L"])
def test_new_layers_are_causal_and_document_local(helpers, letter):
  """d y[i] / d x[j] is exactly zero unless j <= i in the same document (and, for S, within
  the window); the diagonal is always nonzero. Packed row: [doc of 7 | doc of 9 | doc of 7]."""
  modules = {"S": SlidingWindowMLA, "N": GatedDeltaNet, "L": SimpleGatedDeltaNet}
  cfg = variant_config(helpers, letter)
  x, positions = module_inputs(cfg)
  segments = jnp.asarray(SEGMENTS[:1])
  module = modules[letter](cfg)
  params = module_params(helpers, module, x, positions, segments)
  jacobian = jax.jit(jax.jacrev(lambda x: module.apply(params, x, positions, segments)[0]))(x)
  influence_LL = np.abs(np.asarray(jacobian)[0, :, :, 0]).sum(axis=(1, 3))  # [i, j]
  i, j = np.arange(LENGTH)[:, None], np.arange(LENGTH)[None, :]
  allowed = (j <= i) & (SEGMENTS[0][:, None] == SEGMENTS[0][None, :])
  if letter == "S":
    allowed &= i - j < cfg.sliding_window
  leaks = np.argwhere(~allowed & (influence_LL != 0))
  assert leaks.size == 0, f"{letter}: output i depends on input j for (i, j) in {leaks[:5]}"
  assert np.all(np.diag(influence_LL) > 0)
  assert np.all(influence_LL[allowed] > 0), f"{letter}: some allowed (i, j) have no influence"


# ---------------------------------------------------------------------------------------------
# 4. Params, decode form, a model with every letter
# ---------------------------------------------------------------------------------------------


def attention_shapes(params, layer):
  return {name: jax.tree.map(lambda a: a.shape, p)
          for name, p in params[layer]["self_attn"].items()}


@pytest.mark.parametrize("gates", ["fixed", "learned"])
def test_linear_layers_reuse_the_mla_params(helpers, gates):
  """L has exactly M's attention params (plus the two declared [H] scalars when learned); N has
  M's plus its registry extras; S has exactly M's."""
  cfg = variant_config(helpers, "MSNL", simple_gdn_gates=gates)
  params = glm5_jax.abstract_params(cfg)
  m = attention_shapes(params, "layers_0")
  assert set(m) == set(MLA_PARAMS)
  assert attention_shapes(params, "layers_1") == m
  gdn = attention_shapes(params, "layers_2")
  assert {n: gdn[n] for n in m} == m and set(gdn) - set(m) == ATTENTION_KINDS["N"].extra_params
  h, w = cfg.num_attention_heads, cfg.gdn_conv_size
  assert gdn["q_conv1d"] == (w, h, cfg.qk_head_dim) and gdn["v_conv1d"] == (w, h, cfg.v_head_dim)
  assert gdn["g_proj"] == (cfg.hidden_size, h, cfg.v_head_dim) and gdn["A_log"] == (h,)
  scalars = {n: (h,) for n in ATTENTION_KINDS["L"].extra_params} if gates == "learned" else {}
  assert attention_shapes(params, "layers_3") == {**m, **scalars}


def test_decode_form_equals_training_form(helpers):
  """`Mode(form="absorbed")` runs N and L position by position (the recurrence a decoder steps)
  and S / M in the latent form; logits match the chunked / expanded forms, with packed
  documents."""
  cfg = variant_config(helpers, "NLSM")
  params = helpers.random_params(cfg)
  tokens = np.random.default_rng(2).integers(1, cfg.vocab_size, (B, LENGTH))
  expanded = helpers.forward(cfg, params, tokens, segment_ids_BL=SEGMENTS)
  absorbed = helpers.forward(cfg, params, tokens, segment_ids_BL=SEGMENTS,
                             mode=glm5_jax.Mode(form="absorbed"))
  for name in ("logits", "mtp_logits"):
    np.testing.assert_allclose(absorbed[name], expanded[name], rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # end to end: compiles a full train step of a 7-layer model (~1.5 min)
def test_model_with_every_letter_trains_one_step(helpers):
  """One jitted train step (loss, grads, Muon Split + AdamW) on a 7-layer model with every
  letter (no MTP, to keep the compile short): finite loss, every attention param moves."""
  cfg = variant_config(helpers, EVERY_LETTER, num_nextn_predict_layers=0, mtp_depths=0)
  params = helpers.random_params(cfg)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (B, LENGTH)),
                       jnp.int32)
  batch = {"tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(LENGTH), (B, LENGTH)),
           "segment_ids": jnp.asarray(SEGMENTS, jnp.int32), "loss_mask": jnp.ones_like(tokens)}
  optimizer, schedule = build_optimizer(optim_config(warmup_steps=0), params, total_steps=4)
  labels = param_labels(params)
  decay = weight_decay_mask(params)
  gdn_labels = labels["layers_4"]["self_attn"]
  assert gdn_labels["g_proj"] == "muon" and gdn_labels["q_b_proj"] == "muon"
  for name in ("a_proj", "b_proj", "q_conv1d", "A_log", "dt_bias"):
    assert gdn_labels[name] == "adam", name
  assert not decay["layers_4"]["self_attn"]["q_conv1d"]
  assert labels["layers_5"]["self_attn"]["decay_rate_log"] == "adam"
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                     opt_state=optimizer.init(params), rng=jax.random.key_data(jax.random.key(0)))
  step = jax.jit(make_train_step(cfg, StepConfig(), optimizer, schedule))
  new_state, metrics = step(state, batch)
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
  moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), params, new_state.params)
  for i, letter in enumerate(EVERY_LETTER):
    still = [jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_flatten_with_path(
        moved[f"layers_{i}"]["self_attn"])[0] if not m]
    assert not still, f"layer {i} ({letter}): attention params {still} did not move"


# ---------------------------------------------------------------------------------------------
# 5. Config, FLOPs, param stats
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("sliding_window", 0), ("gdn_conv_size", 0), ("gdn_chunk_size", -1),
    ("simple_gdn_gates", "sometimes"), ("simple_gdn_beta", 1.0), ("simple_gdn_beta", 0.0)])
def test_bad_variant_fields_name_the_field(field, value):
  model = tiny.get_config().model
  model[field] = value
  with pytest.raises(ConfigError, match=f"model.{field}"):
    ModelConfig.from_config(model)


def test_config_without_the_new_fields_gets_defaults():
  """A `model` section written before these fields existed (an older checkpoint's meta or
  converted config.json) still loads."""
  model = tiny.get_config().model
  for name in ("sliding_window", "gdn_conv_size", "gdn_chunk_size", "simple_gdn_gates",
               "simple_gdn_beta"):
    del model[name]
  cfg = ModelConfig.from_config(model)
  assert cfg.sliding_window == glm5_jax.model_config().sliding_window
  assert cfg.simple_gdn_gates == "fixed"


def test_interleave_pattern():
  assert interleave_pattern(4, 2, "S", "M") == "SMSM"
  assert interleave_pattern(8, 4, "M", "N", offset=3) == "NNNMNNNM"
  with pytest.raises(ValueError, match="letter"):
    interleave_pattern(4, 2, "X", "M")


def test_flops_and_param_stats_accept_every_letter(helpers):
  seq = 256
  flops = {p: flops_per_token(variant_config(helpers, p), seq) for p in ("MM", "SS", "NN", "LL")}
  assert flops["SS"] < flops["MM"]
  assert flops_per_token(variant_config(helpers, "SS", sliding_window=seq), seq) == flops["MM"]
  assert flops["NN"] > 0 and flops["LL"] > 0
  cfg = variant_config(helpers, EVERY_LETTER)
  summary = summarize(cfg)
  assert summary["breakdown"]["attention"] > 0
  kv = summary["kv_cache_bytes_per_token"]
  assert kv["swa_latent"] > 0 and summary["recurrent_state_bytes"] > 0
  # Every new param carries logical axes that shard (heads over "tensor", embed over "fsdp"
  # and "context").
  specs = param_mesh_specs(*glm5_jax.abstract_params_and_axes(cfg),
                           dict(data=1, fsdp=2, context=1, expert=1, tensor=2),
                           default_logical_axis_rules())
  gdn, simple = specs["layers_4"]["self_attn"], specs["layers_5"]["self_attn"]
  embed = ("fsdp", "context")
  assert tuple(gdn["g_proj"]) == (embed, "tensor", None)
  assert tuple(gdn["q_conv1d"]) == (None, "tensor", None)
  assert tuple(gdn["a_proj"]) == (embed, "tensor") and tuple(gdn["A_log"]) == ("tensor",)
  assert tuple(simple["decay_rate_log"]) == ("tensor",)
