"""glm5_jax.serve.gateway, serve.versions and rl.agent_rollout: the TITO gateway on the real
server (tests/test_serve.py's loopback fixture), param versions switched under a running
request, and agent episodes through the `openai` client turned into training samples."""

import httpx
import jax
import numpy as np
import openai
import pytest

from glm5_jax.data import chat, make_tokenizer
from glm5_jax.data.tokenizers import BYTE_OFFSET
from glm5_jax.infer.engine import Engine
from glm5_jax.infer.requests import Request
from glm5_jax.posttrain import envs, rollout
from glm5_jax.rl import agent_rollout, staleness, trajectories
from glm5_jax.serve.app import create_app
from glm5_jax.serve.gateway import to_sample
from glm5_jax.serve.threaded_server import ThreadedServer
from glm5_jax.serve.versions import VersionedLoop
from tests.conftest import forward, random_params
from tests.test_serve import CFG

MAX_LEN = 256  # also the rows of the one full forward that checks log-probs


@pytest.fixture(scope="module")
def server():
  """test_serve's server with a contiguous cache (`page_size=None`): a few compiled programs
  instead of one per page bucket, whatever the lengths here."""
  params = random_params(CFG, seed=0, std=0.5)
  tok = make_tokenizer("byte")
  loop = VersionedLoop(Engine(CFG, params, slots=4, max_len=MAX_LEN, prefill_chunk=32,
                              page_size=None), max_queue=16)
  app = create_app(loop, tok, model_name="tiny")
  server = ThreadedServer(app)
  url = server.url
  yield dict(url=url, params=params, tok=tok, loop=loop, gateway=app.state.gateway,
             client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0))
  server.close()
  loop.close()


def _logprobs(params, sequences):
  """log p(token t | tokens < t) of each sequence under `params` (one [2, MAX_LEN] forward)."""
  tokens = np.zeros((2, MAX_LEN), np.int32)
  for i, seq in enumerate(sequences):
    tokens[i, :len(seq)] = seq
  logits = forward(CFG, params, tokens, mtp=False)["logits"]
  logp = np.asarray(jax.nn.log_softmax(logits.astype(np.float32), -1))
  return [np.take_along_axis(logp[i, :len(s) - 1], np.asarray(s)[1:, None], -1)[:, 0]
          for i, s in enumerate(sequences)]

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def _chat(server, messages, tid, max_tokens=12, **kw):
  return server["client"].chat.completions.create(
      model="tiny", messages=messages, max_tokens=max_tokens, seed=3, temperature=1.0,
      extra_body={**NO_THINK, "trajectory_id": tid}, **kw)


def test_a_text_round_trip_that_retokenizes_differently_keeps_the_sampled_tokens(server):
  tok, gateway = server["tok"], server["gateway"]
  first = [{"role": "user", "content": "hi"}]
  one = _chat(server, first, "rt", logprobs=True)
  sampled = one.choices[0].model_extra["token_ids"]
  # The real case: the sampled bytes are not valid UTF-8, so the reply's text, encoded again,
  # is other ids (U+FFFD is 3 bytes); the re-rendered conversation differs from the context.
  text_ids = [i for i in sampled if i >= BYTE_OFFSET]
  assert tok.encode(tok.decode(text_ids)) != text_ids
  echo = {"role": "assistant", "content": one.choices[0].message.content}
  second = first + [echo, {"role": "user", "content": "again"}]
  two = _chat(server, second, "rt")
  assert two.model_extra["trajectory"]["mismatch"] is True
  t = httpx.get(server["url"] + "/v1/trajectories/rt").json()
  r0, r1 = t["records"]
  assert r0["prompt_ids"] == chat.render_prompt(first, tok, thinking=False,
                                                thinking_mode="turn_level").tolist()
  assert r0["completion_ids"] == sampled
  np.testing.assert_allclose(r0["raw_logprobs"], [c.logprob for c in one.choices[0].logprobs.content],
                             rtol=1e-6)
  assert len(r0["logprobs"]) == len(sampled) and r0["versions"] == [0] * len(sampled)
  context = r0["prompt_ids"] + r0["completion_ids"]
  assert r1["prompt_ids"][:len(context)] == context  # extends the sampled tokens, not the text
  assert r1["mismatch"] and r1["mismatch_at"] < len(context) and t["mismatches"] == 1
  assert r1["completion_ids"] == two.choices[0].model_extra["token_ids"]
  # A streamed turn is recorded too (the header form of the id).
  third = second + [{"role": "assistant", "content": two.choices[0].message.content},
                    {"role": "user", "content": "more"}]
  chunks = list(server["client"].chat.completions.create(
      model="tiny", messages=third, max_tokens=5, seed=3, stream=True, extra_body=NO_THINK,
      extra_headers={"X-Trajectory-Id": "rt"}))
  assert chunks[-2].choices[0].finish_reason is not None
  assert chunks[-1].choices == [] and chunks[-1].model_extra["trajectory"]["turn"] == 2
  records = gateway.finish("rt").records
  assert len(records) == 3 and records[2].prompt_ids[:len(r1["prompt_ids"])] == r1["prompt_ids"]
  assert chunks[-1].model_extra["trajectory"]["mismatch"] == records[2].mismatch
  sample, versions = to_sample(records, task=None, group=0, reward=1.0, correct=True)
  assert sample.tokens[sample.loss_mask > 0].tolist() == (
      sampled + r1["completion_ids"] + records[2].completion_ids)
  assert (versions[sample.loss_mask > 0] == 0).all() and (versions[sample.loss_mask == 0] < 0).all()
  metrics = httpx.get(server["url"] + "/metrics").text
  assert f"glm5_gateway_mismatches_total {1 + records[2].mismatch}" in metrics
  # A finished trajectory takes no call; history may only grow; one path (n = 1).
  for messages, tid, extra, param in ((second, "rt", {}, "trajectory_id"),
                                      ([{"role": "user", "content": "bye"}] + second[1:], "rt2",
                                       {}, "n"),
                                      (first, "rt3", {"n": 2}, "n")):
    if tid == "rt2":
      _chat(server, first, "rt2")
    r = httpx.post(server["url"] + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 2, "trajectory_id": tid, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == ("messages" if tid == "rt2" else param)


def test_a_stop_string_ends_a_recorded_call_at_the_token_that_completed_it(server):
  first = [{"role": "user", "content": "stop"}]
  full = _chat(server, first, "stop-free", max_tokens=24)
  text, sampled = full.choices[0].message.content, full.choices[0].model_extra["token_ids"]
  at = next(i for i, ch in enumerate(text) if i > 0 and ch.isalnum() and text.index(ch) == i)
  for stream in (False, True):
    tid = f"stop-{stream}"
    reply = _chat(server, first, tid, max_tokens=24, stop=[text[at]], stream=stream,
                  logprobs=True)
    if stream:
      chunks = list(reply)
      content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
      assert chunks[-1].model_extra["trajectory"]["turn"] == 0
    else:
      content, tokens = reply.choices[0].message.content, reply.choices[0].model_extra["token_ids"]
      assert reply.choices[0].finish_reason == "stop" and reply.model_extra["trajectory"]
    assert content == text[:at]
    record, = server["gateway"].records(tid).records
    kept = record.completion_ids
    # The reply's tokens (through the one that completed the stop string), not what the engine
    # sampled after them before the cancel reached it.
    assert 0 < len(kept) < len(sampled) and kept == sampled[:len(kept)]
    assert record.finish_reason == "stop" and len(record.raw_logprobs) == len(kept) == len(
        record.logprobs) == len(record.versions)
    if not stream:
      assert kept == tokens
      np.testing.assert_allclose(record.raw_logprobs,
                                 [c.logprob for c in reply.choices[0].logprobs.content],
                                 rtol=1e-6)
  # The next turn extends exactly the kept tokens.
  second = first + [{"role": "assistant", "content": text[:at]},
                    {"role": "user", "content": "go on"}]
  _chat(server, second, "stop-False", max_tokens=2)
  r0, r1 = server["gateway"].finish("stop-False").records
  assert r1.prompt_ids[:len(r0.prompt_ids) + len(r0.completion_ids)] == (
      r0.prompt_ids + r0.completion_ids)


def test_params_switched_under_a_running_request_tag_each_token(server):
  loop, old = server["loop"], server["params"]
  new = random_params(CFG, seed=1, std=0.5)
  with pytest.raises(ValueError, match="leaf"):
    loop.set_params(jax.tree.map(lambda x: x[..., :1], old), 1)
  ended = []
  request = Request(0, (1, 72, 105), 40, 1.0, 1.0, 0, seed=5)
  loop.watch(request, lambda completion, versions, cancelled: ended.append(
      (completion, versions, cancelled)))
  stream = loop.submit(request)
  first = stream.get(timeout=120)  # running: it holds a slot
  loop.set_params(new, 1)
  tokens = first.tokens + [t for e in stream for t in e.tokens]
  (completion, versions, cancelled), = ended
  assert not cancelled
  assert len(tokens) == 40 and completion.tokens == tokens  # not dropped, not restarted
  assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
  # After the switch, replies are the new params' (their log-probs, by a full forward).
  prompt = [1, 72, 101, 108]
  reply = httpx.post(server["url"] + "/v1/completions", timeout=60, json={
      "prompt": prompt, "max_tokens": 5, "n": 2, "seed": 11, "logprobs": 0}).json()
  assert reply["system_fingerprint"] == "v1"
  sequences = [prompt + c["token_ids"] for c in reply["choices"]]
  for c, want in zip(reply["choices"], _logprobs(new, sequences)):
    np.testing.assert_allclose(c["logprobs"]["token_logprobs"], want[len(prompt) - 1:],
                               atol=2e-4)
  loop.set_params(old, 2)  # the fixture's params again, for the tests after this one


def test_agent_episodes_through_the_gateway_become_training_samples(server, tmp_path):
  env = envs.make("calculator", max_turns=2)
  tasks = [env.task(0, "train")]
  hits = server["loop"].engine.prefix_stats()["session_hits"]
  pairs = agent_rollout.agent_samples(server["url"], env, tasks, group_size=2, seed=0,
                                      model="tiny", max_tokens=16)
  assert len(pairs) == 2
  # Each second turn continued its trajectory's engine session (prefilled only the new tokens).
  assert server["loop"].engine.prefix_stats()["session_hits"] - hits == 2
  batch = rollout.to_batch([s for s, _ in pairs], MAX_LEN, advantages_N=[1.0, -1.0])
  # The raw log-probs are the served model's for exactly these tokens (one full forward).
  logps = _logprobs(server["params"], [s.tokens for s, _ in pairs])
  for i, (sample, versions) in enumerate(pairs):
    # The tiny random model answers garbage: the agent asks again, a second turn (whose
    # prompt extends the sampled tokens: the echoed garbage re-tokenizes differently).
    assert sample.turns == 2 and sample.info["mismatches"] == 1 and sample.reward == 0.0
    assert sample.messages[:2] == list(tasks[0].messages)
    generated = sample.loss_mask > 0
    assert (versions[generated] == server["loop"].version).all()
    assert (versions[~generated] == -1).all()
    np.testing.assert_allclose(sample.rollout_logp[1:][generated[1:]],
                               logps[i][generated[1:]], atol=2e-4)
  assert batch["loss_mask"].sum() == sum(s.response_length for s, _ in pairs)
  records = agent_rollout.to_trajectory_records(pairs, worker="w0", order=0)
  path = trajectories.write_batch(tmp_path, records, worker="w0", batch_index=0)
  back = trajectories.read_batch(path).records  # the async trainer's rollout file
  for r, (sample, versions) in zip(back, pairs):
    assert r.tokens.tolist() == sample.tokens.tolist() and r.versions.tolist() == versions.tolist()
    assert staleness.version_gap(r.versions, r.loss_mask, server["loop"].version) == 0


def test_a_server_follows_the_published_policy_versions(server, tmp_path):
  from glm5_jax.rl.param_sync import PolicyPublisher
  from glm5_jax.rl.serve_policy import PolicyFollower
  loop, new = server["loop"], random_params(CFG, seed=1, std=0.5)
  follower = PolicyFollower(loop, tmp_path)
  assert follower.poll() is None  # nothing published yet
  publisher = PolicyPublisher(tmp_path, keep=1, async_save=False)
  publisher.publish(7, new, block=True)
  assert follower.poll() == 7 and follower.poll() is None
  reply = httpx.post(server["url"] + "/v1/completions", timeout=60, json={
      "prompt": [1, 72], "max_tokens": 2, "seed": 1}).json()
  assert reply["system_fingerprint"] == "v7" and loop.version == 7
  publisher.close()
  loop.set_params(server["params"], 8)


def test_to_sample_merges_each_turns_routing_and_refuses_a_broken_chain():
  from glm5_jax.serve.gateway import TurnRecord

  def record(prompt, completion, routing):
    return TurnRecord(prompt, completion, [-1.0] * len(completion), [-0.5] * len(completion),
                      [3] * len(completion), "stop", False, None, len(prompt), 1,
                      None if routing is None else {"moe": np.asarray(routing, np.int32)})

  # Turn 0 fed 3 tokens (its last generated one unfed: -1); turn 1 re-fed nothing it had.
  first = record([5, 6], [7, 8], [[[0]], [[1]], [[2]], [[-1]]])
  second = record([5, 6, 7, 8, 9], [10], [[[9]], [[9]], [[9]], [[4]], [[5]], [[-1]]])
  sample, versions = to_sample([first, second], task=None, group=0, reward=0.0, correct=False)
  assert sample.tokens.tolist() == [5, 6, 7, 8, 9, 10]
  assert sample.loss_mask.tolist() == [0, 0, 1, 1, 0, 1]
  assert sample.rollout_logp.tolist() == [0, 0, -0.5, -0.5, 0, -0.5]
  assert versions.tolist() == [-1, -1, 3, 3, -1, 3]
  assert sample.routing["moe"][:, 0, 0].tolist() == [0, 1, 2, 4, 5, -1]
  with pytest.raises(ValueError, match="prefix"):
    to_sample([first, record([5, 6, 7, 0, 9], [10], None)], task=None, group=0, reward=0.0,
              correct=False)
