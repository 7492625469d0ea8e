"""Serving: the engine behind a server.

  engine_loop.py   EngineLoop: the one thread that owns an `infer.Engine`, fed by a bounded
                   queue of submissions and cancels; each request's events come back on its
                   own `Stream`
"""
