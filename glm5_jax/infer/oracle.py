"""The exact greedy accept length of MTP speculative decoding, from one teacher-forced forward.

Setting: a request with prompt t_0 .. t_{P-1} that the engine generated greedily, output
t_P .. t_{L-1}. The engine emits t_P from the prefill (main logits at P-1), then runs
verification steps (`glm5_jax.infer.speculative`). A step whose last emitted token is t_m:

  draft d (d = 1..k) proposes t_{m+d}: the MTP chain at position m-1, depth d, fed h_{m-1}
    (the main model's final hidden state at m-1), then the tokens t_m, t^_{m+1}, .., t^_{m+d-1}
    (t^ = earlier drafts of this step);
  the step accepts a drafts and keeps min(a + 1, r) tokens, r = L - 1 - m the tokens still to
    come; the next step starts from m + that.

The teacher-forced forward (`glm5_jax.forward` over t_0 .. t_{L-1}, with `mtp_depths >= k`)
gives `mtp_logits[d-1][i]`, depth d at position i, which predicts t_{i+d+1} from the TRUE
tokens t_0 .. t_{i+d} (glm5_jax/mtp.py). At i = m-1 it is draft d's logits exactly when the
drafted tokens it reads, t^_{m+1} .. t^_{m+d-1}, are the true ones, i.e. when drafts 1..d-1
were accepted (greedy acceptance is equality with the greedy sequence, which IS the true
sequence). That is also the only case in which draft d's verdict matters: a draft after a
rejection is never tested. So every verdict the step uses is readable from one forward:

  draft d accepted  <=>  drafts 1..d-1 accepted  and  argmax mtp_logits[d-1][m-1] == t_{m+d},

for d <= min(k, r - 1) (the drafts that can change what is kept: `accept_stats`). Drafts past
a rejection would need logits of the chain fed with wrong tokens, which the forward does not
have; they are not needed. Argmax ties go to the lowest id, as in `sampling`.

What the oracle assumes of the engine: its depth-d draft logits equal the teacher-forced
forward's whenever the tokens they read are the true ones (the MTP cache is exact: the
"per_depth" scheme, which computes each depth as training does). The "shared" scheme (one MTP
cache with advancing positions, as vLLM and SGLang) computes different draft logits, and this
oracle does not describe it. Counting follows `accept_stats` (the prefill token is not a
step; a final step counts what was kept), so the engine's `AcceptStats` for the request must
equal `greedy_accept_oracle(...).stats` exactly.

Notation (docs/design.md): L sequence length (prompt + output), Y vocab, U MTP depths; k
(lowercase) draft steps.
"""

from typing import NamedTuple

import numpy as np

from glm5_jax.infer.accept_stats import AcceptStats, add_step, init_accept_stats


class OracleResult(NamedTuple):
  """accepted / limits: per verification step, drafts accepted (among those considered) and
  the tokens still to come (`accept_stats` limit r); emitted: tokens kept per step; stats: the
  request's `AcceptStats` (one row)."""

  accepted: list
  limits: list
  emitted: list
  stats: AcceptStats


def greedy_accept_oracle(tokens_L, prompt_len: int, logits_LY, mtp_logits_ULY,
                         k: int) -> OracleResult:
  """The accept lengths greedy MTP speculation with k draft steps gives (module docstring).

  Args:
    tokens_L: int, prompt + greedy output, L tokens.
    prompt_len: P >= 1; the output is tokens P .. L-1 (at least one).
    logits_LY: main logits of the teacher-forced forward over `tokens_L`.
    mtp_logits_ULY: its MTP logits, U >= k depths (the MTP layer is shared, so a forward with
      `mtp_depths = k` gives depths past the trained ones).
    k: draft steps.
  Raises:
    ValueError: on shapes that disagree, U < k, or an output token that is not the main
      logits' argmax (the sequence is not the greedy output of this forward).
  """
  tokens_L = np.asarray(tokens_L)
  logits_LY, mtp_logits_ULY = np.asarray(logits_LY), np.asarray(mtp_logits_ULY)
  length = tokens_L.shape[0]
  if tokens_L.ndim != 1 or logits_LY.shape[0] != length or mtp_logits_ULY.ndim != 3 or \
      mtp_logits_ULY.shape[1:] != logits_LY.shape:
    raise ValueError(f"tokens {tokens_L.shape}, logits {logits_LY.shape}, mtp_logits "
                     f"{mtp_logits_ULY.shape} must be [L], [L, Y], [U, L, Y]")
  if not 1 <= prompt_len < length:
    raise ValueError(f"prompt_len {prompt_len} must be in [1, L) = [1, {length}): the sequence "
                     "needs a prompt and at least one generated token")
  if k < 1 or mtp_logits_ULY.shape[0] < k:
    raise ValueError(f"k = {k} draft steps need 1 <= k <= U = {mtp_logits_ULY.shape[0]} MTP "
                     "depths; run the forward with model.mtp_depths >= k")
  greedy_L = _argmax(logits_LY)
  wrong = np.nonzero(greedy_L[prompt_len - 1:-1] != tokens_L[prompt_len:])[0]
  if wrong.size:
    i = prompt_len + int(wrong[0])
    raise ValueError(f"token {i} is {int(tokens_L[i])} but the main logits' argmax at position "
                     f"{i - 1} is {int(greedy_L[i - 1])}: the sequence is not this forward's "
                     "greedy output")
  drafts_UL = _argmax(mtp_logits_ULY)

  accepted, limits, emitted = [], [], []
  stats = init_accept_stats(1, k)
  m = prompt_len  # the last emitted token; the prefill emitted t_P
  while m < length - 1:
    r = length - 1 - m
    a = 0
    while a < min(k, r - 1) and drafts_UL[a, m - 1] == tokens_L[m + a + 1]:
      a += 1
    stats = add_step(stats, np.array([a]), np.array([r]))
    accepted.append(a)
    limits.append(r)
    emitted.append(min(a + 1, r))
    m += emitted[-1]
  return OracleResult(accepted, limits, emitted, stats)


def _argmax(logits):
  """First maximum over the last axis (+0.0 and -0.0 tie), as `sampling`."""
  return np.argmax(np.where(logits == 0, 0.0, logits), axis=-1)
