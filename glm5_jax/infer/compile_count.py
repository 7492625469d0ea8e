"""Counting XLA compilations: the check that bucketed shapes stop recompiling after warm-up.

`count_compiles()` is a context manager yielding a counter of the backend compilations that
finish inside it (JAX's `/jax/core/compile/backend_compile_duration` monitoring event, one per
program XLA compiles, or loads from the persistent compilation cache; a jit cache hit records
nothing). `cache_hits` counts those of them loaded from the persistent cache
(`jax_compilation_cache_dir`; JAX's `/jax/compilation_cache/cache_hits` event), so
`count - cache_hits` programs were compiled here. `process_compiles()` is one counter for the
whole life of the process.
"""

import contextlib

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
  """`count`: compilations seen so far (persistent-cache loads included); `cache_hits`: those
  loaded from the persistent cache."""

  def __init__(self):
    self.count = 0
    self.cache_hits = 0

  def __call__(self, event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs, kwargs
    if event == BACKEND_COMPILE_EVENT:
      self.count += 1

  def on_event(self, event: str, **kwargs) -> None:
    del kwargs
    if event == CACHE_HIT_EVENT:
      self.cache_hits += 1


@contextlib.contextmanager
def count_compiles():
  """Yields a `CompileCounter` that counts compilations until the block ends."""
  counter = CompileCounter()
  jax.monitoring.register_event_duration_secs_listener(counter)
  jax.monitoring.register_event_listener(counter.on_event)
  try:
    yield counter
  finally:
    jax.monitoring.unregister_event_duration_listener(counter)
    jax.monitoring.unregister_event_listener(counter.on_event)


_PROCESS_COUNTER: CompileCounter | None = None


def process_compiles() -> CompileCounter:
  """A counter of every compilation in this process from the first call on (registered once,
  never removed): what a server reports as its engine's compiles (`/metrics`; 0 new ones after
  warm-up), counted in the process that runs the engine."""
  global _PROCESS_COUNTER
  if _PROCESS_COUNTER is None:
    _PROCESS_COUNTER = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(_PROCESS_COUNTER)
    jax.monitoring.register_event_listener(_PROCESS_COUNTER.on_event)
  return _PROCESS_COUNTER
