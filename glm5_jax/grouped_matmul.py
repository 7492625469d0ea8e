"""The routed experts' grouped matmul: `jax.lax.ragged_dot`, or megablox's `gmm` on TPU.

  y_MN = grouped_matmul(x_MK, w_GKN, group_sizes_G)     # rows [start_g, end_g) times w[g]

Rows past `sum(group_sizes)` (the unused tail of a worst-case-sized receive buffer) come out
zero, as `ragged_dot` defines them.

Why not `ragged_dot` everywhere: the TPU compiler (libtpu 0.0.42.1) writes `ragged_dot`'s
weight gradient as a dense dilated convolution over every group (docs/scaling.md, "Per step"):
with 64 local experts that is 64x the ragged product, 89% of the 744B step's matmul FLOPs.
megablox (`jax.experimental.pallas.ops.tpu.megablox`, a Pallas TPU kernel shipped with jax) has
a `custom_vjp` whose backward is `gmm` (input gradient) and `tgmm` (weight gradient, grouped
over the same rows), so every product is the ragged one.

`impl`: "ragged_dot" | "megablox" | None. None picks megablox when `jax.default_backend()` is
"tpu" (a Mosaic kernel compiles only for TPU; the ahead-of-time planner answers "tpu" while it
traces for a TPU target), else `ragged_dot`. Megablox is a per-device kernel: call it on local
shards (inside `shard_map`, as `glm5_jax.moe_parallel` does); the TPU compiler refuses to
partition a Mosaic kernel. `interpret` (default: off TPU) runs the kernel in the Pallas
interpreter, on any backend (tests).
"""

import jax
import jax.numpy as jnp

IMPLS = ("ragged_dot", "megablox")


def default_impl() -> str:
  return "megablox" if jax.default_backend() == "tpu" else "ragged_dot"


def _lane_tile(k: int, n: int, preferred: int = 512) -> int:
  """One K and N tile for both (k, n multiples of 128): megablox's backward reuses the forward's
  tiling with K and N swapped (`gmm` with `transpose_rhs`), so the tile must fit either."""
  return max(t for t in range(128, preferred + 1, 128) if k % t == 0 and n % t == 0)


def _row_tile(m: int, preferred: int = 512) -> int:
  """The row tile: megablox needs M to be a multiple of it (rows are padded to one); a multiple
  of 16, bf16's sublane tile."""
  return min(preferred, -(-m // 16) * 16)


def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, impl=None, interpret=None):
  """`jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)`, in `x_MK`'s dtype (f32 accumulation).

  Args:
    x_MK: rows sorted by group, `[M, K]`.
    w_GKN: one `[K, N]` matrix per group.
    group_sizes_G: int32 `[G]`, rows per group; their sum may be less than M.
    impl: see the module docstring.
    interpret: megablox only: run the Pallas kernel in the interpreter (default: when the
      backend is not TPU).
  Raises:
    ValueError: an unknown `impl`.
  """
  impl = default_impl() if impl is None else impl
  if impl not in IMPLS:
    raise ValueError(f"grouped_matmul impl: must be one of {IMPLS} or None, got {impl!r}")
  if impl == "ragged_dot":
    return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)
  # Deferred: importing the Pallas TPU ops pulls in Mosaic, which only megablox needs.
  from jax.experimental.pallas.ops.tpu import megablox

  interpret = jax.default_backend() != "tpu" if interpret is None else interpret
  m, k = x_MK.shape
  n = w_GKN.shape[2]
  tm = _row_tile(m)
  # Rows to a multiple of the row tile; K and N to multiples of 128 (a Mosaic block's last
  # dimension is a multiple of 128 or the whole array). Zero padding changes no product.
  pad_m, pad_k, pad_n = -m % tm, -k % 128, -n % 128
  x = jnp.pad(x_MK, ((0, pad_m), (0, pad_k))) if pad_m or pad_k else x_MK
  w = jnp.pad(w_GKN, ((0, 0), (0, pad_k), (0, pad_n))) if pad_k or pad_n else w_GKN
  # One extra group holds the rows past the real groups (and the padding): with more groups in
  # `group_sizes` than in `w`, megablox computes only the first G and zeroes the rest of the
  # output, and its backward's `tgmm` computes the G real weight gradients only.
  sizes = group_sizes_G.astype(jnp.int32)
  sizes = jnp.concatenate([sizes, (m + pad_m - sizes.sum())[None]])
  t = _lane_tile(k + pad_k, n + pad_n)
  y = megablox.gmm(x, w.astype(x.dtype), sizes, x.dtype, (tm, t, t), None, None, False,
                   interpret)
  return y[:m, :n]
