"""`pallas_kernels.indexer_kl_pallas`: the indexer KL's gradient kernels against `jax.vjp` of the
KL at the selection (`dsa_kl_fused.indexer_kl_at_selection`), and their TPU lowering."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.attention.dsa_kl_fused import indexer_kl_at_selection
from pallas_kernels.indexer_kl_pallas import indexer_kl_grads_pallas


def _inputs(b, l, s, j, i, t, *, causal, duplicates, seed=0):
  """q, k, w, a selection with empty slots (a query with none), the target over every key (a
  query whose target is 0 everywhere) and its value at the slots, the KL's cotangent."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, l, j, i)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, s, i)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((b, l, j)), jnp.float32)
  topk = np.stack([rng.permutation(s)[:t] for _ in range(b * l)]).reshape(b, l, t)
  topk = np.where(rng.random((b, l, t)) < 0.25, -1, topk)
  if duplicates:
    topk[..., -1] = topk[..., 0]
  topk[0, 0] = -1
  topk[0, 2, 0] = s + 3  # out of range: empty
  if causal:  # the model's selections are causal (the kernels empty later slots too)
    topk = np.where(topk <= np.arange(l)[None, :, None], topk, -1)
  topk = jnp.asarray(topk, jnp.int32)
  target_BLS = jnp.asarray(rng.uniform(0.1, 1.0, (b, l, s)), jnp.float32).at[0, 1].set(0.0)
  target_BLT = jnp.where((topk >= 0) & (topk < s),
                         jnp.take_along_axis(target_BLS, jnp.clip(topk, 0, s - 1), axis=-1), 0.0)
  dkl = jnp.asarray(rng.standard_normal((b, l)), jnp.float32)
  return q, k, w, topk, target_BLS, target_BLT, dkl


@pytest.mark.parametrize("causal,b,l,s,blocks,duplicates", [
    # 4 x 2 (query, key) blocks, 2 of them skipped, padded to them
    (True, 1, 200, 200, dict(block_q=64, block_k=128), False),
    (False, 2, 13, 150, dict(block_q=8, block_k=128), True)])  # L != S, padded; duplicates
def test_indexer_kl_grads_match_the_selection_reference(causal, b, l, s, blocks, duplicates):
  """The three kernels (interpret mode) give the gradients of the KL at the selection: several
  query and key blocks with causal skipping, padding, empty and out-of-range slots, a query
  with no slot, a query whose target is 0 (no gradient), keys selected twice (counted twice)."""
  j, i, t, scale = 3, 16, 9, 0.3
  q, k, w, topk, target_BLS, target_BLT, dkl = _inputs(b, l, s, j, i, t, causal=causal,
                                                       duplicates=duplicates)
  kl = functools.partial(indexer_kl_at_selection, topk_BLT=topk, target_BLT=target_BLT,
                         index_scale=scale, causal=causal, query_block=8)
  _, vjp = jax.vjp(kl, q, k, w)
  want = vjp(dkl)
  got = jax.jit(functools.partial(indexer_kl_grads_pallas, scale=scale, causal=causal,
                                  interpret=True, **blocks))(q, k, w, topk, target_BLS, dkl)
  for name, g, x in zip(("dq", "dk", "dw"), got, want):
    assert g.shape == x.shape and g.dtype == x.dtype, name
    np.testing.assert_allclose(g, x, rtol=1e-4, atol=1e-5 * float(jnp.abs(x).max()),
                               err_msg=name)
  assert float(jnp.abs(got[2][0, 1]).max()) == 0.0  # the query whose target is 0


def test_indexer_kl_grads_name_the_bad_argument():
  q, k, w, topk, target_BLS, _, dkl = _inputs(1, 8, 8, 2, 4, 3, causal=True, duplicates=False)
  with pytest.raises(ValueError, match=r"target_BLS has shape \(1, 8, 7\), expected \(1, 8, 8\)"):
    indexer_kl_grads_pallas(q, k, w, topk, target_BLS[..., :7], dkl, scale=0.3, interpret=True)
  with pytest.raises(ValueError, match=r"block_k=100 of 128"):
    indexer_kl_grads_pallas(q, k, w, topk, target_BLS, dkl, scale=0.3, block_k=100)
  with pytest.raises(ValueError, match=r"causal=True\): queries and keys must be the same"):
    indexer_kl_grads_pallas(q, k[:, :6], w, topk, target_BLS[..., :6], dkl, scale=0.3,
                            causal=True)


def test_indexer_kl_kernels_lower_for_tpu():
  """The three kernels lower for TPU at the default blocks (128 queries, 512 keys) and GLM-5's
  indexer dims (J 32, I 128); each `pl.CostEstimate` counts the causal steps only: of the
  8 x 2 (query, key) blocks of 1,024 positions, 12 compute."""
  b, l, j, i, t = 1, 1024, 32, 128, 640
  sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
  exported = jax.export.export(
      jax.jit(functools.partial(indexer_kl_grads_pallas, scale=0.088, causal=True)),
      platforms=["tpu"])(sds((b, l, j, i), bf16), sds((b, l, i), bf16), sds((b, l, j), bf16),
                         sds((b, l, t), jnp.int32), sds((b, l, l), jnp.float32),
                         sds((b, l), jnp.float32))
  text = exported.mlir_module()
  kernels = re.findall(r'kernel_name = "(\w+)"', text)
  assert sorted(kernels) == ["indexer_kl_dk", "indexer_kl_dq", "indexer_kl_stats"], kernels
  flops = sorted(int(m) for m in re.findall(r'flops\\22:(\d+)', text))
  products = 2 * 12 * 128 * 512 * j * i  # one [Lb, I] x [I, Sb] product per head and step
  assert flops == [products, 2 * products, 2 * products], flops
