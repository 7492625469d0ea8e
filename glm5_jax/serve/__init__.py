"""Serving: the engine behind a server.

  engine_loop.py   EngineLoop: the one thread that owns an `infer.Engine`, fed by a bounded
                   queue of submissions and cancels; each request's events come back on its
                   own `Stream`
  versions.py      VersionedLoop: new params between engine steps, each token tagged with
                   the version that sampled it
  gateway.py       the TITO gateway: trajectory records per call (exact ids, log-probs,
                   versions), recorded tokens kept across turns, mismatches counted
  app.py           the OpenAI-compatible FastAPI app
"""
