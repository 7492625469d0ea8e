"""The slot engine: continuous batching and prefix sharing over the cached steps.

A fixed number of slots B share one preallocated cache (`glm5_jax.infer.cache`), by default
paged (`page_size`; `glm5_jax.infer.paged`, `paged_slots`): the row-indexed caches live in a
pool of pages reserved per request at admission and returned when it ends, each step reads only
the live slots' pages (their count bucketed to a power of two), and a group's followers
reference the leader's prompt pages instead of copying them. `page_size=None` keeps the
contiguous `[B, max_len]` cache. The host loop keeps a queue of requests and, each iteration:

  1. places waiting requests in free slots (`_place`: a held session's request in its own
     slot, the rest in queue order, evicting held sessions when no slot or no pages are free)
     and admits them (`glm5_jax.infer.admission`): one prefill per distinct prompt, shared by
     its group, chunked and padded to a power-of-two number of rows, so admission compiles at
     most log2(B) + 1 programs whatever the traffic (paged: times the page buckets);
  2. samples each admitted request's first token from its prompt's last logits;
  3. runs one decode step over all B slots (idle slots are padding, `segment_ids` 0, and change
     nothing), samples one token per slot, and frees the slots whose request ended (a stop token,
     kept in the output, or `max_new_tokens`). A freed slot takes the next request in the next
     iteration with no recompile: every shape is fixed by B, max_len and the chunk (paged:
     and the page bucket; `warmup()`, `glm5_jax.infer.warmup`, compiles every bucket up front).

The compiled programs of both phases are `glm5_jax.infer.programs`; this file is the host side:
the queue, the slots, and the device state (`cache`, `hidden`, `counts`) the programs replace.

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

Notation (docs/design.md): B slots, W the speculative h window, Y vocab, D hidden.
"""

import collections
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import sharding as sharding_lib
from glm5_jax.api import abstract_params_and_axes
from glm5_jax.attention.cache_spec import CacheSpec
from glm5_jax.config import ModelConfig
from glm5_jax.infer import penalties, programs, speculate
from glm5_jax.infer.accept_stats import NO_LIMIT, add_step, init_accept_stats
from glm5_jax.infer.admission import Admission, bucket
from glm5_jax.infer.cache import allocate, cache_specs, init_cache
from glm5_jax.infer.paged_slots import PagedSlots
from glm5_jax.infer.requests import (Completion, Event, GenerateResult, Request,
                                     validate_generate_args)
from glm5_jax.infer.sessions import PrefixStats, SessionTable, reusable
from glm5_jax.infer.warmup import Warmup
from glm5_jax.layers.axes import BATCH
from glm5_jax.layers.params import dtypes
from glm5_jax.seeds import derive_seed


# `generate`'s smallest default max_len: short calls share one set of compiled steps.
MIN_GENERATE_LEN = 64


def request_seed(seed: int, index: int) -> int:
  """The uint32 seed of prompt `index` of a `generate` call with `seed`: a hash of both, so the
  G copies of one prompt in an RL group draw differently, and a call's streams do not overlap
  another seed's (as `seed + index` would)."""
  return derive_seed(seed, index)


class Engine(Admission, Warmup):
  """Continuous batching over `slots` sequences of up to `max_len` positions.

  This class is the host loop and its scheduling (module docstring); its admission and prefill
  are `Admission`'s methods (`glm5_jax.infer.admission`), `warmup` is `Warmup`'s
  (`glm5_jax.infer.warmup`), and the device programs are `glm5_jax.infer.programs`.

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
      self.paging = programs.Paging(self.pages.layout, min(self.cfg.index_topk, max_len))
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
    `(slot, request, start, handle)`, `start` the cache rows kept (a held session's, else 0).
    Requests of held sessions go to their slots; the rest take free slots in queue order,
    evicting held sessions LRU-first when none is free."""
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

  def _slot_arrays(self, requests):
    """`(settings, seeds, penalties)` of the slots' requests, rebuilt only when a slot changes
    hands (decode steps in between reuse the device arrays instead of copying them again)."""
    key = tuple(requests)  # by value: equal requests have equal settings
    if self._slot_arrays_memo[0] != key:
      # One transfer for the arrays (ops building them would be a dispatch each).
      self._slot_arrays_memo = (key, jax.device_put((
          programs.host_settings(requests), programs.host_seeds(requests),
          penalties.host_penalties(requests))))
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
    self.cache, self.counts, out, routing = programs.decode_and_sample(
        self.cfg, self.params, self.cache, self.counts, pending, fed, active,
        *self._slot_arrays(requests), index, table,
        return_logits=self.return_logits, record_routing=self.record_routing,
        top_n=self.top_n, paging=self.paging)
    out, routing = jax.device_get((out, routing))
    for slot in np.flatnonzero(active):
      self._keep(slot_of[slot], [programs.sampled_row(out, slot)])
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
    self.cache, self.hidden, out = programs.speculate_and_sample(
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


def _finish_routing(routing: dict) -> dict:
  """Recorded row blocks -> `{kind: [n, N, k]}` with a -1 row for the last token (never fed)."""
  out = {}
  for kind, blocks in routing.items():
    unfed = np.full((1,) + blocks[0].shape[1:], -1, np.int32)
    out[kind] = np.concatenate([np.asarray(b, np.int32) for b in blocks] + [unfed])
  return out


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
    max_len = max(bucket(max(max(lengths, default=1) + max(extra, 0), 1), 1 << 62),
                  MIN_GENERATE_LEN)
  requests = validate_generate_args(
      prompts, vocab_size=cfg.vocab_size, max_len=max_len,
      max_positions=cfg.max_position_embeddings, max_new_tokens=max_new_tokens,
      temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
      speculative_steps=speculative_steps, return_logits=return_logits, stop_tokens=stop_tokens)
  requests = [dataclasses.replace(r, seed=request_seed(seed, r.index)) for r in requests]
  engine = Engine(cfg, params, slots=slots or bucket(min(len(requests), 32), 32),
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
