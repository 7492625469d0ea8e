"""glm5_jax.serve.app: the real server on a loopback port (uvicorn in a thread, a tiny random
model), called with the real `openai` client and raw HTTP. The server is warmed as
experiments/serve.py warms it (listening, 503 "warming" until then), so no test's requests
compile anything in the engine's process (here: this one)."""

import concurrent.futures
import json
import random
import time

import httpx
import jax
import numpy as np
import openai
import pytest

from glm5_jax.data import make_tokenizer
from glm5_jax.infer import sampling
from glm5_jax.infer.compile_count import process_compiles
from glm5_jax.infer.engine import Engine, request_seed
from glm5_jax.infer.requests import Request
from glm5_jax.infer.sampling import SamplingParams
from glm5_jax.serve.app import create_app
from glm5_jax.serve.engine_loop import EngineLoop
from glm5_jax.serve.limits import Limits
from glm5_jax.serve.readiness import Readiness, warm
from glm5_jax.serve.threaded_server import ThreadedServer
from tests.conftest import forward, random_params, tiny_model_config
from glm5_jax.serve.random_requests import random_bodies

CFG = tiny_model_config(num_hidden_layers=2, attention_pattern="DD", first_k_dense_replace=2,
                        mtp_depths=0, num_nextn_predict_layers=0)
MAX_LEN = 512
TOP = 3  # the engine keeps each token's 3 most likely alternatives
# Pages of 64 rows: 4 page buckets up to MAX_LEN, so warm-up compiles 19 programs, not 30.
ENGINE = dict(slots=4, max_len=MAX_LEN, prefill_chunk=32, top_logprobs=TOP, page_size=64)
LIMITS = Limits(max_n=8, max_prompt_tokens=MAX_LEN - 1, max_json_depth=16)


@pytest.fixture(scope="module")
def server():
  params = random_params(CFG, seed=0, std=0.5)
  tok = make_tokenizer("byte")
  engine = Engine(CFG, params, **ENGINE)
  loop = EngineLoop(engine, max_queue=64)
  counter = process_compiles()  # the engine runs in this process
  readiness = Readiness(compiles=lambda: counter.count)
  server = ThreadedServer(create_app(loop, tok, model_name="tiny", limits=LIMITS,
                                     readiness=readiness))
  url = server.url
  # Listening, not ready: as experiments/serve.py while its engine warms.
  cold = (httpx.get(url + "/health"), httpx.post(url + "/v1/completions", json={"prompt": [1]}))
  warm(engine, readiness, log=lambda line: None)
  yield dict(url=url, params=params, tok=tok, loop=loop, cold=cold,
             client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0))
  server.close()
  loop.close()


def _model_logits(params, prompt, tokens):
  """fp32 logits `[len(tokens), Y]` that predict `tokens` after `prompt`: one teacher-forced
  forward of a fixed shape (`[1, 32]`, compiled once for the file)."""
  fed = np.zeros((1, 32), np.int32)
  fed[0, :len(prompt) + len(tokens) - 1] = (list(prompt) + list(tokens))[:-1]
  logits = np.asarray(forward(CFG, params, fed, mtp=False)["logits"], np.float32)[0]
  return logits[len(prompt) - 1:len(prompt) + len(tokens) - 1]


def test_completions_choice_i_draws_with_request_seed_as_generate_does(server):
  """Choice i of a request with seed s draws token n with `token_keys(request_seed(s, i), n)`
  (as prompt i of `infer.generate(..., seed=s)`: `engine.generate`) from the model's logits
  (one teacher-forced forward), and reports their raw log-probs."""
  prompt = [1, 72, 101, 108]
  out = server["client"].completions.create(model="tiny", prompt=prompt, max_tokens=5, n=2,
                                            seed=11, temperature=1.0, logprobs=0)
  for i, choice in enumerate(out.choices):
    tokens = choice.model_extra["token_ids"]
    logits = _model_logits(server["params"], prompt, tokens)
    want = jax.jit(sampling.sample)(logits, SamplingParams.create(5, temperature=1.0),
                                    np.full(5, request_seed(11, i), np.uint32), np.arange(5))
    assert tokens == want.tokens.tolist()
    np.testing.assert_allclose(choice.logprobs.token_logprobs, want.raw_logprobs, atol=2e-4)
  assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 10


def test_chat_streaming_models_health_metrics(server):
  client = server["client"]
  messages = [{"role": "user", "content": "hi"}]
  reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                         seed=1, extra_body={"chat_template_kwargs": {
                                             "enable_thinking": False}})
  assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
  chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                               seed=1, stream=True, extra_body={
                                                   "chat_template_kwargs": {
                                                       "enable_thinking": False}}))
  assert chunks[-1].choices[0].finish_reason is not None
  assert [m.id for m in client.models.list().data] == ["tiny"]
  assert httpx.get(server["url"] + "/health").json() == {"status": "ok"}
  health, api = server["cold"]  # before warm-up: listening, taking no request
  assert health.status_code == 503 and health.json()["status"] == "warming", health.text
  assert api.status_code == 503 and api.json()["error"]["code"] == "warming", api.text
  metrics = httpx.get(server["url"] + "/metrics").text
  assert "glm5_queue_depth" in metrics and "glm5_tokens_generated_total" in metrics


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": [1, 2], "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": MAX_LEN + 5}, 400, "max_tokens"),
    ({"prompt": [1, 2], "model": "gpt-4"}, 400, "model"),
    ({"prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
])
def test_errors_are_openai_bodies_naming_the_field(server, body, status, param):
  r = httpx.post(server["url"] + "/v1/completions", json=body, timeout=60)
  assert r.status_code == status, r.text
  assert r.json()["error"]["param"] == param


def test_a_disconnected_stream_frees_its_slot(server):
  before = server["loop"].tokens_generated
  with httpx.stream("POST", server["url"] + "/v1/completions", timeout=60, json={
      "prompt": [1, 2, 3], "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
    next(r.iter_lines())  # the first chunk arrived: the request holds a slot
  deadline = time.time() + 30
  while server["loop"].running() and time.time() < deadline:
    time.sleep(0.05)
  assert server["loop"].running() == 0
  assert server["loop"].tokens_generated - before < 400  # cut short, not run to max_tokens


TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate",
                                           "parameters": {"type": "object"}}}]


def test_tools_render_and_tool_turns_are_accepted_and_malformed_tools_refused(server):
  messages = [{"role": "user", "content": "2*3?"},
              {"role": "assistant", "content": "", "reasoning_content": "use calc",
               "tool_calls": [{"id": "c0", "type": "function", "function": {
                   "name": "calc", "arguments": '{"expr": "2*3"}'}}]},
              {"role": "tool", "tool_call_id": "c0", "content": "6"}]
  reply = server["client"].chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                                   max_tokens=3, seed=0)
  assert reply.usage.prompt_tokens > 200  # the tools block is in the prompt
  for tools in ([{"type": "function", "function": {}}], "calc"):
    r = httpx.post(server["url"] + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "tools": tools, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def _sse_texts(url, body, field):
  """The concatenated `field` of every streamed chunk (choice 0), and the last finish reason."""
  text, reason = "", None
  with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
    for line in r.iter_lines():
      if line.startswith("data: {"):
        choice = json.loads(line[6:])["choices"][0]
        text += (choice.get("delta") or choice).get(field) or ""
        reason = choice["finish_reason"] or reason
  return text, reason


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stop_strings_cut_the_text_streamed_or_not(server, endpoint):
  if endpoint == "completions":
    url, field = server["url"] + "/v1/completions", "text"
    body = {"prompt": [1, 72, 101], "max_tokens": 24, "seed": 5, "ignore_eos": True}
  else:
    url, field = server["url"] + "/v1/chat/completions", "content"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "seed": 5,
            "chat_template_kwargs": {"enable_thinking": False}}
  full = httpx.post(url, json=body, timeout=60).json()["choices"][0]
  text = full.get("text", (full.get("message") or {}).get("content"))
  assert len(text) >= 4, text  # the seed's output is long enough to cut inside
  stop = text[1:3]  # spans tokens (one byte each)
  want = text[:text.find(stop)]
  cut = httpx.post(url, json={**body, "stop": [stop, "never"]}, timeout=60).json()["choices"][0]
  assert cut.get("text", (cut.get("message") or {}).get("content")) == want
  assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
  assert cut["token_ids"] == full["token_ids"][:len(cut["token_ids"])]
  assert _sse_texts(url, {**body, "stop": stop}, field) == (want, "stop")


def test_stop_token_ids_end_a_choice_without_their_text(server):
  tok = server["tok"]
  body = {"prompt": [1, 72, 101], "max_tokens": 24, "seed": 5, "ignore_eos": True}
  url = server["url"] + "/v1/completions"
  full = httpx.post(url, json=body, timeout=60).json()["choices"][0]
  stop_id = full["token_ids"][4]
  cut = httpx.post(url, json={**body, "stop_token_ids": [stop_id]}, timeout=60).json()
  ids = cut["choices"][0]["token_ids"]
  assert ids == full["token_ids"][:full["token_ids"].index(stop_id) + 1]
  assert cut["choices"][0]["text"] == tok.decode(ids[:-1])
  assert cut["choices"][0]["finish_reason"] == "stop"


def test_top_logprobs_equal_the_engines_in_openai_shapes(server):
  """Both endpoints' log-probs and top alternatives against an engine like the server's (the
  same compiled programs) run directly with the same seed."""
  client, tok = server["client"], server["tok"]
  from glm5_jax.data import chat
  messages = [{"role": "user", "content": "yo"}]
  prompt = [1, 72, 101, 108]
  out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, seed=7,
                                  logprobs=TOP, extra_body={"ignore_eos": True})
  reply = client.chat.completions.create(
      model="tiny", messages=messages, max_tokens=4, seed=7, logprobs=True, top_logprobs=2,
      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
  chat_prompt = tuple(int(i) for i in chat.render_prompt(messages, tok, thinking=False,
                                                         thinking_mode="turn_level"))
  direct = Engine(CFG, server["params"], **ENGINE).run([
                      Request(0, tuple(prompt), 4, 1.0, 1.0, 0, request_seed(7, 0)),
                      Request(1, chat_prompt, 4, 1.0, 1.0, 0, request_seed(7, 0),
                              tuple(chat.stop_ids(tok)))])
  lp = out.choices[0].logprobs
  assert out.choices[0].model_extra["token_ids"] == direct[0].tokens
  np.testing.assert_allclose(lp.token_logprobs, direct[0].raw_logprobs, rtol=1e-4, atol=1e-5)
  for got, (ids, values) in zip(lp.top_logprobs, direct[0].top_logprobs):
    want = {tok.decode([int(i)], skip_special=False): float(v) for i, v in zip(ids, values)}
    assert got.keys() == want.keys()
    np.testing.assert_allclose(list(got.values()), [want[k] for k in got], rtol=1e-4, atol=1e-5)
  content = reply.choices[0].logprobs.content
  assert reply.choices[0].model_extra["token_ids"] == direct[1].tokens
  np.testing.assert_allclose([e.logprob for e in content], direct[1].raw_logprobs, rtol=1e-4,
                             atol=1e-5)
  for entry, (ids, values) in zip(content, direct[1].top_logprobs):
    assert [t.token for t in entry.top_logprobs] == [
        tok.decode([int(i)], skip_special=False) for i in ids[:2]]
    np.testing.assert_allclose([t.logprob for t in entry.top_logprobs], values[:2], rtol=1e-4,
                               atol=1e-5)
  r = httpx.post(server["url"] + "/v1/completions", timeout=60,
                 json={"prompt": prompt, "logprobs": TOP + 1})
  assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_streamed_reasoning_equals_the_reply_and_a_full_queue_is_a_503(server):
  body = {"messages": [{"role": "user", "content": "think"}], "max_tokens": 8, "seed": 3}
  url = server["url"] + "/v1/chat/completions"
  message = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]
  assert message["reasoning_content"]  # thinking on: the turn starts inside <think>
  assert _sse_texts(url, body, "reasoning_content")[0] == message["reasoning_content"]
  assert _sse_texts(url, body, "content")[0] == message["content"]
  loop, bound = server["loop"], server["loop"].max_queue
  loop.max_queue = 0  # every submission finds the queue full
  try:
    r = httpx.post(url, json=body, timeout=60)
  finally:
    loop.max_queue = bound
  assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
  assert r.json()["error"]["code"] == "server_overloaded"
  metrics = dict(line.split() for line in httpx.get(server["url"] + "/metrics").text.splitlines())
  assert int(metrics["glm5_cache_pages_used"]) + int(metrics["glm5_cache_pages_free"]) == int(
      metrics["glm5_cache_pages_total"])
  assert int(metrics["glm5_engine_slot_steps_total"]) >= int(metrics["glm5_engine_steps_total"])


def _metric(url, name) -> int:
  lines = httpx.get(url + "/metrics", timeout=60).text.splitlines()
  return int(next(line.split()[1] for line in lines if line.startswith(name + " ")))


def test_random_requests_after_warm_up_compile_nothing_in_the_engines_process(server):
  """25 random requests (tools/check_serve_warm.py's: lengths, n, sampling, stop strings,
  log-probs, streaming, tools), 4 clients at a time, all answered; the compiles the engine's
  process counts (`/metrics`) do not move."""
  url = server["url"]
  before = _metric(url, "glm5_engine_compiles_total")
  bodies = random_bodies(random.Random(1), 25, max_len=MAX_LEN, max_top=TOP)
  assert {"tools" in b for _, b in bodies} == {True, False}

  def send(path_body):
    path, body = path_body
    if body.get("stream"):
      return _sse_texts(url + path, body, "text")[1] is not None and 200
    return httpx.post(url + path, json=body, timeout=120).status_code

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    assert list(pool.map(send, bodies)) == [200] * len(bodies)
  assert _metric(url, "glm5_engine_compiles_total") == before


HOSTILE = [  # (endpoint, body or raw bytes, status, the field named)
    ("completions", {"prompt": [1], "n": 1000}, 400, "n"),
    ("completions", {"prompt": [1], "n": "2"}, 400, "n"),
    ("completions", {"prompt": [1], "max_tokens": 10 ** 12}, 400, "max_tokens"),
    ("chat", {"max_completion_tokens": 10 ** 9}, 400, "max_completion_tokens"),
    ("completions", {"prompt": [1] * (MAX_LEN + 10)}, 400, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "x" * (2 * MAX_LEN)}]}, 400, "messages"),
    ("completions", {"prompt": "x" * (2 << 20)}, 413, None),
    ("completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("completions", {"prompt": [1], "logprobs": -1}, 400, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": TOP + 1}, 400, "top_logprobs"),
    ("chat", {"logprobs": "yes"}, 400, "logprobs"),
    ("completions", {"prompt": [1], "temperature": "hot"}, 400, "temperature"),
    ("chat", {"stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": [1], "seed": 1 << 40}, 400, "seed"),
]


def test_hostile_requests_get_4xx_json_naming_the_field_while_others_are_served(server):
  """The 14 cases of issue 44's check, each a 4xx OpenAI-shaped JSON error (never a 500 or a
  503), sent while normal requests run: those all succeed. And max_completion_tokens bounds a
  chat turn as max_tokens does."""
  url, chat_body = server["url"], {"messages": [{"role": "user", "content": "hi"}]}
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    normal = [pool.submit(httpx.post, url + "/v1/completions", timeout=120, json={
        "prompt": [1, 2, 3], "max_tokens": 8, "n": 2, "seed": i}) for i in range(3)]
    for endpoint, body, status, param in HOSTILE:
      path = url + ("/v1/completions" if endpoint == "completions" else "/v1/chat/completions")
      if isinstance(body, bytes):
        r = httpx.post(path, content=body, headers={"content-type": "application/json"},
                       timeout=120)
      else:
        r = httpx.post(path, json={**(chat_body if endpoint == "chat" else {}), **body},
                       timeout=120)
      assert r.status_code == status, (body if isinstance(body, dict) else "deep", r.text)
      assert r.json()["error"]["param"] == param, r.text
    assert [f.result().status_code for f in normal] == [200] * 3
  assert server["loop"].waiting() == 0
  # max_completion_tokens (OpenAI's current name) is honoured as max_tokens is.
  turn = {**chat_body, "seed": 4, "temperature": 1.0, "chat_template_kwargs": {
      "enable_thinking": False}}
  got, want = (httpx.post(url + "/v1/chat/completions", json={**turn, name: 3}, timeout=120)
               .json()["choices"][0]["token_ids"]
               for name in ("max_completion_tokens", "max_tokens"))
  assert got == want and len(got) <= 3, (got, want)


def _adjusted_logp(logits_LY, tokens, frequency, presence, bias):
  """log_softmax of OpenAI's adjusted logits in float64 at each generated position: row i
  (the logits that chose tokens[i]) with the counts of tokens[:i]."""
  z = np.asarray(logits_LY, np.float64).copy()
  for token, value in bias.items():
    z[:, int(token)] += value
  for i in range(len(tokens)):
    counts = np.bincount(tokens[:i], minlength=z.shape[1])
    z[i] -= frequency * counts + presence * (counts > 0)
  z -= z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_penalties_and_logit_bias_equal_a_float64_reference_of_the_models_logits(server):
  """Greedy completions and chat turns with frequency / presence penalties and logit_bias: each
  token is the argmax of OpenAI's adjusted logits (float64, from one teacher-forced forward of
  the model) and its log-prob the adjusted log_softmax; the adjustments changed the output."""
  prompt, new = [1, 72, 101, 108], 16
  base = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
          "logprobs": 0}
  url = server["url"] + "/v1/completions"
  plain = httpx.post(url, json=base, timeout=60).json()["choices"][0]["token_ids"]
  # Negative penalties reward repeats (so counts reach past 1); the bias bans a token the
  # plain run chose and favours another.
  adjust = {"frequency_penalty": -0.6, "presence_penalty": -1.2,
            "logit_bias": {str(plain[3]): -100, "101": 2.5, "32": 0.75}}
  got = httpx.post(url, json={**base, **adjust}, timeout=60).json()["choices"][0]
  tokens = got["token_ids"]
  assert len(tokens) == new and tokens != plain and plain[3] not in tokens
  assert max(np.bincount(tokens)) > 1  # a repeat: the penalties acted on a counted token
  want = _adjusted_logp(_model_logits(server["params"], prompt, tokens), tokens,
                        adjust["frequency_penalty"], adjust["presence_penalty"],
                        adjust["logit_bias"])
  assert tokens == want.argmax(-1).tolist()
  np.testing.assert_allclose(got["logprobs"]["token_logprobs"],
                             want[np.arange(new), tokens], atol=2e-4)
  # The chat endpoint takes the same fields (logprobs there: the chosen tokens').
  messages = [{"role": "user", "content": "hi"}]
  chat_body = {"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True,
               "chat_template_kwargs": {"enable_thinking": False}}
  chat_url = server["url"] + "/v1/chat/completions"
  chat_plain = httpx.post(chat_url, json=chat_body, timeout=60).json()["choices"][0]["token_ids"]
  banned = {str(chat_plain[1]): -100, str(chat_plain[2]): -100}
  chat_got = httpx.post(chat_url, json={**chat_body, "logit_bias": banned},
                        timeout=60).json()["choices"][0]["token_ids"]
  assert chat_got[0] == chat_plain[0] and not set(chat_got) & {chat_plain[1], chat_plain[2]}


REFUSED = [  # (endpoint, body fields, the field named by the 400)
    ("completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("chat", {"presence_penalty": "high"}, "presence_penalty"),
    ("completions", {"logit_bias": {str(CFG.vocab_size): 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"05": 1}}, "logit_bias"),
    ("chat", {"logit_bias": [5, 1]}, "logit_bias"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"audio": {"voice": "alloy"}}, "audio"),
    ("chat", {"frobnicate": 1}, "frobnicate"),
    ("chat", {"chat_template_kwargs": {"tools_first": True}}, "chat_template_kwargs"),
    ("chat", {"stream_options": {"include_obfuscation": True}}, "stream_options"),
    ("chat", {"echo": True}, "echo"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "tail"}, "suffix"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"presence_penalty": 0.5, "trajectory_id": "t-penalized"}, "presence_penalty"),
]


def test_every_request_field_is_honoured_or_refused_naming_it(server):
  """Unknown fields, refused values and bad adjustments are 400s naming the field; refused
  fields at their defaults are accepted; a speculating engine refuses the adjustments."""
  url, chat_body = server["url"], {"messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 2}
  for endpoint, extra, param in REFUSED:
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    body = {**({"prompt": [1, 2]} if endpoint == "completions" else chat_body), **extra}
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
  assert server["loop"].engine.prefix_stats()  # nothing above reached the engine's queue
  defaults = {"response_format": {"type": "text"}, "tool_choice": "auto", "store": False,
              "parallel_tool_calls": True, "user": "u-1", "metadata": None,
              "service_tier": "auto", "modalities": ["text"], "stream_options": None}
  r = httpx.post(url + "/v1/chat/completions", json={**chat_body, **defaults}, timeout=60)
  assert r.status_code == 200, r.text
  r = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1, "best_of": 1,
                                                "suffix": None, "echo": False}, timeout=60)
  assert r.status_code == 200, r.text
  engine = server["loop"].engine
  engine.k = 2  # as a speculating server: refused before anything is submitted
  try:
    r = httpx.post(url + "/v1/completions", json={"prompt": [1], "frequency_penalty": 1},
                   timeout=60)
  finally:
    engine.k = 0
  assert r.status_code == 400 and r.json()["error"]["param"] == "frequency_penalty", r.text


def test_echo_returns_the_prompt_first_and_is_refused_with_logprobs(server):
  """With echo the text starts with the prompt's, streamed or not; echo with logprobs is a 400
  naming echo (OpenAI returns prompt log-probs there, which the engine does not compute).
  text_offset with logprobs: tests/test_serve_text.py."""
  url = server["url"] + "/v1/completions"
  body = {"prompt": "héllo wörld", "max_tokens": 6, "seed": 2, "ignore_eos": True, "echo": True}
  whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
  text = ""
  with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
    for line in r.iter_lines():
      if line.startswith("data: {"):
        text += json.loads(line[6:])["choices"][0]["text"]
  assert whole.startswith("héllo wörld") and text == whole
  r = httpx.post(url, json={**body, "logprobs": 0}, timeout=60)
  assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
