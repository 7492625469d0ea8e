"""glm5_jax.serve.engine_process: an engine in its own process serves exactly the tokens of the
same engine in process (through the server's loop, params switched between steps), refuses
what `Engine` refuses with the same ValueError, and a dead child fails requests with its exit
code instead of hanging them."""

import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import openai
import pytest

from glm5_jax.infer import engine as engine_lib
from glm5_jax.infer.requests import Request
from glm5_jax.serve.engine_loop import Refused, Stopped
from glm5_jax.serve.engine_process import EngineProcess, EngineProcessError
from glm5_jax.serve.versions import VersionedLoop
from tests.conftest import REPO_ROOT, forward, random_params, tiny_model_config

CFG = tiny_model_config(num_hidden_layers=2, attention_pattern="DD", first_k_dense_replace=2,
                        mtp_depths=0, num_nextn_predict_layers=0)
PROMPTS = [(5, 17, 3), (11,), (250, 3, 3, 9), (7, 7), (1, 2, 3, 4, 5)]
ENGINE = dict(slots=2, max_len=16, prefill_chunk=4, top_logprobs=2)


def _build(seed):
  """The child's engine (module-level: the spawned process imports it by name)."""
  return engine_lib.Engine(CFG, random_params(CFG, seed=seed, std=0.5), **ENGINE), {"seed": seed}


def _fail_to_build():
  raise ValueError("--workdir /nowhere has no checkpoint")


def _requests(seed):
  return [Request(i, p, 4, 1.0, 1.0, 0, engine_lib.request_seed(seed, i))
          for i, p in enumerate(PROMPTS)]


def _served(loop, requests, whole_every=2):
  """Every request from its own thread; per index (tokens, raw log-probs, top ids, events)."""
  got = {}

  def client(r):
    events = list(loop.submit(r, whole=r.index % whole_every == 0))
    got[r.index] = ([t for e in events for t in e.tokens],
                    [x for e in events for x in e.raw_logprobs],
                    [list(ids) for e in events for ids, _ in e.top_logprobs], len(events))

  threads = [threading.Thread(target=client, args=(r,)) for r in requests]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  return got


def _check(got, want):
  for i, w in enumerate(want):
    tokens, raws, tops, n_events = got[i]
    # Log-probs to float rounding: a request's admission batch (the program's row count)
    # depends on arrival order, and rows are reduced in another order (tokens are exact).
    assert tokens == w.tokens and raws == pytest.approx(w.raw_logprobs, abs=1e-5), i
    assert tops == [list(ids) for ids, _ in w.top_logprobs], i
    assert n_events == 1 if i % 2 == 0 else n_events == len(w.tokens) - 1, i  # whole: one


@pytest.fixture(scope="module")
def proc():
  """One engine process for the module's tests (each drives it with a loop of its own); the
  last test kills it."""
  engine = EngineProcess(_build, 1)
  yield engine
  engine.close()


def test_warmup_in_the_engine_process_leaves_nothing_to_compile(proc):
  """`EngineProcess.warmup` compiles in the child (its progress reported here), and requests
  afterwards add nothing to the compiles the child counts (`compiles`, from its own process:
  this process never compiles the engine's programs)."""
  seen = []
  proc.warmup(progress=lambda done, total: seen.append((done, total)))
  assert seen[-1][0] == seen[-1][1] == len(seen) and proc.compiles > 0, seen
  warm = proc.compiles
  assert [len(c.tokens) for c in proc.run(_requests(3))] == [4] * len(PROMPTS)
  assert proc.compiles == warm


def test_tokens_sampled_ahead_of_a_param_switch_keep_the_old_version(proc):
  """The child computes the next step while the server delivers the last (pipelined): the
  tokens it sampled before a switch must be tagged with the old version. Every old-version
  token's raw log-prob is the old params' full forward's; no new-version token's is."""
  assert proc.pipelined and proc.extra == {"seed": 1}

  class SwitchAfterTheFirstEvent(VersionedLoop):
    """Asks for the switch on the loop's thread: applied before its next step, for sure."""
    new = random_params(CFG, seed=2, std=0.5)

    def _deliver(self, event):
      super()._deliver(event)
      if self.new is not None:
        self.set_params(self.new, 1)
        self.new = None

  loop = SwitchAfterTheFirstEvent(proc)
  request = Request(0, (5, 17, 3), 12, 1.0, 1.0, 0, 7)
  ended = []
  loop.watch(request, lambda completion, versions, _: ended.append((completion, versions)))
  list(loop.submit(request))
  loop.close()
  (completion, versions), = ended
  assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
  old = random_params(CFG, seed=1, std=0.5)
  sequence = list(request.prompt) + completion.tokens
  logp = jax.nn.log_softmax(forward(CFG, old, [sequence], mtp=False)["logits"][0], -1)
  for n, (token, raw, version) in enumerate(zip(completion.tokens, completion.raw_logprobs,
                                                versions)):
    under_old = float(logp[len(request.prompt) + n - 1, token])
    assert (abs(raw - under_old) < 1e-4) == (version == 0), (n, version, raw, under_old)


def test_submits_travel_with_the_next_step(proc):
  """Pipelined, `submit` sends nothing (requests arriving one by one never stall the child): a
  request the engine refuses comes back from a step as `Refused`, the others run, and one
  cancelled before it was sent never reaches the child."""
  sent = []
  send = proc._send
  proc._send = lambda method, *args: (sent.append(method), send(method, *args))[1]
  try:
    ok = proc.submit(Request(0, (5, 17, 3), 3, 0.0, 1.0, 0, 0))
    bad = proc.submit(Request(1, (3,) * 10, 10, 0.0, 1.0, 0, 0))  # over max_len 16
    dropped = proc.submit(Request(2, (4,), 3, 0.0, 1.0, 0, 0))
    assert not sent and proc.busy and proc.waiting() == 3
    assert proc.cancel(dropped) and not sent
    items = []
    while proc.busy:
      items += proc.step()
  finally:
    del proc._send
  assert set(sent) == {"step"}
  refused = [i for i in items if isinstance(i, Refused)]
  assert [r.handle for r in refused] == [bad] and "max_len 16" in refused[0].message
  events = [i for i in items if not isinstance(i, Refused)]
  assert {e.handle for e in events} == {ok} and events[-1].completion.handle == ok
  assert sum(len(e.tokens) for e in events) == 3 and not proc.busy


# The loop's thread ends by raising what broke the engine (the server's console shows it).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_engine_process_serves_the_tokens_of_the_engine_in_process(proc):
  assert (proc.slots, proc.max_len, proc.top_n) == (2, 16, 2)
  before = proc.prefix_stats()["prompt_tokens"]  # the earlier tests' on this child
  loop = VersionedLoop(proc)
  loop.set_params(random_params(CFG, seed=1, std=0.5), 0)
  here = engine_lib.Engine(CFG, random_params(CFG, seed=1, std=0.5), **ENGINE)
  _check(_served(loop, _requests(3)), here.run(_requests(3)))
  with pytest.raises(ValueError, match="max_len 16"):  # Engine's own refusal, same type
    list(loop.submit(Request(9, (3,) * 10, 10, 0.0, 1.0, 0, 0)))
  # New params between steps, shipped to the child: the tokens of an engine built with them.
  new = random_params(CFG, seed=2, std=0.5)
  loop.set_params(new, 1)
  want = engine_lib.Engine(CFG, new, **ENGINE).run(_requests(4))
  _check(_served(loop, _requests(4)), want)
  assert loop.version == 1 and proc.pages.pool.used == 0 and not proc.busy
  assert proc.prefix_stats()["prompt_tokens"] == before + 2 * sum(map(len, PROMPTS))
  # `run`: the batch in the child, with no step round trips (tools/bench_serve.py's baseline).
  assert [c.tokens for c in proc.run(_requests(4))] == [c.tokens for c in want]
  # The child dies (OOM-killed, say): requests fail with its exit code instead of hanging.
  proc._process.kill()
  proc._process.join(30)
  with pytest.raises(EngineProcessError, match="exit code -9"):
    list(loop.submit(Request(10, (3,), 2, 0.0, 1.0, 0, 0)))
  with pytest.raises(Stopped, match="broken: EngineProcessError"):
    loop.submit(Request(11, (3,), 2, 0.0, 1.0, 0, 0))


def test_a_build_that_fails_raises_its_error_in_the_server():
  with pytest.raises(ValueError, match="/nowhere has no checkpoint"):
    EngineProcess(_fail_to_build)


def _metrics(url) -> dict:
  return {name: float(value) for name, value in (
      line.split() for line in httpx.get(url + "/metrics", timeout=30).text.splitlines())}


@pytest.mark.slow
def test_serve_cli_answers_chat_through_its_engine_process_and_names_a_bad_source():
  """experiments/serve.py as README's "Serve" starts it (engine process on, the default), with
a W4A8 model (the model-loading flags generate.py and eval.py share): listening at once,
503 "warming" until its engine process compiled every program, then a chat answered with no
compile in that process (`/metrics`)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, str(REPO_ROOT / "experiments" / "serve.py"), "--random_init",
         f"--config={REPO_ROOT / 'configs' / 'tiny.py'}", "--model.num_hidden_layers=2",
         "--model.attention_pattern=DD", "--model.first_k_dense_replace=1", "--quant=w4a8",
         "--quant_group_size=32", f"--port={port}", "--slots=1", "--max_len=64",
         "--prefill_chunk=32"]
  server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  url = f"http://127.0.0.1:{port}"
  try:
    deadline, statuses = time.time() + 600, set()
    while True:
      assert server.poll() is None, server.stderr.read()[-3000:]
      try:
        health = httpx.get(url + "/health", timeout=10)
        statuses.add(health.json()["status"])
        if health.status_code == 200:
          break
      except httpx.TransportError:
        pass
      assert time.time() < deadline, "the server was not ready within 600 s"
      time.sleep(0.5)
    assert statuses == {"warming", "ok"}, statuses
    compiles = _metrics(url)["glm5_engine_compiles_total"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model="glm5-jax", messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=0,
        temperature=0.0)
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason
    assert _metrics(url)["glm5_engine_compiles_total"] == compiles > 0
  finally:
    server.terminate()
    server.wait(30)
  bad = subprocess.run(cmd[:2] + ["--workdir=/nonexistent/run", f"--port={port}"],
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode != 0 and "/nonexistent/run" in bad.stderr.strip().splitlines()[-1]
