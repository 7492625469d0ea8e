"""Every field of OpenAI's chat and completions request bodies, each honoured or refused.

A field is either read by the app's routes (`glm5_jax.serve.routes`: honoured), or accepted
only at its default (null, or the values listed in `REFUSED_UNLESS`) and otherwise a 400 naming
it: a feature this server does not have must never be dropped silently. A field outside both tables (a typo,
a newer OpenAI field) is a 400 naming it too. docs/serving.md, "Request fields", has the table.

Also here: the readers of one typed field (`int_field`, `float_field`, `bool_field`,
`object_field`), and the fields with rules of their own: `stop`, `logit_bias`, the penalties and
`response_format` (JSON output is not constrained: refused).
"""

from glm5_jax.infer.penalties import BIAS_BOUND, MAX_BIASED_TOKENS, PENALTY_BOUND
from glm5_jax.serve.errors import ApiError

MAX_STOPS = 16  # stop strings per request

# Read by the app (OpenAI's, then this server's extensions).
COMMON = ("model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
          "presence_penalty", "seed", "stop", "stream", "stream_options", "temperature",
          "top_p", "user", "top_k", "stop_token_ids")
HONOURED = {
    "chat": COMMON + ("messages", "top_logprobs", "max_completion_tokens", "response_format",
                      "tools", "chat_template_kwargs", "trajectory_id"),
    "completions": COMMON + ("prompt", "echo", "ignore_eos", "trajectory_id"),
}

# Accepted at these values only (null always); any other value is a 400 naming the field.
_NOT_HERE = "not supported by this server"
REFUSED_UNLESS = {
    "chat": {
        "tool_choice": (("auto",), "a forced or forbidden tool call needs constrained decoding, "
                        "which this server does not do"),
        "parallel_tool_calls": ((True,), "the model may always emit several tool calls"),
        "store": ((False,), "stored completions are " + _NOT_HERE),
        "metadata": (({},), "stored completions are " + _NOT_HERE),
        "service_tier": (("auto", "default"), "service tiers are " + _NOT_HERE),
        "modalities": ((["text"],), "only text output is generated"),
        "audio": ((), "audio output is " + _NOT_HERE),
        "prediction": ((), "predicted outputs are " + _NOT_HERE),
        "reasoning_effort": ((), "thinking is on or off: chat_template_kwargs.enable_thinking"),
        "web_search_options": ((), "web search is " + _NOT_HERE),
        "functions": ((), "deprecated by OpenAI: send tools"),
        "function_call": ((), "deprecated by OpenAI: send tool_choice"),
    },
    "completions": {
        "best_of": ((1,), "ranking several samples server-side is " + _NOT_HERE +
                    "; ask for n choices"),
        "suffix": (("",), "insertion (a suffix after the completion) is " + _NOT_HERE),
    },
}


def check_fields(body: dict, endpoint: str) -> None:
  """400 naming the first field of `body` that is unknown, or set where it is refused
  (`endpoint`: "chat" or "completions")."""
  refused = REFUSED_UNLESS[endpoint]
  for name, value in body.items():
    if name in HONOURED[endpoint]:
      continue
    if name not in refused:
      raise ApiError(400, f"unknown field {name!r:.60} for /v1/{_path(endpoint)} (see "
                     "docs/serving.md, request fields)", name[:60] if isinstance(name, str)
                     else None)
    allowed, why = refused[name]
    if value is not None and value not in allowed:
      raise ApiError(400, f"{name} {value!r:.60}: {why}", name)
  if endpoint == "chat":
    _known_keys(body, "chat_template_kwargs", ("enable_thinking",))
  _known_keys(body, "stream_options", ("include_usage",))


def _path(endpoint):
  return "chat/completions" if endpoint == "chat" else "completions"


def _known_keys(body, name, keys) -> None:
  value = body.get(name)
  if isinstance(value, dict):
    extra = [k for k in value if k not in keys]
    if extra:
      raise ApiError(400, f"{name}.{extra[0]!s:.40} is not supported (known: {', '.join(keys)})",
                     name)


def penalty(body, name) -> float:
  """`frequency_penalty` / `presence_penalty`: a number in [-2, 2], default 0."""
  value = body.get(name)
  if value is None:
    return 0.0
  if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
      -PENALTY_BOUND <= value <= PENALTY_BOUND):
    raise ApiError(400, f"{name} must be a number in [-2, 2]; got {value!r:.60}", name)
  return float(value)


def logit_bias(body, vocab_size: int) -> tuple:
  """`logit_bias` `{"token id": bias}` -> sorted `(id, bias)` pairs; ids written as decimal
  ints in [0, vocab_size), biases numbers in [-100, 100], at most `MAX_BIASED_TOKENS`."""
  value = body.get("logit_bias")
  if value is None:
    return ()
  if not isinstance(value, dict) or len(value) > MAX_BIASED_TOKENS:
    raise ApiError(400, f"logit_bias must be an object of at most {MAX_BIASED_TOKENS} "
                   f"\"token id\": bias entries; got {value!r:.60}", "logit_bias")
  pairs = []
  for key, bias in value.items():
    if not (key.isascii() and key.isdigit() and str(int(key)) == key and int(key) < vocab_size):
      raise ApiError(400, f"logit_bias key {key!r:.40} is not a token id in [0, {vocab_size})",
                     "logit_bias")
    if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not (
        -BIAS_BOUND <= bias <= BIAS_BOUND):
      raise ApiError(400, f"logit_bias[{key!r}] must be a number in [-100, 100]; got "
                     f"{bias!r:.40}", "logit_bias")
    pairs.append((int(key), float(bias)))
  return tuple(sorted(pairs))


def check_response_format(body) -> None:
  """`{"type": "text"}` (the default) only: JSON output would need constrained decoding."""
  value = body.get("response_format")
  if value is None or value == {"type": "text"}:
    return
  kind = value.get("type") if isinstance(value, dict) else None
  if kind in ("json_object", "json_schema"):
    raise ApiError(400, f"response_format {kind!r}: this server does not constrain decoding "
                   "to JSON; ask for JSON in the prompt and parse the text",
                   "response_format")
  raise ApiError(400, f"response_format must be {{\"type\": \"text\"}}; got {value!r:.60}",
                 "response_format")


def int_field(body, name, default, low, high=None, why="") -> int:
  """`body[name]`, an int in [low, high] (None: unbounded above); absent or null: `default`.
  `why` ends the error message (where the bound comes from)."""
  value = body.get(name, default)
  if value is None:
    value = default
  if not isinstance(value, int) or isinstance(value, bool) or value < low or (
      high is not None and value > high):
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ApiError(400, f"{name} must be an int {bounds}{why}; got {value!r:.80}", name)
  return value


def float_field(body, name, default, low, high, low_open=False) -> float:
  """`body[name]`, a number in [low, high] ((low, high] with `low_open`); absent or null:
  `default`."""
  value = body.get(name, default)
  value = default if value is None else value
  if not isinstance(value, (int, float)) or isinstance(value, bool) or value < low or (
      value > high) or (low_open and value == low):
    bracket = "(" if low_open else "["
    raise ApiError(400, f"{name} must be a number in {bracket}{low}, {high}]; got {value!r}",
                   name)
  return float(value)


def bool_field(body, name) -> bool:
  """`body[name]`, true or false; absent or null: false."""
  value = body.get(name)
  if value is not None and not isinstance(value, bool):
    raise ApiError(400, f"{name} must be true or false; got {value!r:.80}", name)
  return bool(value)


def object_field(body, name) -> dict:
  """`body[name]`, an object; absent, null or empty: {}."""
  value = body.get(name) or {}
  if not isinstance(value, dict):
    raise ApiError(400, f"{name} must be an object; got {value!r:.80}", name)
  return value


def stop_strings(body) -> tuple:
  """`stop`: a non-empty string or a list of at most `MAX_STOPS` of them; absent: ()."""
  stop = body.get("stop")
  if stop is None or stop == []:
    return ()
  stop = [stop] if isinstance(stop, str) else stop
  if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(
      isinstance(s, str) and s for s in stop):
    raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} "
                   f"non-empty strings; got {stop!r:.80}", "stop")
  return tuple(stop)
