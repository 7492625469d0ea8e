"""glm5_jax.serve.engine_loop: requests from many threads through the one engine thread get
exactly the tokens of `Engine.run`; cancel frees the slot; a full queue refuses at once."""

import threading

import pytest

from glm5_jax.infer import engine as engine_lib
from glm5_jax.infer.requests import Request
from glm5_jax.serve.engine_loop import EngineLoop, QueueFull
from tests.conftest import random_params, tiny_model_config

CFG = tiny_model_config(num_hidden_layers=2, attention_pattern="DD", first_k_dense_replace=2,
                        mtp_depths=0, num_nextn_predict_layers=0)
PROMPTS = [(5, 17, 3), (11,), (250, 3, 3, 9), (7, 7), (1, 2, 3, 4, 5)]


@pytest.fixture(scope="module")
def params():
  return random_params(CFG, seed=1, std=0.5)


def _requests(max_new=4):
  return [Request(i, p, max_new, 1.0, 1.0, 0, engine_lib.request_seed(3, i))
          for i, p in enumerate(PROMPTS)]


def test_concurrent_submitters_get_the_tokens_of_run(params):
  want = engine_lib.Engine(CFG, params, slots=2, max_len=16, prefill_chunk=4).run(_requests())
  loop = EngineLoop(engine_lib.Engine(CFG, params, slots=2, max_len=16, prefill_chunk=4))
  got = {}

  def client(r):
    events = list(loop.submit(r))
    got[r.index] = ([t for e in events for t in e.tokens], events[-1].completion)

  threads = [threading.Thread(target=client, args=(r,)) for r in _requests()]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  loop.close()
  for i, w in enumerate(want):
    streamed, completion = got[i]
    assert streamed == completion.tokens == w.tokens, i


def test_cancelling_an_ended_stream_does_not_ask_the_engine(params):
  """The app cancels every stream when its reply is done; for an ended one the engine is not
  asked (an engine process would pay a round trip per request, stalling its pipeline)."""

  class Counting(engine_lib.Engine):
    cancels = 0

    def cancel(self, handle):
      self.cancels += 1
      return super().cancel(handle)

  engine = Counting(CFG, params, slots=2, max_len=16, prefill_chunk=4)
  loop = EngineLoop(engine)
  stream = loop.submit(_requests()[0])
  assert list(stream)[-1].completion is not None
  loop.cancel(stream)
  loop.close()  # after every command
  assert engine.cancels == 0


class _Gated(engine_lib.Engine):
  """An engine whose every step waits for the test's permission (no race with the thread)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.gate = threading.Semaphore(0)

  def step(self):
    self.gate.acquire()
    return super().step()


def test_cancel_frees_the_slot_and_bad_requests_and_full_queue_are_refused(params):
  engine = _Gated(CFG, params, slots=1, max_len=16, prefill_chunk=4)
  loop = EngineLoop(engine, max_queue=2)
  long = loop.submit(Request(0, (1, 2), 14, 1.0, 1.0, 0, 0))
  engine.gate.release()
  assert len(long.get(timeout=120).tokens) == 2  # admitted: first token + one decode token
  loop.cancel(long)
  engine.gate.release()  # at most one more step before the thread reads the cancel
  rest = []
  while (event := long.get(timeout=120)) is not None:
    rest.append(event)
  assert len(rest) <= 1 and all(e.completion is None for e in rest)  # cut short, unfinished
  assert engine.running() == 0
  engine.gate.release(100)
  short = loop.submit(Request(1, (3,), 2, 0.0, 1.0, 0, 0))  # takes the freed slot
  assert [e.completion for e in short][-1].tokens
  with pytest.raises(ValueError, match="max_len 16"):
    list(loop.submit(Request(2, (3,) * 10, 10, 0.0, 1.0, 0, 0)))
  loop.close()
  stalled = EngineLoop.__new__(EngineLoop)  # a loop whose thread never drains its queue
  stalled.max_queue, stalled._pending, stalled._lock = 1, 1, threading.Lock()
  stalled._stop, stalled.error = False, None
  with pytest.raises(QueueFull, match="max_queue=1"):
    stalled.submit(Request(3, (3,), 2, 0.0, 1.0, 0, 0))


def test_a_whole_stream_gets_its_tokens_in_one_event_or_what_it_had_when_cancelled(params):
  want = engine_lib.Engine(CFG, params, slots=2, max_len=16, prefill_chunk=4).run(_requests())
  engine = _Gated(CFG, params, slots=2, max_len=16, prefill_chunk=4)
  engine.gate.release(100)
  loop = EngineLoop(engine)
  events = list(loop.submit(_requests()[2], whole=True))
  assert len(events) == 1 and events[0].tokens == events[0].completion.tokens == want[2].tokens
  assert events[0].raw_logprobs == events[0].completion.raw_logprobs
  engine.gate = threading.Semaphore(0)
  long = loop.submit(Request(5, (1, 2), 14, 1.0, 1.0, 0, 0), whole=True)
  engine.gate.release(2)  # admission + a decode step, then another decode step
  while engine.gate._value:
    pass
  loop.cancel(long)
  engine.gate.release(100)
  (had,) = list(long)
  assert had.completion is None and 3 <= len(had.tokens) < 14
  loop.close()


class _FakeEngine:
  """What `EngineLoop._admit_held` reads of an engine: slots, running / waiting, submit."""

  def __init__(self, slots, running):
    self.slots, self.run_count, self.submitted = slots, running, []

  busy = property(lambda self: bool(self.run_count or self.submitted))

  def running(self):
    return self.run_count

  def waiting(self):
    return 0

  def submit(self, request):
    self.submitted.append(request)
    return len(self.submitted) - 1


def _unstarted_loop(engine, admit_after_steps, admit_window_s=0.0):
  loop = EngineLoop.__new__(EngineLoop)  # no thread: the test drives the loop's methods
  loop.engine, loop.admit_after, loop.steps = engine, admit_after_steps, 0
  loop.admit_window, loop._held_at, loop._held_last = admit_window_s, 0.0, 0.0
  loop._held, loop._held_since, loop._streams, loop._outbox = [], 0, {}, []
  loop._lock, loop._pending, loop._queued_submits = threading.Lock(), 0, 0
  return loop


def test_arrivals_during_decoding_are_admitted_together():
  from glm5_jax.serve.engine_loop import Stream
  engine = _FakeEngine(slots=8, running=2)
  loop = _unstarted_loop(engine, admit_after_steps=3)
  loop._command("submit", Request(0, (1,), 2, 0.0, 1.0, 0, 0), Stream())
  loop.steps = 2
  loop._command("submit", Request(1, (1,), 2, 0.0, 1.0, 0, 0), Stream())
  loop._admit_held()
  assert engine.submitted == []  # held: the oldest has waited 2 steps of 3
  loop.steps = 3
  loop._admit_held()
  assert [r.index for r in engine.submitted] == [0, 1]  # both in one admission
  idle = _FakeEngine(slots=8, running=0)
  loop = _unstarted_loop(idle, admit_after_steps=3)
  loop._command("submit", Request(2, (1,), 2, 0.0, 1.0, 0, 0), Stream())
  loop._admit_held()
  assert len(idle.submitted) == 1  # an idle engine takes a request at once
  full = _FakeEngine(slots=3, running=2)
  loop = _unstarted_loop(full, admit_after_steps=3)
  loop._command("submit", Request(3, (1,), 2, 0.0, 1.0, 0, 0), Stream())
  loop._admit_held()
  assert len(full.submitted) == 1  # the held requests fill the free slot: no reason to wait


def test_an_idle_engine_admits_a_burst_of_arrivals_together(monkeypatch):
  """`admit_window_s`: an idle engine holds arrivals until none has come for the window (each
  arrival renews it, up to 4 windows after the first) or they fill its slots; the loop waits
  on its queue no longer than that."""
  from glm5_jax.serve import engine_loop
  from glm5_jax.serve.engine_loop import Stream
  now = [100.0]
  monkeypatch.setattr(engine_loop.time, "monotonic", lambda: now[0])
  submit = lambda loop, i: loop._command("submit", Request(i, (1,), 2, 0.0, 1.0, 0, 0), Stream())
  idle = _FakeEngine(slots=8, running=0)
  loop = _unstarted_loop(idle, admit_after_steps=0, admit_window_s=0.02)
  assert loop._wait() == dict(block=True)  # nothing held: sleep until a command comes
  submit(loop, 0)
  now[0] += 0.005
  loop._admit_held()
  assert idle.submitted == [] and loop._wait()["timeout"] == pytest.approx(0.015)
  submit(loop, 1)  # renews the window
  now[0] += 0.015
  loop._admit_held()
  assert idle.submitted == [] and loop._wait()["timeout"] == pytest.approx(0.005)
  now[0] += 0.006
  assert loop._wait() == dict(block=False)  # quiet for a window: admit now
  loop._admit_held()
  assert [r.index for r in idle.submitted] == [0, 1]  # one admission for the two
  loop = _unstarted_loop(idle, admit_after_steps=0, admit_window_s=0.02)
  for i in range(2, 7):  # a steady trickle: admitted 4 windows after the first at the latest
    submit(loop, i)
    now[0] += 0.019
  loop._admit_held()
  assert [r.index for r in idle.submitted[2:]] == [2, 3, 4, 5, 6]
  idle = _FakeEngine(slots=2, running=0)
  loop = _unstarted_loop(idle, admit_after_steps=0, admit_window_s=0.02)
  for i in range(2):
    submit(loop, i)
  loop._admit_held()
  assert len(idle.submitted) == 2  # they fill the slots: no reason to wait
  with pytest.raises(ValueError, match="admit_window_s must be a number of seconds"):
    EngineLoop(idle, admit_window_s=-1)
