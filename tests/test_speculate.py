"""MTP speculative decoding in the engine: greedy output equals plain greedy exactly, the accept
counts equal the teacher-forced oracle's, and sampling keeps the plain distribution."""

import numpy as np
import pytest
from scipy import stats

from glm5_jax import infer
from glm5_jax.infer import engine as engine_lib
from glm5_jax.infer.oracle import greedy_accept_oracle
from glm5_jax.infer.requests import Request
from tests.conftest import forward, random_params, tiny_model_config

# A 6-token vocabulary makes drafts right often enough for every accept count to occur.
CFG = tiny_model_config(num_hidden_layers=4, attention_pattern="DDRM", first_k_dense_replace=1,
                        index_topk=4, mtp_depths=3, vocab_size=6)
PROMPTS = [[5, 1, 3, 2, 4, 0, 1], [1], [2, 3, 3, 1], [4, 4]]


@pytest.fixture(scope="module")
def params():
  return random_params(CFG, seed=3, std=0.5)


@pytest.fixture(scope="module")
def plain(params):
  return infer.generate(CFG, params, PROMPTS, max_new_tokens=16, prefill_chunk=4)


@pytest.mark.parametrize("mtp_cache", ["per_depth", "shared"])
def test_speculative_greedy_equals_plain_greedy(params, plain, mtp_cache):
  spec = infer.generate(CFG, params, PROMPTS, max_new_tokens=16, prefill_chunk=4,
                        speculative_steps=3, mtp_cache=mtp_cache)
  assert spec.tokens == plain.tokens
  np.testing.assert_allclose(np.array(spec.raw_logprobs), np.array(plain.raw_logprobs),
                             rtol=1e-4, atol=1e-5)
  assert all(1.0 <= a <= 4.0 for a in spec.accept_lengths)


@pytest.mark.parametrize("k", [1, 3])
def test_per_depth_accept_counts_equal_the_teacher_forced_oracle(params, k):
  """Per request: steps, tokens kept, and per draft position reached / accepted equal what one
  teacher-forced forward says greedy speculation must give (`oracle.greedy_accept_oracle`),
  including a stop token that cuts the last step."""
  requests = [Request(i, tuple(p), 16, 0.0, 1.0, 0, i) for i, p in enumerate(PROMPTS)]
  requests.append(Request(len(PROMPTS), tuple(PROMPTS[0]), 16, 0.0, 1.0, 0, 0, (4,)))
  done = engine_lib.Engine(CFG, params, slots=2, max_len=32, prefill_chunk=4,
                           speculative_steps=k).run(requests)
  mixed = set()
  for c in done:
    # Right-padded to one length (one compile; causal, so the padding changes nothing before).
    n = len(c.sequence)
    seq = np.zeros((1, 32), np.int32)
    seq[0, :n] = c.sequence
    out = forward(CFG, params, seq)
    want = greedy_accept_oracle(seq[0, :n], len(c.request.prompt),
                                np.asarray(out["logits"][0, :n]),
                                np.asarray(out["mtp_logits"][:, 0, :n]), k).stats
    for got_x, want_x in zip(c.accept, want):
      # Host arrays: eager device ops per slot per step made MTP decoding 14x slower on a GPU.
      assert isinstance(got_x, np.ndarray), type(got_x)
      np.testing.assert_array_equal(got_x, want_x)
    mixed.update(int(a) for a in np.asarray(want.accepted).ravel())
  assert done[-1].tokens[-1] == 4 and len(done[-1].tokens) < 16  # the stop token ended it
  assert len(mixed) > 1  # drafts both accepted and rejected somewhere


def test_speculative_sampling_keeps_the_plain_distribution(params):
  """800 samples of 3 tokens from one prompt (the 2nd and 3rd come from verification steps
  with k = 2): the joint distribution of tokens 2 and 3 is the same with and without
  speculation (chi-square test of homogeneity on the 6 x 6 table)."""
  n, prompt = 800, (2, 3, 3, 1)

  def sample(k):
    requests = [Request(i, prompt, 3, 1.0, 1.0, 0, i) for i in range(n)]
    done = engine_lib.Engine(CFG, params, slots=200, max_len=12, prefill_chunk=4,
                             speculative_steps=k).run(requests)
    return np.array([c.tokens for c in done])

  plain, spec = sample(0), sample(2)
  table = np.zeros((2, 36))
  for row, tokens in enumerate((plain, spec)):
    np.add.at(table[row], tokens[:, 1] * 6 + tokens[:, 2], 1)
  table = table[:, table.sum(0) > 0]
  assert table.shape[1] > 10  # a spread-out distribution, not a near-deterministic one
  p_value = stats.chi2_contingency(table).pvalue
  assert p_value > 1e-3, (p_value, table)
  assert (plain != spec).any()  # the two used different randomness


@pytest.mark.parametrize("pattern", ["NM", "LD"])
def test_recurrent_layers_roll_back_rejected_drafts(pattern):
  """N / L layers keep only the tokens that stand (their per-token states, `rollback_cache`):
  speculative greedy equals plain greedy, with drafts both accepted and rejected."""
  cfg = tiny_model_config(num_hidden_layers=2, attention_pattern=pattern,
                          first_k_dense_replace=1, index_topk=4, mtp_depths=2, vocab_size=6)
  params = random_params(cfg, seed=5, std=0.5)
  prompts = [[5, 1, 3, 2, 4], [2, 3]]
  plain = infer.generate(cfg, params, prompts, max_new_tokens=12, prefill_chunk=4)
  spec = infer.generate(cfg, params, prompts, max_new_tokens=12, prefill_chunk=4,
                        speculative_steps=2)
  assert spec.tokens == plain.tokens
  rates = np.array(spec.acceptance_rates, np.float64)
  assert np.nanmax(rates) > 0 and np.nanmin(rates) < 1, rates


def test_speculation_refuses_a_recurrent_mtp_layer_and_models_without_mtp():
  with pytest.raises(ValueError, match="MTP layer runs the recurrent kind N"):
    engine_lib.Engine(tiny_model_config(num_hidden_layers=2, attention_pattern="MN",
                                        first_k_dense_replace=2), None, slots=1, max_len=8,
                      speculative_steps=2)
  with pytest.raises(ValueError, match="has none"):
    engine_lib.Engine(tiny_model_config(num_nextn_predict_layers=0, mtp_depths=0), None,
                      slots=1, max_len=8, speculative_steps=2)
