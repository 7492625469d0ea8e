"""The routed experts' grouped matmul (`glm5_jax.grouped_matmul`): megablox's Pallas TPU kernel
and our Pallas Triton gmm / tgmm (`pallas_kernels.grouped_matmul_triton`), run here in the
Pallas interpreter, equal `jax.lax.ragged_dot` forward and backward (megablox's compiled form
for TPU: tests/test_tpu_aot.py; the Triton kernels' for sm_90a: tests/test_triton_compile.py);
and the planner counts a Pallas kernel's FLOPs from its cost estimate. (That the GPU program of
the train step runs the experts as these kernels, with no dense dot over the experts:
tests/test_flop_ledger.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import grouped_matmul
from glm5_jax.planning import hlo_stats
from pallas_kernels import blocking
from pallas_kernels.grouped_matmul_triton import gmm_triton, tile_visits

# Empty groups first, inside and last; boundaries off every tile; 30 rows past the groups.
SIZES = (0, 50, 0, 70, 33, 17, 0)


def _vjp_triple(f, x, w, dy):
  y, vjp = jax.vjp(f, x, w)
  return (y, *vjp(dy))


def _inputs(m, k, n, dtype, seed=0):
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kx, (m, k), dtype), jax.random.normal(kw, (len(SIZES), k, n), dtype),
          jax.random.normal(kd, (m, n), dtype))


def test_megablox_equals_ragged_dot_forward_and_backward():
  """An empty group, rows past the groups' sum (zero in both), no dimension a tile multiple."""
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  m, k, n = 200, 96, 160  # K, N padded to 128s, M to 208
  x = jax.random.normal(kx, (m, k))
  w = jax.random.normal(kw, (4, k, n))
  sizes = jnp.array([50, 0, 70, 40], jnp.int32)
  dy = jax.random.normal(kd, (m, n))

  def run(impl):
    f = lambda x, w: grouped_matmul.grouped_matmul(x, w, sizes, impl=impl, interpret=True)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))

  ref, got = run("ragged_dot"), run("megablox")
  assert not np.asarray(got[0])[160:].any()  # the tail past the groups
  for name, r, g in zip(("y", "dx", "dw"), ref, got):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-4, err_msg=name)
  assert np.abs(np.asarray(got[2])[1]).max() == 0  # the empty group's weight gradient


def test_impl_choice():
  assert grouped_matmul.default_impl() == "ragged_dot"  # CPU: no Mosaic, no Triton
  assert grouped_matmul.global_impl() == "ragged_dot"
  with blocking.lowering_for("cuda"):
    assert grouped_matmul.default_impl() == grouped_matmul.global_impl() == "triton_gmm"
  with blocking.lowering_for("tpu"):
    assert (grouped_matmul.default_impl(), grouped_matmul.global_impl()) == (
        "megablox", "ragged_dot")
  x, w = jnp.ones((16, 8)), jnp.ones((2, 8, 4))
  with pytest.raises(ValueError, match="must be one of"):
    grouped_matmul.grouped_matmul(x, w, jnp.array([8, 8], jnp.int32), impl="einsum")


def test_tile_visits_cover_every_row_once():
  """Each row of the padded rows is in exactly one used visit's [lo, hi) and tile; a tile
  holding a boundary is visited once per group; the tail is group G."""
  tile, group, lo, hi = (np.asarray(a) for a in tile_visits(jnp.array(SIZES), 256, 64))
  assert tile.shape == (256 // 64 + len(SIZES),)
  owner = np.full(256, -1)
  for t, g, a, b in zip(tile, group, lo, hi):
    rows = np.arange(max(a, t * 64), min(b, t * 64 + 64))
    assert (owner[rows] == -1).all()
    owner[rows] = g
  starts = np.cumsum((0,) + SIZES)
  expected = np.searchsorted(starts[1:], np.arange(256), side="right")  # 7 = tail past 170
  np.testing.assert_array_equal(owner, expected)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_triton_gmm_equals_ragged_dot_forward_dgrad_wgrad(dtype, tol):
  """Forward, input and weight gradient vs `ragged_dot` (fp32: IEEE dots, tight; bf16: inputs
  rounded the same, fp32 accumulation in both, one output rounding). Small tiles so that M, K,
  N span several (no dimension a tile multiple: M 200, K 40, N 24 pad to 208, 48, 32)."""
  x, w, dy = _inputs(200, 40, 24, dtype)
  sizes = jnp.array(SIZES, jnp.int32)
  ref = _vjp_triple(lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=
                                                      jnp.float32), x, w, dy.astype(jnp.float32))
  tiles = dict(block_m=16, block_k=16, block_n=16, tgmm_block_m=16, tgmm_block_k=16,
               tgmm_block_n=16)
  got = _vjp_triple(jax.jit(lambda x, w: gmm_triton(x, w, sizes, interpret=True, **tiles)),
                    x, w, dy)
  for name, r, g in zip(("y", "dx", "dw"), ref, got):
    assert g.dtype == dtype and g.shape == r.shape, name
    r, g = np.asarray(r, np.float32), np.asarray(g, np.float32)
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * np.abs(r).max(), err_msg=name)
  y, dx, dw = (np.asarray(a, np.float32) for a in got)
  assert not y[170:].any() and not dx[170:].any()  # the tail past the groups
  assert not dw[[0, 2, 6]].any()  # the empty groups' weight gradients


def test_expert_mlp_program_gradients_match_across_impls():
  """What the device suite times: the same loss and gradients from ragged_dot and the Triton
  gmm (through `grouped_matmul`: interpreted off GPU, default tiles cut to these dims, row
  tiles of 128 holding group boundaries), at a small shape with uneven groups."""
  fn, args, flops = grouped_matmul.expert_mlp_program(
      "triton_gmm", rows=200, hidden=32, intermediate=16, experts=5, dtype=jnp.float32)
  assert int(args[-1].sum()) == 200 and flops == 9 * 2 * 200 * 32 * 16
  loss = lambda *w: grouped_matmul.expert_mlp(*w, args[-1], impl="ragged_dot").sum()
  ref = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(*args[:4])  # eager: no second compile
  for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(fn(*args))):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
