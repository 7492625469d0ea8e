"""Requests and results (the engine's `Completion` and `Event`, `infer.generate`'s
`GenerateResult`), and the validation of `generate`'s arguments.

Every argument is checked once, on the host, before anything is traced: under jit a bad token
id cannot be refused (the model only marks it with NaN logits), so bad input must never get
that far. Each error is a `ValueError` that names the argument, the prompt (by index) and the
offending value.
"""

import dataclasses
import math
import numbers
from typing import Hashable, Optional, Sequence

import numpy as np

from glm5_jax.infer.accept_stats import AcceptStats, acceptance_rates, mean_accept_length
from glm5_jax.infer.penalties import BIAS_BOUND, MAX_BIASED_TOKENS, PENALTY_BOUND

SEED_BOUND = 2**32  # seeds are uint32 (`sampling.token_keys`)


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt to complete, with its own settings (the engine gives each request a slot).

  Attributes:
    index: the prompt's position in the `prompts` list (its place in the result).
    prompt: token ids, non-empty, each in [0, vocab_size).
    max_new_tokens: >= 1.
    temperature: >= 0, finite (0 = greedy).
    top_p: in (0, 1] (1 = off).
    top_k: >= 0 (0 = off).
    seed: in [0, 2**32); token n of the request draws from (seed, n) only.
    stop_tokens: ids that end the request (the stop token is kept in the output).
    session: None, or a hashable id: the engine keeps the slot's cache when the request ends,
      and a later request of the same session whose prompt extends this one's sequence
      prefills only the new tokens (`glm5_jax.infer.sessions`). The prompt is still the whole
      context, so an evicted session costs a full prefill, never a wrong answer.
    frequency_penalty, presence_penalty: in [-2, 2] (0 = off), OpenAI's penalties on the tokens
      this request generated so far (`glm5_jax.infer.penalties`).
    logit_bias: `(token id, bias)` pairs, distinct ids, each bias in [-100, 100], at most
      `penalties.MAX_BIASED_TOKENS` (an engine's `submit` checks the ids against its vocab).
  """

  index: int
  prompt: tuple
  max_new_tokens: int
  temperature: float
  top_p: float
  top_k: int
  seed: int
  stop_tokens: tuple = ()
  session: Hashable | None = None
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  logit_bias: tuple = ()

  def __post_init__(self):
    """Refuses settings outside the ranges above, naming the field (an engine's `submit` checks
    the prompt against its vocab and lengths)."""
    where = f"Request {self.index}"
    _integer(f"{where}: max_new_tokens", self.max_new_tokens, low=1)
    if _real(f"{where}: temperature", self.temperature) < 0:
      raise ValueError(f"{where}: temperature must be >= 0 (0 = greedy); got {self.temperature}")
    if not 0 < _real(f"{where}: top_p", self.top_p) <= 1:
      raise ValueError(f"{where}: top_p must be in (0, 1]; got {self.top_p} (1 = off)")
    _integer(f"{where}: top_k", self.top_k, low=0)
    if not 0 <= _integer(f"{where}: seed", self.seed, low=0) < SEED_BOUND:
      raise ValueError(f"{where}: seed must be in [0, 2**32); got {self.seed}")
    if not isinstance(self.prompt, tuple) or not self.prompt:
      raise ValueError(f"{where}: prompt must be a non-empty tuple of token ids; got "
                       f"{self.prompt!r:.80}")
    for name in ("frequency_penalty", "presence_penalty"):
      value = _real(f"{where}: {name}", getattr(self, name))
      if abs(value) > PENALTY_BOUND:
        raise ValueError(f"{where}: {name} must be in [-2, 2] (0 = off); got {value}")
    _logit_bias(f"{where}: logit_bias", self.logit_bias)


@dataclasses.dataclass
class GenerateResult:
  """What `infer.generate` returns; lists are indexed like `prompts`.

  tokens: generated ids per prompt (the stop token included when one ended it).
  logprobs: per token, the log-prob under the sampling distribution (0.0 for greedy).
  raw_logprobs: per token, the log-prob under the model at temperature 1.
  logits: per prompt, fp32 `[n_generated, vocab]` raw logits, when `return_logits`; else None.
  accept_lengths: per prompt, mean tokens per verification step (bonus included), when
    `speculative_steps > 0`; else None.
  acceptance_rates: per prompt, per draft position d, accepted / reached
    (`glm5_jax.infer.accept_stats`), when `speculative_steps > 0`; else None.
  """

  tokens: list
  logprobs: list
  raw_logprobs: list
  logits: Optional[list] = None
  accept_lengths: Optional[list] = None
  acceptance_rates: Optional[list] = None


@dataclasses.dataclass
class Completion:
  """One request the engine ran (`Engine.run`, `Event.completion`): its generated tokens with
  what the engine keeps of each, in the order they were sampled.

  `routing` (engine with `record_routing`): `{"moe": int32 [n, N_moe, X], "dsa": int32
  [n, N_dsa, T]}` over the n = len(prompt) + len(tokens) tokens of `sequence`
  (`glm5_jax.routing_replay`; DSA keys are positions). The last generated token was never fed
  to the model: its row is -1 (not recorded)."""

  request: Request
  tokens: list  # generated ids (the stop token included when one ended it)
  logprobs: list  # per token, the log-prob under the sampling distribution
  raw_logprobs: list  # per token, under the raw model (temperature 1, after the adjustments)
  logits: list | None = None  # engine with return_logits: per token its raw logits [Y]
  accept: AcceptStats | None = None  # speculative decoding: `glm5_jax.infer.accept_stats`
  routing: dict | None = None  # engine with record_routing (above)
  top_logprobs: list | None = None  # engine with top_logprobs N: per token (ids [N], raw [N])
  handle: int = -1  # `Engine.submit`'s handle

  @property
  def sequence(self) -> list:
    return list(self.request.prompt) + self.tokens

  @property
  def finish_reason(self) -> str:
    """"stop" (a stop token ended it) or "length" (max_new_tokens)."""
    return "stop" if self.tokens and self.tokens[-1] in self.request.stop_tokens else "length"

  def accept_length(self) -> float:
    """Tokens kept per verification step, the bonus token included (NaN without a step)."""
    return float(mean_accept_length(self.accept)[0])

  def acceptance_rates(self) -> list:
    """Per draft position d: accepted / reached (NaN where never reached)."""
    return [float(x) for x in acceptance_rates(self.accept)[0]]


@dataclasses.dataclass
class Event:
  """What one `Engine.step` produced for one submitted request: its new tokens (a request
  admitted in this step gets its first token and, from the step's decode, its second), their
  log-probs (sampling distribution and raw), with `top_logprobs` the raw top-N alternatives
  per token, and `completion` on the step that finished it (else None)."""

  handle: int
  tokens: list
  logprobs: list
  raw_logprobs: list
  top_logprobs: list | None = None
  completion: Completion | None = None


def validate_generate_args(prompts, *, vocab_size: int, max_len: int,
                           max_positions: int | None = None, max_new_tokens=32,
                           temperature=0.0, top_p=1.0, top_k=0, seed=0, speculative_steps=0,
                           return_logits=False, stop_tokens: Sequence[int] = ()) -> list:
  """Checks `infer.generate`'s arguments and returns one `Request` per prompt.

  Args:
    prompts: a list of prompts, each a non-empty sequence (or 1-D integer array) of token ids.
    vocab_size: the model's vocabulary size Y; ids must be in [0, Y).
    max_len: the cache's positions per slot. A prompt may not be longer, and a request needs
      `len(prompt) + max_new_tokens - 1 + speculative_steps` positions (every token but the last
      generated one is fed to the model; a verification step feeds k drafts past it).
    max_positions: the model's `max_position_embeddings` (None: unchecked); a request's
      `len(prompt) + max_new_tokens - 1` fed positions may not exceed it.
    the rest: as `infer.generate` (see `Request` for the accepted ranges).
  Raises:
    ValueError: naming the argument, the prompt index and the value.
  """
  max_new_tokens = _integer("max_new_tokens", max_new_tokens, low=1)
  temperature = _real("temperature", temperature)
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0 (0 = greedy); got {temperature}")
  top_p = _real("top_p", top_p)
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1]; got {top_p} (1 = off)")
  top_k = _integer("top_k", top_k, low=0)
  seed = _integer("seed", seed, low=0)
  if seed >= SEED_BOUND:
    raise ValueError(f"seed must be in [0, 2**32); got {seed}")
  speculative_steps = _integer("speculative_steps", speculative_steps, low=0)
  if not isinstance(return_logits, (bool, np.bool_)):
    raise ValueError(f"return_logits must be a bool; got {return_logits!r}")
  stop_tokens = _token_ids("stop_tokens", stop_tokens, vocab_size, allow_empty=True)

  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
    raise ValueError(f"prompts must be a list of token-id lists; got {type(prompts).__name__}")
  if len(prompts) == 0:
    raise ValueError("prompts is empty: expected at least one prompt")
  requests = []
  for i, prompt in enumerate(prompts):
    ids = _token_ids(f"prompts[{i}]", prompt, vocab_size, allow_empty=False)
    if len(ids) > max_len:
      raise ValueError(f"prompts[{i}] has {len(ids)} tokens, longer than max_len = {max_len}")
    needed = len(ids) + max_new_tokens - 1 + speculative_steps
    if needed > max_len:
      raise ValueError(
          f"prompts[{i}]: {len(ids)} prompt tokens + max_new_tokens {max_new_tokens} - 1 + "
          f"speculative_steps {speculative_steps} = {needed} cache positions, more than "
          f"max_len = {max_len}")
    if max_positions is not None and len(ids) + max_new_tokens - 1 > max_positions:
      raise ValueError(
          f"prompts[{i}]: {len(ids)} prompt tokens + max_new_tokens {max_new_tokens} - 1 = "
          f"{len(ids) + max_new_tokens - 1} positions, more than the model's "
          f"max_position_embeddings = {max_positions}")
    requests.append(Request(i, ids, max_new_tokens, temperature, top_p, top_k, seed,
                            stop_tokens))
  return requests


def _is_int(value):
  return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value,
                                                                               (bool, np.bool_))


def _integer(name, value, *, low):
  if not _is_int(value):
    raise ValueError(f"{name} must be an int; got {value!r} ({type(value).__name__})")
  if value < low:
    raise ValueError(f"{name} must be >= {low}; got {value}")
  return int(value)


def _real(name, value):
  if not isinstance(value, (numbers.Real, np.floating, np.integer)) or isinstance(
      value, (bool, np.bool_)) or not math.isfinite(value):
    raise ValueError(f"{name} must be a finite number; got {value!r}")
  return float(value)


def _logit_bias(name, pairs) -> None:
  """`pairs` must be a tuple of `(int id >= 0, finite bias in [-100, 100])`, distinct ids."""
  if not isinstance(pairs, tuple) or len(pairs) > MAX_BIASED_TOKENS:
    raise ValueError(f"{name} must be a tuple of at most {MAX_BIASED_TOKENS} (token id, bias) "
                     f"pairs; got {pairs!r:.80}")
  for pair in pairs:
    if not (isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0):
      raise ValueError(f"{name}: {pair!r:.40} is not a (token id >= 0, bias) pair")
    if abs(_real(f"{name}[{pair[0]}]", pair[1])) > BIAS_BOUND:
      raise ValueError(f"{name}[{pair[0]}] = {pair[1]} is outside [-100, 100]")
  if len({p[0] for p in pairs}) != len(pairs):
    raise ValueError(f"{name} names a token id twice")


def _token_ids(name, ids, vocab_size, *, allow_empty):
  """`ids` as a tuple of ints in [0, vocab_size), or a ValueError naming `name`."""
  if isinstance(ids, np.ndarray):
    if ids.ndim != 1:
      raise ValueError(f"{name} must be a 1-D sequence of token ids; got an array of shape "
                       f"{ids.shape}")
    ids = ids.tolist() if np.issubdtype(ids.dtype, np.integer) else list(ids)
  if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
    raise ValueError(f"{name} must be a sequence of int token ids; got {type(ids).__name__}")
  if not ids and not allow_empty:
    raise ValueError(f"{name} is empty: a prompt needs at least one token")
  for j, token in enumerate(ids):
    if not _is_int(token):
      raise ValueError(f"{name}[{j}] = {token!r} ({type(token).__name__}) is not an int "
                       "token id")
    if token < 0:
      raise ValueError(f"{name}[{j}] = {token} is negative; token ids are in [0, {vocab_size})")
    if token >= vocab_size:
      raise ValueError(f"{name}[{j}] = {token} is >= the vocab size {vocab_size}")
  return tuple(int(t) for t in ids)
