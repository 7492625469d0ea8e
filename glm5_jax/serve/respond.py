"""Running one HTTP request's engine requests and answering it: a whole JSON reply, or
server-sent events, one chunk per choice per batch of engine events.

Shared by the completions and chat routes, which give the shapes (`chunk`, `reply`); here:
submitting all of a request's choices or none (503 + Retry-After when the queue cannot take
them), feeding events into their `Choice`s, cancelling at a stop string, and cancelling every
stream when the reply is done or the client disconnects (their slots freed).
"""

import asyncio
import json

from fastapi.responses import JSONResponse, StreamingResponse

from glm5_jax.serve import fields
from glm5_jax.serve.choices import batches
from glm5_jax.serve.context import RETRY_AFTER_S, ServerContext
from glm5_jax.serve.engine_loop import QueueFull, Stopped
from glm5_jax.serve.errors import ApiError


async def respond(ctx: ServerContext, body, requests, choices, chunk, reply, call=None):
  """Runs `requests` (one per choice); a reply dict, or an SSE response of chunks:
  `chunk.head` (the same in every chunk: serialized once) with the choice `chunk(choice,
  delta, kept, first)`. Errors the engine raises before the first event are 400s. `call`:
  the gateway's (None: not recorded); its fields are read once every stream ended (the
  record is made on the engine thread before a stream's end is delivered)."""
  loop, gateway = ctx.loop, ctx.gateway
  inbox: asyncio.Queue = asyncio.Queue()
  stream = fields.bool_field(body, "stream")
  # A reply sent whole, with no stop string to watch for, needs no event before the end.
  whole = not stream and not any(c.text.stops for c in choices)
  streams = gateway.submit(call, requests, lambda rs: _submit(loop, rs, inbox, whole))
  deltas, kept = [{} for _ in choices], [[] for _ in choices]
  items = aiter(batches(inbox, streams))
  try:
    first = await anext(items)
  except ValueError as e:
    for s in streams:
      loop.cancel(s)
    raise ApiError(400, str(e)) from None
  except StopAsyncIteration:
    first = []
  if not stream:
    try:
      async for batch in _with_first(first, items):
        for i, event in batch:
          _apply(ctx, choices[i], streams[i], event, deltas[i], kept[i], call)
    finally:
      for s in streams:
        loop.cancel(s)
    # json.dumps directly: FastAPI's encoder walks every log-prob in Python (~1 ms a reply).
    return JSONResponse(reply(deltas, kept))
  include_usage = fields.object_field(body, "stream_options").get("include_usage")

  async def events():
    sent, closed = set(), set()  # choices whose first / last chunk went out
    prefix = "data: " + json.dumps(chunk.head)[:-1] + ', "choices": ['
    try:
      async for batch in _with_first(first, items):
        out = {}  # one chunk per choice per batch
        for i, event in batch:
          if i not in closed:
            delta, new = out.setdefault(i, ({}, []))
            _apply(ctx, choices[i], streams[i], event, delta, new, call)
        frames = []
        for i, (delta, new) in out.items():
          frames.append(prefix + json.dumps(chunk(choices[i], delta, new, i not in sent))
                        + "]}\n\n")
          sent.add(i)
          if choices[i].finish_reason is not None:
            closed.add(i)
        if frames:
          yield "".join(frames)
      tail = {"usage": usage(requests, choices)} if include_usage else {}
      tail.update(gateway.reply_fields(call))
      if tail:
        yield f"data: {json.dumps({**chunk.head, 'choices': [], **tail})}\n\n"
      yield "data: [DONE]\n\n"
    finally:
      for s in streams:  # a disconnected client (or one done) frees every slot it held
        loop.cancel(s)
  return StreamingResponse(events(), media_type="text/event-stream")


def usage(requests, choices) -> dict:
  """OpenAI's `usage`: one prompt (every choice's), the tokens of every choice."""
  prompt, done = len(requests[0].prompt), sum(len(c.tokens) for c in choices)
  return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def stop_reason(choice):
  """vLLM's `stop_reason`: the stop string or stop token that ended `choice` (None: another
  end, or none yet)."""
  if choice.text.stopped is not None:
    return choice.text.stopped
  if choice.finish_reason in ("stop", "tool_calls") and choice.tokens and (
      choice.tokens[-1] in choice.stop_tokens):
    return choice.tokens[-1]
  return None


def _submit(loop, requests, inbox, whole):
  try:  # all of a request's choices or none: a request never half fills the queue
    return loop.submit_all(requests, asyncio.get_running_loop(), inbox, whole=whole)
  except (QueueFull, Stopped) as e:
    if isinstance(e, QueueFull):  # overload: transient, the client should retry later
      raise ApiError(503, f"server overloaded, retry later: {e}", code="server_overloaded",
                     headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    raise ApiError(503, f"server unavailable: {e}", code="engine_stopped") from None


def _apply(ctx, choice, stream, event, delta, kept, call) -> None:
  """One stream item into its choice; a stop string cancels the request at the engine
  (a recorded call keeps the tokens up to it: `Gateway.cut`)."""
  if event is None:
    choice.end(delta)
    return
  stopped = choice.finish_reason is not None
  kept += choice.feed(event, delta)
  if not stopped and choice.text.stopped is not None:
    ctx.gateway.cut(call, len(choice.tokens))
    ctx.loop.cancel(stream)


async def _with_first(first, items):
  yield first
  async for batch in items:
    yield batch
