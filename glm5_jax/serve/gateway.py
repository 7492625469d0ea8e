"""The token-in-token-out (TITO) gateway: exact records of an agent's calls, for RL.

An agent talks text through `POST /v1/chat/completions`; a call that carries a trajectory id
(the header `X-Trajectory-Id`, or the body field `trajectory_id`: the openai client's
`extra_body={"trajectory_id": ...}`) is recorded, per call (`TurnRecord`): the prompt ids the
engine was given, the completion ids it sampled, each token's log-prob under the sampling
distribution (`logprobs`) and under the raw model (`raw_logprobs`, temperature 1: what the RL
loss compares against), each token's param version (`glm5_jax.serve.versions`), the finish
reason, and with an engine that records routing (`Engine(record_routing=True)`) the MoE
experts and DSA keys of every token. A trajectory is one path: `n` must be 1.

Prompts of later turns. The client re-sends the whole conversation, with the previous reply
as it understood it (its text, its parsed tool calls). That text, rendered and tokenized
again, need not give back the sampled ids: invalid UTF-8 decodes to U+FFFD, the template
strips whitespace, drops earlier turns' thinking after a new user message, ends a turn with a
role token where the model stopped at eos, and a BPE tokenizer may split text another way.
So the gateway never re-tokenizes what the model generated: turn t's prompt is turn t-1's
prompt + completion, then the messages after the echoed reply rendered alone (their role token
left out when the model's stop token already was it: `posttrain.rollout.observation_tokens`
does the same). When that differs from rendering the whole conversation, the call is counted
as a mismatch (`TurnRecord.mismatch`, the first differing position, the trajectory's
`mismatches`, `glm5_gateway_mismatches_total` in /metrics); generation uses the recorded
tokens either way. The earlier messages must be those of the previous call, unchanged (400
otherwise: a trajectory only grows). Each trajectory is an engine session (plain decoding), so
a later turn prefills only the tokens past the previous call's.

Reading records over HTTP (`serve.routes.trajectories`): `GET /v1/trajectories/{id}`,
`POST /v1/trajectories/{id}/finish` (no more calls; returns the records),
`DELETE /v1/trajectories/{id}`; or in Python, `Gateway.records` and `Gateway.finish`.
`to_sample` turns a trajectory into `posttrain.rollout.Sample` (the training sample: those ids,
those raw log-probs, loss mask 1 on the completions) and its per-token versions.
"""

import dataclasses
import json
import threading
import time

import numpy as np

from glm5_jax.data import chat
from glm5_jax.posttrain.rollout import Sample, merge_routing

HEADER = "x-trajectory-id"
MAX_ID_LEN = 200


class GatewayError(Exception):
  def __init__(self, status: int, message: str, param: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param


@dataclasses.dataclass
class TurnRecord:
  """One recorded call. Lists of ints / floats (JSON as they are); `routing`: None or
  `{kind: int32 [len(prompt_ids) + len(completion_ids), layers, k]}` (-1 rows: not fed)."""
  prompt_ids: list
  completion_ids: list
  logprobs: list
  raw_logprobs: list
  versions: list
  finish_reason: str
  mismatch: bool
  mismatch_at: int | None
  rendered_length: int
  messages: int
  routing: dict | None = None

  def as_json(self) -> dict:
    out = dataclasses.asdict(self)
    if self.routing is not None:
      out["routing"] = {k: np.asarray(v).tolist() for k, v in self.routing.items()}
    return out


@dataclasses.dataclass
class Trajectory:
  id: str
  records: list = dataclasses.field(default_factory=list)
  mismatches: int = 0
  aborted: int = 0  # calls cancelled (client gone) or refused: no record
  finished: bool = False
  pending: bool = False  # a call in flight
  messages: list = dataclasses.field(default_factory=list)  # the last call's messages
  touched: float = 0.0

  def as_json(self) -> dict:
    return {"id": self.id, "finished": self.finished, "mismatches": self.mismatches,
            "aborted": self.aborted, "records": [r.as_json() for r in self.records]}


@dataclasses.dataclass
class Call:
  trajectory: Trajectory
  prompt: list
  messages: list
  mismatch_at: int | None
  rendered_length: int
  record: TurnRecord | None = None
  keep: int | None = None  # a stop string ended the reply after this many tokens (`cut`)


class Gateway:
  """Trajectory records of one server (module docstring). Thread-safe: calls begin on the
  HTTP thread and end on the engine thread. At most `max_trajectories` are kept; a new one
  evicts the least recently used idle one (`evicted` counts them)."""

  def __init__(self, loop, tokenizer, *, max_trajectories: int = 4096):
    self.loop, self.tokenizer, self.max_trajectories = loop, tokenizer, max_trajectories
    self._lock = threading.Lock()
    self._trajectories: dict[str, Trajectory] = {}
    self.calls = self.mismatches = self.aborted = self.evicted = 0

  @staticmethod
  def trajectory_id(headers, body: dict) -> str | None:
    """The request's trajectory id (header or body field; both must agree), or None."""
    header, field = headers.get(HEADER), body.get("trajectory_id")
    if header is not None and field is not None and header != field:
      raise GatewayError(400, f"the {HEADER} header {header!r} and the body's trajectory_id "
                         f"{field!r} differ", "trajectory_id")
    tid = header if header is not None else field
    if tid is not None and (not isinstance(tid, str) or not 0 < len(tid) <= MAX_ID_LEN):
      raise GatewayError(400, f"trajectory_id must be a non-empty str of at most {MAX_ID_LEN} "
                         f"characters; got {tid!r:.80}", "trajectory_id")
    return tid

  def begin(self, tid: str | None, messages: list, rendered, *, thinking: bool,
            n: int) -> Call | None:
    """The call's prompt ids: `rendered` (the whole conversation rendered) on a first turn,
    else the recorded tokens + the new messages' rendering (module docstring). None without a
    trajectory id. Changes no state (`submit` does)."""
    if tid is None:
      return None
    if n != 1:
      raise GatewayError(400, f"a trajectory is one path: n must be 1 with a trajectory id, "
                         f"got {n!r}", "n")
    rendered = [int(i) for i in rendered]
    messages = json.loads(json.dumps(messages))  # a private copy, compared by value later
    with self._lock:
      t = self._trajectories.get(tid)
      if t is not None and (t.finished or t.pending):
        state = "finished" if t.finished else "waiting for its previous call"
        raise GatewayError(409 if t.pending else 400, f"trajectory {tid!r} is {state}",
                           "trajectory_id")
      if t is None or not t.records:
        return Call(t or Trajectory(tid), rendered, messages, None, len(rendered))
      last, k = t.records[-1], t.records[-1].messages
      previous = t.messages
    if messages[:k] != previous:
      i = next((i for i, (a, b) in enumerate(zip(messages, previous)) if a != b), len(messages))
      raise GatewayError(400, f"trajectory {tid!r}: messages[{i}] is not the one turn "
                         f"{len(t.records)} sent; a trajectory's conversation may only grow "
                         "(start a new trajectory id for another conversation)", "messages")
    if len(messages) < k + 2 or messages[k]["role"] != "assistant":
      raise GatewayError(400, f"trajectory {tid!r}: expected messages[{k}] to be the assistant "
                         f"reply of turn {len(t.records)} and new messages after it",
                         "messages")
    suffix = [int(i) for i in chat.render_prompt(
        messages[k + 1:], self.tokenizer, thinking=thinking, thinking_mode="turn_level")[2:]]
    context = last.prompt_ids + last.completion_ids
    if last.completion_ids and suffix[:1] == last.completion_ids[-1:]:
      suffix = suffix[1:]  # the model's stop token was the role token that opens them
    prompt = context + suffix
    at = next((i for i, (a, b) in enumerate(zip(prompt, rendered)) if a != b),
              None if len(prompt) == len(rendered) else min(len(prompt), len(rendered)))
    return Call(t, prompt, messages, at, len(rendered))

  def submit(self, call: Call | None, requests: list, submit):
    """`submit(requests)` (the app's), with the call recorded when its request ends."""
    if call is None:
      return submit(requests)
    if not hasattr(self.loop, "watch"):
      raise GatewayError(400, "this server's engine loop records no trajectories (serve it "
                         "with glm5_jax.serve.versions.VersionedLoop)", "trajectory_id")
    t = call.trajectory
    with self._lock:
      if t.pending or t.finished or self._trajectories.get(t.id, t) is not t:
        raise GatewayError(409, f"trajectory {t.id!r} changed while this call was prepared",
                           "trajectory_id")
      if t.id not in self._trajectories:
        self._make_room()
        self._trajectories[t.id] = t
      t.pending, t.touched = True, time.time()
    if getattr(self.loop.engine, "k", 0) == 0:  # sessions need plain decoding
      requests = [dataclasses.replace(requests[0], session=_session(t.id))]
    self.loop.watch(requests[0], lambda completion, versions, cancelled: self._end(
        call, completion, versions, cancelled))
    try:
      return submit(requests)
    except BaseException:
      self.loop.unwatch(requests[0])
      with self._lock:
        t.pending = False
      raise

  def _make_room(self) -> None:
    while len(self._trajectories) >= self.max_trajectories:
      idle = [t for t in self._trajectories.values() if not t.pending]
      if not idle:
        raise GatewayError(503, f"the gateway holds {len(self._trajectories)} trajectories "
                           "with calls in flight (max_trajectories)")
      tid = min(idle, key=lambda t: (not t.finished, t.touched)).id
      del self._trajectories[tid]
      self._release(tid)
      self.evicted += 1

  def _release(self, tid: str) -> None:
    if hasattr(self.loop, "release"):
      self.loop.release(_session(tid))

  def _end(self, call: Call, completion, versions, cancelled: bool) -> None:
    """On the engine thread: the call's record, or an aborted call (cancelled without a stop
    string: the client went away)."""
    t = call.trajectory
    with self._lock:
      t.pending, t.touched = False, time.time()
      if completion is None or (cancelled and call.keep is None):
        t.aborted += 1
        self.aborted += 1
        return
      routing = completion.routing
      call.record = TurnRecord(
          list(call.prompt), list(completion.tokens), list(completion.logprobs),
          list(completion.raw_logprobs), list(versions), completion.finish_reason,
          call.mismatch_at is not None, call.mismatch_at, call.rendered_length,
          len(call.messages), None if routing is None else
          {k: np.asarray(v, np.int32) for k, v in routing.items()})
      if call.keep is not None:
        _cut(call.record, call.keep)
      t.records.append(call.record)
      t.messages = call.messages
      t.mismatches += call.record.mismatch
      self.calls += 1
      self.mismatches += call.record.mismatch

  def cut(self, call: Call | None, keep: int) -> None:
    """A stop string ended `call`'s reply after its first `keep` tokens (the app then cancels
    the engine request): the record holds those tokens only (the client's reply is made of
    them; what the engine sampled past them is dropped), finish reason "stop". Either order
    with the record being made on the engine thread."""
    if call is None:
      return
    with self._lock:
      call.keep = keep
      if call.record is not None:
        _cut(call.record, keep)

  @staticmethod
  def reply_fields(call: Call | None) -> dict:
    """What a reply to a recorded call adds: `{"trajectory": {id, turn, mismatch,
    param_versions: [first, last]}}`."""
    if call is None or call.record is None:
      return {}
    r = call.record
    return {"trajectory": {"id": call.trajectory.id, "turn": len(call.trajectory.records) - 1,
                           "mismatch": r.mismatch,
                           "param_versions": [min(r.versions), max(r.versions)]}}

  def records(self, tid: str) -> Trajectory:
    with self._lock:
      if tid not in self._trajectories:
        raise GatewayError(404, f"no trajectory {tid!r} (never recorded, deleted or evicted)",
                           "trajectory_id")
      return self._trajectories[tid]

  def finish(self, tid: str) -> Trajectory:
    """Marks `tid` finished (later calls are refused) and returns it."""
    t = self.records(tid)
    with self._lock:
      t.finished = True
    self._release(tid)
    return t

  def drop(self, tid: str) -> None:
    self.records(tid)
    with self._lock:
      self._trajectories.pop(tid, None)
    self._release(tid)

  def metric_lines(self) -> list[str]:
    return [f"glm5_gateway_trajectories {len(self._trajectories)}",
            f"glm5_gateway_calls_total {self.calls}",
            f"glm5_gateway_mismatches_total {self.mismatches}",
            f"glm5_gateway_aborted_total {self.aborted}",
            f"glm5_gateway_evicted_total {self.evicted}",
            f"glm5_param_version {getattr(self.loop, 'version', 0)}"]


def _cut(record: TurnRecord, keep: int) -> None:
  """`record` ends after its first `keep` generated tokens. Its routing's rows stop there too,
  the last one -1 (that token's row came from a forward whose output was dropped: the next
  turn's prefill routes it, `merge_routing`)."""
  if keep >= len(record.completion_ids) and record.finish_reason == "stop":
    return
  for name in ("completion_ids", "logprobs", "raw_logprobs", "versions"):
    setattr(record, name, getattr(record, name)[:keep])
  record.finish_reason = "stop"
  if record.routing is not None:
    rows = len(record.prompt_ids) + keep
    record.routing = {k: v[:rows].copy() for k, v in record.routing.items()}
    for v in record.routing.values():
      v[-1] = -1


def _session(tid: str) -> tuple:
  """The engine session of a trajectory: its slot's cache is held between calls, so a turn
  prefills only the tokens past the previous call's (`glm5_jax.infer.sessions`; evicted when
  the engine needs the slot, then prefilled whole: never a different answer)."""
  return ("gateway", tid)


def records_from_json(trajectory: dict) -> list[TurnRecord]:
  """`TurnRecord`s of a `GET /v1/trajectories/{id}` body."""
  out = []
  for r in trajectory["records"]:
    r = dict(r)
    if r.get("routing") is not None:
      r["routing"] = {k: np.asarray(v, np.int32) for k, v in r["routing"].items()}
    out.append(TurnRecord(**r))
  return out


def to_sample(records, *, task, group: int, reward: float, correct: bool, messages=(),
              info=None) -> tuple[Sample, np.ndarray]:
  """A trajectory's records -> (the RL `Sample`, int32 [n] the version of each token, -1 on
  prompt and observation tokens). The sample's tokens are the last call's prompt + completion;
  every call's completion is trained (loss mask 1) with its raw log-probs. ValueError when a
  call's prompt does not extend the previous call's context (never so for the gateway's)."""
  if not records:
    raise ValueError("to_sample: a trajectory without records")
  last = records[-1]
  tokens = list(last.prompt_ids) + list(last.completion_ids)
  n = len(tokens)
  logp, mask = np.zeros(n, np.float32), np.zeros(n, np.float32)
  versions, routing = np.full(n, -1, np.int32), None
  for t, r in enumerate(records):
    start, end = len(r.prompt_ids), len(r.prompt_ids) + len(r.completion_ids)
    if tokens[:end] != list(r.prompt_ids) + list(r.completion_ids):
      raise ValueError(f"to_sample: turn {t}'s prompt + completion is not a prefix of the last "
                       "turn's context")
    logp[start:end], mask[start:end] = r.raw_logprobs, 1.0
    versions[start:end] = r.versions
    if r.routing is not None:
      routing = merge_routing(routing, r.routing)
  if routing is not None and any(r.routing is None for r in records):
    raise ValueError("to_sample: some calls recorded routing and others did not")
  sample = Sample(task=task, group=group, tokens=np.asarray(tokens, np.int32), rollout_logp=logp,
                  loss_mask=mask, reward=float(reward), correct=bool(correct),
                  turns=len(records), messages=list(messages), info=dict(info or {}),
                  routing=routing)
  return sample, versions
