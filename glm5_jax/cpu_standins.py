"""Stand-ins of the same shapes and bytes for collectives XLA:CPU cannot compile, so that
tools/plan_memory.py can compile a TPU/GPU program for simulated CPU devices.

XLA:CPU (jax 0.10.2) rejects `ragged-all-to-all` ("HLO opcode `ragged-all-to-all` is not
supported by XLA:CPU ThunkEmitter"); the expert-parallel MoE (`model.moe_impl =
"expert_parallel"`) dispatches tokens with it. Sharded `ragged_dot` itself compiles on XLA:CPU
(checked at GLM-5 width in docs/scaling.md), so it needs no stand-in.

`ragged_all_to_all_standin()` replaces `jax.lax.ragged_all_to_all` while a program is traced
with a dense `all_to_all` of the whole send buffer: the same result shape and dtype, and the
bytes a ragged exchange moves when every row of the buffer is sent (its worst case; a balanced
exchange moves about as much, since the buffers are sized for the tokens actually routed).
Figures compiled under it are labelled "MoE via stand-in". Only the planner uses it; the
numbers it computes are wrong by design, so nothing may run a program traced under it.
"""

import contextlib

import jax
import jax.numpy as jnp


def _dense_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                    axis_name, axis_index_groups=None):
  """`ragged_all_to_all`'s signature; sends all of `operand`, shaped like `output`."""
  del input_offsets, send_sizes, output_offsets, recv_sizes
  if axis_index_groups is not None:
    raise NotImplementedError("ragged_all_to_all stand-in: axis_index_groups is not supported")
  ways = jax.lax.axis_size(axis_name)
  rows = operand.shape[0]
  padded = -(-rows // ways) * ways  # all_to_all splits the rows evenly over the axis
  if padded != rows:
    operand = jnp.pad(operand, [(0, padded - rows)] + [(0, 0)] * (operand.ndim - 1))
  moved = jax.lax.all_to_all(operand, axis_name, 0, 0, tiled=True)
  if moved.shape[0] >= output.shape[0]:
    return moved[:output.shape[0]].astype(output.dtype)
  return jax.lax.dynamic_update_slice_in_dim(output, moved.astype(output.dtype), 0, axis=0)


@contextlib.contextmanager
def ragged_all_to_all_standin():
  """While active, `jax.lax.ragged_all_to_all` is the dense stand-in (see the module
  docstring); code that calls it as `jax.lax.ragged_all_to_all(...)` at trace time sees it."""
  original = jax.lax.ragged_all_to_all
  jax.lax.ragged_all_to_all = _dense_exchange
  try:
    yield
  finally:
    jax.lax.ragged_all_to_all = original
