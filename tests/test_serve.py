"""glm5_jax.serve.app: the real server on a loopback port (uvicorn in a thread, a tiny random
model), called with the real `openai` client and raw HTTP."""

import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn

from glm5_jax import infer
from glm5_jax.data import make_tokenizer
from glm5_jax.infer.engine import Engine
from glm5_jax.serve.app import create_app
from glm5_jax.serve.engine_loop import EngineLoop
from tests.conftest import random_params, tiny_model_config

CFG = tiny_model_config(num_hidden_layers=2, attention_pattern="DD", first_k_dense_replace=2,
                        mtp_depths=0, num_nextn_predict_layers=0)
MAX_LEN = 512
TOP = 3  # the engine keeps each token's 3 most likely alternatives


@pytest.fixture(scope="module")
def server():
  params = random_params(CFG, seed=0, std=0.5)
  tok = make_tokenizer("byte")
  loop = EngineLoop(Engine(CFG, params, slots=4, max_len=MAX_LEN, prefill_chunk=32,
                           top_logprobs=TOP),
                    max_queue=64)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = uvicorn.Server(uvicorn.Config(create_app(loop, tok, model_name="tiny"),
                                         host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  while not server.started:
    time.sleep(0.05)
  url = f"http://127.0.0.1:{port}"
  yield dict(url=url, params=params, tok=tok, loop=loop,
             client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0))
  server.should_exit = True
  thread.join(timeout=30)
  loop.close()


def test_completions_logprobs_equal_generate_with_the_seed(server):
  prompt = [1, 72, 101, 108]
  out = server["client"].completions.create(model="tiny", prompt=prompt, max_tokens=5, n=2,
                                            seed=11, temperature=1.0, logprobs=0)
  want = infer.generate(CFG, server["params"], [prompt] * 2, max_new_tokens=5, temperature=1.0,
                        seed=11, max_len=MAX_LEN, prefill_chunk=32,
                        stop_tokens=[server["tok"].eos_id])
  for i, choice in enumerate(out.choices):
    assert choice.model_extra["token_ids"] == want.tokens[i]
    np.testing.assert_allclose(choice.logprobs.token_logprobs, want.raw_logprobs[i], rtol=1e-4,
                               atol=1e-5)
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
  metrics = httpx.get(server["url"] + "/metrics").text
  assert "glm5_queue_depth" in metrics and "glm5_tokens_generated_total" in metrics


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": [1, 2], "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": MAX_LEN + 5}, 400, "max_tokens"),
    ({"prompt": [1, 2], "model": "gpt-4"}, 400, "model"),
    ({"prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
    ({"prompt": "x" * (2 << 20)}, 413, None),
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


def test_generated_tool_calls_come_back_as_openai_tool_calls(server):
  """The parse path: GLM's `<tool_call>` ids -> the reply's OpenAI `tool_calls`."""
  from glm5_jax.data import chat
  from glm5_jax.serve.app import _tool_call
  tok = server["tok"]
  c = chat.special_ids(tok)
  ids = ([c.think_close, c.tool_call_open] + tok.encode("calc") + [c.arg_key_open]
         + tok.encode("expr") + [c.arg_key_close, c.arg_value_open] + tok.encode("2*3")
         + [c.arg_value_close, c.tool_call_close, c.observation])
  parsed = chat.parse_response(ids, tok)
  assert [_tool_call(call, 0)["function"] for call in parsed.tool_calls] == [
      {"name": "calc", "arguments": '{"expr": "2*3"}'}]
