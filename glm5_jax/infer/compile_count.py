"""Counting XLA compilations: the check that bucketed shapes stop recompiling after warm-up.

`count_compiles()` is a context manager yielding a counter of the backend compilations that
finish inside it (JAX's `/jax/core/compile/backend_compile_duration` monitoring event, one per
program XLA compiles; a jit cache hit records nothing).
"""

import contextlib

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
  """`count`: compilations seen so far."""

  def __init__(self):
    self.count = 0

  def __call__(self, event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs, kwargs
    if event == BACKEND_COMPILE_EVENT:
      self.count += 1


@contextlib.contextmanager
def count_compiles():
  """Yields a `CompileCounter` that counts compilations until the block ends."""
  counter = CompileCounter()
  jax.monitoring.register_event_duration_secs_listener(counter)
  try:
    yield counter
  finally:
    jax.monitoring.unregister_event_duration_listener(counter)
