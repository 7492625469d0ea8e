"""GET /v1/models (the one served model), /health (200 once warm; 503 "warming" with its
progress before: `serve.readiness`) and /metrics (Prometheus text: queue, slots, tokens,
engine steps and compiles, the gateway's counters, the paged cache's pool)."""

import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from glm5_jax.serve.context import RETRY_AFTER_S, ServerContext


def router(ctx: ServerContext) -> APIRouter:
  routes = APIRouter()
  readiness = ctx.readiness

  @routes.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": ctx.model_name, "object": "model",
                                        "created": int(ctx.started), "owned_by": "glm5-jax"}]}

  @routes.get("/health")
  async def health():
    if not readiness.ready:  # listening, but no request is taken before the engine is warm
      return JSONResponse({"status": "warming", "progress": readiness.progress},
                          status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return {"status": "ok"}

  @routes.get("/metrics")
  async def metrics():
    return PlainTextResponse("\n".join(metric_lines(ctx)) + "\n",
                             media_type="text/plain; version=0.0.4")

  return routes


def metric_lines(ctx: ServerContext) -> list[str]:
  """The /metrics lines, `name value` each."""
  loop, engine, readiness = ctx.loop, ctx.engine, ctx.readiness
  uptime = max(time.time() - ctx.started, 1e-9)
  lines = [f"glm5_queue_depth {loop.waiting()}", f"glm5_running_slots {loop.running()}",
           f"glm5_slots {engine.slots}", f"glm5_tokens_generated_total {loop.tokens_generated}",
           f"glm5_tokens_per_second {loop.tokens_generated / uptime:.3f}",
           f"glm5_engine_steps_total {loop.steps}",
           f"glm5_engine_slot_steps_total {loop.slot_steps}",
           f"glm5_ready {int(readiness.ready)}"]
  compiles = readiness.compiles()
  if compiles is not None:  # counted in the engine's own process (after warm-up: 0 new)
    lines.append(f"glm5_engine_compiles_total {compiles}")
  lines += ctx.gateway.metric_lines()
  if engine.pages is not None:  # the paged cache's pool (page 0 reserved: not counted)
    pool = engine.pages.pool
    lines += [f"glm5_cache_pages_used {pool.used}", f"glm5_cache_pages_free {pool.free}",
              f"glm5_cache_pages_total {pool.num_pages - 1}",
              f"glm5_cache_page_size {pool.page_size}"]
  return lines
