"""Muon with its Newton-Schulz iteration in a chosen dtype (`optim.ns_dtype`), momentum in fp32.

optax's `scale_by_muon` runs the iteration in the dtype of the Nesterov momentum it builds,
which is the parameters' (fp32 here), and has no option for it: every NS matmul is fp32, TF32
on a GPU, about half the bf16 rate (43.4 TFLOP per step of the 3B config, issue 41,
docs/performance.md). Muon is usually run with the iteration in bf16 (Keller Jordan's
modded-nanogpt, Moonlight): the polar factor it approximates does not need fp32 precision,
and the quintic's fixed point spreads singular values over ~[0.7, 1.2] anyway.

`scale_by_muon_in(ns_dtype, ...)` keeps optax's own code for both halves:

  1. optax `scale_by_muon(ns_steps=0)`: the momentum, its bias correction and Nesterov step
     in fp32, exactly as the default, then the Frobenius normalization (per matrix slice) that
     precedes the iteration; with 0 steps that is all it does. Its state is the default's
     `MuonState`, so a checkpoint restores under either dtype.
  2. a stateless optax `scale_by_muon(beta=0, nesterov=False)` on the result cast to
     `ns_dtype`: with beta 0 its "momentum" is the input itself (bias correction divides by
     1 - 0^1 = 1), so it is the iteration alone, in `ns_dtype`; cast back to fp32.

Step 2 normalizes again an input of norm 1 / (1 + eps / |x|): a relative change of ~1e-8, far
below bf16's resolution. Normalizing in fp32 first keeps bf16's rounding of the norm out of the
iteration's stability margin. With `ns_dtype` float32 this is optax's `scale_by_muon` itself.
"""

import jax
import jax.numpy as jnp
import optax
from optax.contrib import scale_by_muon

NS_DTYPES = ("float32", "bfloat16")


def scale_by_muon_in(ns_dtype: str, *, ns_coeffs, ns_steps: int, beta: float, nesterov: bool,
                     weight_dimension_numbers) -> optax.GradientTransformation:
  """optax `scale_by_muon` with its Newton-Schulz matmuls in `ns_dtype` (module docstring).

  Args:
    ns_dtype: one of `NS_DTYPES`.
    ns_coeffs, ns_steps, beta, nesterov, weight_dimension_numbers: as `scale_by_muon`
      (`ns_coeffs` one `(a, b, c)` triple).
  Returns:
    a transformation whose state is `optax.contrib.MuonState`, updates fp32 (the inputs' dtype).
  """
  if ns_dtype not in NS_DTYPES:
    raise ValueError(f"config.optim.ns_dtype: must be one of {NS_DTYPES}, got {ns_dtype!r}")
  if ns_dtype == "float32":
    return scale_by_muon(ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta, nesterov=nesterov,
                         weight_dimension_numbers=weight_dimension_numbers)
  return two_stage_muon(jnp.dtype(ns_dtype), ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta,
                        nesterov=nesterov, weight_dimension_numbers=weight_dimension_numbers)


def momentum_stage(*, ns_coeffs, beta: float, nesterov: bool,
                   weight_dimension_numbers) -> optax.GradientTransformation:
  """Step 1 of the module docstring: optax's momentum, bias correction, Nesterov step and
  per-matrix normalization (`scale_by_muon` with 0 iterations), fp32; state `MuonState`."""
  return scale_by_muon(ns_coeffs=ns_coeffs, ns_steps=0, beta=beta, nesterov=nesterov,
                       weight_dimension_numbers=weight_dimension_numbers)


def iteration_stage(*, ns_coeffs, ns_steps: int, weight_dimension_numbers):
  """Step 2 of the module docstring as a function `tree -> tree`: the Newton-Schulz iteration
  alone, in the dtype of its input (optax's stateless `scale_by_muon`, beta 0)."""
  iteration = scale_by_muon(ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=0.0, nesterov=False,
                            weight_dimension_numbers=weight_dimension_numbers)
  # A fresh state each call: beta 0 reads nothing from it (zeros, constant-folded).
  return lambda tree: iteration.update(tree, iteration.init(tree))[0]


def two_stage_muon(dtype, *, ns_coeffs, ns_steps: int, beta: float, nesterov: bool,
                   weight_dimension_numbers) -> optax.GradientTransformation:
  """Steps 1-2 of the module docstring, the iteration in `dtype` (with float32: optax's
  `scale_by_muon` to ~1e-6, tests/test_optim.py)."""
  momentum = momentum_stage(ns_coeffs=ns_coeffs, beta=beta, nesterov=nesterov,
                            weight_dimension_numbers=weight_dimension_numbers)
  iterate = iteration_stage(ns_coeffs=ns_coeffs, ns_steps=ns_steps,
                            weight_dimension_numbers=weight_dimension_numbers)

  def update_fn(updates, state, params=None):
    del params
    normalized, state = momentum.update(updates, state)
    out = iterate(jax.tree.map(lambda x: x.astype(dtype), normalized))
    return jax.tree.map(lambda y, x: y.astype(x.dtype), out, normalized), state

  return optax.GradientTransformation(momentum.init, update_fn)
