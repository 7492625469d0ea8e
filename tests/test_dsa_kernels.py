"""DSA ops (`pallas_kernels`): XLA and Pallas (interpret mode) paths against the references,
TPU lowering of every kernel, and the three `model.dsa_impl` paths on the tiny model.

Indexer inputs are small integers with a power-of-two scale, so every score is exact in fp32
and bf16 and all paths must pick bit-identical keys: ReLU zeros and equal sums make many exact
ties, which must go to the earlier position (checked against a numpy brute force).
Tolerances: fp32 ~1e-5 relative; bf16 inputs (fp32 accumulation) 2e-2 forward, 5e-2 gradients.

The index contract of `pallas_kernels/__init__.py` (indices outside [0, S) are empty slots,
duplicates count twice, any sign of the indexer's weights and scale, +0.0 ties -0.0) is checked
on every path, forward and gradients, at the end of the kernel sections.

Notation (docs/design.md): B batch, L queries, S keys, J index heads, I index head dim, H heads,
C latent dim, R rope dim, T top-k.
"""

import functools
import re
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import glm5_jax
import pallas_kernels as pk
from glm5_jax.attention.dsa import restrict_topk_to_visible
from glm5_jax.attention.mla import MLA
from glm5_jax.config import ConfigError, model_config, validate_model_config
from tests.inputs import sparse_mla_inputs

# Small blocks (illegal on TPU, fine in interpret mode) so tiny shapes still span several query,
# key and slot blocks, partial last blocks and skipped causal blocks.
INDEXER_BLOCKS = dict(block_q=8, block_s=16, query_block=16, interpret=True)
MLA_BLOCKS = dict(block_t=4, backward_query_block=4, interpret=True)
INDEXER_IMPLS = {
    "xla": functools.partial(pk.indexer_topk_xla, query_block=8, key_block=16),
    "pallas": functools.partial(pk.indexer_topk_pallas, **INDEXER_BLOCKS),
    # Cached decoding's path, both selections (`lax.top_k`, the sort), several query blocks.
    "decode": functools.partial(pk.indexer_topk_decode, query_block=8),
    "decode_sort": functools.partial(pk.indexer_topk_decode, query_block=8, partial=False),
}
MLA_IMPLS = {
    "xla": functools.partial(pk.sparse_mla_xla, query_block=4),
    "pallas": functools.partial(pk.sparse_mla_pallas, **MLA_BLOCKS),
    # Every key's logits, the selection as counts (not causal: these selections are any rows).
    "dense": functools.partial(pk.sparse_mla_dense, query_block=4),
}


# ---------------------------------------------------------------------------------------------
# Lightning indexer
# ---------------------------------------------------------------------------------------------


def integer_indexer_inputs(b, l, s, j=3, i=8, seed=0, dtype=jnp.float32, doc_split=None):
  """Integer q, k, w (exact scores, many ties); queries at the end of the keys (q_pos =
  S - L + l); with `doc_split`, keys/queries before that position are document 1, after it 2."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.integers(-2, 3, (b, l, j, i)), dtype)
  k = jnp.asarray(rng.integers(-2, 3, (b, s, i)), dtype)
  w = jnp.asarray(rng.integers(-2, 3, (b, l, j)), jnp.float32)
  q_pos = jnp.broadcast_to(jnp.arange(s - l, s, dtype=jnp.int32), (b, l))
  k_seg = jnp.ones((b, s), jnp.int32)
  if doc_split is not None:
    k_seg = jnp.where(jnp.arange(s) >= doc_split, 2, 1).astype(jnp.int32)[None].repeat(b, 0)
  q_seg = k_seg[:, s - l:]
  return q, k, w, q_pos, q_seg, k_seg


def brute_force_topk(q, k, w, q_pos, q_seg, k_seg, topk, scale):
  """numpy: visible keys by descending score, ties to the earlier key, padded with -1."""
  q, k, w = (np.asarray(x, np.float64) for x in (q, k, w))
  scores = np.einsum("blj,bljs->bls", w, np.maximum(np.einsum("blji,bsi->bljs", q, k) * scale, 0))
  b, l, s = scores.shape
  out = -np.ones((b, l, min(topk, s)), np.int64)
  for bi in range(b):
    for li in range(l):
      keys = [si for si in range(s) if si <= q_pos[bi, li] and k_seg[bi, si] == q_seg[bi, li]]
      keys = sorted(keys, key=lambda si: (-scores[bi, li, si], si))[:topk]
      out[bi, li, :len(keys)] = keys
  return out


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas", "decode", "decode_sort"])
@pytest.mark.parametrize("b,l,s,topk,doc_split,dtype", [
    (2, 37, 37, 5, 17, jnp.float32),  # prefill, packed documents, k odd
    (1, 3, 40, 7, None, jnp.bfloat16),  # decode: 3 queries at the end of 40 cached keys
    (2, 1, 21, 30, None, jnp.float32),  # one query, k > S: clipped, trailing -1 slots
])
def test_indexer_topk_exact_with_ties(impl, b, l, s, topk, doc_split, dtype):
  args = integer_indexer_inputs(b, l, s, doc_split=doc_split, dtype=dtype)
  fn = pk.indexer_topk_reference if impl == "reference" else INDEXER_IMPLS[impl]
  got, scores = jax.jit(functools.partial(fn, topk=topk, scale=0.5))(*args)
  expected = brute_force_topk(*args, topk=topk, scale=0.5)
  np.testing.assert_array_equal(got, expected, err_msg=f"{impl}: top-k differs from the brute "
                                "force (descending score, ties to the earlier key)")
  assert got.dtype == jnp.int32 and scores.dtype == jnp.float32
  ref_idx, ref_scores = pk.indexer_topk_reference(*args, topk=topk, scale=0.5)
  np.testing.assert_array_equal(scores, ref_scores)
  assert np.all((np.asarray(got) < 0) == np.isneginf(np.asarray(scores)))


def test_indexer_scores_pallas_random_fp32():
  rng = np.random.default_rng(1)
  b, l, s, j, i = 2, 19, 45, 4, 8
  q, k = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in
          ((b, l, j, i), (b, s, i)))
  w = jnp.asarray(rng.standard_normal((b, l, j)), jnp.float32)
  q_pos = jnp.asarray(rng.integers(-1, s, (b, l)), jnp.int32)  # arbitrary positions, padding
  q_seg = jnp.asarray(rng.integers(0, 2, (b, l)), jnp.int32)
  k_seg = jnp.asarray(rng.integers(0, 2, (b, s)), jnp.int32)
  ref = pk.indexer_scores_reference(q, k, w, q_pos, q_seg, k_seg, scale=0.3)
  got = pk.indexer_scores_pallas(q, k, w, q_pos, q_seg, k_seg, scale=0.3, block_q=8, block_s=16,
                                 interpret=True)
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
  finite = np.isfinite(np.asarray(ref))
  np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(ref)[finite], rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("keys", ["gather", "dense"])
@pytest.mark.parametrize("scale", [0.5, -0.5])  # the sign of scale is not assumed
def test_indexer_scores_at_values_and_gradients(scale, keys):
  """Scores at the selection equal the dense scores gathered there, and their gradient equals
  autodiff of (dense scores -> gather) in q, k and w; both forms of `indexer_scores_at`."""
  rng = np.random.default_rng(2)
  b, l, s, j, i, t = 2, 9, 9, 3, 4, 5
  q, k, w, q_pos, q_seg, k_seg = integer_indexer_inputs(b, l, s, j, i)
  q, k = q + 0.1 * rng.standard_normal(q.shape), k + 0.1 * rng.standard_normal(k.shape)
  topk, _ = pk.indexer_topk_reference(q, k, w, q_pos, q_seg, k_seg, topk=t, scale=scale)
  assert np.any(np.asarray(topk) < 0)
  cotangent = jnp.asarray(rng.standard_normal((b, l, t)), jnp.float32)

  def dense_then_gather(q, k, w):
    dense = pk.indexer_scores_reference(q, k, w, q_pos, q_seg, k_seg, scale=scale)
    return jnp.take_along_axis(dense, jnp.maximum(topk, 0), axis=-1)

  def loss(fn, q, k, w):
    return jnp.sum(jnp.where(topk >= 0, fn(q, k, w), 0.0) * cotangent)

  at = lambda q, k, w: pk.indexer_scores_at(q, k, w, topk, scale=scale, query_block=4,
                                            keys=keys)
  valid = np.asarray(topk) >= 0
  values = np.asarray(jax.jit(at)(q, k, w))
  np.testing.assert_allclose(values[valid], np.asarray(dense_then_gather(q, k, w))[valid],
                             rtol=1e-5)
  assert np.all(np.isneginf(values[~valid]))
  grad = lambda fn: jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2)))(q, k, w)
  got, ref = grad(at), grad(dense_then_gather)
  for name, g, r in zip("qkw", got, ref):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


# ---------------------------------------------------------------------------------------------
# Sparse MLA
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["xla", "pallas", "dense"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_sparse_mla_forward_matches_reference(impl, dtype, tol):
  args = sparse_mla_inputs(dtype=dtype)
  ref_out, ref_lse = pk.sparse_mla_reference(*args, scale=0.25)
  out, lse = jax.jit(functools.partial(MLA_IMPLS[impl], scale=0.25))(*args)
  assert out.dtype == dtype and lse.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                             rtol=tol, atol=tol)
  np.testing.assert_allclose(lse, ref_lse, rtol=tol, atol=tol)
  assert np.isneginf(lse[0, 0]).all() and not np.asarray(out[0, 0], np.float32).any()


def _loss_with_lse(fn, cot_out, cot_lse, topk, q, q_rope, kv, k_rope):
  """A scalar that sends a cotangent into both outputs (lse -inf rows excluded)."""
  out, lse = fn(q, q_rope, kv, k_rope, topk, scale=0.25)
  return (jnp.sum(out.astype(jnp.float32) * cot_out)
          + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * cot_lse))


@pytest.mark.parametrize("impl", ["xla", "pallas", "dense"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)])
def test_sparse_mla_gradients_match_reference_autodiff(impl, dtype, tol):
  *arrays, topk = sparse_mla_inputs(dtype=dtype, seed=3)
  rng = np.random.default_rng(4)
  cot_out = jnp.asarray(rng.standard_normal(arrays[0].shape), jnp.float32)
  cot_lse = jnp.asarray(rng.standard_normal(arrays[0].shape[:3]), jnp.float32)
  grad = lambda fn: jax.jit(jax.grad(functools.partial(_loss_with_lse, fn, cot_out, cot_lse, topk),
                                     argnums=(0, 1, 2, 3)))(*arrays)
  ref = grad(pk.sparse_mla_reference)
  for name, g, r in zip(("q", "q_rope", "kv", "k_rope"), grad(MLA_IMPLS[impl]), ref):
    assert g.dtype == r.dtype == dtype
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * np.abs(r).max(),
                               err_msg=f"{impl} d{name}")


def test_sparse_mla_pallas_bf16_key_words_round_trip_exactly():
  """The kernel gathers bf16 keys as uint32 words (Mosaic's bf16 tile rule); unpacking must
  give back every bit: signed zeros, subnormals, infinities, the extremes."""
  from pallas_kernels.sparse_mla_pallas import _pack_halves, _unpack_halves
  special = [0.0, -0.0, 1e-40, -1e-40, np.inf, -np.inf, 3.3e38, -3.3e38, 1.0, -2.5]
  values = np.concatenate([special, np.random.default_rng(0).standard_normal(54)])
  kv = jnp.asarray(values.reshape(1, 2, 32), jnp.bfloat16)
  words = _pack_halves(kv)
  assert words.dtype == jnp.uint32 and words.shape == (1, 2, 16)
  back = _unpack_halves(words[0], jnp.bfloat16)
  np.testing.assert_array_equal(jax.lax.bitcast_convert_type(back, jnp.uint16),
                                jax.lax.bitcast_convert_type(kv[0], jnp.uint16))
  with pytest.raises(ValueError, match="kv / k_rope must be 32-bit, or bfloat16"):
    _pack_halves(kv.astype(jnp.float16))


@pytest.mark.parametrize("impl", ["xla", "pallas", "dense"])
def test_sparse_mla_check_grads(impl):
  """Finite differences on a small fp32 case (no empty rows: lse -inf is not differentiable)."""
  *arrays, topk = sparse_mla_inputs(b=1, l=5, s=9, h=2, c=8, r=4, t=6, seed=5)
  topk = topk.at[0, 0].set(jnp.arange(6, dtype=jnp.int32) - 1)  # one -1 slot, five rows
  rng = np.random.default_rng(6)
  cot_out = jnp.asarray(rng.standard_normal(arrays[0].shape), jnp.float32)
  cot_lse = jnp.asarray(rng.standard_normal(arrays[0].shape[:3]), jnp.float32)
  loss = jax.jit(functools.partial(_loss_with_lse, MLA_IMPLS[impl], cot_out, cot_lse, topk))
  check_grads(loss, arrays, order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-2)


def test_head_mean_probs_are_the_attention_at_the_selection():
  *arrays, topk = sparse_mla_inputs(seed=7)
  q, q_rope, kv, k_rope = arrays
  _, lse = pk.sparse_mla_reference(*arrays, topk, scale=0.25)
  probs = pk.sparse_mla_head_mean_probs(*arrays, topk, lse, scale=0.25, query_block=4)
  rows = jnp.maximum(topk, 0)
  gather = jax.vmap(lambda x, i: x[i])
  logits = (jnp.einsum("blhc,bltc->blht", q, gather(kv, rows))
            + jnp.einsum("blhr,bltr->blht", q_rope, gather(k_rope, rows))) * 0.25
  expected = jnp.where(topk[:, :, None] >= 0, jax.nn.softmax(
      jnp.where(topk[:, :, None] >= 0, logits, -jnp.inf), axis=-1), 0.0).mean(2)
  expected = jnp.where(jnp.isnan(expected), 0.0, expected)  # the empty row
  np.testing.assert_allclose(probs, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(probs).sum(-1)[np.asarray(topk).max(-1) >= 0], 1.0,
                             rtol=1e-5)
  # The `xla` path's target from its own attention pass, and the TPU kernel's from its forward
  # (the slot blocks' logits kept until the last block's lse; here 4 blocks of 4 slots, the last
  # partly padding): the same target, the same attention, no gradient through the target.
  for fused, plain in (
      (functools.partial(pk.sparse_mla_xla_with_kl_target, scale=0.25, query_block=4),
       functools.partial(pk.sparse_mla_xla, scale=0.25, query_block=4)),
      (functools.partial(pk.sparse_mla_pallas_with_head_probs, scale=0.25, **MLA_BLOCKS),
       functools.partial(pk.sparse_mla_pallas, scale=0.25, **MLA_BLOCKS)),
      (functools.partial(pk.sparse_mla_dense_with_kl_target, scale=0.25, query_block=4),
       functools.partial(pk.sparse_mla_dense, scale=0.25, query_block=4))):
    out, fused_lse, target = fused(*arrays, topk)
    want_out, want_lse = plain(*arrays, topk)
    np.testing.assert_allclose(target, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(fused_lse, want_lse)
    target_grads = jax.grad(lambda *a: fused(*a, topk)[2].sum(), argnums=(0, 1, 2, 3))(*arrays)
    assert all(not np.any(np.asarray(g)) for g in target_grads)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_decode_queries_equal_prefill_rows(impl):
  """Indexer + sparse attention for the last 3 queries against all 24 keys (a decode step) give
  exactly the last 3 rows of the full prefill."""
  b, s, h, c, r, t = 1, 24, 2, 8, 4, 6
  q_i, k_i, w, q_pos, q_seg, k_seg = integer_indexer_inputs(b, s, s, seed=8)
  *arrays, _ = sparse_mla_inputs(b=b, l=s, s=s, h=h, c=c, r=r, t=t, seed=9)
  indexer = jax.jit(functools.partial(INDEXER_IMPLS[impl], topk=t, scale=0.5))
  attention = jax.jit(functools.partial(MLA_IMPLS[impl], scale=0.25))
  topk_full, _ = indexer(q_i, k_i, w, q_pos, q_seg, k_seg)
  out_full, lse_full = attention(*arrays, topk_full)
  tail = lambda x: x[:, s - 3:]
  topk_step, _ = indexer(tail(q_i), k_i, tail(w), tail(q_pos), tail(q_seg), k_seg)
  np.testing.assert_array_equal(topk_step, tail(topk_full))
  out_step, lse_step = attention(tail(arrays[0]), tail(arrays[1]), arrays[2], arrays[3],
                                 topk_step)
  np.testing.assert_allclose(out_step, tail(out_full), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(lse_step, tail(lse_full), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Index contract (pallas_kernels/__init__.py): out-of-range = empty, duplicates, signs
# ---------------------------------------------------------------------------------------------

ALL_MLA_IMPLS = dict(reference=pk.sparse_mla_reference, **MLA_IMPLS)


def out_of_range_like_empty(topk, num_keys, seed=0):
  """`topk` with each -1 slot replaced by another index outside [0, S): S, S + 5, 2^30, -7 or
  -1, so the original is what the contract says these must equal."""
  rng = np.random.default_rng(seed)
  choices = np.array([num_keys, num_keys + 5, 2 ** 30, -7, -1])
  topk = np.asarray(topk)
  replaced = np.where(topk < 0, choices[rng.integers(0, len(choices), topk.shape)], topk)
  assert np.any(replaced >= num_keys) and np.any(replaced < -1)
  return jnp.asarray(replaced, jnp.int32)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas", "dense"])
def test_sparse_mla_out_of_range_indices_are_empty_slots(impl):
  """Forward and every gradient are bit-identical to the same selection with -1 there (before
  the contract the forward read row S - 1 for an index >= S and the backward dropped it)."""
  *arrays, topk = sparse_mla_inputs(b=2, l=7, s=12, h=2, c=8, r=4, t=6, seed=10)
  far = out_of_range_like_empty(topk, num_keys=12)
  rng = np.random.default_rng(11)
  cot_out = jnp.asarray(rng.standard_normal(arrays[0].shape), jnp.float32)
  cot_lse = jnp.asarray(rng.standard_normal(arrays[0].shape[:3]), jnp.float32)
  fn = ALL_MLA_IMPLS[impl]
  run = lambda sel: jax.jit(jax.value_and_grad(
      functools.partial(_loss_with_lse, fn, cot_out, cot_lse, sel), argnums=(0, 1, 2, 3)))(
          *arrays)
  forward = jax.jit(functools.partial(fn, scale=0.25))
  for got, want in zip(forward(*arrays, far), forward(*arrays, topk)):
    np.testing.assert_array_equal(got, want, err_msg=f"{impl}: forward")
  (loss_far, grads_far), (loss, grads) = run(far), run(topk)
  np.testing.assert_array_equal(loss_far, loss)
  for name, got, want in zip(("q", "q_rope", "kv", "k_rope"), grads_far, grads):
    np.testing.assert_array_equal(got, want, err_msg=f"{impl}: d{name}")


def test_indexer_ops_out_of_range_indices_are_empty_slots():
  """`indexer_scores_at` (values and gradients) and `sparse_mla_head_mean_probs`."""
  b, l, s, t = 2, 9, 9, 5
  q, k, w, q_pos, q_seg, k_seg = integer_indexer_inputs(b, l, s, seed=12)
  topk, _ = pk.indexer_topk_reference(q, k, w, q_pos, q_seg, k_seg, topk=t, scale=0.5)
  far = out_of_range_like_empty(topk, num_keys=s, seed=13)

  def summed(sel, q, k, w):
    scores = pk.indexer_scores_at(q, k, w, sel, scale=0.5, query_block=4)
    return jnp.sum(jnp.where(jnp.isfinite(scores), scores, 0.0) ** 2), scores

  grad = lambda sel: jax.jit(jax.grad(summed, argnums=(1, 2, 3), has_aux=True))(sel, q, k, w)
  (grads_far, scores_far), (grads, scores) = grad(far), grad(topk)
  np.testing.assert_array_equal(scores_far, scores)
  assert np.all(np.isneginf(np.asarray(scores_far)[np.asarray(far) != np.asarray(topk)]))
  for name, got, want in zip("qkw", grads_far, grads):
    np.testing.assert_array_equal(got, want, err_msg=f"d{name}")

  *arrays, mla_topk = sparse_mla_inputs(b=2, l=7, s=12, h=2, c=8, r=4, t=6, seed=14)
  mla_far = out_of_range_like_empty(mla_topk, num_keys=12, seed=15)
  _, lse = pk.sparse_mla_reference(*arrays, mla_topk, scale=0.25)
  probs = lambda sel: pk.sparse_mla_head_mean_probs(*arrays, sel, lse, scale=0.25, query_block=4)
  np.testing.assert_array_equal(probs(mla_far), probs(mla_topk))


def test_sparse_mla_duplicate_slots_count_twice():
  """A row selected m times weighs m exp(logit) in the softmax (numpy, float64, over the
  distinct rows with their multiplicities); every path agrees, forward and gradients (xla and
  pallas against the reference's autodiff, whose gather transposes to a scatter-add); each copy
  gets the same head-mean probability, and a row's probabilities still sum to 1."""
  *arrays, _ = sparse_mla_inputs(b=1, l=3, s=7, h=2, c=8, r=4, t=4, seed=16)
  topk = jnp.asarray([[[2, 2, 5, -1], [0, 0, 0, 3], [6, 1, 6, 1]]], jnp.int32)
  q, q_rope, kv, k_rope = (np.asarray(x, np.float64) for x in arrays)
  want_out, want_lse = np.zeros(q.shape), np.zeros(q.shape[:3])
  for li, row in enumerate(np.asarray(topk)[0]):
    keys, counts = np.unique(row[row >= 0], return_counts=True)
    logits = (q[0, li] @ kv[0, keys].T + q_rope[0, li] @ k_rope[0, keys].T) * 0.25  # [H, keys]
    weights = counts * np.exp(logits)
    want_out[0, li] = weights @ kv[0, keys] / weights.sum(-1, keepdims=True)
    want_lse[0, li] = np.log(weights.sum(-1))
  rng = np.random.default_rng(17)
  cot_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  cot_lse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
  grads = {}
  for impl, fn in ALL_MLA_IMPLS.items():
    out, lse = jax.jit(functools.partial(fn, scale=0.25))(*arrays, topk)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6, err_msg=impl)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-6, err_msg=impl)
    grads[impl] = jax.jit(jax.grad(functools.partial(_loss_with_lse, fn, cot_out, cot_lse, topk),
                                   argnums=(0, 1, 2, 3)))(*arrays)
  for impl in MLA_IMPLS:
    for name, got, want in zip(("q", "q_rope", "kv", "k_rope"), grads[impl], grads["reference"]):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{impl}: d{name}")
  probs = np.asarray(pk.sparse_mla_head_mean_probs(*arrays, topk, want_lse.astype(np.float32),
                                                   scale=0.25))
  np.testing.assert_allclose(probs[0, 0, 0], probs[0, 0, 1])
  np.testing.assert_allclose(probs[0, 1, :3], probs[0, 1, 0])
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("head_groups,key_ranges", [(1, 8), (3, 2)])
def test_sparse_mla_dense_causal_skips_future_keys(head_groups, key_ranges):
  """`sparse_mla_dense(causal=True)`, whose runs of query blocks form only the keys up to their
  last query: outputs, lse, the KL target and every gradient equal the reference's on the same
  selection with each slot after its query emptied (such slots are empty by contract), over
  blocks of 4 queries (the last one partial), three runs of one block or two of two (a scan),
  with the key gradients accumulated per head group, and the output buffers filled with NaN
  (`_uninitialized`: every row must be written before it is read); L != S is an error naming
  both."""
  nan_buffer = lambda shape, dtype, like: jnp.full(shape, jnp.nan, dtype)
  with mock.patch.object(sys.modules["pallas_kernels.sparse_mla_dense"], "_uninitialized",
                         nan_buffer):
    _check_dense_causal(head_groups, key_ranges)


def _check_dense_causal(head_groups, key_ranges):
  *arrays, topk = sparse_mla_inputs(b=2, l=11, s=11, h=3, c=8, r=4, t=7, seed=18)
  causal_topk = jnp.where(topk <= jnp.arange(11)[None, :, None], topk, -1)
  assert np.any(np.asarray(causal_topk) != np.asarray(topk))  # some slots select the future
  dense = functools.partial(pk.sparse_mla_dense, causal=True, query_block=4,
                            head_groups=head_groups, key_ranges=key_ranges)
  out, lse = jax.jit(functools.partial(dense, scale=0.25))(*arrays, topk)
  want_out, want_lse = pk.sparse_mla_reference(*arrays, causal_topk, scale=0.25)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-6)
  _, _, target = pk.sparse_mla_dense_with_kl_target(*arrays, topk, scale=0.25, causal=True,
                                                    query_block=4, key_ranges=key_ranges)
  np.testing.assert_allclose(target, pk.sparse_mla_head_mean_probs(
      *arrays, causal_topk, want_lse, scale=0.25), rtol=1e-5, atol=1e-6)
  rng = np.random.default_rng(19)
  cot_out = jnp.asarray(rng.standard_normal(arrays[0].shape), jnp.float32)
  cot_lse = jnp.asarray(rng.standard_normal(arrays[0].shape[:3]), jnp.float32)
  grad = lambda fn, sel: jax.jit(jax.grad(functools.partial(_loss_with_lse, fn, cot_out, cot_lse,
                                                            sel), argnums=(0, 1, 2, 3)))(*arrays)
  want_grads = grad(pk.sparse_mla_reference, causal_topk)
  for name, got, want in zip(("q", "q_rope", "kv", "k_rope"), grad(dense, topk), want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")
  # As parts (`dsa_kl_fused`'s): the forward alone, with the target, and the backward, whose
  # target comes from the p its gradients form.
  parts = pk.sparse_mla_dense_parts(causal=True, query_block=4, head_groups=head_groups,
                                    key_ranges=key_ranges)
  parts_out, parts_lse = jax.jit(functools.partial(parts.forward, scale=0.25))(*arrays, topk)
  np.testing.assert_array_equal(parts_out, out)
  np.testing.assert_array_equal(parts_lse, lse)
  np.testing.assert_array_equal(parts.forward(*arrays, topk, 0.25, head_probs=True)[2], target)
  *parts_grads, parts_target = jax.jit(functools.partial(parts.backward, scale=0.25))(
      *arrays, topk, out, lse, cot_out, cot_lse)
  np.testing.assert_allclose(parts_target, target, rtol=1e-5, atol=1e-6)
  for name, got, want in zip(("q", "q_rope", "kv", "k_rope"), parts_grads, want_grads):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"parts d{name}")
  *other, other_topk = sparse_mla_inputs(b=1, l=5, s=9, h=2, c=8, r=4, t=4)
  with pytest.raises(ValueError, match=r"causal=True.*L=5 queries.*S=9 keys"):
    pk.sparse_mla_dense(*other, other_topk, scale=0.25, causal=True)
  with pytest.raises(ValueError, match=r"key_ranges=0 must be >= 1"):
    pk.sparse_mla_dense(*arrays, topk, scale=0.25, causal=True, key_ranges=0)


def _expanded_reference(q_BLHK, k_BSHK, v_BSHV, topk_BLT, *, scale):
  """Dense attention of per-head q / k / v, each key weighted by how many valid slots of the
  query select it (the index contract); autodiff for the gradients."""
  s = k_BSHK.shape[1]
  valid_BLT = (topk_BLT >= 0) & (topk_BLT < s)
  counts_BLS = jnp.sum(jax.nn.one_hot(jnp.where(valid_BLT, topk_BLT, 0), s) * valid_BLT[..., None],
                       axis=2)
  logits = jnp.einsum("blhk,bshk->blhs", q_BLHK, k_BSHK) * scale
  logits = jnp.where(counts_BLS[:, :, None] > 0, logits, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(jnp.isfinite(logits), logits, 0.0), axis=-1))
  w = counts_BLS[:, :, None] * jnp.exp(logits - m[..., None])
  total = w.sum(-1)
  out = jnp.einsum("blhs,bshv->blhv", w / jnp.where(total > 0, total, 1.0)[..., None], v_BSHV)
  return out, jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


@pytest.mark.parametrize("causal,head_block,head_shards,key_ranges",
                         [(True, None, 1, 8), (True, 1, 2, 2), (True, 2, 3, 3), (False, 1, 1, 8)])
def test_sparse_mla_dense_expanded_matches_references(causal, head_block, head_shards,
                                                      key_ranges):
  """`sparse_mla_dense_expanded` (per-head keys and values, a loop over head groups, causal
  runs of queries): outputs, lse, every gradient and the KL target equal a dense reference's
  on the same selection (future slots emptied when causal; a duplicate slot and an index >= S
  when not); and, with the keys and values expanded from the latent rows, the absorbed
  reference's (`sparse_mla_reference`, the output then through W_vb). As parts too (the
  backward's target); bad shapes and head splits are errors naming them."""
  rng = np.random.default_rng(23)
  b, l, s, h, c, n, r, v, t = 2, 11, (11 if causal else 29), 6, 8, 5, 4, 3, 7
  q_nope, q_rope, kv, k_rope, topk = sparse_mla_inputs(b=b, l=l, s=s, h=h, c=n, r=r, t=t,
                                                       seed=24)
  kv = jnp.asarray(rng.standard_normal((b, s, c)), jnp.float32)
  w_kb = jnp.asarray(rng.standard_normal((c, h, n)) / 3, jnp.float32)
  w_vb = jnp.asarray(rng.standard_normal((c, h, v)) / 3, jnp.float32)
  if causal:
    sel = jnp.where(topk <= jnp.arange(l)[None, :, None], topk, -1)
    assert np.any(np.asarray(sel) != np.asarray(topk))
  else:
    topk = topk.at[1, 3, :2].set(jnp.asarray([4, 4])).at[1, 4, 0].set(s)
    sel = jnp.where(topk < s, topk, -1)
  qkv = (jnp.concatenate([q_nope, q_rope], -1),
         jnp.concatenate([jnp.einsum("bsc,chn->bshn", kv, w_kb),
                          jnp.broadcast_to(k_rope[:, :, None], (b, s, h, r))], -1),
         jnp.einsum("bsc,chv->bshv", kv, w_vb))
  options = dict(causal=causal, head_block=head_block, head_shards=head_shards,
                 key_ranges=key_ranges)
  op = functools.partial(pk.sparse_mla_dense_expanded, scale=0.25, **options)
  out, lse = jax.jit(op)(*qkv, topk)
  want_out, want_lse = _expanded_reference(*qkv, sel, scale=0.25)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
  latent_out, latent_lse = pk.sparse_mla_reference(jnp.einsum("blhn,chn->blhc", q_nope, w_kb),
                                                   q_rope, kv, k_rope, sel, scale=0.25)
  np.testing.assert_allclose(out, jnp.einsum("blhc,chv->blhv", latent_out, w_vb), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(lse, latent_lse, rtol=1e-5, atol=1e-5)
  cot_out = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
  cot_lse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)

  def loss(fn, selection, *qkv):
    o, ls = fn(*qkv, selection)
    return jnp.sum(o * cot_out) + jnp.sum(jnp.where(jnp.isfinite(ls), ls, 0.0) * cot_lse)

  grads = jax.jit(jax.grad(functools.partial(loss, op, topk), argnums=(0, 1, 2)))(*qkv)
  want_grads = jax.grad(functools.partial(
      loss, functools.partial(_expanded_reference, scale=0.25), sel), argnums=(0, 1, 2))(*qkv)
  for name, got, want in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")
  parts = pk.sparse_mla_dense_expanded_parts(**options)
  parts_out, parts_lse, target = parts.forward(*qkv, topk, 0.25, head_probs=True)
  np.testing.assert_allclose(parts_out, out, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(target, pk.sparse_mla_head_mean_probs(
      jnp.einsum("blhn,chn->blhc", q_nope, w_kb), q_rope, kv, k_rope, sel, latent_lse,
      scale=0.25), rtol=1e-5, atol=1e-6)
  *parts_grads, parts_target = parts.backward(*qkv, topk, out, lse, cot_out, cot_lse, 0.25)
  np.testing.assert_allclose(parts_target, target, rtol=1e-5, atol=1e-6)
  for name, got, want in zip("qkv", parts_grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"parts d{name}")
  if causal:
    with pytest.raises(ValueError, match=r"head_block=4 must be >= 1 and divide the 6 heads"):
      pk.sparse_mla_dense_expanded(*qkv, topk, scale=0.25, causal=True, head_block=4)
    with pytest.raises(ValueError, match=r"head_shards=4 must be >= 1 and divide the 6 heads"):
      pk.sparse_mla_dense_expanded(*qkv, topk, scale=0.25, head_shards=4)
    with pytest.raises(ValueError, match=r"shapes disagree: q .* \[B, L, H, K\], k"):
      pk.sparse_mla_dense_expanded(qkv[0], qkv[1][..., 1:], qkv[2], topk, scale=0.25)


@pytest.mark.parametrize("keys", ["gather", "dense"])
def test_indexer_scores_at_duplicate_slots_count_twice(keys):
  """Each copy of a twice-selected key gets its score, and the gradient is the sum of both
  slots' (autodiff of dense scores gathered at the same duplicated selection); both forms."""
  b, l, s = 1, 4, 6
  q, k, w, q_pos, q_seg, k_seg = integer_indexer_inputs(b, l, s, seed=18)
  topk = jnp.asarray([[[2, 2, -1], [0, 3, 0], [4, 4, 4], [5, 1, 5]]], jnp.int32)
  cotangent = jnp.asarray(np.random.default_rng(19).standard_normal((b, l, 3)), jnp.float32)

  def dense_then_gather(q, k, w):
    dense = pk.indexer_scores_reference(q, k, w, q_pos, q_seg, k_seg, scale=0.5)
    return jnp.take_along_axis(dense, jnp.maximum(topk, 0), axis=-1)

  at = lambda q, k, w: pk.indexer_scores_at(q, k, w, topk, scale=0.5, keys=keys)
  valid = np.asarray(topk) >= 0
  np.testing.assert_array_equal(np.asarray(at(q, k, w))[valid],
                                np.asarray(dense_then_gather(q, k, w))[valid])
  loss = lambda fn: lambda q, k, w: jnp.sum(jnp.where(valid, fn(q, k, w), 0.0) * cotangent)
  got = jax.grad(loss(at), argnums=(0, 1, 2))(q, k, w)
  want = jax.grad(loss(dense_then_gather), argnums=(0, 1, 2))(q, k, w)
  for name, g, r in zip("qkw", got, want):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")
  assert np.abs(np.asarray(got[1])[0, 4]).sum() > 0  # key 4 (three copies) got a gradient


@pytest.mark.parametrize("keys", ["dense", "gather"])
def test_indexer_scores_at_causal_ranges(keys):
  """`causal=True` on a causal selection: the same scores and gradients as without it, while
  "dense" runs its query blocks in key ranges (here 3 ranges of 4, 8 and 9 keys, and the KL's
  reduce_block inside them); a slot after its query is emptied; L != S is an error."""
  rng = np.random.default_rng(31)
  b, l, j, i, t = 2, 9, 3, 4, 5
  q, k, w, q_pos, q_seg, k_seg = integer_indexer_inputs(b, l, l, j, i, seed=30)
  q, k = q + 0.1 * rng.standard_normal(q.shape), k + 0.1 * rng.standard_normal(k.shape)
  topk, _ = pk.indexer_topk_reference(q, k, w, q_pos, q_seg, k_seg, topk=t, scale=0.5)
  assert np.all(np.asarray(topk) <= np.arange(l)[None, :, None])  # causal: q_pos = l here
  target = jax.nn.softmax(jnp.asarray(rng.standard_normal((b, l, t)), jnp.float32), axis=-1)
  kl = lambda s_BLT, t_BLT, p_BLT: jnp.sum(jnp.where(t_BLT >= 0, s_BLT, 0.0) * p_BLT, axis=-1)

  def at(causal, q, k, w, topk=topk, reduce_block=None):
    return pk.indexer_scores_at(q, k, w, topk, scale=0.5, query_block=4, keys=keys,
                                causal=causal, reduce_block=reduce_block,
                                per_query=[target] if reduce_block else ())

  valid = np.asarray(topk) >= 0
  got, want = np.asarray(at(True, q, k, w)), np.asarray(at(False, q, k, w))
  np.testing.assert_allclose(got[valid], want[valid], rtol=1e-6)
  assert np.all(np.isneginf(got[~valid]))
  loss = lambda causal: lambda q, k, w: jnp.sum(at(causal, q, k, w, reduce_block=kl))
  for name, g, r in zip("qkw", jax.grad(loss(True), argnums=(0, 1, 2))(q, k, w),
                        jax.grad(loss(False), argnums=(0, 1, 2))(q, k, w)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=f"d{name}")
  acausal = topk.at[:, 2, 0].set(7)  # query 2 selecting key 7: empty under causal
  np.testing.assert_array_equal(np.isneginf(np.asarray(at(True, q, k, w, acausal)))[:, 2, 0],
                                [True, True])
  with pytest.raises(ValueError, match=r"causal=True.*L=9 queries .* S=8 keys"):
    pk.indexer_scores_at(q, k[:, :8], w, jnp.minimum(topk, 7), scale=0.5, causal=True)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas", "decode"])
@pytest.mark.parametrize("weight_sign,scale", [(-1, 0.5), (1, -0.5), (-1, -0.5)])
def test_indexer_topk_any_sign_of_weights_and_scale(impl, weight_sign, scale):
  """Non-positive weights (most scores are then -0.0 or +0.0, depending on how a backend
  accumulates, and must still tie to the earlier key) and a negative scale select exactly the
  numpy brute force, which orders by the formula as written; visible keys with negative scores
  still fill the slots."""
  b, l, s, topk = 2, 13, 29, 6
  q, k, w, q_pos, q_seg, k_seg = integer_indexer_inputs(b, l, s, seed=20, doc_split=20)
  w = weight_sign * jnp.abs(w)
  args = (q, k, w, q_pos, q_seg, k_seg)
  fn = pk.indexer_topk_reference if impl == "reference" else INDEXER_IMPLS[impl]
  got, scores = jax.jit(functools.partial(fn, topk=topk, scale=scale))(*args)
  np.testing.assert_array_equal(got, brute_force_topk(*args, topk=topk, scale=scale))
  visible = np.asarray(pk.lightning_indexer.visible_keys(q_pos, q_seg, k_seg)).sum(-1)
  np.testing.assert_array_equal((np.asarray(got) >= 0).sum(-1), np.minimum(visible, topk))
  assert np.any(np.asarray(scores) < 0)


def test_select_topk_ties_signed_zeros_to_the_earlier_key():
  """`lax.top_k` alone ranks +0.0 above -0.0; the contract ties them (earlier key first)."""
  scores = jnp.asarray([[[-0.0, 0.0, -1.0, -0.0, -jnp.inf, 0.0]]], jnp.float32)
  topk, values = pk.select_topk(scores, 6)
  np.testing.assert_array_equal(topk, [[[0, 1, 3, 5, 2, -1]]])
  np.testing.assert_array_equal(values, [[[0, 0, 0, 0, -1, -np.inf]]])


# ---------------------------------------------------------------------------------------------
# TPU lowering (Mosaic) on CPU: catches lowering and block-shape errors without a TPU
# ---------------------------------------------------------------------------------------------


def _export_for_tpu(fn, *shapes):
  exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*shapes)
  text = exported.mlir_module()
  assert "tpu_custom_call" in text, "no Mosaic kernel in the lowered module"
  return text


@pytest.mark.parametrize("causal,b,l,s,h,blocks", [
    # 2 head blocks (the dq kernel: 1 of 4 heads x 32 queries), 4 x 2 (query, key) blocks
    # of which 2 are skipped, padded to them
    (True, 1, 200, 200, 4, dict(head_block=2, block_q=64, block_k=128)),
    (False, 2, 13, 150, 2, dict(head_block=1, block_q=8, block_k=128))])  # L != S, padded
def test_sparse_mla_dense_expanded_pallas_matches_xla(causal, b, l, s, h, blocks):
  """The TPU kernels (interpret mode) give `sparse_mla_dense_expanded`'s outputs, lse, input
  gradients and, as parts, the KL target from the forward and from the backward: several head
  blocks (the dq kernel's twice as many heads over half the queries), several query and key
  blocks with causal skipping, padded sequences, empty slots and a query with none; the parts'
  backward gives the target over every key, equal to the slots' where read there."""
  rng = np.random.default_rng(31)
  k_dim, v_dim, t = 16, 8, 9
  q, kk, vv = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((b, l, h, k_dim), (b, s, h, k_dim), (b, s, h, v_dim)))
  topk = np.stack([rng.permutation(s)[:t] for _ in range(b * l)]).reshape(b, l, t)
  topk = jnp.asarray(np.where(rng.random((b, l, t)) < 0.25, -1, topk), jnp.int32).at[0, 0].set(-1)
  xla = functools.partial(pk.sparse_mla_dense_expanded, scale=0.3, causal=causal)
  kernels = functools.partial(pk.sparse_mla_dense_expanded_pallas, scale=0.3, causal=causal,
                              interpret=True, **blocks)
  out, lse = jax.jit(kernels)(q, kk, vv, topk)
  want_out, want_lse = xla(q, kk, vv, topk)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
  cot_out = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
  cot_lse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)

  def loss(fn, *qkv):
    o, ls = fn(*qkv, topk)
    return jnp.sum(o * cot_out) + jnp.sum(jnp.where(jnp.isfinite(ls), ls, 0.0) * cot_lse)

  grads = jax.jit(jax.grad(functools.partial(loss, kernels), argnums=(0, 1, 2)))(q, kk, vv)
  want_grads = jax.grad(functools.partial(loss, xla), argnums=(0, 1, 2))(q, kk, vv)
  for name, got, want in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")
  parts = pk.sparse_mla_dense_expanded_pallas_parts(causal=causal, interpret=True, **blocks)
  want_target = pk.sparse_mla_dense_expanded_parts(causal=causal).forward(
      q, kk, vv, topk, 0.3, head_probs=True)[2]
  np.testing.assert_allclose(parts.forward(q, kk, vv, topk, 0.3, head_probs=True)[2],
                             want_target, rtol=1e-5, atol=1e-6)
  *_, target_BLS = parts.backward(q, kk, vv, topk, out, lse, cot_out, cot_lse, 0.3)
  assert target_BLS.shape == (b, l, s)  # over every key, for the indexer KL's kernels
  at_slots = jnp.take_along_axis(target_BLS, jnp.maximum(topk, 0), axis=-1)
  np.testing.assert_allclose(jnp.where(topk >= 0, at_slots, 0.0), want_target, rtol=1e-5,
                             atol=1e-6)


def test_dense_expanded_kernels_lower_for_tpu():
  """`sparse_mla_dense_expanded_pallas`'s three kernels lower for TPU at its default blocks
  (4 heads, 512 queries, 512 keys), and each `pl.CostEstimate` counts the causal steps only:
  of the 2 x 2 (query, key) blocks of 1,024 positions, 3 compute, for each of 2 head blocks."""
  b, l, h, k, v, t = 1, 1024, 8, 256, 256, 640
  sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16

  def forward_backward(q, kk, vv, topk):
    def loss(*arrays):
      out, lse = pk.sparse_mla_dense_expanded_pallas(*arrays, topk, scale=0.07, causal=True)
      return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, kk, vv)

  text = _export_for_tpu(forward_backward, sds((b, l, h, k), bf16), sds((b, l, h, k), bf16),
                         sds((b, l, h, v), bf16), sds((b, l, t), jnp.int32))
  kernels = re.findall(r'kernel_name = "(\w+)"', text)
  assert sorted(kernels) == ["sparse_mla_dense_expanded_dkv", "sparse_mla_dense_expanded_dq",
                             "sparse_mla_dense_expanded_forward"], kernels
  flops = sorted(int(m) for m in re.findall(r'flops\\22:(\d+)', text))
  pairs = 3 * 2 * 4 * 512 * 512  # computing steps x head-block heads x queries x keys
  assert flops == sorted([2 * pairs * (k + v), 2 * pairs * (2 * k + v),
                          2 * pairs * 2 * (k + v)]), flops


@pytest.mark.parametrize("l,s", [(256, 1024), (1, 1000)])  # prefill; decode, ragged key count
def test_kernels_lower_for_tpu(l, s):
  b, j, i, h, c, r, t = 1, 8, 128, 16, 512, 64, 640  # t: not a multiple of the 512-slot block
  sds = jax.ShapeDtypeStruct
  bf16, i32 = jnp.bfloat16, jnp.int32
  _export_for_tpu(
      functools.partial(pk.indexer_topk_pallas, topk=t, scale=i ** -0.5, interpret=False),
      sds((b, l, j, i), bf16), sds((b, s, i), bf16), sds((b, l, j), jnp.float32),
      sds((b, l), i32), sds((b, l), i32), sds((b, s), i32))

  def forward_backward(q, q_rope, kv, k_rope, topk):  # the forward that emits the KL target
    def loss(*arrays):
      out, lse, probs = pk.sparse_mla_pallas_with_head_probs(*arrays, topk, scale=0.07,
                                                             backward_query_block=64)
      return out.astype(jnp.float32).sum() + lse.sum() + probs.sum()
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, q_rope, kv, k_rope)

  arrays = (sds((b, l, h, c), bf16), sds((b, l, h, r), bf16), sds((b, s, c), bf16),
            sds((b, s, r), bf16), sds((b, l, t), i32))
  text = _export_for_tpu(forward_backward, *arrays) + _export_for_tpu(
      lambda *a: pk.sparse_mla_pallas(*a, scale=0.07), *arrays)
  kernels = re.findall(r'kernel_name = "(\w+)"', text)
  assert sorted(kernels) == ["sparse_mla_backward", "sparse_mla_forward",
                             "sparse_mla_forward_head_probs"], kernels
  if l == 1:
    return
  # Each kernel's pl.CostEstimate (what glm5_jax.planning.op_costs prices it by): its MXU
  # FLOPs, and the bytes it moves, each selected key row once per query for every product
  # (T padded to 1,024 slots: 2 blocks of 512); the backward runs on 64-query blocks.
  costs = [tuple(int(x) for x in m) for m in re.findall(
      r'bytes_accessed\\22:(\d+),\\0A\\22flops\\22:(\d+),.*?transcendentals\\22:(\d+)', text)]
  tp = 1024
  rows = tp * ((c + r) * 2 + 2 * 4)  # bf16 rows, the top-k row in SMEM and in VMEM
  q_bytes = h * (c + r) * 2
  forward = (l * (rows + q_bytes + h * c * 2 + h * 4),  # + out, lse
             2 * l * tp * h * (c + r + c), l * tp * h)
  with_probs = (forward[0] + l * tp * 4, forward[1], 2 * forward[2])  # + the target, exps
  p = 640  # the joined key-row columns [dkv | dk_rope | 0], C + R = 576 padded to lanes
  backward = (64 * (rows + q_bytes + h * c * 2 + 2 * h * 4  # + dout, lse, delta
                    + 2 * h * p * 2  # the key-row product's [[dout | 0], [q | q_rope | 0]]
                    + h * (c + r) * 4 + tp * p * 4),  # dq, dq_rope, the joined key rows: fp32
              # logits, dp, dq and dq_rope, the key rows as one product over 2H rows
              2 * 64 * tp * h * ((c + r) + c + (c + r) + 2 * p), 64 * tp * h)
  assert sorted(costs) == sorted([forward, with_probs, backward]), costs


# ---------------------------------------------------------------------------------------------
# The model: model.dsa_impl = dense_mask | xla | pallas_interpret (the TPU kernels interpreted)
# ---------------------------------------------------------------------------------------------


def test_dsa_impl_validation():
  for impl in ("dense_mask", "xla", "pallas", "pallas_interpret"):
    validate_model_config(model_config(dsa_impl=impl))
  with pytest.raises(ConfigError, match=r"model\.dsa_impl.*dense_mask.*xla.*pallas.*'sparse'"):
    validate_model_config(model_config(dsa_impl="sparse"))
  for keys in ("gather", "dense", "auto"):
    validate_model_config(model_config(dsa_impl="xla", dsa_attention_keys=keys))
  with pytest.raises(ConfigError, match=r"model\.dsa_attention_keys.*gather.*dense.*'all'"):
    validate_model_config(model_config(dsa_attention_keys="all"))


def test_auto_keys_go_dense_only_where_they_form_no_more_logits():
  """`dsa_attention_keys="auto"`: the dense form for causal self-attention with S <= 2 T only."""
  from glm5_jax.attention.mla import _dense_keys
  pick = lambda keys, l, s, t: _dense_keys(type("C", (), {"dsa_attention_keys": keys}), l, s, t)
  assert pick("auto", 4096, 4096, 2048) and pick("auto", 64, 64, 2048)
  assert not pick("auto", 8192, 8192, 2048)  # 4,096 causal keys a query on average vs 2,048
  assert not pick("auto", 1, 4096, 2048)  # decode-shaped: one query, the cache's keys
  assert pick("dense", 1, 4096, 2048) and not pick("gather", 4096, 4096, 2048)


def _loss_and_grads(cfg, params, tokens, segments):
  """LM loss + mean indexer KL of the sparse stage, and its gradient in every parameter."""
  positions = jnp.where(segments == 2, jnp.arange(tokens.shape[1]) - 13, jnp.arange(
      tokens.shape[1]))

  def loss(params):
    out = glm5_jax.forward(cfg, params, tokens, positions, segments,
                           mode=glm5_jax.Mode(dsa_stage="sparse"))
    logp = jax.nn.log_softmax(out["logits"][:, :-1])
    lm = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()
    auxes = list(out["aux"]["layers"].values()) + list(out["aux"]["mtp"])
    kl = jnp.mean(jnp.stack([a["indexer_kl"].mean() for a in auxes if "indexer_kl" in a]))
    topk = [a["topk_indices"] for a in auxes if "topk_indices" in a]
    return lm + kl, (out["logits"], kl, topk)

  # The forward alone beside it, one program: where the KL target comes from the attention's
  # backward, a differentiated forward's KL is 0 and only the forward alone has its value.
  return jax.jit(lambda p: (jax.value_and_grad(loss, has_aux=True)(p), loss(p)[1][1]))(params)


def test_dsa_impls_agree_on_tiny_model(helpers):
  """Same logits, top-k, indexer KL and parameter gradients from all three paths on the tiny
  model (one own-indexer layer, one shared-top-k layer, one MTP depth with its own indexer;
  dense FFNs), packed rows; and from "xla" with the sparse attention over every key
  (`dsa_attention_keys="dense"`: causal blocks, the attention and the KL as one op whose KL
  target comes from the attention's backward: its differentiated forward's KL is 0, the
  gradients exact, the forward alone's KL the others'): in the absorbed form on "xla", and
  in the expanded form on the TPU kernels, "pallas_interpret" (`mla._expanded_dense_keys`: the
  tiny model's N + V < 2 C)."""
  from glm5_jax.attention import mla
  b, l = 2, 32
  results = {}
  variants = {"dense_mask": {}, "xla": {}, "pallas_interpret": {},
              "xla_dense_keys": dict(dsa_attention_keys="dense"),
              "pallas_interpret_dense_keys": dict(dsa_attention_keys="dense")}
  for name, extra in variants.items():
    cfg = helpers.config(dsa_impl=name.removesuffix("_dense_keys"), attention_pattern="DR",
                         num_hidden_layers=2, mtp_depths=1,
                         first_k_dense_replace=2, **extra)  # dense FFNs: faster compile
    assert mla._expanded_dense_keys(cfg) == (cfg.dsa_impl == "pallas_interpret"), name
    params = helpers.random_params(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (b, l)), jnp.int32)
    segments = jnp.where(jnp.arange(l) >= 13, 2, 1).astype(jnp.int32)[None].repeat(b, 0)
    results[name] = _loss_and_grads(cfg, params, tokens, segments)
  ((ref_loss, (ref_logits, ref_kl, ref_topk)), ref_grads), ref_forward_kl = results["dense_mask"]
  assert float(ref_kl) > 0 and float(ref_forward_kl) == float(ref_kl)
  for impl in ("xla", "pallas_interpret", "xla_dense_keys", "pallas_interpret_dense_keys"):
    ((loss, (logits, kl, topk)), grads), forward_kl = results[impl]
    for got, want in zip(topk, ref_topk):
      np.testing.assert_array_equal(got, want, err_msg=f"{impl}: top-k differs")
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5, err_msg=impl)
    np.testing.assert_allclose(forward_kl, ref_kl, rtol=1e-5, atol=1e-6, err_msg=impl)
    in_backward = impl.endswith("_dense_keys")
    np.testing.assert_allclose(kl, 0.0 if in_backward else ref_kl, rtol=1e-5, atol=1e-6,
                               err_msg=impl)
    np.testing.assert_allclose(loss, ref_loss - ref_kl if in_backward else ref_loss, rtol=1e-5,
                               err_msg=impl)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    for (path, want), got in zip(flat_ref, jax.tree_util.tree_leaves(grads)):
      scale = max(float(np.abs(want).max()), 1e-6)
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale,
                                 err_msg=f"{impl}: gradient of {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_given_selection_is_restricted_to_visible_keys(helpers, impl):
  """A shared-top-k layer handed a selection that reaches across documents and into the future
  (as a sliding window over packed rows would) attends exactly as the dense mask path does."""
  b, l = 2, 16
  x = jnp.asarray(np.random.default_rng(0).standard_normal((b, l, 64)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(l), (b, l))
  segments = jnp.where(jnp.arange(l) >= 6, 2, 1).astype(jnp.int32)[None].repeat(b, 0)
  window = jnp.arange(l)[:, None] - jnp.arange(-1, 4)[None, :]  # includes the next key
  selection = jnp.broadcast_to(jnp.where(window >= 0, window, -1), (b, l, 5)).astype(jnp.int32)
  restricted = np.asarray(restrict_topk_to_visible(selection, segments))
  assert np.all(restricted[:, 6:] != 5) and np.all(restricted <= np.arange(l)[None, :, None])
  ys = {}
  for name in ("dense_mask", impl):
    module = MLA(helpers.config(dsa_impl=name), kind="dsa_shared_topk")
    params = helpers.random_tree(jax.eval_shape(
        lambda: module.init(jax.random.key(0), x, positions, segments, selection)))
    ys[name], _ = jax.jit(module.apply)(params, x, positions, segments, selection)
  np.testing.assert_allclose(ys[impl], ys["dense_mask"], rtol=1e-5, atol=1e-6)


def test_dense_expanded_target_resident_equals_partials(monkeypatch):
  """The dq kernel's head-summed probabilities kept in VMEM per query block (its head blocks
  adding to them, causal key blocks skipped) equal the per-head-block partials summed in XLA
  (what it writes where a query block's row does not fit)."""
  rng = np.random.default_rng(5)
  b, l, h, t = 1, 200, 4, 9
  q, kk = (jnp.asarray(rng.standard_normal((b, l, h, 16)), jnp.float32) for _ in range(2))
  vv = jnp.asarray(rng.standard_normal((b, l, h, 8)), jnp.float32)
  topk = jnp.asarray(np.stack([rng.permutation(l)[:t] for _ in range(l)])[None], jnp.int32)
  out, lse = pk.sparse_mla_dense_expanded(q, kk, vv, topk, scale=0.3, causal=True)
  dout, dlse = jnp.ones_like(out), jnp.zeros_like(lse)

  def target():
    parts = pk.sparse_mla_dense_expanded_pallas_parts(causal=True, interpret=True, head_block=1,
                                                      block_q=64, block_k=128)
    return parts.backward(q, kk, vv, topk, out, lse, dout, dlse, 0.3)[-1]

  resident = target()
  # (the package exports a function of the module's name)
  monkeypatch.setattr(sys.modules["pallas_kernels.sparse_mla_dense_expanded_pallas"],
                      "_RESIDENT_PROBS_BYTES", 0)
  partials = target()
  np.testing.assert_allclose(resident, partials, rtol=1e-6, atol=1e-7)
  visible = np.tril(np.ones((l, l), bool))[None]
  np.testing.assert_array_equal(np.asarray(resident)[~visible], 0.0)
  sees_a_key = (np.asarray(topk) <= np.arange(l)[None, :, None]).any(-1)  # else no mass
  np.testing.assert_allclose(np.asarray(resident).sum(-1), sees_a_key * 1.0, rtol=1e-5)
  assert sees_a_key.any() and not sees_a_key.all()
