"""A built-in example agent: an OpenAI-API program that uses a calculator tool, multi-turn.

It knows nothing of this repository's engine, tokens or chat format: it talks to a server
only through the `openai` Python client (chat completions with a `calc` function tool), runs
the tool itself (`posttrain.envs.calculator.run_tool`, the calculator env's tool) and keeps
the conversation as OpenAI messages. The one thing it adds for RL is the trajectory id of
every call (`extra_body={"trajectory_id": ...}`), so the server's TITO gateway records the
exact tokens (`glm5_jax.serve.gateway`); `glm5_jax.rl.agent_rollout` runs it as an RL episode.

One episode, at most `max_turns` calls:
  - a reply with tool calls: each is run and its result sent back as a `tool` message;
  - a reply whose content is an integer: the final answer, the episode ends;
  - any other reply: the agent asks again with a user message (`NUDGE`), a format retry;
  - a call the server refuses for want of room (400 naming `max_tokens`: the conversation has
    outgrown the context) ends the episode (`context_full`), as it ends an agent's session.
It also keeps the conversation in the calculator env's own form (`transcript`: tool calls as
`calc(EXPR)` text, results as observations), which the env scores.
"""

import json

from glm5_jax.posttrain.envs import base
from glm5_jax.posttrain.envs.calculator import run_tool
from glm5_jax.posttrain.envs.agent_chat import AgentResult, run_turns

CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an integer expression with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
NUDGE = "Call calc(expression), or answer with an integer only."


def call_text(name: str, arguments: str | None) -> str:
  """An OpenAI tool call -> the env's `calc(EXPR)` text. GLM's free-text call
  `<tool_call>calc(2*3)</tool_call>` comes back as the name `calc(2*3)` with no arguments."""
  try:
    args = json.loads(arguments or "{}")
  except ValueError:
    args = {"arguments": arguments}
  if name == "calc" and isinstance(args, dict) and set(args) == {"expression"}:
    return f"calc({args['expression']})"
  return name if not args else f"{name}({json.dumps(args)})"


def run_episode(client, *, model: str, messages, trajectory_id: str, max_turns: int = 3,
                max_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
                seed: int = 0, thinking: bool = True,
                tools: list | None = None) -> AgentResult:
  """Plays one episode against `client` (an `openai.OpenAI`) from the prompt `messages`
  (system / user dicts); every call carries `trajectory_id`. `tools`: the function schemas
  to send (e.g. `[CALC_TOOL]`); None sends none, so the prompt is the env's own (its system
  message names the tool, as in the env's SFT data and the engine rollouts), and GLM's
  free-text calls `calc(EXPR)` still come back as `tool_calls`."""
  def answer(turn, m, messages, transcript):
    calls = m.tool_calls or []
    if calls:
      for c, text in zip(calls, transcript[-1]["tool_calls"]):
        result, _ = run_tool(text)
        messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
        transcript.append({"role": "observation", "content": result})
      return True
    if base.INTEGER.fullmatch((m.content or "").strip()) or turn + 1 == max_turns:
      return False
    messages.append({"role": "user", "content": NUDGE})
    transcript.append({"role": "user", "content": NUDGE})
    return True

  return run_turns(client, messages, call_text, answer, max_turns=max_turns, model=model,
                   trajectory_id=trajectory_id, max_tokens=max_tokens, temperature=temperature,
                   top_p=top_p, seed=seed, thinking=thinking, tools=tools)


def play(client, env, task, **request) -> AgentResult:
  """`agent_rollout.AGENTS`' entry: an episode of `task` from its prompt (`request`: the keyword
  arguments of `run_episode` but `messages`). The calculator's tool needs nothing of `env`."""
  del env
  return run_episode(client, messages=task.messages, **request)
