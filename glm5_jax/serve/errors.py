"""The server's errors, answered as OpenAI-style JSON bodies
`{"error": {"message", "type", "param", "code"}}`."""


# OpenAI's error code for a request whose prompt and max_tokens do not fit the context; agents
# read it as "no room for this call" (`glm5_jax.posttrain.envs.agent_chat.complete`).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class ApiError(Exception):
  """An HTTP error answered as an OpenAI-style body (`error_body`): `status`, `param` (the
  request field at fault), `code` (default the status), extra `headers` (Retry-After)."""

  def __init__(self, status: int, message: str, param: str | None = None, *,
               code: str | None = None, headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.code, self.headers = code, headers


def error_body(status, message, param=None, code=None):
  kind = {400: "invalid_request_error", 413: "invalid_request_error",
          404: "not_found"}.get(status, "server_error")
  return {"error": {"message": message, "type": kind, "param": param,
                    "code": code or status}}
