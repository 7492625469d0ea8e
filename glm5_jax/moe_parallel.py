"""Expert parallelism: (token, expert) pairs travel to the devices holding their experts, a
per-shard grouped matmul runs there, and the results travel back (`model.moe_impl =
"expert_parallel"`).

The reference (`glm5_jax.moe.dispatch_experts`) is one global `ragged_dot` with sharding
annotations; with the expert dimension sharded, XLA's partitioner is free to all-gather every
expert's weights. Here the layout is explicit, under `jax.shard_map` over the whole mesh:

  tokens  M   split over the batch axes of the logical rules plus the `expert` axis (so the
              expert-parallel devices are also data-parallel, as in DeepSeek-V3 and MaxText);
  experts E   split over the mesh axis of the `expert` rule; each device holds E/n experts
              (n = that axis' size). The expert kernels enter on their EMBED (fsdp) shards
              and are all-gathered inside, over fsdp, the local experts' slice only: the
              gather's transpose reduce-scatters their gradients (gathered outside, the
              shard_map's transpose all-reduced them over fsdp first). Gate and up enter
              joined, `[E, D, 2F]` (`_joined_gate_up`): one grouped matmul for both.
  F           split over the `expert_mlp` rule's axes (tensor); the partial outputs are summed
              over them after the combine (`psum` of `[M/shards, D]`).

A quantized model's kernels (`model.quant`) arrive as `(q int8 [E, I, O], scale [E, G, O])`
per projection and are split the same way (the scales over `expert` and O's axes), the local
matmul `glm5_jax.quant.linear.ragged_int_matmul` (per-token INT8 activations, int32 sums per
scale group). Without this the quantized experts ran one global sharded `ragged_dot` per scale
group, and the TPU compiler all-gathered every expert's weights for it at every step
(docs/quantization.md: 675 GiB per device per decode step of the 744B model on 8 v5p chips).

Per shard: sort the local pairs by expert (as the reference), exchange per-expert counts with
one small all-to-all, send each pair's row to the device holding its expert, sort the received
rows by local expert, a grouped matmul over the local experts (`ragged_dot`; megablox on TPU,
our Triton gmm on GPU: `glm5_jax.grouped_matmul`), un-sort, send back, un-sort, and
sum each token's rows (inverse permutation + sum: no scatter-add, so deterministic). Each pair's
router weight travels with its row (a second, small exchange) and scales the expert's SwiGLU
output before the down projection: the same mixture as the reference's weighted sum of the
experts' outputs (the projection is linear), but the weights' gradient is then the rows' dot
with the down projection's input gradient, which the backward computes anyway, so a remat's
rerun of the layer needs neither the down projection nor the exchange back (a third of the
experts' rerun: 0.57 s a step at the 744B headline, docs/scaling.md "Router weights with the
rows"). Quantized experts (inference) scale the output instead, their INT8 activations as the
reference's. Routing, `expert_counts` and the balance loss stay in
`glm5_jax.moe.MoE`, computed on the global token array exactly as for "ragged".

Shaped for the TPU compiler (docs/scaling.md, "MoE dispatch without the relayouts" and "MoE
dispatch in 16-token groups"): rows travel and are sorted in groups of 16 tokens (`GROUP`), each
(destination, expert) segment padded to whole groups with zero rows, so the collective, the
receiver's sort and the grouped matmul all take `[groups, 16, D]` = `[rows, D]` as it is (no
relayout on either side of the matmul); the combine receives into the dispatch's used send
buffer instead of a fresh zero buffer; the row gathers differentiate to gathers by their inverse
maps, not scatter-adds into zero buffers; the dispatch's receive buffer and the exchanges'
transposes write into uninitialized buffers (`jax.lax.empty`, `_exchange`), not zero-filled
ones. The groups no message wrote sit past the grouped matmul's groups (the received groups are
a prefix of the buffer), and every grouped matmul here (ragged_dot, megablox, the Triton gmm)
leaves rows past its groups out of every group's result and weight gradient, whatever they
hold: tests/test_moe_parallel.py runs each on NaN-filled buffers. The padding rows inside an
expert's group are zeros: their outputs are zero, and so is every weight-gradient term of
theirs whatever finite cotangent they get (the combine's backward gives them another slot's).

Dropless by default, so every buffer is sized for the worst case: a device can receive up to
`n * m * min(X, E/n)` rows (every local token choosing only its experts; m local tokens), n
times the `m * X` rows it receives on average, plus each segment's padding. With
`model.moe_capacity_factor` c > 0 a device receives at most `ceil(c * m * X / 16) + E/n` groups
of 16 rows, padding included (one group per local expert on top: a lone source's padding):
each destination takes its sources' groups in source order, each source's groups in expert
order, until full; the rest are dropped (their expert output is zero, as in GShard / Switch
capacity), and the dispatch returns the fraction of pairs dropped (`moe_dropped_fraction` in the
layer's aux and the train metrics). The padding costs capacity: at the 744B headline (32
sources x 8 experts a device, ~7.5 padding rows a segment) about 4% of the 1.25 x average
rows. With the "ragged_all_to_all" transport the receive buffer and the
expert matmuls shrink to that many rows; "all_to_all" drops the same pairs but keeps its dense
worst-case slots.
Chunks (`model.moe_dispatch_chunks` = k > 1): each shard's m tokens go through all of the above
in k contiguous chunks of m / k, independent of each other (tokens padded to a multiple of k
shards). A chunk's exchange then has another chunk's grouped matmul to run beside it, which the
compiler's scheduler can overlap with it (one pass leaves it nothing: the exchange, the matmul
and the exchange back depend on each other in turn). Each chunk has its own buffers and capacity
(`ceil(c * m / k * X / 16) + E/n` groups), so with a capacity factor the drops are decided per
chunk. The chunks share the kernels: each chunk's grouped matmuls pass them to the next's
(`grouped_matmul`'s `pass_weights`), so the backward accumulates the chunks' weight gradients
in megablox's `tgmm` rather than adding them after it (docs/scaling.md, "Gate and up joined,
gathered inside").
Weights before rows: the local experts' kernels are gathered over the fsdp axes (inside the
shard_map, with the rows behind the same barrier), the pair counts exchanged
(`_exchanged_counts`, a shard_map of its own) and the caller's `computed_first` (the MoE's
load counts and balance loss) computed before any row moves, behind an optimization barrier whose backward is the identity. Left to the
scheduler, those gathers and the counts' all-reduce came after the first exchanges had started,
and a collective the compiler keeps synchronous waits for the ones in flight before it: ~1.3 s
a step of the forward layer loop in the 744B headline's schedule (docs/scaling.md, "Weights
before rows"). The backward's exchanges send the messages back by offsets every device already
knows from the exchanged counts (`_exchange`), not by offsets exchanged again.

Transport (`model.moe_transport`):
  "ragged_all_to_all"  `jax.lax.ragged_all_to_all`: each message is exactly the groups it
                       carries, so the bytes on the wire are the real `m * X` rows each way
                       plus the segments' padding; only the receive buffer is worst-case
                       sized. The production choice on
                       TPU and GPU. XLA:CPU (jax 0.10.2) cannot compile it: "UNIMPLEMENTED:
                       HLO opcode `ragged-all-to-all` is not supported by XLA:CPU
                       ThunkEmitter".
  "all_to_all"         `jax.lax.all_to_all` of `[n, m * min(X, E/n) + pad, D]` buffers, one
                       worst-case slot per destination: runs everywhere (the CPU tests and
                       the AOT planner use it), but sends n * m * min(X, E/n) rows, about n
                       times the ragged bytes when E/n >= X, and holds both full buffers.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from glm5_jax import grouped_matmul
from glm5_jax.layers import axes as logical_axes
from glm5_jax.layers.ordering import in_order
from glm5_jax.quant.linear import ragged_int_matmul
from pallas_kernels.blocking import varying_axes, varying_like

TRANSPORTS = ("ragged_all_to_all", "all_to_all")


context_mesh = logical_axes.context_mesh


def _mesh_axes(rules, logical_name):
  return logical_axes.spec_axes(nn.logical_to_mesh_axes((logical_name,), rules)[0])


def expert_parallel_dispatch(x_MD, weights_MX, experts_MX, w_gate_EDF, w_up_EDF, w_down_EFD,
                             *, transport="ragged_all_to_all", matmul="auto",
                             capacity_factor=0.0, chunks=1, mesh=None, rules=None,
                             computed_first=None):
  """`glm5_jax.moe.dispatch_experts`'s mixture `y_MD`, computed expert-parallel.

  Args:
    x_MD, weights_MX, experts_MX: global arrays (any sharding), as for `dispatch_experts`.
    w_*: the global expert kernels `[E, D, F]`, `[E, D, F]`, `[E, F, D]`; or, quantized, each
      a pair `(q int8, scale [E, G, O])` (module docstring).
    transport: "ragged_all_to_all" or "all_to_all" (see the module docstring).
    matmul: the local grouped matmul, `model.moe_matmul`: "auto" (`grouped_matmul.default_impl`:
      megablox on TPU, triton_gmm on GPU), "ragged_dot", "megablox" or "triton_gmm"
      (`glm5_jax.grouped_matmul`).
    capacity_factor: 0 (dropless) or c > 0: receive at most `ceil(c * m * X)` rows per device
      (module docstring).
    chunks: each shard's tokens in this many independent exchange -> grouped matmul -> exchange
      passes (`model.moe_dispatch_chunks`; "Chunks" in the module docstring).
    mesh: defaults to the context mesh (`jax.set_mesh`); required.
    rules: logical axis rules; default the flax context's (`nn.logical_axis_rules`).
    computed_first: arrays (any pytree, e.g. the load counts) to compute, with the kernels'
      gather, before any row moves ("Weights before rows" in the module docstring).
  Returns:
    `(y_MD, dropped_S, first)`: the mixture in `x_MD`'s dtype, the fraction of (token, expert)
    pairs dropped for capacity per token shard (f32 `[shards]`, split over the token axes: its
    sum is the fraction, 0 when dropless; summed where it is read, not here, a scalar
    all-reduce in every layer that waited behind the exchanges in flight, 0.36 s a step in the
    744B headline's schedule), and `computed_first` as it left
    the barrier, for the caller to use in its place: a value used only past the barrier is
    one the compiler may still compute late (the TPU compiler folded the load counts'
    all-reduce into the dropped fraction's, after the exchanges, until the counts came from
    here).
  Raises:
    ValueError: no mesh, no mesh axis for the `expert` logical axis, E not divisible by it,
      F's axes overlapping the token axes, or an unknown transport.
  """
  if transport not in TRANSPORTS:
    raise ValueError(f"model.moe_transport: must be one of {TRANSPORTS}, got {transport!r}")
  mesh = context_mesh() if mesh is None else mesh
  if mesh is None:
    raise ValueError("moe_impl='expert_parallel' needs a device mesh in context "
                     "(glm5_jax.sharding.activation_sharding or jax.set_mesh)")
  rules = nn.get_logical_axis_rules() if rules is None else rules
  expert_axes = _mesh_axes(rules, logical_axes.EXPERT)
  if len(expert_axes) != 1:
    raise ValueError(f"config.mesh.logical_axis_rules: moe_impl='expert_parallel' needs the "
                     f"logical axis {logical_axes.EXPERT!r} mapped to exactly one mesh axis, "
                     f"got {expert_axes}")
  (expert_axis,) = expert_axes
  f_axes = _mesh_axes(rules, logical_axes.EXPERT_MLP)
  token_axes = tuple(a for a in _mesh_axes(rules, logical_axes.BATCH) if a != expert_axis)
  token_axes += (expert_axis,)
  # Context parallelism: a row's tokens are split over the `length` rule's axes too; flattened
  # [B, L] -> M rows they follow the batch axes (the natural layout, no relayout).
  token_axes += tuple(a for a in _mesh_axes(rules, logical_axes.LENGTH) if a not in token_axes)
  if set(f_axes) & set(token_axes):
    raise ValueError(f"config.mesh.logical_axis_rules: the expert FFN axes {f_axes} overlap "
                     f"the token axes {token_axes}")
  quantized = isinstance(w_gate_EDF, tuple)
  if quantized and math.prod(mesh.shape[a] for a in f_axes) > 1:
    raise ValueError(f"config.mesh.logical_axis_rules: quantized experts (model.quant) run "
                     f"expert-parallel with their F dimension whole; the expert_mlp rule splits "
                     f"it over {f_axes} (set those mesh axes to 1)")
  if quantized:
    f_axes = ()  # size-1 axes: nothing to split or sum
  num_experts = (w_gate_EDF[0] if quantized else w_gate_EDF).shape[0]
  n = mesh.shape[expert_axis]
  if num_experts % n:
    raise ValueError(f"model.n_routed_experts: {num_experts} is not divisible by the "
                     f"{expert_axis!r} mesh axis ({n})")

  # Pad the tokens to a multiple of the token shards. Padding rows get distinct experts (the
  # worst-case buffer bound assumes a token's X experts differ) and zero router weights.
  m, x = experts_MX.shape
  if not isinstance(chunks, int) or chunks < 1:
    raise ValueError(f"model.moe_dispatch_chunks: must be an int >= 1, got {chunks!r}")
  shards = math.prod(mesh.shape[a] for a in token_axes)
  pad = -m % (shards * chunks)
  if pad:
    x_MD = jnp.pad(x_MD, ((0, pad), (0, 0)))
    weights_MX = jnp.pad(weights_MX, ((0, pad), (0, 0)))
    experts_MX = jnp.concatenate(
        [experts_MX, jnp.broadcast_to(jnp.arange(x, dtype=experts_MX.dtype), (pad, x))])

  tokens = PartitionSpec(token_axes, None)
  f_spec = f_axes if f_axes else None
  impl = grouped_matmul.default_impl() if matmul == "auto" else matmul
  local = functools.partial(_chunked_dispatch, chunks=chunks, expert_axis=expert_axis, n=n,
                            f_axes=f_axes, transport=transport, matmul=impl,
                            capacity_factor=capacity_factor)
  if quantized:  # (q, scale) pairs, each whole over fsdp; the scale's group axis whole (F is)
    kernel_specs = tuple((spec, spec) for spec in (PartitionSpec(expert_axis, None, None),) * 2
                         + (PartitionSpec(expert_axis, None, None),))
    kernels, d_axes = (w_gate_EDF, w_up_EDF, w_down_EFD), ()
  else:
    # The kernels enter on their fsdp shards and are gathered inside ("Weights before rows"):
    # the gather's transpose is then a reduce-scatter of the weight gradients, where a gather
    # outside the shard_map had the shard_map's transpose all-reduce them first.
    d_axes = tuple(a for a in _mesh_axes(rules, logical_axes.EMBED)
                   if a != expert_axis and a not in f_axes)
    if set(d_axes) - set(token_axes):
      # Ordered with the gathered kernels (`in_order`), the tokens would vary over these axes
      # too, and the combined rows with them.
      raise ValueError(f"config.mesh.logical_axis_rules: moe_impl='expert_parallel' needs the "
                       f"expert kernels' embed axes {d_axes} among the token axes "
                       f"{token_axes} or the expert FFN axes {f_axes}")
    d_spec = d_axes if d_axes else None
    # The down kernel as `[E, D, F]` too (a transpose of each device's own shard), gathered
    # along D as gate and up are: gathered along its minor dimension, `[E, F, D]` came out of
    # the gather D-major and was copied into the grouped matmul's layout in the forward and
    # again in the remat's rerun (a `bf16[32, 2048, 6144]` copy each, 0.39 s a step at 128K
    # tokens by the TPU compiler's estimate).
    kernel_specs = (PartitionSpec(expert_axis, d_spec, f_spec),) * 2
    f_shards = math.prod(mesh.shape[a] for a in f_axes)
    kernels = (_joined_gate_up(w_gate_EDF, w_up_EDF, f_shards), w_down_EFD.swapaxes(1, 2))
  local = functools.partial(_chunked_dispatch, chunks=chunks, expert_axis=expert_axis, n=n,
                            f_axes=f_axes, d_axes=d_axes, transport=transport, matmul=impl,
                            capacity_factor=capacity_factor)
  per_shard = PartitionSpec(token_axes)
  counted = jax.shard_map(
      functools.partial(_exchanged_counts, chunks=chunks, n=n, local_experts=num_experts // n,
                        expert_axis=expert_axis),
      mesh=mesh, in_specs=(tokens,), out_specs=(per_shard,) * 3)(experts_MX)
  kernels = jax.tree.map(
      lambda w, spec: jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec)),
      kernels, kernel_specs)
  # The kernels' shards stay out of this barrier: their gather (inside) is ordered before the
  # rows by the shard_map's own barrier, and may start before this one's inputs exist.
  x_MD, weights_MX, experts_MX, counted, first = in_order(
      (x_MD, weights_MX, experts_MX, counted, computed_first))
  y_MD, dropped_S = jax.shard_map(
      local, mesh=mesh, in_specs=(tokens, tokens, tokens, *(per_shard,) * 3, *kernel_specs),
      out_specs=(tokens, PartitionSpec(token_axes)),
      # A pallas_call (megablox's, the Triton gmm's) states no varying-axes type for its
      # outputs, which check_vma requires. Without it, shard_map's transpose divides the unmapped
      # output's cotangent by the unmentioned axes' size, so the psum over F's axes still
      # differentiates exactly (tests/moe_parallel_cases.py compares the gradients with the
      # reference).
      check_vma=impl not in ("megablox", "triton_gmm") or quantized)(
          x_MD, weights_MX, experts_MX, *counted, *kernels)
  return y_MD[:m], dropped_S / (m * x), first


def _exclusive_cumsum(a, axis=-1):
  return jnp.cumsum(a, axis=axis) - a


def _joined_gate_up(w_gate_EDF, w_up_EDF, f_shards):
  """`[E, D, 2F]`: the gate and up kernels side by side in each of the `f_shards` F shards, so
  each device's shard is its `[gate | up]` (one grouped matmul for both, `_swiglu_joined`)."""
  e, d, f = w_gate_EDF.shape
  split = lambda w: w.reshape(e, d, f_shards, 1, f // f_shards)
  return jnp.concatenate([split(w_gate_EDF), split(w_up_EDF)], axis=3).reshape(e, d, 2 * f)


@jax.custom_vjp
def _swiglu_joined(gate_up_RF):
  """`silu(gate) * up` of `[R, 2F]` = `[gate | up]`, `[R, F]`. Its own VJP writes the gradient
  `[R, 2F]` whole in one fusion; jax's transposes of the two slices are pads, added."""
  gate, up = jnp.split(gate_up_RF, 2, axis=-1)
  return jax.nn.silu(gate) * up


def _swiglu_joined_fwd(gate_up_RF):
  return _swiglu_joined(gate_up_RF), gate_up_RF


def _swiglu_joined_bwd(gate_up_RF, dh_RF):
  gate, up = (a.astype(jnp.float32) for a in jnp.split(gate_up_RF, 2, axis=-1))
  dh = dh_RF.astype(jnp.float32)
  sig = jax.nn.sigmoid(gate)
  d_gate = dh * up * sig * (1 + gate * (1 - sig))
  return (jnp.concatenate([d_gate, dh * gate * sig], axis=-1).astype(gate_up_RF.dtype),)


_swiglu_joined.defvjp(_swiglu_joined_fwd, _swiglu_joined_bwd)


# Rows travel in groups of `GROUP` tokens, `[groups, GROUP, D]`. The TPU compiler lays a ragged
# all-to-all's buffers out so that each exchanged row is contiguous. A bf16 `[rows, D]` array is
# tiled 16 rows x 128 columns (8 sublanes of two packed rows), so a token's row is not: the
# compiler relaid each buffer out around the collective (13 ms per 81,920 x 6,144 buffer by its
# cost model). `[rows, 8, D / 8]` slabs kept each token contiguous, but then the grouped matmul's
# `[rows, D]` was a relayout each way (14 copies of `bf16[40960, 6144]` a layer in the 744B
# headline step, ~1.05 s). A group of 16 tokens is exactly one row of tiles: `[groups, 16, D]`
# is contiguous per group and its reshape to `[rows, D]` is a bitcast (docs/scaling.md, "MoE
# dispatch in 16-token groups"). So every (destination, expert) segment of a sender's rows is
# padded to whole groups with zero rows, messages and the receiver's sort move whole groups,
# and the grouped matmul reads the received groups as rows: a zero row adds zero to its expert's
# output and weight gradients.
GROUP = 16
# The grouped matmul's row tile (`grouped_matmul`: 512 rows), in groups: a receive buffer of whole
# tiles is not padded (copied) by it.
_TILE_GROUPS = 512 // GROUP


def _groups(count):
  """Whole groups that hold `count` rows."""
  return -(-count // GROUP)


def _per_row(mask, a):
  """`mask` `[R...]` broadcastable against the row array `a` `[R..., *row]`."""
  return mask.reshape(mask.shape + (1,) * (a.ndim - mask.ndim))


def _allocate(shape, dtype):
  """`jax.lax.empty`: no fill on TPU and GPU, zeros elsewhere. The tests make it NaN to show
  that no unwritten row reaches a result."""
  return jax.lax.empty(shape, dtype)


def _uninitialized(shape, dtype, anchor=None):
  """A buffer every read row of which is written first (`_allocate`).

  With `anchor` (any array computed in the same layer), the buffer is allocated in that layer's
  iteration of the layers' scan. An operand-free `empty` is loop-invariant, so jax hoists it out
  of the scan, and a ragged all-to-all writing into it in place then copies it in every
  iteration: a `bf16[41472, 6144]` copy per dispatch chunk in the 744B headline's forward (1.0
  ms each by the TPU compiler's estimate, 0.15 s a step). A branch on the anchor whose both
  sides allocate is not invariant; the TPU compiler keeps it as a conditional of two
  allocations (no copy)."""
  if anchor is None:
    return _allocate(shape, dtype)
  allocate = lambda: _allocate(shape, dtype)
  return jax.lax.cond(anchor.reshape(-1)[0] > 0, allocate, allocate)


# The ragged all-to-all's own transpose (jax) sends the cotangents back into a zero buffer of
# the operand's shape: a rows-sized broadcast per exchange in the backward (3.6 ms per 81,920-row
# slab buffer by the TPU compiler's cost model, docs/scaling.md), for rows that are all written
# (a dropless dispatch sends every row), past the grouped matmul's groups (the combine's operand:
# only its first `sum(recv)` rows were sent), or left out of the token gradient's sum (the pairs
# a capacity factor dropped: `_spread_rows`' `sent_MX`). It also learns the reversed messages'
# offsets with two all-to-alls of its own (each a wait in the backward: 0.12 s a step exposed
# in the 744B headline's schedule); every device here knows them already, from the counts all
# of them exchanged (`_exchanged_counts`).
def _exchange(rows_R_, into_S_, input_offsets_N, send_N, output_offsets_N, recv_N, axis_name,
              back_input_offsets_N, back_output_offsets_N):
  """`jax.lax.ragged_all_to_all(rows_R_, into_S_, ...)` whose backward writes into an
  uninitialized buffer: the rows of `rows_R_` that no message carried get undefined cotangents,
  which the caller must leave unread. The backward sends each message back from where it landed
  (`back_input_offsets_N[i]`: where source i's rows sit in this device's `into_S_`) to where it
  came from (`back_output_offsets_N[i]`: where they sat in source i's `rows_R_`)."""
  # The received rows vary over the mesh axes as the sent ones do (shard_map's check_vma types
  # a ragged all-to-all's result as its output buffer).
  into_S_ = varying_like(into_S_, rows_R_)
  return _exchange_vjp(rows_R_, into_S_, input_offsets_N, send_N, output_offsets_N, recv_N,
                       back_input_offsets_N, back_output_offsets_N, axis_name,
                       varying_axes(rows_R_))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _exchange_vjp(rows_R_, into_S_, input_offsets_N, send_N, output_offsets_N, recv_N,
                  back_input_offsets_N, back_output_offsets_N, axis_name, varying):
  del back_input_offsets_N, back_output_offsets_N, varying  # the backward's
  return jax.lax.ragged_all_to_all(rows_R_, into_S_, input_offsets_N, send_N, output_offsets_N,
                                   recv_N, axis_name=axis_name)


def _exchange_fwd(rows_R_, into_S_, input_offsets_N, send_N, output_offsets_N, recv_N,
                  back_input_offsets_N, back_output_offsets_N, axis_name, varying):
  out = _exchange_vjp(rows_R_, into_S_, input_offsets_N, send_N, output_offsets_N, recv_N,
                      back_input_offsets_N, back_output_offsets_N, axis_name, varying)
  return out, (rows_R_.shape[0], send_N, recv_N, back_input_offsets_N, back_output_offsets_N)


def _exchange_bwd(axis_name, varying, res, ct_S_):
  num_rows, send_N, recv_N, back_input_offsets_N, back_output_offsets_N = res
  into_R_ = _uninitialized((num_rows, *ct_S_.shape[1:]), ct_S_.dtype)
  if varying:  # shard_map's type check (check_vma): the cotangent varies as the operand did
    into_R_ = jax.lax.pcast(into_R_, varying, to="varying")
  ct_R_ = jax.lax.ragged_all_to_all(ct_S_, into_R_, back_input_offsets_N, recv_N,
                                    back_output_offsets_N, send_N, axis_name=axis_name)
  return (ct_R_,) + (None,) * 7


_exchange_vjp.defvjp(_exchange_fwd, _exchange_bwd)


# The dispatch's row gathers are injective (each source row to at most one place, or each token's
# row to its X slots): their backward is a gather by the inverse map, not jax's scatter-add into a
# zero buffer (which the TPU compiler broadcasts first: a rows-sized zero buffer each).
@jax.custom_vjp
def _permute_rows(a_R_, order_S, inverse_R):
  """`a_R_[order_S]`, each row of `a_R_` taken at most once: `inverse_R` the place each row went
  to, -1 for none. A row taken nowhere gets another row's cotangent, not zero: finite, which is
  all the callers' padding rows need (their every use multiplies it by an exact zero: a zero
  input row's matmul outputs, the SwiGLU's derivative there); a zero would cost a select as
  large as the buffer (1 ms per 41,088 x 6,144 in the 744B step)."""
  return a_R_[order_S]


def _permute_rows_fwd(a_R_, order_S, inverse_R):
  return a_R_[order_S], (order_S, inverse_R)


def _permute_rows_bwd(orders, ct_S_):
  order_S, inverse_R = orders
  no_grad = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # integer inputs
  return ct_S_[jnp.maximum(inverse_R, 0)], no_grad(order_S), no_grad(inverse_R)


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _spread_rows(x_MD, token_S, slot_MX, x, sent_MX=None):
  """`[x_MD; 0][token_S]`: each token's row in the slots of its X pairs (`token_S` = m: a zero
  row, the padding); the backward sums a token's X slots (`slot_MX`, token order), gathered.
  With `sent_MX` only the pairs it marks contribute: the others were dropped for capacity, never
  sent, and their cotangent rows are undefined (`_exchange`)."""
  return _with_zero_row(x_MD)[token_S]


def _with_zero_row(x_MD):
  return jnp.concatenate([x_MD, jnp.zeros_like(x_MD[:1])])


def _spread_rows_fwd(x_MD, token_S, slot_MX, x, sent_MX=None):
  return _with_zero_row(x_MD)[token_S], (token_S, slot_MX, sent_MX)


def _spread_rows_bwd(x, res, ct_SD):
  token_S, slot_MX, sent_MX = res
  # X-major, `[X, m, D]`, summed slab by slab (as the combine's sum, `_local_dispatch`).
  ct_XMD = ct_SD[slot_MX.T.reshape(-1)].reshape(*slot_MX.T.shape, ct_SD.shape[-1])
  no_grad = lambda a: None if a is None else np.zeros(a.shape, jax.dtypes.float0)
  ct_MD = _summed_slabs(ct_XMD, None if sent_MX is None else sent_MX.T)
  return ct_MD.astype(ct_SD.dtype), no_grad(token_S), no_grad(slot_MX), no_grad(sent_MX)


_spread_rows.defvjp(_spread_rows_fwd, _spread_rows_bwd)


@jax.custom_vjp
def _combined_rows(ys_SD, slot_XM, token_S, keep_XM=None):
  """fp32 `[m, D]`: each token's X rows `ys_SD[slot_XM[:, t]]` summed, those `keep_XM` marks
  only (None: all), the transpose of `_spread_rows`. Gathered X-major, `[X, m, D]`, and summed
  slab by slab (`_summed_slabs`). Its backward is the spread: each slot gets its token's
  cotangent (`token_S`, m: a zero row), one gather, the slots `keep_XM` leaves out included
  (the caller leaves their cotangents unread). jax's own (the slabs' transposes added into
  `[X, m, D]`, then the gather's inverse permutation) was priced at ~1 ms more per chunk at the
  744B headline."""
  x, m = slot_XM.shape
  return _summed_slabs(ys_SD[slot_XM.reshape(-1)].reshape(x, m, ys_SD.shape[-1]), keep_XM)


def _combined_rows_fwd(ys_SD, slot_XM, token_S, keep_XM=None):
  # The zero-length array carries the rows' dtype to the backward.
  return (_combined_rows(ys_SD, slot_XM, token_S, keep_XM),
          (slot_XM, token_S, keep_XM, jnp.zeros((0,), ys_SD.dtype)))


def _combined_rows_bwd(res, ct_MD):
  slot_XM, token_S, keep_XM, dtype_of = res
  no_grad = lambda a: None if a is None else np.zeros(a.shape, jax.dtypes.float0)
  return (_with_zero_row(ct_MD.astype(dtype_of.dtype))[token_S], no_grad(slot_XM),
          no_grad(token_S), no_grad(keep_XM))


_combined_rows.defvjp(_combined_rows_fwd, _combined_rows_bwd)


def _summed_slabs(a_XMD, keep_XM=None):
  """`sum_k where(keep_XM[k], a_XMD[k], 0)` over the leading X, fp32 `[m, D]`, as a chain
  of X - 1 adds of `[m, D]` slabs, each slab's select beside its add. The TPU compiler priced
  the same sum as one reduce over the major dimension at 0.98 ms per `bf16[8, 4096, 6144]` (the
  744B headline's combine, forward and backward) and a select over the whole `[X, m, D]` (its
  predicate broadcast) at 0.80 ms more; the chain of adds, selects included, at 0.28 ms
  (`tools/price_moe_combine.py`)."""
  total = None
  for k in range(a_XMD.shape[0]):
    slab = a_XMD[k] if keep_XM is None else jnp.where(keep_XM[k][:, None], a_XMD[k], 0)
    total = slab.astype(jnp.float32) if total is None else total + slab
  return total


def _chunked_dispatch(x_MD, weights_MX, experts_MX, counts_1KNE, recv_1KNE, sizes_1NKN,
                      *kernels, chunks, expert_axis, n, d_axes, **kw):
  """`_local_dispatch` of one shard's tokens in `chunks` contiguous, independent passes, with
  the pair counts all of them exchanged first (`_exchanged_counts`). Float kernels arrive on
  their fsdp (`d_axes`) shards, `[E/n, D/d, 2F]` and `[E/n, D/d, F]`, and are gathered here
  before any row moves; each chunk passes them to the next (`grouped_matmul`'s
  `pass_weights`), whose weight gradients its backward accumulates into its own."""
  if d_axes:
    kernels = tuple(jax.lax.all_gather(w, d_axes, axis=1, tiled=True) for w in kernels)
  # The counts were ordered before the shard_map; with them here they would vary over the F
  # axes (`in_order`), and so would the dropped fraction.
  x_MD, weights_MX, experts_MX, kernels = in_order((x_MD, weights_MX, experts_MX, kernels))
  local_experts = counts_1KNE.shape[-1]
  split = lambda a: jnp.split(a, chunks)
  counts = [(counts_1KNE[0, k], recv_1KNE[0, k], sizes_1NKN[0, :, k]) for k in range(chunks)]
  ys, dropped = [], []
  for k, (chunk, counted) in enumerate(zip(zip(split(x_MD), split(weights_MX),
                                               split(experts_MX)), counts)):
    y, d, kernels = _local_dispatch(*chunk, kernels, *counted, expert_axis=expert_axis, n=n,
                                    local_experts=local_experts,
                                    pass_weights=k < chunks - 1, **kw)
    ys.append(y)
    dropped.append(d)
  if chunks == 1:
    return ys[0], dropped[0]
  return jnp.concatenate(ys), sum(dropped)


def _exchanged_counts(experts_MX, *, chunks, n, local_experts, expert_axis):
  """One shard's `(counts_1KNE, recv_1KNE, sizes_1NKN)` for its `chunks` contiguous chunks of
  tokens: chunk k's pairs for device i's expert e, source i's pairs for my expert e, and the
  groups each source sends each destination. Its own shard_map, ahead of the dispatch's: one
  small all-to-all and one all-gather for every chunk together, free to overlap the compute
  before the rows move (the router's, the shared experts'); a chunk's own would queue behind
  the previous chunk's exchange of rows (0.65 s a step exposed in the 744B headline's schedule
  with two chunks)."""
  counts_KNE = jnp.stack([
      jnp.bincount(e.reshape(-1), length=n * local_experts).reshape(n, local_experts)
      for e in jnp.split(experts_MX, chunks)]).astype(jnp.int32)
  recv_KNE = jax.lax.all_to_all(counts_KNE, expert_axis, 1, 1, tiled=True)
  sizes_NKN = jax.lax.all_gather(_groups(counts_KNE).sum(2).reshape(-1), expert_axis).reshape(
      n, chunks, n)  # [source, chunk, destination]
  # A remat policy may keep these (`model.remat_policy` save_selections): a few KiB a layer,
  # and the backward's rerun of the layer then exchanges no counts.
  recv_KNE, sizes_NKN = (checkpoint_name(a, "moe_exchanged_counts")
                         for a in (recv_KNE, sizes_NKN))
  return counts_KNE[None], recv_KNE[None], sizes_NKN[None]


def _local_dispatch(x_MD, weights_MX, experts_MX, kernels, counts_NE, recv_counts_NE, sizes_NN,
                    *, expert_axis, n, local_experts, f_axes, transport, matmul,
                    capacity_factor, pass_weights):
  """One shard: its m tokens, its E/n experts (`E` here is the local count), the exchanged
  counts (`_exchanged_counts`). `kernels`: `(gate_up [E, D, 2F], down [E, D, F])`
  (`_joined_gate_up`), or quantized `(gate, up, down)`, each a `(q, scale)` pair. Returns
  `(y_MD, dropped, kernels)`, the kernels passed on for the next chunk (`pass_weights`). Row
  arrays in groups (`GROUP`) have a G in their name: `[groups, GROUP, D]`; counts of groups end
  in `_g`."""
  m, x = experts_MX.shape
  d = x_MD.shape[-1]
  quantized = len(kernels) == 3
  me = jax.lax.axis_index(expert_axis)
  flat_experts_P = experts_MX.reshape(-1)
  order_P = jnp.argsort(flat_experts_P, stable=True)
  inverse_P = jnp.argsort(order_P)
  groups_NE = _groups(counts_NE)
  send_g_N = groups_NE.sum(1)
  slot_g = _groups(m * min(x, local_experts)) + local_experts  # most one device sends one
  rows_g = n * slot_g
  if capacity_factor:
    cap_g = min(rows_g, _groups(math.ceil(capacity_factor * m * x)) + local_experts)
    # Each destination keeps its sources' groups in source order until `cap_g`; each source's
    # kept groups are a prefix of its (expert-sorted, padded) groups for that destination.
    kept_NN = jnp.clip(cap_g - _exclusive_cumsum(sizes_NN, axis=0), 0, sizes_NN)
    rows_g = cap_g if transport == "ragged_all_to_all" else rows_g
  else:
    kept_NN = sizes_NN
  if transport == "ragged_all_to_all":  # whole row tiles of the grouped matmul: no padding copy
    rows_g = -(-rows_g // _TILE_GROUPS) * _TILE_GROUPS
  keep = lambda groups_NE, kept_N: jnp.clip(kept_N[:, None] - _exclusive_cumsum(groups_NE),
                                            0, groups_NE)
  kept_send_N, kept_recv_N = kept_NN[me], kept_NN[:, me]
  kept_pairs_NE = jnp.minimum(counts_NE, GROUP * keep(groups_NE, kept_send_N))
  recv_groups_NE = keep(_groups(recv_counts_NE), kept_recv_N)
  dropped = (counts_NE - kept_pairs_NE).sum().astype(jnp.float32)

  # The send buffer: (destination, expert) segments in order, each padded to whole groups.
  segment_P = flat_experts_P[order_P]  # = destination * E + local expert, ascending
  rank_P = jnp.arange(m * x) - _exclusive_cumsum(counts_NE.reshape(-1))[segment_P]
  slot_P = GROUP * _exclusive_cumsum(groups_NE.reshape(-1))[segment_P] + rank_P
  buffer_g = _groups(m * x) + n * local_experts
  token_S = jnp.full((GROUP * buffer_g,), m, jnp.int32).at[slot_P].set(order_P // x)
  slot_MX = slot_P[inverse_P].reshape(m, x)
  sent_MX = ((rank_P < kept_pairs_NE.reshape(-1)[segment_P])[inverse_P].reshape(m, x)
             if capacity_factor else None)
  xs_G = _spread_rows(x_MD, token_S, slot_MX, x, sent_MX).reshape(buffer_g, GROUP, d)
  # Each slot's pair (-1: padding, and the slots past the used groups), and the pair's router
  # weight, which travels with its row: the experts scale their SwiGLU output by it before the
  # down projection (below). A dropped pair's weight is zero here, so the undefined cotangent
  # its unsent slot gets back (`_exchange`) is selected away.
  pair_S = jnp.full((GROUP * buffer_g,), -1, jnp.int32).at[slot_MX.reshape(-1)].set(
      jnp.arange(m * x))
  sent_weights_P = (jnp.where(sent_MX, weights_MX, 0) if capacity_factor
                    else weights_MX).reshape(-1)
  ws_G = _with_zero_row(sent_weights_P)[jnp.where(pair_S < 0, m * x, pair_S)].reshape(
      buffer_g, GROUP)
  send_offsets_N = _exclusive_cumsum(send_g_N)

  if transport == "ragged_all_to_all":
    recv_offsets_N = _exclusive_cumsum(kept_recv_N)
    # Where my groups land in each destination's buffer, and where each source's came from.
    dest_offsets_N = _exclusive_cumsum(kept_NN, axis=0)[me]
    source_offsets_N = _exclusive_cumsum(sizes_NN, axis=1)[:, me]

    # Groups from sum(kept_recv_N) on are never written: they sort past the experts' groups.
    def send(a_G):
      into = _uninitialized((rows_g, *a_G.shape[1:]), a_G.dtype, anchor=kept_recv_N)
      return _exchange(a_G, into, send_offsets_N,
                       kept_send_N, dest_offsets_N, kept_recv_N, expert_axis,
                       recv_offsets_N, source_offsets_N)
  else:
    recv_offsets_N = jnp.arange(n, dtype=jnp.int32) * slot_g
    j = jnp.arange(slot_g)

    def send(a_G):
      picked = a_G[jnp.minimum(send_offsets_N[:, None] + j, buffer_g - 1)]
      send_NJ = jnp.where(_per_row(j < kept_send_N[:, None], picked), picked, 0)
      return jax.lax.all_to_all(send_NJ, expert_axis, 0, 0, tiled=True).reshape(
          rows_g, *a_G.shape[1:])
  recv_G = send(xs_G)
  # A remat policy may keep the received weights (`rows_g x GROUP` fp32, ~160 KiB a chunk at the
  # 744B headline): the backward's rerun of the layer then exchanges only the rows.
  recv_w_G = checkpoint_name(send(ws_G), "moe_exchanged_weights")

  # Each received group's local expert: the groups of (source i, expert e) sit contiguously
  # from recv_offsets_N[i] + (source i's groups for experts before e); others get `E`.
  starts_NE = recv_offsets_N[:, None] + _exclusive_cumsum(recv_groups_NE)
  ends = (starts_NE + recv_groups_NE).reshape(-1)
  g = jnp.arange(rows_g)
  segment_G = jnp.searchsorted(ends, g, side="right")
  valid_G = (segment_G < ends.size) & (g >= starts_NE.reshape(-1)[
      jnp.minimum(segment_G, ends.size - 1)])
  expert_G = jnp.where(valid_G, segment_G % local_experts, local_experts)
  order_G = jnp.argsort(expert_G, stable=True)
  inverse_G = jnp.argsort(order_G)
  group_sizes = GROUP * recv_groups_NE.sum(0)  # padding rows included: zeros
  xs_RD = _permute_rows(recv_G, order_G, inverse_G).reshape(GROUP * rows_g, d)  # a bitcast
  # The received weights in the rows' order; the groups no message wrote hold undefined
  # numbers (they sort last): zero weights there.
  w_R = jnp.where(jnp.repeat(valid_G[order_G], GROUP),
                  _permute_rows(recv_w_G, order_G, inverse_G).reshape(-1), 0)[:, None]
  if quantized:  # inference only: the output scaled, the INT8 activations as the reference's
    # Rows past the groups (empty slots) get zero sums; their scale index clipped.
    rows_expert_R = jnp.repeat(jnp.minimum(expert_G[order_G], local_experts - 1), GROUP)
    mm = lambda h, w: ragged_int_matmul(h, *w, group_sizes, rows_expert_R, x_MD.dtype)
    w_gate, w_up, w_down = kernels
    h_RF = jax.nn.silu(mm(xs_RD, w_gate)) * mm(xs_RD, w_up)
    y_RD = (mm(h_RF, w_down) * w_R).astype(x_MD.dtype)
  else:
    # `ragged_dot`, or a grouped-matmul kernel: megablox on TPU, Triton gmm on GPU
    # (`glm5_jax.grouped_matmul`: both compilers run some of `ragged_dot` dense over the
    # experts). The rows past the groups are never read: megablox leaves them unwritten
    # (`tail="undefined"`: no select over its whole result, 0.15 s a step at the 744B
    # headline by the compiler's estimate), in the products and in their input gradients.
    mm = functools.partial(grouped_matmul.grouped_matmul, group_sizes_G=group_sizes,
                           impl=matmul, tail="undefined", pass_weights=pass_weights)
    w_gate_up, w_down = kernels
    gate_up_RF, w_gate_up = mm(xs_RD, w_gate_up) if pass_weights else (mm(xs_RD, w_gate_up),
                                                                       w_gate_up)
    h_RF = _swiglu_joined(gate_up_RF)
    # Scaled before the down projection (linear: the same sum), so the weights' gradient is
    # the rows' dot with the down projection's input gradient, which the backward computes
    # anyway: a remat's rerun of the layer needs neither the down projection nor the exchange
    # back (they were a third of the experts' rerun: 0.57 s a step at the 744B headline).
    scaled_RF = (h_RF * w_R).astype(h_RF.dtype)
    down = functools.partial(mm, transpose_w=True)
    y_RD, w_down = (down(scaled_RF, w_down) if pass_weights
                    else (down(scaled_RF, w_down), w_down))
    kernels = (w_gate_up, w_down)
  ys_G = _permute_rows(y_RD.reshape(rows_g, GROUP, d), inverse_G, order_G)

  if transport == "ragged_all_to_all":
    # Back into the send buffer, dead once sent (the backward never reads it: the exchange is
    # linear), not a fresh zero buffer: that would be another broadcast as large. The groups
    # of dropped pairs are not written and keep their tokens' inputs: masked below.
    ys_G = _exchange(ys_G, jax.lax.stop_gradient(xs_G), recv_offsets_N, kept_recv_N,
                     source_offsets_N, kept_send_N, expert_axis, send_offsets_N, dest_offsets_N)
  else:
    back_NJ = jax.lax.all_to_all(ys_G.reshape(n, slot_g, GROUP, d), expert_axis, 0, 0,
                                 tiled=True)
    b = jnp.arange(buffer_g)
    dest_B = jnp.minimum(jnp.searchsorted(send_offsets_N + send_g_N, b, side="right"), n - 1)
    ys_G = back_NJ[dest_B, jnp.clip(b - send_offsets_N[dest_B], 0, slot_g - 1)]

  # Each token's X expert rows, weighted already, summed. A dropped pair's row holds no expert
  # output and contributes zero; the cotangent its slot gets is never read (no message carried
  # the row: `_exchange`'s backward, or the dense transport's mask, leave it out).
  y_MD = _combined_rows(ys_G.reshape(GROUP * buffer_g, d), slot_MX.T, token_S,
                        sent_MX.T if capacity_factor else None)
  if f_axes:  # partial sums over the F shards
    y_MD = jax.lax.psum(y_MD, f_axes)
  return y_MD.astype(x_MD.dtype), dropped[None], kernels
