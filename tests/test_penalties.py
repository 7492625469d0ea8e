"""glm5_jax.infer.penalties through the engine's jitted sampler (`programs.sample`, host-only: no
model): logit_bias, frequency and presence penalties against a float64 numpy reference of
OpenAI's formula, the device-side counts over a request's generated tokens, and the Request
fields' bounds."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from glm5_jax.infer import engine, penalties, programs
from glm5_jax.infer.requests import Request
from glm5_jax.infer.sampling import SamplingParams

B, Y = 5, 37  # odd sizes: no accidental alignment
count_fed = jax.jit(penalties.count_fed)


def reference(z_BY, counts_BY, requests):
  """OpenAI's formula in float64: z + bias - f * c - p * [c > 0], then log_softmax."""
  z = np.asarray(z_BY, np.float64).copy()
  for b, r in enumerate(requests):
    for token, bias in r.logit_bias:
      z[b, token] += bias
    z[b] -= r.frequency_penalty * counts_BY[b] + r.presence_penalty * (counts_BY[b] > 0)
  z -= z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _requests(rng):
  out = []
  for b in range(B):
    ids = rng.choice(Y, size=b * 3, replace=False)  # slot 0: no bias
    bias = tuple((int(t), float(rng.uniform(-100, 100) if j % 2 else rng.uniform(-3, 3)))
                 for j, t in enumerate(ids))
    f, p = (0.0, 0.0) if b == 1 else rng.uniform(-2, 2, size=2)
    out.append(Request(b, (1,), 8, 0.0, 1.0, 0, b, frequency_penalty=float(f),
                       presence_penalty=float(p), logit_bias=bias))
  return out


def _sample(z_BY, requests, counts_BY, top_n=4):
  settings = SamplingParams.create(B)
  out = programs.sample(
      z_BY, settings, np.zeros(B, np.uint32), np.ones(B, np.int32),
      penalties.host_penalties(requests), counts_BY, return_logits=True, top_n=top_n)
  return jax.device_get(out)


def test_adjusted_greedy_tokens_logprobs_and_alternatives_equal_the_float64_reference():
  rng = np.random.default_rng(0)
  requests = _requests(rng)
  z = rng.normal(0, 3, (B, Y)).astype(np.float32)
  counts = rng.integers(0, 4, (B, Y)) * (rng.random((B, Y)) < 0.3)
  tokens, logprobs, raw, logits, (top_ids, top_values) = _sample(z, requests,
                                                                 counts.astype(np.int32))
  want = reference(z, counts, requests)
  np.testing.assert_array_equal(tokens, want.argmax(-1))
  np.testing.assert_allclose(raw, want[np.arange(B), tokens], atol=2e-5)
  np.testing.assert_array_equal(logprobs, 0.0)  # greedy: all mass on the argmax
  np.testing.assert_array_equal(top_ids, np.argsort(-want, -1, kind="stable")[:, :4])
  np.testing.assert_allclose(top_values, np.take_along_axis(want, top_ids, -1), atol=2e-5)
  np.testing.assert_array_equal(logits, z)  # return_logits: the model's own
  # All off: the logits are untouched (the same tokens and log-probs, bit for bit).
  plain = [Request(b, (1,), 8, 0.0, 1.0, 0, b) for b in range(B)]
  got = _sample(z, plain, counts.astype(np.int32))
  base = _sample(z, plain, np.zeros((B, Y), np.int32))
  np.testing.assert_array_equal(got[2], base[2])
  np.testing.assert_array_equal(got[0], z.argmax(-1))


def test_a_greedy_run_with_device_counts_equals_the_reference_run():
  """12 steps of fixed per-step logits: the device counts (`count_fed`, reset at each slot's
  token 1) drive the same greedy sequence and log-probs as counting in numpy; slot 3 takes a
  new request at step 6 and counts from zero."""
  rng = np.random.default_rng(1)
  requests = _requests(rng)
  steps = rng.normal(0, 1, (12, B, Y)).astype(np.float32)
  counts = np.full((B, Y), 7, np.int32)  # stale counts of earlier requests: reset at token 1
  generated = [[] for _ in range(B)]
  start = np.zeros(B, int)
  pending = np.zeros(B, np.int32)
  for n, z in enumerate(steps):
    if n == 6:
      start[3], generated[3] = n, []
    index = (n - start).astype(np.int32)
    if n:
      counts = count_fed(counts, pending, index, np.ones(B, bool))
    want_counts = np.stack([np.bincount(g, minlength=Y) for g in generated])
    np.testing.assert_array_equal(np.asarray(counts)[index > 0], want_counts[index > 0])
    tokens, _, raw, _, _ = _sample(z, requests, counts if n else None)
    want = reference(z, want_counts, requests)
    np.testing.assert_array_equal(tokens, want.argmax(-1))
    np.testing.assert_allclose(raw, want[np.arange(B), tokens], atol=2e-5)
    for b in range(B):
      generated[b].append(int(tokens[b]))
    pending = tokens.astype(np.int32)
  assert any(len(set(g)) < len(g) for g in generated)  # penalties acted on repeats


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", float("nan")),
    ("logit_bias", ((3, 101.0),)), ("logit_bias", ((3, 1.0), (3, 2.0))),
    ("logit_bias", ((-1, 1.0),)), ("logit_bias", [(3, 1.0)]),
    ("logit_bias", tuple((i, 1.0) for i in range(penalties.MAX_BIASED_TOKENS + 1))),
])
def test_request_refuses_adjustments_out_of_range_naming_the_field(field, value):
  base = Request(0, (1,), 4, 1.0, 1.0, 0, 0)
  with pytest.raises(ValueError, match=field):
    dataclasses.replace(base, **{field: value})


def test_an_engine_refuses_adjustments_it_cannot_honour():
  """A speculating engine (a verification step would need each draft's counts) and a bias on
  an id past the vocab: ValueErrors naming the field; plain decoding in the vocab passes."""
  biased = Request(0, (1,), 4, 1.0, 1.0, 0, 0, logit_bias=((Y - 1, 1.0),))
  engine_like = lambda k: types.SimpleNamespace(k=k, cfg=types.SimpleNamespace(vocab_size=Y))
  engine.Engine._check_adjustments(engine_like(0), biased)
  with pytest.raises(ValueError, match="presence_penalty.*speculates 2"):
    engine.Engine._check_adjustments(engine_like(2), biased)
  with pytest.raises(ValueError, match=f"logit_bias token id {Y}"):
    engine.Engine._check_adjustments(engine_like(0), dataclasses.replace(
        biased, logit_bias=((Y, 1.0),)))
