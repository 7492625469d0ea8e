"""The OpenAI-compatible HTTP layer (FastAPI) over one `EngineLoop`.

  POST /v1/completions        prompt: text (tokenized, bos first) or token ids
  POST /v1/chat/completions   messages rendered by `glm5_jax.data.chat` (GLM-5's template);
                              thinking per request with the extra body field
                              `chat_template_kwargs: {"enable_thinking": bool}` (default on);
                              the reply's `reasoning_content` is the thinking text;
                              `tools` rendered in GLM's tools block, generated `<tool_call>`s
                              parsed back into `tool_calls`
  GET  /v1/models, /health, /metrics (Prometheus text)
  GET, POST .../finish, DELETE /v1/trajectories/{id}   the TITO gateway's records

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

`create_app` only assembles: the routes are `serve.routes`' (one router per family: completions,
chat, trajectories, status), over one `serve.context.ServerContext` (the engine loop, tokenizer,
bounds and readiness, and the readers of a request body); `serve.respond` runs a request's
choices and answers it whole or as SSE; `serve.fields` reads and refuses fields.
"""

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from glm5_jax.data import chat
from glm5_jax.serve.context import ServerContext
from glm5_jax.serve.engine_loop import EngineLoop
from glm5_jax.serve.errors import ApiError, error_body
from glm5_jax.serve.gateway import Gateway, GatewayError
from glm5_jax.serve.limits import Limits
from glm5_jax.serve.readiness import Readiness
from glm5_jax.serve.routes import chat as chat_routes
from glm5_jax.serve.routes import completions, status, trajectories


def create_app(loop: EngineLoop, tokenizer, *, model_name: str, limits: Limits | None = None,
               readiness: Readiness | None = None, version=None,
               gateway: Gateway | None = None) -> FastAPI:
  """The app; `limits` bound each request (`serve.limits`; default `Limits()`); `readiness`
  says whether the engine is warm (`serve.readiness`; default: ready); `version()` gives the
  param version each response is tagged with (default the loop's `version`:
  `glm5_jax.serve.versions`); `gateway` records trajectories (default a new one:
  `glm5_jax.serve.gateway`; also `app.state.gateway`)."""
  gateway = gateway or Gateway(loop, tokenizer)
  ctx = ServerContext(loop=loop, tokenizer=tokenizer, model_name=model_name,
                      limits=limits or Limits(), readiness=readiness or Readiness(ready=True),
                      version=version or (lambda: getattr(loop, "version", 0)),
                      gateway=gateway, chat_stops=tuple(chat.stop_ids(tokenizer)),
                      started=time.time())
  app = FastAPI(title="glm5-jax")
  app.state.gateway = gateway
  app.add_exception_handler(ApiError, _api_error)
  app.add_exception_handler(GatewayError, trajectories.gateway_error)
  app.add_exception_handler(Exception, _unexpected)
  app.include_router(trajectories.router(gateway))
  app.include_router(completions.router(ctx))
  app.include_router(chat_routes.router(ctx))
  app.include_router(status.router(ctx))
  return app


async def _api_error(_, e: ApiError) -> JSONResponse:
  return JSONResponse(error_body(e.status, e.message, e.param, e.code),
                      status_code=e.status, headers=e.headers)


async def _unexpected(_, e: Exception) -> JSONResponse:
  """A bug: still an OpenAI-shaped body, not text/plain."""
  return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"[:500]),
                      status_code=500)
