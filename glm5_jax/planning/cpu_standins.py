"""Stand-ins of the same shapes and bytes for collectives XLA:CPU cannot compile, so that
tools/plan_memory.py can compile a TPU/GPU program for simulated CPU devices.

XLA:CPU (jax 0.10.2) rejects `ragged-all-to-all` ("HLO opcode `ragged-all-to-all` is not
supported by XLA:CPU ThunkEmitter"); the expert-parallel MoE (`model.moe_impl =
"expert_parallel"`) dispatches tokens with it. Sharded `ragged_dot` does compile on XLA:CPU,
expert axis sharded included, but as a dense expansion over the experts: `[P, D] x [E, D, F]`
with P = 8192, E = 64 takes 262x its output's bytes in temp (measured, docs/scaling.md). The
TPU compiler runs a grouped matmul with buffers the size of its operands. GPUs do not, at
default flags: XLA GPU's `RaggedDotRewriter` (openxla/xla `ragged_dot_rewriter.cc`) rewrites
the HLO `ragged-dot` jax emits into the same dense masked dot over all E experts (E x the
FLOPs; the weight gradient expands both operands), keeping a ragged dot only with
`xla_gpu_experimental_use_ragged_dot_fusion` and cuDNN >= 9.22 (issue 41;
`tools/flop_ledger.py --platform=cuda` prices it so); so the MoE on GPU does not call it by
default: `glm5_jax.grouped_matmul` runs our Pallas Triton gmm / tgmm there (on one GPU, and per
device expert-parallel), whose buffers are its operands' size. The stand-in below is the grouped
matmul a TPU or that kernel runs, not `ragged_dot` on a GPU. Both get stand-ins:

  `ragged_dot_standin()`          `jax.lax.ragged_dot` -> a capacity-padded grouped einsum
                                  `[E, C, D] x [E, D, F] -> [E, C, F]`, C = ceil(P / E): the
                                  buffers of a perfectly balanced dropless dispatch (P rows
                                  padded up to a multiple of E), tokens placed by expert
                                  (logical `expert` axis) so the expert weights stay put
  `ragged_all_to_all_standin()`   `jax.lax.ragged_all_to_all` -> a dense all-to-all

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

from glm5_jax.layers.axes import EXPERT
from glm5_jax.layers.params import constrain


def _grouped_einsum(lhs_PD, rhs_EDF, group_sizes_E, **kwargs):
  """`ragged_dot`'s signature; every expert gets C = ceil(P / E) rows (see the module
  docstring), so the result's values are not the ragged product's."""
  del group_sizes_E
  preferred = kwargs.pop("preferred_element_type", None)  # the quantized experts' int32 sums
  unsupported = {k: v for k, v in kwargs.items() if v is not None}
  if unsupported:
    raise NotImplementedError(f"ragged_dot stand-in: unsupported arguments {unsupported}")
  p, d = lhs_PD.shape
  e, f = rhs_EDF.shape[0], rhs_EDF.shape[2]
  c = -(-p // e)
  lhs_ECD = jnp.pad(lhs_PD, [(0, e * c - p), (0, 0)]).reshape(e, c, d)
  # Inside the expert-parallel shard_map (every mesh axis manual) the experts are already this
  # device's own: nothing to constrain.
  place = (lambda x: x) if _inside_shard_map() else (
      lambda x: constrain(x, (EXPERT, None, None)))
  out_ECF = place(jnp.einsum("ecd,edf->ecf", place(lhs_ECD), rhs_EDF,
                                preferred_element_type=preferred))
  return out_ECF.reshape(e * c, f)[:p]


def _inside_shard_map() -> bool:
  mesh = jax.sharding.get_abstract_mesh()
  return bool(mesh.axis_names) and all(t == jax.sharding.AxisType.Manual
                                       for t in mesh.axis_types)


@contextlib.contextmanager
def _replacing_lax(name: str, standin):
  """While active, `jax.lax.<name>` is `standin`: code that calls it as `jax.lax.<name>(...)` at
  trace time sees it."""
  original = getattr(jax.lax, name)
  setattr(jax.lax, name, standin)
  try:
    yield
  finally:
    setattr(jax.lax, name, original)


def ragged_dot_standin():
  """While active, `jax.lax.ragged_dot` is the capacity-padded grouped einsum (module
  docstring)."""
  return _replacing_lax("ragged_dot", _grouped_einsum)


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


def ragged_all_to_all_standin():
  """While active, `jax.lax.ragged_all_to_all` is the dense stand-in (module docstring)."""
  return _replacing_lax("ragged_all_to_all", _dense_exchange)
