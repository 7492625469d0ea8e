"""Expert parallelism: (token, expert) pairs travel to the devices holding their experts, a
per-shard grouped matmul runs there, and the results travel back (`model.moe_impl =
"expert_parallel"`).

The reference (`glm5_jax.moe.dispatch_experts`) is one global `ragged_dot` with sharding
annotations; with the expert dimension sharded, XLA's partitioner is free to all-gather every
expert's weights. Here the layout is explicit, under `jax.shard_map` over the whole mesh:

  tokens  M   split over the batch axes of the logical rules plus the `expert` axis (so the
              expert-parallel devices are also data-parallel, as in DeepSeek-V3 and MaxText);
  experts E   split over the mesh axis of the `expert` rule; each device holds E/n experts
              (n = that axis' size). The EMBED (fsdp) dimension of the expert kernels enters
              whole, so the only weight all-gather is over fsdp of the local experts' slice.
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
combine with the router weights as the reference (inverse permutation + weighted sum: no
scatter-add, so deterministic). Routing, `expert_counts` and the balance loss stay in
`glm5_jax.moe.MoE`, computed on the global token array exactly as for "ragged".

Shaped for the TPU compiler (docs/scaling.md, "MoE dispatch without the relayouts"): the rows
travel as `[rows, 8, D/8]` slabs, the layout the ragged all-to-all takes as it is (`SLAB`); the
combine receives into the dispatch's used send buffer instead of a fresh zero buffer; the row
permutations differentiate to gathers by the inverse permutation, not scatter-adds into zero
buffers; the dispatch's receive buffer and the exchanges' transposes write into uninitialized
buffers (`jax.lax.empty`, `_exchange`), not zero-filled ones. The rows no message wrote sit past
the grouped matmul's groups (the received rows are a prefix of the buffer), and every grouped
matmul here (ragged_dot, megablox, the Triton gmm) leaves rows past its groups out of every
group's result and weight gradient, whatever they hold: tests/test_moe_parallel.py runs each on
NaN-filled buffers. The grouped matmul sees `[rows, D]`: one relayout each way around it.

Dropless by default, so every buffer is sized for the worst case: a device can receive up to
`n * m * min(X, E/n)` rows (every local token choosing only its experts; m local tokens), n
times the `m * X` rows it receives on average. With `model.moe_capacity_factor` c > 0 a device
receives at most `ceil(c * m * X)` rows (rounded up to 16): each destination takes its sources'
rows in source order, each source's rows in expert order, until full; the rest are dropped (their
expert output is zero, as in GShard / Switch capacity), and the dispatch returns the fraction of
pairs dropped (`moe_dropped_fraction` in the layer's aux and the train metrics). With the
"ragged_all_to_all" transport the receive buffer and the expert matmuls shrink to that many rows;
"all_to_all" drops the same pairs but keeps its dense worst-case slots.
Chunks (`model.moe_dispatch_chunks` = k > 1): each shard's m tokens go through all of the above
in k contiguous chunks of m / k, independent of each other (tokens padded to a multiple of k
shards). A chunk's exchange then has another chunk's grouped matmul to run beside it, which the
compiler's scheduler can overlap with it (one pass leaves it nothing: the exchange, the matmul and
the exchange back depend on each other in turn). Each chunk has its own buffers and capacity
(`ceil(c * m / k * X)` rows), so with a capacity factor the drops are decided per chunk.

Transport (`model.moe_transport`):
  "ragged_all_to_all"  `jax.lax.ragged_all_to_all`: each message is exactly the pairs it
                       carries, so the bytes on the wire are the real `m * X` rows each way;
                       only the receive buffer is worst-case sized. The production choice on
                       TPU and GPU. XLA:CPU (jax 0.10.2) cannot compile it: "UNIMPLEMENTED:
                       HLO opcode `ragged-all-to-all` is not supported by XLA:CPU
                       ThunkEmitter".
  "all_to_all"         `jax.lax.all_to_all` of `[n, m * min(X, E/n), D]` buffers, one
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
from jax.sharding import PartitionSpec

from glm5_jax import grouped_matmul
from glm5_jax.layers import axes as logical_axes
from glm5_jax.quant.linear import ragged_int_matmul
from pallas_kernels.blocking import varying_axes, varying_like

TRANSPORTS = ("ragged_all_to_all", "all_to_all")


context_mesh = logical_axes.context_mesh


def _mesh_axes(rules, logical_name):
  return logical_axes.spec_axes(nn.logical_to_mesh_axes((logical_name,), rules)[0])


def expert_parallel_dispatch(x_MD, weights_MX, experts_MX, w_gate_EDF, w_up_EDF, w_down_EFD,
                             *, transport="ragged_all_to_all", matmul="auto",
                             capacity_factor=0.0, chunks=1, mesh=None, rules=None):
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
  Returns:
    `(y_MD, dropped)`: the mixture in `x_MD`'s dtype, and the fraction of (token, expert) pairs
    dropped for capacity (f32 scalar; 0 when dropless).
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
  kernel_specs = (PartitionSpec(expert_axis, None, f_spec),
                  PartitionSpec(expert_axis, None, f_spec),
                  PartitionSpec(expert_axis, f_spec, None))
  if quantized:  # (q, scale) pairs; the scale's group axis whole (F is, above)
    kernel_specs = tuple((spec, spec) for spec in kernel_specs)
  y_MD, dropped_S = jax.shard_map(
      local, mesh=mesh, in_specs=(tokens, tokens, tokens, *kernel_specs),
      out_specs=(tokens, PartitionSpec(token_axes)),
      # A pallas_call (megablox's, the Triton gmm's) states no varying-axes type for its
      # outputs, which check_vma requires. Without it, shard_map's transpose divides the unmapped
      # output's cotangent by the unmentioned axes' size, so the psum over F's axes still
      # differentiates exactly (tests/moe_parallel_cases.py compares the gradients with the
      # reference).
      check_vma=impl not in ("megablox", "triton_gmm") or quantized)(
          x_MD, weights_MX, experts_MX, w_gate_EDF, w_up_EDF, w_down_EFD)
  return y_MD[:m], dropped_S.sum() / (m * x)


def _exclusive_cumsum(a, axis=-1):
  return jnp.cumsum(a, axis=axis) - a


# Rows travel as `[rows, SLAB, D / SLAB]` slabs. The TPU compiler lays a ragged all-to-all's
# buffers out so that each row is contiguous; a bf16 `[rows, D]` array is tiled 8 rows x 128
# columns (two rows packed per 32-bit word), so it relaid each send and receive buffer out as
# `[rows, 2, D/2]` in (2, 128) tiles, and broadcast each zero receive buffer in that layout: 13 ms
# per 81,920 x 6,144 buffer by its cost model, 72% of the MoE dispatch's cost in the headline
# step (docs/scaling.md, "MoE dispatch without the relayouts"). An `[rows, 8, D/8]` slab in the
# standard (8, 128) tiles has each row contiguous already: the collective takes it as it is, and
# a gather moves whole slabs.
SLAB = 8


def _slabs(a_RD):
  """`[R, D] -> [R, SLAB, D / SLAB]` (unchanged when SLAB does not divide D)."""
  return a_RD if a_RD.shape[-1] % SLAB else a_RD.reshape(a_RD.shape[0], SLAB, -1)


def _rows(a_R_):
  """`_slabs`' inverse: `[R, ...] -> [R, D]`."""
  return a_R_.reshape(a_R_.shape[0], -1)


def _per_row(mask, a):
  """`mask` `[R...]` broadcastable against the row array `a` `[R..., *row]`."""
  return mask.reshape(mask.shape + (1,) * (a.ndim - mask.ndim))


def _uninitialized(shape, dtype):
  """A buffer every read row of which is written first: `jax.lax.empty` (no fill on TPU and GPU;
  zeros elsewhere). The tests make it NaN to show that no unwritten row reaches a result."""
  return jax.lax.empty(shape, dtype)


# The ragged all-to-all's own transpose (jax) sends the cotangents back into a zero buffer of
# the operand's shape: a rows-sized broadcast per exchange in the backward (3.6 ms per 81,920-row
# slab buffer by the TPU compiler's cost model, docs/scaling.md), for rows that are all written
# (a dropless dispatch sends every row), past the grouped matmul's groups (the combine's operand:
# only its first `sum(recv)` rows were sent), or left out of the token gradient's sum (the pairs
# a capacity factor dropped: `_repeat_rows`' `sent_P`).
def _exchange(rows_R_, into_S_, input_offsets_N, send_N, output_offsets_N, recv_N, axis_name):
  """`jax.lax.ragged_all_to_all(rows_R_, into_S_, ...)` whose backward writes into an
  uninitialized buffer: the rows of `rows_R_` that no message carried get undefined cotangents,
  which the caller must leave unread."""
  # The received rows vary over the mesh axes as the sent ones do (shard_map's check_vma types
  # a ragged all-to-all's result as its output buffer).
  into_S_ = varying_like(into_S_, rows_R_)
  return _exchange_vjp(rows_R_, into_S_, input_offsets_N, send_N, output_offsets_N, recv_N,
                       axis_name, varying_axes(rows_R_))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _exchange_vjp(rows_R_, into_S_, input_offsets_N, send_N, output_offsets_N, recv_N,
                  axis_name, varying):
  del varying  # the backward's
  return jax.lax.ragged_all_to_all(rows_R_, into_S_, input_offsets_N, send_N, output_offsets_N,
                                   recv_N, axis_name=axis_name)


def _exchange_fwd(rows_R_, into_S_, input_offsets_N, send_N, output_offsets_N, recv_N,
                  axis_name, varying):
  out = _exchange_vjp(rows_R_, into_S_, input_offsets_N, send_N, output_offsets_N, recv_N,
                      axis_name, varying)
  return out, (rows_R_.shape[0], input_offsets_N, send_N, output_offsets_N, recv_N)


def _exchange_bwd(axis_name, varying, res, ct_S_):
  num_rows, input_offsets_N, send_N, output_offsets_N, recv_N = res
  # The messages reversed: each destination sends back the rows it received from each source
  # (from where they landed, `output_offsets` as the source gave them) to where they came from.
  swap = lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True)
  into_R_ = _uninitialized((num_rows, *ct_S_.shape[1:]), ct_S_.dtype)
  if varying:  # shard_map's type check (check_vma): the cotangent varies as the operand did
    into_R_ = jax.lax.pcast(into_R_, varying, to="varying")
  ct_R_ = jax.lax.ragged_all_to_all(ct_S_, into_R_, swap(output_offsets_N), recv_N,
                                    swap(input_offsets_N), send_N, axis_name=axis_name)
  return ct_R_, None, None, None, None, None


_exchange_vjp.defvjp(_exchange_fwd, _exchange_bwd)


# The dispatch's row gathers are permutations (or, from the tokens, each row repeated X times):
# their backward is a gather by the inverse permutation. jax's transpose of a gather is a
# scatter-add into a zero buffer, which the TPU compiler broadcasts first: four more
# rows-sized zero buffers per layer's backward.
@jax.custom_vjp
def _permute_rows(a_R_, order_R, inverse_R):
  """`a_R_[order_R]`, `order_R` a permutation of the rows and `inverse_R` its inverse."""
  return a_R_[order_R]


def _permute_rows_fwd(a_R_, order_R, inverse_R):
  return a_R_[order_R], (order_R, inverse_R)


def _permute_rows_bwd(orders, ct_R_):
  order_R, inverse_R = orders
  no_grad = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # integer inputs
  return ct_R_[inverse_R], no_grad(order_R), no_grad(inverse_R)


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _repeat_rows(x_M_, order_P, inverse_P, x, sent_P=None):
  """`x_M_[order_P // x]`: each token's row once per chosen expert, in the pairs' sorted order
  `order_P` (`inverse_P` its inverse); the backward sums a token's X rows, gathered. With
  `sent_P` (bool, sorted order) only the pairs it marks contribute to that sum: the others were
  dropped for capacity, never sent, and their cotangent rows are undefined (`_exchange`)."""
  return x_M_[order_P // x]


def _repeat_rows_fwd(x_M_, order_P, inverse_P, x, sent_P=None):
  return x_M_[order_P // x], (order_P, inverse_P, sent_P)


def _repeat_rows_bwd(x, res, ct_P_):
  order_P, inverse_P, sent_P = res
  ct_MX_ = ct_P_[inverse_P].reshape(-1, x, *ct_P_.shape[1:])
  if sent_P is not None:  # a select the compiler fuses into the sum
    ct_MX_ = jnp.where(_per_row(sent_P[inverse_P].reshape(-1, x), ct_MX_), ct_MX_, 0)
  no_grad = lambda a: None if a is None else np.zeros(a.shape, jax.dtypes.float0)
  return (ct_MX_.sum(1, dtype=jnp.float32).astype(ct_P_.dtype), no_grad(order_P),
          no_grad(inverse_P), no_grad(sent_P))


_repeat_rows.defvjp(_repeat_rows_fwd, _repeat_rows_bwd)


def _chunked_dispatch(x_MD, weights_MX, experts_MX, *kernels, chunks, **kw):
  """`_local_dispatch` of one shard's tokens in `chunks` contiguous, independent passes."""
  if chunks == 1:
    return _local_dispatch(x_MD, weights_MX, experts_MX, *kernels, **kw)
  split = lambda a: jnp.split(a, chunks)
  outs = [_local_dispatch(*chunk, *kernels, **kw)
          for chunk in zip(split(x_MD), split(weights_MX), split(experts_MX))]
  return jnp.concatenate([y for y, _ in outs]), sum(d for _, d in outs)


def _local_dispatch(x_MD, weights_MX, experts_MX, w_gate_EDF, w_up_EDF, w_down_EFD, *,
                    expert_axis, n, f_axes, transport, matmul, capacity_factor):
  """One shard: its m tokens, its E/n experts (`E` here is the local count). Row arrays without
  a D in their name (`xs_P`, `recv_R`, `ys_R`, `ys_P`) are `_slabs`: `[rows, SLAB, D / SLAB]`."""
  m, x = experts_MX.shape
  quantized = isinstance(w_gate_EDF, tuple)
  local_experts = (w_gate_EDF[0] if quantized else w_gate_EDF).shape[0]
  me = jax.lax.axis_index(expert_axis)
  flat_experts_P = experts_MX.reshape(-1)
  order_P = jnp.argsort(flat_experts_P, stable=True)
  inverse_P = jnp.argsort(order_P)
  counts_NE = jnp.bincount(flat_experts_P, length=n * local_experts).astype(jnp.int32)
  counts_NE = counts_NE.reshape(n, local_experts)  # my pairs for device k's expert e
  send_N = counts_NE.sum(1)
  send_offsets_N = _exclusive_cumsum(send_N)
  # Row i: source device i's pairs for each of my experts.
  recv_counts_NE = jax.lax.all_to_all(counts_NE, expert_axis, 0, 0, tiled=True)
  slot = m * min(x, local_experts)  # most pairs one device can send one device
  rows = n * slot
  sizes_NN = jax.lax.all_gather(send_N, expert_axis)  # [source, destination]
  if capacity_factor:
    cap = min(rows, -(-math.ceil(capacity_factor * m * x) // 16) * 16)
    # Each destination keeps its sources' rows in source order until `cap`; each source's kept
    # rows are a prefix of its (expert-sorted) rows for that destination.
    kept_NN = jnp.clip(cap - _exclusive_cumsum(sizes_NN, axis=0), 0, sizes_NN)
    keep = lambda counts_NE, kept_N: jnp.clip(
        kept_N[:, None] - _exclusive_cumsum(counts_NE), 0, counts_NE)
    recv_counts_NE = keep(recv_counts_NE, kept_NN[:, me])
    kept_send_N = kept_NN[me]
    rows = cap if transport == "ragged_all_to_all" else rows
  else:
    kept_NN, kept_send_N = sizes_NN, send_N
  dropped = (send_N - kept_send_N).sum().astype(jnp.float32)
  # Each sorted pair's destination device and place among the pairs sent there.
  dest_P = jnp.sort(flat_experts_P) // local_experts
  place_P = jnp.arange(m * x) - send_offsets_N[dest_P]
  sent_P = (place_P < kept_send_N[dest_P]) if capacity_factor else None
  # Sorted by expert, hence by destination device.
  xs_P = _repeat_rows(_slabs(x_MD), order_P, inverse_P, x, sent_P)
  row = xs_P.shape[1:]

  if transport == "ragged_all_to_all":
    recv_N = kept_NN[:, me]
    recv_offsets_N = _exclusive_cumsum(recv_N)
    # Where my rows land in each destination's buffer, and where each source's rows came from.
    dest_offsets_N = _exclusive_cumsum(kept_NN, axis=0)[me]
    source_offsets_N = _exclusive_cumsum(sizes_NN, axis=1)[:, me]
    # Rows from sum(recv_N) on are never written: they sort past the groups (`expert_R` below).
    recv_R = _exchange(xs_P, _uninitialized((rows, *row), xs_P.dtype), send_offsets_N,
                       kept_send_N, dest_offsets_N, recv_N, expert_axis)
  else:
    recv_offsets_N = jnp.arange(n, dtype=jnp.int32) * slot
    j = jnp.arange(slot)
    take_NS = jnp.minimum(send_offsets_N[:, None] + j, m * x - 1)
    picked_NS = xs_P[take_NS]
    send_NS = jnp.where(_per_row(j < kept_send_N[:, None], picked_NS), picked_NS, 0)
    recv_R = jax.lax.all_to_all(send_NS, expert_axis, 0, 0, tiled=True).reshape(rows, *row)

  # Each received row's local expert: rows of (source i, expert e) sit contiguously from
  # recv_offsets_N[i] + (source i's rows for experts before e); rows outside get `local_experts`.
  starts_NE = recv_offsets_N[:, None] + _exclusive_cumsum(recv_counts_NE)
  ends = (starts_NE + recv_counts_NE).reshape(-1)
  r = jnp.arange(rows)
  segment_R = jnp.searchsorted(ends, r, side="right")
  valid_R = (segment_R < ends.size) & (r >= starts_NE.reshape(-1)[
      jnp.minimum(segment_R, ends.size - 1)])
  expert_R = jnp.where(valid_R, segment_R % local_experts, local_experts)
  order_R = jnp.argsort(expert_R, stable=True)
  inverse_R = jnp.argsort(order_R)
  group_sizes = recv_counts_NE.sum(0)
  # The grouped matmul's `[rows, D]`: one relayout each way between it and the slabs.
  xs_RD = _rows(_permute_rows(recv_R, order_R, inverse_R))
  if quantized:  # rows past the groups (empty slots) get zero sums; their scale index clipped
    rows_expert_R = jnp.minimum(expert_R[order_R], local_experts - 1)
    mm = lambda h, w: ragged_int_matmul(h, *w, group_sizes, rows_expert_R, x_MD.dtype)
  else:
    # `ragged_dot`, or a grouped-matmul kernel: megablox on TPU, Triton gmm on GPU
    # (`glm5_jax.grouped_matmul`: both compilers run some of `ragged_dot` dense over the experts).
    mm = functools.partial(grouped_matmul.grouped_matmul, group_sizes_G=group_sizes,
                           impl=matmul)
  h_RF = jax.nn.silu(mm(xs_RD, w_gate_EDF)) * mm(xs_RD, w_up_EDF)
  ys_R = _permute_rows(_slabs(mm(h_RF, w_down_EFD)), inverse_R, order_R)

  if transport == "ragged_all_to_all":
    # Back into the send buffer, dead once sent (the backward never reads it: the exchange is
    # linear), not a fresh zero buffer: that would be another broadcast as large. The rows of
    # dropped pairs are not written and keep their token's input: zeroed below.
    ys_P = _exchange(ys_R, jax.lax.stop_gradient(xs_P), recv_offsets_N, recv_N,
                     source_offsets_N, kept_send_N, expert_axis)
  else:
    back_NS = jax.lax.all_to_all(ys_R.reshape(n, slot, *row), expert_axis, 0, 0, tiled=True)
    ys_P = back_NS[dest_P, place_P]

  # As the reference: inverse permutation, then the weighted sum over a token's X experts.
  ys_MX = _permute_rows(ys_P, inverse_P, order_P).reshape(m, x, *row)
  if capacity_factor:  # a dropped pair's row holds no expert output; it contributes zero
    kept_MX = sent_P[inverse_P].reshape(m, x)
    ys_MX = jnp.where(_per_row(kept_MX, ys_MX), ys_MX, 0)
  mix = "mxsd,mx->msd" if ys_MX.ndim == 4 else "mxd,mx->md"  # slabs, or rows SLAB left whole
  y_M = jnp.einsum(mix, ys_MX.astype(jnp.float32), weights_MX)
  if f_axes:  # partial sums over the F shards
    y_M = jax.lax.psum(y_M, f_axes)
  return _rows(y_M).astype(x_MD.dtype), dropped[None]
