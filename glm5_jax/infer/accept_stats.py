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

The counts are host (numpy) bookkeeping: the engine updates them once per request per
verification step, and as eager jax ops each update was a dozen device dispatches and a
transfer, which at 32 slots made MTP decoding 14x slower than plain decoding on an H200
(docs/device_runs/2026-12-04-h200.md). jax arrays are accepted as input.

Notation (docs/design.md): B slots (requests), Q tokens per step; k (lowercase) draft steps.
"""

from typing import NamedTuple

import numpy as np

NO_LIMIT = 2**30  # a limit larger than any step's emission


class AcceptStats(NamedTuple):
  """Counts per request: steps `[B]`, emitted `[B]`, reached `[B, k]`, accepted `[B, k]` (all
  int32; draft position d is column d - 1)."""

  steps: np.ndarray
  emitted: np.ndarray
  reached: np.ndarray
  accepted: np.ndarray


def init_accept_stats(batch: int, k: int) -> AcceptStats:
  zeros_B = np.zeros((batch,), np.int32)
  zeros_Bk = np.zeros((batch, k), np.int32)
  return AcceptStats(zeros_B, zeros_B, zeros_Bk, zeros_Bk)


def step_counts(accepted_B, limit_B, k: int):
  """One verification step's counts (module docstring).

  Args:
    accepted_B: int drafts accepted, 0..k.
    limit_B: int tokens the request can keep from this step (`stop_limit`; NO_LIMIT if none).
  Returns:
    `(emitted_B, reached_Bk, accepted_Bk)`, int32.
  """
  accepted_B = np.asarray(accepted_B, np.int32)
  limit_B = np.asarray(limit_B, np.int32)
  d_k = np.arange(1, k + 1, dtype=np.int32)
  considered_Bk = d_k <= limit_B[:, None] - 1
  reached_Bk = considered_Bk & (accepted_B[:, None] >= d_k - 1)
  accepted_Bk = considered_Bk & (accepted_B[:, None] >= d_k)
  return (np.minimum(accepted_B + 1, limit_B), reached_Bk.astype(np.int32),
          accepted_Bk.astype(np.int32))


def add_step(stats: AcceptStats, accepted_B, limit_B, active_B=None) -> AcceptStats:
  """`stats` plus one verification step; rows with `active_B` False (idle slots) unchanged."""
  emitted_B, reached_Bk, accepted_Bk = step_counts(accepted_B, limit_B, stats.reached.shape[1])
  active_B = (np.ones(emitted_B.shape, np.int32) if active_B is None
              else np.asarray(active_B).astype(np.int32))
  return AcceptStats(stats.steps + active_B, stats.emitted + active_B * emitted_B,
                     stats.reached + active_B[:, None] * reached_Bk,
                     stats.accepted + active_B[:, None] * accepted_Bk)


def reset_rows(stats: AcceptStats, rows_B) -> AcceptStats:
  """Zero the counts of the rows where `rows_B` is True (a slot starting a new request)."""
  rows_B = np.asarray(rows_B, bool)
  return AcceptStats(*(np.where(rows_B.reshape(rows_B.shape + (1,) * (x.ndim - 1)), 0, x)
                       for x in stats))


def pooled(stats: AcceptStats) -> AcceptStats:
  """All requests' counts summed into one row `[1, ...]`."""
  return AcceptStats(*(np.sum(x, axis=0, keepdims=True, dtype=x.dtype) for x in stats))


def mean_accept_length(stats: AcceptStats):
  """fp32 `[B]`: emitted tokens per verification step (NaN before any step)."""
  steps_B = stats.steps.astype(np.float32)
  return np.where(stats.steps > 0, stats.emitted.astype(np.float32) / np.maximum(steps_B, 1), np.nan)


def acceptance_rates(stats: AcceptStats):
  """fp32 `[B, k]`: accepted / reached per draft position (NaN where never reached)."""
  reached_Bk = stats.reached.astype(np.float32)
  return np.where(stats.reached > 0, stats.accepted.astype(np.float32) / np.maximum(reached_Bk, 1), np.nan)


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
  positions_BQ = np.arange(q, dtype=np.int32)[None, :]
  stop_BQ = np.isin(tokens_BQ, np.asarray(stop_tokens, np.int32).reshape(-1))
  stop_BQ &= positions_BQ < np.asarray(num_emitted_B)[:, None]
  first_stop_B = np.min(np.where(stop_BQ, positions_BQ, NO_LIMIT - 1), axis=-1) + 1
  return np.minimum(np.asarray(budget_B, np.int32), first_stop_B).astype(np.int32)
