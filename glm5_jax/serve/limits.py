"""The server's bounds on one request, and reading a body within them.

One request must never cost the server more than a bounded share of it: its body bytes, its
JSON's nesting (Python's parser recurses, and a body of 100,000 `[` raised RecursionError, a 500),
its choices `n` (each a slot and a queue entry: `n=1000` filled the queue and every other client
got 503 for a moment), its prompt and generated tokens, and its log-prob alternatives. Each bound
is a 400 (413 for the body) in OpenAI's error shape naming the field; 503 stays for real
overload (many requests), never for one oversized request. experiments/serve.py sets them from
flags (`--max_n`, `--max_tokens_limit`, `--max_prompt_tokens`, `--max_body_bytes`,
`--max_json_depth`, `--max_top_logprobs`).
"""

import dataclasses
import json
import re

from glm5_jax.serve.errors import ApiError


@dataclasses.dataclass(frozen=True)
class Limits:
  """Bounds per request (module docstring); None: the engine's own (max_len) bound only.

  max_n: choices per request; also at most the loop's `max_queue` (`check_against_queue`).
  max_tokens: generated tokens per choice (`max_tokens` / `max_completion_tokens`).
  max_prompt_tokens: prompt tokens (after the chat template).
  max_body_bytes: request body bytes (413 past it).
  max_json_depth: nesting of the body's arrays and objects (the body itself is depth 1).
  """

  max_n: int = 16
  max_tokens: int | None = None
  max_prompt_tokens: int | None = None
  max_body_bytes: int = 1 << 20
  max_json_depth: int = 32

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value is None and field.name in ("max_tokens", "max_prompt_tokens"):
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Limits: {field.name} must be an int >= 1, got {value!r}")

  def check_against_queue(self, max_queue: int) -> None:
    """One request's choices must leave room in the queue for other clients' requests."""
    if self.max_n > max_queue // 2:
      raise ValueError(f"max_n {self.max_n} is more than half of max_queue {max_queue}: one "
                       "request could fill the queue and turn every other client away (503); "
                       "lower --max_n or raise --max_queue")


def parse_body(raw: bytes, limits: Limits) -> dict:
  """The JSON object of `raw`, within `limits`; ApiError 413 / 400 otherwise."""
  if len(raw) > limits.max_body_bytes:
    raise ApiError(413, f"request body of {len(raw)} bytes, more than {limits.max_body_bytes}")
  depth = json_depth(raw)
  if depth > limits.max_json_depth:
    raise ApiError(400, f"body nests arrays and objects {depth} deep, more than "
                   f"{limits.max_json_depth}")
  try:
    body = json.loads(raw)
  except ValueError as e:  # (UnicodeDecodeError is one)
    raise ApiError(400, f"body is not JSON: {e}") from None
  if not isinstance(body, dict):
    raise ApiError(400, "body must be a JSON object")
  return body


_STRUCTURAL = re.compile(rb'["\\\[\]{}]')


def json_depth(raw: bytes) -> int:
  """The deepest nesting of `[` / `{` in JSON text `raw`, brackets inside strings not counted.
  Checked before parsing: the parser recurses once per level (and a deep enough body raises
  RecursionError). Bytes, not characters: the structural characters and `"` / `\\` are ASCII,
  and no byte of a multi-byte UTF-8 character is ASCII; only those bytes are visited (a prompt
  of token ids or of text has a few)."""
  depth = deepest = 0
  in_string, escaped_at = False, -1  # the position a backslash escapes
  for match in _STRUCTURAL.finditer(raw):
    i, c = match.start(), raw[match.start()]
    if in_string:
      if i == escaped_at:
        continue
      if c == 0x5C:  # backslash
        escaped_at = i + 1
      elif c == 0x22:  # quote
        in_string = False
      continue
    if c == 0x22:
      in_string = True
    elif c in (0x5B, 0x7B):  # [ {
      depth += 1
      deepest = max(deepest, depth)
    elif c in (0x5D, 0x7D):  # ] }
      depth -= 1
  return deepest
