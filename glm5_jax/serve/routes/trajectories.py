"""The TITO gateway's records over HTTP (`serve.gateway`): GET /v1/trajectories/{id},
POST /v1/trajectories/{id}/finish (no more calls; returns the records) and
DELETE /v1/trajectories/{id}; a `GatewayError` answered in OpenAI's error shape."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from glm5_jax.serve.gateway import Gateway, GatewayError


def router(gateway: Gateway) -> APIRouter:
  routes = APIRouter()

  @routes.get("/v1/trajectories/{tid}")
  async def get(tid: str):
    return gateway.records(tid).as_json()

  @routes.post("/v1/trajectories/{tid}/finish")
  async def finish(tid: str):
    return gateway.finish(tid).as_json()

  @routes.delete("/v1/trajectories/{tid}")
  async def delete(tid: str):
    gateway.drop(tid)
    return {"id": tid, "deleted": True}

  return routes


async def gateway_error(_, e: GatewayError) -> JSONResponse:
  """The app's handler of `GatewayError` (an unknown trajectory: 404, a conflicting turn: 409,
  ...); the code is the status."""
  kind = {404: "not_found", 409: "conflict", 503: "server_error"}.get(
      e.status, "invalid_request_error")
  return JSONResponse({"error": {"message": e.message, "type": kind, "param": e.param,
                                 "code": e.status}}, status_code=e.status)
