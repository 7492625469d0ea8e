"""pallas_kernels/triton_atomics.py: a relaxed atomic_add lowers to a relaxed Triton atomic while
`plgpu.atomic_add` keeps jax's acq_rel, and both sum alike in interpret mode (CPU, no triton)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_atomics, triton_offline


def _scatter_add(order, interpret, rows, vals):
  """acc[rows[i]] += vals[i] for 4 rows of 16 floats, one atomic per row."""

  def kernel(rows_ref, vals_ref, acc_in, acc_ref):
    del acc_in  # aliased to acc_ref
    for i in range(rows_ref.shape[0]):
      triton_atomics.atomic_add(acc_ref, (rows_ref[i], pl.ds(0, 16)), vals_ref[i], order=order)

  acc = jnp.zeros((8, 16), jnp.float32)
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(acc.shape, acc.dtype),
                        in_specs=[pl.no_block_spec] * 3, out_specs=pl.no_block_spec,
                        input_output_aliases={2: 0}, interpret=interpret,
                        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
                        )(rows, vals, acc)


def _ttir(order):
  rows = jax.ShapeDtypeStruct((4,), jnp.int32)
  vals = jax.ShapeDtypeStruct((4, 16), jnp.float32)
  return triton_offline.capture_ttir(functools.partial(_scatter_add, order, False), rows,
                                     vals).ttir


def test_orders_lower_as_named_and_relaxed_stays_scoped():
  relaxed = _ttir("relaxed")
  assert "tt.atomic_rmw fadd, relaxed, gpu" in relaxed and "acq_rel" not in relaxed
  # Lowered after a relaxed kernel, jax's own atomic keeps its acq_rel order.
  acq_rel = _ttir("acq_rel")
  assert "tt.atomic_rmw fadd, acq_rel, gpu" in acq_rel and "relaxed" not in acq_rel


def test_interpret_mode_sums_like_plgpu_atomic_add():
  rows = jnp.array([3, 0, 3, 7], jnp.int32)  # row 3 twice: both adds land
  vals = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
  want = np.zeros((8, 16), np.float32)
  np.add.at(want, np.asarray(rows), np.asarray(vals))
  for order in triton_atomics.ORDERS:
    np.testing.assert_allclose(_scatter_add(order, True, rows, vals), want, rtol=1e-6)


def test_unknown_order_is_an_error_naming_it():
  with pytest.raises(ValueError, match="order='seq_cst'"):
    _scatter_add("seq_cst", True, jnp.zeros((4,), jnp.int32), jnp.zeros((4, 16), jnp.float32))
