"""Pallas Triton lightning indexer with streaming top-k (`pallas_kernels.lightning_indexer_triton`)
on CPU: interpret-mode runs against `indexer_topk_reference`, CUDA lowering at GLM-5 shapes, and
its input errors.

Inputs are small integers, weights multiples of 1/2 and power-of-two scales, so every score is
exact in fp32 (and bf16 inputs) whatever the accumulation order: the selection must equal the
reference's bit for bit, ties (ReLU zeros, equal sums) to the lower index, +0.0 tying -0.0.
Tiny blocks (legal for the interpreter, not for Triton) make tiny shapes span several key tiles,
partial tiles, padded query blocks and repeated compactions of the candidate buffer.

Interpret mode runs one program at a time and cannot show what only a GPU shows (races between
threads, Triton's own compiler): that is the device suite's check.

Notation (docs/design.md): B batch, L queries, S keys, J index heads, I index head dim, T top-k.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lightning_indexer import indexer_scores_reference, indexer_topk_reference
from pallas_kernels.lightning_indexer_triton import indexer_topk_triton
from tests.conftest import lower_for_cuda

TINY = dict(block_q=4, block_s=16, chunk=16, interpret=True)


def _assert_same_selection(args, *, topk, scale, **options):
  got_idx, got_scores = indexer_topk_triton(*args, topk=topk, scale=scale, **(TINY | options))
  want_idx, want_scores = indexer_topk_reference(*args, topk=topk, scale=scale)
  assert got_idx.dtype == jnp.int32 and got_idx.shape == want_idx.shape
  np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(want_idx))
  np.testing.assert_array_equal(np.asarray(got_scores), np.asarray(want_scores))
  return want_idx


def _packed_prefill(seed, b=2, length=45, heads=4, dim=16, dtype=jnp.float32):
  """Prefill (q_pos = arange) over packed documents of random lengths; the last 5 queries of
  each row are padding (q_pos -1). Returns the indexer's six array arguments."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.integers(-2, 3, (b, length, heads, dim)), dtype)
  k = jnp.asarray(rng.integers(-2, 3, (b, length, dim)), dtype)
  w = rng.integers(-2, 3, (b, length, heads)) / 2
  w[:, ::3] = -np.abs(w[:, ::3]) - 0.5  # all heads negative: zero sums come out as -0.0
  w = jnp.asarray(w, jnp.float32)
  seg = np.cumsum(rng.random((b, length)) < 0.12, axis=1).astype(np.int32)
  q_pos = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy()
  q_pos[:, -5:] = -1
  args = (q, k, w, jnp.asarray(q_pos), jnp.asarray(seg), jnp.asarray(seg))
  return args


@pytest.mark.parametrize("topk,scale,heads", [(8, -0.5, 4), (64, 0.25, 1)])
def test_packed_prefill_matches_reference(topk, scale, heads):
  """Packed documents, padded queries, S = 45 (not a multiple of the 16-key tile), negative
  weights and scales, many exact ties; topk 8 (the 32-slot buffer compacts on the long rows)
  and 64 > S (T = S, -1 / -inf padding). With one head the reference's zero scores of queries
  whose weight is negative are -0.0 (a one-term sum keeps the sign), beside +0.0 elsewhere: the
  two must tie. (In interpret mode the kernel's own head sum starts from +0.0, so its -0.0 to
  +0.0 map matters on GPU only, where Triton's reduction has no +0.0 identity.)"""
  args = _packed_prefill(seed=topk, heads=heads)
  scores = np.asarray(indexer_scores_reference(*args, scale=scale))
  # The case has what it claims: zero scores of both signs, exact ties, rows that see no key.
  visible = np.isfinite(scores)
  assert (visible & (scores == 0) & ~np.signbit(scores)).any()
  assert heads > 1 or (visible & (scores == 0) & np.signbit(scores)).any()
  assert (~visible).all(-1).any()
  block_q = max(4, 16 // heads)  # a Triton dot has >= 16 rows
  idx = _assert_same_selection(args, topk=topk, scale=scale, block_q=block_q)
  assert idx.shape[-1] == min(topk, 45) and (idx == -1).any()


def test_decode_bf16_and_no_gradient():
  """Decode-like queries at the end of 70 cached keys (q_pos = S - L + l), bf16 inputs, two
  documents, J = 3 and I = 12 (padded inside to 4 and 16); the scores pass no gradient to q, k
  or w (inputs detached, as the reference)."""
  rng = np.random.default_rng(3)
  b, l, s, heads, dim = 1, 6, 70, 3, 12
  q = jnp.asarray(rng.integers(-2, 3, (b, l, heads, dim)), jnp.bfloat16)
  k = jnp.asarray(rng.integers(-2, 3, (b, s, dim)), jnp.bfloat16)
  w = jnp.asarray(rng.integers(-2, 3, (b, l, heads)) / 2, jnp.float32)
  q_pos = jnp.arange(s - l, s, dtype=jnp.int32)[None]
  k_seg = jnp.where(jnp.arange(s) < 20, 1, 2).astype(jnp.int32)[None]
  q_seg = jnp.full((b, l), 2, jnp.int32).at[0, 0].set(1)  # a query of the first document

  def total(q, k, w):  # one interpret-mode compile for the selection and its gradient
    idx, scores = indexer_topk_triton(q, k, w, q_pos, q_seg, k_seg, topk=12, scale=-0.25,
                                      **TINY)
    return jnp.sum(jnp.where(jnp.isfinite(scores), scores, 0.0)), (idx, scores)

  (_, (idx, scores)), grads = jax.value_and_grad(total, (0, 1, 2), has_aux=True)(q, k, w)
  want_idx, want_scores = indexer_topk_reference(q, k, w, q_pos, q_seg, k_seg, topk=12,
                                                 scale=-0.25)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
  np.testing.assert_array_equal(np.asarray(scores), np.asarray(want_scores))
  assert (np.asarray(idx[0, 0]) < 20).all() and (np.asarray(idx[0, 1:]) >= 20).all()  # documents
  assert all(not np.asarray(g, np.float32).any() for g in grads)


# radix_bits 2 (the default) runs in the other tests; capacity 32 / 128 is 2 / 8 chunks, so the
# counting passes step 2 / 8 chunks at a time.
@pytest.mark.parametrize("radix_bits,capacity", [(1, 32), (4, 128)])
def test_repeated_compaction_keeps_earliest_ties(radix_bits, capacity):
  """Scores that rise with the key index in steps of three equal keys: under positive total
  weight every key enters except those tying the threshold (at most two per compaction), so the
  32-slot buffer (T = 3) compacts about (200 - 3) / (32 - 3) ~ 6 times (the 128-slot one about
  twice), and the T-th best value
  is shared by several keys (the earliest must win). Negated weights reverse the order (few keys
  enter after the first ones)."""
  b, l, s, heads, dim = 1, 8, 200, 4, 16
  k = np.zeros((b, s, dim), np.float32)
  k[0, :, 0] = np.arange(s) // 3
  k[0, :, 1] = 1.0
  q = np.zeros((b, l, heads, dim), np.float32)
  q[..., 0] = 1.0
  q[..., 1] = np.arange(heads) - 1.0   # head biases -1, 0, 1, 2: ReLU cuts some small keys
  w = np.tile(np.array([1.0, 0.5, -0.5, 1.0], np.float32), (b, l, 1))
  w[0, 4:] *= -1.0                      # queries 4..7: best keys are the earliest ones
  q_pos = np.full((b, l), s - 1, np.int32)
  q_pos[0, 3] = 150                     # a causal cut inside a tile
  # Query 2 sees only keys 5, 21, 37, ...: fewer than T when the first compaction runs (at
  # capacity 32 query 0 fills the buffer after two tiles): its threshold must stay -inf until it
  # has T keys.
  k_seg = (np.arange(s) % 16 == 5).astype(np.int32)[None]
  q_seg = np.zeros((b, l), np.int32)
  q_seg[0, 2] = 1
  args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(w), jnp.asarray(q_pos),
          jnp.asarray(q_seg), jnp.asarray(k_seg))
  idx = _assert_same_selection(args, topk=3, scale=1.0, capacity=capacity,
                               radix_bits=radix_bits)
  np.testing.assert_array_equal(np.asarray(idx[0, 0]), [198, 199, 195])


@pytest.mark.parametrize("b,l,s,dtype,options", [
    (1, 8192, 8192, jnp.bfloat16, {}),  # prefill, the default Hopper blocks
    (2, 3, 65536, jnp.float32, dict(block_q=16, block_s=128, radix_bits=4, num_warps=4)),
])
def test_lowers_for_cuda_at_glm5_shapes(b, l, s, dtype, options):
  """GLM-5 indexer shapes (J = 32, I = 128, T = 2048) lower to one Triton custom call, for
  prefill (L = S) and decode (3 queries, 64K keys, fp32 inputs, other block options); no
  [L, S]-sized array appears in the module, only the [B, L', C] candidate buffer (L' = L
  padded to the query block, C = 2T). Lowering only: Triton's own compiler (ptxas) is not run."""
  heads, dim = 32, 128
  sds = jax.ShapeDtypeStruct
  shapes = (sds((b, l, heads, dim), dtype), sds((b, s, dim), dtype), sds((b, l, heads), dtype),
            sds((b, l), jnp.int32), sds((b, l), jnp.int32), sds((b, s), jnp.int32))
  fn = functools.partial(indexer_topk_triton, topk=2048, scale=128 ** -0.5, **options)
  text = lower_for_cuda(fn, *shapes)
  assert text.count("__gpu$xla.gpu.triton") == 1, "expected exactly one Triton kernel"
  assert "lightning_indexer_topk" in text
  padded = -(-l // options.get("block_q", 8)) * options.get("block_q", 8)
  assert f"tensor<{b}x{padded}x4096xf32>" in text  # the candidate buffer
  assert f"x{l}x{s}x" not in text and f"<{l}x{s}x" not in text, "an [L, S] array exists"


@pytest.mark.parametrize("change,message", [
    (dict(k_BSI=jnp.zeros((1, 40, 8))), "indexer shapes disagree"),
    (dict(block_q=6), "block_q=6 must be a power of two"),
    (dict(block_q=2), "needs block_q"),
    (dict(block_s=8), "needs block_q"),
    (dict(capacity=24), "capacity=24 must be a multiple of chunk"),
    (dict(topk=0), "topk=0"),
    (dict(radix_bits=3), "radix_bits=3"),
])
def test_bad_inputs_raise(change, message):
  b, l, s, heads, dim = 1, 8, 40, 4, 16
  call = dict(q_BLJI=jnp.zeros((b, l, heads, dim)), k_BSI=jnp.zeros((b, s, dim)),
              weights_BLJ=jnp.zeros((b, l, heads)), q_pos_BL=jnp.zeros((b, l), jnp.int32),
              q_seg_BL=jnp.zeros((b, l), jnp.int32), k_seg_BS=jnp.zeros((b, s), jnp.int32),
              topk=4, scale=1.0, **TINY)
  with pytest.raises(ValueError, match=message):
    indexer_topk_triton(**(call | change))
