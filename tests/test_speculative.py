"""glm5_jax.infer.speculative, accept_stats and oracle: greedy acceptance, speculative sampling's
output distribution (chi-square), reproducibility, the accept-length counts, and the greedy
accept-length oracle against a real speculation loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from glm5_jax.infer import accept_stats, sampling, speculative
from glm5_jax.infer.oracle import greedy_accept_oracle
from glm5_jax.infer.sampling import DRAFT, SamplingParams

greedy_accept = jax.jit(speculative.greedy_accept)
verify = jax.jit(speculative.verify)
PAD = speculative.PAD_TOKEN


def onehot_logits(ids, y, scale=5.0):
  return scale * jax.nn.one_hot(jnp.asarray(ids), y)


def test_greedy_accept_cases():
  target = onehot_logits([[2, 4, 1, 3]] * 3, 5)
  target = target.at[2, 3, 1].set(5.0)  # row 3 of slot 2 ties ids 1 and 3: argmax 1
  drafts = jnp.array([[0, 4, 1], [2, 4, 0], [2, 4, 1]])
  out = greedy_accept(drafts, target)
  np.testing.assert_array_equal(out.accepted, [0, 2, 3])
  np.testing.assert_array_equal(out.num_emitted, [1, 3, 4])
  np.testing.assert_array_equal(out.tokens, [[2, PAD, PAD, PAD], [2, 4, 1, PAD], [2, 4, 1, 1]])
  np.testing.assert_array_equal(out.logprobs, np.zeros((3, 4)))
  raw = jax.nn.log_softmax(target)
  np.testing.assert_allclose(out.raw_logprobs[2], raw[2, jnp.arange(4), jnp.array([2, 4, 1, 1])])
  assert out.raw_logprobs[0, 1] == 0.0


def test_verify_at_temperature_zero_is_greedy_accept():
  """Whatever the draft distribution (drafts need not be its argmax), a greedy slot accepts
  exactly the drafts equal to the target's argmax."""
  y, k, b = 7, 3, 16
  key_t, key_d, key_m = jax.random.split(jax.random.key(3), 3)
  target = jax.random.normal(key_t, (b, k + 1, y))
  argmax = jnp.argmax(target, -1)
  drafts = jnp.where(jax.random.uniform(key_m, (b, k)) < 0.7, argmax[:, :k],
                     (argmax[:, :k] + 1) % y)
  draft_logits = jax.random.normal(key_d, (b, k, y))
  params = SamplingParams.create(b, temperature=0.0, top_k=2, top_p=0.5)
  got = verify(drafts, draft_logits, target, params, jnp.arange(b, dtype=jnp.uint32),
               jnp.zeros(b, jnp.int32))
  want = greedy_accept(drafts, target)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6)
  assert 0 < int(jnp.sum(want.accepted)) < b * k


def test_verify_reproducible_whatever_the_batch():
  y, k = 9, 3
  keys = jax.random.split(jax.random.key(4), 3)
  target = jax.random.normal(keys[0], (4, k + 1, y))
  draft_logits = jax.random.normal(keys[1], (4, k, y))
  drafts = jax.random.randint(keys[2], (4, k), 0, y)
  params = SamplingParams.create(4, temperature=[1.0, 0.0, 0.7, 1.0], top_k=[0, 0, 4, 0])
  seeds = jnp.array([11, 12, 13, 14], jnp.uint32)
  index = jnp.array([5, 0, 2, 9])
  out = verify(drafts, draft_logits, target, params, seeds, index)
  perm = jnp.array([2, 0, 3, 1])
  permuted = verify(drafts[perm], draft_logits[perm], target[perm],
                    jax.tree.map(lambda x: x[perm], params), seeds[perm], index[perm])
  for a, b in zip(out, permuted):
    np.testing.assert_array_equal(np.asarray(a)[np.asarray(perm)], b)


def test_speculative_sampling_has_the_target_distribution():
  """A toy Markov "model" over 6 tokens: the target's next-token logits are P[prev], the
  draft's Q[prev], very different. Three speculative steps (k = 2, temperature 0.9, top_k 5)
  per trial from token 0; the first three generated tokens must be distributed as the chain
  under the target's sampling distribution (joint of tokens 1-2, and of 2-3, which includes
  bonus tokens), and the acceptance rates must be those of Leviathan et al."""
  y, k, trials = 6, 2, 20000
  rng = np.random.default_rng(0)
  p_logits = jnp.asarray(rng.normal(size=(y, y)) * 1.5, jnp.float32)
  q_logits = jnp.asarray(-np.asarray(p_logits) + rng.normal(size=(y, y)), jnp.float32)
  params = SamplingParams.create(1, temperature=0.9, top_k=5)
  p_table = np.asarray(jnp.exp(sampling.sampling_logprobs(p_logits, SamplingParams.create(
      y, 0.9, 5))), np.float64)
  q_table = np.asarray(jnp.exp(sampling.sampling_logprobs(q_logits, SamplingParams.create(
      y, 0.9, 5))), np.float64)

  def trial(seed):
    seed_B = seed[None]
    out = jnp.full((3 * (k + 1) + 1,), -1, jnp.int32)
    last, n, first_accepted = jnp.int32(0), jnp.int32(1), None
    for _ in range(3):
      drafts, ctx = [], last
      for j in range(k):
        ctx = sampling.sample(q_logits[ctx][None], params, seed_B, (n + j)[None], DRAFT).tokens[0]
        drafts.append(ctx)
      drafts = jnp.stack(drafts)
      contexts = jnp.concatenate([last[None], drafts])
      v = speculative.verify(drafts[None], q_logits[contexts[:k]][None],
                             p_logits[contexts][None], params, seed_B, n[None])
      where = jnp.where(jnp.arange(k + 1) < v.num_emitted[0], n + jnp.arange(k + 1), 10**6)
      out = out.at[where].set(v.tokens[0], mode="drop")
      last, n = v.tokens[0, v.accepted[0]], n + v.num_emitted[0]
      first_accepted = v.accepted[0] if first_accepted is None else first_accepted
    return out[1:4], first_accepted

  tokens, accepted = jax.jit(jax.vmap(trial))(jnp.arange(trials, dtype=jnp.uint32))
  tokens, accepted = np.asarray(tokens), np.asarray(accepted)
  assert tokens.min() >= 0
  marginal_1 = p_table[0] @ p_table
  for (a, b), first in (((0, 1), p_table[0]), ((1, 2), marginal_1)):
    counts = np.bincount(tokens[:, a] * y + tokens[:, b], minlength=y * y)
    expected = (first[:, None] * p_table).reshape(-1) * trials
    support = expected > 0
    assert counts[~support].sum() == 0
    expected = expected[support] * trials / expected[support].sum()  # fp32 table rounding
    pvalue = stats.chisquare(counts[support], expected).pvalue
    assert pvalue > 1e-3, (a, b, pvalue)
  # P(draft 1 accepted) = sum_x min(p, q); P(both) = sum_x min(p, q)(x) sum_y min(p, q)(y|x).
  overlap = np.minimum(p_table, q_table)
  for observed, expected in ((np.mean(accepted >= 1), overlap[0].sum()),
                             (np.mean(accepted == 2), overlap[0] @ overlap.sum(1))):
    assert abs(observed - expected) < 5 * np.sqrt(expected * (1 - expected) / trials)
  assert 0.05 < np.mean(accepted >= 1) < 0.95  # the draft really is different


def test_step_counts_and_stats():
  # k = 3; (accepted, limit): a full step, a rejection at draft 2, a step cut by its limit,
  # a cut step where the limit leaves no draft to consider.
  emitted, reached, acc = accept_stats.step_counts(jnp.array([3, 1, 3, 0]),
                                                   jnp.array([99, 99, 2, 1]), 3)
  np.testing.assert_array_equal(emitted, [4, 2, 2, 1])
  np.testing.assert_array_equal(reached, [[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
  np.testing.assert_array_equal(acc, [[1, 1, 1], [1, 0, 0], [1, 0, 0], [0, 0, 0]])
  stats_ = accept_stats.init_accept_stats(2, 3)
  stats_ = accept_stats.add_step(stats_, jnp.array([3, 0]), jnp.array([99, 99]))
  stats_ = accept_stats.add_step(stats_, jnp.array([1, 2]), jnp.array([99, 99]),
                                 active_B=jnp.array([True, False]))
  np.testing.assert_allclose(accept_stats.mean_accept_length(stats_), [3.0, 1.0])
  np.testing.assert_allclose(accept_stats.acceptance_rates(stats_),
                             [[1.0, 0.5, 1.0], [0.0, np.nan, np.nan]])
  np.testing.assert_allclose(accept_stats.mean_accept_length(accept_stats.pooled(stats_)), [7 / 3])
  cleared = accept_stats.reset_rows(stats_, jnp.array([True, False]))
  assert np.isnan(accept_stats.mean_accept_length(cleared)[0])
  np.testing.assert_array_equal(cleared.reached[1], stats_.reached[1])


def test_stop_limit():
  tokens = jnp.array([[5, 7, 2, 7], [1, 2, 3, PAD], [7, 1, 1, 1], [1, 1, 1, 1]])
  limit = accept_stats.stop_limit(tokens, jnp.array([4, 3, 4, 4]), jnp.array([9, 9, 9, 2]),
                                  stop_tokens=(7, 3))
  np.testing.assert_array_equal(limit, [2, 3, 1, 2])
  np.testing.assert_array_equal(accept_stats.stop_limit(tokens, jnp.array([4, 3, 4, 4]),
                                                        jnp.array([9, 9, 9, 2])), [9, 9, 9, 2])


def test_oracle_hand_built():
  tokens = np.array([9, 9, 1, 2, 3, 4, 5, 6, 7, 8])  # prompt of 2, 8 generated
  length, y = len(tokens), 10
  logits = np.asarray(onehot_logits(np.append(tokens[1:], 0), y))  # greedy: row i -> t_{i+1}
  mtp = np.zeros((3, length, y), np.float32)  # argmax 0 = a wrong draft unless set below
  right = lambda d, i: mtp.__setitem__((d - 1, i, tokens[i + d + 1]), 5.0)
  right(1, 1)  # step from m=2: draft 1 right, draft 2 wrong -> a=1, keeps 2
  right(1, 4)  # step from m=5 (after m=4: draft 1 wrong): both right -> a=2, keeps 3
  right(2, 4)
  right(2, 3)  # depth 2 at m=4 is right, but after a rejected draft 1 it is never tested
  result = greedy_accept_oracle(tokens, 2, logits, mtp, k=2)
  assert result.accepted == [1, 0, 2, 0]
  assert result.limits == [7, 5, 4, 1]
  assert result.emitted == [2, 1, 3, 1]
  np.testing.assert_array_equal(result.stats.reached, [[3, 2]])
  np.testing.assert_array_equal(result.stats.accepted, [[2, 1]])
  np.testing.assert_allclose(accept_stats.mean_accept_length(result.stats), [7 / 4])
  with pytest.raises(ValueError, match="token 5 is 4 but the main logits' argmax"):
    bad = logits.copy()
    bad[4] = onehot_logits(3, y)
    greedy_accept_oracle(tokens, 2, bad, mtp, k=2)
  with pytest.raises(ValueError, match="mtp_depths >= k"):
    greedy_accept_oracle(tokens, 2, logits, mtp, k=4)


def _toy_next(seq):
  return (3 * seq[-1] + sum(seq[-3:]) + len(seq)) % 4


def _toy_draft(seq, d):
  """MTP depth d's prediction of the token after `seq` (right or wrong, deterministically)."""
  guess = _toy_next(seq)
  return guess if (7 * sum(seq) + d + len(seq)) % 3 else (guess + 1) % 4


@pytest.mark.parametrize("k", [1, 2, 3])
def test_oracle_equals_a_speculation_loop(k):
  """A toy model whose drafts depend on the tokens they are fed: a real greedy speculation
  loop (drafts fed earlier drafts, `greedy_accept`, kept counts cut by max_new_tokens) gives
  the plain greedy output and exactly the oracle's counts from the teacher-forced logits."""
  y, prompt, new = 4, [1, 2, 3], 20
  seq = list(prompt)
  while len(seq) < len(prompt) + new:
    seq.append(_toy_next(seq))
  length = len(seq)
  logits = np.asarray(onehot_logits([_toy_next(seq[:i + 1]) for i in range(length)], y))
  mtp = np.zeros((k, length, y), np.float32)
  for d in range(1, k + 1):
    for i in range(length - d):
      mtp[d - 1, i, _toy_draft(seq[:i + d + 1], d)] = 5.0

  out = list(prompt) + [_toy_next(prompt)]  # the prefill's token
  stats_ = accept_stats.init_accept_stats(1, k)
  while len(out) < length:
    drafts = []
    for d in range(1, k + 1):
      drafts.append(_toy_draft(out + drafts, d))
    target = onehot_logits([_toy_next(out + drafts[:j]) for j in range(k + 1)], y)
    v = greedy_accept(jnp.array([drafts]), target[None])
    limit = np.array([length - len(out)])
    stats_ = accept_stats.add_step(stats_, v.accepted, limit)
    out += np.asarray(v.tokens[0, :min(int(v.num_emitted[0]), int(limit[0]))]).tolist()
  assert out == seq
  oracle = greedy_accept_oracle(seq, len(prompt), logits, mtp, k)
  for got, want in zip(stats_, oracle.stats):
    np.testing.assert_array_equal(got, want)
  assert 0 < oracle.stats.accepted.sum() < oracle.stats.reached.sum()  # both outcomes occur
