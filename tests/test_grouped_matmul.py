"""The routed experts' grouped matmul (`glm5_jax.grouped_matmul`): megablox's Pallas kernel,
run here in the Pallas interpreter, equals `jax.lax.ragged_dot` forward and backward (its
compiled form for TPU: tests/test_tpu_aot.py); and the planner counts a Pallas kernel's FLOPs
from its cost estimate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import grouped_matmul

from glm5_jax.planning import hlo_stats


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
  assert grouped_matmul.default_impl() == "ragged_dot"  # CPU: no Mosaic
  x, w = jnp.ones((16, 8)), jnp.ones((2, 8, 4))
  with pytest.raises(ValueError, match="must be one of"):
    grouped_matmul.grouped_matmul(x, w, jnp.array([8, 8], jnp.int32), impl="einsum")


def test_step_flops_count_a_pallas_kernels_cost_estimate():
  """The TPU compiler's form of a Mosaic custom call (abridged from libtpu 0.0.42.1's text)."""
  hlo = """HloModule m

ENTRY %main (p0: bf16[4096,512], p1: bf16[64,512,1024]) -> bf16[4096,1024] {
  %p0 = bf16[4096,512]{1,0} parameter(0)
  %p1 = bf16[64,512,1024]{2,1,0} parameter(1)
  ROOT %gmm = bf16[4096,1024]{1,0} custom-call(%p0, %p1), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "TUxS", "cost_estimate":{"flops":"4294967296","transcendentals":"0","bytes_accessed":"88080384"}}}
}
"""
  flops = hlo_stats.step_dot_flops(hlo)
  assert flops["flops"] == 2 * 4096 * 512 * 1024 and flops["custom_calls"] == 0, flops
