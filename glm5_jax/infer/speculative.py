"""Acceptance rules of MTP speculative decoding: pure functions over one verification step.

One step of a slot whose request has generated tokens up to index n-1 (the last, t_{n-1}, is
already emitted and not yet fed to the main model):

  drafts   d_0 .. d_{k-1}   proposals for tokens n .. n+k-1 (the MTP chain; `sampling.sample`
                            with `stream=DRAFT`, from the draft logits under the slot's settings)
  verify   one main forward over [t_{n-1}, d_0, .., d_{k-1}] gives the target logits at the
           Q = k + 1 positions; row j predicts token n+j (it has seen d_0 .. d_{j-1})
  accept   a = number of leading drafts accepted (0..k); the step emits a + 1 tokens:
           d_0 .. d_{a-1}, then one token from the target at row a (the correction, or after
           all k accepted the bonus token).

`verify` implements speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", algorithm 1) with p = the target's and q = the draft's
sampling distribution (`sampling.sampling_logprobs`, the same settings for both):
  * draft d_j is accepted iff `u_j * q_j(d_j) < p_j(d_j)`, u_j ~ U[0, 1) (i.e. with probability
    min(1, p/q), no division);
  * at the first rejection a, the emitted token is drawn from norm(max(0, p_a - q_a)); after k
    acceptances from p_k (q_k := 0 makes that the same formula).
Every emitted token is then distributed exactly as plain sampling from p would give it. A
greedy slot (temperature 0) has p = one-hot at the target's argmax, so a draft is accepted iff
it equals the argmax and the emitted token is the argmax: exactly `greedy_accept`, whatever q.
If the residual has no mass (p == q to rounding where the test still rejected, probability ~0),
the token is drawn from p_a instead; the draw stays exact up to that rounding.

Randomness per (request seed, token index) as `sampling.token_keys`: u_j uses (n+j, ACCEPT),
the emitted token at row a uses (n+a, SAMPLE), drafts use (n+j, DRAFT). The emitted history
depends only on the keys of token indices <= n+a, and the next step starts at n+a+1, so keys
reused for indices past n+a in a later step are still fresh draws: the output is exact and
reruns reproduce it.

Log-probs of emitted tokens are under the target's sampling distribution at their row
(log p_j(token), 0 for greedy), the quantity plain sampling reports, since p is each token's
exact distribution; raw log-probs are `log_softmax(target logits)` at temperature 1.

Notation (docs/design.md): B slots, Q = k + 1 verified positions, Y vocab; k (lowercase, local
to this module) the draft steps.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from glm5_jax.infer.sampling import ACCEPT, SAMPLE, SamplingParams, sampling_logprobs, \
    take_token, token_keys

PAD_TOKEN = -1  # `Verified.tokens` entries past `num_emitted`


class Verified(NamedTuple):
  """The outcome of one verification step per slot.

  accepted: int32 `[B]`, drafts accepted (0..k).
  num_emitted: int32 `[B]`, accepted + 1.
  tokens: int32 `[B, Q]`, the emitted tokens, PAD_TOKEN past `num_emitted`.
  logprobs: fp32 `[B, Q]`, under the target's sampling distribution (0 for greedy; 0 past
    `num_emitted`).
  raw_logprobs: fp32 `[B, Q]`, under the raw target logits (0 past `num_emitted`).
  """

  accepted: jax.Array
  num_emitted: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  raw_logprobs: jax.Array


def greedy_accept(drafts_Bk, target_logits_BQY) -> Verified:
  """Exact-match acceptance at temperature 0.

  Args:
    drafts_Bk: int draft tokens, k = Q - 1.
    target_logits_BQY: fp32 target logits at the Q verified rows (row j predicts the token
      draft j proposes; row k the bonus token).
  Returns:
    `Verified`: accepted = the longest prefix of drafts equal to the target's argmax (lowest id
    among equal maxima, as `sampling`); the emitted tokens are the target's argmax at rows
    0..accepted (the drafts themselves where accepted, then the correction or the bonus).
  """
  _check_shapes(drafts_Bk, target_logits_BQY)
  logits_BQY = target_logits_BQY.astype(jnp.float32)
  argmax_BQ = jnp.argmax(jnp.where(logits_BQY == 0, 0.0, logits_BQY), axis=-1).astype(jnp.int32)
  match_Bk = drafts_Bk == argmax_BQ[:, :-1]
  accepted_B = _leading_true(match_Bk)
  valid_BQ = _valid(accepted_B, logits_BQY.shape[1])
  raw_BQ = take_token(jax.nn.log_softmax(logits_BQY), argmax_BQ)
  return Verified(accepted_B, accepted_B + 1, jnp.where(valid_BQ, argmax_BQ, PAD_TOKEN),
                  jnp.zeros(valid_BQ.shape, jnp.float32), jnp.where(valid_BQ, raw_BQ, 0.0))


def verify(drafts_Bk, draft_logits_BkY, target_logits_BQY, params: SamplingParams, seed_B,
           index_B) -> Verified:
  """Speculative sampling (module docstring) for slots with any settings, greedy included.

  Args:
    drafts_Bk: int draft tokens, drawn from the draft's sampling distribution (for greedy
      slots: its argmax).
    draft_logits_BkY: fp32 raw draft (MTP) logits that the drafts were drawn from.
    target_logits_BQY: fp32 raw target logits at the Q = k + 1 verified rows.
    params: per-slot settings `[B]`, applied to both draft and target logits.
    seed_B: uint32 request seeds.
    index_B: int32 token index (within each request) of the first token this step emits, i.e.
      the one draft 0 proposes.
  Returns:
    `Verified`.
  """
  _check_shapes(drafts_Bk, target_logits_BQY)
  b, q, y = target_logits_BQY.shape
  k = q - 1
  if draft_logits_BkY.shape != (b, k, y):
    raise ValueError(f"draft_logits has shape {draft_logits_BkY.shape}; expected {(b, k, y)} "
                     "[B, k, Y] for drafts of shape [B, k] and target logits [B, k + 1, Y]")
  drafts_Bk = drafts_Bk.astype(jnp.int32)
  index_B = jnp.asarray(index_B, jnp.int32)
  logp_BQY = sampling_logprobs(target_logits_BQY.astype(jnp.float32), params)
  p_BQY = jnp.exp(logp_BQY)
  q_BQY = jnp.pad(jnp.exp(sampling_logprobs(draft_logits_BkY.astype(jnp.float32), params)),
                  ((0, 0), (0, 1), (0, 0)))  # q_k := 0: the bonus row's residual is p_k
  offsets_k = jnp.arange(k, dtype=jnp.int32)
  u_Bk = jax.vmap(jax.vmap(jax.random.uniform))(
      token_keys(seed_B, index_B[:, None] + offsets_k, ACCEPT))
  ok_Bk = u_Bk * take_token(q_BQY[:, :k], drafts_Bk) < take_token(p_BQY[:, :k], drafts_Bk)
  accepted_B = _leading_true(ok_Bk)

  rows_B = jnp.arange(b)
  p_a_BY, q_a_BY = p_BQY[rows_B, accepted_B], q_BQY[rows_B, accepted_B]
  residual_BY = jnp.maximum(p_a_BY - q_a_BY, 0.0)
  residual_BY = jnp.where(jnp.sum(residual_BY, -1, keepdims=True) > 0, residual_BY, p_a_BY)
  keys_B = token_keys(seed_B, index_B + accepted_B, SAMPLE)
  last_B = jax.vmap(jax.random.categorical)(keys_B, jnp.log(residual_BY)).astype(jnp.int32)

  positions_BQ = jnp.arange(q, dtype=jnp.int32)[None, :]
  drafts_BQ = jnp.pad(drafts_Bk, ((0, 0), (0, 1)))
  tokens_BQ = jnp.where(positions_BQ < accepted_B[:, None], drafts_BQ, last_B[:, None])
  valid_BQ = _valid(accepted_B, q)
  raw_BQY = jax.nn.log_softmax(target_logits_BQY.astype(jnp.float32))
  return Verified(accepted_B, accepted_B + 1, jnp.where(valid_BQ, tokens_BQ, PAD_TOKEN),
                  jnp.where(valid_BQ, take_token(logp_BQY, tokens_BQ), 0.0),
                  jnp.where(valid_BQ, take_token(raw_BQY, tokens_BQ), 0.0))


def _leading_true(mask_Bk):
  """Number of leading True entries per row."""
  return jnp.sum(jnp.cumprod(mask_Bk.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _valid(accepted_B, q):
  return jnp.arange(q, dtype=jnp.int32)[None, :] <= accepted_B[:, None]


def _check_shapes(drafts_Bk, target_logits_BQY):
  if target_logits_BQY.ndim != 3 or drafts_Bk.ndim != 2 or \
      drafts_Bk.shape != (target_logits_BQY.shape[0], target_logits_BQY.shape[1] - 1):
    raise ValueError(f"drafts {drafts_Bk.shape} and target logits {target_logits_BQY.shape} "
                     "must be [B, k] and [B, k + 1, Y]")
