"""Query-block iteration and backend choices shared by the DSA ops.

Every DSA op works on one block of queries at a time so that its temporaries are
O(query_block x keys) or O(query_block x top-k), never O(L x S). These helpers pad the query axis
to a multiple of the block, run a function per block with `lax.map` / `lax.scan`, and strip
the padding again.

Notation: B batch, L queries, Lb queries per block, nL query blocks.
"""

import contextlib
import contextvars
import typing

import jax
import jax.numpy as jnp

# A large finite negative logit for masked slots: softmax arithmetic stays NaN-free even when a
# whole block of slots is masked (exp(MASKED - MASKED) = 1 is then zeroed explicitly).
MASKED_LOGIT = -1e30


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


# Set by `lowering_for`: the platform a program is traced for when it is not this host's.
_LOWERING_PLATFORM = contextvars.ContextVar("lowering_platform", default=None)


@contextlib.contextmanager
def lowering_for(name: str):
  """Trace for platform `name` ("cuda", "rocm", "tpu", "gpu") whatever this host's devices, as
  `jit(...).trace(...).lower(lowering_platforms=(name,))` needs when the kernels are picked by
  platform (tools/flop_ledger.py lowers the GPU train step on a CPU host)."""
  token = _LOWERING_PLATFORM.set("gpu" if name in ("cuda", "rocm") else name)
  try:
    yield
  finally:
    _LOWERING_PLATFORM.reset(token)


def platform() -> str:
  """"tpu", "gpu" or "cpu": where the computation being traced runs.

  `lowering_for`'s platform inside it; else the context mesh's devices (`jax.set_mesh`, as the
  trainer sets it) when there is one, else `jax.default_backend()`. Called at trace time, so it
  is the platform of the jit being built. "cuda" and "rocm" are both "gpu" (jax's own backend
  name for them).
  """
  if (forced := _LOWERING_PLATFORM.get()) is not None:
    return forced
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh is None or mesh.empty else getattr(mesh, "abstract_device", None)
  name = device.platform if device is not None else jax.default_backend()
  return "gpu" if name in ("cuda", "rocm") else name


def pad_axis(x, axis: int, size: int, value):
  """`x` padded at the end of `axis` to `size` with `value` (no-op when already that size)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def to_query_blocks(x_BL, block: int, pad_value):
  """`[B, L, ...]` -> `[nL, B, Lb, ...]` (L padded with `pad_value` to a multiple of `block`)."""
  b, l = x_BL.shape[:2]
  x_BL = pad_axis(x_BL, 1, round_up(l, block), pad_value)
  x_BnLb = x_BL.reshape((b, -1, block) + x_BL.shape[2:])
  return jnp.moveaxis(x_BnLb, 1, 0)


def from_query_blocks(x_nBLb, length: int):
  """Inverse of `to_query_blocks`: `[nL, B, Lb, ...]` -> `[B, length, ...]`."""
  n, b, block = x_nBLb.shape[:3]
  x_BL = jnp.moveaxis(x_nBLb, 0, 1).reshape((b, n * block) + x_nBLb.shape[3:])
  return x_BL[:, :length]


def block_for_budget(bytes_per_query: int, budget_bytes: int = 256 << 20) -> int:
  """Queries per block (a multiple of 8, at least 8) whose temporaries fit `budget_bytes`."""
  return max(8, budget_bytes // max(bytes_per_query, 1) // 8 * 8)


def rows_per_device(batch: int, batch_shards: int) -> int:
  """The batch rows each device holds when XLA's SPMD partitioner splits `batch` rows over
  `batch_shards` devices: what a query-block loop traced with global shapes must size its
  blocks by (each device runs every block on its own rows). Sized by the global batch, the
  744B step's blocks fell to the 8-query minimum (2,048 rows, 1,024 devices): 512 iterations
  a layer, each too small to fill the chip (docs/scaling.md)."""
  if batch_shards < 1:
    raise ValueError(f"batch_shards={batch_shards} must be >= 1 (the devices the batch is "
                     "split over)")
  return -(-batch // batch_shards)


def default_query_block(bytes_per_query: int, cpu_cap: int = 128, accelerator_cap: int = 1024,
                        on_accelerator: bool | None = None):
  """Queries per block when the caller gives none: what fits the temporaries budget (256 MiB on
  CPU, 2 GiB on an accelerator), capped. Small blocks keep CPU work in cache (measured: 128
  queries run the sparse attention ~3x faster than 1024 on CPU); accelerators want more work
  per step. `on_accelerator` None: whether this host's default backend is one (an
  ahead-of-time TPU compile from a CPU host then gets the CPU's blocks; pass
  `platform() != "cpu"` to size for the platform being traced for)."""
  on_cpu = (jax.default_backend() == "cpu") if on_accelerator is None else not on_accelerator
  return min(cpu_cap if on_cpu else accelerator_cap,
             block_for_budget(bytes_per_query, temporaries_budget(not on_cpu)))


def temporaries_budget(on_accelerator: bool) -> int:
  """Bytes a loop's block may hold in temporaries: 256 MiB on CPU, 2 GiB on an accelerator."""
  return (2 << 30) if on_accelerator else (256 << 20)


def query_block_size(length: int, block: int | None) -> int:
  """The query block actually used: `block` clipped to the (8-aligned) query count."""
  if block is None or block >= length:
    return round_up(length, 8)
  return block


# Causal query ranges (`causal_key_ranges`): each a loop over its query blocks with one key
# count. One range per block would form each block's keys exactly, but as a Python loop of
# bodies it compiles one body per block (32 at the 744B headline's 4,096 tokens; the depth-4
# step's compile ran out of this 24 GiB host); 8 ranges form ~9% more logits than that there.
CAUSAL_KEY_RANGES = 8


def causal_key_ranges(l: int, s: int, block: int, causal: bool,
                      key_ranges: int = CAUSAL_KEY_RANGES) -> list:
  """`[(start, stop, keys)]`: at most `key_ranges` runs of whole query blocks of `block` queries,
  and the keys each needs (causal: up to the range's last query; else all S)."""
  if key_ranges < 1:
    raise ValueError(f"key_ranges={key_ranges} must be >= 1 (causal query ranges)")
  if not causal:
    return [(0, l, s)]
  blocks = -(-l // block)
  per_range = -(-blocks // min(key_ranges, blocks)) * block
  return [(start, min(start + per_range, l), min(start + per_range, l, s))
          for start in range(0, l, per_range)]


def map_query_blocks(fn, block: int | None, per_query, pad_values):
  """`fn(*per_query_block) -> pytree of [B, Lb, ...]`, mapped over query blocks.

  Args:
    fn: called on one block of every array in `per_query` (each `[B, Lb, ...]`); whatever it
      closes over (keys, values) is shared by all blocks.
    block: queries per block; None = one block with every query.
    per_query: arrays `[B, L, ...]`, split along L.
    pad_values: per array, the fill for the padded queries (e.g. -1 for top-k slots).
  Returns:
    `fn`'s outputs for every query, `[B, L, ...]`.
  """
  length = per_query[0].shape[1]
  if block is None or block >= length:
    # One block: no loop (no loop overhead or carried state), and unpadded: padding a decode
    # token's one query to 8 made the sparse attention gather and attend 8x the rows (GLM-5
    # shapes: 2.3 GFLOP a layer for 0.29); every `fn` here takes any query count (the Pallas
    # indexer pads to its own tiles).
    return fn(*per_query)
  blocks = [to_query_blocks(x, block, v) for x, v in zip(per_query, pad_values)]
  out = jax.lax.map(lambda xs: fn(*xs), blocks)
  return jax.tree.map(lambda y: from_query_blocks(y, length), out)


def empty_out_of_range(topk_BLT, num_keys: int):
  """`topk_BLT` with every slot outside `[0, num_keys)` set to -1, the empty slot.

  The ops' contract (package docstring): any index outside [0, S) selects nothing, forward and
  backward. Without this a gather would clamp an index >= S to row S - 1 (JAX's default for
  out-of-bounds reads) while the scatter-add of its gradient drops it, so forward and backward
  would disagree; a Pallas DMA would read out of bounds.
  """
  in_range_BLT = (topk_BLT >= 0) & (topk_BLT < num_keys)
  return jnp.where(in_range_BLT, topk_BLT, -1).astype(topk_BLT.dtype)


def op_selection(topk_BLT, q_BLX, k_BSX, causal: bool, op: str):
  """`topk_BLT` as an op over queries `q_BLX` and keys `k_BSX` sees it, once for its forward,
  residuals and backward: slots outside [0, S) empty (`empty_out_of_range`), and with `causal`
  (queries and keys the same L positions, else a ValueError naming `op` and both shapes) slots
  after their query empty too (`empty_after_query`)."""
  l, s = q_BLX.shape[1], k_BSX.shape[1]
  if causal and s != l:
    raise ValueError(f"{op}(causal=True): queries and keys must be the same positions, got "
                     f"L={l} queries ({q_BLX.shape}) and S={s} keys ({k_BSX.shape})")
  topk_BLT = empty_out_of_range(topk_BLT, s)
  return empty_after_query(topk_BLT) if causal else topk_BLT


def empty_after_query(topk_BLT):
  """`topk_BLT` with every slot that selects a key after its query (index > l) set to -1:
  the causal contract when queries and keys are the same L positions."""
  l = topk_BLT.shape[1]
  return jnp.where(topk_BLT <= jnp.arange(l)[None, :, None], topk_BLT, -1)


def gather_rows(x_BS, idx_BLT):
  """`x[b, idx[b, l, t]]`: `[B, S, ...]` -> `[B, L, T, ...]`; callers clamp -1 slots to a valid
  row first (and mask them afterwards)."""
  return jax.vmap(lambda x_S, idx_LT: x_S[idx_LT])(x_BS, idx_BLT)


def varying_axes(a) -> tuple:
  """The manual mesh axes `a` varies over inside `shard_map` (its type under check_vma): the
  aval's `manual_axis_type.varying` (jax >= 0.10), `vma` before."""
  aval = jax.typeof(a)
  mat = getattr(aval, "manual_axis_type", None)
  return tuple(sorted(mat.varying if mat is not None else getattr(aval, "vma", ())))


def varying_like(a, like):
  """`a` typed to vary over the manual mesh axes `like` varies over (no data moves): a buffer
  made inside `shard_map` (zeros, `jax.lax.empty`) that a loop carries with per-device values."""
  missing = tuple(n for n in varying_axes(like) if n not in varying_axes(a))
  return jax.lax.pcast(a, missing, to="varying") if missing else a


class KernelBlocks(typing.NamedTuple):
  """A Pallas kernel step's heads, queries and keys, and whether key blocks wholly after a
  block's queries are skipped (`causal`: queries and keys the same positions)."""

  hb: int
  lb: int
  sb: int
  causal: bool

  def visible(self, i, j):
    """Whether key block j holds a key at or before query block i's last query."""
    return (not self.causal) | (j * self.sb <= (i + 1) * self.lb - 1)

  def last_key_block(self, i, j):
    """Key block j, or for a skipped one the last that query block i needs (no new DMA)."""
    # lax.div: nonnegative operands, and `//`'s floor correction lowers to a `sign` Mosaic
    # prices by asking the host's device kind
    return jnp.minimum(j, jax.lax.div((i + 1) * self.lb - 1, self.sb)) if self.causal else j

  def first_query_block(self, j, i):
    """Query block i, or for a skipped one the first that key block j is visible to."""
    return jnp.maximum(i, jax.lax.div(j * self.sb, self.lb)) if self.causal else i

  def computed(self, l_pad: int, s_pad: int) -> int:
    """How many (query block, key block) steps compute (are not skipped)."""
    nl, ns = l_pad // self.lb, s_pad // self.sb
    return sum(1 for i in range(nl) for j in range(ns)
               if not self.causal or j * self.sb <= (i + 1) * self.lb - 1)
