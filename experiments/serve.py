"""Serve a model over HTTP with the OpenAI API (`glm5_jax.serve`; docs/serving.md).

  python experiments/serve.py --random_init --config=configs/tiny.py --port=8000
  python experiments/serve.py --workdir=workdir/tiny --slots=16 --max_len=2048
  python experiments/serve.py --hf_path=/ckpt/GLM-5 --cache_dtype=float32
  python experiments/serve.py --workdir=/tmp/rl_run/trainer --policy_dir=/tmp/rl_run/policy

The model comes from `--workdir` (a training run's latest checkpoint), `--hf_path` or
`--random_init --config=...`, loaded as experiments/generate.py loads it
(`glm5_jax.infer.loading`). One engine thread batches every request continuously over
`--slots` sequences of up to `--max_len` positions; by default the engine runs in a process of
its own (`glm5_jax.serve.engine_process`: the HTTP layer's Python never stalls a decode step),
which loads the model itself; `--noengine_process` keeps it on a thread of the server. Calls with a trajectory id are recorded by
the TITO gateway (`glm5_jax.serve.gateway`). With `--policy_dir` (an asynchronous RL run's
policy directory) the server starts from its newest published version and loads each newer one
between engine steps (`glm5_jax.rl.serve_policy`); responses and records carry the version.
"""

import sys

from absl import app, flags
import jax
from ml_collections import config_flags
import uvicorn

from configs import overrides
from glm5_jax.config import model_config
from glm5_jax.infer.engine import Engine
from glm5_jax.infer.loading import load_model
from glm5_jax.serve.app import create_app
from glm5_jax.serve.engine_process import EngineProcess, EngineProcessError, served_engine
from glm5_jax.rl.serve_policy import PolicyFollower
from glm5_jax.serve.versions import VersionedLoop
from glm5_jax.train import console

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run workdir: serve its latest "
                               "checkpoint.")
_HF_PATH = flags.DEFINE_string("hf_path", None, "HF GLM-5 checkpoint directory to serve.")
_RANDOM_INIT = flags.DEFINE_bool("random_init", False, "Serve --config's model with random "
                                 "params (smoke tests of the serving path only).")
_CONFIG = overrides.define_config_file(
    "config", None, "Run config for --random_init (its model and data.tokenizer), e.g. "
    "configs/tiny.py.", lock_config=False)
_MODEL = overrides.define_config_dict(
    "model", model_config(), "Served-model fields to change; only fields given here apply.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "'byte' or a tokenizer.json path instead of "
                                 "the model source's own.")
_CACHE_DTYPE = flags.DEFINE_enum(
    "cache_dtype", None, ["float32", "bfloat16", "float16"], "The decode cache's dtype "
    "(default: the model's compute dtype, so cached decode equals the full forward; bfloat16 "
    "under an fp32 model halves the cache and rounds it: docs/inference.md).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_SLOTS = flags.DEFINE_integer("slots", 8, "Sequences decoded at once.")
_MAX_LEN = flags.DEFINE_integer("max_len", 1024, "Cache positions per slot (prompt + "
                                "max_tokens - 1 of one request).")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 256, "Prompt tokens per slot per "
                                      "prefill call.")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 256, "Requests waiting for a slot before the "
                                  "server answers 503 (Retry-After).")
_TOP_LOGPROBS = flags.DEFINE_integer("max_top_logprobs", 20, "Alternatives kept per generated "
                                     "token: the most a request's top_logprobs (chat) / "
                                     "logprobs (completions) may ask for; 0 keeps none.")
_ADMIT_AFTER = flags.DEFINE_integer("admit_after_steps", 0, "While requests decode, hold new "
                                    "ones and admit them together after at most this many "
                                    "steps (glm5_jax.serve.engine_loop); 0: at the next step.")
_ADMIT_WINDOW = flags.DEFINE_float("admit_window_s", 0.02, "An idle engine admits arrivals "
                                    "once none has come for this long (at most 4 windows after "
                                    "the first; glm5_jax.serve.engine_loop): clients answered "
                                    "together send their next requests together; 0: at once.")
_SWITCH = flags.DEFINE_float(
    "switch_interval_s", 0.0002, "sys.setswitchinterval of the server process. The engine "
    "thread gives up the GIL at every device call and transfer; at Python's default 0.005 s "
    "each time the event loop holds it costs the engine up to 5 ms (a busy Python thread "
    "slowed Engine.run 2-5.7x at 0.005 s, 1.5x at 0.0002 s: docs/serving.md).")
_NAME = flags.DEFINE_string("model_name", "glm5-jax", "The model id clients pass as `model`.")
_SEED = flags.DEFINE_integer("seed", 0, "Init seed of --random_init.")
_POLICY_DIR = flags.DEFINE_string(
    "policy_dir", None, "An async RL run's policy directory (<run>/policy): serve its newest "
    "published version and load newer ones while serving (the model source gives the "
    "architecture and the tokenizer).")
_RECORD_ROUTING = flags.DEFINE_bool(
    "record_routing", False, "Record each token's MoE experts and DSA keys in the TITO "
    "gateway's trajectory records (for RL routing replay; docs/serving.md).")
_ENGINE_PROCESS = flags.DEFINE_bool(
    "engine_process", True, "Run the engine in a process of its own (it loads the model; the "
    "server's process then keeps to the CPU and never holds the accelerator). Off: the engine "
    "runs on a thread of the server's process, which shares one GIL with the HTTP layer "
    "(docs/serving.md 'Load test').")
_POLICY_POLL_S = flags.DEFINE_float("policy_poll_s", 5.0, "Seconds between checks of "
                                    "--policy_dir for a newer version.")


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
  sys.setswitchinterval(_SWITCH.value)
  try:
    if _RANDOM_INIT.value and _CONFIG.value is None:
      raise ValueError("--random_init needs --config (e.g. --config=configs/tiny.py)")
    load = dict(workdir=_WORKDIR.value, hf_path=_HF_PATH.value,
                random_init_config=_CONFIG.value if _RANDOM_INIT.value else None,
                model_overrides=config_flags.get_override_values(flags.FLAGS["model"]),
                tokenizer=_TOKENIZER.value, seed=_SEED.value, cache_dtype=_CACHE_DTYPE.value)
    sizes = dict(slots=_SLOTS.value, max_len=_MAX_LEN.value, prefill_chunk=_PREFILL_CHUNK.value,
                 top_logprobs=_TOP_LOGPROBS.value, record_routing=_RECORD_ROUTING.value)
    if _ENGINE_PROCESS.value:
      # Before anything starts a backend here: the accelerator is the engine process's.
      jax.config.update("jax_platforms", "cpu")
      engine = EngineProcess(_served_engine_with_notices, load, sizes)
      tokenizer = engine.extra["tokenizer"]
    else:
      served = load_model(**load)
      engine, tokenizer = Engine(served.model, served.params, **sizes), served.tokenizer
    if tokenizer is None:
      raise ValueError("the model source has no tokenizer: pass --tokenizer")
    loop = VersionedLoop(engine, max_queue=_MAX_QUEUE.value,
                         admit_after_steps=_ADMIT_AFTER.value,
                         admit_window_s=_ADMIT_WINDOW.value)
    follower = None
    if _POLICY_DIR.value:
      follower = PolicyFollower(loop, _POLICY_DIR.value, poll_s=_POLICY_POLL_S.value)
      if follower.poll() is None:
        raise ValueError(f"--policy_dir={_POLICY_DIR.value}: no published policy version yet "
                         "(start the server after the trainer's first publish)")
      follower.start()
  except (ValueError, FileNotFoundError, EngineProcessError) as e:
    sys.stderr.write("\n".join(console.failure_lines(e, "serving")) + "\n")
    sys.exit(console.EXIT_FAILED)
  uvicorn.run(create_app(loop, tokenizer, model_name=_NAME.value), host=_HOST.value,
              port=_PORT.value, log_level="info")


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
