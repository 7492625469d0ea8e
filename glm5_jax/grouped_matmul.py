"""The routed experts' grouped matmul: `jax.lax.ragged_dot`, megablox's `gmm` on TPU, or our
Pallas Triton `gmm` on GPU.

  y_MN = grouped_matmul(x_MK, w_GKN, group_sizes_G)     # rows [start_g, end_g) times w[g]

Rows past `sum(group_sizes)` (the unused tail of a worst-case-sized receive buffer) come out
zero, as `ragged_dot` defines them; with `tail="undefined"` they (and the same rows of the input
gradient) may hold anything, for a caller that never reads them: megablox is then given exactly
the G real groups, so its dynamic grid visits only their row tiles and writes nothing else,
instead of zeroing the tail in a pass of its own over the whole output
(`_zero_uninitialized_memory`; 744B TPU step: a `[41,472, 6,144]` select after each down
projection, 0.15 s a step by the compiler's estimate).

`pass_weights=True` returns `(y_MN, w_GKN)`: the weights as they were, for the next use of the
same weights (the next dispatch chunk's grouped matmul in `glm5_jax.moe_parallel`), whose weight
gradient the backward then adds into this one's. With megablox (no K or N padding) the add is
the `tgmm` kernel's own: it accumulates into the next use's gradient (`existing_out`, written in
place) instead of a separate add of two `[G, K, N]` gradients after it; elsewhere it is jax's sum.
`transpose_w=True` takes the weights as `[G, N, K]` (the MoE's down projection, gathered over
its D dimension the way gate and up are: `glm5_jax.moe_parallel`).

Why not `ragged_dot` everywhere: the TPU compiler (libtpu 0.0.42.1) writes `ragged_dot`'s
weight gradient as a dense dilated convolution over every group (docs/scaling.md, "Per step"):
with 64 local experts that is 64x the ragged product, 89% of the 744B step's matmul FLOPs.
megablox (`jax.experimental.pallas.ops.tpu.megablox`, a Pallas TPU kernel shipped with jax) has
a `custom_vjp` whose backward is `gmm` (input gradient) and `tgmm` (weight gradient, grouped
over the same rows), so every product is the ragged one.

Why not `ragged_dot` on GPU: at default flags XLA GPU's `RaggedDotRewriter` (openxla/xla
`ragged_dot_rewriter.cc`) runs it as one dense dot over all G groups with the other groups' rows
masked, forward, input gradient and weight gradient alike: G times the FLOPs (32x in
configs/glm5_gpu_3b.py, 49% of its step's matmul FLOPs; issue 41, tools/flop_ledger.py).
"triton_gmm" (`pallas_kernels.grouped_matmul_triton`) is a grouped matmul of our own for GPUs,
with a custom VJP of the same kind as megablox's: gmm forward, gmm with the weights transposed
for the input gradient, tgmm for the weight gradient; every product is the ragged one.

`impl`: "ragged_dot" | "megablox" | "triton_gmm" | None. None = `default_impl()`: the
platform being traced for (`pallas_kernels.blocking.platform()`: the context mesh's devices,
`jax.default_backend()`, or the platform `blocking.lowering_for` names when a CPU host lowers
for another; the ahead-of-time planner makes `jax.default_backend()` answer "tpu" while it
traces for a TPU target) picks megablox on TPU (a Mosaic kernel compiles only for TPU),
triton_gmm on GPU, `ragged_dot` elsewhere. Both kernels are per-device: call them on local
shards (inside `shard_map`, as `glm5_jax.moe_parallel` does) or on arrays of one device; XLA
has no partitioning rule for a Pallas custom call (the TPU compiler refuses one; on GPUs its
operands would have to be replicated). `global_impl()` is the choice for global arrays (`moe.dispatch_experts`).
`interpret` (default: off the kernel's platform) runs a kernel in the Pallas interpreter, on any
backend (tests).

`expert_mlp_program` is one routed-expert SwiGLU forward + backward at given shapes, what the
device suite times per impl (issue 41, item 5: `moe_matmul`).
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import blocking

IMPLS = ("ragged_dot", "megablox", "triton_gmm")
TAILS = ("zero", "undefined")
_KERNEL_PLATFORM = {"megablox": "tpu", "triton_gmm": "gpu"}


def default_impl() -> str:
  """For per-device arrays: megablox on TPU, triton_gmm on GPU, else ragged_dot."""
  platform = blocking.platform()
  return next((impl for impl, p in _KERNEL_PLATFORM.items() if p == platform), "ragged_dot")


def global_impl() -> str:
  """For global (possibly sharded) arrays: triton_gmm on a GPU when the context mesh has at
  most one device, else ragged_dot, which XLA partitions (a Pallas custom call it cannot). TPU
  keeps ragged_dot here: its grouped matmul runs expert-parallel (`model.moe_impl`)."""
  mesh = jax.sharding.get_abstract_mesh()
  one_device = mesh is None or mesh.empty or mesh.size <= 1
  return "triton_gmm" if one_device and blocking.platform() == "gpu" else "ragged_dot"


def _lane_tile(k: int, n: int, preferred: int = 512) -> int:
  """One K and N tile for both (k, n multiples of 128): megablox's backward reuses the forward's
  tiling with K and N swapped (`gmm` with `transpose_rhs`), so the tile must fit either."""
  return max(t for t in range(128, preferred + 1, 128) if k % t == 0 and n % t == 0)


def _row_tile(m: int, preferred: int = 512) -> int:
  """The row tile: megablox needs M to be a multiple of it (rows are padded to one); a multiple
  of 16, bf16's sublane tile."""
  return min(preferred, -(-m // 16) * 16)


def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, impl=None, interpret=None, tail="zero",
                   pass_weights=False, transpose_w=False):
  """`jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)`, in `x_MK`'s dtype (f32 accumulation).

  Args:
    x_MK: rows sorted by group, `[M, K]`.
    w_GKN: one `[K, N]` matrix per group; with `transpose_w`, `[G, N, K]`: each group's matrix
      transposed, multiplied as `x @ w[g].T` (megablox reads it so; its weight gradient comes
      out `[G, N, K]` from `tgmm` directly).
    group_sizes_G: int32 `[G]`, rows per group; their sum may be less than M.
    impl: see the module docstring.
    interpret: megablox and triton_gmm: run the Pallas kernel in the interpreter (default: when
      the platform is not the kernel's).
    tail: "zero" (the rows past the groups' sum are zero, as `ragged_dot`'s) or "undefined"
      (they, and those rows of the gradient in `x_MK`, are not written: leave them unread).
    pass_weights: return `(y_MN, w_GKN)`, the weights for their next use (module docstring).
    transpose_w: see `w_GKN`.
  Returns:
    `y_MN`, or with `pass_weights` `(y_MN, w_GKN)` (w in `x_MK`'s dtype for the kernels).
  Raises:
    ValueError: an unknown `impl` or `tail`.
  """
  impl = default_impl() if impl is None else impl
  if impl not in IMPLS:
    raise ValueError(f"grouped_matmul impl: must be one of {IMPLS} or None, got {impl!r}")
  if tail not in TAILS:
    raise ValueError(f"grouped_matmul tail: must be one of {TAILS}, got {tail!r}")
  as_gkn = lambda w: w.swapaxes(1, 2) if transpose_w else w
  if impl == "ragged_dot":
    y = jax.lax.ragged_dot(x_MK, as_gkn(w_GKN), group_sizes_G)
    return (y, w_GKN) if pass_weights else y
  interpret = blocking.platform() != _KERNEL_PLATFORM[impl] if interpret is None else interpret
  if impl == "triton_gmm":
    # Deferred, like the DSA's GPU kernels: only a GPU program needs the Triton module.
    from pallas_kernels import grouped_matmul_triton
    y = grouped_matmul_triton.gmm_triton(x_MK, as_gkn(w_GKN), group_sizes_G,
                                         interpret=interpret)
    return (y, w_GKN) if pass_weights else y
  # Deferred: importing the Pallas TPU ops pulls in Mosaic, which only megablox needs.
  from jax.experimental.pallas.ops.tpu import megablox

  m, k = x_MK.shape
  n = w_GKN.shape[1 if transpose_w else 2]
  tm = _row_tile(m)
  # Rows to a multiple of the row tile; K and N to multiples of 128 (a Mosaic block's last
  # dimension is a multiple of 128 or the whole array). Zero padding changes no product.
  pad_m, pad_k, pad_n = -m % tm, -k % 128, -n % 128
  x = jnp.pad(x_MK, ((0, pad_m), (0, pad_k))) if pad_m or pad_k else x_MK
  pad_w = ((0, 0), (0, pad_n), (0, pad_k)) if transpose_w else ((0, 0), (0, pad_k), (0, pad_n))
  w = jnp.pad(w_GKN, pad_w) if pad_k or pad_n else w_GKN
  sizes = group_sizes_G.astype(jnp.int32)
  if tail == "zero":
    # One extra group holds the rows past the real groups (and the padding): with more groups
    # in `group_sizes` than in `w`, megablox computes only the first G and zeroes the rest of
    # the output, and its backward's `tgmm` computes the G real weight gradients only.
    sizes = jnp.concatenate([sizes, (m + pad_m - sizes.sum())[None]])
  t = _lane_tile(k + pad_k, n + pad_n)
  tiling = (tm, t, t)
  w = w.astype(x.dtype)
  if pad_k or pad_n:  # megablox's own VJP (its `[G, N, K]` gradient a transpose of tgmm's)
    y = megablox.gmm(x, w, sizes, x.dtype, tiling, None, None, transpose_w, interpret)
    passed = w_GKN.astype(x.dtype)
  elif pass_weights:
    y, passed = _gmm_passing_weights(x, w, sizes, tiling, interpret, transpose_w)
  else:
    y = _gmm(x, w, sizes, tiling, interpret, transpose_w)
  y = y[:m, :n]
  return (y, passed) if pass_weights else y


# megablox's kernels under VJPs of our own: `megablox.gmm`'s custom VJP takes no gradient to
# accumulate into (`tgmm`'s `existing_out`), and with the weights transposed it transposes the
# weight gradient `tgmm` gives, a copy of it, where `tgmm` can give it `[G, N, K]` itself.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(x_MK, w, sizes, tiling, interpret, transpose_w):
  """megablox's `gmm` (`w` `[G, K, N]`, or `[G, N, K]` with `transpose_w`)."""
  return _megablox_kernels().gmm(x_MK, w, sizes, x_MK.dtype, tiling, None, None,
                                 transpose_rhs=transpose_w, interpret=interpret)


def _gmm_forward(x_MK, w, sizes, tiling, interpret, transpose_w):
  return _gmm(x_MK, w, sizes, tiling, interpret, transpose_w), (x_MK, w, sizes)


def _gmm_backward(tiling, interpret, transpose_w, residuals, dy_MN):
  return _gmm_gradients(residuals, dy_MN, None, tiling, interpret, transpose_w)


_gmm.defvjp(_gmm_forward, _gmm_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm_passing_weights(x_MK, w, sizes, tiling, interpret, transpose_w):
  """`(_gmm(...), w)`: the backward's `tgmm` accumulates into the passed weights' cotangent."""
  return _gmm(x_MK, w, sizes, tiling, interpret, transpose_w), w


def _gmm_passing_weights_forward(x_MK, w, sizes, tiling, interpret, transpose_w):
  out = _gmm_passing_weights(x_MK, w, sizes, tiling, interpret, transpose_w)
  return out, (x_MK, w, sizes)


def _gmm_passing_weights_backward(tiling, interpret, transpose_w, residuals, cotangents):
  dy_MN, dw_next = cotangents
  return _gmm_gradients(residuals, dy_MN, dw_next, tiling, interpret, transpose_w)


_gmm_passing_weights.defvjp(_gmm_passing_weights_forward, _gmm_passing_weights_backward)


def _gmm_gradients(residuals, dy_MN, dw_into, tiling, interpret, transpose_w):
  """`(dx_MK, dw, no gradient for the sizes)`: `gmm` with the weights' other orientation, and
  `tgmm` over the same groups, added into `dw_into` (or not: None). With `transpose_w` the
  weight gradient `[G, N, K]` is `tgmm(dy^T, x)`."""
  x_MK, w, sizes = residuals
  kernels = _megablox_kernels()
  dx_MK = kernels.gmm(dy_MN, w, sizes, x_MK.dtype, tiling, None, None,
                      transpose_rhs=not transpose_w, interpret=interpret)
  lhs, rhs = (dy_MN, x_MK) if transpose_w else (x_MK, dy_MN)
  existing = None if dw_into is None else dw_into.astype(w.dtype)
  dw = kernels.tgmm(lhs.swapaxes(0, 1), rhs, sizes, w.dtype, tiling, None, w.shape[0],
                    existing_out=existing, interpret=interpret)
  return dx_MK, dw, np.zeros(sizes.shape, jax.dtypes.float0)


def _megablox_kernels():
  # The kernels themselves, without `megablox.gmm`'s custom VJP.
  return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def expert_mlp(x_PD, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E, impl=None):
  """The routed experts' SwiGLU on rows sorted by expert (`moe.dispatch_experts`' middle):
  `down(silu(x @ gate) * (x @ up))` per group, three grouped matmuls. Returns `[P, D]`."""
  mm = lambda h, w: grouped_matmul(h, w, group_sizes_E, impl=impl)
  return mm(jax.nn.silu(mm(x_PD, w_gate_EDF)) * mm(x_PD, w_up_EDF), w_down_EFD)


def uneven_group_sizes(rows: int, groups: int, seed: int = 0):
  """int32 `[groups]` summing to `rows`, as uneven as a young router's loads (Dirichlet(1)
  shares: some groups several times the mean, some near empty)."""
  shares = np.random.default_rng(seed).dirichlet(np.ones(groups))
  sizes = np.floor(shares * rows).astype(np.int64)
  sizes[np.argmax(sizes)] += rows - sizes.sum()
  return jnp.asarray(sizes, jnp.int32)


def expert_mlp_program(impl=None, *, rows=32768, hidden=2048, intermediate=512, experts=32,
                       dtype=jnp.bfloat16, seed=0):
  """`(fn, args, useful_flops)`: a jitted forward + backward of `expert_mlp` (the gradients of
  a sum, in x and the three weights) on random inputs, for timing impls side by side (device
  suite). Defaults: configs/glm5_gpu_3b.py's MoE (2 x 4096 tokens x top-4 rows, D 2048, F 512,
  32 experts). Useful FLOPs: 9 grouped products (3 forward, 3 input and 3 weight gradients) of
  2 P D F each, what a grouped matmul does (a dense expansion does `experts` times more)."""
  kx, kg, ku, kd = jax.random.split(jax.random.key(seed), 4)
  scale = hidden ** -0.5
  args = (jax.random.normal(kx, (rows, hidden), dtype),
          (jax.random.normal(kg, (experts, hidden, intermediate)) * scale).astype(dtype),
          (jax.random.normal(ku, (experts, hidden, intermediate)) * scale).astype(dtype),
          (jax.random.normal(kd, (experts, intermediate, hidden))
           * intermediate ** -0.5).astype(dtype),
          uneven_group_sizes(rows, experts, seed))

  def loss(x, wg, wu, wd, sizes):
    return expert_mlp(x, wg, wu, wd, sizes, impl=impl).astype(jnp.float32).sum()

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
  return fn, args, 9 * 2.0 * rows * hidden * intermediate
