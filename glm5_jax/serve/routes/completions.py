"""POST /v1/completions: a prompt (text, tokenized with bos first, or token ids) continued;
`echo` puts the prompt's text before each choice's (with `logprobs`: a 400, the engine computes
no log-probs for prompt tokens)."""

import secrets
import time

from fastapi import APIRouter, Request as HttpRequest

from glm5_jax.serve import fields
from glm5_jax.serve.choices import Choice, completion_logprobs, echo_prompt
from glm5_jax.serve.context import ServerContext
from glm5_jax.serve.errors import ApiError
from glm5_jax.serve.respond import respond, stop_reason, usage
from glm5_jax.serve.text import ChoiceText


def router(ctx: ServerContext) -> APIRouter:
  routes = APIRouter()
  tokenizer = ctx.tokenizer

  @routes.post("/v1/completions")
  async def completions(http: HttpRequest):
    body = await ctx.read_body(http)
    fields.check_fields(body, "completions")
    if ctx.gateway.trajectory_id(http.headers, body) is not None:
      raise ApiError(400, "trajectory ids are recorded on /v1/chat/completions only",
                     "trajectory_id")
    prompt, vocab_size = body.get("prompt"), ctx.engine.cfg.vocab_size
    if isinstance(prompt, str):
      prompt = [tokenizer.bos_id] + tokenizer.encode(prompt)
    if not isinstance(prompt, list) or not prompt or not all(
        isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
      raise ApiError(400, "prompt must be a non-empty string or a list of token ids in "
                     f"[0, {vocab_size})", "prompt")
    want_lp = body.get("logprobs") is not None
    top = ctx.top_logprobs(body, "logprobs") if want_lp else 0
    echo = fields.bool_field(body, "echo")
    if echo and want_lp:
      raise ApiError(400, "echo with logprobs: OpenAI returns the prompt tokens' log-probs, and "
                     "this server computes none for prompt tokens; ask for echo or logprobs",
                     "echo")
    stops = fields.stop_strings(body)
    ends = () if fields.bool_field(body, "ignore_eos") else (tokenizer.eos_id,)
    requests = ctx.requests(body, prompt, ends)
    choices = [Choice(i, ChoiceText(tokenizer, stops), r.stop_tokens, top)
               for i, r in enumerate(requests)]
    echoed = echo_prompt(tokenizer, prompt) if echo else ""
    head = {"object": "text_completion", "model": ctx.model_name, "created": int(time.time()),
            "id": f"cmpl-{secrets.token_hex(8)}", "system_fingerprint": f"v{ctx.version()}"}

    def choice_text(c, delta, kept, first, final):
      """The choice's text in this chunk (a whole reply: one chunk) and its log-probs."""
      text = (echoed if first else "") + delta.get("text", "")
      c.text_chars += len(text)
      return {"index": c.index, "text": text, "finish_reason": c.finish_reason,
              "logprobs": completion_logprobs(tokenizer, kept, c, c.text_chars,
                                              final) if want_lp else None}

    def chunk(c, delta, kept, first):
      return choice_text(c, delta, kept, first, c.finish_reason is not None)
    chunk.head = head

    def reply(deltas, kept):
      return {**head, "usage": usage(requests, choices), "choices": [
          {**choice_text(c, d, k, True, True), "stop_reason": stop_reason(c),
           "token_ids": c.tokens} for c, d, k in zip(choices, deltas, kept)]}
    return await respond(ctx, body, requests, choices, chunk, reply)

  return routes
