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
  app.py           create_app: the FastAPI app assembled from its routers and error handlers
  routes/          one APIRouter per route family: completions.py, chat.py, trajectories.py
                   (the gateway's records), status.py (/v1/models, /health, /metrics)
  context.py       ServerContext: what every route reads (loop, tokenizer, bounds, readiness)
                   and the readers of a request body into engine requests
  respond.py       a request's choices run on the loop, answered whole or as SSE
  fields.py        every OpenAI request field honoured or refused; typed field readers
  limits.py        each request's bounds (n, tokens, body bytes, JSON depth)
  readiness.py     warm-up before taking requests (/health)
  choices.py       one request's choices fed by its events: kept tokens, finish reasons,
                   log-probs in OpenAI's shapes
  text.py          generated ids -> text: incremental decode, stop strings, GLM's reasoning /
                   content / tool-call split
  messages.py      OpenAI chat messages and tools -> GLM chat messages
  errors.py        ApiError and OpenAI-style error bodies
"""
