"""The OpenAI-compatible HTTP layer (FastAPI) over one `EngineLoop`.

  POST /v1/completions        prompt: text (tokenized, bos first) or token ids
  POST /v1/chat/completions   messages rendered by `glm5_jax.data.chat` (GLM-5's template);
                              thinking per request with the extra body field
                              `chat_template_kwargs: {"enable_thinking": bool}` (default on);
                              the reply's `reasoning_content` is the thinking text;
                              `tools` rendered in GLM's tools block, generated `<tool_call>`s
                              parsed back into `tool_calls`
  GET  /v1/models, /health, /metrics (Prometheus text)

Both POSTs take `n`, `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop_token_ids`,
`logprobs` and `stream` (server-sent events). A completion stops at eos (unless `ignore_eos`),
a chat turn at GLM's stop tokens (`chat.stop_ids`: every role token and eos). Log-probs are the raw model's (temperature 1),
the engine's `raw_logprobs`; choice i of a request with `seed` s draws with
`request_seed(s, i)`, as prompt i of `infer.generate(..., seed=s)` does.

Errors are OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}`: 400 naming
the field, 413 for a body over `max_body_bytes`, 429 when the engine loop's queue is full. A
streaming client that disconnects has its requests cancelled (their slots freed).
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
from glm5_jax.serve.engine_loop import EngineLoop, QueueFull
from glm5_jax.serve.gateway import Gateway


class ApiError(Exception):
  def __init__(self, status: int, message: str, param: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param


def _error_body(status, message, param=None):
  kind = {400: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_exceeded", 404: "not_found"}.get(status, "server_error")
  return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _int(body, name, default, low):
  value = body.get(name, default)
  if value is None:
    value = default
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    raise ApiError(400, f"{name} must be an int >= {low}; got {value!r}", name)
  return value


def _float(body, name, default, low, high, low_open=False):
  value = body.get(name, default)
  value = default if value is None else value
  if not isinstance(value, (int, float)) or isinstance(value, bool) or value < low or (
      value > high) or (low_open and value == low):
    bracket = "(" if low_open else "["
    raise ApiError(400, f"{name} must be a number in {bracket}{low}, {high}]; got {value!r}",
                   name)
  return float(value)


def create_app(loop: EngineLoop, tokenizer, *, model_name: str, max_body_bytes: int = 1 << 20,
               version=None, gateway: Gateway | None = None) -> FastAPI:
  """The app; `version()` gives the param version each response is tagged with (default the
  loop's `version`: `glm5_jax.serve.versions`); `gateway` records trajectories (default a new
  one: `glm5_jax.serve.gateway`)."""
  app = FastAPI(title="glm5-jax")
  version = version or (lambda: getattr(loop, "version", 0))
  gateway = gateway or Gateway(loop, tokenizer)
  app.state.gateway = gateway
  gateway.add_routes(app)
  engine = loop.engine
  started, chat_stops = time.time(), tuple(chat.stop_ids(tokenizer))

  @app.exception_handler(ApiError)
  async def _api_error(_, e: ApiError):
    return JSONResponse(_error_body(e.status, e.message, e.param), status_code=e.status)

  async def _body(http: HttpRequest) -> dict:
    raw = await http.body()
    if len(raw) > max_body_bytes:
      raise ApiError(413, f"request body of {len(raw)} bytes, more than {max_body_bytes}")
    try:
      body = json.loads(raw)
    except ValueError as e:
      raise ApiError(400, f"body is not JSON: {e}") from None
    if not isinstance(body, dict):
      raise ApiError(400, "body must be a JSON object")
    if body.get("model", model_name) != model_name:
      raise ApiError(400, f"unknown model {body['model']!r}; this server has {model_name!r}",
                     "model")
    return body

  def _requests(body, prompt, stops) -> list:
    n = _int(body, "n", 1, 1)
    max_tokens = _int(body, "max_tokens", 16, 1)
    room = engine.max_len - len(prompt) + 1
    if max_tokens > room:
      raise ApiError(400, f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} need "
                     f"{len(prompt) + max_tokens - 1} positions, more than the server's "
                     f"max_len {engine.max_len} (at most {max(room, 0)} new tokens)",
                     "max_tokens")
    stop = body.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
      raise ApiError(400, "stop_token_ids must be a list of ints", "stop_token_ids")
    seed = body.get("seed")
    seed = secrets.randbits(32) if seed is None else _int(body, "seed", 0, 0)
    settings = dict(temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_float(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                    top_k=_int(body, "top_k", 0, 0))
    try:
      return [Request(i, tuple(prompt), max_tokens, seed=request_seed(seed, i),
                      stop_tokens=tuple(stop) + stops, **settings) for i in range(n)]
    except ValueError as e:
      raise ApiError(400, str(e)) from None

  def _submit(requests):
    streams = []
    try:
      for r in requests:
        streams.append(loop.submit(r, asyncio.get_running_loop()))
    except QueueFull as e:
      for s in streams:
        loop.cancel(s)
      raise ApiError(429, f"server busy: {e}") from None
    return streams

  async def _next(stream):
    return await stream.aget()

  def _choice_logprobs(event_tokens, raws, want):
    if not want:
      return None
    return {"tokens": [tokenizer.decode([t], skip_special=False) for t in event_tokens],
            "token_ids": event_tokens, "token_logprobs": raws}

  async def _collect(streams):
    results = []
    for s in streams:
      tokens, raws, reason = [], [], "length"
      while True:
        try:
          event = await _next(s)
        except ValueError as e:
          raise ApiError(400, str(e)) from None
        if event is None:
          break
        tokens += event.tokens
        raws += event.raw_logprobs
        if event.completion is not None:
          reason = event.completion.finish_reason
      results.append((tokens, raws, reason))
    return results

  def _usage(prompt, results):
    done = sum(len(t) for t, _, _ in results)
    return {"prompt_tokens": len(prompt), "completion_tokens": done,
            "total_tokens": len(prompt) + done}

  async def _stream(http, streams, frame):
    async def events():
      try:
        for i, s in enumerate(streams):
          while (event := await _next(s)) is not None:
            if await http.is_disconnected():
              raise asyncio.CancelledError
            reason = event.completion.finish_reason if event.completion else None
            yield f"data: {json.dumps(frame(i, event, reason))}\n\n"
        yield "data: [DONE]\n\n"
      finally:
        for s in streams:  # a disconnected client (or one done) frees every slot it held
          loop.cancel(s)
    return StreamingResponse(events(), media_type="text/event-stream")

  @app.post("/v1/completions")
  async def completions(http: HttpRequest):
    body = await _body(http)
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
    requests = _requests(body, prompt, () if body.get("ignore_eos") else (tokenizer.eos_id,))
    streams = _submit(requests)
    head = {"object": "text_completion", "model": model_name, "created": int(time.time()),
            "id": f"cmpl-{secrets.token_hex(8)}", "system_fingerprint": f"v{version()}"}
    if body.get("stream"):
      return await _stream(http, streams, lambda i, e, reason: {**head, "choices": [{
          "index": i, "text": tokenizer.decode(e.tokens), "finish_reason": reason,
          "logprobs": _choice_logprobs(e.tokens, e.raw_logprobs, want_lp)}]})
    results = await _collect(streams)
    return {**head, "usage": _usage(prompt, results), "choices": [
        {"index": i, "text": tokenizer.decode(t), "finish_reason": reason, "token_ids": t,
         "logprobs": _choice_logprobs(t, raws, want_lp)}
        for i, (t, raws, reason) in enumerate(results)]}

  @app.post("/v1/chat/completions")
  async def chat_completions(http: HttpRequest):
    body = await _body(http)
    thinking = (body.get("chat_template_kwargs") or {}).get("enable_thinking", True)
    messages = _glm_messages(body.get("messages"), body.get("tools"))
    try:
      prompt = [int(i) for i in chat.render_prompt(
          messages, tokenizer, thinking=bool(thinking),
          thinking_mode="turn_level")]
    except (ValueError, TypeError, KeyError) as e:
      raise ApiError(400, f"messages: {e}", "messages") from None
    call = gateway.begin(gateway.trajectory_id(http.headers, body), messages, prompt,
                         thinking=bool(thinking), n=body.get("n") or 1)
    prompt = prompt if call is None else call.prompt  # TITO: the recorded tokens
    want_lp = bool(body.get("logprobs"))
    streams = gateway.submit(call, _requests(body, prompt, chat_stops), _submit)
    head = {"object": "chat.completion", "model": model_name, "created": int(time.time()),
            "id": f"chatcmpl-{secrets.token_hex(8)}", "system_fingerprint": f"v{version()}"}
    if body.get("stream"):
      return await _stream(http, streams, lambda i, e, reason: {
          **head, "object": "chat.completion.chunk", "choices": [{
              "index": i, "delta": {"content": tokenizer.decode(e.tokens)},
              "finish_reason": reason}]})
    results = await _collect(streams)
    choices = []
    for i, (tokens, raws, reason) in enumerate(results):
      parsed = chat.parse_response(tokens, tokenizer)
      message = {"role": "assistant", "content": parsed.content,
                 "reasoning_content": parsed.thinking}
      if parsed.tool_calls:
        message["tool_calls"] = [_tool_call(c, j) for j, c in enumerate(parsed.tool_calls)]
        reason = "tool_calls"
      choice = {"index": i, "message": message, "finish_reason": reason, "token_ids": tokens}
      if want_lp:
        choice["logprobs"] = {"content": [
            {"token": tokenizer.decode([t], skip_special=False), "logprob": lp}
            for t, lp in zip(tokens, raws)]}
      choices.append(choice)
    return {**head, "usage": _usage(prompt, results), "choices": choices,
            **gateway.reply_fields(call)}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model",
                                        "created": int(started), "owned_by": "glm5-jax"}]}

  @app.get("/health")
  async def health():
    return {"status": "ok"}

  @app.get("/metrics")
  async def metrics():
    uptime = max(time.time() - started, 1e-9)
    lines = [f"glm5_queue_depth {loop.waiting()}", f"glm5_running_slots {loop.running()}",
             f"glm5_slots {engine.slots}", f"glm5_tokens_generated_total {loop.tokens_generated}",
             f"glm5_tokens_per_second {loop.tokens_generated / uptime:.3f}"]
    lines += gateway.metric_lines()
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

  return app


def _tool_call(call, j):
  name, arguments = (call, {}) if isinstance(call, str) else (call["name"], call["arguments"])
  return {"id": f"call_{j}", "type": "function",
          "function": {"name": name, "arguments": json.dumps(arguments)}}


TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, output the function name and arguments within the "
    "following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key>"
    "<arg_value>{arg-value-1}</arg_value>...</tool_call>")


def _glm_messages(messages, tools) -> list:
  """OpenAI messages (and `tools`) -> `glm5_jax.data.chat` messages: role `tool` is
  `observation`, `reasoning_content` is `thinking`, an assistant's OpenAI `tool_calls` become
  `{"name", "arguments": dict}`, and the tools' JSON schemas go into the system message in
  GLM's tools block. ApiError 400 naming `messages[i]` or `tools[i]` on bad input."""
  if not isinstance(messages, list) or not messages:
    raise ApiError(400, "messages must be a non-empty list of message objects", "messages")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise ApiError(400, f"messages[{i}] must be an object with a str role", "messages")
    role = {"tool": "observation"}.get(m["role"], m["role"])
    g = {"role": role, "content": m.get("content") or ""}
    if role == "assistant":
      if m.get("reasoning_content"):
        g["thinking"] = m["reasoning_content"]
      calls = []
      for j, call in enumerate(m.get("tool_calls") or []):
        try:
          fn = call["function"]
          args = json.loads(fn.get("arguments") or "{}")
          calls.append({"name": fn["name"], "arguments": args} if args else fn["name"])
        except (KeyError, TypeError, AttributeError, ValueError) as e:
          raise ApiError(400, f"messages[{i}].tool_calls[{j}]: expected {{\"function\": "
                         f"{{\"name\", \"arguments\": JSON text}}}} ({e})", "messages") from None
      if calls:
        g["tool_calls"] = calls
    out.append(g)
  if tools:
    if not isinstance(tools, list):
      raise ApiError(400, "tools must be a list of {\"type\": \"function\", \"function\": "
                     "{\"name\", ...}}", "tools")
    for i, t in enumerate(tools):
      if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(
          t.get("function"), dict) and isinstance(t["function"].get("name"), str)):
        raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                       f"{{\"name\": str, ...}}}}; got {t!r:.80}", "tools")
    block = TOOLS_HEADER + "\n".join(json.dumps(t["function"], ensure_ascii=False)
                                      for t in tools) + TOOLS_FOOTER
    if out[0]["role"] == "system":
      out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
    else:
      out.insert(0, {"role": "system", "content": block})
  return out
