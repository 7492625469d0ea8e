"""The app's routes, one module per family, each a FastAPI `APIRouter` over one
`serve.context.ServerContext` (`serve.app.create_app` includes them all).

  completions.py    POST /v1/completions
  chat.py           POST /v1/chat/completions (recorded by the TITO gateway with a trajectory id)
  trajectories.py   the gateway's records: GET, POST .../finish and DELETE /v1/trajectories/{id}
  status.py         GET /v1/models, /health (readiness), /metrics (Prometheus text)
"""
