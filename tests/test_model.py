"""Model-level properties of GLM-5 on the tiny config (docs/reference.md section 2).

Causality (token perturbation through the indexer, top-k and MoE; gradients nanodo-style),
MLA absorbed == expanded (and the mode reaching every MLA layer), DSA with top-k >= length ==
dense MLA, RoPE shift invariance, deterministic top-k with ties, the shared-top-k 'R' layers,
GQA, and packed sequences. The models run unrolled (`scan_layers=False`): these tests read
each layer's params and aux; tests/test_scan_layers.py shows the scanned model computes the same.

Notation: B batch, L length, S keys, T top-k, V vocab, D hidden, P MTP depths.
"""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import glm5_jax
import pallas_kernels
from glm5_jax.attention.dsa import topk_mask
from glm5_jax.attention.mla import MLA

B, L = 2, 32  # index_topk of the tiny config is 16 < L: selection is really sparse
DOC_A = 13  # packed rows: document A is positions [0, 13), document B [13, 32)


def distinct_tokens(cfg, shape, seed=0):
  """Tokens all distinct across the whole batch and never 0 (the MTP padding token), so a row of
  the embedding table belongs to exactly one (row, position)."""
  rng = np.random.default_rng(seed)
  return rng.permutation(np.arange(1, cfg.vocab_size))[:np.prod(shape)].reshape(shape)


def random_tokens(cfg, shape, seed=0):
  return np.random.default_rng(seed).integers(1, cfg.vocab_size, size=shape)


def dsa_aux(out):
  """`{name: aux}` of every layer that produced a top-k, main layers then `mtp_{d}`."""
  named = dict(out["aux"]["layers"])
  named.update({f"mtp_{d}": aux for d, aux in enumerate(out["aux"]["mtp"], start=1)})
  return {name: aux for name, aux in named.items() if "topk_indices" in aux}


def drop_indexers(tree):
  """The params without every `indexer` subtree: a DSA model's params as a dense-MLA model's."""
  if not isinstance(tree, dict):
    return tree
  return {k: drop_indexers(v) for k, v in tree.items() if k != "indexer"}


# ---------------------------------------------------------------------------------------------
# 1. Causality
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["D", "DRGD"])
def test_causal_token_perturbation(helpers, pattern):
  """Changing token t (row 0) changes no main logit at positions < t and no MTP depth-d logit
  at positions < t - d (depth d at position i reads token i + d), and nothing in row 1 (the
  MoE dispatch sorts the tokens of the whole batch together)."""
  cfg = helpers.config(scan_layers=False, attention_pattern=pattern)
  params = helpers.random_params(cfg)
  tokens = random_tokens(cfg, (B, L))
  base = helpers.forward(cfg, params, tokens)
  assert base["aux"]["layers"]["layers_3"]["topk_indices"].shape[-1] == cfg.index_topk < L
  for t in (0, 1, 7, 16, 20, L - 1):
    changed = tokens.copy()
    changed[0, t] = tokens[0, t] % (cfg.vocab_size - 1) + 1  # a different nonzero token
    out = helpers.forward(cfg, params, changed)
    np.testing.assert_array_equal(out["logits"][1], base["logits"][1],
                                  err_msg=f"row 1 changed when row 0's token {t} changed")
    np.testing.assert_array_equal(out["mtp_logits"][:, 1], base["mtp_logits"][:, 1],
                                  err_msg=f"MTP row 1 changed when row 0's token {t} changed")
    np.testing.assert_array_equal(out["logits"][0, :t], base["logits"][0, :t],
                                  err_msg=f"main logits before position {t} changed")
    assert np.any(out["logits"][0, t] != base["logits"][0, t]), f"position {t} did not change"
    for d in range(1, cfg.mtp_depths + 1):
      first = max(t - d, 0)
      np.testing.assert_array_equal(
          out["mtp_logits"][d - 1, 0, :first], base["mtp_logits"][d - 1, 0, :first],
          err_msg=f"MTP depth {d} logits before position {t - d} changed (token {t} changed)")
      if t - d >= 0:
        assert np.any(out["mtp_logits"][d - 1, 0, t - d] != base["mtp_logits"][d - 1, 0, t - d]), (
            f"MTP depth {d} at position {t - d} ignores token {t}")


def test_causal_gradients(helpers, tiny_cfg, tiny_params):
  """nanodo-style: the loss at (row b, position i) has exactly zero gradient w.r.t. the input
  embedding of every later position (main head), every position past i + d (MTP depth d), and
  every position of the other row. Tokens are distinct over the batch, so the embedding-table
  row of a token is the input embedding of exactly one (row, position)."""
  cfg, params = tiny_cfg, tiny_params
  tokens = jnp.asarray(distinct_tokens(cfg, (B, L)), jnp.int32)
  targets = jnp.asarray(random_tokens(cfg, (B, L), seed=1), jnp.int32)

  def position_losses(embed_VD):
    out = glm5_jax.forward(cfg, {**params, "embed_tokens": embed_VD}, tokens)
    logits_PBLV = jnp.concatenate([out["logits"][None], out["mtp_logits"]])
    logp_PBLV = jax.nn.log_softmax(logits_PBLV, axis=-1)
    return -jnp.take_along_axis(logp_PBLV, targets[None, :, :, None], axis=-1)[..., 0]

  @jax.jit
  def gradient_norms(embed_VD):
    # One backward pass per loss, in a `lax.map` (`jacrev` would vmap `ragged_dot` over a
    # non-leading axis, which JAX does not implement).
    losses_PBL, pullback = jax.vjp(position_losses, embed_VD)
    onehots = jnp.eye(losses_PBL.size, dtype=losses_PBL.dtype).reshape((-1,) + losses_PBL.shape)
    norms = jax.lax.map(lambda onehot: jnp.abs(pullback(onehot)[0]).sum(-1), onehots)
    return norms.reshape(losses_PBL.shape + (embed_VD.shape[0],))

  grad_norm_PBLV = np.asarray(gradient_norms(params["embed_tokens"]))
  # influence[p, b, i, c, j]: |d loss(p, b, i) / d embedding of token (c, j)|
  influence = grad_norm_PBLV[..., np.asarray(tokens)]
  i = np.arange(L)[:, None]
  j = np.arange(L)[None, :]
  for p in range(1 + cfg.mtp_depths):  # p = 0: main head; p = d: MTP depth d
    for b in range(B):
      for c in range(B):
        block_LL = influence[p, b, :, c, :]
        allowed_LL = (j <= i + p) if b == c else np.zeros((L, L), bool)
        leaks = np.argwhere(~allowed_LL & (block_LL != 0))
        assert leaks.size == 0, (
            f"head {p} (0 = main, d = MTP depth d), row {b}: loss at position i has a nonzero "
            f"gradient from the embedding at (row {c}, position j) for (i, j) in "
            f"{leaks[:5].tolist()}")
      # The bound is tight: position i + p (when it exists) always matters.
      own = influence[p, b, np.arange(L - p), b, np.arange(p, L)]
      assert np.all(own > 0), f"head {p}, row {b}: loss ignores the token it reads last"


# ---------------------------------------------------------------------------------------------
# 2-3. MLA forms; DSA with top-k >= length is dense MLA
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["M", "D"])
def test_absorbed_equals_expanded(helpers, pattern):
  cfg = helpers.config(scan_layers=False, attention_pattern=pattern)
  params = helpers.random_params(cfg)
  tokens = random_tokens(cfg, (B, L))
  expanded = helpers.forward(cfg, params, tokens, mode=glm5_jax.Mode(form="expanded"))
  absorbed = helpers.forward(cfg, params, tokens, mode=glm5_jax.Mode(form="absorbed"))
  for name in ("logits", "mtp_logits", "hidden"):
    np.testing.assert_allclose(absorbed[name], expanded[name], rtol=1e-5, atol=1e-5,
                               err_msg=f"{pattern}: absorbed MLA {name} differ from expanded")
  for name, aux in dsa_aux(expanded).items():
    np.testing.assert_array_equal(dsa_aux(absorbed)[name]["topk_indices"], aux["topk_indices"])


def test_absorbed_mode_reaches_every_mla_layer(helpers):
  """`forward(mode=Mode(form="absorbed"))` must run every MLA attention in the absorbed form,
  the MTP layer's included (it decodes from the same latent cache when drafting). Checked at
  trace time by intercepting `MLA.__call__`."""
  cfg = helpers.config(scan_layers=False, attention_pattern="M")
  signature = inspect.signature(MLA.__call__)
  calls = []

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, MLA) and context.method_name == "__call__":
      bound = signature.bind(context.module, *args, **kwargs)
      bound.apply_defaults()
      calls.append(("/".join(context.module.path), bound.arguments["mode"].form))
    return next_fun(*args, **kwargs)

  def run(params, tokens):
    with nn.intercept_methods(record):
      return glm5_jax.forward(cfg, params, tokens, mode=glm5_jax.Mode(form="absorbed"))

  jax.eval_shape(run, glm5_jax.abstract_params(cfg), jax.ShapeDtypeStruct((1, 8), jnp.int32))
  assert len(calls) == cfg.num_hidden_layers + cfg.mtp_depths
  expanded = sorted({path for path, form in calls if form != "absorbed"})
  assert not expanded, (
      f"LIBRARY BUG: forward(mode=Mode(form='absorbed')) still runs {expanded} in the expanded "
      "form (MTPLayer calls its DecoderLayer without passing `mode`)")


def test_dsa_with_full_topk_equals_dense_mla(helpers):
  """With index_topk >= L every visible key is selected, so DSA is exactly dense MLA on the
  shared MLA params (the D model only adds indexer params). index_topk == L is the edge case;
  k > L is clipped by `select_topk` (checked with k = 20 > 11 keys below)."""
  index_topk = L
  cfg_d = helpers.config(scan_layers=False, attention_pattern="D", index_topk=index_topk)
  cfg_m = helpers.config(scan_layers=False, attention_pattern="M")
  params_d = helpers.random_params(cfg_d)
  params_m = drop_indexers(params_d)
  assert (jax.tree_util.tree_structure(params_m)
          == jax.tree_util.tree_structure(glm5_jax.abstract_params(cfg_m)))
  tokens = random_tokens(cfg_d, (B, L))
  out_d = helpers.forward(cfg_d, params_d, tokens)
  out_m = helpers.forward(cfg_m, params_m, tokens)
  topk = out_d["aux"]["layers"]["layers_0"]["topk_indices"]
  assert topk.shape == (B, L, L)  # top-k is clipped to the number of keys
  for name in ("logits", "mtp_logits"):
    np.testing.assert_array_equal(out_d[name], out_m[name],
                                  err_msg=f"DSA (top-k {index_topk} >= {L}) {name} != dense MLA")


@pytest.mark.parametrize("pattern", ["M", "D"])
def test_position_shift_invariance(helpers, pattern):
  """RoPE is relative: shifting every position by a constant leaves attention, the indexer
  scores (rope applied alike to index queries and keys) and so the logits unchanged, up to
  float rounding of the rotation angles."""
  cfg = helpers.config(scan_layers=False, attention_pattern=pattern)
  params = helpers.random_params(cfg)
  tokens = random_tokens(cfg, (B, L))
  base = helpers.forward(cfg, params, tokens)
  shifted = helpers.forward(cfg, params, tokens, np.arange(L)[None].repeat(B, 0) + 37)
  for name, aux in dsa_aux(base).items():
    visible = np.isfinite(aux["index_scores"])
    np.testing.assert_allclose(np.asarray(dsa_aux(shifted)[name]["index_scores"])[visible],
                               np.asarray(aux["index_scores"])[visible], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(dsa_aux(shifted)[name]["topk_indices"], aux["topk_indices"])
  np.testing.assert_allclose(shifted["logits"], base["logits"], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(shifted["mtp_logits"], base["mtp_logits"], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# 4. Deterministic top-k
# ---------------------------------------------------------------------------------------------


def reference_topk(scores_BLS, k):
  """numpy: visible keys (score > -inf) by descending score, ties to the earlier position,
  padded with -1."""
  b, l, s = scores_BLS.shape
  out = -np.ones((b, l, min(k, s)), np.int64)
  for bi in range(b):
    for li in range(l):
      keys = [si for si in range(s) if scores_BLS[bi, li, si] > -np.inf]
      keys.sort(key=lambda si: (-scores_BLS[bi, li, si], si))
      keys = keys[:k]
      out[bi, li, :len(keys)] = keys
  return out


def select_topk(scores_BLS, k):
  """The top-k every DSA path uses (`pallas_kernels.select_topk`), indices only."""
  return pallas_kernels.select_topk(scores_BLS, k)[0]


def tie_heavy_scores(b=2, l=11, s=11, seed=0):
  """ReLU of small integers (half exact zeros, many equal positives), causally masked."""
  rng = np.random.default_rng(seed)
  scores = np.maximum(rng.integers(-3, 3, size=(b, l, s)), 0).astype(np.float32)
  causal = np.arange(l)[:, None] >= np.arange(s)[None, :]
  return np.where(causal, scores, -np.inf).astype(np.float32)


@pytest.mark.parametrize("k", [1, 4, 7, 11, 20])
def test_select_topk_ties_go_to_earlier_positions(k):
  scores = tie_heavy_scores()
  expected = reference_topk(scores, k)
  got = np.asarray(select_topk(jnp.asarray(scores), k))
  np.testing.assert_array_equal(got, expected, err_msg="top-k order/ties differ from the "
                                "reference (descending score, ties to the earlier key)")
  assert got.dtype == np.int32
  for _ in range(3):
    np.testing.assert_array_equal(select_topk(jnp.asarray(scores), k), got)
  jitted = jax.jit(select_topk, static_argnums=1)
  for _ in range(2):
    np.testing.assert_array_equal(jitted(jnp.asarray(scores), k), got)
  # Query l sees l + 1 keys: its slots past that are -1.
  slots = np.arange(got.shape[-1])
  np.testing.assert_array_equal(
      got < 0, np.broadcast_to(slots[None, None, :] > np.arange(11)[None, :, None], got.shape))


def test_select_topk_all_zero_scores():
  """All scores tied: the first k visible positions, in order."""
  scores = np.where(np.tri(6, dtype=bool), 0.0, -np.inf).astype(np.float32)[None]
  got = np.asarray(select_topk(jnp.asarray(scores), 3))
  expected = np.array([[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2]])
  np.testing.assert_array_equal(got[0], expected)


def test_topk_mask_marks_exactly_the_selected_keys():
  scores = tie_heavy_scores(seed=1)
  topk = select_topk(jnp.asarray(scores), 4)
  mask = np.asarray(topk_mask(topk, scores.shape[-1]))
  expected = np.zeros(scores.shape, bool)
  for (b, l, _), key in np.ndenumerate(np.asarray(topk)):
    if key >= 0:
      expected[b, l, key] = True
  np.testing.assert_array_equal(mask, expected)
  assert not mask[:, :, -1][:, :-1].any()  # -1 slots must not wrap around to the last key


def test_model_topk_is_deterministic(helpers):
  """Two forward calls select identical keys in every DSA layer and MTP depth; so does a call
  with the batch rows swapped (the selection of a row does not depend on its batch-mates)."""
  cfg = helpers.config(scan_layers=False)
  params = helpers.random_params(cfg)
  tokens = random_tokens(cfg, (B, L))
  first = dsa_aux(helpers.forward(cfg, params, tokens))
  second = dsa_aux(helpers.forward(cfg, params, tokens))
  swapped = dsa_aux(helpers.forward(cfg, params, tokens[::-1]))
  assert len(first) == cfg.num_hidden_layers + cfg.mtp_depths
  for name, aux in first.items():
    np.testing.assert_array_equal(second[name]["topk_indices"], aux["topk_indices"],
                                  err_msg=f"{name}: top-k differs between identical calls")
    np.testing.assert_array_equal(swapped[name]["topk_indices"][::-1], aux["topk_indices"],
                                  err_msg=f"{name}: top-k depends on the batch order")


# ---------------------------------------------------------------------------------------------
# 5. 'R' layers reuse the previous top-k
# ---------------------------------------------------------------------------------------------


def test_shared_topk_layers_reuse_previous_selection(helpers):
  cfg = helpers.config(scan_layers=False, attention_pattern="DRRD")
  params = helpers.random_params(cfg)
  for i, letter in enumerate("DRRD"):
    has_indexer = "indexer" in params[f"layers_{i}"]["self_attn"]
    assert has_indexer == (letter == "D"), f"layer {i} ({letter}): indexer params {has_indexer}"
  assert "indexer" in params["mtp"]["layer"]["self_attn"]

  out = helpers.forward(cfg, params, random_tokens(cfg, (B, L)))
  aux = out["aux"]["layers"]
  for i in (1, 2):
    np.testing.assert_array_equal(aux[f"layers_{i}"]["topk_indices"],
                                  aux["layers_0"]["topk_indices"],
                                  err_msg=f"R layer {i} does not use layer 0's selection")
    assert "index_scores" not in aux[f"layers_{i}"]
  assert np.any(aux["layers_3"]["topk_indices"] != aux["layers_0"]["topk_indices"]), (
      "layer 3 (D) should select with its own indexer")


def test_mtp_after_shared_topk_layer_gets_own_indexer(helpers):
  """The MTP pass has no previous DSA layer, so an 'R' last layer gives the MTP layer an
  indexer of its own."""
  params = glm5_jax.abstract_params(helpers.config(scan_layers=False, attention_pattern="DDRR"))
  assert "indexer" not in params["layers_3"]["self_attn"]
  assert "indexer" in params["mtp"]["layer"]["self_attn"]


def test_shared_topk_attention_applies_given_selection(helpers, tiny_cfg):
  """The 'R' attention module restricts attention to `prev_topk_BLT`: selecting every visible
  key is dense MLA; selecting only key 0 makes every query's output v_0's projection."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((B, L, tiny_cfg.hidden_size)),
                  jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(L), (B, L))
  segments = jnp.ones((B, L), jnp.int32)
  shared, dense = MLA(tiny_cfg, kind="dsa_shared_topk"), MLA(tiny_cfg, kind="mla")
  params = helpers.random_tree(jax.eval_shape(
      lambda: dense.init(jax.random.key(0), x, positions, segments)))
  apply_shared = jax.jit(lambda topk: shared.apply(params, x, positions, segments, topk))
  all_keys = select_topk(jnp.where(jnp.tri(L, dtype=bool), 0.0, -jnp.inf)[None].repeat(B, 0), L)
  y_dense, _ = jax.jit(lambda: dense.apply(params, x, positions, segments))()
  y_all, aux = apply_shared(all_keys)
  np.testing.assert_array_equal(aux["topk_indices"], all_keys)
  np.testing.assert_array_equal(y_all, y_dense)
  only_first = jnp.full((B, L, L), -1, jnp.int32).at[:, :, 0].set(0)
  y_first, _ = apply_shared(only_first)
  np.testing.assert_allclose(y_first, jnp.broadcast_to(y_first[:, :1], y_first.shape),
                             rtol=1e-6, atol=1e-6)
  assert not np.allclose(y_first, y_dense)
  with pytest.raises(ValueError, match="previous"):
    shared.apply(params, x, positions, segments, None)


# ---------------------------------------------------------------------------------------------
# 7. GQA
# ---------------------------------------------------------------------------------------------


def test_gqa_pattern(helpers):
  cfg = helpers.config(scan_layers=False, attention_pattern="G", num_hidden_layers=2, mtp_depths=1)
  d, h, g, k = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.gqa_head_dim
  assert 1 < g < h
  params = helpers.random_params(cfg)
  for attn in [params[f"layers_{i}"]["self_attn"] for i in range(cfg.num_hidden_layers)] + [
      params["mtp"]["layer"]["self_attn"]]:
    shapes = {name: w.shape for name, w in attn.items()}
    assert shapes == {"q_proj": (d, h, k), "k_proj": (d, g, k), "v_proj": (d, g, k),
                      "o_proj": (h, k, d)}
  tokens = random_tokens(cfg, (B, L))
  out = helpers.forward(cfg, params, tokens)
  assert out["logits"].shape == (B, L, cfg.vocab_size)
  assert out["mtp_logits"].shape == (cfg.mtp_depths, B, L, cfg.vocab_size)
  assert np.all(np.isfinite(out["logits"])) and np.all(np.isfinite(out["mtp_logits"]))
  assert not dsa_aux(out)


# ---------------------------------------------------------------------------------------------
# 8. Packed sequences
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["M", "D"])
def test_packed_document_equals_document_alone(helpers, pattern):
  """Row = [doc A (13 tokens) | doc B (19 tokens)], positions restarting at 0 for doc B. Doc B's
  logits (main and MTP: it ends the row, so its MTP inputs past the end are padding either way)
  equal doc B run alone, and no DSA selection crosses the document boundary."""
  cfg = helpers.config(scan_layers=False, attention_pattern=pattern)
  params = helpers.random_params(cfg)
  tokens = random_tokens(cfg, (B, L))
  positions = np.concatenate([np.arange(DOC_A), np.arange(L - DOC_A)])[None].repeat(B, 0)
  segments = np.concatenate([np.ones(DOC_A), 2 * np.ones(L - DOC_A)])[None].repeat(B, 0)
  packed = helpers.forward(cfg, params, tokens, positions, segments)
  alone = helpers.forward(cfg, params, tokens[:, DOC_A:])
  np.testing.assert_allclose(packed["logits"][:, DOC_A:], alone["logits"], rtol=1e-5,
                             atol=1e-5, err_msg=f"{pattern}: packed doc B != doc B alone")
  np.testing.assert_allclose(packed["mtp_logits"][:, :, DOC_A:], alone["mtp_logits"], rtol=1e-5,
                             atol=1e-5, err_msg=f"{pattern}: packed doc B MTP != doc B alone")
  for name, aux in dsa_aux(packed).items():
    topk = np.asarray(aux["topk_indices"])
    doc_a, doc_b = topk[:, :DOC_A], topk[:, DOC_A:]
    assert np.all(doc_a < DOC_A), f"{name}: a doc A query selected a doc B key"
    assert np.all((doc_b == -1) | (doc_b >= DOC_A)), f"{name}: a doc B query selected a doc A key"
    np.testing.assert_array_equal(np.where(doc_b >= 0, doc_b - DOC_A, -1),
                                  dsa_aux(alone)[name]["topk_indices"],
                                  err_msg=f"{name}: packed doc B selects other keys than alone")


# ---------------------------------------------------------------------------------------------
# 9. Token ids outside the vocabulary
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id, name", [("vocab", "vocab_size"), (-1, "negative")])
def test_concrete_bad_token_id_is_refused(tiny_cfg, tiny_params, bad_id, name):
  """`logits` and `forward` name the id, its position and vocab_size (an id >= vocab used to
  give a NaN row; a negative one wrapped to another token)."""
  del name
  bad_id = tiny_cfg.vocab_size if bad_id == "vocab" else bad_id
  tokens = random_tokens(tiny_cfg, (B, L))
  tokens[1, 5] = bad_id
  message = (rf"token id {bad_id} at position \(1, 5\) is outside the vocabulary "
             rf"\[0, vocab_size={tiny_cfg.vocab_size}\)")
  with pytest.raises(ValueError, match=message):
    glm5_jax.logits(tiny_cfg, tiny_params, tokens)
  with pytest.raises(ValueError, match=message):
    glm5_jax.forward(tiny_cfg, tiny_params, jnp.asarray(tokens, jnp.int32))
  with pytest.raises(ValueError, match="must be integers"):
    glm5_jax.logits(tiny_cfg, tiny_params, tokens.astype(np.float32))
  for shape in ((5,), (0,), (1, 0), (0, 4), (1, 2, 3)):
    with pytest.raises(ValueError, match=rf"expected token ids of shape \[batch, seq\], both >= 1, "
                       rf"got shape {re.escape(str(shape))}"):
      glm5_jax.logits(tiny_cfg, tiny_params, np.zeros(shape, np.int32))


def test_traced_bad_token_id_marks_only_the_logits_that_read_it(helpers, tiny_cfg, tiny_params):
  """Under jit the ids cannot be checked: an out-of-range id (here >= vocab in row 0, negative
  in row 1, at position P) makes NaN exactly the logits that read it (main at P; MTP depth d at
  P and P - d) and nothing else; positions before P are unchanged (causality), later ones
  finite."""
  p = 20
  tokens = random_tokens(tiny_cfg, (B, L))
  bad = tokens.copy()
  bad[0, p], bad[1, p] = tiny_cfg.vocab_size + 3, -2
  clean = helpers.forward(tiny_cfg, tiny_params, tokens)
  out = helpers.forward(tiny_cfg, tiny_params, bad)  # jitted: traced tokens, no check
  nan_rows = np.isnan(out["logits"]).any(-1)
  np.testing.assert_array_equal(nan_rows, np.arange(L)[None, :].repeat(B, 0) == p)
  assert np.isnan(out["logits"][:, p]).all()
  np.testing.assert_array_equal(out["logits"][:, :p], clean["logits"][:, :p])
  for d in range(1, tiny_cfg.mtp_depths + 1):
    nan_rows = np.isnan(out["mtp_logits"][d - 1]).any(-1)
    np.testing.assert_array_equal(nan_rows[0], np.isin(np.arange(L), [p, p - d]),
                                  err_msg=f"MTP depth {d}")
    np.testing.assert_array_equal(out["mtp_logits"][d - 1][:, :p - d],
                                  clean["mtp_logits"][d - 1][:, :p - d])
