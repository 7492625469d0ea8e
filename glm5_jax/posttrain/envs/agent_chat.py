"""One call of a built-in agent program (`calculator_agent`, `repo_repair_agent`): a chat
completion through the `openai` client only, and its reply as the message sent back.

Every call carries the episode's trajectory id (`extra_body={"trajectory_id": ...}`), so the
server's TITO gateway records the exact tokens (`glm5_jax.serve.gateway`), and thinking per
request (`chat_template_kwargs`). A call the server refuses for want of room (400 naming
`max_tokens`: the conversation has outgrown the context) is not an error: it ends the
episode (`AgentResult.context_full`), as it ends an agent's session.
"""

import dataclasses

import openai

from glm5_jax.seeds import derive_seed

# OpenAI's error code for a call whose prompt and max_tokens do not fit the context. The agent
# speaks the OpenAI API, not this repository's server: it reads the public code (which
# `glm5_jax.serve.errors.CONTEXT_LENGTH_EXCEEDED` answers), and `posttrain` stays below `serve`.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


@dataclasses.dataclass
class AgentResult:
  messages: list  # the OpenAI conversation, as sent (and the last reply)
  transcript: list  # the same in the environment's message form, which the env scores
  turns: int  # calls answered
  context_full: bool = False  # the server refused a call: no room left for max_tokens


def complete(client, messages, *, model: str, trajectory_id: str, turn: int, max_tokens: int,
             temperature: float, top_p: float, seed: int, thinking: bool, tools: list | None):
  """The reply's message (`openai` ChatCompletionMessage) to `messages`, or None when the
  server refused the call for want of room. `turn` varies the seed per call; `tools`: the
  function schemas to send, None sends none (the prompt is then the env's own)."""
  try:
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=temperature,
        top_p=top_p, seed=derive_seed("agent", seed, turn),
        **({"tools": tools} if tools else {}), extra_body={
            "trajectory_id": trajectory_id,
            "chat_template_kwargs": {"enable_thinking": thinking}})
  except openai.BadRequestError as e:
    if e.code != CONTEXT_LENGTH_EXCEEDED:  # no room: the prompt alone, or with max_tokens
      raise
    return None
  return reply.choices[0].message


def run_turns(client, prompt, env_call, answer, *, max_turns: int, **request) -> AgentResult:
  """An episode's calls: from the `prompt` messages (role and content of each kept), up to
  `max_turns` calls (`take_turn`; `request`: `complete`'s keywords but `turn`). After each reply
  `answer(turn, reply, messages, transcript)` appends what the agent sends next (tool results, a
  nudge) to both and returns whether the episode goes on. A call refused for want of room ends
  it (`context_full`)."""
  messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
  transcript = [dict(m) for m in prompt]
  for turn in range(max_turns):
    m = take_turn(client, messages, transcript, env_call, turn=turn, **request)
    if m is None:
      return AgentResult(messages, transcript, turn, context_full=True)
    if not answer(turn, m, messages, transcript):
      return AgentResult(messages, transcript, turn + 1)
  return AgentResult(messages, transcript, max_turns)


def take_turn(client, messages: list, transcript: list, env_call, **request):
  """One call of an episode: `complete(client, messages, **request)`, then the reply appended to
  `messages` as it is sent back (`assistant_message`) and to `transcript` in the environment's
  form (each tool call as `env_call(name, arguments)`). Returns the reply (`openai`
  ChatCompletionMessage), or None when the server refused the call for want of room (nothing
  appended)."""
  m = complete(client, messages, **request)
  if m is None:
    return None
  said, reasoning = assistant_message(m)
  messages.append(said)
  transcript.append({"role": "assistant", "content": m.content or "", "thinking": reasoning,
                     "tool_calls": [env_call(c.function.name, c.function.arguments)
                                    for c in m.tool_calls or []]})
  return m


def assistant_message(m) -> tuple[dict, str | None]:
  """(the OpenAI assistant message that echoes the reply `m` in the next call, its reasoning
  text or None), with the reasoning and the tool calls as the server sent them (the gateway
  continues from the sampled tokens either way; a re-render of this echo that differs from
  them counts as a mismatch)."""
  reasoning = (m.model_extra or {}).get("reasoning_content")
  said = {"role": "assistant", "content": m.content or ""}
  if reasoning is not None:
    said["reasoning_content"] = reasoning
  if m.tool_calls:
    said["tool_calls"] = [{"id": c.id, "type": "function", "function": {
        "name": c.function.name, "arguments": c.function.arguments}} for c in m.tool_calls]
  return said, reasoning
