"""Run an optax transformation layer by layer over the stacked params of a scanned run.

Scanned layers (`model.scan_layers`) store a run's kernels as one `[layers, ...]` array. Muon's
Newton-Schulz iteration (`optax.contrib.scale_by_muon`) treats every axis outside a matrix as a
batch axis, but flattens all of them into one before its `vmap`. For a stacked expert kernel
`[layers, E, D, F]` with E sharded over the `expert` mesh axis, that merged `layers * E` axis
cannot keep the expert sharding (the sharded factor is the minor one), so XLA computes every
layer's and every expert's `F x F` Gram matrices on every device: compiled for GLM-5 on 256
simulated devices, an all-reduce of `f32[75 * 256, 2048, 2048]` (300 GiB) per step.

`map_over_layers(tx)` instead initializes `tx` per layer (`jax.vmap`) and applies it with
`jax.lax.map` over the leading axis: one layer's slice at a time, each with its own sharding,
and the same numbers as the unrolled layout (`tests/test_optim.py`). optax has no such wrapper,
hence this one.
"""

import jax
import optax


def map_over_layers(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` applied to each index of the leading (layers) axis of every leaf on its own.

  Every leaf `tx` sees must carry the same leading axis length (one scanned run's params);
  `tx`'s state gains that axis too.
  """

  def init_fn(params):
    return jax.vmap(tx.init)(params)

  def update_fn(updates, state, params=None):
    if params is None:
      return jax.lax.map(lambda args: tx.update(*args), (updates, state))
    return jax.lax.map(lambda args: tx.update(*args), (updates, state, params))

  return optax.GradientTransformation(init_fn, update_fn)
