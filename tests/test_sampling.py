"""glm5_jax.infer.sampling: the sampling distribution as defined, its log-probs, per-request seeds,
and the empirical distribution of the draws (chi-square)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from glm5_jax.infer import sampling
from glm5_jax.infer.sampling import DRAFT, SAMPLE, SamplingParams

# Jitted once per shape: eager dispatch of the many small ops is far slower on CPU.
sample = jax.jit(sampling.sample, static_argnames="stream")
sampling_logprobs = jax.jit(sampling.sampling_logprobs)


def reference_probs(z, temperature, top_k, top_p):
  """The module docstring's definition, written out token by token in numpy (float64)."""
  z = np.asarray(z, np.float64)
  order = sorted(range(len(z)), key=lambda i: (-z[i], i))
  if temperature == 0:
    out = np.zeros(len(z))
    out[order[0]] = 1
    return out
  kept = order[:top_k] if 0 < top_k < len(z) else order
  weights = {i: np.exp((z[i] - z[order[0]]) / temperature) for i in kept}
  total = sum(weights.values())
  if top_p < 1:
    nucleus, mass = [], 0.0
    for i in kept:
      if mass >= top_p:
        break
      nucleus.append(i)
      mass += weights[i] / total
    kept = nucleus
  out = np.zeros(len(z))
  for i in kept:
    out[i] = weights[i]
  return out / out.sum()


def probs(z, temperature=1.0, top_k=0, top_p=1.0):
  z = jnp.asarray(z, jnp.float32)[None]
  return np.exp(np.asarray(sampling_logprobs(z, SamplingParams.create(1, temperature, top_k,
                                                                     top_p))))[0]


def test_greedy_is_argmax_ties_to_lowest_id():
  z = jnp.array([[1.0, 4.0, 4.0, -2.0], [0.0, -0.0, -1.0, -3.0], [-0.0, 0.0, -1.0, -3.0]])
  params = SamplingParams.create(3, temperature=0.0, top_k=[0, 1, 3], top_p=[1.0, 0.5, 0.2])
  out = sample(z, params, jnp.array([1, 2, 3], jnp.uint32), jnp.array([0, 5, 9]))
  np.testing.assert_array_equal(out.tokens, [1, 0, 0])
  np.testing.assert_array_equal(out.logprobs, [0.0, 0.0, 0.0])
  np.testing.assert_allclose(out.raw_logprobs, jax.nn.log_softmax(z)[jnp.arange(3), out.tokens],
                             rtol=1e-6)
  random_z = jax.random.normal(jax.random.key(0), (5, 3, 50))
  params = SamplingParams.create(5)
  out = sample(random_z, params, jnp.zeros(5, jnp.uint32), jnp.zeros((5, 3), jnp.int32))
  np.testing.assert_array_equal(out.tokens, jnp.argmax(random_z, -1))


def test_top_k_keeps_exactly_k_ties_to_lower_ids():
  z = [2.0, 5.0, 5.0, 1.0, 5.0]
  np.testing.assert_allclose(probs(z, top_k=2), [0, 0.5, 0.5, 0, 0], atol=1e-7)
  np.testing.assert_allclose(probs(z, top_k=1), [0, 1, 0, 0, 0], atol=1e-7)
  e = np.exp([2.0, 5.0, 5.0, 5.0])
  np.testing.assert_allclose(probs(z, top_k=4), [e[0], e[1], e[2], 0, e[3]] / e.sum(), rtol=1e-6)
  np.testing.assert_allclose(probs(z, top_k=5), probs(z), rtol=1e-6)  # k >= Y: off
  np.testing.assert_allclose(probs(z, top_k=9), probs(z), rtol=1e-6)


def test_top_p_smallest_prefix_with_mass_at_least_p():
  z = np.log([0.1, 0.4, 0.2, 0.3])  # order: 1 (0.4), 3 (0.3), 2 (0.2), 0 (0.1)
  np.testing.assert_allclose(probs(z, top_p=0.3), [0, 1, 0, 0], atol=1e-7)  # top token always
  np.testing.assert_allclose(probs(z, top_p=0.4), [0, 1, 0, 0], atol=1e-6)
  np.testing.assert_allclose(probs(z, top_p=0.65), [0, 4 / 7, 0, 3 / 7], rtol=1e-6)
  np.testing.assert_allclose(probs(z, top_p=0.75), [0, 4 / 9, 2 / 9, 3 / 9], rtol=1e-6)
  np.testing.assert_allclose(probs(z, top_p=1.0), [0.1, 0.4, 0.2, 0.3], rtol=1e-6)
  # Equal probabilities: the prefix runs in id order.
  np.testing.assert_allclose(probs(np.log([0.3, 0.3, 0.1, 0.3]), top_p=0.5), [0.5, 0.5, 0, 0],
                             rtol=1e-6)
  # Top-p applies to the top-k survivors, renormalized: {1, 3} has mass 0.7 -> 4/7, 3/7.
  np.testing.assert_allclose(probs(z, top_k=2, top_p=0.5), [0, 1, 0, 0], atol=1e-7)
  np.testing.assert_allclose(probs(z, top_k=2, top_p=0.6), [0, 4 / 7, 0, 3 / 7], rtol=1e-6)


def test_matches_reference_on_random_settings_with_ties():
  rng = np.random.default_rng(0)
  settings = list(itertools.product([0.0, 0.3, 1.0, 2.5], [0, 1, 3, 7, 12], [1.0, 0.9, 0.5, 0.05]))
  z = np.round(rng.normal(size=(len(settings), 12)) * 2) / 2  # quantized: many exact ties
  z[:, 3] = -np.inf  # a masked token
  params = SamplingParams(*(jnp.asarray(np.array(column), dtype)
                            for column, dtype in zip(zip(*settings),
                                                     (jnp.float32, jnp.int32, jnp.float32))))
  got = np.exp(np.asarray(sampling_logprobs(jnp.asarray(z, jnp.float32), params)))
  for row, (t, k, p) in enumerate(settings):
    np.testing.assert_allclose(got[row], reference_probs(z[row], t, k, p), atol=1e-6,
                               err_msg=f"temperature {t}, top_k {k}, top_p {p}")


def test_logprobs_and_raw_logprobs():
  z = jax.random.normal(jax.random.key(1), (4, 2, 30)) * 3
  params = SamplingParams.create(4, temperature=[0.0, 0.7, 1.3, 1.0], top_k=[0, 5, 0, 10],
                                 top_p=[1.0, 1.0, 1.0, 0.8])
  out = sample(z, params, jnp.arange(4, dtype=jnp.uint32), jnp.ones((4, 2), jnp.int32))
  lp = sampling_logprobs(z, params)
  np.testing.assert_allclose(out.logprobs, jnp.take_along_axis(lp, out.tokens[..., None], -1)[..., 0])
  np.testing.assert_allclose(out.raw_logprobs, jnp.take_along_axis(
      jax.nn.log_softmax(z), out.tokens[..., None], -1)[..., 0], rtol=1e-6)
  assert np.all(np.isfinite(out.logprobs)) and np.all(out.logprobs <= 0)
  # Unfiltered temperature: log_softmax(z / t).
  np.testing.assert_allclose(lp[2], jax.nn.log_softmax(z[2] / 1.3), rtol=1e-5, atol=1e-6)


def test_seed_reproducible_whatever_the_batch():
  """Request (seed 7, tokens 0..5, temperature 0.9, top_k 20) in slot 0 of one batch and slot 2
  of another, with different neighbours (some filtering, some greedy) gives the same tokens
  and bit-identical log-probs."""
  z = jax.random.normal(jax.random.key(2), (6, 40)) * 2
  mine = (0.9, 20, 1.0)
  batch_a = [mine, (0.0, 0, 1.0), (1.0, 0, 1.0)]
  batch_b = [(0.5, 3, 0.5), (1.0, 0, 0.9), mine, (0.0, 0, 1.0)]

  def run(batch, slot, seeds):
    params = SamplingParams(*(jnp.asarray(c) for c in zip(*batch)))
    params = SamplingParams(params.temperature.astype(jnp.float32),
                            params.top_k.astype(jnp.int32), params.top_p.astype(jnp.float32))
    outs = []
    for n in range(6):
      logits = jnp.broadcast_to(z[n], (len(batch), 40)) + jnp.arange(len(batch))[:, None] * (
          jnp.arange(len(batch)) != slot)[:, None]
      out = sample(logits, params, jnp.asarray(seeds, jnp.uint32),
                            jnp.full(len(batch), n, jnp.int32))
      outs.append(jax.tree.map(lambda x: x[slot], out))
    return jax.tree.map(lambda *x: np.stack(x), *outs)

  a = run(batch_a, 0, [7, 1, 2])
  b = run(batch_b, 2, [3, 4, 7, 5])
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert len(set(a.tokens.tolist())) > 1  # not a constant
  other_seed = run(batch_a, 0, [8, 1, 2])
  assert not np.array_equal(a.tokens, other_seed.tokens)


def test_streams_are_independent_draws():
  z = jnp.zeros((256, 16))
  params = SamplingParams.create(256, temperature=1.0)
  seeds = jnp.arange(256, dtype=jnp.uint32)
  plain = sample(z, params, seeds, jnp.zeros(256, jnp.int32), SAMPLE).tokens
  draft = sample(z, params, seeds, jnp.zeros(256, jnp.int32), DRAFT).tokens
  assert np.mean(np.asarray(plain) == np.asarray(draft)) < 0.2  # ~1/16 by chance


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9), (1.7, 0, 0.6)])
def test_empirical_distribution_matches(temperature, top_k, top_p):
  """Chi-square of 20000 draws (different seeds and token indices) against the definition."""
  z = np.array([0.5, -1.0, 2.0, 1.2, 0.0, -0.3, 1.9, -2.5], np.float32)
  n = 20000
  params = SamplingParams.create(n, temperature, top_k, top_p)
  seeds = jnp.arange(n, dtype=jnp.uint32) % 97
  index = jnp.arange(n, dtype=jnp.int32) // 97
  tokens = sample(jnp.broadcast_to(jnp.asarray(z), (n, 8)), params, seeds, index).tokens
  counts = np.bincount(np.asarray(tokens), minlength=8)
  expected = reference_probs(z, temperature, top_k, top_p) * n
  support = expected > 0
  assert counts[~support].sum() == 0
  pvalue = stats.chisquare(counts[support], expected[support]).pvalue
  assert pvalue > 1e-3, (counts, expected)
