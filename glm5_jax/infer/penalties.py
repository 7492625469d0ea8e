"""OpenAI's logit adjustments: `logit_bias`, `frequency_penalty` and `presence_penalty`.

For a slot with bias `b` (0 for tokens not in its `logit_bias`), penalties `f`, `p`, and `c_j`
the number of times token j is among the tokens its request generated so far (that choice's
own tokens, not the prompt's), the logits the sampler sees are

  z'_j = z_j + b_j - f * c_j - p * [c_j > 0]

(the formula of OpenAI's API docs, "Frequency and presence penalties": c_j counts the tokens
sampled before the current position), before temperature, top-k and top-p
(`glm5_jax.infer.sampling`), so greedy picks the argmax of `z'`. The log-probs reported with
the tokens are `log_softmax(z')` at temperature 1: the adjusted model's, as OpenAI's move
with `logit_bias` (which is how Carlini et al. 2024, "Stealing part of a production language
model", read hidden logits through the API) and do not move with temperature.

Per-slot state never makes a new program: every slot always has its arrays (`Penalties`, and
the counts `[B, Y]` int32 the decode step carries), and zeros mean off: `z + 0 - 0 * c - 0 * 1`
is `z` exactly (a -0.0 that may appear ties with +0.0 in the sampler). Counts are kept on the
device by the decode step itself (`count_fed`): the step that samples token n of a request
feeds its token n - 1, so it adds that token to the slot's row, and at n = 1 (the token fed
is the request's first) it zeroes the row first: a slot taking a new request starts from
zero with no extra program or transfer.

Notation (docs/design.md): B slots, Y vocab, M biased tokens per slot (`MAX_BIASED_TOKENS`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_BIASED_TOKENS = 300  # M: `logit_bias` entries per request (a fixed shape: one program)
PENALTY_BOUND = 2.0  # |frequency_penalty|, |presence_penalty| <= 2 (OpenAI's range)
BIAS_BOUND = 100.0  # |logit_bias value| <= 100 (OpenAI's range)


class Penalties(NamedTuple):
  """Per-slot adjustments: frequency, presence fp32 `[B]`; bias_ids int32 `[B, M]` and
  bias_values fp32 `[B, M]` (unused entries: id 0, value 0, which adds nothing)."""

  frequency: jax.Array
  presence: jax.Array
  bias_ids: jax.Array
  bias_values: jax.Array


def host_penalties(requests) -> Penalties:
  """Numpy `Penalties` of the slots' requests (None: an idle slot, all off). Each request has
  `frequency_penalty`, `presence_penalty` and `logit_bias`, a tuple of `(token id, bias)`."""
  b = len(requests)
  ids = np.zeros((b, MAX_BIASED_TOKENS), np.int32)
  values = np.zeros((b, MAX_BIASED_TOKENS), np.float32)
  for i, r in enumerate(requests):
    if r is not None and r.logit_bias:
      ids[i, :len(r.logit_bias)], values[i, :len(r.logit_bias)] = zip(*r.logit_bias)
  return Penalties(np.array([r.frequency_penalty if r else 0.0 for r in requests], np.float32),
                   np.array([r.presence_penalty if r else 0.0 for r in requests], np.float32),
                   ids, values)


def is_adjusted(request) -> bool:
  """Whether a request changes its logits at all (a bias or a non-zero penalty)."""
  return bool(request.logit_bias) or request.frequency_penalty != 0 or (
      request.presence_penalty != 0)


def adjust(logits_BY, penalties: Penalties, counts_BY=None):
  """`z'` of the module docstring, fp32 `[B, Y]`; `counts_BY` None: no token generated yet
  (the first token: the bias only)."""
  z_BY = logits_BY.astype(jnp.float32)
  rows_BM = jnp.arange(z_BY.shape[0], dtype=jnp.int32)[:, None]
  z_BY = z_BY.at[rows_BM, penalties.bias_ids].add(penalties.bias_values)
  if counts_BY is None:
    return z_BY
  seen_BY = (counts_BY > 0).astype(jnp.float32)
  return (z_BY - penalties.frequency[:, None] * counts_BY.astype(jnp.float32)
          - penalties.presence[:, None] * seen_BY)


def count_fed(counts_BY, fed_tokens_B, index_B, active_B):
  """The counts after the decode step that feeds `fed_tokens_B` (each active slot's token
  `index_B - 1`, its latest) and samples token `index_B`: a slot's row restarts at
  `index_B == 1` (its request's first token is being fed), then counts the fed token."""
  counts_BY = jnp.where((index_B == 1)[:, None], 0, counts_BY)
  rows_B = jnp.arange(counts_BY.shape[0], dtype=jnp.int32)
  return counts_BY.at[rows_B, fed_tokens_B].add(active_B.astype(counts_BY.dtype))
