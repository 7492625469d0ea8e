"""The LM head fused with the cross-entropy's statistics, chunked over the sequence, so no
`[B, L, Y]` logits (nor their fp32 cotangent) exist, forward or backward (`train.ce_chunk`).

The logits path (`GLM5`'s fp32 `logits`, then `losses.cross_entropy`) holds `[tokens, Y]` fp32
logits for the backward and differentiates an fp32 einsum: the head's two backward matmuls take
an fp32 cotangent (TF32 on a GPU, half the bf16 rate) and, for the 3B config at 2 x 4,096
tokens, Y = 154,880, ~5 GB of fp32 logits per head (issue 41, docs/performance.md). Here
`head_statistics` computes, per position, `log Z = logsumexp(h W)`, the target's logit and the
argmax, one `[B, C, Y]` chunk of logits at a time (a `lax.scan` over L / C chunks), and saves
only `h`, `W` and `log Z` for its custom VJP. The backward recomputes each chunk's logits and
forms

    d logits = g_logZ * softmax(logits) + g_target * onehot(target)      (fp32, [B, C, Y])

cast to the compute dtype (bf16) for `dh = d logits W^T` and `dW += h^T d logits` (fp32
accumulation): the cotangent is bf16, as the forward's operands. The loss formulas stay in
`losses` on `[B, L]` vectors, so CE, z-loss and accuracy are the logits path's to rounding
(tests/test_losses_fused.py).

`loss_with_gradients` (`train.ce_grad_in_forward`) goes one step further where the loss's
per-position cotangents are known before the backward: a weighted sum over heads and positions

    loss = sum_k sum_i a_ki (log Z_ki - logit_ki[target]) + b_ki log Z_ki^2

(`a` the CE weights with the mean's denominator and the head's coefficient folded in, `b` the
z-loss's) has `d loss / d logits = (a + 2 b log Z) softmax - a onehot(target)` once the forward
knows `log Z`. So its forward forms, per chunk, the logits once and from them `dh` and the `dW`
accumulation, and saves those: the backward only scales them by the scalar cotangent. Three
`2 B L D Y` matmuls per head instead of four (the logits are not recomputed), at a memory cost:
`dW` `[D, Y]` (the kernel's dtype; 0.63 GB bf16 at D 2,048, Y 154,880) and every head's `dh`
(as `h`) live from the forward to the backward, where the other form keeps `h` and `W` (which
live anyway) and `log Z`; during the forward the fp32 `dW` accumulator (1.27 GB) is live
beside the chunk's logits. Every head sharing the kernel (the main head, the MTP depths)
accumulates into one `dW`, so the loss is one scalar over all of them.

Chunks run along L, not over flattened tokens, so each chunk keeps the batch axis's sharding.
On a mesh (`jax.set_mesh`, as the trainer sets it) the chunk loops run per device under
`jax.shard_map` on the device's own rows (`_RowSplit`): the kernel is gathered once and the rows'
dW reduced once, at the end, not in every chunk as XLA's partitioner ran them.

Notation: B batch, L sequence (C a chunk of it), D hidden, Y vocab.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from glm5_jax.layers import axes as axes_lib
from glm5_jax.layers import ordering


def head_statistics(h_BLD, w_DY, targets_BL, chunk: int):
  """`(log_z_BL, target_logit_BL, argmax_BL)` of the logits `h_BLD @ w_DY`, fp32 (argmax
  int32), computed `chunk` positions at a time; differentiable in `h_BLD` and `w_DY` (module
  docstring). The matmuls run in the operands' dtype with fp32 accumulation, as `GLM5`'s head.

  Args:
    h_BLD: the head's input (compute dtype; NaN rows stay NaN, as in the logits path).
    w_DY: the head's kernel (compute dtype).
    targets_BL: int token ids in `[0, Y)`.
    chunk: positions per chunk (>= 1); L is padded up to a multiple of it.
  """
  return _statistics(chunk, h_BLD, w_DY, targets_BL)


def _chunks(x_BL_, chunk: int):
  """`[B, L, ...]` -> `[L / C, B, C, ...]`, the scan axis first (L zero-padded to C's multiple)."""
  b, l = x_BL_.shape[:2]
  n = -(-l // chunk)
  x = jnp.pad(x_BL_, [(0, 0), (0, n * chunk - l)] + [(0, 0)] * (x_BL_.ndim - 2))
  return jnp.moveaxis(x.reshape((b, n, chunk) + x_BL_.shape[2:]), 1, 0)


def _unchunk(x_NBC_, length: int):
  """Inverse of `_chunks`: `[L / C, B, C, ...]` -> `[B, L, ...]`."""
  x = jnp.moveaxis(x_NBC_, 0, 1)
  return x.reshape((x.shape[0], -1) + x.shape[3:])[:, :length]


def _chunk_logits(h_BCD, w_DY):
  return jnp.einsum("bcd,dy->bcy", h_BCD, w_DY, preferred_element_type=jnp.float32)


def _head_cotangents(h_BCD, w_DY, probs_BCY, t_BC, g_log_z_BC, g_target_BC):
  """`(dh_BCD, dw_DY)` of one chunk (dh in h's dtype, dW fp32) for the logits cotangent
  `g_log_z softmax + g_target onehot(target)`, cast to the kernel's dtype for both matmuls."""
  onehot_BCY = jax.nn.one_hot(t_BC, w_DY.shape[1], dtype=jnp.float32)
  d_BCY = (g_log_z_BC[..., None] * probs_BCY + g_target_BC[..., None] * onehot_BCY
           ).astype(w_DY.dtype)
  # Written once (`ordering.in_order`): left to fuse, the TPU compiler recomputed it from the
  # fp32 logits inside both products below, the dW product at half the matrix unit's peak
  # by its own estimate (docs/scaling.md).
  (d_BCY,) = ordering.in_order((d_BCY,))
  dh_BCD = jnp.einsum("bcy,dy->bcd", d_BCY, w_DY, preferred_element_type=jnp.float32)
  dw_DY = jnp.einsum("bcd,bcy->dy", h_BCD, d_BCY, preferred_element_type=jnp.float32)
  return dh_BCD.astype(h_BCD.dtype), dw_DY


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _statistics(chunk, h_BLD, w_DY, targets_BL):
  return _forward(chunk, h_BLD, w_DY, targets_BL)[0]


def _forward(chunk, h_BLD, w_DY, targets_BL):
  mesh = axes_lib.context_mesh()
  if mesh is None:
    stats = _statistics_on_rows(chunk, h_BLD, w_DY, targets_BL)
  else:
    split = _RowSplit.of(mesh, [h_BLD.shape], w_DY.shape[0])
    stats = jax.shard_map(functools.partial(_statistics_on_rows, chunk), mesh=mesh,
                          in_specs=(split.hidden[0], P(), split.rows[0]),
                          out_specs=(split.rows[0],) * 3,
                          check_vma=False)(h_BLD, w_DY, targets_BL)
  return stats, (h_BLD, w_DY, targets_BL, stats[0])


def _statistics_on_rows(chunk, h_BLD, w_DY, targets_BL):
  def body(_, xs):
    h_BCD, t_BC = xs
    logits_BCY = _chunk_logits(h_BCD, w_DY)
    log_z_BC = jax.nn.logsumexp(logits_BCY, axis=-1)
    target_BC = jnp.take_along_axis(logits_BCY, t_BC[..., None], axis=-1)[..., 0]
    return None, (log_z_BC, target_BC, jnp.argmax(logits_BCY, axis=-1).astype(jnp.int32))

  _, stats = jax.lax.scan(body, None, (_chunks(h_BLD, chunk), _chunks(targets_BL, chunk)))
  return tuple(_unchunk(s, h_BLD.shape[1]) for s in stats)


def _backward(chunk, residuals, cotangents):
  h_BLD, w_DY, targets_BL, log_z_BL = residuals
  g_log_z_BL, g_target_BL, _ = cotangents  # argmax: integer, no cotangent
  args = h_BLD, w_DY, targets_BL, log_z_BL, g_log_z_BL, g_target_BL
  mesh = axes_lib.context_mesh()
  if mesh is None:
    dh_BLD, dw_DY = _backward_on_rows(chunk, *args)
  else:
    split = _RowSplit.of(mesh, [h_BLD.shape], w_DY.shape[0])

    def run(*args):
      dh_BLD, dw_DY = _backward_on_rows(chunk, *args)
      return dh_BLD, split.reduce(dw_DY)

    dh_BLD, dw_DY = jax.shard_map(
        run, mesh=mesh, in_specs=(split.hidden[0], P()) + (split.rows[0],) * 4,
        out_specs=(split.hidden[0], split.kernel), check_vma=False)(*args)
  return dh_BLD, dw_DY.astype(w_DY.dtype), None


def _backward_on_rows(chunk, h_BLD, w_DY, targets_BL, log_z_BL, g_log_z_BL, g_target_BL):
  """`(dh, dW)` of the rows given (dW fp32: these rows' sum)."""

  def body(dw_DY, xs):
    h_BCD, t_BC, log_z_BC, g_z_BC, g_t_BC = xs
    probs_BCY = jnp.exp(_chunk_logits(h_BCD, w_DY) - log_z_BC[..., None])
    dh_BCD, dw_chunk_DY = _head_cotangents(h_BCD, w_DY, probs_BCY, t_BC, g_z_BC, g_t_BC)
    return dw_DY + dw_chunk_DY, dh_BCD

  # Padded positions have zero cotangents, so they add nothing to dW.
  xs = tuple(_chunks(x, chunk) for x in (h_BLD, targets_BL, log_z_BL, g_log_z_BL, g_target_BL))
  dw_DY, dh_NBCD = jax.lax.scan(body, jnp.zeros(w_DY.shape, jnp.float32), xs)
  return _unchunk(dh_NBCD, h_BLD.shape[1]), dw_DY


_statistics.defvjp(_forward, _backward)


def loss_with_gradients(heads, w_DY, chunk: int):
  """`(loss, statistics)` of heads sharing the kernel `w_DY`, each head's gradients formed in the
  forward pass (module docstring).

  Args:
    heads: a sequence of `(h_BLD, targets_BL, ce_weights_BL, z_weights_BL)`, one per head (L
      may differ between heads): the head's input and targets as `head_statistics`', `a` and
      `b` of the module docstring's loss (fp32; zero where a position does not count).
    w_DY: the shared kernel (compute dtype).
    chunk: positions per chunk (>= 1).
  Returns:
    `loss`: the fp32 scalar, differentiable in every `h_BLD`, in `w_DY` and in the weights;
    `statistics`: per head `(log_z_BL, target_logit_BL, argmax_BL)` as `head_statistics`',
    without gradient (metrics).
  """
  hs, targets, ce_weights, z_weights = zip(*heads)
  as_f32 = lambda ws: tuple(w.astype(jnp.float32) for w in ws)
  loss, statistics = _loss(chunk, hs, w_DY, targets, as_f32(ce_weights), as_f32(z_weights))
  return loss, jax.lax.stop_gradient(statistics)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss(chunk, hs, w_DY, targets, ce_weights, z_weights):
  return _loss_forward(chunk, hs, w_DY, targets, ce_weights, z_weights)[0]


def _loss_forward(chunk, hs, w_DY, targets, ce_weights, z_weights):
  args = hs, w_DY, targets, ce_weights, z_weights
  mesh = axes_lib.context_mesh()
  if mesh is None:
    loss_N, statistics, dhs, dw_DY, weight_grads = _loss_on_rows(chunk, *args)
  else:
    split = _RowSplit.of(mesh, [h.shape for h in hs], w_DY.shape[0])

    def run(*args):
      loss_N, statistics, dhs, dw_DY, weight_grads = _loss_on_rows(chunk, *args)
      return loss_N, statistics, dhs, split.reduce(dw_DY).astype(w_DY.dtype), weight_grads

    loss_N, statistics, dhs, dw_DY, weight_grads = jax.shard_map(
        run, mesh=mesh, in_specs=(split.hidden, P(), split.rows, split.rows, split.rows),
        out_specs=(P(split.axes or None), [(r,) * 3 for r in split.rows], split.hidden,
                   split.kernel, [(r, r) for r in split.rows]),
        check_vma=False)(list(hs), w_DY, list(targets), list(ce_weights), list(z_weights))
  residuals = tuple(dhs), dw_DY.astype(w_DY.dtype), tuple(weight_grads)
  return (loss_N.sum(), tuple(statistics)), residuals


class _RowSplit(NamedTuple):
  """How the heads' `[B, L, ...]` rows split over a mesh, for the chunk loops run per device
  (`jax.shard_map`): each device on its own rows with the kernel gathered once, its rows' dW
  summed locally and reduced over the devices once, at the end: reduce-scattered over the row
  axes that split the kernel's own D (`mesh.logical_axis_rules`' EMBED, where D divides by
  them), all-reduced over the other row axes, so the result lies as the kernel does. Left to
  XLA's partitioner the loops gathered the kernel and all-reduced an fp32 `[D, Y]` in every
  chunk (the 744B step at depth 4: 113 GiB of all-reduces a step, docs/scaling.md). Scattered
  over every row axis instead (all 1,024 devices on the 744B headline: 6 of D's 6,144 rows a
  device, fewer than a TPU tile's 8), the TPU compiler ran that reduce-scatter as an all-reduce
  of the whole `[D, Y]`."""

  rows: list  # per head, the PartitionSpec of its [B, L] arrays
  hidden: list  # per head, of its [B, L, D] input
  axes: tuple  # the mesh axes the rows split over: dW's partial sums are over them
  scatter: tuple  # of `axes`, those dW's D rows are reduce-scattered over (the rest all-reduced)

  @classmethod
  def of(cls, mesh, shapes, d: int):
    """Batch rows and positions as the model's activations split them (the context's logical
    rules), positions only where they divide (an MTP depth's input is a few positions
    shorter); `d`: the kernel's rows."""
    batch, length = map(axes_lib.spec_axes,
                        nn.logical_to_mesh_axes((axes_lib.BATCH, axes_lib.LENGTH)))
    rows, hidden, axes = [], [], []
    for shape in shapes:
      split = length if shape[1] % math.prod(mesh.shape[a] for a in length) == 0 else ()
      rows.append(P(batch or None, split or None))
      hidden.append(P(batch or None, split or None, None))
      axes += [a for a in batch + split if a not in axes]
    kernel_rows = axes_lib.spec_axes(nn.logical_to_mesh_axes((axes_lib.EMBED,))[0])
    scatter = tuple(a for a in kernel_rows if a in axes)
    if d % math.prod(mesh.shape[a] for a in scatter):
      scatter = ()
    return cls(rows, hidden, tuple(axes), scatter)

  def reduce(self, dw_DY):
    """The rows' partial dW summed over the devices (inside the shard_map)."""
    if self.scatter:
      dw_DY = jax.lax.psum_scatter(dw_DY, self.scatter, scatter_dimension=0, tiled=True)
    rest = tuple(a for a in self.axes if a not in self.scatter)
    return jax.lax.psum(dw_DY, rest) if rest else dw_DY

  @property
  def kernel(self):
    """The PartitionSpec of `reduce`'s result."""
    return P(self.scatter) if self.scatter else P()


def _loss_on_rows(chunk, hs, w_DY, targets, ce_weights, z_weights):
  """Every head's chunk loops over the rows given: `(loss [1] (these rows' part), statistics,
  dhs, dW (fp32, these rows' sum), the weights' gradients)`."""
  dw_DY = jnp.zeros(w_DY.shape, jnp.float32)
  loss, statistics, dhs, weight_grads = jnp.zeros((), jnp.float32), [], [], []
  for h_BLD, t_BL, a_BL, b_BL in zip(hs, targets, ce_weights, z_weights):

    def body(dw_DY, xs):
      h_BCD, t_BC, a_BC, b_BC = xs
      logits_BCY = _chunk_logits(h_BCD, w_DY)
      log_z_BC = jax.nn.logsumexp(logits_BCY, axis=-1)
      target_BC = jnp.take_along_axis(logits_BCY, t_BC[..., None], axis=-1)[..., 0]
      argmax_BC = jnp.argmax(logits_BCY, axis=-1).astype(jnp.int32)
      probs_BCY = jnp.exp(logits_BCY - log_z_BC[..., None])
      dh_BCD, dw_chunk_DY = _head_cotangents(h_BCD, w_DY, probs_BCY, t_BC,
                                             a_BC + 2 * b_BC * log_z_BC, -a_BC)
      return dw_DY + dw_chunk_DY, (log_z_BC, target_BC, argmax_BC, dh_BCD)

    # Padded positions have zero weights, so they add nothing to dW.
    xs = tuple(_chunks(x, chunk) for x in (h_BLD, t_BL, a_BL, b_BL))
    dw_DY, outs = jax.lax.scan(body, dw_DY, xs)
    log_z_BL, target_BL, argmax_BL, dh_BLD = (_unchunk(x, h_BLD.shape[1]) for x in outs)
    ce_BL, z_BL = log_z_BL - target_BL, jnp.square(log_z_BL)
    loss = loss + (a_BL * ce_BL).sum() + (b_BL * z_BL).sum()
    statistics.append((log_z_BL, target_BL, argmax_BL))
    dhs.append(dh_BLD)
    weight_grads.append((ce_BL, z_BL))
  return loss[None], statistics, dhs, dw_DY, weight_grads


def _loss_backward(chunk, residuals, cotangents):
  dhs, dw_DY, weight_grads = residuals
  g, _ = cotangents  # the statistics leave without gradient (`loss_with_gradients`)
  scale = lambda x: (g * x.astype(jnp.float32)).astype(x.dtype)
  return (tuple(scale(dh_BLD) for dh_BLD in dhs), scale(dw_DY), None,
          tuple(g * ce_BL for ce_BL, _ in weight_grads),
          tuple(g * z_BL for _, z_BL in weight_grads))


_loss.defvjp(_loss_forward, _loss_backward)
