"""The slot engine and `infer.generate`: greedy output equals a full-forward reference loop,
continuous batching equals one request at a time, prefix sharing, seeds, stops, log-probs."""

import numpy as np
import pytest

from glm5_jax import infer
from glm5_jax.infer import engine as engine_lib
from glm5_jax.infer.requests import Request
from tests.conftest import forward, random_params, tiny_model_config

# D | D (MoE) | R | M, index_topk 4: top-k is active past 4 tokens.
CFG = tiny_model_config(num_hidden_layers=4, attention_pattern="DDRM", first_k_dense_replace=1,
                        index_topk=4, mtp_depths=1)
PROMPTS = [[5, 17, 3, 99, 42, 7, 8], [11], [250, 3, 3, 9], [5, 17, 3, 99, 42, 7, 8]]


@pytest.fixture(scope="module")
def params():
  return random_params(CFG, seed=3, std=0.5)


def test_greedy_generate_equals_the_full_forward(params):
  """Each generated token is the argmax of the full forward over prompt + output (one
  teacher-forced forward per prompt, right-padded to one length: causal, so padding changes
  nothing before it), with that forward's raw log-prob and logits."""
  n, length = 6, 16
  result = infer.generate(CFG, params, PROMPTS, max_new_tokens=n, return_logits=True,
                          prefill_chunk=4)
  for i, prompt in enumerate(PROMPTS):
    seq = np.zeros((1, length), np.int32)
    seq[0, :len(prompt) + n] = list(prompt) + result.tokens[i]
    logits = np.asarray(forward(CFG, params, seq, mtp=False)["logits"][0])
    want_LY = logits[len(prompt) - 1:len(prompt) - 1 + n]
    assert result.tokens[i] == list(np.argmax(want_LY, axis=-1)), i
    log_softmax = want_LY - np.log(np.exp(want_LY - want_LY.max(-1, keepdims=True)).sum(
        -1, keepdims=True)) - want_LY.max(-1, keepdims=True)
    raw = log_softmax[np.arange(n), result.tokens[i]]
    # 3e-5 of the logits' scale: params of std 0.5 (diverse greedy tokens) round more than
    # tests/test_decode_cache.py's 1e-5 cases; a wrong cache row or top-k is off by O(1).
    scale = np.abs(want_LY).max()
    np.testing.assert_allclose(result.raw_logprobs[i], raw, rtol=0, atol=3e-5 * scale)
    np.testing.assert_allclose(result.logits[i], want_LY, rtol=0, atol=3e-5 * scale)
    assert result.logprobs[i] == [0.0] * n  # greedy: all mass on the argmax


def _requests(temperature, seed=0, max_new=(5, 3, 6, 4, 2, 5), stop=()):
  prompts = PROMPTS + [[1, 2, 3], [250]]
  return [Request(i, tuple(p), m, temperature, 0.9 if temperature else 1.0, 0,
                  engine_lib.request_seed(seed, i), tuple(stop))
          for i, (p, m) in enumerate(zip(prompts, max_new))]


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_continuous_batching_equals_one_request_at_a_time(params, temperature):
  """2 slots for 6 requests (slots are refilled as requests finish at different lengths) give
  the tokens and log-probs of generating each request alone."""
  requests = _requests(temperature)
  batched = engine_lib.Engine(CFG, params, slots=2, max_len=16, prefill_chunk=4).run(requests)
  for r, got in zip(requests, batched):
    alone = engine_lib.Engine(CFG, params, slots=1, max_len=16, prefill_chunk=4).run([r])[0]
    assert got.tokens == alone.tokens, r.index
    assert len(got.tokens) == r.max_new_tokens
    # Same tokens exactly; log-probs to rounding (XLA may order a reduction differently for
    # 2 rows than for 1).
    np.testing.assert_allclose(got.logprobs, alone.logprobs, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.raw_logprobs, alone.raw_logprobs, rtol=1e-4, atol=1e-5)


def test_prefix_sharing_copies_one_prefill_into_the_group(params, monkeypatch):
  """A prompt sampled G = 4 times is prefilled once; the copies decode like separate
  prefills (their samples differ: each has its own seed)."""
  prefilled_rows = []

  original = engine_lib.Engine._paged_chunk  # the engine's default cache is paged

  def counting(self, chunk, *args):
    lengths_P = chunk[3]
    prefilled_rows.append(int((lengths_P > 0).sum()))
    return original(self, chunk, *args)

  monkeypatch.setattr(engine_lib.Engine, "_paged_chunk", counting)
  prompt = [5, 17, 3, 99, 42]
  group = infer.generate(CFG, params, [prompt] * 4, max_new_tokens=5, temperature=1.0,
                         seed=7, prefill_chunk=4, max_len=16)
  assert prefilled_rows == [1, 1]  # one prompt row, in two chunks of 4
  monkeypatch.undo()
  for i in range(4):
    alone = engine_lib.Engine(CFG, params, slots=1, max_len=16, prefill_chunk=4).run(
        [Request(i, tuple(prompt), 5, 1.0, 1.0, 0, engine_lib.request_seed(7, i))])[0]
    assert group.tokens[i] == alone.tokens
  assert len({tuple(t) for t in group.tokens}) > 1


def test_seed_reproduces_and_changes_samples(params):
  kwargs = dict(max_new_tokens=6, temperature=1.0, top_k=20)
  a = infer.generate(CFG, params, PROMPTS, seed=1, **kwargs)
  b = infer.generate(CFG, params, PROMPTS, seed=1, **kwargs)
  c = infer.generate(CFG, params, PROMPTS, seed=2, **kwargs)
  assert a.tokens == b.tokens and a.logprobs == b.logprobs
  assert a.tokens != c.tokens
  for lp, raw in zip(a.logprobs, a.raw_logprobs):  # top-k renormalizes: more likely than raw
    assert all(s >= r - 1e-6 for s, r in zip(lp, raw))


def test_stop_token_ends_a_request_and_is_kept(params):
  free = infer.generate(CFG, params, PROMPTS[:1], max_new_tokens=6)
  stop = free.tokens[0][2]
  stopped = infer.generate(CFG, params, PROMPTS[:1], max_new_tokens=6, stop_tokens=[stop])
  first = free.tokens[0].index(stop)
  assert stopped.tokens[0] == free.tokens[0][:first + 1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[]]), "prompts\\[0\\] is empty"),
    (dict(prompts=[[1], [CFG.vocab_size]]), "prompts\\[1\\]\\[0\\] = .* vocab size"),
    (dict(prompts=[[-1]]), "negative"),
    (dict(prompts=[[1, 2, 3]], max_len=2), "longer than max_len"),
    (dict(prompts=[[1]], top_p=0.0), "top_p must be in \\(0, 1\\]"),
    (dict(prompts=[[1]], top_p=1.5), "top_p must be in \\(0, 1\\]"),
    (dict(prompts=[[1]], slots=0), "slots must be None .* or an int >= 1; got 0"),
    # Refused before a cache of 10**7 positions is allocated (was RESOURCE_EXHAUSTED).
    (dict(prompts=[[1, 2]], max_new_tokens=10**7), "max_new_tokens 10000000 .* "
     f"max_position_embeddings = {CFG.max_position_embeddings}"),
])
def test_bad_input_is_a_clear_value_error(params, kwargs, match):
  with pytest.raises(ValueError, match=match):
    infer.generate(CFG, params, **kwargs)


def test_incremental_api_streams_cancels_and_stays_exact(params):
  """submit / step / cancel: 4 requests on 2 slots; each step's events carry the new tokens;
  cancelling a running request frees its slot at once (the waiting one is admitted in the next
  step), and the others get exactly the tokens of `run` (batching independence)."""
  requests = _requests(1.3)[:4]
  want = engine_lib.Engine(CFG, params, slots=2, max_len=16, prefill_chunk=4).run(requests)
  engine = engine_lib.Engine(CFG, params, slots=2, max_len=16, prefill_chunk=4)
  handles = [engine.submit(r) for r in requests]
  streamed = {h: [] for h in handles}
  done = {}
  events = engine.step()  # admits requests 0 and 1: first token + one decode token each
  assert [e.handle for e in events] == handles[:2] and engine.waiting() == 2
  assert all(len(e.tokens) == 2 and e.completion is None for e in events)
  for e in events:
    streamed[e.handle] += e.tokens
  assert engine.cancel(handles[1]) and engine.running() == 1 and not engine.cancel(handles[1])
  assert engine.cancel(handles[3]) and engine.waiting() == 1  # dropped from the queue
  while engine.busy:
    for e in engine.step():
      streamed[e.handle] += e.tokens
      if e.completion is not None:
        done[e.handle] = e.completion
  assert set(done) == {handles[0], handles[2]}
  for h, i in ((handles[0], 0), (handles[2], 2)):
    assert streamed[h] == done[h].tokens == want[i].tokens, i
    assert done[h].finish_reason == "length"
  assert engine.step() == []


def test_request_refuses_bad_settings_naming_the_field():
  good = dict(index=3, prompt=(1, 2), max_new_tokens=2, temperature=1.0, top_p=1.0, top_k=0,
              seed=0)
  for field, value, match in (("temperature", -1.0, "temperature must be >= 0"),
                              ("top_p", 0.0, "top_p must be in \\(0, 1\\]"),
                              ("top_k", -5, "top_k must be >= 0"),
                              ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
                              ("prompt", (), "prompt must be a non-empty tuple")):
    with pytest.raises(ValueError, match=f"Request 3: {match}"):
      Request(**{**good, field: value})
