"""MTP speculative decoding: one jitted step drafts k tokens with the shared MTP layer, verifies
them in one main-model call and accepts them exactly; and the MTP caches' prefill.

A slot's state at a step (positions are cache rows): F positions are in the main cache, the
last emitted token x = t_F is pending (not yet fed), and `hidden_BWD` holds the main model's
final hidden states h_i at the W = 2k + 1 positions i = F-W .. F-1 (`window_size`).

  draft   depth d (1..k) at position F-1 proposes t_{F+d} from h^{d-1}_{F-1} and t_{F+d-1}
          (x for d = 1, else draft d-1); drafts are sampled from the MTP logits under the
          slot's settings (`sampling.sample`, stream DRAFT: argmax when greedy).
  verify  one `decode_step` over [x, draft_1 .. draft_k] at positions F .. F+k.
  accept  `speculative.verify`: exact greedy match at temperature 0, rejection sampling
          (Leviathan et al. 2023) otherwise, so every emitted token has exactly the model's
          sampling distribution. a drafts accepted: the step emits a + 1 tokens and F grows by
          a + 1. Main-cache rows F+a+1 .. F+k hold rejected drafts; rows are positions and a
          query at p reads rows <= p, so they are never read and the next step overwrites them
          (the DSA indexer's key rows likewise; SWA rings are sized for them). Recurrent kinds
          (N, L) take back the rejected tokens from their per-token states
          (`rollback.rollback_cache`); an MTP layer of such a kind is refused
          (`check_speculative_config`): its window re-feeds positions.

MTP caches (`glm5_jax.infer.cache`, `mtp_cache`):
  "per_depth"  k caches. Each step runs depth d over the WINDOW of positions F-W .. F-1 (not
               only F-1), teacher-forced where tokens are known (t_{i+d} for i + d <= F) and
               fed the drafts past that. Rows whose tokens are known are rewritten with the
               same values a teacher-forced forward gives; rows that read drafts hold what this
               step's chain computed. W = 2k + 1 is the least width for which every row is
               written by some window (F grows by at most k + 1 per step) and leaves the window
               only once F >= i + k, i.e. with every depth's token known. So whenever the
               drafts a depth reads were accepted, its logits equal the teacher-forced
               forward's `mtp_logits`: the greedy accept lengths equal
               `oracle.greedy_accept_oracle` exactly (tests/test_speculate.py).
  "shared"     one cache, as vLLM and SGLang: depth 1 runs over the window (rows F-W .. F-1,
               depth-1 semantics: (h_i, t_{i+1})), and depth d >= 2 runs at the single
               position F+d-2 (advancing positions), reading the depth-1 rows before it.
               Cheaper (one cache, one window), not how depths >= 2 were trained.

Prefill (`prefill_mtp`): after the main model's chunk, each depth runs teacher-forced over the
chunk's positions i with t_{i+d} inside the prompt, so the MTP caches hold every prompt row the
first window does not rewrite.

Notation (docs/design.md): B slots, Q = k + 1 verified tokens, W = 2k + 1 window positions,
C prefill chunk, D hidden, Y vocab; k (lowercase) draft steps.
"""

import typing

import jax
import jax.numpy as jnp

from glm5_jax.attention.kinds import layer_kind
from glm5_jax.config import ModelConfig
from glm5_jax.infer import sampling, speculative
from glm5_jax.infer.cache import MTP_CACHE_SCHEMES
from glm5_jax.infer.rollback import rollback_cache
from glm5_jax.infer.step import decode_step, mtp_step


class SpecOutput(typing.NamedTuple):
  """One speculative step.

  verified: `speculative.Verified` (accepted, num_emitted, tokens `[B, Q]`, log-probs).
  hidden_BWD: h at the W positions before each slot's new pending token.
  logits_BQY: fp32 raw target logits of the verified rows (row j produced emitted token j).
  cache: the updated cache tree.
  """

  verified: speculative.Verified
  hidden_BWD: jax.Array
  logits_BQY: jax.Array
  cache: dict


def check_speculative_config(cfg: ModelConfig, k: int, mtp_cache: str) -> None:
  """ValueError unless `cfg` can decode speculatively with k draft steps."""
  if not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ValueError(f"speculative_steps must be an int >= 1, got {k!r}")
  if not cfg.num_nextn_predict_layers:
    raise ValueError("speculative decoding drafts with the MTP layer; this model has none "
                     "(model.num_nextn_predict_layers = 0)")
  if mtp_cache not in MTP_CACHE_SCHEMES:
    raise ValueError(f"mtp_cache must be one of {MTP_CACHE_SCHEMES}, got {mtp_cache!r}")
  mtp_kind = layer_kind(cfg.attention_pattern, cfg.num_hidden_layers)
  if mtp_kind.decode_steps:
    raise ValueError(
        f"speculative decoding: the MTP layer runs the recurrent kind {mtp_kind.letter} "
        f"({mtp_kind.name}, after the last layer's {cfg.attention_pattern[-1]!r}); its drafting "
        "window re-feeds positions, which a recurrent state cannot take back. Use a pattern "
        "whose last layer is not N / L, or speculative_steps=0")


def window_size(k: int) -> int:
  """W: the MTP window's positions per step for k draft steps (module docstring)."""
  return 2 * k + 1


def _window(fed_B, w: int):
  """Positions F-W .. F-1 `[B, W]` (clipped at 0) and which of them exist."""
  positions_BW = fed_B[:, None] - w + jnp.arange(w, dtype=jnp.int32)
  return jnp.maximum(positions_BW, 0), positions_BW >= 0


def speculative_step(cfg: ModelConfig, params, cache, hidden_BWD, window_BX, fed_B, active_B,
                     settings: sampling.SamplingParams, seeds_B, index_B, *, k: int,
                     mtp_cache: str) -> SpecOutput:
  """Draft, verify and accept for every slot (module docstring). Trace it under jit.

  Args:
    hidden_BWD: h at positions F-W .. F-1 (anything where the position is < 0).
    window_BX: int32 tokens at positions F-W .. F, X = W + 1 (the last is the pending x;
      anything where the position is < 0).
    fed_B: int32 F. active_B: bool, slots with a request (others change nothing).
    settings, seeds_B: per-slot sampling settings and request seeds.
    index_B: int32 token index, within its request, of the first token this step emits.
  """
  w = window_size(k)
  if hidden_BWD.shape[1] != w or window_BX.shape[1] != w + 1:
    raise ValueError(f"speculative_step: k={k} needs hidden [B, {w}, D] and window tokens "
                     f"[B, {w + 1}], got {hidden_BWD.shape} and {window_BX.shape}")
  positions_BW, exists_BW = _window(fed_B, w)
  real_BW = (exists_BW & active_B[:, None]).astype(jnp.int32)
  active_B1 = active_B[:, None].astype(jnp.int32)
  # Tokens at positions F-W .. F+k: the window, then the drafts as they are made.
  tokens_BX = jnp.concatenate([window_BX, jnp.zeros((window_BX.shape[0], k), jnp.int32)], 1)
  h_BWD = hidden_BWD
  drafts, draft_logits = [], []
  for d in range(1, k + 1):
    if mtp_cache == "per_depth" or d == 1:
      # Depth d over the window: position i reads t_{i+d}.
      out = mtp_step(cfg, params, cache, h_BWD, tokens_BX[:, d:d + w], positions_BW, real_BW,
                     d, mtp_cache=mtp_cache)
    else:  # "shared": one position, F + d - 2, after the depth-1 window's rows
      out = mtp_step(cfg, params, cache, h_BWD[:, -1:], tokens_BX[:, w + d - 1:w + d],
                     fed_B[:, None] + d - 2, active_B1, d, mtp_cache=mtp_cache)
    cache, h_BWD = out.cache, out.hidden_BQD
    logits_BY = out.logits_BQY[:, -1]  # at position F-1 (or F+d-2): predicts t_{F+d}
    draft_B = sampling.sample(logits_BY, settings, seeds_B, index_B + d - 1,
                              stream=sampling.DRAFT).tokens
    tokens_BX = tokens_BX.at[:, w + d].set(draft_B)
    drafts.append(draft_B)
    draft_logits.append(logits_BY)
  drafts_Bk = jnp.stack(drafts, axis=1)

  verify_BQ = tokens_BX[:, w:]
  positions_BQ = fed_B[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
  out = decode_step(cfg, params, cache, verify_BQ, positions_BQ,
                    jnp.broadcast_to(active_B1, verify_BQ.shape))
  verified = speculative.verify(drafts_Bk, jnp.stack(draft_logits, axis=1), out.logits_BQY,
                                settings, seeds_B, index_B)
  # Recurrent states (N, L) keep only the tokens that stand: x and the accepted drafts.
  new_cache = rollback_cache(cfg, cache, out.cache, out.cache_steps, verified.accepted + 1)
  # The new window ends at F + a: h at F-W .. F-1 then the verified rows F .. F+k.
  all_hidden = jnp.concatenate([hidden_BWD.astype(out.hidden_BQD.dtype), out.hidden_BQD], 1)
  take_BW = verified.accepted[:, None] + 1 + jnp.arange(w, dtype=jnp.int32)
  hidden_BWD = jnp.take_along_axis(all_hidden, take_BW[..., None], axis=1)
  return SpecOutput(verified, hidden_BWD, out.logits_BQY, new_cache)


def prefill_mtp(cfg: ModelConfig, params, cache, hidden_PCD, tokens_PX, positions_PC,
                lengths_P, *, depths: int, mtp_cache: str):
  """The MTP caches' rows for one prefill chunk (module docstring).

  Args:
    hidden_PCD: the main model's h at the chunk's positions.
    tokens_PX: int32 prompt tokens from the chunk's first position on, at least C + depths of
      them (zeros past each prompt).
    positions_PC: int32 the chunk's positions. lengths_P: prompt lengths (0: padding row).
    depths: k under "per_depth"; "shared" fills its one cache with depth 1.
  Returns:
    The cache.
  """
  c = positions_PC.shape[1]
  h_PCD = hidden_PCD
  for d in range(1, (depths if mtp_cache == "per_depth" else 1) + 1):
    known_PC = (positions_PC + d < lengths_P[:, None]).astype(jnp.int32)
    out = mtp_step(cfg, params, cache, h_PCD, tokens_PX[:, d:d + c], positions_PC, known_PC, d,
                   mtp_cache=mtp_cache)
    cache, h_PCD = out.cache, out.hidden_BQD
  return cache
