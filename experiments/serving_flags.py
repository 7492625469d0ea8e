"""The engine's flags, defined once here for the entry points that run an `infer.Engine`:

  define_engine_sizes   --slots, --max_len, --prefill_chunk (serve.py, generate.py: each with
                        its own defaults; `EngineSizes.kwargs()` -> `Engine`'s arguments)
  define_loop_flags     --admit_after_steps, --admit_window_s, --engine_process,
                        --switch_interval_s: how experiments/serve.py runs its engine loop, and
                        tools/bench_serve.py runs it the same way

Functions rather than module-level flags: an entry point defines only the groups it takes, and
a tool can import this beside an entry point's own definitions. The model-loading flags are
experiments/model_flags.py's.
"""

import dataclasses

from absl import flags


@dataclasses.dataclass(frozen=True)
class EngineSizes:
  """The holders of --slots, --max_len and --prefill_chunk."""

  slots: flags.FlagHolder
  max_len: flags.FlagHolder
  prefill_chunk: flags.FlagHolder

  def kwargs(self) -> dict:
    """`Engine`'s slots, max_len and prefill_chunk, as given."""
    return dict(slots=self.slots.value, max_len=self.max_len.value,
                prefill_chunk=self.prefill_chunk.value)


def define_engine_sizes(*, slots: tuple[int, str], max_len: tuple[int, str]) -> EngineSizes:
  """--slots and --max_len, each `(default, help)` (what 0 means differs between entry
  points), and --prefill_chunk (256 prompt tokens per slot per prefill call)."""
  return EngineSizes(
      slots=flags.DEFINE_integer("slots", slots[0], slots[1]),
      max_len=flags.DEFINE_integer("max_len", max_len[0], max_len[1]),
      prefill_chunk=flags.DEFINE_integer("prefill_chunk", 256, "Prompt tokens per slot per "
                                         "prefill call."))


@dataclasses.dataclass(frozen=True)
class LoopFlags:
  """The holders of the engine loop's flags (`define_loop_flags`)."""

  admit_after_steps: flags.FlagHolder
  admit_window_s: flags.FlagHolder
  engine_process: flags.FlagHolder
  switch_interval_s: flags.FlagHolder

  def loop_kwargs(self) -> dict:
    """`EngineLoop`'s admit_after_steps and admit_window_s."""
    return dict(admit_after_steps=self.admit_after_steps.value,
                admit_window_s=self.admit_window_s.value)


def define_loop_flags() -> LoopFlags:
  """How the server runs its engine: admission batching (`serve.engine_loop`), the engine in
  a process of its own or on a thread, and the server process's GIL switch interval."""
  return LoopFlags(
      admit_after_steps=flags.DEFINE_integer(
          "admit_after_steps", 0, "While requests decode, hold new ones and admit them "
          "together after at most this many steps (glm5_jax.serve.engine_loop); 0: at the "
          "next step."),
      admit_window_s=flags.DEFINE_float(
          "admit_window_s", 0.02, "An idle engine admits arrivals once none has come for this "
          "long (at most 4 windows after the first; glm5_jax.serve.engine_loop): clients "
          "answered together send their next requests together; 0: at once."),
      engine_process=flags.DEFINE_bool(
          "engine_process", True, "Run the engine in a process of its own "
          "(glm5_jax.serve.engine_process: it loads the model; the server's process then keeps "
          "to the CPU and never holds the accelerator). Off: the engine runs on a thread of "
          "the server's process, which shares one GIL with the HTTP layer (docs/serving.md "
          "'Load test')."),
      switch_interval_s=flags.DEFINE_float(
          "switch_interval_s", 0.0002, "sys.setswitchinterval of the server process. The "
          "engine thread gives up the GIL at every device call and transfer; at Python's "
          "default 0.005 s each time the event loop holds it costs the engine up to 5 ms (a "
          "busy Python thread slowed Engine.run 2-5.7x at 0.005 s, 1.5x at 0.0002 s: "
          "docs/serving.md)."))
