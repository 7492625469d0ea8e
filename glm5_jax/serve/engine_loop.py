"""The one engine thread of a server: every request goes through one `infer.Engine`, so
concurrent requests are batched continuously (a request's tokens do not depend on its
neighbours: `glm5_jax.infer.engine`).

Callers on any thread `submit` a `Request` and get a `Stream` of its `Event`s; `cancel(stream)`
frees its slot at the engine's next iteration (a client that disconnects). Commands travel
through one bounded queue, so the engine is touched by its own thread only; a full queue is
`QueueFull` at once (the server answers 503) instead of an unbounded backlog; a loop whose
engine raised refuses with `Stopped`. The loop runs
`engine.step()` while anything is in flight and blocks on the queue when idle.
"""

import asyncio
import dataclasses
import queue
import threading
import time

from glm5_jax.infer.engine import Engine, Event
from glm5_jax.infer.requests import Request


class QueueFull(Exception):
  """The loop's bounded submission queue is full (`max_queue` waiting)."""


class Stopped(Exception):
  """The loop takes no requests: closed, or its engine raised (`EngineLoop.error`)."""


@dataclasses.dataclass(frozen=True)
class Refused:
  """An item of `engine.step()`'s list in place of an `Event`: the engine refused the request
  of `handle` after `submit` returned (an engine in another process checks a request when it
  receives it, with its next step: `glm5_jax.serve.engine_process`). Its stream gets
  `ValueError(message)`, as if `submit` had raised it."""
  handle: int
  message: str


class Stream:
  """One request's events, in order; `None` after its last one (finished or cancelled), or an
  exception the engine raised for it (e.g. a ValueError from `Engine.submit`).

  Read from a thread with `get` / iteration; or, submitted with an asyncio loop, with `await
  aget()`, or through an `inbox` (an asyncio.Queue several streams share) that receives
  `(stream, item)` pairs: one consumer per HTTP request, whatever its `n`. A `whole` stream
  gets one `Event` with every token (and the completion) when its request ends, or what it had
  when it is cancelled."""

  def __init__(self, aloop=None, inbox: asyncio.Queue | None = None, whole: bool = False):
    self._events = queue.Queue() if aloop is None else None  # a thread reader's
    self.handle: int | None = None
    # `whole`: the events are merged into one, delivered when the request ends (a reader
    # that waits for the whole reply is woken once, not once per step).
    self.whole, self._merged = whole, []
    # With an asyncio loop, events go to an asyncio.Queue instead: a blocked thread per
    # waiting stream would exhaust the executor with many streams.
    self._aloop = aloop
    self._tagged = inbox is not None
    self._aevents = inbox if inbox is not None else (
        asyncio.Queue() if aloop is not None else None)

  def _item(self, item):
    return (self, item) if self._tagged else item

  async def aget(self):
    """`get` for a stream submitted with an asyncio loop (and no inbox)."""
    item = await self._aevents.get()
    if isinstance(item, Exception):
      raise item
    return item

  def get(self, timeout: float | None = None):
    """The next `Event`, `None` at the end; raises what the engine raised for the request."""
    item = self._events.get(timeout=timeout)
    if isinstance(item, Exception):
      raise item
    return item

  def __iter__(self):
    while (event := self.get()) is not None:
      yield event


def _merge(events: list) -> Event:
  """One request's events as one (its tokens and log-probs in order, the last completion)."""
  tops = [e.top_logprobs for e in events]
  return Event(events[0].handle, [t for e in events for t in e.tokens],
               [x for e in events for x in e.logprobs],
               [x for e in events for x in e.raw_logprobs],
               None if tops[0] is None else [x for top in tops for x in top],
               events[-1].completion)


def _drain(commands: queue.Queue) -> list:
  out = []
  while True:
    try:
      out.append(commands.get_nowait())
    except queue.Empty:
      return out


def _put_all(items) -> None:
  for inbox, item in items:
    inbox.put_nowait(item)


class EngineLoop:
  """Owns `engine` on a daemon thread.

  Args:
    engine: the engine (touched by the loop's thread only from now on).
    max_queue: submissions waiting for the thread (and, counted with them, requests held or
      waiting in the engine for a slot) before `QueueFull`.
    admit_after_steps: while requests are decoding, new ones are held and handed to the engine
      together, at the latest after this many steps (at once when the engine is idle or the
      held requests fill its free slots). Requests arriving one by one would otherwise each
      cost an admission of their own (a prefill call, its first-token sampling, the
      host-device round trips), several times a decode step; 0 admits at every step. The
      policy of text-generation-inference's `max_waiting_tokens`.
    admit_window_s: an idle engine holds arrivals until none has come for this long (at most
      `4 * admit_window_s` after the first), or until they fill its slots. Clients answered at
      the same step send their next requests within milliseconds of each other; admitted one
      by one, the first starts a decode step alone and the rest join a step later, so the
      group finishes out of step and every round decodes partial batches. 0 admits at once
      (as Triton's `max_queue_delay_microseconds`, with the wait renewed by each arrival).
  """

  def __init__(self, engine: Engine, *, max_queue: int = 256, admit_after_steps: int = 0,
               admit_window_s: float = 0.0):
    if not isinstance(max_queue, int) or max_queue < 1:
      raise ValueError(f"EngineLoop: max_queue must be an int >= 1, got {max_queue!r}")
    if not isinstance(admit_after_steps, int) or admit_after_steps < 0:
      raise ValueError(f"EngineLoop: admit_after_steps must be an int >= 0, got "
                       f"{admit_after_steps!r}")
    if not isinstance(admit_window_s, (int, float)) or not 0 <= admit_window_s <= 10:
      raise ValueError(f"EngineLoop: admit_window_s must be a number of seconds in [0, 10], "
                       f"got {admit_window_s!r}")
    self.engine, self.max_queue, self.admit_after = engine, max_queue, admit_after_steps
    self.admit_window = float(admit_window_s)
    self._held: list = []  # (request, stream) not handed to the engine yet
    self._held_since = 0  # `steps` when the oldest held request arrived
    self._held_at = self._held_last = 0.0  # its time.monotonic(), and the newest's
    self._commands: queue.Queue = queue.Queue()
    self._pending = 0  # submitted, not yet admitted to a slot (commands + engine's waiting)
    # Submit commands queued and not yet taken by the loop: `_pending` is recounted from it,
    # not from the queue's size, which holds cancels too (the app cancels every stream whose
    # reply ended, so counting them left `waiting()` above 0 once the engine went idle).
    self._queued_submits = 0
    self._lock = threading.Lock()
    self._streams: dict[int, Stream] = {}
    self._stop = False
    self.error: Exception | None = None  # what broke the engine thread, if anything did
    self.tokens_generated = 0
    self.steps = 0  # engine steps run, and the running slots summed over them: their ratio is
    self.slot_steps = 0  # the mean decode batch (are concurrent requests batched?)
    # Items for streams, delivered after each command batch / step: one wake-up of each
    # asyncio loop per step (`call_soon_threadsafe` per stream costs a syscall each).
    self._outbox: list = []
    self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
    self._thread.start()

  def submit(self, request: Request, aloop=None, inbox: asyncio.Queue | None = None,
             whole: bool = False) -> Stream:
    """Queues `request`; its events come back on the returned stream (on `aloop`, an asyncio
    event loop, when given: read them with `await stream.aget()`, or from `inbox`), merged into
    one at its end when `whole` (`Stream`)."""
    self._check_open()
    with self._lock:
      if self._pending >= self.max_queue:
        raise QueueFull(f"{self._pending} requests waiting, max_queue={self.max_queue}")
      self._pending += 1
      self._queued_submits += 1
    stream = Stream(aloop, inbox, whole)
    self._commands.put(("submit", request, stream))
    return stream

  def submit_all(self, requests, aloop=None, inbox: asyncio.Queue | None = None,
                 whole: bool = False) -> list[Stream]:
    """`submit` of every request, or of none: QueueFull when the queue has no room for all of
    them (one request's choices never half fill the queue and turn other clients away)."""
    requests = list(requests)
    self._check_open()
    with self._lock:
      if self._pending + len(requests) > self.max_queue:
        raise QueueFull(f"{self._pending} requests waiting, {len(requests)} more asked for, "
                        f"max_queue={self.max_queue}")
      self._pending += len(requests)
      self._queued_submits += len(requests)
    streams = [Stream(aloop, inbox, whole) for _ in requests]
    for request, stream in zip(requests, streams):
      self._commands.put(("submit", request, stream))
    return streams

  def _check_open(self) -> None:
    if self._stop or self.error is not None:
      raise Stopped(f"the engine loop is {'closed' if self._stop else 'broken'}"
                    + (f": {type(self.error).__name__}: {self.error}" if self.error else ""))

  def cancel(self, stream: Stream) -> None:
    self._commands.put(("cancel", None, stream))

  def waiting(self) -> int:
    return self._pending

  def running(self) -> int:
    return self.engine.running()

  def close(self) -> None:
    self._stop = True
    self._commands.put(("stop", None, None))
    self._thread.join()

  def _run(self) -> None:
    try:
      while not self._stop:
        self._iterate()
    except Exception as e:  # the engine is broken: every request in flight hears why
      self.error = e  # from now on `submit` refuses
      waiting = [s for kind, _, s in _drain(self._commands) if kind == "submit"]
      for stream in [*self._streams.values(), *(s for _, s in self._held), *waiting]:
        self._put(stream, e)
      self._flush()
      raise

  def _iterate(self) -> None:
    try:  # block only when the engine has nothing to do
      self._command(*self._commands.get(**self._wait()))
      while True:
        self._command(*self._commands.get_nowait())
    except queue.Empty:
      pass
    self._admit_held()
    self._flush()
    if self._stop or not self.engine.busy:
      return
    events = self.engine.step()
    self.steps += 1
    self.slot_steps += self.engine.running() + sum(
        isinstance(e, Event) and e.completion is not None for e in events)
    with self._lock:
      self._pending = self.engine.waiting() + len(self._held) + self._queued_submits
    for event in events:
      self._deliver(event)
    self._flush()

  def _put(self, stream: Stream, item) -> None:
    if stream._aloop is None:
      stream._events.put(item)
    else:
      self._outbox.append((stream._aloop, stream._aevents, stream._item(item)))

  def _flush(self) -> None:
    if not self._outbox:
      return
    by_loop: dict = {}
    for aloop, inbox, item in self._outbox:
      by_loop.setdefault(aloop, []).append((inbox, item))
    self._outbox = []
    for aloop, items in by_loop.items():
      try:
        aloop.call_soon_threadsafe(_put_all, items)
      except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass

  def _deliver(self, event: Event | Refused) -> None:
    stream = self._streams.get(event.handle)
    if stream is None:
      return
    if isinstance(event, Refused):
      del self._streams[event.handle]
      self._put(stream, ValueError(event.message))
      return
    self.tokens_generated += len(event.tokens)
    if stream.whole:
      stream._merged.append(event)
      if event.completion is None:
        return
      event = _merge(stream._merged)
    self._put(stream, event)
    if event.completion is not None:
      del self._streams[event.handle]
      self._put(stream, None)

  def _wait(self) -> dict:
    """`queue.get` arguments for the next command: no wait while the engine has work or held
    requests are due; until the admission window closes while an idle engine holds requests;
    else until a command comes."""
    if self.engine.busy:
      return dict(block=False)
    if not self._held:
      return dict(block=True)
    left = self._window_left()
    return dict(block=True, timeout=left) if left > 0 else dict(block=False)

  def _window_left(self) -> float:
    """Seconds until an idle engine admits what it holds (`admit_window_s`)."""
    return min(self._held_last, self._held_at + 3 * self.admit_window) + self.admit_window - (
        time.monotonic())

  def _admit_held(self) -> None:
    """Hands the held requests to the engine when they fill its free slots; else, while it
    decodes, when the oldest has waited `admit_after_steps` steps, and when it is idle, once
    the window of `admit_window_s` closed."""
    if not self._held:
      return
    free = self.engine.slots - self.engine.running() - self.engine.waiting()
    if len(self._held) < free and (
        self.steps - self._held_since < self.admit_after if self.engine.busy
        else self._window_left() > 0):
      return
    held, self._held = self._held, []
    for i, (request, stream) in enumerate(held):
      try:
        stream.handle = self.engine.submit(request)
        self._streams[stream.handle] = stream
      except ValueError as e:  # this request cannot run here
        with self._lock:
          self._pending -= 1
        self._put(stream, e)
      except Exception:  # the engine broke: the rest are still waiting (`_run` tells them)
        self._held = held[i:] + self._held
        raise
      self._admitted(request, stream)

  def _admitted(self, request: Request, stream: Stream) -> None:
    """Called once `request` was handed to the engine: `stream.handle` set, or None when
    `Engine.submit` refused it (a subclass's hook: `glm5_jax.serve.versions`)."""

  def _command(self, kind, request, stream) -> None:
    if kind == "submit":
      with self._lock:
        self._queued_submits -= 1
      now = time.monotonic()
      if not self._held:
        self._held_since, self._held_at = self.steps, now
      self._held_last = now
      self._held.append((request, stream))
    elif kind == "cancel" and any(s is stream for _, s in self._held):
      self._held = [(r, s) for r, s in self._held if s is not stream]
      with self._lock:
        self._pending -= 1
      self._put(stream, None)
    # A stream that ended is not asked of the engine (the app cancels every stream when its
    # reply is done: for an engine process that would be a round trip per request).
    elif kind == "cancel" and stream.handle in self._streams:
      if self.engine.cancel(stream.handle) and self._streams.pop(stream.handle, None):
        if stream._merged:  # what it had (a reader may still be there)
          self._put(stream, _merge(stream._merged))
        self._put(stream, None)
