"""A rollout worker's own OpenAI-compatible server, for agent episodes (`rl.rollout_via`
"gateway").

`AgentServer` serves the worker's engine in this process: `serve.app.create_app` (with its TITO
gateway) over a `serve.versions.VersionedLoop`, run by uvicorn on a thread of its own, on a
loopback port the operating system picks (`serve.threaded_server`: the socket is bound before
uvicorn takes it, so two workers on one host never race for a port). Agent programs reach it
at `url` through the `openai` client like any server; `rl.agent_rollout.agent_samples` plays
the episodes and turns the gateway's records into samples.

The engine's shapes come from the config only (slots, `data.seq_len`), as the engine path's
do, so a new policy version (`set_params`: applied between two engine steps, each token tagged
with the version whose step sampled it) reuses every compiled program. `max_len` is
`data.seq_len - 1`: a call may take at most `max_len + 1 - len(prompt)` new tokens (the last
one is never fed), so every sample fits the trainer's `seq_len` rows.
"""

import logging

from glm5_jax.infer.engine import Engine
from glm5_jax.serve.app import create_app
from glm5_jax.serve.threaded_server import ThreadedServer
from glm5_jax.serve.versions import VersionedLoop

MODEL_NAME = "glm5-jax"
# Prompt tokens per slot per prefill call: experiments/serve.py's default. A first call's
# prompt (the task's messages) is prefilled in one call, so the compiled prefill programs are
# few; later calls of a trajectory prefill only their new tokens (engine sessions).
PREFILL_CHUNK = 256


class AgentServer:
  """The server over `params` (version `version`): `url`, `model_name` (the `model` its
  clients pass), `set_params`, `close`, and the gateway's and engine's counters (`counters`)."""

  def __init__(self, model, params, tokenizer, *, slots: int, seq_len: int, version: int,
               record_routing: bool = False, start_timeout_s: float = 60.0):
    if seq_len < 2:
      raise ValueError(f"AgentServer: seq_len must be >= 2, got {seq_len}")
    engine = Engine(model, params, slots=slots, max_len=seq_len - 1,
                    prefill_chunk=min(PREFILL_CHUNK, seq_len - 1),
                    record_routing=record_routing)
    # Every request of a batch is in flight at once: never refuse one for a full queue.
    self.loop = VersionedLoop(engine, version=version, max_queue=max(256, 4 * slots))
    self.model_name = MODEL_NAME
    self.app = create_app(self.loop, tokenizer, model_name=MODEL_NAME)
    # The agents' `openai` clients log every HTTP call at INFO through httpx ("httpx2" from
    # openai 3.x on): thousands of lines per batch in the worker's log. Their errors still
    # surface as exceptions.
    for name in ("httpx", "httpx2"):
      logging.getLogger(name).setLevel(logging.WARNING)
    # uvicorn installs no signal handlers off the main thread: SIGTERM stays the worker's.
    try:
      self._http = ThreadedServer(self.app, access_log=False, start_timeout_s=start_timeout_s)
    except RuntimeError:  # uvicorn did not start: the engine loop's thread must not outlive it
      self.loop.close()
      raise
    self.url = self._http.url

  @property
  def gateway(self):
    return self.app.state.gateway

  def set_params(self, params, version: int) -> None:
    """Serves `params` as `version` from the engine's next step on (`VersionedLoop`)."""
    self.loop.set_params(params, version)

  def counters(self) -> dict:
    """Cumulative since the server started: the engine's prefix counters (prompt tokens
    submitted and prefilled, session hits / misses / evictions), tokens generated, gateway
    calls, mismatches (re-rendered text that re-tokenized differently; generation used the
    recorded tokens) and aborted calls."""
    g = self.gateway
    prefix = self.loop.engine.prefix_stats()
    return {**{k: int(prefix.get(k, 0)) for k in ("prompt_tokens", "prefilled_tokens",
                                                   "session_hits", "session_misses",
                                                   "evictions")},
            "tokens_generated": int(self.loop.tokens_generated), "calls": g.calls,
            "mismatches": g.mismatches, "aborted": g.aborted}

  def close(self) -> None:
    self._http.close()
    self.loop.close()
