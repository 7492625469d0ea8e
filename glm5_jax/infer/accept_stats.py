"""Accept-length bookkeeping of speculative decoding, per request.

Definitions (the report's accept length: tokens emitted per verification step, the bonus token
included). For one verification step of a request with `a` drafts accepted out of k:

  limit  r = how many more tokens the request can keep: its remaining `max_new_tokens` budget,
         or, when a stop token is among the emitted ones, its position + 1 (`stop_limit`).
  emitted  min(a + 1, r): the tokens the request keeps from this step. Only the final step of a
         request can be cut; a cut step counts what was kept, because whatever the drafts past
         the end would have done cannot be observed (nor reproduced by the oracle).
  drafts considered  d = 1 .. min(k, r - 1): the drafts whose acceptance can change what is kept
         (with r - 1 accepted the step already keeps r tokens).
  reached[d]  the step considered draft d and accepted drafts 1 .. d-1 (draft d was tested).
  accepted[d] reached[d] and draft d accepted.

The first token after the prompt comes from the prefill, not from a verification step, and is
not counted. Per request: mean accept length = sum(emitted) / steps (NaN before any step); the
acceptance rate at draft position d = accepted[d] / reached[d] (conditional on reaching d; NaN
when never reached). Pool requests by summing their counts (`pooled`) before dividing.

Notation (docs/design.md): B slots (requests), Q tokens per step; k (lowercase) draft steps.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

NO_LIMIT = 2**30  # a limit larger than any step's emission


class AcceptStats(NamedTuple):
  """Counts per request: steps `[B]`, emitted `[B]`, reached `[B, k]`, accepted `[B, k]` (all
  int32; draft position d is column d - 1)."""

  steps: jax.Array
  emitted: jax.Array
  reached: jax.Array
  accepted: jax.Array


def init_accept_stats(batch: int, k: int) -> AcceptStats:
  zeros_B = jnp.zeros((batch,), jnp.int32)
  zeros_Bk = jnp.zeros((batch, k), jnp.int32)
  return AcceptStats(zeros_B, zeros_B, zeros_Bk, zeros_Bk)


def step_counts(accepted_B, limit_B, k: int):
  """One verification step's counts (module docstring).

  Args:
    accepted_B: int drafts accepted, 0..k.
    limit_B: int tokens the request can keep from this step (`stop_limit`; NO_LIMIT if none).
  Returns:
    `(emitted_B, reached_Bk, accepted_Bk)`, int32.
  """
  accepted_B = jnp.asarray(accepted_B, jnp.int32)
  limit_B = jnp.asarray(limit_B, jnp.int32)
  d_k = jnp.arange(1, k + 1, dtype=jnp.int32)
  considered_Bk = d_k <= limit_B[:, None] - 1
  reached_Bk = considered_Bk & (accepted_B[:, None] >= d_k - 1)
  accepted_Bk = considered_Bk & (accepted_B[:, None] >= d_k)
  return (jnp.minimum(accepted_B + 1, limit_B), reached_Bk.astype(jnp.int32),
          accepted_Bk.astype(jnp.int32))


def add_step(stats: AcceptStats, accepted_B, limit_B, active_B=None) -> AcceptStats:
  """`stats` plus one verification step; rows with `active_B` False (idle slots) unchanged."""
  emitted_B, reached_Bk, accepted_Bk = step_counts(accepted_B, limit_B, stats.reached.shape[1])
  active_B = (jnp.ones(emitted_B.shape, jnp.int32) if active_B is None
              else jnp.asarray(active_B).astype(jnp.int32))
  return AcceptStats(stats.steps + active_B, stats.emitted + active_B * emitted_B,
                     stats.reached + active_B[:, None] * reached_Bk,
                     stats.accepted + active_B[:, None] * accepted_Bk)


def reset_rows(stats: AcceptStats, rows_B) -> AcceptStats:
  """Zero the counts of the rows where `rows_B` is True (a slot starting a new request)."""
  rows_B = jnp.asarray(rows_B, bool)
  return AcceptStats(*(jnp.where(rows_B.reshape(rows_B.shape + (1,) * (x.ndim - 1)), 0, x)
                       for x in stats))


def pooled(stats: AcceptStats) -> AcceptStats:
  """All requests' counts summed into one row `[1, ...]`."""
  return AcceptStats(*(jnp.sum(x, axis=0, keepdims=True) for x in stats))


def mean_accept_length(stats: AcceptStats):
  """fp32 `[B]`: emitted tokens per verification step (NaN before any step)."""
  steps_B = stats.steps.astype(jnp.float32)
  return jnp.where(stats.steps > 0, stats.emitted / jnp.maximum(steps_B, 1), jnp.nan)


def acceptance_rates(stats: AcceptStats):
  """fp32 `[B, k]`: accepted / reached per draft position (NaN where never reached)."""
  reached_Bk = stats.reached.astype(jnp.float32)
  return jnp.where(stats.reached > 0, stats.accepted / jnp.maximum(reached_Bk, 1), jnp.nan)


def stop_limit(tokens_BQ, num_emitted_B, budget_B, stop_tokens=()):
  """Tokens each request keeps at most from a step that emitted `tokens_BQ[:, :num_emitted]`.

  Args:
    tokens_BQ: int emitted tokens (entries past `num_emitted_B` are ignored).
    num_emitted_B: int tokens the step emitted.
    budget_B: int tokens the request may still generate (`max_new_tokens` - generated).
    stop_tokens: ids that end a request; the stop token itself is kept.
  Returns:
    int32 `[B]`: min(budget, position of the first emitted stop token + 1). The kept count is
    `min(num_emitted, limit)`; the request ends iff `limit <= num_emitted`.
  """
  q = tokens_BQ.shape[1]
  positions_BQ = jnp.arange(q, dtype=jnp.int32)[None, :]
  stop_BQ = jnp.isin(tokens_BQ, jnp.asarray(stop_tokens, jnp.int32).reshape(-1))
  stop_BQ &= positions_BQ < jnp.asarray(num_emitted_B)[:, None]
  first_stop_B = jnp.min(jnp.where(stop_BQ, positions_BQ, NO_LIMIT - 1), axis=-1) + 1
  return jnp.minimum(jnp.asarray(budget_B, jnp.int32), first_stop_B).astype(jnp.int32)
