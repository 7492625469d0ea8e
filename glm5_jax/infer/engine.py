"""The slot engine: continuous batching and prefix sharing over the cached steps.

A fixed number of slots B share one preallocated cache (`glm5_jax.infer.cache`). The host
loop keeps a queue of requests and, each iteration:

  1. admits waiting requests into free slots. Requests admitted together that share a prompt
     (an RL group: one prompt sampled G times) are prefilled once, in the first of their slots,
     and that slot's cache is copied into the others (`_copy_slots`). Prefill runs in chunks of
     `prefill_chunk` tokens over the admitted slots only (their caches are gathered out of the
     whole cache, stepped, and scattered back), padded to a power-of-two number of rows so
     admission compiles at most log2(B) + 1 programs whatever the traffic;
  2. samples each admitted request's first token from its prompt's last logits;
  3. runs one decode step over all B slots (idle slots are padding, `segment_ids` 0, and change
     nothing), samples one token per slot, and frees the slots whose request ended (a stop token,
     kept in the output, or `max_new_tokens`). A freed slot takes the next request in the next
     iteration with no recompile: every shape is fixed by B, max_len and the chunk.

Randomness: token n of a request draws from (its seed, n) only (`glm5_jax.infer.sampling`), so a
request's tokens do not depend on its slot, on its neighbours, or on when it was admitted:
continuous batching gives exactly the tokens of generating each request alone.

Every generated token comes with its log-prob under the sampling distribution and under the
raw model (temperature 1), from the logits that produced it (token-in-token-out: RL trains on
these ids and log-probs, never on re-tokenized text).

Notation (docs/design.md): B slots, P admitted rows (a power of two <= B), C prefill chunk,
Q tokens per slot in one call, Y vocab, D hidden.
"""

import collections
import contextlib
import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import sharding as sharding_lib
from glm5_jax.api import abstract_params_and_axes
from glm5_jax.config import ModelConfig
from glm5_jax.infer import sampling
from glm5_jax.infer.cache import cache_specs, init_cache
from glm5_jax.infer.cache_spec import CacheSpec
from glm5_jax.infer.requests import GenerateResult, Request, validate_generate_args
from glm5_jax.infer.step import decode_step
from glm5_jax.layers.axes import BATCH


@dataclasses.dataclass
class Completion:
  """One finished request: generated ids, their log-probs (sampling distribution and raw), and
  the raw logits `[n, Y]` that produced them when the engine keeps logits."""

  request: Request
  tokens: list
  logprobs: list
  raw_logprobs: list
  logits: list | None = None


def request_seed(seed: int, index: int) -> int:
  """The uint32 seed of prompt `index` of a `generate` call with `seed`: a hash of both, so the
  G copies of one prompt in an RL group draw differently, and a call's streams do not overlap
  another seed's (as `seed + index` would)."""
  digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=4).digest()
  return int.from_bytes(digest, "little")


class Engine:
  """Continuous batching over `slots` sequences of up to `max_len` positions.

  Args:
    config: the model section or a `ModelConfig`.
    params: the model's params (layout matching `model.scan_layers`), placed as the caller
      wants; with `mesh`, `Engine` shards them by the logical-axis rules.
    slots: B, sequences decoded at once.
    max_len: cache positions per slot: a request needs `len(prompt) + max_new_tokens - 1`.
    prefill_chunk: C, prompt tokens per slot per prefill call.
    return_logits: keep each generated token's raw logits (`[Y]` per token, copied to host).
    mesh, rules: serve sharded: params and cache placed by `mesh.logical_axis_rules` (the
      cache's slots split over the batch axes, so B must divide by them).
  """

  def __init__(self, config, params, *, slots: int, max_len: int, prefill_chunk: int = 256,
               return_logits: bool = False, mesh=None, rules=None):
    self.cfg = ModelConfig.from_config(config)
    for name, value in (("slots", slots), ("max_len", max_len), ("prefill_chunk", prefill_chunk)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Engine: {name} must be an int >= 1, got {value!r}")
    if (mesh is None) != (rules is None):
      raise ValueError("Engine: give both mesh and rules, or neither")
    self.slots, self.max_len, self.return_logits = slots, max_len, return_logits
    self.chunk = min(prefill_chunk, max_len)
    self.mesh, self.rules = mesh, rules
    specs = cache_specs(self.cfg, slots, max_len, mtp_cache="shared", mtp_depths=0)
    # The slots axis of every cache array: gathered and scattered when admitting requests.
    self._slot_axes = tuple(s.axes.index(BATCH) for s in jax.tree.leaves(
        specs, is_leaf=lambda x: isinstance(x, CacheSpec)))
    if mesh is not None:
      shapes, logical = abstract_params_and_axes(self.cfg)
      params = jax.device_put(params, sharding_lib.param_shardings(shapes, logical, mesh, rules))
    self.params = params
    self.cache = init_cache(self.cfg, slots, max_len, mtp_depths=0, mesh=mesh, rules=rules)

  def _context(self):
    if self.mesh is None:
      return contextlib.nullcontext()
    return sharding_lib.activation_sharding(self.mesh, self.rules)

  # ---- the host loop -------------------------------------------------------------------------

  def run(self, requests) -> list[Completion]:
    """Generates every request (in any order of completion); returns them in input order."""
    requests = list(requests)
    for r in requests:
      if len(r.prompt) + r.max_new_tokens - 1 > self.max_len:
        raise ValueError(f"request {r.index}: {len(r.prompt)} prompt tokens + max_new_tokens "
                         f"{r.max_new_tokens} - 1 exceed the engine's max_len {self.max_len}")
    queue = collections.deque(requests)
    done: dict[int, Completion] = {}
    slot_of: list[Completion | None] = [None] * self.slots
    fed = np.zeros(self.slots, np.int32)  # positions in each slot's cache
    pending = np.zeros(self.slots, np.int32)  # each slot's last token, not yet fed
    with self._context():
      while queue or any(c is not None for c in slot_of):
        free = [s for s in range(self.slots) if slot_of[s] is None]
        admitted = [(s, queue.popleft()) for s in free[:len(queue)]]
        if admitted:
          first = self._admit(admitted)
          for (slot, request), token in zip(admitted, first):
            completion = Completion(request, [], [], [], [] if self.return_logits else None)
            slot_of[slot], fed[slot] = completion, len(request.prompt)
            pending[slot] = self._append(completion, token)
            if self._finished(completion):
              done[id(request)], slot_of[slot] = completion, None
        if not any(c is not None for c in slot_of):
          continue
        active = np.array([c is not None for c in slot_of])
        out = self._decode(pending, fed, active, slot_of)
        for slot in np.flatnonzero(active):
          completion = slot_of[slot]
          fed[slot] += 1
          pending[slot] = self._append(completion, _row(out, slot))
          if self._finished(completion):
            done[id(completion.request)], slot_of[slot] = completion, None
    return [done[id(r)] for r in requests]

  @staticmethod
  def _append(completion: Completion, token) -> int:
    tok, logprob, raw, logits = token
    completion.tokens.append(int(tok))
    completion.logprobs.append(float(logprob))
    completion.raw_logprobs.append(float(raw))
    if completion.logits is not None:
      completion.logits.append(np.asarray(logits, np.float32))
    return int(tok)

  @staticmethod
  def _finished(completion: Completion) -> bool:
    r = completion.request
    return (len(completion.tokens) >= r.max_new_tokens
            or completion.tokens[-1] in r.stop_tokens)

  # ---- admission: grouped, chunked prefill ---------------------------------------------------

  def _admit(self, admitted):
    """Prefills the admitted requests (one prefill per distinct prompt, copied to the group)
    and samples their first tokens. Returns `(token, logprob, raw_logprob, logits)` per
    request."""
    leaders: dict[tuple, int] = {}  # prompt -> slot holding its prefill
    copies = []  # (source slot, destination slot)
    for slot, request in admitted:
      if request.prompt in leaders:
        copies.append((leaders[request.prompt], slot))
      else:
        leaders[request.prompt] = slot
    prompts = list(leaders)
    rows = _bucket(len(prompts), self.slots)
    # Rows past the prompts use slot id B: gathered as zeros, their scatter dropped.
    slot_ids = np.full(rows, self.slots, np.int32)
    slot_ids[:len(prompts)] = [leaders[p] for p in prompts]
    lengths = np.zeros(rows, np.int32)
    lengths[:len(prompts)] = [len(p) for p in prompts]
    tokens = np.zeros((rows, _round_up(int(lengths.max()), self.chunk)), np.int32)
    for i, p in enumerate(prompts):
      tokens[i, :len(p)] = p
    sub = _gather_slots(self.cache, jnp.asarray(slot_ids), self._slot_axes)
    last_PY = jnp.zeros((rows, self.cfg.vocab_size), jnp.float32)
    for start in range(0, tokens.shape[1], self.chunk):
      sub, last_PY = _prefill_chunk(self.cfg, self.params, sub, last_PY,
                                    jnp.asarray(tokens[:, start:start + self.chunk]),
                                    jnp.asarray(lengths), jnp.int32(start))
    self.cache = _scatter_slots(self.cache, sub, jnp.asarray(slot_ids), self._slot_axes)
    if copies:
      src, dst = (jnp.asarray(x, jnp.int32) for x in zip(*copies))
      self.cache = _copy_slots(self.cache, src, dst, self._slot_axes)
    # First tokens: one row per admitted request, padded to B rows (one compiled shape).
    row_of = {p: i for i, p in enumerate(prompts)}
    requests = [r for _, r in admitted] + [None] * (self.slots - len(admitted))
    rows_B = np.array([row_of[r.prompt] if r else 0 for r in requests], np.int32)
    out = _sample(last_PY[jnp.asarray(rows_B)], _settings(requests), _seeds(requests),
                  jnp.zeros(self.slots, jnp.int32), return_logits=self.return_logits)
    out = jax.device_get(out)
    return [_row(out, i) for i in range(len(admitted))]

  # ---- one decode step over every slot -------------------------------------------------------

  def _decode(self, pending, fed, active, slot_of):
    requests = [c.request if c is not None else None for c in slot_of]
    index = np.array([len(c.tokens) if c is not None else 0 for c in slot_of], np.int32)
    self.cache, out = _decode_and_sample(
        self.cfg, self.params, self.cache, jnp.asarray(pending), jnp.asarray(fed),
        jnp.asarray(active), _settings(requests), _seeds(requests), jnp.asarray(index),
        return_logits=self.return_logits)
    return jax.device_get(out)


# ---- jitted device functions -----------------------------------------------------------------


def _settings(requests) -> sampling.SamplingParams:
  """Per-slot sampling settings; None (an idle slot) samples greedily, unused."""
  return sampling.SamplingParams.create(
      len(requests), [r.temperature if r else 0.0 for r in requests],
      [r.top_k if r else 0 for r in requests], [r.top_p if r else 1.0 for r in requests])


def _seeds(requests):
  return jnp.asarray([r.seed if r else 0 for r in requests], jnp.uint32)


def _row(out, i):
  tokens, logprobs, raw, logits = out
  return tokens[i], logprobs[i], raw[i], None if logits is None else logits[i]


def _bucket(n: int, limit: int) -> int:
  """The smallest power of two >= n, at most `limit` (compiled prefill shapes stay few)."""
  return min(1 << (n - 1).bit_length(), limit) if n > 1 else 1


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("slot_axes",))
def _gather_slots(cache, slot_ids_P, slot_axes):
  """The caches of slots `slot_ids_P` (ids >= B give zeros), the slots axis in place.

  `slot_axes`: each cache leaf's slots axis, in `jax.tree.leaves` order."""
  leaves, tree = jax.tree.flatten(cache)
  return jax.tree.unflatten(tree, [
      jnp.take(x, slot_ids_P, axis=axis, mode="fill", fill_value=0)
      for x, axis in zip(leaves, slot_axes)])


@functools.partial(jax.jit, static_argnames=("slot_axes",), donate_argnames=("cache",))
def _scatter_slots(cache, sub, slot_ids_P, slot_axes):
  """`cache` with slots `slot_ids_P` replaced by `sub`'s (ids >= B dropped)."""

  def put(x, rows, axis):
    x, rows = jnp.moveaxis(x, axis, 0), jnp.moveaxis(rows, axis, 0)
    return jnp.moveaxis(x.at[slot_ids_P].set(rows, mode="drop"), 0, axis)

  leaves, tree = jax.tree.flatten(cache)
  return jax.tree.unflatten(tree, [put(x, rows, axis) for x, rows, axis in
                                   zip(leaves, jax.tree.leaves(sub), slot_axes)])


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("sub",))
def _prefill_chunk(cfg, params, sub, last_PY, tokens_PC, lengths_P, start):
  """One prefill chunk of P prompts, positions `start .. start + C - 1`, into their gathered
  caches `sub`.

  Args:
    last_PY: fp32 logits at each prompt's last token, where an earlier chunk held it.
    tokens_PC: int32 this chunk of each prompt (anything past its length).
    lengths_P: int32 prompt lengths (0 for padding rows: nothing written).
  Returns:
    `(sub, last_PY)`, last_PY updated for prompts ending in this chunk: the logits there
    predict each prompt's first generated token.
  """
  p, c = tokens_PC.shape
  positions_PC = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (p, c))
  real_PC = positions_PC < lengths_P[:, None]
  out = decode_step(cfg, params, sub, tokens_PC, positions_PC, real_PC.astype(jnp.int32))
  last_P = lengths_P - 1 - start
  logits_PY = jnp.take_along_axis(out.logits_BQY, jnp.clip(last_P, 0, c - 1)[:, None, None],
                                  axis=1)[:, 0]
  ends_here_P = (last_P >= 0) & (last_P < c)
  return out.cache, jnp.where(ends_here_P[:, None], logits_PY, last_PY)


@functools.partial(jax.jit, static_argnames=("slot_axes",), donate_argnames=("cache",))
def _copy_slots(cache, src_G, dst_G, slot_axes):
  """Prefix sharing: slot `dst_G[i]` gets a copy of slot `src_G[i]`'s cache."""
  sub = _gather_slots(cache, src_G, slot_axes)
  return _scatter_slots(cache, sub, dst_G, slot_axes)


@functools.partial(jax.jit, static_argnames=("return_logits",))
def _sample(logits_BY, settings, seeds_B, index_B, *, return_logits):
  out = sampling.sample(logits_BY, settings, seeds_B, index_B)
  return out.tokens, out.logprobs, out.raw_logprobs, logits_BY if return_logits else None


@functools.partial(jax.jit, static_argnames=("cfg", "return_logits"),
                   donate_argnames=("cache",))
def _decode_and_sample(cfg, params, cache, pending_B, fed_B, active_B, settings, seeds_B,
                       index_B, *, return_logits):
  """Feeds each active slot's pending token at its next position and samples token
  `index_B` of its request. Returns `(cache, (tokens, logprobs, raw_logprobs, logits))`."""
  out = decode_step(cfg, params, cache, pending_B[:, None], fed_B[:, None],
                    active_B[:, None].astype(jnp.int32))
  return out.cache, _sample(out.logits_BQY[:, 0], settings, seeds_B, index_B,
                            return_logits=return_logits)


def generate(config, params, prompts, max_new_tokens=32, temperature=0.0, top_p=1.0, top_k=0,
             seed=0, speculative_steps=0, return_logits=False, stop_tokens=(), *,
             slots: int | None = None, max_len: int | None = None, prefill_chunk: int = 256,
             mesh=None, rules=None) -> GenerateResult:
  """Completes every prompt (see the module docstring; `GenerateResult` for the fields).

  Args:
    config: the model section or a `ModelConfig`. params: its params.
    prompts: a list of token-id lists (of any lengths >= 1).
    max_new_tokens, temperature, top_p, top_k, stop_tokens: per request, as `Request`.
    seed: prompt i draws with `request_seed(seed, i)`.
    speculative_steps: MTP draft steps per verification (0: plain decoding).
    return_logits: also return each generated token's raw logits.
    slots: sequences decoded at once (default: all prompts, at most 32).
    max_len: cache positions per slot (default: what the longest request needs).
    prefill_chunk: prompt tokens per slot per prefill call.
    mesh, rules: serve sharded (`Engine`).
  Raises:
    ValueError: a bad argument (`glm5_jax.infer.requests.validate_generate_args`).
  """
  cfg = ModelConfig.from_config(config)
  if speculative_steps:
    raise ValueError("speculative_steps > 0: MTP speculative decoding is not in the engine yet; "
                     "use speculative_steps=0")
  longest = max((len(p) for p in prompts), default=0) if isinstance(prompts, (list, tuple)) else 0
  needed = max(longest + max_new_tokens - 1 + speculative_steps, 1) if isinstance(
      max_new_tokens, int) else 1
  max_len = needed if max_len is None else max_len
  requests = validate_generate_args(
      prompts, vocab_size=cfg.vocab_size, max_len=max_len, max_new_tokens=max_new_tokens,
      temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
      speculative_steps=speculative_steps, return_logits=return_logits, stop_tokens=stop_tokens)
  requests = [dataclasses.replace(r, seed=request_seed(seed, r.index)) for r in requests]
  engine = Engine(cfg, params, slots=slots or min(len(requests), 32), max_len=max_len,
                  prefill_chunk=prefill_chunk, return_logits=return_logits, mesh=mesh,
                  rules=rules)
  done = engine.run(requests)
  return GenerateResult(
      tokens=[c.tokens for c in done], logprobs=[c.logprobs for c in done],
      raw_logprobs=[c.raw_logprobs for c in done],
      logits=[np.stack(c.logits) for c in done] if return_logits else None)
