"""Serving: the engine behind an OpenAI-compatible server (docs/serving.md).

  engine_loop.py   EngineLoop: the one thread that owns an `infer.Engine`, fed by a bounded
                   queue of submissions and cancels; each request's events come back on its
                   own `Stream` (or one asyncio inbox per HTTP request)
  engine_process.py  EngineProcess: the engine in a process of its own behind a pipe (what
                   experiments/serve.py runs), pipelined one step ahead
  versions.py      VersionedLoop: new params between engine steps, each token tagged with
                   the version that sampled it
  gateway.py       the TITO gateway: trajectory records per call (exact ids, log-probs,
                   versions), recorded tokens kept across turns, mismatches counted
  app.py           the FastAPI app: endpoints, request fields, SSE, /metrics
  choices.py       one request's choices fed by its events: kept tokens, finish reasons,
                   log-probs in OpenAI's shapes
  text.py          generated ids -> text: incremental decode, stop strings, GLM's reasoning /
                   content / tool-call split
  messages.py      OpenAI chat messages and tools -> GLM chat messages
  errors.py        ApiError and OpenAI-style error bodies
"""
