"""POST /v1/chat/completions: messages (and tools) rendered by `glm5_jax.data.chat` (GLM-5's
template), thinking per request (`chat_template_kwargs.enable_thinking`, default on), the reply
split into `reasoning_content`, `content` and `tool_calls`. A call with a trajectory id is
recorded by the TITO gateway (`serve.gateway`): its prompt is the gateway's recorded tokens,
and its reply carries `trajectory` (in a stream, in the last chunk before `[DONE]`)."""

import secrets
import time

from fastapi import APIRouter, Request as HttpRequest

from glm5_jax.data import chat
from glm5_jax.serve import fields
from glm5_jax.serve.choices import Choice, chat_logprobs
from glm5_jax.serve.context import ServerContext
from glm5_jax.serve.errors import ApiError
from glm5_jax.serve.messages import glm_messages
from glm5_jax.serve.respond import respond, stop_reason, usage
from glm5_jax.serve.text import ChoiceText


def router(ctx: ServerContext) -> APIRouter:
  routes = APIRouter()
  tokenizer, gateway = ctx.tokenizer, ctx.gateway

  @routes.post("/v1/chat/completions")
  async def chat_completions(http: HttpRequest):
    body = await ctx.read_body(http)
    fields.check_fields(body, "chat")
    fields.check_response_format(body)
    thinking = bool(fields.object_field(body, "chat_template_kwargs").get("enable_thinking",
                                                                          True))
    messages = glm_messages(body.get("messages"), body.get("tools"))
    try:
      prompt = [int(i) for i in chat.render_prompt(
          messages, tokenizer, thinking=thinking, thinking_mode="turn_level")]
    except (ValueError, TypeError, KeyError) as e:
      raise ApiError(400, f"messages: {e}", "messages") from None
    tid = gateway.trajectory_id(http.headers, body)
    if tid is not None:  # refused before the gateway records anything
      ctx.adjustments(body, recorded=True)
    call = gateway.begin(tid, messages, prompt, thinking=thinking, n=body.get("n") or 1)
    prompt = prompt if call is None else call.prompt  # TITO: the recorded tokens
    want_lp = fields.bool_field(body, "logprobs")
    top = ctx.top_logprobs(body, "top_logprobs")
    if top and not want_lp:
      raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    stops = fields.stop_strings(body)
    if stops and call is not None and ctx.engine.record_routing:
      raise ApiError(400, "stop strings end a recorded call by cancelling it, which loses its "
                     "routing: this server records routing (--record_routing), so a call with "
                     "a trajectory id takes stop_token_ids only", "stop")
    requests = ctx.requests(body, prompt, ctx.chat_stops, chat_turn=True,
                            prompt_field="messages")
    choices = [Choice(i, ChoiceText(tokenizer, stops, chat_turn=True, thinking=thinking),
                      r.stop_tokens, top) for i, r in enumerate(requests)]
    head = {"object": "chat.completion", "model": ctx.model_name, "created": int(time.time()),
            "id": f"chatcmpl-{secrets.token_hex(8)}", "system_fingerprint": f"v{ctx.version()}"}

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
          message["tool_calls"] = [{k2: v for k2, v in tool_call.items() if k2 != "index"}
                                   for tool_call in d["tool_calls"]]
        out.append({"index": c.index, "message": message, "finish_reason": c.finish_reason,
                    "stop_reason": stop_reason(c), "token_ids": c.tokens,
                    "logprobs": chat_logprobs(tokenizer, k) if want_lp else None})
      return {**head, "usage": usage(requests, choices), "choices": out,
              **gateway.reply_fields(call)}
    return await respond(ctx, body, requests, choices, chunk, reply, call)

  return routes
