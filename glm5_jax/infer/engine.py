"""The slot engine: continuous batching and prefix sharing over the cached steps.

A fixed number of slots B share one preallocated cache (`glm5_jax.infer.cache`), by default
paged (`page_size`; `glm5_jax.infer.paged`, `paged_slots`): the row-indexed caches live in a
pool of pages reserved per request at admission and returned when it ends, each step reads only
the live slots' pages (their count bucketed to a power of two), and a group's followers
reference the leader's prompt pages instead of copying them. `page_size=None` keeps the
contiguous `[B, max_len]` cache. The host loop keeps a queue of requests and, each iteration:

  1. admits waiting requests into free slots. Requests admitted together that share a prompt
     (an RL group: one prompt sampled G times) are prefilled once, in the first of their slots,
     and that slot's cache is shared with the others (paged: page references and a copy of
     the partly filled page; contiguous: `_copy_slots`). Prefill runs in chunks of
     `prefill_chunk` tokens over the admitted slots only (their caches are gathered out of the
     whole cache, stepped, and scattered back), padded to a power-of-two number of rows (at
     least the mesh's batch shards) so admission compiles at most log2(B) + 1 programs
     whatever the traffic (paged: times log2(max_len / page_size) + 1 page buckets);
  2. samples each admitted request's first token from its prompt's last logits;
  3. runs one decode step over all B slots (idle slots are padding, `segment_ids` 0, and change
     nothing), samples one token per slot, and frees the slots whose request ended (a stop token,
     kept in the output, or `max_new_tokens`). A freed slot takes the next request in the next
     iteration with no recompile: every shape is fixed by B, max_len and the chunk (paged:
     and the page bucket; `warmup()` compiles every bucket up front).

The loop is incremental: `submit(request)` queues a request and returns its handle, `step()`
runs one iteration (admission, then one decode step) and returns an `Event` per request that
got tokens (its finished `Completion` on the step that ended it), and `cancel(handle)` drops a
queued request or frees a running one's slot at once. `run(requests)` is `submit` + `step`
until idle. A server (`glm5_jax.serve`) calls these from its one engine thread.

Sessions (`glm5_jax.infer.sessions`): a request with a `session` id leaves its slot's cache
held when it ends; the session's next request (its prompt the whole conversation so far)
continues in that slot and prefills only the tokens past the held ones, each prefill row from
its own start position. `release(session)` frees the slot; a request that finds no free slot
evicts the least recently used held session. `prefix_stats()` counts prompt tokens submitted
and prefilled (group sharing and sessions both save prefill).

Randomness: token n of a request draws from (its seed, n) only (`glm5_jax.infer.sampling`), so a
request's tokens do not depend on its slot, on its neighbours, or on when it was admitted:
continuous batching gives exactly the tokens of generating each request alone.

Every generated token comes with its log-prob under the sampling distribution and under the
raw model (temperature 1; after the request's logit_bias and penalties, `infer.penalties`,
which are zero in RL), from the logits that produced it (token-in-token-out: RL trains on
these ids and log-probs, never on re-tokenized text). With `record_routing`, each request also
returns the routing its tokens went through (MoE experts, DSA keys; `glm5_jax.routing_replay`)
so the trainer can replay it: prompt tokens from the prefill chunk that fed them, each
generated token from the decode step that fed it.

Notation (docs/design.md): B slots, P admitted rows (a power of two <= B), C prefill chunk,
Q tokens per slot in one call, Y vocab, D hidden.
"""

import collections
import contextlib
import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import sharding as sharding_lib
from glm5_jax.api import abstract_params_and_axes
from glm5_jax.config import ModelConfig
from glm5_jax.infer import paged, penalties, sampling, speculate
from glm5_jax.infer.accept_stats import (NO_LIMIT, AcceptStats, acceptance_rates, add_step,
                                         init_accept_stats, mean_accept_length)
from glm5_jax.infer.cache import allocate, cache_specs, init_cache
from glm5_jax.attention.cache_spec import CacheSpec
from glm5_jax.infer.paged_slots import PagedSlots
from glm5_jax.infer.requests import GenerateResult, Request, validate_generate_args
from glm5_jax.infer.sessions import PrefixStats, SessionTable, reusable
from glm5_jax.infer.step import decode_step
from glm5_jax.layers.axes import BATCH
from glm5_jax.layers.params import dtypes
from glm5_jax.seeds import derive_seed


@dataclasses.dataclass
class Completion:
  """One finished request: generated ids, their log-probs (sampling distribution and raw), the
  raw logits `[n, Y]` that produced them when the engine keeps logits, and with speculative
  decoding its accept counts (`glm5_jax.infer.accept_stats`: verification steps, tokens kept,
  and per draft position how often it was reached and accepted).

  `routing` (engine with `record_routing`): `{"moe": int32 [n, N_moe, X], "dsa": int32
  [n, N_dsa, T]}` over the n = len(prompt) + len(tokens) tokens of `sequence`
  (`glm5_jax.routing_replay`; DSA keys are positions). The last generated token was never fed
  to the model: its row is -1 (not recorded)."""

  request: Request
  tokens: list
  logprobs: list
  raw_logprobs: list
  logits: list | None = None
  accept: AcceptStats | None = None
  routing: dict | None = None
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


# `generate`'s smallest default max_len: short calls share one set of compiled steps.
MIN_GENERATE_LEN = 64


def request_seed(seed: int, index: int) -> int:
  """The uint32 seed of prompt `index` of a `generate` call with `seed`: a hash of both, so the
  G copies of one prompt in an RL group draw differently, and a call's streams do not overlap
  another seed's (as `seed + index` would)."""
  return derive_seed(seed, index)


class Engine:
  """Continuous batching over `slots` sequences of up to `max_len` positions.

  Args:
    config: the model section or a `ModelConfig`.
    params: the model's params (layout matching `model.scan_layers`), placed as the caller
      wants; with `mesh`, `Engine` shards them by the logical-axis rules.
    slots: B, sequences decoded at once.
    max_len: cache positions per slot: a request needs `len(prompt) + max_new_tokens - 1`
      (+ `speculative_steps`: a verification feeds k drafts past the last kept token).
    prefill_chunk: C, prompt tokens per slot per prefill call.
    return_logits: keep each generated token's raw logits (`[Y]` per token, copied to host).
    speculative_steps: k > 0 decodes with MTP speculation (`glm5_jax.infer.speculate`).
    mtp_cache: "per_depth" or "shared", the MTP caches' scheme (`glm5_jax.infer.speculate`).
    mesh, rules: serve sharded: params and cache placed by `mesh.logical_axis_rules` (the
      cache's slots split over the batch axes, so B must divide by them).
    record_routing: return each request's routing (`Completion.routing`), for routing
      replay in RL; plain decoding only (not with `speculative_steps`).
    page_size: rows per page of the paged cache (`glm5_jax.infer.paged`): a step reads the
      live slots' pages only, bucketed; None keeps the contiguous `[B, max_len]` cache, every
      step reading max_len rows.
    num_pages: pages in the pool (page 0 reserved); None: `slots * ceil(max_len / page_size)
      + 1`, every slot at max_len. Fewer makes requests wait for pages (memory follows the
      live rows, not slots x max_len).
    top_logprobs: N >= 0: keep each generated token's N most likely alternatives under the
      raw model (ids and log-probs, `Completion.top_logprobs`); plain decoding only.
  """

  def __init__(self, config, params, *, slots: int, max_len: int, prefill_chunk: int = 256,
               return_logits: bool = False, speculative_steps: int = 0,
               mtp_cache: str = "per_depth", mesh=None, rules=None,
               record_routing: bool = False, top_logprobs: int = 0,
               page_size: int | None = 16, num_pages: int | None = None):
    self.cfg = ModelConfig.from_config(config)
    for name, value in (("slots", slots), ("max_len", max_len), ("prefill_chunk", prefill_chunk)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Engine: {name} must be an int >= 1, got {value!r}")
    if (mesh is None) != (rules is None):
      raise ValueError("Engine: give both mesh and rules, or neither")
    self.k = speculative_steps
    if record_routing and self.k:
      raise ValueError(f"Engine: record_routing=True records the routing of one decode step per "
                       f"token; with speculative_steps={self.k} a verification step feeds k + 1 "
                       "tokens of which only some are kept. Use speculative_steps=0 to record")
    self.record_routing = bool(record_routing)
    if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or not (
        0 <= top_logprobs <= self.cfg.vocab_size):
      raise ValueError(f"Engine: top_logprobs must be an int in [0, vocab_size "
                       f"{self.cfg.vocab_size}], got {top_logprobs!r}")
    if top_logprobs and self.k:
      raise ValueError(f"Engine: top_logprobs={top_logprobs} needs plain decoding; "
                       f"speculative_steps={self.k} keeps no alternatives")
    self.top_n = top_logprobs
    self._prompt_routing = []  # per request of the last `_admit`: its prefill routing
    if self.k:
      speculate.check_speculative_config(self.cfg, self.k, mtp_cache)
    self.mtp_cache = mtp_cache
    self.slots, self.max_len, self.return_logits = slots, max_len, return_logits
    self.chunk = min(prefill_chunk, max_len)
    self.mesh, self.rules = mesh, rules
    # Prefill rows are padded to a multiple of the batch shards, so every shard gets whole rows
    # (fewer rows than shards makes the SPMD partitioner replicate and rematerialize the step).
    self.row_multiple = 1 if mesh is None else int(np.prod(
        [mesh.shape[a] for a in sharding_lib.batch_mesh_axes(rules)], dtype=np.int64))
    if slots % self.row_multiple:
      raise ValueError(f"Engine: slots {slots} must be a multiple of the {self.row_multiple} "
                       f"batch shards of the mesh {dict(mesh.shape)}")
    cache_args = dict(max_verify=self.k + 1, mtp_cache=mtp_cache, mtp_depths=self.k)
    specs = cache_specs(self.cfg, slots, max_len, **cache_args)
    # The slots axis of every cache array: gathered and scattered when admitting requests.
    self._slot_axes = tuple(s.axes.index(BATCH) for s in jax.tree.leaves(
        specs, is_leaf=lambda x: isinstance(x, CacheSpec)))
    if mesh is not None:
      shapes, logical = abstract_params_and_axes(self.cfg)
      params = jax.device_put(params, sharding_lib.param_shardings(shapes, logical, mesh, rules))
    self.params = params
    # Speculative state: each slot's main-model h at the W positions before its pending token.
    self.w = speculate.window_size(self.k) if self.k else 0
    self.pages, self.paging = None, None
    if page_size is None:
      self.cache = init_cache(self.cfg, slots, max_len, **cache_args, mesh=mesh, rules=rules)
    else:
      self.pages = PagedSlots(specs, slots=slots, max_len=max_len, page_size=page_size,
                              num_pages=num_pages, window=self.w)
      self.paging = Paging(self.pages.layout, min(self.cfg.index_topk, max_len))
      self.cache = allocate(self.pages.specs, mesh=mesh, rules=rules)
    self.hidden = jnp.zeros((slots, self.w, self.cfg.hidden_size), dtypes(self.cfg)[0])
    # Each slot's counts of its request's generated tokens, for the penalties
    # (`penalties.count_fed`: the decode step keeps them; always present, zeros are off).
    self.counts = jnp.zeros((slots, self.cfg.vocab_size), jnp.int32)
    self._slot_arrays_memo = (None, None)
    self._carry_zeros = {}  # rows -> `_fresh_carry`
    self.sessions = SessionTable()
    self.stats = PrefixStats()
    # The incremental loop's state: waiting (handle, request)s and each slot's Completion.
    self._queue: collections.deque = collections.deque()
    self._slot_of: list[Completion | None] = [None] * slots
    self._next_handle = 0

  def release(self, session) -> bool:
    """Frees a held session's slot (and its pages); False when the session is not held
    (evicted, unknown)."""
    entry = self.sessions.take(session)
    if entry is not None:
      self._free_slot(entry.slot)
    return entry is not None

  def _free_slot(self, slot: int) -> None:
    """A slot nobody holds any more: its pages go back to the pool."""
    if self.pages is not None:
      self.pages.release(slot)

  def _rows(self, request) -> int:
    """Cache rows a request can write: its prompt, all but its last token, k drafts."""
    return len(request.prompt) + request.max_new_tokens - 1 + self.k

  def prefix_stats(self) -> dict:
    """{"prompt_tokens", "prefilled_tokens", "hit_rate" = 1 - prefilled / prompt, and the
    session hits, misses and evictions} since the engine was built."""
    return self.stats.as_dict()

  def _context(self):
    if self.mesh is None:
      return contextlib.nullcontext()
    return sharding_lib.activation_sharding(self.mesh, self.rules)

  def warmup(self, max_rows: int | None = None, progress=None) -> None:
    """Compiles every program the loop can run (paged cache only: every admitted-rows bucket
    with every page bucket, every decode page bucket), so that no request compiles anything
    later whatever its lengths. `max_rows`: only the page buckets of requests of up to that
    many rows (prompt + max_new_tokens - 1 + k; default max_len). `progress(done, total)` is
    called after each of its `total` parts (a part compiles about one program). Leaves the
    engine as built (stats, pages, slots idle).

    What a request can change is data, not a program: sampling settings, penalties and seeds
    are per-slot arrays (`infer.sampling`, `infer.penalties`), `n` and sessions choose slots
    and prefill rows (the row buckets), stop strings and tools only change the prompt and
    where the server cancels; quantized params are the params. A server's engine fixes the rest (speculative steps,
    top_logprobs, record_routing, return_logits), so these parts are every program."""
    if self.pages is None:
      raise ValueError("Engine.warmup needs the paged cache (page_size); the contiguous cache "
                       "compiles its few shapes on first use")
    if any(self.pages.pool.held) or len(self.sessions):
      raise RuntimeError("Engine.warmup: run it before any request")
    buckets = self.pages.buckets(self.max_len if max_rows is None else max_rows)
    row_buckets = sorted({min(_round_up(_bucket(n, self.slots), self.row_multiple), self.slots)
                          for n in range(1, self.slots + 1)})
    stats = dataclasses.replace(self.stats)
    token = Request(0, (0,), 1, 0.0, 1.0, 0, 0, ())

    def host_path(rows):  # the whole host path: distinct prompts, then a group
      for admitted in ([(s, dataclasses.replace(token, prompt=(s,)), 0) for s in range(rows)],
                       [(s, token, 0) for s in range(2)] if rows > 1 else []):
        if admitted:
          self._admit(admitted)
        for slot in range(self.slots):
          self.pages.release(slot)

    # The first decode takes the counts as allocated, every later one a program's output (with
    # placed params a committed array: another program, as in `_warm_admission`), so the first
    # bucket's decode runs twice.
    parts = ([functools.partial(self._warm_admission, rows, n, fresh=n == buckets[0])
              for rows in row_buckets for n in buckets]
             + [functools.partial(host_path, rows) for rows in row_buckets]
             + [functools.partial(self._warm_decode, n) for n in buckets[:1] + buckets])
    with self._context():
      for done, part in enumerate(parts, 1):
        part()
        if progress is not None:
          progress(done, len(parts))
    self.stats = stats

  def _warm_decode(self, n: int) -> None:
    """Compiles the decode (or verification) step reading `n` pages per slot, all slots idle."""
    idle = [None] * self.slots
    # Host arrays as the loop passes them: numpy.
    zeros = np.zeros(self.slots, np.int32)
    inactive = np.zeros(self.slots, bool)
    table = self.pages.table(np.arange(self.slots), n * self.pages.page_size)
    if self.k:
      self.cache, self.hidden, _ = _speculate_and_sample(
          self.cfg, self.params, self.cache, self.hidden,
          np.zeros((self.slots, self.w + 1), np.int32), zeros, inactive,
          *self._slot_arrays(idle)[:2], zeros, table, self.pages.shared_rows(), k=self.k,
          mtp_cache=self.mtp_cache, return_logits=self.return_logits, paging=self.paging)
    else:
      self.cache, self.counts, *_ = _decode_and_sample(
          self.cfg, self.params, self.cache, self.counts, zeros, zeros, inactive,
          *self._slot_arrays(idle), zeros, table, return_logits=self.return_logits,
          record_routing=self.record_routing, top_n=self.top_n, paging=self.paging)

  def _warm_admission(self, rows: int, n: int, fresh: bool) -> None:
    """Compiles the admission program of `rows` prefill rows at page bucket `n`
    (`_paged_admit`, on padding rows: nothing written), for a prompt's first chunk and for a
    later one.

    Where the params are placed on a mesh, a program's outputs are committed arrays, and a
    program given them is another program than one given fresh arrays. So (`fresh`: the
    first bucket of a row count) a first call on fresh arrays (the cache as allocated, zeros)
    is made before the programs the loop will use, and the first chunk's zeros are then made
    like the outputs (`jnp.zeros_like` keeps their placement): first and later chunks run one
    program."""
    ids = np.full(rows, self.slots, np.int32)
    zeros = np.zeros(rows, np.int32)
    tokens = np.zeros((rows, self.chunk + self.k), np.int32)
    idle = [None] * self.slots
    first = (np.zeros(self.slots, np.int32), _host_settings(idle), _host_seeds(idle),
             penalties.host_penalties(idle))

    def chunk(n):
      return (self.pages.table(ids, n * self.pages.page_size), ids, tokens, zeros, zeros)

    if fresh:
      carry, _, _ = self._paged_chunk(chunk(n), self._fresh_carry(rows), first)
      self._carry_zeros[rows] = tuple(jnp.zeros_like(x) for x in carry)
    carry, _, _ = self._paged_chunk(chunk(n), self._fresh_carry(rows), first)
    self._paged_chunk(chunk(n), carry, first)

  # ---- the host loop -------------------------------------------------------------------------

  def submit(self, request: Request) -> int:
    """Queues `request` (admitted by a later `step`); returns its handle. Raises ValueError
    when it cannot run here (longer than `max_len` or the model's max_position_embeddings, a
    token id outside the vocab, its session already in flight or unusable)."""
    self._check_requests([request])
    return self._enqueue(request)

  def _enqueue(self, request: Request) -> int:
    handle, self._next_handle = self._next_handle, self._next_handle + 1
    self._queue.append((handle, request))
    return handle

  @property
  def busy(self) -> bool:
    """Whether a request is waiting or running (held sessions are neither)."""
    return bool(self._queue) or any(c is not None for c in self._slot_of)

  def waiting(self) -> int:
    """Requests submitted and not yet admitted to a slot."""
    return len(self._queue)

  def running(self) -> int:
    """Slots generating a request now."""
    return sum(c is not None for c in self._slot_of)

  def cancel(self, handle: int) -> bool:
    """Drops a waiting request, or frees a running request's slot at once (a session's cache
    is not held: its next request prefills in full). False when `handle` is not in flight."""
    for i, (h, _) in enumerate(self._queue):
      if h == handle:
        del self._queue[i]
        return True
    for slot, c in enumerate(self._slot_of):
      if c is not None and c.handle == handle:
        self._slot_of[slot] = None
        self._free_slot(slot)  # its pages back to the pool
        return True
    return False

  def step(self) -> list[Event]:
    """One iteration of the loop: admits waiting requests into free slots (their first
    tokens), then one decode (or verification) step over every running slot. Returns one
    `Event` per request that got tokens, in slot order; [] when nothing is in flight."""
    if not self.busy:
      return []
    slot_of = self._slot_of
    before: dict[int, int] = {}  # slot -> tokens its completion had before this step
    finished: dict[int, Completion] = {}
    with self._context():
      admitted = self._place(self._queue, slot_of)
      if admitted:
        first = self._admit([a[:3] for a in admitted])
        for i, ((slot, request, _, handle), token) in enumerate(zip(admitted, first)):
          completion = Completion(request, [], [], [], [] if self.return_logits else None,
                                  init_accept_stats(1, self.k) if self.k else None,
                                  top_logprobs=[] if self.top_n else None, handle=handle)
          if self.record_routing:
            completion.routing = {kind: [rows] for kind, rows in
                                  self._prompt_routing[i].items()}
          slot_of[slot], before[slot] = completion, 0
          self._keep(completion, [token])
          if self._finished(completion):
            finished[slot] = self._end(slot_of, slot)
      if any(c is not None for c in slot_of):
        for slot, c in enumerate(slot_of):
          if c is not None:
            before.setdefault(slot, len(c.tokens))
        for slot, completion in (self._speculate if self.k else self._decode)(slot_of):
          if self._finished(completion):
            finished[slot] = self._end(slot_of, slot)
    events = []
    for slot in sorted(before):
      c, n = finished.get(slot) or slot_of[slot], before[slot]
      events.append(Event(c.handle, c.tokens[n:], c.logprobs[n:], c.raw_logprobs[n:],
                          None if c.top_logprobs is None else c.top_logprobs[n:],
                          finished.get(slot)))
    return events

  def run(self, requests) -> list[Completion]:
    """Generates every request (in any order of completion); returns them in input order.
    The engine must be idle (nothing submitted and unfinished)."""
    requests = list(requests)
    if self.busy:
      raise RuntimeError(f"Engine.run: {self.waiting()} requests waiting and {self.running()} "
                         "running from `submit`; drive them with `step` or `cancel` them first")
    self._check_requests(requests)
    handles = [self._enqueue(r) for r in requests]
    done: dict[int, Completion] = {}
    while self.busy:
      for event in self.step():
        if event.completion is not None:
          done[event.handle] = event.completion
    return [done[h] for h in handles]

  def _check_requests(self, requests) -> None:
    in_flight = {r.session for _, r in self._queue} | {
        c.request.session for c in self._slot_of if c is not None}
    sessions = set()
    for r in requests:
      if len(r.prompt) + r.max_new_tokens - 1 + self.k > self.max_len:
        raise ValueError(f"request {r.index}: {len(r.prompt)} prompt tokens + max_new_tokens "
                         f"{r.max_new_tokens} - 1 + speculative_steps {self.k} exceed the "
                         f"engine's max_len {self.max_len}")
      if len(r.prompt) + r.max_new_tokens - 1 > self.cfg.max_position_embeddings:
        raise ValueError(f"request {r.index}: {len(r.prompt)} prompt tokens + max_new_tokens "
                         f"{r.max_new_tokens} - 1 exceed the model's max_position_embeddings "
                         f"{self.cfg.max_position_embeddings}")
      bad = [t for t in r.prompt if not 0 <= t < self.cfg.vocab_size]
      if bad:
        raise ValueError(f"request {r.index}: prompt token id {bad[0]} is outside the vocab "
                         f"[0, {self.cfg.vocab_size})")
      if self.pages is not None:
        self.pages.check_fits(r.index, self._rows(r))
      if penalties.is_adjusted(r):
        self._check_adjustments(r)
      if r.session is None:
        continue
      if self.k:  # the MTP caches and h window would need their own continuation
        raise ValueError(f"request {r.index}: session {r.session!r} with speculative_steps "
                         f"{self.k}; sessions need plain decoding (speculative_steps=0)")
      try:
        hash(r.session)
      except TypeError:
        raise ValueError(f"request {r.index}: session must be hashable, got "
                         f"{type(r.session).__name__}") from None
      if r.session in sessions or r.session in in_flight:
        raise ValueError(f"request {r.index}: session {r.session!r} has two requests in "
                         "flight; a session's next turn waits for its last one to finish")
      sessions.add(r.session)

  def _check_adjustments(self, r: Request) -> None:
    """Penalties and logit_bias are exact in plain decoding only: a verification step would
    need each draft position's counts (and the drafts' own distribution adjusted too)."""
    if self.k:
      raise ValueError(f"request {r.index}: frequency_penalty, presence_penalty and logit_bias "
                       f"need plain decoding; this engine speculates {self.k} tokens")
    bad = [t for t, _ in r.logit_bias if t >= self.cfg.vocab_size]
    if bad:
      raise ValueError(f"request {r.index}: logit_bias token id {bad[0]} is outside the vocab "
                       f"[0, {self.cfg.vocab_size})")

  def _place(self, queue, slot_of) -> list:
    """Pops the requests that start this iteration from `queue` (of `(handle, request)`):
    `(slot, request, start, handle)`, `start` the cache rows kept (a held session's, else 0). Requests of held sessions go to their slots; the rest
    take free slots in queue order, evicting held sessions LRU-first when none is free."""
    held = self.sessions.slots()
    free = [s for s in range(self.slots) if slot_of[s] is None and s not in held]
    placed, waiting, deferred = [], collections.deque(), []
    # Paged: pages each placed request takes (all its rows, no credit for group sharing).
    budget = self.pages.pool.free if self.pages is not None else None
    for h, r in queue:
      entry = self.sessions.take(r.session) if r.session is not None else None
      if entry is None:
        waiting.append((h, r))
        continue
      start = reusable(entry, r.prompt)
      if self.pages is not None:
        if not start:  # a miss restarts the slot: its held pages go back first
          self.pages.release(entry.slot)
          budget = self.pages.pool.free
        need = self.pages.new_pages(entry.slot, self._rows(r))
        if need > budget:  # waits, its session held as it was
          self.sessions.hold(r.session, entry.slot, entry.tokens if start else ())
          deferred.append((h, r))
          continue
        budget -= need
      placed.append((entry.slot, r, start, h))
    queue.clear()
    while waiting:
      need = 0 if self.pages is None else self.pages.pages_needed(self._rows(waiting[0][1]))
      if not free or (self.pages is not None and need > budget):
        slot = self.sessions.evict()
        if slot is None:
          break
        self.stats.evictions += 1
        self._free_slot(slot)
        budget = None if self.pages is None else self.pages.pool.free - sum(
            self.pages.new_pages(s, self._rows(r)) for s, r, *_ in placed)
        free.append(slot)
        continue
      h, r = waiting.popleft()
      placed.append((free.pop(0), r, 0, h))
      if self.pages is not None:
        budget -= need
    queue.extend(deferred)
    queue.extend(waiting)
    for _, r, start, _ in placed:
      if r.session is not None:
        self.stats.session_hits += start > 0
        self.stats.session_misses += start == 0
    return placed

  def _end(self, slot_of, slot) -> Completion:
    """Frees a finished request's slot, or holds it for the request's session."""
    completion, slot_of[slot] = slot_of[slot], None
    if completion.request.session is not None:
      self.sessions.hold(completion.request.session, slot, tuple(completion.sequence[:-1]))
    else:
      self._free_slot(slot)
    if self.record_routing:
      completion.routing = _finish_routing(completion.routing)
    return completion

  @staticmethod
  def _keep(completion: Completion, tokens) -> None:
    for tok, logprob, raw, logits, *top in tokens:
      completion.tokens.append(int(tok))
      completion.logprobs.append(float(logprob))
      completion.raw_logprobs.append(float(raw))
      if completion.logits is not None:
        completion.logits.append(np.asarray(logits, np.float32))
      if completion.top_logprobs is not None:
        completion.top_logprobs.append(top[0])

  @staticmethod
  def _finished(completion: Completion) -> bool:
    r = completion.request
    return (len(completion.tokens) >= r.max_new_tokens
            or completion.tokens[-1] in r.stop_tokens)

  # ---- admission: grouped, chunked prefill ---------------------------------------------------

  def _admit(self, admitted):
    """Prefills the admitted `(slot, request, start)`s from position `start` (one prefill per
    distinct fresh prompt, copied to the group; a session's rows in its own slot) and samples
    their first tokens. Returns `(token, logprob, raw_logprob, logits[, top])` per request.

    Paged, each prefill chunk is one program (`_paged_admit`, the same for every chunk), so an
    admission whose prompts fit one chunk is one dispatch, plus one for a group's copy-on-write
    (`_share_prefix`). Host arrays go to the programs as numpy arrays: jit copies them with
    the call, where `jnp.asarray` would dispatch an op per array."""
    plan = self._plan(admitted)
    requests = [r for _, r, _ in admitted] + [None] * (self.slots - len(admitted))
    first = (plan.rows_B, _host_settings(requests), _host_seeds(requests),
             penalties.host_penalties(requests))
    prefill = self._contiguous_prefill if self.pages is None else self._paged_prefill
    out, routing = jax.device_get(prefill(plan, first))
    if self.record_routing:
      self._prompt_routing = _prefilled_routing(plan, routing, len(admitted))
    return [_row(out, i) for i in range(len(admitted))]

  def _plan(self, admitted) -> "_Admission":
    """The host side of an admission: one prefill row per distinct key (a fresh prompt, shared
    by its group, or a session's continuation), its pages reserved (a follower's shared with
    its leader), the prefix stats counted, and the rows' tokens laid out."""
    row_key = []  # per request: its prefill row's key, (prompt, start) or (prompt, slot)
    leaders: dict[tuple, tuple] = {}  # row key -> (slot holding its prefill, start)
    copies = []  # (source slot, destination slot)
    page_copies = []  # paged: (source page, destination page), copied after the prefill
    for slot, request, start in admitted:
      self.stats.prompt_tokens += len(request.prompt)
      # Only fresh prompts (start 0) are shared: a session's rows are its own slot's.
      key = (request.prompt, 0) if start == 0 else (request.prompt, -1 - slot)
      row_key.append(key)
      if key in leaders:
        copies.append((leaders[key][0], slot))
        if self.pages is not None:  # the leader's prompt pages by reference
          page_copies += self.pages.share(leaders[key][0], slot, len(request.prompt),
                                          self._rows(request))
      else:
        leaders[key] = (slot, start)
        if self.pages is not None:
          self.pages.grow(slot, self._rows(request))
    keys = list(leaders)
    rows = min(_round_up(_bucket(len(keys), self.slots), self.row_multiple), self.slots)
    # Rows past the prompts use slot id B: gathered as zeros, their scatter dropped.
    slot_ids = np.full(rows, self.slots, np.int32)
    slot_ids[:len(keys)] = [leaders[k][0] for k in keys]
    lengths = np.zeros(rows, np.int32)
    lengths[:len(keys)] = [len(k[0]) for k in keys]
    starts = np.zeros(rows, np.int32)
    starts[:len(keys)] = [leaders[k][1] for k in keys]
    self.stats.prefilled_tokens += int((lengths - starts).sum())
    # Each row holds its tokens from its own start; k tokens of lookahead past each chunk: the
    # MTP depths read t_{i+d}.
    width = _round_up(int((lengths - starts).max()), self.chunk)
    tokens = np.zeros((rows, width + self.k), np.int32)
    for i, (prompt, _) in enumerate(keys):
      tokens[i, :lengths[i] - starts[i]] = prompt[starts[i]:]
    row_of = {k: i for i, k in enumerate(keys)}
    rows_B = np.zeros(self.slots, np.int32)  # padding requests read row 0, unused
    rows_B[:len(row_key)] = [row_of[k] for k in row_key]
    return _Admission(keys, slot_ids, lengths, starts, tokens, rows_B, copies, page_copies)

  def _fresh_carry(self, rows: int):
    """`(last_PY, hidden_PWD)` zeros, what a prompt's first chunk starts from; made once per
    row count and kept (no program donates them), so an admission dispatches no op for them
    (`warmup` remakes them placed like a chunk's outputs: `_warm_admission`)."""
    if rows not in self._carry_zeros:
      self._carry_zeros[rows] = (
          jnp.zeros((rows, self.cfg.vocab_size), jnp.float32),
          jnp.zeros((rows,) + self.hidden.shape[1:], self.hidden.dtype))
    return self._carry_zeros[rows]

  def _paged_prefill(self, plan, first):
    """`plan`'s prefill on the paged cache, chunk by chunk, with its first tokens (`first`:
    `(rows_B, settings, seeds_B)` of `_first_tokens`, sampled by every chunk, kept from the
    last) and the groups' copy-on-write. Returns device `(first tokens as _sample's, [routing
    of each chunk])`."""
    width = plan.tokens.shape[1] - self.k
    carry, routing = self._fresh_carry(len(plan.slot_ids_P)), []
    for offset in range(0, width, self.chunk):
      reach = int(np.minimum(plan.lengths_P, plan.starts_P + offset + self.chunk).max())
      chunk = (self.pages.table(plan.slot_ids_P, reach), plan.slot_ids_P,
               plan.tokens[:, offset:offset + self.chunk + self.k], plan.lengths_P,
               plan.starts_P + offset)
      carry, out, chunk_routing = self._paged_chunk(chunk, carry, first)
      routing.append(chunk_routing)
    if plan.copies:
      self._copy_on_write(plan.page_copies, plan.copies)
    return out, routing

  def _paged_chunk(self, chunk, carry, first):
    """One prefill chunk (`_paged_admit`): `chunk` = `(table_PN, slot_ids_P, tokens_PX,
    lengths_P, start_P)`, `carry` = `(last_PY, hidden_PWD)` of the earlier chunks, `first` as
    `_paged_prefill`'s. Returns `(carry, first tokens, routing)`."""
    self.cache, self.hidden, carry, out, routing = _paged_admit(
        self.cfg, self.params, self.cache, self.hidden, *chunk, *carry, *first, depths=self.k,
        mtp_cache=self.mtp_cache, record_routing=self.record_routing, paging=self.paging,
        return_logits=self.return_logits, top_n=self.top_n)
    return carry, out, routing

  def _copy_on_write(self, page_copies, copies) -> None:
    """Copies `(source page, destination page)`s and the per-slot state of `(source slot,
    destination slot)`s (`_share_prefix`; padded to fixed shapes: one program whatever the
    group sizes)."""
    self.cache, self.hidden = _share_prefix(
        self.cache, self.hidden, *self.pages.copy_args(page_copies, copies, self.slots),
        layout=self.paging.layout)

  def _contiguous_prefill(self, plan, first):
    """`_paged_prefill` on the contiguous cache: the rows' slots gathered, stepped chunk by
    chunk, scattered back, then copied to their groups."""
    slot_ids = jnp.asarray(plan.slot_ids_P)
    sub = _gather_slots(self.cache, slot_ids, self._slot_axes)
    last_PY, hidden_PWD = self._fresh_carry(len(plan.slot_ids_P))
    routing = []
    for offset in range(0, plan.tokens.shape[1] - self.k, self.chunk):
      sub, last_PY, hidden_PWD, chunk_routing = _prefill_chunk(
          self.cfg, self.params, sub, last_PY, hidden_PWD,
          plan.tokens[:, offset:offset + self.chunk + self.k], plan.lengths_P,
          plan.starts_P + offset, depths=self.k, mtp_cache=self.mtp_cache,
          record_routing=self.record_routing)
      routing.append(chunk_routing)
    self.cache = _scatter_slots(self.cache, sub, slot_ids, self._slot_axes)
    self.hidden = self.hidden.at[slot_ids].set(hidden_PWD, mode="drop")
    if plan.copies:
      src, dst = (jnp.asarray(x, jnp.int32) for x in zip(*plan.copies))
      self.cache = _copy_slots(self.cache, src, dst, self._slot_axes)
      self.hidden = self.hidden.at[dst].set(self.hidden[src])
    return _first_tokens(last_PY, *first, return_logits=self.return_logits,
                         top_n=self.top_n), routing

  def _slot_arrays(self, requests):
    """`(settings, seeds, penalties)` of the slots' requests, rebuilt only when a slot changes
    hands (decode steps in between reuse the device arrays instead of copying them again)."""
    key = tuple(requests)  # by value: equal requests have equal settings
    if self._slot_arrays_memo[0] != key:
      # One transfer for the arrays (ops building them would be a dispatch each).
      self._slot_arrays_memo = (key, jax.device_put((
          _host_settings(requests), _host_seeds(requests), penalties.host_penalties(requests))))
    return self._slot_arrays_memo[1]

  # ---- one decode step over every slot -------------------------------------------------------

  def _decode(self, slot_of):
    """One token for every active slot; yields `(slot, completion)` for each."""
    requests = [c.request if c is not None else None for c in slot_of]
    active = np.array([c is not None for c in slot_of])
    pending = np.array([c.tokens[-1] if c else 0 for c in slot_of], np.int32)
    fed = np.array([len(c.sequence) - 1 if c else 0 for c in slot_of], np.int32)
    index = np.array([len(c.tokens) if c else 0 for c in slot_of], np.int32)
    table = None if self.pages is None else self.pages.table(np.arange(self.slots),
                                                             int(fed.max()) + 1)
    self.cache, self.counts, out, routing = _decode_and_sample(
        self.cfg, self.params, self.cache, self.counts, pending, fed, active,
        *self._slot_arrays(requests), index, table,
        return_logits=self.return_logits, record_routing=self.record_routing,
        top_n=self.top_n, paging=self.paging)
    out, routing = jax.device_get((out, routing))
    for slot in np.flatnonzero(active):
      self._keep(slot_of[slot], [_row(out, slot)])
      for kind, rows in routing.items():  # [B, 1, N, k]: the routing of the fed pending token
        slot_of[slot].routing[kind].append(rows[slot])
      yield slot, slot_of[slot]

  def _speculate(self, slot_of):
    """One verification step for every active slot: keeps up to k + 1 tokens per slot (cut at
    a stop token or the budget) and counts them; yields `(slot, completion)` for each."""
    requests = [c.request if c is not None else None for c in slot_of]
    active = np.array([c is not None for c in slot_of])
    window = np.zeros((self.slots, self.w + 1), np.int32)
    fed = np.zeros(self.slots, np.int32)
    for slot, c in enumerate(slot_of):
      if c is not None:
        seq = c.sequence
        fed[slot] = len(seq) - 1
        tail = seq[max(0, len(seq) - self.w - 1):]
        window[slot, self.w + 1 - len(tail):] = tail
    index = np.array([len(c.tokens) if c else 0 for c in slot_of], np.int32)
    paged_args = () if self.pages is None else (
        self.pages.table(np.arange(self.slots), int(fed.max()) + self.k + 1),
        self.pages.shared_rows())
    self.cache, self.hidden, out = _speculate_and_sample(
        self.cfg, self.params, self.cache, self.hidden, window, fed, active,
        *self._slot_arrays(requests)[:2], index, *paged_args,
        k=self.k, mtp_cache=self.mtp_cache, return_logits=self.return_logits,
        paging=self.paging)
    accepted, num_emitted, tokens, logprobs, raws, logits = jax.device_get(out)
    for slot in np.flatnonzero(active):
      c = slot_of[slot]
      emitted = [int(t) for t in tokens[slot, :num_emitted[slot]]]
      stops = [j for j, t in enumerate(emitted) if t in c.request.stop_tokens]
      limit = min(c.request.max_new_tokens - len(c.tokens), stops[0] + 1 if stops else NO_LIMIT)
      kept = min(len(emitted), limit)
      c.accept = add_step(c.accept, accepted[slot:slot + 1], np.array([limit], np.int32))
      self._keep(c, [(tokens[slot, j], logprobs[slot, j], raws[slot, j],
                      None if logits is None else logits[slot, j]) for j in range(kept)])
      yield slot, c


# ---- jitted device functions -----------------------------------------------------------------


def _host_settings(requests) -> sampling.SamplingParams:
  """Per-slot sampling settings as numpy arrays (a program given them copies them with its
  call: no op dispatched per array); None (an idle slot) samples greedily, unused."""
  return sampling.SamplingParams(
      np.array([r.temperature if r else 0.0 for r in requests], np.float32),
      np.array([r.top_k if r else 0 for r in requests], np.int32),
      np.array([r.top_p if r else 1.0 for r in requests], np.float32))


def _host_seeds(requests):
  return np.array([r.seed if r else 0 for r in requests], np.uint32)


class _Admission(typing.NamedTuple):
  """One admission laid out for the device (`Engine._plan`): P prefill rows (a power of two;
  padding rows have slot id B and length 0).

  keys: per real row, its key: `(prompt, 0)` a fresh prompt (its group's one prefill) or
    `(prompt, -1 - slot)` a session's continuation in its own slot.
  slot_ids_P, lengths_P, starts_P: int32 each row's slot, prompt length and first position
    to prefill (a held session's length, else 0).
  tokens: int32 `[P, n * C + k]`, each row's tokens from its start (n chunks), and k
    lookahead tokens past the last chunk (the MTP depths read t_{i+d}), zeros past the prompt.
  rows_B: int32 `[B]` each admitted request's row (its first token's logits), 0 for padding.
  copies: (source slot, destination slot) per group follower.
  page_copies: paged: (source page, destination page) per page a follower copies.
  """
  keys: list
  slot_ids_P: np.ndarray
  lengths_P: np.ndarray
  starts_P: np.ndarray
  tokens: np.ndarray
  rows_B: np.ndarray
  copies: list
  page_copies: list


def _prefilled_routing(plan: _Admission, chunk_routing: list, admitted: int) -> list:
  """Each of the first `admitted` requests' prompt routing `{kind: [len(prompt), N, k]}` from
  its row of the chunks' `{kind: [P, C, N, k]}`: the rows it prefilled here; a held session's
  earlier rows are -1 (recorded by the turns that fed them)."""
  per_row = []
  for i, (prompt, _) in enumerate(plan.keys):
    start, routing = int(plan.starts_P[i]), {}
    for kind in chunk_routing[0]:
      rows = np.concatenate([r[kind][i] for r in chunk_routing])[:len(prompt) - start]
      full = np.full((len(prompt),) + rows.shape[1:], -1, rows.dtype)
      full[start:] = rows
      routing[kind] = full
    per_row.append(routing)
  return [per_row[row] for row in plan.rows_B[:admitted]]


def _row(out, i):
  tokens, logprobs, raw, logits, top = out
  row = (tokens[i], logprobs[i], raw[i], None if logits is None else logits[i])
  return row if top is None else row + ((top[0][i], top[1][i]),)


def _finish_routing(routing: dict) -> dict:
  """Recorded row blocks -> `{kind: [n, N, k]}` with a -1 row for the last token (never fed)."""
  out = {}
  for kind, blocks in routing.items():
    unfed = np.full((1,) + blocks[0].shape[1:], -1, np.int32)
    out[kind] = np.concatenate([np.asarray(b, np.int32) for b in blocks] + [unfed])
  return out


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


def _prefill_chunk_body(cfg, params, sub, last_PY, hidden_PWD, tokens_PX, lengths_P, start_P, *,
                        depths, mtp_cache, record_routing=False):
  """One prefill chunk of P prompts, row p at positions `start_P[p] .. start_P[p] + C - 1`,
  into their gathered caches `sub` (and, with `depths` = k > 0, the MTP caches:
  `speculate.prefill_mtp`). Rows start where their cache ends: 0 for a fresh prompt, a held
  session's length for its new tokens.

  Args:
    last_PY: fp32 logits at each prompt's last token, where an earlier chunk held it.
    hidden_PWD: h at each prompt's last W positions, where earlier chunks held them.
    tokens_PX: int32 this chunk of each prompt and the k tokens after it (anything past the
      prompt's length), X = C + k.
    lengths_P: int32 prompt lengths (0 for padding rows: nothing written).
    start_P: int32 each row's first position in this chunk.
  Returns:
    `(sub, last_PY, hidden_PWD, routing)`, updated for the prompt positions in this chunk: the
    logits at a prompt's last token predict its first generated token; routing (with
    `record_routing`, else {}) `{kind: [P, C, N, k]}` of the chunk's tokens.
  """
  p, c = tokens_PX.shape[0], tokens_PX.shape[1] - depths
  positions_PC = start_P[:, None] + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (p, c))
  real_PC = positions_PC < lengths_P[:, None]
  out = decode_step(cfg, params, sub, tokens_PX[:, :c], positions_PC, real_PC.astype(jnp.int32),
                    return_routing=record_routing)
  sub = out.cache
  last_P = lengths_P - 1 - start_P
  logits_PY = jnp.take_along_axis(out.logits_BQY, jnp.clip(last_P, 0, c - 1)[:, None, None],
                                  axis=1)[:, 0]
  ends_here_P = (last_P >= 0) & (last_P < c)
  last_PY = jnp.where(ends_here_P[:, None], logits_PY, last_PY)
  if depths:
    sub = speculate.prefill_mtp(cfg, params, sub, out.hidden_BQD, tokens_PX, positions_PC,
                                lengths_P, depths=depths, mtp_cache=mtp_cache)
    w = hidden_PWD.shape[1]
    # Window row of each chunk position (W, dropped, outside the prompt's last W).
    row_PC = positions_PC - (lengths_P[:, None] - w)
    row_PC = jnp.where(real_PC & (row_PC >= 0), row_PC, w)
    hidden_PWD = jax.vmap(lambda h, rows, new: h.at[rows].set(new, mode="drop"))(
        hidden_PWD, row_PC, out.hidden_BQD.astype(hidden_PWD.dtype))
  return sub, last_PY, hidden_PWD, out.routing


_prefill_chunk = functools.partial(jax.jit, static_argnames=(
    "cfg", "depths", "mtp_cache", "record_routing"), donate_argnames=("sub",))(
        _prefill_chunk_body)


@functools.partial(jax.jit, static_argnames=("cfg", "depths", "mtp_cache", "record_routing",
                                             "paging", "return_logits", "top_n"),
                   donate_argnames=("cache", "hidden_BWD"))
def _paged_admit(cfg, params, cache, hidden_BWD, table_PN, slot_ids_P, tokens_PX, lengths_P,
                 start_P, last_PY, hidden_PWD, rows_B, settings, seeds_B, adjust, *, depths,
                 mtp_cache,
                 record_routing, paging, return_logits, top_n):
  """One prefill chunk of an admission with all that follows it, one program, so that an
  admission of one chunk costs one dispatch and a longer one reruns the same program:

    1. `_prefill_chunk` on the paged cache: rows `slot_ids_P` (ids >= B: padding) read their
       pages through `table_PN` (`glm5_jax.infer.paged.view`), the chunk's prompt rows go
       back into their pages, the per-slot arrays into their slots;
    2. the rows' h windows (`hidden_PWD`, so far) into their slots of `hidden_BWD` (ids >= B
       dropped; a later chunk rewrites them);
    3. `_first_tokens` from the prompts' last logits so far (final after the last chunk;
       the caller keeps the last chunk's).

  Returns `(cache, hidden_BWD, (last_PY, hidden_PWD), first tokens as _sample's, routing)`,
  routing `{kind: [P, C, N, k]}` padded to the contiguous cache's DSA width (with
  `record_routing`, else {})."""
  sub = paged.view(cache, table_PN, *paging.layout, slot_ids_P)
  sub, last_PY, hidden_PWD, routing = _prefill_chunk_body(
      cfg, params, sub, last_PY, hidden_PWD, tokens_PX, lengths_P, start_P, depths=depths,
      mtp_cache=mtp_cache, record_routing=record_routing)
  c = tokens_PX.shape[1] - depths
  rows_PC = start_P[:, None] + jnp.arange(c, dtype=jnp.int32)
  cache = paged.write_back(cache, sub, table_PN, rows_PC, rows_PC < lengths_P[:, None],
                           *paging.layout, slot_ids_P)
  hidden_BWD = hidden_BWD.at[slot_ids_P].set(hidden_PWD, mode="drop")
  out = _first_tokens(last_PY, rows_B, settings, seeds_B, adjust, return_logits=return_logits,
                      top_n=top_n)
  return cache, hidden_BWD, (last_PY, hidden_PWD), out, _pad_topk(routing, paging.topk_width)


class Paging(typing.NamedTuple):
  """The static facts a paged step needs: `layout` = `paged.page_layout` of the cache specs,
  and `topk_width`, the DSA selection width of the contiguous cache (min(index_topk,
  max_len)), to which recorded routing is padded whatever the view's width."""
  layout: tuple
  topk_width: int


def _pad_topk(routing: dict, width: int) -> dict:
  """Recorded DSA keys `[..., T]` padded with -1 (empty) to `width`: a view narrower than
  index_topk selects fewer slots, all else is the same selection."""
  if "dsa" not in routing:
    return routing
  t = routing["dsa"].shape[-1]
  pad = [(0, 0)] * (routing["dsa"].ndim - 1) + [(0, width - t)]
  return {**routing, "dsa": jnp.pad(routing["dsa"], pad, constant_values=-1)}


@functools.partial(jax.jit, static_argnames=("slot_axes",), donate_argnames=("cache",))
def _copy_slots(cache, src_G, dst_G, slot_axes):
  """Prefix sharing: slot `dst_G[i]` gets a copy of slot `src_G[i]`'s cache."""
  sub = _gather_slots(cache, src_G, slot_axes)
  return _scatter_slots(cache, sub, dst_G, slot_axes)


@functools.partial(jax.jit, static_argnames=("layout",), donate_argnames=("cache", "hidden_BWD"))
def _share_prefix(cache, hidden_BWD, src_G, dst_G, src_slots_G, dst_slots_G, *, layout):
  """A group's copy-on-write after its leader's prefill: `paged.copy_pages` (pages `src_G` to
  `dst_G`, the per-slot leaves of slots `src_slots_G` to `dst_slots_G`) and the speculative h
  windows of the same slots (ids past the pool / slots: padding, dropped)."""
  cache = paged.copy_pages(cache, src_G, dst_G, src_slots_G, dst_slots_G, *layout)
  hidden_BWD = hidden_BWD.at[dst_slots_G].set(
      jnp.take(hidden_BWD, src_slots_G, axis=0, mode="fill", fill_value=0), mode="drop")
  return cache, hidden_BWD


@functools.partial(jax.jit, static_argnames=("return_logits", "top_n"))
def _first_tokens(last_PY, rows_B, settings, seeds_B, adjust, *, return_logits, top_n):
  """Token 0 of each admitted request from the last logits of its prefill row `rows_B`
  (`[B]`, padding rows sample unused tokens; `adjust`: the slots' `penalties.Penalties`, of
  which only the bias acts on a first token); `_sample`'s outputs, B rows."""
  return _sample(last_PY[rows_B], settings, seeds_B, jnp.zeros(rows_B.shape, jnp.int32),
                 adjust, return_logits=return_logits, top_n=top_n)


@functools.partial(jax.jit, static_argnames=("return_logits", "top_n"))
def _sample(logits_BY, settings, seeds_B, index_B, adjust, counts_BY=None, *, return_logits,
            top_n=0):
  """Samples one token per row from the logits adjusted by `adjust` (`penalties.adjust`, with
  the generated tokens' `counts_BY`; None: none yet); returns `(tokens, logprobs, raw_logprobs,
  logits or None, top or None)`, top = (ids [B, N], raw log-probs [B, N]) of the N most likely
  tokens. "Raw" log-probs are the adjusted logits' at temperature 1; `logits` the model's own."""
  adjusted_BY = penalties.adjust(logits_BY, adjust, counts_BY)
  out = sampling.sample(adjusted_BY, settings, seeds_B, index_B)
  top = None
  if top_n:
    values, ids = jax.lax.top_k(jax.nn.log_softmax(adjusted_BY, axis=-1), top_n)
    top = (ids, values)
  return (out.tokens, out.logprobs, out.raw_logprobs, logits_BY if return_logits else None,
          top)


@functools.partial(jax.jit, static_argnames=("cfg", "return_logits", "record_routing", "top_n",
                                             "paging"), donate_argnames=("cache", "counts_BY"))
def _decode_and_sample(cfg, params, cache, counts_BY, pending_B, fed_B, active_B, settings,
                       seeds_B, adjust, index_B, table_BN=None, *, return_logits,
                       record_routing=False, top_n=0, paging=None):
  """Feeds each active slot's pending token at its next position and samples token
  `index_B` of its request, its logits adjusted by `adjust` and the counts of its generated
  tokens (`counts_BY`, updated with the pending token: `penalties.count_fed`). Returns
  `(cache, counts_BY, (tokens, logprobs, raw_logprobs, logits, top), routing)` (routing
  `{kind: [B, 1, N, k]}` with `record_routing`, else {}). With `paging` (a `Paging`), `cache`
  is paged and each slot reads the N pages of `table_BN`."""
  step_cache = cache if paging is None else paged.read_in_place(cache, table_BN, *paging.layout)
  out = decode_step(cfg, params, step_cache, pending_B[:, None], fed_B[:, None],
                    active_B[:, None].astype(jnp.int32), return_routing=record_routing)
  new_cache, routing = out.cache, out.routing
  if paging is not None:  # the active slots' rows at fed_B went into their pages in place
    new_cache = paged.pools(new_cache)
    routing = _pad_topk(routing, paging.topk_width)
  counts_BY = penalties.count_fed(counts_BY, pending_B, index_B, active_B)
  return new_cache, counts_BY, _sample(out.logits_BQY[:, 0], settings, seeds_B, index_B, adjust,
                                       counts_BY, return_logits=return_logits,
                                       top_n=top_n), routing


@functools.partial(jax.jit, static_argnames=("cfg", "k", "mtp_cache", "return_logits",
                                             "paging"), donate_argnames=("cache", "hidden_BWD"))
def _speculate_and_sample(cfg, params, cache, hidden_BWD, window_BX, fed_B, active_B, settings,
                          seeds_B, index_B, table_BN=None, shared_rows_B=None, *, k, mtp_cache,
                          return_logits, paging=None):
  """`speculate.speculative_step`; returns `(cache, hidden_BWD, (accepted, num_emitted,
  tokens, logprobs, raw_logprobs, logits or None))`. With `paging`, the step reads the pages
  of `table_BN` and writes back the rows F-W .. F+k it may have written (never a row below
  `shared_rows_B`, in pages other slots share)."""
  step_cache = cache if paging is None else paged.view(cache, table_BN, *paging.layout)
  out = speculate.speculative_step(cfg, params, step_cache, hidden_BWD, window_BX, fed_B,
                                   active_B, settings, seeds_B, index_B, k=k,
                                   mtp_cache=mtp_cache)
  new_cache = out.cache
  if paging is not None:
    w = hidden_BWD.shape[1]
    rows_BR = fed_B[:, None] + jnp.arange(-w, k + 1, dtype=jnp.int32)
    keep_BR = active_B[:, None] & (rows_BR >= shared_rows_B[:, None])
    new_cache = paged.write_back(cache, out.cache, table_BN, rows_BR, keep_BR, *paging.layout)
  v = out.verified
  return new_cache, out.hidden_BWD, (v.accepted, v.num_emitted, v.tokens, v.logprobs,
                                     v.raw_logprobs, out.logits_BQY if return_logits else None)


def generate(config, params, prompts, max_new_tokens=32, temperature=0.0, top_p=1.0, top_k=0,
             seed=0, speculative_steps=0, return_logits=False, stop_tokens=(), *,
             slots: int | None = None, max_len: int | None = None, prefill_chunk: int = 256,
             mtp_cache: str = "per_depth", mesh=None, rules=None, page_size: int | None = 16,
             num_pages: int | None = None) -> GenerateResult:
  """Completes every prompt (see the module docstring; `GenerateResult` for the fields).

  Args:
    config: the model section or a `ModelConfig`. params: its params.
    prompts: a list of token-id lists (of any lengths >= 1).
    max_new_tokens, temperature, top_p, top_k, stop_tokens: per request, as `Request`.
    seed: prompt i draws with `request_seed(seed, i)`.
    speculative_steps: MTP draft steps per verification (0: plain decoding). The output has
      exactly the distribution of plain decoding (greedy: the same tokens).
    return_logits: also return each generated token's raw logits.
    slots: sequences decoded at once (default: the number of prompts rounded up to a power of
      two, at most 32: one compiled shape for many call sizes).
    max_len: cache positions per slot (default: what the longest request needs, rounded up to
      a power of two of at least `MIN_GENERATE_LEN`, so that new lengths reuse the compiled
      steps; with the paged cache a larger max_len costs no step time).
    prefill_chunk: prompt tokens per slot per prefill call.
    mtp_cache: the MTP caches' scheme with speculative_steps > 0 (`glm5_jax.infer.speculate`).
    mesh, rules: serve sharded (`Engine`).
    page_size, num_pages: the paged cache (`Engine`; page_size None: contiguous).
  Raises:
    ValueError: a bad argument (`glm5_jax.infer.requests.validate_generate_args`).
  """
  cfg = ModelConfig.from_config(config)
  if slots is not None and (not isinstance(slots, int) or isinstance(slots, bool) or slots < 1):
    raise ValueError(f"slots must be None (all prompts, at most 32) or an int >= 1; got "
                     f"{slots!r}")
  if max_len is None:  # what the longest request needs (validation below names bad input)
    lengths = [len(p) for p in prompts if hasattr(p, "__len__")] if hasattr(
        prompts, "__iter__") else []
    extra = max_new_tokens - 1 + speculative_steps if isinstance(
        max_new_tokens, int) and isinstance(speculative_steps, int) else 0
    max_len = max(_bucket(max(max(lengths, default=1) + max(extra, 0), 1), 1 << 62),
                  MIN_GENERATE_LEN)
  requests = validate_generate_args(
      prompts, vocab_size=cfg.vocab_size, max_len=max_len,
      max_positions=cfg.max_position_embeddings, max_new_tokens=max_new_tokens,
      temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
      speculative_steps=speculative_steps, return_logits=return_logits, stop_tokens=stop_tokens)
  requests = [dataclasses.replace(r, seed=request_seed(seed, r.index)) for r in requests]
  engine = Engine(cfg, params, slots=slots or _bucket(min(len(requests), 32), 32),
                  max_len=max_len, prefill_chunk=prefill_chunk, return_logits=return_logits,
                  speculative_steps=speculative_steps, mtp_cache=mtp_cache, mesh=mesh,
                  rules=rules, page_size=page_size, num_pages=num_pages)
  done = engine.run(requests)
  spec = bool(speculative_steps)
  return GenerateResult(
      tokens=[c.tokens for c in done], logprobs=[c.logprobs for c in done],
      raw_logprobs=[c.raw_logprobs for c in done],
      logits=[np.stack(c.logits) for c in done] if return_logits else None,
      accept_lengths=[c.accept_length() for c in done] if spec else None,
      acceptance_rates=[c.acceptance_rates() for c in done] if spec else None)
