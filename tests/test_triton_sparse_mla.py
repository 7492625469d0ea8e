"""The Pallas Triton sparse MLA (`pallas_kernels/sparse_mla_triton.py`) on CPU: interpret-mode
numerics against `sparse_mla_reference` (forward, gradients, split-k decode, the index
contract's edge cases) and the CUDA lowering at GLM-5 shapes (no GPU needed; Triton's own
compiler, ptxas, does not run here)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import sparse_mla_head_mean_probs, sparse_mla_reference
# The functions by name from the module: the package may later export `sparse_mla_triton`, the
# function, under the module's name.
from pallas_kernels.blocking import empty_out_of_range
from pallas_kernels.sparse_mla_triton import (_auto_split, sparse_mla_flops, sparse_mla_triton,
                                              sparse_mla_triton_parts,
                                              sparse_mla_triton_with_head_probs)
from tests.conftest import lower_for_cuda
from tests.inputs import sparse_mla_inputs

SCALE = 0.25


def mla_inputs(b=2, l=5, s=45, h=3, c=16, r=4, t=37, dtype=jnp.float32, seed=0):
  """`tests.inputs.sparse_mla_inputs` with every case of the index contract in its selection:
  distinct rows with ~25% -1 slots; query (0, 0) selects nothing; query (0, 1) holds indices
  S, S + 7 and -3 (empty slots); query (1, 2) selects row 7 three times, twice in one slot block
  of 16 and once in another; query (1, 3) has one valid slot, the last (earlier blocks empty)."""
  *arrays, topk = sparse_mla_inputs(b, l, s, h, c, r, t, dtype, seed)
  topk = np.array(topk)
  topk[0, 1, :3] = [s, s + 7, -3]
  topk[1, 2, [1, 5, 20]] = 7
  topk[1, 3] = -1
  topk[1, 3, t - 1] = 11
  return arrays + [jnp.asarray(topk, jnp.int32)]


def _close(got, ref, tol, what):
  got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  assert np.array_equal(np.isneginf(got), np.isneginf(ref)), f"{what}: -inf pattern"
  finite = np.isfinite(ref)
  np.testing.assert_allclose(got[finite], ref[finite], rtol=tol, atol=tol * max(
      1.0, np.abs(ref[finite]).max()), err_msg=what)


@pytest.mark.parametrize("options", [{}, {"block_t": 16, "split_k": 1}])
def test_forward_matches_reference_fp32(options):
  """Default blocks (bt 32: two slot blocks, auto split-k for these 10 tokens) and bt 16 with
  no split (three blocks, T = 37 padded to 48), the latter with the head-mean probabilities of
  the second sweep: `sparse_mla_head_mean_probs`, H = 3 padded to 16 (the padded heads, zero
  queries with uniform probabilities, stay out of the mean)."""
  args = mla_inputs()
  ref_out, ref_lse = sparse_mla_reference(*args, scale=SCALE)
  run = sparse_mla_triton_with_head_probs if options.get("split_k") == 1 else sparse_mla_triton
  out, lse, *probs = jax.jit(functools.partial(run, scale=SCALE, interpret=True,
                                               **options))(*args)
  assert out.shape == ref_out.shape and out.dtype == jnp.float32 and lse.dtype == jnp.float32
  _close(out, ref_out, 1e-5, "out")
  _close(lse, ref_lse, 1e-5, "lse")
  assert np.isneginf(lse[0, 0]).all() and not np.asarray(out[0, 0]).any()
  if probs:
    _close(probs[0], sparse_mla_head_mean_probs(*args, ref_lse, scale=SCALE), 1e-5, "probs")


def _loss(fn, cot_out, cot_lse, topk, q, q_rope, kv, k_rope):
  """A scalar that sends a cotangent into out and lse (lse -inf rows excluded), and fn's
  outputs beyond those two (the head probabilities) as aux."""
  out, lse, *rest = fn(q, q_rope, kv, k_rope, topk, scale=SCALE)
  return (jnp.sum(out.astype(jnp.float32) * cot_out)
          + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * cot_lse)), (out, lse, *rest)


def _grads(fn, args, seed=4, with_outputs=False):
  """d loss / d (q, q_rope, kv, k_rope); with_outputs: `(grads, fn's outputs)`, one program."""
  *arrays, topk = args
  rng = np.random.default_rng(seed)
  cot_out = jnp.asarray(rng.standard_normal(arrays[0].shape), jnp.float32)
  cot_lse = jnp.asarray(rng.standard_normal(arrays[0].shape[:3]), jnp.float32)
  loss = functools.partial(_loss, fn, cot_out, cot_lse, topk)
  grads, outputs = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*arrays)
  return (grads, outputs) if with_outputs else grads


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 5e-2)])  # fp32: the 64-heads test
def test_gradients_match_reference_autodiff(dtype, tol):
  """dq, dq_rope, dkv, dk_rope against autodiff of the reference: duplicates receive both
  slots' gradients, empty and out-of-range slots none, the empty query no NaN; and the bf16
  forward (out in bf16) within bf16 rounding of the reference's."""
  args = mla_inputs(dtype=dtype, seed=3)
  triton = functools.partial(sparse_mla_triton, interpret=True, block_t=16,
                             backward_block_t=16)
  (got, (out, lse)), (ref, (ref_out, ref_lse)) = (
      _grads(f, args, with_outputs=True) for f in (triton, sparse_mla_reference))
  for name, g, r in zip(("q", "q_rope", "kv", "k_rope"), got, ref):
    assert g.dtype == r.dtype == dtype and np.isfinite(np.asarray(g, np.float32)).all(), name
    _close(g, r, tol, f"d{name}")
  assert not np.asarray(got[0][0, 0], np.float32).any(), "the empty query gets no gradient"
  assert out.dtype == dtype
  _close(out, ref_out, 2e-2, "out")
  _close(lse, ref_lse, 1e-2, "lse")


def test_backward_split_over_head_blocks_matches_reference():
  """H = 20 padded to 32 and split into two programs of 16 heads per token (the option the
  GLM-5 default replaced with all heads in one program), C 32 gathered as one chunk and its
  key-row gradients formed in two halves of 16 (as GLM-5's 128 in two of 64), through
  `sparse_mla_triton_parts`
  (its forward, then its backward from the same cotangents as `_grads`): each block adds its
  heads' key-row gradients, and its share of the head-mean probabilities (the padded heads,
  uniform p, left out): `sparse_mla_head_mean_probs`, 0 at empty slots."""
  args = mla_inputs(h=20, c=32, seed=6)
  *arrays, topk = args
  rng = np.random.default_rng(4)  # `_grads`' cotangents
  cot_out = jnp.asarray(rng.standard_normal(arrays[0].shape), jnp.float32)
  cot_lse = jnp.asarray(rng.standard_normal(arrays[0].shape[:3]), jnp.float32)
  topk = empty_out_of_range(topk, arrays[2].shape[1])
  parts = sparse_mla_triton_parts(interpret=True, block_t=16, backward_block_t=16,
                                  backward_head_block=16, backward_dkv_chunk=16)

  @jax.jit
  def forward_backward(*arrays):
    out, lse = parts.forward(*arrays, topk, SCALE)
    return lse, parts.backward(*arrays, topk, out, lse, cot_out, cot_lse, SCALE)

  lse, (*got, probs) = forward_backward(*arrays)
  ref = _grads(sparse_mla_reference, args)
  for name, g, r in zip(("q", "q_rope", "kv", "k_rope"), got, ref):
    _close(g, r, 1e-5, f"d{name}")
  _close(probs, sparse_mla_head_mean_probs(*args, lse, scale=SCALE), 1e-5, "head-mean probs")
  assert not np.asarray(probs)[np.asarray(topk) < 0].any()
  with pytest.raises(ValueError, match="backward_head_block=24"):
    triton = functools.partial(sparse_mla_triton, interpret=True, backward_head_block=24)
    _grads(triton, args)


def test_all_64_heads_in_one_program_with_latent_chunks():
  """GLM-5's 64 heads in one backward program (the default), the latent dims in two chunks of
  the key-row gradients (backward_c_chunk 16 of C = 32), two slot blocks, every case of
  `mla_inputs`: fp32 gradients as the reference's (through the head-probs variant: its probs
  take no cotangent); and the forward's second sweep gives `sparse_mla_head_mean_probs` at
  every slot (duplicates in each copy, empty slots 0) beside the unchanged out and lse."""
  args = mla_inputs(b=2, l=4, s=30, h=64, c=32, r=16, t=24, seed=7)
  topk = args[-1]
  triton = functools.partial(sparse_mla_triton_with_head_probs, interpret=True, block_t=16,
                             backward_block_t=16, backward_c_chunk=16)
  (got, (out, lse, probs)), (ref, (want_out, want_lse)) = (
      _grads(f, args, with_outputs=True) for f in (triton, sparse_mla_reference))
  for name, g, r in zip(("q", "q_rope", "kv", "k_rope"), got, ref):
    _close(g, r, 1e-5, f"d{name}")
  _close(out, want_out, 1e-5, "out")
  _close(lse, want_lse, 1e-5, "lse")
  want = sparse_mla_head_mean_probs(*args, want_lse, scale=SCALE)
  assert probs.shape == topk.shape and probs.dtype == jnp.float32
  _close(probs, want, 1e-5, "head-mean probs")
  assert not np.asarray(probs)[np.asarray(topk) < 0].any()
  np.testing.assert_allclose(np.asarray(probs).sum(-1)[1], 1.0, rtol=1e-5)  # rows sum to 1
  assert not np.asarray(got[0][0, 0]).any(), "the empty query gets no gradient"


def test_decode_split_k_equals_unsplit():
  """Flash-decoding: 3 (uneven) and 16 splits of 8 slot blocks (half of them empty) merge to the
  unsplit result; the automatic choice splits few tokens and leaves prefill alone."""
  args = mla_inputs(b=2, l=4, s=200, t=128, seed=6)
  run = lambda k: jax.jit(functools.partial(sparse_mla_triton, scale=SCALE, interpret=True,
                                            block_t=16, split_k=k))(*args)
  out1, lse1 = run(1)
  for k in (3, 16):
    out, lse = run(k)
    _close(out, out1, 1e-6, f"out split {k}")
    _close(lse, lse1, 1e-6, f"lse split {k}")
  _close(out1, sparse_mla_reference(*args, scale=SCALE)[0], 1e-5, "unsplit out")
  assert _auto_split(8, 64) == 32 and _auto_split(4096, 64) == 1
  assert _auto_split(8, 4) == 4  # never more splits than slot blocks


def test_options_are_checked():
  args = mla_inputs()
  with pytest.raises(TypeError, match="unknown options"):
    sparse_mla_triton(*args, scale=SCALE, interpret=True, blok_t=16)
  with pytest.raises(ValueError, match="power of two"):
    sparse_mla_triton(*args, scale=SCALE, interpret=True, block_t=24)
  with pytest.raises(ValueError, match="split_k"):
    sparse_mla_triton(*args, scale=SCALE, interpret=True, split_k=0)
  with pytest.raises(ValueError, match="split_k=2 with head_probs"):  # needs the final lse
    sparse_mla_triton_with_head_probs(*args, scale=SCALE, interpret=True, split_k=2)
  with pytest.raises(ValueError, match="share one dtype"):
    sparse_mla_triton(args[0].astype(jnp.bfloat16), *args[1:], scale=SCALE, interpret=True)


def test_flop_formula():
  # per (query, head, slot): fwd q.kv + q_rope.k_rope + p.kv; bwd 5 C-wide and 3 R-wide matmuls
  assert sparse_mla_flops(1, 1, 1, 512, 64, 1) == 2 * (512 + 64 + 512)
  assert sparse_mla_flops(1, 1, 1, 512, 64, 1, backward=True) == 2 * (5 * 512 + 3 * 64)
  assert sparse_mla_flops(2, 3, 4, 8, 2, 5) == 2 * 3 * 4 * 5 * sparse_mla_flops(
      1, 1, 1, 8, 2, 1)


# ---------------------------------------------------------------------------------------------
# CUDA lowering on CPU (GLM-5 shapes, bf16): block shapes and primitives are Triton-legal
# ---------------------------------------------------------------------------------------------


def _lower_for_cuda(fn, *shapes):
  return lower_for_cuda(fn, *shapes)


def _glm5_shapes(b, l, s=4096, h=64, c=512, r=64, t=2048):
  sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
  return (sds((b, l, h, c), bf16), sds((b, l, h, r), bf16), sds((b, s, c), bf16),
          sds((b, s, r), bf16), sds((b, l, t), jnp.int32))


def test_lowers_for_cuda_at_glm5_shapes_forward_and_backward():
  def forward_backward(q, q_rope, kv, k_rope, topk):
    def loss(*arrays):
      out, lse = sparse_mla_triton(*arrays, topk, scale=192 ** -0.5)
      return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, q_rope, kv, k_rope)

  text = _lower_for_cuda(forward_backward, *_glm5_shapes(1, 4096))
  assert text.count("__gpu$xla.gpu.triton") == 2, "forward and backward Triton kernels expected"


def test_lowers_for_cuda_decode_split():
  text = _lower_for_cuda(functools.partial(sparse_mla_triton, scale=192 ** -0.5),
                         *_glm5_shapes(8, 1))
  assert text.count("__gpu$xla.gpu.triton") == 1
  grid_z = re.search(r"grid_z = (\d+)", text)
  assert grid_z and int(grid_z.group(1)) == 32, "8 decode tokens split 32 ways"
