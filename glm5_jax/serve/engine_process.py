"""An `infer.Engine` in a process of its own, driven by the server's engine thread.

Why a process: in one process the engine thread gives up the GIL at every device call and
transfer (about 10 per decode step, 30 per admission) and waits for it while the event loop
runs Python (HTTP parsing, SSE, detokenization); a decode step of 1.4 ms alone took 5-12 ms
inside the server (docs/serving.md). In its own process the engine's Python never waits for
the HTTP layer's, and the two use two cores; the server's engine thread waits for each
step's reply with the GIL released. vLLM's engine core runs the same way.

`EngineProcess(build, *args)` spawns a process that calls `build(*args) -> (engine, extra)`
(a picklable module-level function: the child loads the params itself, so they are never in
the HTTP process), and is then what `EngineLoop` needs of an engine: `submit`, `step`,
`cancel`, `release`, `busy`, `running()`, `waiting()`, `prefix_stats()`, `warmup()` (every
program compiled in the child, its progress reported here), `compiles` (the child's
compilations so far), the fields the app
reads (`cfg`, `slots`, `max_len`, `top_n`, `k`, `record_routing`, `pages.pool` counts) and
`params` (abstract shapes; assigning host or device arrays ships them to the child, as
`VersionedLoop` does between steps). `extra` (picklable: the tokenizer, the model's source)
comes back as `.extra`. `run(requests)` is `Engine.run` in the child (a batch, no round trip
per step). Every call is one message each way on a pipe; each reply carries the engine's busy
/ running / waiting counts, so `busy` and the counts cost nothing.

Pipelined (the default): when a step leaves the engine busy, the next "step" is sent at once,
so the child computes step n + 1 while this process unpickles and delivers step n's events and
handles new requests (otherwise the child waits a round trip per step). Requests are numbered
here and `submit` sends nothing: they travel with the next step message, so requests arriving
one by one (as HTTP clients send them) never break the pipeline, and one the engine refuses
comes back from a later `step()` as `engine_loop.Refused` (its stream gets the ValueError). A
call made meanwhile (`cancel`, `release`, ...) first reads that step's reply and keeps its
events for the next `step()`: a cancel lands one step later (the loop drops events of a
cancelled request). New params must not be applied to tokens that
the old ones sampled: `computed_events()` hands over what was computed ahead
(`serve.versions.VersionedLoop` delivers them, under the old version, before switching).

Errors: `Engine`'s ValueErrors (a request that cannot run here) are raised again as
ValueErrors, and a build's ValueError / FileNotFoundError (a bad flag or path) as itself;
anything else the child raises comes back as `EngineProcessError` with the
child's traceback; a child that dies (killed, out of memory) is `EngineProcessError` naming
its exit code. `close()` stops the child; it also exits when the parent goes away.
"""

import dataclasses
import multiprocessing
import os
import time
import traceback
import types

import jax
import numpy as np

from glm5_jax.infer.compile_count import process_compiles
from glm5_jax.infer.engine import Engine, Event
from glm5_jax.infer.loading import load_model
from glm5_jax.serve.engine_loop import Refused


class EngineProcessError(RuntimeError):
  """The engine process failed (its traceback in the message) or exited."""


@dataclasses.dataclass
class _State:
  """What each reply carries besides its value."""
  busy: bool
  running: int
  waiting: int
  pages_used: int | None
  pages_free: int | None
  step_seconds: float  # inside `Engine.step`, summed since the start (the child's own time)
  cpu_seconds: float  # the child's CPU time (all its threads) since it started
  compiles: int  # XLA compilations in the child since it started (`compile_count`)


def _state(engine, step_seconds: float) -> _State:
  pool = engine.pages.pool if engine.pages is not None else None
  return _State(engine.busy, engine.running(), engine.waiting(),
                None if pool is None else pool.used, None if pool is None else pool.free,
                step_seconds, time.process_time(), process_compiles().count)


def _set_params(engine, params) -> None:
  """Host (numpy) params in the served ones' placement (the same shardings)."""
  engine.params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, engine.params))


class _Served:
  """The child's engine, addressed by the server's handles (`EngineProcess.submit` numbers
  requests itself, so that a submit needs no round trip)."""

  def __init__(self, engine):
    self.engine = engine
    self._engine_handle: dict[int, int] = {}  # server handle -> the engine's
    self._server_handle: dict[int, int] = {}  # and back

  def submit(self, handle: int, request) -> int:
    engine_handle = self.engine.submit(request)
    self._engine_handle[handle], self._server_handle[engine_handle] = engine_handle, handle
    return handle

  def submit_many(self, submits) -> list:
    """`submit` of each `(handle, request)`; `(handle, message)` of those the engine refused."""
    refused = []
    for handle, request in submits:
      try:
        self.submit(handle, request)
      except ValueError as e:
        refused.append((handle, str(e)))
    return refused

  def step(self, submits=()) -> tuple:
    """The `submits`, then `engine.step()`: `(events as tuples, refused)`. Tuples: a list of
    dataclass instances pickles several times slower, on the server's engine thread."""
    refused = self.submit_many(submits)
    events = []
    for e in self.engine.step():
      handle = self._server_handle[e.handle]
      if e.completion is not None:
        del self._server_handle[e.handle], self._engine_handle[handle]
        e.completion.handle = handle
      events.append((handle, e.tokens, e.logprobs, e.raw_logprobs, e.top_logprobs,
                     e.completion))
    return events, refused

  def cancel(self, handle: int) -> bool:
    engine_handle = self._engine_handle.pop(handle, None)
    if engine_handle is None:
      return False
    del self._server_handle[engine_handle]
    return self.engine.cancel(engine_handle)


_METHODS = {
    "submit": lambda s, handle, request: s.submit(handle, request),
    "submit_many": lambda s, submits: s.submit_many(submits),
    "step": lambda s, submits: s.step(submits),
    "cancel": lambda s, handle: s.cancel(handle),
    "release": lambda s, session: s.engine.release(session),
    "prefix_stats": lambda s: s.engine.prefix_stats(),
    "set_params": lambda s, params: _set_params(s.engine, params),
    "run": lambda s, requests: s.engine.run(requests),
}


def _child(conn, build, args, env) -> None:
  """The engine process: builds the engine, then answers calls until the pipe closes."""
  os.environ.update(env)  # before the backend starts (XLA_FLAGS is read then)
  process_compiles()  # every compilation of this process is counted from here on
  try:
    engine, extra = build(*args)
    pool = engine.pages.pool if engine.pages is not None else None
    info = dict(cfg=engine.cfg, slots=engine.slots, max_len=engine.max_len, top_n=engine.top_n,
                k=engine.k, record_routing=engine.record_routing, extra=extra,
                params=jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                                    engine.params),
                pages=None if pool is None else (pool.num_pages, pool.page_size))
    conn.send(("ok", info, _state(engine, 0.0)))
  except (ValueError, FileNotFoundError) as e:  # bad input (a flag, a path): the user's error
    conn.send(("refused", (type(e).__name__, str(e)), None))
    return
  except BaseException as e:  # pylint: disable=broad-except
    conn.send(("raise", _failure(e), None))
    return
  served, step_seconds = _Served(engine), 0.0
  while True:
    try:
      method, call_args = conn.recv()
    except (EOFError, OSError):  # the server is gone
      return
    if method == "close":
      conn.send(("ok", None, None))
      return
    start = time.perf_counter()
    try:
      if method == "warmup":  # progress lines travel ahead of the reply
        max_rows, = call_args
        engine.warmup(max_rows, progress=lambda done, total: conn.send(
            ("progress", (done, total), None)))
        reply = ("ok", None)
      else:
        reply = ("ok", _METHODS[method](served, *call_args))
    except ValueError as e:  # a request (or params) the engine refuses: the caller's error
      reply = ("value_error", str(e)) if method in ("submit", "set_params") else (
          "raise", _failure(e))
    except BaseException as e:  # pylint: disable=broad-except
      reply = ("raise", _failure(e))
    if method == "step":
      step_seconds += time.perf_counter() - start
    conn.send(reply + (_state(engine, step_seconds),))


_REFUSALS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


def _failure(e: BaseException) -> str:
  return "".join(traceback.format_exception(e)).rstrip()


class EngineProcess:
  """The engine of `build(*args)` in a spawned process (module docstring).

  Args:
    build: a picklable function returning `(engine, extra)`; runs in the child.
    *args: its (picklable) arguments.
    env: environment variables set in the child before its backend starts (e.g. XLA_FLAGS).
    pipelined: when a step leaves the engine busy, ask for the next one at once, so the child
      computes it while this process delivers the last one's events (module docstring).
  """

  def __init__(self, build, *args, env: dict | None = None, pipelined: bool = True):
    spawn = multiprocessing.get_context("spawn")  # a fork would copy the parent's threads
    self._conn, child_conn = spawn.Pipe()
    self._process = spawn.Process(target=_child, args=(child_conn, build, args, env or {}),
                                  name="glm5-engine", daemon=True)
    self._process.start()
    child_conn.close()  # the child's end: recv sees EOF when the child exits
    self.pipelined = pipelined
    self._ahead = False  # a "step" sent whose reply is not read yet
    self._computed: list | None = None  # events of a step read before they were asked for
    self._submits: list = []  # (handle, request) to send with the next step (pipelined)
    self._next_handle = 0
    info = self._reply("start")
    self.cfg, self.slots, self.max_len = info["cfg"], info["slots"], info["max_len"]
    self.top_n, self.k, self.record_routing = info["top_n"], info["k"], info["record_routing"]
    self.extra, self._params = info["extra"], info["params"]
    self.pages = None
    if info["pages"] is not None:
      num_pages, page_size = info["pages"]
      self.pages = types.SimpleNamespace(pool=types.SimpleNamespace(
          num_pages=num_pages, page_size=page_size, used=0, free=num_pages - 1))

  def _call(self, method: str, *args):
    if self._conn is None:
      raise EngineProcessError("the engine process is closed")
    if self._ahead:  # replies come in order: the step asked for ahead first
      self._keep(self._read_step())
    if self._submits:  # in order: a call may concern a request submitted before it
      self._send("submit_many", self._take_submits())
      self._keep([Refused(*r) for r in self._reply("submit_many")])
    self._send(method, *args)
    return self._reply(method)

  def _keep(self, items: list) -> None:
    """Events (and refusals) read before `step` asked for them: its next return."""
    if items or self._computed is not None:
      self._computed = (self._computed or []) + items

  def _take_submits(self) -> list:
    submits, self._submits = self._submits, []
    return submits

  def _reply(self, method: str, progress=None):
    try:
      kind, value, state = self._conn.recv()
      while kind == "progress":  # (warm-up) `progress(done, total)` until its reply
        if progress is not None:
          progress(*value)
        kind, value, state = self._conn.recv()
    except (EOFError, OSError):
      self._died(method)
    if state is not None:
      self._state = state
      if getattr(self, "pages", None) is not None:  # (not set yet during the start reply)
        self.pages.pool.used, self.pages.pool.free = state.pages_used, state.pages_free
    if kind == "value_error":
      raise ValueError(value)
    if kind == "refused":
      raise _REFUSALS[value[0]](value[1])
    if kind == "raise":
      raise EngineProcessError(f"the engine process raised in {method}:\n{value}")
    return value

  def _died(self, method: str):
    self._process.join(5)
    raise EngineProcessError(f"the engine process exited (exit code {self._process.exitcode}) "
                             f"during {method}") from None

  # ---- what EngineLoop and the app use of an Engine -----------------------------------------

  def submit(self, request) -> int:
    """Queues `request`; returns its handle. Pipelined, it travels with the next step (no
    round trip of its own), and a request the engine refuses comes back from a later `step`
    as `engine_loop.Refused` instead of raising here; otherwise ValueError as `Engine`."""
    if self._conn is None:
      raise EngineProcessError("the engine process is closed")
    handle, self._next_handle = self._next_handle, self._next_handle + 1
    if self.pipelined:
      self._submits.append((handle, request))
      return handle
    return self._call("submit", handle, request)

  def step(self) -> list:
    """`Engine.step`'s events, and `Refused` for requests refused since the last call."""
    if self._computed is not None:
      events, self._computed = self._computed, None
    elif self._ahead:
      events = self._read_step()
    else:
      events = self._parse_step(self._call("step", self._take_submits()))
    if self.pipelined and (self._state.busy or self._submits):
      self._send("step", self._take_submits())
      self._ahead = True
    return events

  def computed_events(self) -> list:
    """Events of a step the child ran ahead of the caller (pipelined), now, with no new step:
    a caller about to change the params delivers them first (they were sampled before)."""
    if self._ahead:
      self._keep(self._read_step())
    events, self._computed = self._computed or [], None
    return events

  def _read_step(self) -> list:
    self._ahead = False
    return self._parse_step(self._reply("step"))

  @staticmethod
  def _parse_step(reply) -> list:
    events, refused = reply
    return [Refused(*r) for r in refused] + [Event(*fields) for fields in events]

  def _send(self, method: str, *args) -> None:
    try:
      self._conn.send((method, args))
    except (BrokenPipeError, OSError):
      self._died(method)

  def cancel(self, handle: int) -> bool:
    for i, (pending, _) in enumerate(self._submits):
      if pending == handle:  # not sent yet: nothing to ask the child
        del self._submits[i]
        return True
    return self._call("cancel", handle)

  def release(self, session) -> bool:
    return self._call("release", session)

  def run(self, requests) -> list:
    """`Engine.run(requests)` in the child: every request generated with no round trip per
    step (the completions in input order). The engine must be idle. tools/bench_serve.py
    times the served engine's own process this way, so that its direct baseline shares the
    process (and its placement of memory and threads) with what it is compared to."""
    requests = list(requests)
    if self.busy:
      raise RuntimeError(f"EngineProcess.run: {self.waiting()} requests waiting and "
                         f"{self.running()} running; drive them with `step` first")
    return self._call("run", requests)

  def prefix_stats(self) -> dict:
    return self._call("prefix_stats")

  def warmup(self, max_rows: int | None = None, progress=None) -> None:
    """`Engine.warmup` in the child (every program compiled there, where requests run);
    `progress(done, total)` is called here as the child reports each part."""
    if self._conn is None:
      raise EngineProcessError("the engine process is closed")
    if self.busy:
      raise RuntimeError("EngineProcess.warmup: run it before any request")
    self._send("warmup", max_rows)
    self._reply("warmup", progress)

  @property
  def compiles(self) -> int:
    """XLA compilations in the engine's process since it started (0 new ones after `warmup`:
    what tools/bench_serve.py and `/metrics` report), as of its last reply."""
    return self._state.compiles

  @property
  def busy(self) -> bool:
    """Whether a request is waiting or running, or events computed ahead are not taken yet."""
    return (self._state.busy or self._ahead or self._computed is not None
            or bool(self._submits))

  def running(self) -> int:
    return self._state.running

  def waiting(self) -> int:
    return self._state.waiting + len(self._submits)

  @property
  def step_seconds(self) -> float:
    """Seconds the child spent inside `Engine.step` (without the pipe and the pickling)."""
    return self._state.step_seconds

  @property
  def cpu_seconds(self) -> float:
    """The child's CPU time so far, as of its last reply."""
    return self._state.cpu_seconds

  @property
  def params(self):
    """The served params' shapes and dtypes (`jax.ShapeDtypeStruct`s)."""
    return self._params

  @params.setter
  def params(self, params) -> None:
    """Serves `params` (host or device arrays of the served tree) from the next step on."""
    self._call("set_params", jax.device_get(params))

  def close(self) -> None:
    """Stops the child (idempotent)."""
    if self._conn is None:
      return
    try:
      self._conn.send(("close", ()))
      while self._conn.recv()[2] is not None:  # a step asked for ahead answers first
        pass
    except (EOFError, OSError):
      pass
    self._conn.close()
    self._conn = None
    self._process.join(10)
    if self._process.is_alive():
      self._process.kill()


def served_engine(load_kwargs: dict, engine_kwargs: dict, warmup_rows: int | None = None):
  """`build` for a server: `infer.loading.load_model(**load_kwargs)` and an `Engine` of it
  (`engine_kwargs`), every program compiled first when `warmup_rows` (`Engine.warmup`);
  extra: `{"model", "tokenizer", "source"}`."""
  served = load_model(**load_kwargs)
  engine = Engine(served.model, served.params, **engine_kwargs)
  if warmup_rows:
    engine.warmup(warmup_rows)
  return engine, {"model": served.model, "tokenizer": served.tokenizer, "source": served.source}
