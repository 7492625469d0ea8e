"""The OpenAI-compatible HTTP layer (FastAPI) over one `EngineLoop`.

  POST /v1/completions        prompt: text (tokenized, bos first) or token ids
  POST /v1/chat/completions   messages rendered by `glm5_jax.data.chat` (GLM-5's template);
                              thinking per request with the extra body field
                              `chat_template_kwargs: {"enable_thinking": bool}` (default on);
                              the reply's `reasoning_content` is the thinking text;
                              `tools` rendered in GLM's tools block, generated `<tool_call>`s
                              parsed back into `tool_calls`
  GET  /v1/models, /health, /metrics (Prometheus text)

Both POSTs take `n`, `max_tokens` (chat: or its current name `max_completion_tokens`),
`temperature`, `top_p`, `top_k`, `seed`, `stop_token_ids`, `logprobs`, `stream` (server-sent
events), `frequency_penalty`, `presence_penalty` and `logit_bias` (`infer.penalties`);
completions `echo`. Every other field of OpenAI's request bodies is refused unless at its
default, and an unknown field is a 400 naming it (`serve.fields`). A completion stops at eos
(unless `ignore_eos`), a chat turn at GLM's stop tokens (`chat.stop_ids`: every role token
and eos). Log-probs are the model's at temperature 1 after logit_bias and the penalties, the
engine's `raw_logprobs`; choice i of a request with `seed` s draws with `request_seed(s, i)`,
as prompt i of `infer.generate(..., seed=s)` does.

Errors are OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}`: 400 naming
the field, for every bound of `serve.limits.Limits` too (n, max_tokens, prompt tokens, JSON
depth, log-prob alternatives), 413 for a body over `max_body_bytes`, 503 + Retry-After when
the engine loop's queue cannot take a request's choices (real overload: one request's `n` is
bounded well below the queue) and while the engine warms up (`serve.readiness`: `/health` is
503 `{"status": "warming"}` until every program is compiled). Anything else that goes wrong is
a 500 in the same shape, never a text/plain traceback. A streaming client that disconnects has
its requests cancelled (their slots freed).

A chat call with a trajectory id is recorded by the TITO gateway (`glm5_jax.serve.gateway`):
its prompt is the gateway's (the recorded tokens), and its reply carries `trajectory` (in a
stream, in the last chunk before `[DONE]`, whose `choices` is empty).
"""

import asyncio
import json
import secrets
import time

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from glm5_jax.data import chat
from glm5_jax.infer.engine import request_seed
from glm5_jax.infer.requests import Request
from glm5_jax.serve.choices import (Choice, batches, chat_logprobs, completion_logprobs,
                                    echo_prompt)
from glm5_jax.serve.engine_loop import EngineLoop, QueueFull, Stopped
from glm5_jax.serve import fields
from glm5_jax.serve.errors import CONTEXT_LENGTH_EXCEEDED, ApiError, error_body
from glm5_jax.serve.gateway import Gateway
from glm5_jax.serve.limits import Limits, parse_body
from glm5_jax.serve.messages import glm_messages
from glm5_jax.serve.readiness import Readiness
from glm5_jax.serve.text import ChoiceText


MAX_STOPS = 16  # stop strings per request
RETRY_AFTER_S = 1  # a 503's Retry-After: the queue drains at the engine's pace
SEED_BOUND = 1 << 32


def _int(body, name, default, low, high=None, why=""):
  value = body.get(name, default)
  if value is None:
    value = default
  if not isinstance(value, int) or isinstance(value, bool) or value < low or (
      high is not None and value > high):
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ApiError(400, f"{name} must be an int {bounds}{why}; got {value!r:.80}", name)
  return value


def _object(body, name) -> dict:
  value = body.get(name) or {}
  if not isinstance(value, dict):
    raise ApiError(400, f"{name} must be an object; got {value!r:.80}", name)
  return value


def _bool(body, name) -> bool:
  value = body.get(name)
  if value is not None and not isinstance(value, bool):
    raise ApiError(400, f"{name} must be true or false; got {value!r:.80}", name)
  return bool(value)


def _float(body, name, default, low, high, low_open=False):
  value = body.get(name, default)
  value = default if value is None else value
  if not isinstance(value, (int, float)) or isinstance(value, bool) or value < low or (
      value > high) or (low_open and value == low):
    bracket = "(" if low_open else "["
    raise ApiError(400, f"{name} must be a number in {bracket}{low}, {high}]; got {value!r}",
                   name)
  return float(value)


def create_app(loop: EngineLoop, tokenizer, *, model_name: str, limits: Limits | None = None,
               readiness: Readiness | None = None, version=None,
               gateway: Gateway | None = None) -> FastAPI:
  """The app; `limits` bound each request (`serve.limits`; default `Limits()`); `readiness`
  says whether the engine is warm (`serve.readiness`; default: ready); `version()` gives the
  param version each response is tagged with (default the loop's `version`:
  `glm5_jax.serve.versions`); `gateway` records trajectories (default a new one:
  `glm5_jax.serve.gateway`)."""
  limits = limits or Limits()
  readiness = readiness or Readiness(ready=True)
  app = FastAPI(title="glm5-jax")
  version = version or (lambda: getattr(loop, "version", 0))
  gateway = gateway or Gateway(loop, tokenizer)
  app.state.gateway = gateway
  gateway.add_routes(app)
  engine = loop.engine
  started, chat_stops = time.time(), tuple(chat.stop_ids(tokenizer))

  @app.exception_handler(ApiError)
  async def _api_error(_, e: ApiError):
    return JSONResponse(error_body(e.status, e.message, e.param, e.code),
                        status_code=e.status, headers=e.headers)

  @app.exception_handler(Exception)
  async def _unexpected(_, e: Exception):  # a bug: still an OpenAI-shaped body, not text/plain
    return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"[:500]),
                        status_code=500)

  async def _body(http: HttpRequest) -> dict:
    if not readiness.ready:
      raise ApiError(503, f"the engine is warming up (compiling its programs: "
                     f"{readiness.progress}); retry later", code="warming",
                     headers={"Retry-After": str(RETRY_AFTER_S)})
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:  # refused unread
      raise ApiError(413, f"request body of {declared} bytes, more than "
                     f"{limits.max_body_bytes}")
    raw = bytearray()
    async for part in http.stream():  # a body without a length is cut off at the bound too
      raw += part
      if len(raw) > limits.max_body_bytes:
        raise ApiError(413, f"request body of more than {limits.max_body_bytes} bytes")
    body = parse_body(bytes(raw), limits)
    if body.get("model", model_name) != model_name:
      raise ApiError(400, f"unknown model {body['model']!r}; this server has {model_name!r}",
                     "model")
    return body

  def _requests(body, prompt, stops, *, chat_turn=False, prompt_field="prompt") -> list:
    n = _int(body, "n", 1, 1, limits.max_n, " (experiments/serve.py --max_n)")
    if limits.max_prompt_tokens is not None and len(prompt) > limits.max_prompt_tokens:
      raise ApiError(400, f"prompt of {len(prompt)} tokens, more than this server takes "
                     f"({limits.max_prompt_tokens}: experiments/serve.py --max_prompt_tokens)",
                     prompt_field)
    name = "max_tokens"
    if chat_turn and body.get("max_completion_tokens") is not None:  # OpenAI's current name
      if body.get("max_tokens") not in (None, body["max_completion_tokens"]):
        raise ApiError(400, f"max_completion_tokens {body['max_completion_tokens']!r:.40} and "
                       f"max_tokens {body['max_tokens']!r:.40} differ; give one",
                       "max_completion_tokens")
      name = "max_completion_tokens"
    max_tokens = _int(body, name, 16, 1, limits.max_tokens,
                      "" if limits.max_tokens is None else
                      " (experiments/serve.py --max_tokens_limit)")
    room = engine.max_len - len(prompt) + 1
    if max_tokens > room:
      raise ApiError(400, f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} need "
                     f"{len(prompt) + max_tokens - 1} positions, more than the server's "
                     f"max_len {engine.max_len} (at most {max(room, 0)} new tokens)",
                     name if room > 0 else prompt_field, code=CONTEXT_LENGTH_EXCEEDED)
    stop = body.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
      raise ApiError(400, "stop_token_ids must be a list of ints", "stop_token_ids")
    seed = body.get("seed")
    seed = secrets.randbits(32) if seed is None else _int(body, "seed", 0, 0, SEED_BOUND - 1)
    settings = dict(temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_float(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                    top_k=_int(body, "top_k", 0, 0), **_adjustments(body))
    try:
      return [Request(i, tuple(prompt), max_tokens, seed=request_seed(seed, i),
                      stop_tokens=tuple(stop) + stops, **settings) for i in range(n)]
    except ValueError as e:
      raise ApiError(400, str(e)) from None

  def _adjustments(body, recorded=False) -> dict:
    """The penalties and logit_bias (`infer.penalties`), refused where they cannot be exact:
    with speculative decoding, and on a recorded call (the gateway records the model's own
    log-probs for training; adjusted ones would be another policy's)."""
    out = dict(frequency_penalty=fields.penalty(body, "frequency_penalty"),
               presence_penalty=fields.penalty(body, "presence_penalty"),
               logit_bias=fields.logit_bias(body, engine.cfg.vocab_size))
    for name, value in out.items():
      if value and engine.k:
        raise ApiError(400, f"{name} needs plain decoding; this server speculates {engine.k} "
                       "tokens (experiments/serve.py --speculative_steps 0)", name)
      if value and recorded:
        raise ApiError(400, f"{name} on a recorded call (trajectory id): the gateway records "
                       "the model's own log-probs for training", name)
    return out

  def _top(body, name) -> int:
    return _int(body, name, 0, 0, engine.top_n,
                " (the alternatives this server keeps: experiments/serve.py --max_top_logprobs)")

  def _submit(requests, inbox, whole):
    try:  # all of a request's choices or none: a request never half fills the queue
      return loop.submit_all(requests, asyncio.get_running_loop(), inbox, whole=whole)
    except (QueueFull, Stopped) as e:
      if isinstance(e, QueueFull):  # overload: transient, the client should retry later
        raise ApiError(503, f"server overloaded, retry later: {e}", code="server_overloaded",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
      raise ApiError(503, f"server unavailable: {e}", code="engine_stopped") from None

  def _apply(choice, stream, event, delta, kept, call) -> None:
    """One stream item into its choice; a stop string cancels the request at the engine
    (a recorded call keeps the tokens up to it: `Gateway.cut`)."""
    if event is None:
      choice.end(delta)
      return
    stopped = choice.finish_reason is not None
    kept += choice.feed(event, delta)
    if not stopped and choice.text.stopped is not None:
      gateway.cut(call, len(choice.tokens))
      loop.cancel(stream)

  async def _respond(body, requests, choices, chunk, reply, call=None):
    """Runs `requests` (one per choice); a reply dict, or an SSE response of chunks:
    `chunk.head` (the same in every chunk: serialized once) with the choice `chunk(choice,
    delta, kept, first)`. Errors the engine raises before the first event are 400s. `call`:
    the gateway's (None: not recorded); its fields are read once every stream ended (the
    record is made on the engine thread before a stream's end is delivered)."""
    inbox: asyncio.Queue = asyncio.Queue()
    # A reply sent whole, with no stop string to watch for, needs no event before the end.
    whole = not _bool(body, "stream") and not any(c.text.stops for c in choices)
    streams = gateway.submit(call, requests, lambda rs: _submit(rs, inbox, whole))
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
    if not _bool(body, "stream"):
      try:
        async for batch in _with_first(first, items):
          for i, event in batch:
            _apply(choices[i], streams[i], event, deltas[i], kept[i], call)
      finally:
        for s in streams:
          loop.cancel(s)
      # json.dumps directly: FastAPI's encoder walks every log-prob in Python (~1 ms a reply).
      return JSONResponse(reply(deltas, kept))
    usage = _object(body, "stream_options").get("include_usage")

    async def events():
      sent, closed = set(), set()  # choices whose first / last chunk went out
      prefix = "data: " + json.dumps(chunk.head)[:-1] + ', "choices": ['
      try:
        async for batch in _with_first(first, items):
          out = {}  # one chunk per choice per batch
          for i, event in batch:
            if i not in closed:
              delta, new = out.setdefault(i, ({}, []))
              _apply(choices[i], streams[i], event, delta, new, call)
          frames = []
          for i, (delta, new) in out.items():
            frames.append(prefix + json.dumps(chunk(choices[i], delta, new, i not in sent))
                          + "]}\n\n")
            sent.add(i)
            if choices[i].finish_reason is not None:
              closed.add(i)
          if frames:
            yield "".join(frames)
        tail = {"usage": _usage(requests, choices)} if usage else {}
        tail.update(gateway.reply_fields(call))
        if tail:
          yield f"data: {json.dumps({**chunk.head, 'choices': [], **tail})}\n\n"
        yield "data: [DONE]\n\n"
      finally:
        for s in streams:  # a disconnected client (or one done) frees every slot it held
          loop.cancel(s)
    return StreamingResponse(events(), media_type="text/event-stream")

  def _usage(requests, choices):
    prompt, done = len(requests[0].prompt), sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

  def _stop_reason(choice):
    if choice.text.stopped is not None:
      return choice.text.stopped
    if choice.finish_reason in ("stop", "tool_calls") and choice.tokens and (
        choice.tokens[-1] in choice.stop_tokens):
      return choice.tokens[-1]
    return None

  @app.post("/v1/completions")
  async def completions(http: HttpRequest):
    body = await _body(http)
    fields.check_fields(body, "completions")
    if gateway.trajectory_id(http.headers, body) is not None:
      raise ApiError(400, "trajectory ids are recorded on /v1/chat/completions only",
                     "trajectory_id")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
      prompt = [tokenizer.bos_id] + tokenizer.encode(prompt)
    if not isinstance(prompt, list) or not prompt or not all(
        isinstance(t, int) and 0 <= t < engine.cfg.vocab_size for t in prompt):
      raise ApiError(400, "prompt must be a non-empty string or a list of token ids in "
                     f"[0, {engine.cfg.vocab_size})", "prompt")
    want_lp = body.get("logprobs") is not None
    top = _top(body, "logprobs") if want_lp else 0
    stops = _stop_strings(body)
    requests = _requests(body, prompt, () if _bool(body, "ignore_eos") else (tokenizer.eos_id,))
    choices = [Choice(i, ChoiceText(tokenizer, stops), r.stop_tokens, top)
               for i, r in enumerate(requests)]
    # echo: each choice's text starts with the prompt's (and its log-probs with its tokens).
    echoed = [echo_prompt(tokenizer, prompt, c) if _bool(body, "echo") else "" for c in choices]
    head = {"object": "text_completion", "model": model_name, "created": int(time.time()),
            "id": f"cmpl-{secrets.token_hex(8)}", "system_fingerprint": f"v{version()}"}

    def choice_text(c, delta, kept, first, final):
      """The choice's text in this chunk (a whole reply: one chunk) and its log-probs."""
      text = (echoed[c.index] if first else "") + delta.get("text", "")
      c.text_chars += len(text)
      return {"index": c.index, "text": text, "finish_reason": c.finish_reason,
              "logprobs": completion_logprobs(tokenizer, kept, c, c.text_chars,
                                              final) if want_lp else None}

    def chunk(c, delta, kept, first):
      return choice_text(c, delta, kept, first, c.finish_reason is not None)
    chunk.head = head

    def reply(deltas, kept):
      return {**head, "usage": _usage(requests, choices), "choices": [
          {**choice_text(c, d, k, True, True), "stop_reason": _stop_reason(c),
           "token_ids": c.tokens} for c, d, k in zip(choices, deltas, kept)]}
    return await _respond(body, requests, choices, chunk, reply)

  @app.post("/v1/chat/completions")
  async def chat_completions(http: HttpRequest):
    body = await _body(http)
    fields.check_fields(body, "chat")
    fields.check_response_format(body)
    thinking = bool(_object(body, "chat_template_kwargs").get("enable_thinking", True))
    messages = glm_messages(body.get("messages"), body.get("tools"))
    try:
      prompt = [int(i) for i in chat.render_prompt(
          messages, tokenizer, thinking=thinking, thinking_mode="turn_level")]
    except (ValueError, TypeError, KeyError) as e:
      raise ApiError(400, f"messages: {e}", "messages") from None
    tid = gateway.trajectory_id(http.headers, body)
    if tid is not None:  # refused before the gateway records anything
      _adjustments(body, recorded=True)
    call = gateway.begin(tid, messages, prompt, thinking=thinking, n=body.get("n") or 1)
    prompt = prompt if call is None else call.prompt  # TITO: the recorded tokens
    want_lp = _bool(body, "logprobs")
    top = _top(body, "top_logprobs")
    if top and not want_lp:
      raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    stops = _stop_strings(body)
    if stops and call is not None and engine.record_routing:
      raise ApiError(400, "stop strings end a recorded call by cancelling it, which loses its "
                     "routing: this server records routing (--record_routing), so a call with "
                     "a trajectory id takes stop_token_ids only", "stop")
    requests = _requests(body, prompt, chat_stops, chat_turn=True, prompt_field="messages")
    choices = [Choice(i, ChoiceText(tokenizer, stops, chat_turn=True, thinking=thinking),
                      r.stop_tokens, top) for i, r in enumerate(requests)]
    head = {"object": "chat.completion", "model": model_name, "created": int(time.time()),
            "id": f"chatcmpl-{secrets.token_hex(8)}", "system_fingerprint": f"v{version()}"}

    def chunk(c, delta, kept, first):
      return {"index": c.index, "delta": {"role": "assistant", **delta} if first else delta,
              "finish_reason": c.finish_reason,
              "logprobs": chat_logprobs(tokenizer, kept) if want_lp else None}
    chunk.head = {**head, "object": "chat.completion.chunk"}

    def reply(deltas, kept):
      out = []
      for c, d, k in zip(choices, deltas, kept):
        message = {"role": "assistant", "content": d.get("content", ""),
                   "reasoning_content": d.get("reasoning_content")}
        if d.get("tool_calls"):
          message["tool_calls"] = [{k2: v for k2, v in call.items() if k2 != "index"}
                                   for call in d["tool_calls"]]
        out.append({"index": c.index, "message": message, "finish_reason": c.finish_reason,
                    "stop_reason": _stop_reason(c), "token_ids": c.tokens,
                    "logprobs": chat_logprobs(tokenizer, k) if want_lp else None})
      return {**head, "usage": _usage(requests, choices), "choices": out,
              **gateway.reply_fields(call)}
    return await _respond(body, requests, choices, chunk, reply, call)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model",
                                        "created": int(started), "owned_by": "glm5-jax"}]}

  @app.get("/health")
  async def health():
    if not readiness.ready:  # listening, but no request is taken before the engine is warm
      return JSONResponse({"status": "warming", "progress": readiness.progress},
                          status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return {"status": "ok"}

  @app.get("/metrics")
  async def metrics():
    uptime = max(time.time() - started, 1e-9)
    lines = [f"glm5_queue_depth {loop.waiting()}", f"glm5_running_slots {loop.running()}",
             f"glm5_slots {engine.slots}", f"glm5_tokens_generated_total {loop.tokens_generated}",
             f"glm5_tokens_per_second {loop.tokens_generated / uptime:.3f}",
             f"glm5_engine_steps_total {loop.steps}",
             f"glm5_engine_slot_steps_total {loop.slot_steps}",
             f"glm5_ready {int(readiness.ready)}"]
    compiles = readiness.compiles()
    if compiles is not None:  # counted in the engine's own process (after warm-up: 0 new)
      lines.append(f"glm5_engine_compiles_total {compiles}")
    lines += gateway.metric_lines()
    if engine.pages is not None:  # the paged cache's pool (page 0 reserved: not counted)
      pool = engine.pages.pool
      lines += [f"glm5_cache_pages_used {pool.used}", f"glm5_cache_pages_free {pool.free}",
                f"glm5_cache_pages_total {pool.num_pages - 1}",
                f"glm5_cache_page_size {pool.page_size}"]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

  return app


async def _with_first(first, items):
  yield first
  async for batch in items:
    yield batch


def _stop_strings(body) -> tuple:
  stop = body.get("stop")
  if stop is None or stop == []:
    return ()
  stop = [stop] if isinstance(stop, str) else stop
  if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(
      isinstance(s, str) and s for s in stop):
    raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} "
                   f"non-empty strings; got {stop!r:.80}", "stop")
  return tuple(stop)
