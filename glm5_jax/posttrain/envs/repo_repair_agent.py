"""An agent program for repo repair (`posttrain.envs.repo_repair`): the `openai` client, three
function tools, the environment's own tools.

Like `calculator_agent`, it knows nothing of this repository's engine, tokens or chat format:
it sends chat completions with the repository tools as OpenAI function schemas (`TOOLS`:
`read_file(path)`, `write_file(path, content)`, `run_tests()`), reads `tool_calls` from each
reply and sends each result back as a `tool` message; every call carries the trajectory id
(`agent_chat.complete`), so the server's TITO gateway records the exact tokens and
`glm5_jax.rl.agent_rollout` trains on them.

The tools are the environment's, not a copy: a reply's calls (in the env's form, `env_call`)
are appended to the env-form conversation (`transcript`) and the env's `step` answers that
turn, the same function the engine path calls; it replays the earlier write_file calls on the
task's files and runs `run_tests` in the sandbox with the env's limits (`rl.sandbox`; the
rollout worker hides its run directory with `sandbox.hide_in_this_process` before any episode,
whichever path plays it). So an observation is the one the engine path would show for the
same calls, and one per turn: a reply with several calls gets the env's error for the turn as
the result of each.

One episode, at most `max_turns` calls (default the env's):
  - a reply with tool calls: the env answers the turn; the episode goes on, unless the env ends
    it (a call at its `max_turns`: reward 0);
  - a reply without one: the episode ends, and `agent_rollout.score` runs the env's step on the
    transcript: the hidden tests on the final repository, in the sandbox, give the reward;
  - a call the server refuses for want of room ends the episode (`context_full`; the env has
    not finished it: reward 0).
"""

import json

from glm5_jax.posttrain.envs.agent_chat import AgentResult, run_turns


def _tool(name: str, description: str, **params) -> dict:
  return {"type": "function", "function": {
      "name": name, "description": description,
      "parameters": {"type": "object",
                     "properties": {k: {"type": "string", "description": v}
                                    for k, v in params.items()},
                     "required": list(params)}}}


TOOLS = [
    _tool("read_file", "Read a file of the repository.", path="the file's path"),
    _tool("write_file", "Replace a file's content (test files are read-only).",
          path="the file's path", content="the file's new content"),
    _tool("run_tests", "Run the repository's tests and show their output."),
]


def env_call(name: str, arguments: str | None):
  """An OpenAI tool call -> the env's form, as the server renders it back
  (`serve.messages.glm_messages`): `{"name", "arguments": dict}`, or the bare name without
  arguments (GLM's `<tool_call>run_tests</tool_call>`). Arguments that are not a JSON object
  stay as they came: the env answers "error: malformed tool call"."""
  try:
    args = json.loads(arguments or "{}")
  except ValueError:
    return {"name": name, "arguments": arguments}
  return name if args == {} else {"name": name, "arguments": args}


def run_episode(client, env, task, *, model: str, trajectory_id: str,
                max_turns: int | None = None, max_tokens: int = 192, temperature: float = 1.0,
                top_p: float = 1.0, seed: int = 0, thinking: bool = True,
                tools: list | None = TOOLS) -> AgentResult:
  """Plays one episode of `task` (a `RepoRepair` task of `env`) against `client` (an
  `openai.OpenAI`); every call carries `trajectory_id`. `tools`: the function schemas sent
  (default `TOOLS`); None sends none, so the prompt is the env's own (it names the tools),
  as in the env's SFT data and the engine path's rollouts."""
  def answer(turn, m, messages, transcript):
    del turn
    calls = m.tool_calls or []
    if not calls:
      return False
    step = env.step(task, transcript)
    if step.done:
      return False
    transcript.append({"role": "observation", "content": step.observation})
    messages += [{"role": "tool", "tool_call_id": c.id, "content": step.observation}
                 for c in calls]
    return True

  return run_turns(client, task.messages, env_call, answer,
                   max_turns=max_turns or env.max_turns, model=model,
                   trajectory_id=trajectory_id, max_tokens=max_tokens, temperature=temperature,
                   top_p=top_p, seed=seed, thinking=thinking, tools=tools)


def play(client, env, task, **request) -> AgentResult:
  """`agent_rollout.AGENTS`' entry. Sends no `tools`: the policy's prompt is then the engine
  path's and its SFT data's (the env's prompt names the tools; GLM's `<tool_call>`s come back
  as `tool_calls` either way), and it fits the rows: with `TOOLS` task 0's prompt is 1273 byte
  tokens instead of 226, past configs/rl_agentic.py's 1024-token rows (episodes ~700)."""
  return run_episode(client, env, task, tools=None, **request)
