"""OpenAI chat messages (and `tools`) -> `glm5_jax.data.chat` messages, for the server's chat
endpoint (`glm5_jax.serve.app`). Bad input is an `ApiError` 400 naming `messages` or `tools`."""

import json

from glm5_jax.serve.errors import ApiError

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, output the function name and arguments within the "
    "following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key>"
    "<arg_value>{arg-value-1}</arg_value>...</tool_call>")


def glm_messages(messages, tools) -> list:
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
