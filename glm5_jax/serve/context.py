"""What every route of the app reads: the engine loop, the tokenizer, the request bounds and
readiness, and the readers that turn a request body into engine `Request`s.

`ServerContext.read_body` admits a body (warm engine, size, JSON depth, the served model);
`ServerContext.requests` makes one engine request per choice (n, max_tokens within the cache and
the bounds, stop ids, seed, sampling, the penalties and logit_bias). Each bad field is an
`ApiError` 400 naming it.
"""

import dataclasses
import secrets
from typing import Callable

from fastapi import Request as HttpRequest

from glm5_jax.infer.engine import request_seed
from glm5_jax.infer.requests import Request
from glm5_jax.serve import fields
from glm5_jax.serve.errors import CONTEXT_LENGTH_EXCEEDED, ApiError
from glm5_jax.serve.gateway import Gateway
from glm5_jax.serve.limits import Limits, parse_body
from glm5_jax.serve.readiness import Readiness

RETRY_AFTER_S = 1  # a 503's Retry-After: the queue drains at the engine's pace
SEED_BOUND = 1 << 32


@dataclasses.dataclass
class ServerContext:
  """The served engine and its bounds. `version()`: the param version responses are tagged
  with; `chat_stops`: the ids that end a chat turn (`chat.stop_ids`); `started`: the server's
  start time (seconds since the epoch)."""

  loop: object  # an EngineLoop (or VersionedLoop)
  tokenizer: object
  model_name: str
  limits: Limits
  readiness: Readiness
  version: Callable[[], int]
  gateway: Gateway
  chat_stops: tuple
  started: float

  @property
  def engine(self):
    return self.loop.engine

  async def read_body(self, http: HttpRequest) -> dict:
    """The request's JSON object: 503 while warming, 413 past `max_body_bytes` (refused unread
    when its declared length says so), 400 for bad JSON or another model's name."""
    limits = self.limits
    if not self.readiness.ready:
      raise ApiError(503, f"the engine is warming up (compiling its programs: "
                     f"{self.readiness.progress}); retry later", code="warming",
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
    if body.get("model", self.model_name) != self.model_name:
      raise ApiError(400, f"unknown model {body['model']!r}; this server has "
                     f"{self.model_name!r}", "model")
    return body

  def requests(self, body: dict, prompt, stops: tuple, *, chat_turn=False,
               prompt_field="prompt") -> list[Request]:
    """One engine request per choice of `body` (`n`), each ending at `stop_token_ids` +
    `stops`; `prompt_field` is named when the prompt is what does not fit."""
    limits, engine = self.limits, self.engine
    n = fields.int_field(body, "n", 1, 1, limits.max_n, " (experiments/serve.py --max_n)")
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
    max_tokens = fields.int_field(body, name, 16, 1, limits.max_tokens,
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
    seed = (secrets.randbits(32) if seed is None
            else fields.int_field(body, "seed", 0, 0, SEED_BOUND - 1))
    settings = dict(temperature=fields.float_field(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=fields.float_field(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                    top_k=fields.int_field(body, "top_k", 0, 0), **self.adjustments(body))
    try:
      return [Request(i, tuple(prompt), max_tokens, seed=request_seed(seed, i),
                      stop_tokens=tuple(stop) + stops, **settings) for i in range(n)]
    except ValueError as e:
      raise ApiError(400, str(e)) from None

  def adjustments(self, body: dict, recorded=False) -> dict:
    """The penalties and logit_bias (`infer.penalties`), refused where they cannot be exact:
    with speculative decoding, and on a recorded call (the gateway records the model's own
    log-probs for training; adjusted ones would be another policy's)."""
    engine = self.engine
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

  def top_logprobs(self, body: dict, name: str) -> int:
    """Log-prob alternatives asked for in field `name`, at most what the engine keeps."""
    return fields.int_field(body, name, 0, 0, self.engine.top_n,
                            " (the alternatives this server keeps: experiments/serve.py "
                            "--max_top_logprobs)")
