"""Serve a model over HTTP with the OpenAI API (`glm5_jax.serve`; docs/serving.md).

  python experiments/serve.py --random_init --config=configs/tiny.py --port=8000
  python experiments/serve.py --workdir=workdir/tiny --slots=16 --max_len=2048
  python experiments/serve.py --hf_path=/ckpt/GLM-5 --cache_dtype=float32
  python experiments/serve.py --workdir=workdir/tiny --quant=w4a8 --rotate
  python experiments/serve.py --workdir=/tmp/rl_run/trainer --policy_dir=/tmp/rl_run/policy

The model comes from `--workdir` (a training run's latest checkpoint), `--hf_path` or
`--random_init --config=...`, quantized with `--quant=w8a8|w4a8` (`--rotate`), through the
model-loading flags experiments/generate.py and eval.py share (experiments/model_flags.py,
`glm5_jax.infer.loading`); the engine's sizes and loop flags are experiments/serving_flags.py's
(tools/bench_serve.py runs its engine loop with the same flags).

Warm before serving: the server listens at once, but `/health` answers 503
`{"status": "warming"}` (and the API 503, code "warming") until the engine has compiled every
program a request can reach (`Engine.warmup`, in the engine's process; a "warming N programs
... (s)" line per part on stderr); then no request compiles anything (`/metrics`:
`glm5_engine_compiles_total`, counted in the engine's process). Each request is bounded
(`--max_n`, `--max_tokens_limit`, `--max_prompt_tokens`, `--max_body_bytes`, `--max_json_depth`,
`--max_top_logprobs`: a 400 naming the field; `glm5_jax.serve.limits`). One engine thread batches every request continuously over
`--slots` sequences of up to `--max_len` positions; by default the engine runs in a process of
its own (`glm5_jax.serve.engine_process`: the HTTP layer's Python never stalls a decode step),
which loads the model itself; `--noengine_process` keeps it on a thread of the server. Calls with a trajectory id are recorded by
the TITO gateway (`glm5_jax.serve.gateway`). With `--policy_dir` (an asynchronous RL run's
policy directory) the server starts from its newest published version and loads each newer one
between engine steps (`glm5_jax.rl.serve_policy`); responses and records carry the version.
"""

import os
import sys

# `experiments.model_flags` when run as `python experiments/X.py` (sys.path[0] is experiments/,
# and the package is not installed: setup.cfg installs glm5_jax, pallas_kernels and configs).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags
import jax
import uvicorn

from configs import overrides
from experiments import model_flags, serving_flags  # pylint: disable=wrong-import-position
from glm5_jax.infer.compile_count import process_compiles
from glm5_jax.infer.engine import Engine
from glm5_jax.infer.loading import load_model
from glm5_jax.serve.app import create_app
from glm5_jax.serve.engine_process import EngineProcess, EngineProcessError, served_engine
from glm5_jax.serve.limits import Limits
from glm5_jax.serve.readiness import Readiness, warm_in_background
from glm5_jax.rl.serve_policy import PolicyFollower
from glm5_jax.serve.versions import VersionedLoop
from glm5_jax.train import console

_CONFIG = model_flags.define_random_init_config()
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_SIZES = serving_flags.define_engine_sizes(
    slots=(8, "Sequences decoded at once."),
    max_len=(1024, "Cache positions per slot (prompt + max_tokens - 1 of one request)."))
_LOOP = serving_flags.define_loop_flags()
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 256, "Requests (choices) waiting for a slot "
                                  "before the server answers 503 (Retry-After).")
_MAX_N = flags.DEFINE_integer("max_n", 16, "Choices (`n`) one request may ask for; at most "
                              "half of --max_queue, so that one request never fills the queue.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens_limit", 0, "Tokens one choice may ask to "
                                   "generate (`max_tokens` / `max_completion_tokens`); 0: as "
                                   "many as --max_len leaves after the prompt.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_tokens", 0, "Prompt tokens a request may have "
                                   "(after the chat template); 0: --max_len - 1.")
_MAX_BODY = flags.DEFINE_integer("max_body_bytes", 1 << 20, "Request body bytes (413 past it).")
_MAX_DEPTH = flags.DEFINE_integer("max_json_depth", 32, "Nesting of a request body's arrays "
                                  "and objects (a tool's JSON schema nests a few levels).")
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile every program a request can reach before "
                            "taking requests (/health is 503 'warming' until then). Off: each "
                            "new shape compiles on the request that first needs it.")
_TOP_LOGPROBS = flags.DEFINE_integer("max_top_logprobs", 20, "Alternatives kept per generated "
                                     "token: the most a request's top_logprobs (chat) / "
                                     "logprobs (completions) may ask for; 0 keeps none.")
_NAME = flags.DEFINE_string("model_name", "glm5-jax", "The model id clients pass as `model`.")
_SEED = flags.DEFINE_integer("seed", 0, "Init seed of --random_init.")
_POLICY_DIR = flags.DEFINE_string(
    "policy_dir", None, "An async RL run's policy directory (<run>/policy): serve its newest "
    "published version and load newer ones while serving (the model source gives the "
    "architecture and the tokenizer).")
_RECORD_ROUTING = flags.DEFINE_bool(
    "record_routing", False, "Record each token's MoE experts and DSA keys in the TITO "
    "gateway's trajectory records (for RL routing replay; docs/serving.md).")
_POLICY_POLL_S = flags.DEFINE_float("policy_poll_s", 5.0, "Seconds between checks of "
                                    "--policy_dir for a newer version.")


def _log(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _exit_failed(e: BaseException) -> None:
  """A warm-up that failed (on its own thread): the server would never be ready."""
  sys.stderr.write("\n".join(console.failure_lines(e, "serving")) + "\n")
  os._exit(console.EXIT_FAILED)  # pylint: disable=protected-access


def _limits() -> Limits:
  limits = Limits(max_n=_MAX_N.value, max_tokens=_MAX_TOKENS.value or None,
                  max_prompt_tokens=_MAX_PROMPT.value or _SIZES.max_len.value - 1,
                  max_body_bytes=_MAX_BODY.value, max_json_depth=_MAX_DEPTH.value)
  limits.check_against_queue(_MAX_QUEUE.value)
  return limits


def _served_engine_with_notices(load: dict, sizes: dict):
  """The engine process's `build`: the engine compiles its programs there (at the first
  requests), so that process announces its slow compiles too, on stderr (absl's INFO lines are
  not set up there)."""
  console.announce_slow_compiles(
      log=lambda line: print(f"engine process: {line}", file=sys.stderr, flush=True))
  return served_engine(load, sizes)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  console.quiet_library_info()
  console.announce_slow_compiles()
  sys.setswitchinterval(_LOOP.switch_interval_s.value)
  try:
    limits = _limits()
    load = model_flags.load_kwargs(_CONFIG.value, _SEED.value)
    sizes = dict(_SIZES.kwargs(), top_logprobs=_TOP_LOGPROBS.value,
                 record_routing=_RECORD_ROUTING.value)
    if _LOOP.engine_process.value:
      # Before anything starts a backend here: the accelerator is the engine process's.
      jax.config.update("jax_platforms", "cpu")
      engine = EngineProcess(_served_engine_with_notices, load, sizes)
      tokenizer, compiles = engine.extra["tokenizer"], lambda: engine.compiles
    else:
      counter = process_compiles()  # this process runs the engine
      served = load_model(**load)
      engine, tokenizer = Engine(served.model, served.params, **sizes), served.tokenizer
      compiles = lambda: counter.count
    if tokenizer is None:
      raise ValueError("the model source has no tokenizer: pass --tokenizer")
    loop = VersionedLoop(engine, max_queue=_MAX_QUEUE.value, **_LOOP.loop_kwargs())
    follower = None
    if _POLICY_DIR.value:
      follower = PolicyFollower(loop, _POLICY_DIR.value, poll_s=_POLICY_POLL_S.value)
      if follower.poll() is None:
        raise ValueError(f"--policy_dir={_POLICY_DIR.value}: no published policy version yet "
                         "(start the server after the trainer's first publish)")
  except (ValueError, FileNotFoundError, EngineProcessError) as e:
    sys.stderr.write("\n".join(console.failure_lines(e, "serving")) + "\n")
    sys.exit(console.EXIT_FAILED)
  readiness = Readiness(ready=not _WARMUP.value, compiles=compiles)
  then = follower.start if follower is not None else None  # new params only once warm
  if _WARMUP.value:  # the server listens meanwhile; requests wait for `readiness`
    warm_in_background(engine, readiness, log=_log, then=then, on_error=_exit_failed)
  elif then is not None:
    then()
  uvicorn.run(create_app(loop, tokenizer, model_name=_NAME.value, limits=limits,
                         readiness=readiness), host=_HOST.value, port=_PORT.value,
              log_level="info")


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
