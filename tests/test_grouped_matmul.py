"""The routed experts' grouped matmul (`glm5_jax.grouped_matmul`): megablox's Pallas TPU kernel
and our Pallas Triton gmm / tgmm (`pallas_kernels.grouped_matmul_triton`), run here in the
Pallas interpreter, equal `jax.lax.ragged_dot` forward and backward (megablox's compiled form
for TPU: tests/test_tpu_aot.py; the Triton kernels' for sm_90a: tests/test_triton_compile.py);
and the planner counts a Pallas kernel's FLOPs from its cost estimate. (That the GPU program of
the train step runs the experts as these kernels, with no dense dot over the experts:
tests/test_flop_ledger.py.)"""

import functools
import re
from unittest import mock

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


@pytest.mark.parametrize("transpose_w", [False, True])
def test_megablox_equals_ragged_dot_forward_and_backward(transpose_w):
  """An empty group, rows past the groups' sum (zero in both), no dimension a tile multiple
  (megablox's own VJP: K and N padded); with `transpose_w` the weights and their gradient are
  `[G, N, K]`."""
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  m, k, n = 200, 96, 160  # K, N padded to 128s, M to 208
  x = jax.random.normal(kx, (m, k))
  w = jax.random.normal(kw, (4, k, n))
  w = w.swapaxes(1, 2) if transpose_w else w
  sizes = jnp.array([50, 0, 70, 40], jnp.int32)
  dy = jax.random.normal(kd, (m, n))

  def run(impl):
    f = lambda x, w: grouped_matmul.grouped_matmul(x, w, sizes, impl=impl, interpret=True,
                                                   transpose_w=transpose_w)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))

  ref, got = run("ragged_dot"), run("megablox")
  assert not np.asarray(got[0])[160:].any()  # the tail past the groups
  for name, r, g in zip(("y", "dx", "dw"), ref, got):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-4, err_msg=name)
  assert np.abs(np.asarray(got[2])[1]).max() == 0  # the empty group's weight gradient


def test_megablox_tail_undefined_leaves_the_rows_past_the_groups_out():
  """`tail="undefined"`: megablox given exactly the G groups. The groups' rows of the output
  and of the input gradient, and the weight gradient, equal `ragged_dot`'s, with NaN in the
  rows past the groups of the input and of the output's cotangent (as an uninitialized
  receive buffer may hold): nothing past the groups is read."""
  kx, kw, kd = jax.random.split(jax.random.key(1), 3)
  m, k, n = 200, 96, 160
  x = jax.random.normal(kx, (m, k))
  w = jax.random.normal(kw, (4, k, n))
  sizes = jnp.array([50, 0, 70, 40], jnp.int32)
  dy = jax.random.normal(kd, (m, n))
  past = jnp.arange(m)[:, None] >= 160

  def run(impl, tail, x, dy):
    f = lambda x, w: grouped_matmul.grouped_matmul(x, w, sizes, impl=impl, interpret=True,
                                                   tail=tail)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))

  ref = run("ragged_dot", "undefined", x, dy)  # ragged_dot's tail is zero: a valid "undefined"
  y, dx, dw = run("megablox", "undefined", jnp.where(past, jnp.nan, x),
                  jnp.where(past, jnp.nan, dy))
  for name, r, g in (("y", ref[0][:160], y[:160]), ("dx", ref[1][:160], dx[:160]),
                     ("dw", ref[2], dw)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-4, err_msg=name)
  with pytest.raises(ValueError, match="tail"):
    grouped_matmul.grouped_matmul(x, w, sizes, impl="ragged_dot", tail="garbage")


@pytest.mark.parametrize("impl,transpose_w",
                         [("ragged_dot", False), ("megablox", False), ("megablox", True)])
def test_passed_weights_gradients_add_up(impl, transpose_w):
  """`pass_weights`: two uses of one weight, the second through the first's passed weights; the
  weight gradient is the sum of both uses' (megablox, under VJPs of our own: `tgmm`
  accumulating in place), as `ragged_dot` used twice gives. With `transpose_w` the weights
  are `[G, N, K]`, and so is their gradient (`tgmm` of the transposed product)."""
  kx, kw, kd = jax.random.split(jax.random.key(2), 3)
  m, k, n = 64, 128, 256
  x = jax.random.normal(kx, (2, m, k))
  w = jax.random.normal(kw, (3, k, n))
  w = w.swapaxes(1, 2) if transpose_w else w
  sizes = jnp.array([20, 0, 30], jnp.int32)
  mm = functools.partial(grouped_matmul.grouped_matmul, group_sizes_G=sizes, interpret=True,
                         transpose_w=transpose_w)

  def chained(x, w):
    y0, passed = mm(x[0], w, impl=impl, pass_weights=True)
    return jnp.stack([y0, mm(x[1], passed, impl=impl)])

  def reference(x, w):
    return jnp.stack([mm(x[0], w, impl="ragged_dot"), mm(x[1], w, impl="ragged_dot")])

  dy = jax.random.normal(kd, (2, m, n))
  (y, vjp), (y_ref, vjp_ref) = jax.vjp(chained, x, w), jax.vjp(reference, x, w)
  for name, g, r in zip(("y", "dx", "dw"), (y, *vjp(dy)), (y_ref, *vjp_ref(dy))):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-4, err_msg=name)
  assert np.abs(np.asarray(vjp(dy)[1])[1]).max() == 0  # the empty group's


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
  visits = jax.jit(tile_visits, static_argnums=(1, 2))(jnp.array(SIZES), 256, 64)
  tile, group, lo, hi = (np.asarray(a) for a in visits)
  assert tile.shape == (256 // 64 + len(SIZES),)
  owner = np.full(256, -1)
  for t, g, a, b in zip(tile, group, lo, hi):
    rows = np.arange(max(a, t * 64), min(b, t * 64 + 64))
    assert (owner[rows] == -1).all()
    owner[rows] = g
  starts = np.cumsum((0,) + SIZES)
  expected = np.searchsorted(starts[1:], np.arange(256), side="right")  # 7 = tail past 170
  np.testing.assert_array_equal(owner, expected)


def _check_against_ragged_dot(f, dtype, tol):
  """`f(x, w)`'s output, input and weight gradients vs `ragged_dot`'s (fp32 accumulation; for
  bf16 inputs rounded the same, one output rounding apart) at M 200, K 40, N 24 with `SIZES`."""
  x, w, dy = _inputs(200, 40, 24, dtype)
  sizes = jnp.array(SIZES, jnp.int32)
  ref = _vjp_triple(lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=
                                                      jnp.float32), x, w, dy.astype(jnp.float32))
  got = _vjp_triple(jax.jit(lambda x, w: f(x, w, sizes)), x, w, dy)
  for name, r, g in zip(("y", "dx", "dw"), ref, got):
    assert g.dtype == dtype and g.shape == r.shape, name
    r, g = np.asarray(r, np.float32), np.asarray(g, np.float32)
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * np.abs(r).max(), err_msg=name)
  y, dx, dw = (np.asarray(a, np.float32) for a in got)
  assert not y[170:].any() and not dx[170:].any()  # the tail past the groups
  assert not dw[[0, 2, 6]].any()  # the empty groups' weight gradients


def test_triton_gmm_equals_ragged_dot_fp32_default_tiles():
  """Through `grouped_matmul` (interpreted: the default off GPU), IEEE fp32 dots, tight. The
  default tiles cut to these dims: two row tiles of 128 holding all four group boundaries,
  K 40 -> one tile of 64, N 24 -> one of 32 (zero padding)."""
  _check_against_ragged_dot(
      lambda x, w, sizes: grouped_matmul.grouped_matmul(x, w, sizes, impl="triton_gmm"),
      jnp.float32, 1e-5)


def test_triton_gmm_equals_ragged_dot_bf16_small_tiles():
  """bf16, tiles of 16 so that M, K, N each span several (M 200 -> 13 row tiles, K 40 -> three
  K steps, N 24 -> two column tiles; none a tile multiple)."""
  tiles = dict(block_m=16, block_k=16, block_n=16, tgmm_block_m=16, tgmm_block_k=16,
               tgmm_block_n=16)
  _check_against_ragged_dot(
      lambda x, w, sizes: gmm_triton(x, w, sizes, interpret=True, **tiles), jnp.bfloat16, 2e-2)


def test_expert_mlp_program_runs_nine_grouped_products():
  """What the device suite times, traced (not compiled: the kernels' numerics are the tests
  above): the triton_gmm program holds 3 forward, 3 input-gradient and 3 weight-gradient
  kernels and no ragged_dot; its group sizes are uneven and sum to the rows."""
  fn, args, flops = grouped_matmul.expert_mlp_program(
      "triton_gmm", rows=200, hidden=32, intermediate=16, experts=5, dtype=jnp.float32)
  assert int(args[-1].sum()) == 200 and len(set(np.asarray(args[-1]))) > 1
  assert flops == 9 * 2 * 200 * 32 * 16
  jaxpr = str(fn.trace(*args).jaxpr)
  kernels = [re.sub(r"\d+$", "", k) for k in re.findall(r"pallas_call\[[^\]]*?jaxpr=(\w+)", jaxpr)]
  assert sorted(kernels) == ["grouped_matmul_triton_gmm"] * 6 + [
      "grouped_matmul_triton_tgmm"] * 3, kernels
  assert "ragged_dot" not in jaxpr
