"""The routed experts' grouped matmul as Pallas Triton (GPU) kernels: `gmm` (forward and input
gradient) and `tgmm` (weight gradient), under a custom VJP, so that no product is ever dense
over the groups.

  y_MN = gmm_triton(x_MK, w_GKN, group_sizes_G)     # y[rows of g] = x[rows of g] @ w[g]

Same contract as `jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)`: rows are sorted by group,
group g owns rows [start_g, end_g) with start_g = sizes_0 + ... + sizes_{g-1}; rows past
`sum(group_sizes)` come out zero and get no gradient. Why a kernel of our own: XLA GPU's
`RaggedDotRewriter` (default flags) runs `ragged_dot` as one dense dot over all G groups with
the other groups' rows masked, G times the FLOPs, forward, input and weight gradient alike
(issue 41; `glm5_jax/planning/flop_ledger.py`).

gmm, grid (N / tn, V) over V = M / tm + G "visits" (megablox's `make_group_metadata` idea):
  1. In XLA, from the group sizes: each group's rows cover the row tiles from `start // tm` to
     `(end - 1) // tm`; a tile straddling a group boundary is visited once per group it holds.
     Visit v carries (row tile, group, [lo, hi) = its group's rows). The rows past the groups
     are one more group, G, whose visits compute nothing and write zeros. A tile holds at most
     one more boundary than its groups, so M / tm + G visits always suffice (Mp / tm + (G + 1)
     - 1, Mp = M padded to tm); the unused ones have an empty row range and store nothing.
  2. A program loads its tile's `[tm, tk]` rows and the group's `[tk, tn]` weight block per K
     step (`[tn, tk]` for the input gradient, `transpose_rhs`: dy `[M, N]` times w[g]^T, so no
     transposed copy of the weights is made) and accumulates `[tm, tn]` in fp32 registers.
  3. It stores only the rows of its group (a masked store): the visits of one tile write
     disjoint rows, so programs running at once never race, and every output row is written
     exactly once (no zero-initialised buffer).
  Work: the useful 2 M K N plus at most one partial tile per group boundary (<= G tm K N each).
tgmm, grid (N / tn, K / tk, G): program (j, k, g) sums `x[rows of g, k-tile]^T dy[rows of g,
  j-tile]` over the group's row tiles (loop bounds from the group's offsets, so an empty group
  runs no iteration and writes zeros), rows of other groups zeroed in both operands (a tail
  row's cotangent may be anything). Work: 2 M K N plus one partial tile per group edge.
Grid order: the fastest axis (N tiles) walks the programs that share a row tile (gmm) or a
group's rows (tgmm), so those rows are read from L2 after the first program.

Padding: M to a multiple of tm, K and N to multiples of their tiles (Triton blocks are powers
of two, each dot operand >= 16 per dim); zero rows and columns change no product, and no
padding happens at GLM-5's shapes (D 6144, F 2048) or the 3B config's (2048, 512).

Checked without a GPU: interpret mode against `ragged_dot` (tests/test_grouped_matmul.py),
the CUDA lowering of the MoE layer (no dense dot over the experts) and Triton's own compile for
sm_90a (tools/check_triton_compile.py: registers, spills, shared memory). Speed is the device
suite's to measure (`expert_mlp_program` in glm5_jax/grouped_matmul.py is what it times).

Notation: M rows (routed pairs), K contracted dim, N output dim, G groups (experts), V visits;
tm, tk, tn tile sizes.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.blocking import pad_axis, round_up

_NT = (((1,), (1,)), ((), ()))  # [m, k] x [n, k] -> [m, n]
_TN = (((0,), (0,)), ((), ()))  # [k, m] x [k, n] -> [m, n]
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GmmOptions:
  """Tiles and launch parameters (keywords of `gmm_triton`); Hopper defaults.

  gmm (forward and input gradient): block_m rows x block_n columns of output per program, K in
    steps of block_k: bf16 `[128, 64] + [64, 128]` per stage, 3 stages = 96 KiB of shared
    memory (of 227 KiB), the `[128, 128]` fp32 accumulator 64 registers a thread at 8 warps.
    A smaller block_m wastes less on the partial tiles at group boundaries (G of them per
    product) but reuses each weight block over fewer rows.
  tgmm (weight gradient): `[tgmm_block_k, tgmm_block_n]` of dw[g] per program, the group's
    rows in steps of tgmm_block_m: bf16 `[64, 128] + [64, 128]` per stage, same budget.
  Tiles are powers of two >= 16; each is cut to the (padded) dimension when that is smaller.
  """

  block_m: int = 128
  block_k: int = 64
  block_n: int = 128
  num_warps: int = 8
  num_stages: int = 3
  tgmm_block_m: int = 64
  tgmm_block_k: int = 128
  tgmm_block_n: int = 128
  tgmm_num_warps: int = 8
  tgmm_num_stages: int = 3
  interpret: bool = False


def _tile(dim: int, preferred: int, name: str) -> int:
  """`preferred` (option `name`), or the smallest power of two >= 16 covering `dim`."""
  if preferred < 16 or preferred & (preferred - 1):
    raise ValueError(f"gmm_triton: {name}={preferred} must be a power of two >= 16 (Triton "
                     "block dims are powers of two; dot operands >= 16)")
  return min(preferred, max(16, 1 << (max(dim, 1) - 1).bit_length()))


def _precision(dtype):
  # fp32 operands: IEEE fp32 dots (Triton's default for fp32 is TF32); bf16 needs nothing.
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def group_bounds(group_sizes_G, rows: int):
  """`(starts_G, ends_G)` int32 of each group's rows, clipped to `rows` (a `ragged_dot` whose
  sizes sum past M computes only the rows that exist)."""
  ends_G = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), rows)
  starts_G = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_G[:-1]])
  return starts_G, ends_G


def tile_visits(group_sizes_G, rows: int, tm: int):
  """The gmm visits (module docstring, step 1): `(tile_V, group_V, lo_V, hi_V)` int32, V =
  rows / tm + G. Group G is the tail past the groups; unused visits have lo = hi = 0."""
  g = group_sizes_G.shape[0]
  starts, ends = group_bounds(group_sizes_G, rows)
  starts = jnp.concatenate([starts, ends[-1:]])  # + the tail group G: [sum, rows)
  ends = jnp.concatenate([ends, jnp.full((1,), rows, jnp.int32)])
  first = starts // tm
  tiles = jnp.where(ends > starts, (ends - 1) // tm - first + 1, 0)
  done = jnp.cumsum(tiles)  # visits of groups <= g
  v = jnp.arange(rows // tm + g, dtype=jnp.int32)
  group = jnp.searchsorted(done, v, side="right").astype(jnp.int32)  # G + 1: unused
  used = group <= g
  gc = jnp.minimum(group, g)
  tile = first[gc] + v - (done[gc] - tiles[gc])
  return (jnp.where(used, tile, 0), gc, jnp.where(used, starts[gc], 0),
          jnp.where(used, ends[gc], 0))


def _gmm_kernel(tile_ref, group_ref, lo_ref, hi_ref, x_ref, w_ref, y_ref, *, tm, tk, tn,
                k_steps, num_groups, transpose_rhs, precision):
  j, v = pl.program_id(0), pl.program_id(1)
  tile, g, lo, hi = tile_ref[v], group_ref[v], lo_ref[v], hi_ref[v]
  rows = pl.ds(tile * tm, tm)
  wg = jnp.minimum(g, num_groups - 1)  # the tail group reads no weights (0 steps below)

  def k_step(kk, acc_MN):
    x_MK = x_ref[rows, pl.ds(kk * tk, tk)]
    if transpose_rhs:  # w[g]^T: the block [tn, tk] of w[g] `[N, K]`
      w_NK = w_ref[wg, pl.ds(j * tn, tn), pl.ds(kk * tk, tk)]
      return acc_MN + jax.lax.dot_general(x_MK, w_NK, _NT, precision=precision,
                                          preferred_element_type=_F32)
    w_KN = w_ref[wg, pl.ds(kk * tk, tk), pl.ds(j * tn, tn)]
    return acc_MN + jnp.dot(x_MK, w_KN, precision=precision, preferred_element_type=_F32)

  # int32 bounds throughout: a Triton `scf.for` takes one integer type for all three.
  zero = jnp.int32(0)
  steps = jnp.where(g < num_groups, jnp.int32(k_steps), zero)
  acc_MN = jax.lax.fori_loop(zero, steps, k_step, jnp.zeros((tm, tn), _F32))
  row_M = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
  mine_MN = (row_M >= lo) & (row_M < hi)
  plgpu.store(y_ref.at[rows, pl.ds(j * tn, tn)], acc_MN.astype(y_ref.dtype), mask=mine_MN)


def _tgmm_kernel(starts_ref, ends_ref, x_ref, dy_ref, dw_ref, *, tm, tk, tn, precision):
  j, kk, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  lo, hi = starts_ref[g], ends_ref[g]

  def row_step(t, acc_KN):
    rows = pl.ds(t * tm, tm)
    row_M = t * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    mine_M1 = (row_M >= lo) & (row_M < hi)
    x_MK = jnp.where(mine_M1, x_ref[rows, pl.ds(kk * tk, tk)], 0)
    dy_MN = jnp.where(mine_M1, dy_ref[rows, pl.ds(j * tn, tn)], 0)
    return acc_KN + jax.lax.dot_general(x_MK, dy_MN, _TN, precision=precision,
                                        preferred_element_type=_F32)

  stop = jnp.where(hi > lo, (hi + tm - 1) // tm, jnp.int32(0))
  acc_KN = jax.lax.fori_loop(jnp.minimum(lo // tm, stop), stop, row_step,
                             jnp.zeros((tk, tn), _F32))
  dw_ref[...] = acc_KN.astype(dw_ref.dtype)


def gmm(lhs_MK, rhs, group_sizes_G, transpose_rhs: bool, opts: GmmOptions):
  """`y[rows of g] = lhs[rows of g] @ rhs[g]` (`rhs[g]^T` with `transpose_rhs`), in lhs's
  dtype; rhs `[G, K, N]` (`[G, N, K]` transposed)."""
  m, k = lhs_MK.shape
  g = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tm = _tile(m, opts.block_m, "block_m")
  tk, tn = _tile(k, opts.block_k, "block_k"), _tile(n, opts.block_n, "block_n")
  mp, kp, np_ = round_up(m, tm), round_up(k, tk), round_up(n, tn)
  lhs = pad_axis(pad_axis(lhs_MK, 0, mp, 0), 1, kp, 0)
  k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
  rhs = pad_axis(pad_axis(rhs.astype(lhs_MK.dtype), k_axis, kp, 0), n_axis, np_, 0)
  visits = tile_visits(group_sizes_G, mp, tm)
  y = pl.pallas_call(
      functools.partial(_gmm_kernel, tm=tm, tk=tk, tn=tn, k_steps=kp // tk, num_groups=g,
                        transpose_rhs=transpose_rhs, precision=_precision(lhs.dtype)),
      out_shape=jax.ShapeDtypeStruct((mp, np_), lhs_MK.dtype),
      grid=(np_ // tn, visits[0].shape[0]),
      in_specs=[pl.no_block_spec] * 6,
      out_specs=pl.no_block_spec,
      compiler_params=plgpu.CompilerParams(num_warps=opts.num_warps,
                                           num_stages=opts.num_stages),
      interpret=opts.interpret,
      name="grouped_matmul_triton_gmm",
  )(*visits, lhs, rhs)
  return y[:m, :n]


def tgmm(x_MK, dy_MN, group_sizes_G, opts: GmmOptions):
  """`dw[g] = x[rows of g]^T dy[rows of g]`, `[G, K, N]` in x's dtype (zero for an empty
  group)."""
  (m, k), n = x_MK.shape, dy_MN.shape[1]
  g = group_sizes_G.shape[0]
  tm = _tile(m, opts.tgmm_block_m, "tgmm_block_m")
  tk = _tile(k, opts.tgmm_block_k, "tgmm_block_k")
  tn = _tile(n, opts.tgmm_block_n, "tgmm_block_n")
  mp, kp, np_ = round_up(m, tm), round_up(k, tk), round_up(n, tn)
  x = pad_axis(pad_axis(x_MK, 0, mp, 0), 1, kp, 0)
  dy = pad_axis(pad_axis(dy_MN.astype(x_MK.dtype), 0, mp, 0), 1, np_, 0)
  starts, ends = group_bounds(group_sizes_G, m)
  dw = pl.pallas_call(
      functools.partial(_tgmm_kernel, tm=tm, tk=tk, tn=tn, precision=_precision(x.dtype)),
      out_shape=jax.ShapeDtypeStruct((g, kp, np_), x_MK.dtype),
      grid=(np_ // tn, kp // tk, g),
      in_specs=[pl.no_block_spec] * 4,
      out_specs=pl.BlockSpec((None, tk, tn), lambda j, kk, gi: (gi, kk, j)),
      compiler_params=plgpu.CompilerParams(num_warps=opts.tgmm_num_warps,
                                           num_stages=opts.tgmm_num_stages),
      interpret=opts.interpret,
      name="grouped_matmul_triton_tgmm",
  )(starts, ends, x, dy)
  return dw[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x_MK, w_GKN, group_sizes_G, opts):
  return gmm(x_MK, w_GKN, group_sizes_G, False, opts)


def _grouped_forward(x_MK, w_GKN, group_sizes_G, opts):
  return gmm(x_MK, w_GKN, group_sizes_G, False, opts), (x_MK, w_GKN, group_sizes_G)


def _grouped_backward(opts, residuals, dy_MN):
  x_MK, w_GKN, group_sizes_G = residuals
  dy_MN = dy_MN.astype(x_MK.dtype)
  dx_MK = gmm(dy_MN, w_GKN, group_sizes_G, True, opts)  # rows past the groups: zero
  dw_GKN = tgmm(x_MK, dy_MN, group_sizes_G, opts).astype(w_GKN.dtype)
  return dx_MK, dw_GKN, None


_grouped.defvjp(_grouped_forward, _grouped_backward)


def gmm_triton(x_MK, w_GKN, group_sizes_G, *, interpret: bool = False, **options):
  """`jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)` on the kernels of the module docstring,
  differentiable in x and w (custom VJP: gmm, gmm with w transposed, tgmm).

  Args:
    x_MK: rows sorted by group.
    w_GKN: one `[K, N]` matrix per group; cast to x's dtype (one element type per Triton dot).
    group_sizes_G: int `[G]`, rows per group; their sum may be less than M.
    interpret: run the kernels in Pallas interpret mode (CPU tests).
    options: `GmmOptions` fields (tiles, warps, stages).
  Returns:
    `[M, N]` in x's dtype (fp32 accumulation); zero past `sum(group_sizes)`.
  """
  if x_MK.ndim != 2 or w_GKN.ndim != 3 or group_sizes_G.ndim != 1:
    raise ValueError(f"gmm_triton: expected x [M, K], w [G, K, N], group_sizes [G], got "
                     f"{x_MK.shape}, {w_GKN.shape}, {group_sizes_G.shape}")
  if w_GKN.shape[1] != x_MK.shape[1] or w_GKN.shape[0] != group_sizes_G.shape[0]:
    raise ValueError(f"gmm_triton: x {x_MK.shape}, w {w_GKN.shape} and group_sizes "
                     f"{group_sizes_G.shape} disagree on K or G")
  fields = {f.name for f in dataclasses.fields(GmmOptions)} - {"interpret"}
  unknown = set(options) - fields
  if unknown:
    raise TypeError(f"gmm_triton: unknown options {sorted(unknown)}; expected some of "
                    f"{sorted(fields)}")
  opts = GmmOptions(interpret=interpret, **options)
  return _grouped(x_MK, w_GKN.astype(x_MK.dtype), group_sizes_G.astype(jnp.int32), opts)

