"""glm5_jax.posttrain.envs.repo_repair_agent: the repo-repair agent program through the
`openai` client.

Scripted replies (an `openai.OpenAI` over an httpx mock transport: the real client, requests
and replies as JSON) drive the real env, tools and sandbox: a correct fix earns 1, a wrong
one 0, each equal to the engine path's replay of the same actions. On a real loopback server
(`rl.agent_server.AgentServer`) with a tiny random model, the samples are the gateway's
records: every sampled token, the raw log-probs of a full forward, observations untrained."""

import json
import types

import httpx
import jax
import numpy as np
import openai
import pytest
from openai.types.chat import ChatCompletionMessageToolCall as ToolCall

from glm5_jax.config import ConfigError
from glm5_jax.posttrain import envs, sandbox, tasks
from glm5_jax.posttrain.config import rl_config, validate_rl_config
from glm5_jax.posttrain.envs import agent_chat, repo_repair, repo_repair_agent
from glm5_jax.rl import agent_rollout
from glm5_jax.serve import errors

ISO = sandbox.isolation()
pytestmark = pytest.mark.skipif(ISO.mode == "none",
                                reason=f"this OS cannot isolate a program: {ISO.reason}")


def make_env(**options):
  """The env as a rollout worker makes it: from `rl` (sandbox limits from `rl.sandbox`)."""
  rl = rl_config(env="repo_repair")
  rl.env_options.update(options)
  rl.sandbox.update(wall_seconds=1.0, cpu_seconds=1)
  return tasks.make_env(rl)


def reply(content="", calls=()):
  """An OpenAI chat completion whose message has `content` and `calls` [(name, args)]."""
  message = {"role": "assistant", "content": content}
  if calls:
    message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {
        "name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}
        for i, (name, args) in enumerate(calls)]
  return {"id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "message": message, "logprobs": None,
                       "finish_reason": "tool_calls" if calls else "stop"}]}


def scripted_client(replies):
  """(an `openai.OpenAI` answering with `replies` in turn, the request bodies it got)."""
  bodies, replies = [], list(replies)

  def handle(request):
    bodies.append(json.loads(request.content))
    r = replies.pop(0)
    return httpx.Response(r.pop("status", 200), json=r)

  client = openai.OpenAI(base_url="http://scripted/v1", api_key="none", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handle)))
  return client, bodies


def play(env, task, replies, **kw):
  client, bodies = scripted_client(replies)
  result = repo_repair_agent.run_episode(client, env, task, model="m", trajectory_id="t0", **kw)
  return result, bodies


def test_a_correct_fix_scores_1_and_its_observations_are_the_engine_paths():
  env = make_env()
  task = env.task(0, "train")
  worked = env.worked_solution(task)  # read, write the fix, run_tests, "done"
  actions = [m["tool_calls"][0] for m in worked if m["role"] == "assistant" and
             m.get("tool_calls")]
  replies = [reply(calls=[(c, {})] if isinstance(c, str) else [(c["name"], c["arguments"])])
             for c in actions] + [reply("done")]
  result, bodies = play(env, task, replies)
  assert result.turns == 4 and not result.context_full
  # The env answered each call as the engine path's rollout would: the same observations.
  said = [m["content"] for m in result.transcript if m["role"] == "observation"]
  assert said == [m["content"] for m in worked if m["role"] == "observation"]
  assert "3/3 passed" in said[-1]
  reward, correct, info = agent_rollout.score(env, task, result.transcript)
  assert (reward, correct) == (1.0, True) and info["passed"] == info["tests"] == 8
  assert envs.replay(env, task, result.transcript).reward == envs.replay(env, task,
                                                                         worked).reward == 1.0
  # Every call sent the three tools and the trajectory id; results went back as `tool`
  # messages answering the call's id.
  for k, body in enumerate(bodies):
    assert body["tools"] == repo_repair_agent.TOOLS and body["trajectory_id"] == "t0"
    if k:
      assert body["messages"][-1] == {"role": "tool", "tool_call_id": "call_0",
                                      "content": said[k - 1]}
  assert [t["function"]["name"] for t in bodies[0]["tools"]] == ["read_file", "write_file",
                                                                 "run_tests"]


def test_a_wrong_fix_and_bad_calls_score_0_as_the_engine_path_scores_them():
  env = make_env(max_turns=8)
  task = env.task(3, "train")
  module = f"{task.info['module']}.py"
  wrong = next(b for b in repo_repair.mutations(task.info["fixed"])
               if b != task.info["files"][module])
  replies = [
      reply(calls=[("read_file", "{not json")]),  # arguments that are not JSON: malformed
      reply(calls=[("read_file", {"path": module}), ("run_tests", {})]),  # two calls at once
      reply(calls=[("write_file", {"path": module, "content": "while True: pass\n"})]),
      reply(calls=[("run_tests", {})]),  # rl.sandbox.wall_seconds (1 s) stops it
      reply(calls=[("write_file", {"path": module, "content": wrong})]),
      reply(calls=[("run_tests", {})]),
      reply("done")]
  result, bodies = play(env, task, replies)
  said = [m["content"] for m in result.transcript if m["role"] == "observation"]
  assert said[0].startswith("error: malformed tool call")
  assert said[1] == "error: one tool call per turn, got 2"
  # Each call of a turn gets the turn's one observation.
  assert [m["tool_call_id"] for m in bodies[2]["messages"][-2:]] == ["call_0", "call_1"]
  assert "(timed out)" in said[3] and "FAILED" in said[5]
  assert agent_rollout.score(env, task, result.transcript)[:2] == (0.0, False)
  assert envs.replay(env, task, result.transcript).reward == 0.0
  # The same episode ending with the right fix instead: 1 (the last write counts).
  replies[4] = reply(calls=[("write_file", {"path": module, "content": task.info["fixed"]})])
  result, _ = play(env, task, replies)
  assert agent_rollout.score(env, task, result.transcript)[:2] == (1.0, True)


def test_the_turn_limit_and_a_full_context_end_the_episode_unscored():
  env = make_env(max_turns=2)
  task = env.task(1, "train")
  result, bodies = play(env, task, [reply(calls=[("run_tests", {})])] * 2)
  assert result.turns == len(bodies) == 2  # a call at the env's max_turns: no third call
  assert agent_rollout.score(env, task, result.transcript)[:2] == (0.0, False)
  # The agent reads OpenAI's code itself (posttrain is below serve): the one the server answers.
  assert agent_chat.CONTEXT_LENGTH_EXCEEDED == errors.CONTEXT_LENGTH_EXCEEDED
  full = {"status": 400, "error": {"message": "no room", "type": "invalid_request_error",
                                   "param": "max_tokens",
                                   "code": errors.CONTEXT_LENGTH_EXCEEDED}}
  result, _ = play(env, task, [reply(calls=[("run_tests", {})]), full])
  assert result.context_full and result.turns == 1
  assert agent_rollout.score(env, task, result.transcript)[0] == 0.0
  # `play` (the rollout's entry) sends no tools: the prompt is the engine path's.
  client, bodies = scripted_client([reply("done")])
  repo_repair_agent.play(client, env, task, model="m", trajectory_id="t1", max_turns=2)
  assert "tools" not in bodies[0]


def test_rollout_via_gateway_accepts_repo_repair_and_refuses_envs_without_an_agent():
  for env, ok in (("repo_repair", True), ("calculator", True), ("code", False)):
    rl = rl_config(env=env, rollout_via="gateway")
    if ok:
      validate_rl_config(rl)
    else:
      with pytest.raises(ConfigError, match="rl.rollout_via.*only the environments"):
        validate_rl_config(rl)
  assert set(agent_rollout.AGENTS) == {"calculator", "repo_repair"}


@pytest.mark.slow
def test_episodes_on_a_real_server_are_trained_from_the_gateways_records(helpers):
  """A tiny random model never calls a tool; a client that turns its first reply into a
  run_tests call (what the model sampled is kept: the gateway counts a mismatch) makes each
  episode two calls, the observation between them a real sandbox test run."""
  from glm5_jax.data import make_tokenizer  # pylint: disable=import-outside-toplevel
  from glm5_jax.rl.agent_server import AgentServer  # pylint: disable=import-outside-toplevel
  from tests.test_serve import CFG  # pylint: disable=import-outside-toplevel
  seq_len = 512
  params = helpers.random_params(CFG, seed=0, std=0.5)
  tok = make_tokenizer("byte")
  server = AgentServer(CFG, params, tok, slots=2, seq_len=seq_len, version=5)
  env = make_env(max_turns=2)
  task = env.task(1, "train")  # its run_tests output is short: both calls fit seq_len

  class ForcedClient:
    """`client` whose reply to a first call (the prompt alone) is a run_tests call."""
    def __init__(self, client):
      self.create_ = client.chat.completions.create
      self.chat = types.SimpleNamespace(completions=types.SimpleNamespace(create=self.create))

    def create(self, **kw):
      out = self.create_(**kw)
      if len(kw["messages"]) == 1:
        out.choices[0].message.tool_calls = [ToolCall.model_validate(
            {"id": "forced", "type": "function",
             "function": {"name": "run_tests", "arguments": "{}"}})]
      return out

  def forced(client, env, task, **request):
    return repo_repair_agent.play(ForcedClient(client), env, task, **request)

  try:
    pairs = agent_rollout.agent_samples(server.url, env, [task], group_size=2, seed=0,
                                        model=server.model_name, agent=forced, max_tokens=8)
    counters = server.counters()
  finally:
    server.close()
  tokens = np.zeros((2, seq_len), np.int32)
  for i, (sample, versions) in enumerate(pairs):
    assert sample.turns == 2 and sample.reward == 0.0 and sample.info["mismatches"] == 1
    assert "FAILED" in sample.messages[2]["content"]  # the sandbox's run_tests output
    generated = sample.loss_mask > 0
    assert (versions[generated] == 5).all() and (versions[~generated] == -1).all()
    # The observation's bytes are in the tokens, untrained, between the two completions.
    text = tok.decode([int(t) for t in sample.tokens[~generated]])
    assert sample.messages[2]["content"][:40] in text
    tokens[i, :len(sample.tokens)] = sample.tokens
  assert sum(int(s.loss_mask.sum()) for s, _ in pairs) == counters["tokens_generated"]
  assert counters["calls"] == 4 and counters["session_hits"] >= 2
  logits = helpers.forward(CFG, params, tokens, mtp=False)["logits"]
  logp = np.asarray(jax.nn.log_softmax(logits.astype(np.float32), -1))
  for i, (sample, _) in enumerate(pairs):
    n, generated = len(sample.tokens), sample.loss_mask[1:] > 0
    want = np.take_along_axis(logp[i, :n - 1], sample.tokens[1:, None], -1)[:, 0]
    np.testing.assert_allclose(sample.rollout_logp[1:][generated], want[generated], atol=2e-4)
