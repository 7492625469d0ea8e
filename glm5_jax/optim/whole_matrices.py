"""Muon's Newton-Schulz on whole routed-expert matrices: each matrix moved to one device first.

A routed expert's kernel `[E, in, out]` is stored with E over the `expert` mesh axis and its
matrix dimensions over `fsdp` (and `context`, `tensor`), so every Newton-Schulz step's Gram
product `X X^T` contracts over a sharded dimension and all-reduces the local experts' Gram
matrices: for GLM-5 on fsdp 64 x expert 16, `f32[16, 2048, 2048]` (256 MiB) per step of the
iteration, 5 steps x 3 kernels x 75 layers, 440 GiB per device per train step compiled by the
TPU compiler (docs/scaling.md, "Making the step fast"). Distributed Muon (Moonlight, Dion)
instead gives each device whole matrices: the normalized momentum's shards are exchanged within
the group that splits the matrix dimensions (one all-to-all), each device orthogonalizes its
own matrices, and the results go back (one more): a few MiB per kernel per layer.

`whole_expert_matrices(ns_dtype, ...)` is Muon (`ns_precision.scale_by_muon_in`'s numbers) run
this way. Under the mesh and logical axis rules of the trace
(`glm5_jax.sharding.activation_sharding`):

  1. the momentum, Nesterov step and per-matrix normalization (`ns_precision.momentum_stage`)
     in the parameters' layout: elementwise, and a norm per matrix;
  2. that normalized update, cast to `ns_dtype`, moved per routed-expert leaf (path
     `.../experts/{gate,up,down}_proj`, logical axes `(expert, embed | expert_mlp, ...)`):

       [E, in, out] -> [n_e, E / n_e, in, out]       the experts of each `expert` shard
                    -> zero-pad axis 1 to a multiple of n_m (the devices splitting in and out)
                    -> constrain to P(expert axes, matrix axes, None, None)   (the all-to-all)
                    -> [n_e * padded, in, out], P(expert + matrix axes, None, None)

  3. the iteration alone (`ns_precision.iteration_stage`) with axis 0 its batch axis; back the
     same way, cast to fp32.

Only the iteration's input and output cross the exchange, in `ns_dtype`: moving the whole Muon
(updates and fp32 momentum in, update and momentum out) was four all-to-alls a kernel a step
(1.15 s of the 744B headline's 1.65 s of optimizer collectives exposed by the TPU compiler's
schedule, docs/scaling.md). The momentum stays in the parameter's layout (the state is
`scale_by_muon`'s, unchanged: a checkpoint restores either way); the padding matrices are zero
and orthogonalize to zero. The numbers are Muon's: each matrix is orthogonalized on its own as
before (`tests/test_optim.py` compares with the unsharded update). Outside a mesh, or where
nothing splits the matrix dimensions, the transformation is `scale_by_muon_in` itself. Written
here because optax's Muon takes no layout for its iteration.
"""

import math
import typing

import jax
import optax
from flax import linen as nn
from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers

from glm5_jax.layers import axes as axes_lib
from glm5_jax.optim.ns_precision import iteration_stage, momentum_stage, scale_by_muon_in

# Routed-expert kernels: name -> logical axes (`glm5_jax.moe`).
_EXPERT_KERNELS = {
    "gate_proj": (axes_lib.EXPERT, axes_lib.EMBED, axes_lib.EXPERT_MLP),
    "up_proj": (axes_lib.EXPERT, axes_lib.EMBED, axes_lib.EXPERT_MLP),
    "down_proj": (axes_lib.EXPERT, axes_lib.EXPERT_MLP, axes_lib.EMBED),
}


class _Owner(typing.NamedTuple):
  """How one `[E, in, out]` leaf moves: its param spec, expert axes and matrix axes."""
  spec: PartitionSpec
  expert_axes: tuple
  matrix_axes: tuple
  n_e: int
  n_m: int


_axes = axes_lib.spec_axes


def _owner(path, leaf, dims, mesh) -> _Owner | None:
  names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
  if (len(names) < 2 or names[-2] != "experts" or names[-1] not in _EXPERT_KERNELS
      or not isinstance(dims, MuonDimensionNumbers) or leaf.ndim != 3):
    return None
  spec = nn.logical_to_mesh_axes(_EXPERT_KERNELS[names[-1]])
  expert_axes = _axes(spec[0])
  matrix_axes = _axes(spec[1]) + _axes(spec[2])
  n_e = math.prod(mesh.shape[a] for a in expert_axes)
  n_m = math.prod(mesh.shape[a] for a in matrix_axes)
  if n_m == 1 or leaf.shape[0] % n_e:
    return None
  return _Owner(PartitionSpec(*spec), expert_axes, matrix_axes, n_e, n_m)


def _to_owner(x, o: _Owner):
  """`[E, in, out]` -> `[n_e * ceil(E / n_e / n_m) * n_m, in, out]`: the experts of each
  `expert` shard, zero-padded to a multiple of n_m, one whole matrix (or several) per device.
  The padded expert axis stays one axis (split over the expert and matrix axes): Muon's own
  reshape of several batch axes into one lost the split on the TPU compiler."""
  e, d, f = x.shape
  local = e // o.n_e
  x = x.reshape(o.n_e, local, d, f)
  x = jax.numpy.pad(x, ((0, 0), (0, -local % o.n_m), (0, 0), (0, 0)))
  x = jax.lax.with_sharding_constraint(
      x, PartitionSpec(o.expert_axes or None, o.matrix_axes, None, None))
  x = x.reshape((-1, d, f))
  return jax.lax.with_sharding_constraint(
      x, PartitionSpec(o.expert_axes + o.matrix_axes, None, None))


def _from_owner(y, o: _Owner, e: int):
  """The inverse of `_to_owner`, back in the parameter's layout."""
  y = y.reshape((o.n_e, -1) + y.shape[1:])
  y = jax.lax.with_sharding_constraint(
      y, PartitionSpec(o.expert_axes or None, None, *o.spec[1:]))
  y = y[:, :e // o.n_e].reshape((e,) + y.shape[2:])
  return jax.lax.with_sharding_constraint(y, o.spec)


def whole_expert_matrices(ns_dtype: str, *, ns_coeffs, ns_steps: int, beta: float,
                          nesterov: bool, weight_dimension_numbers) -> optax.GradientTransformation:
  """Muon (`ns_precision.scale_by_muon_in` with these arguments) with each routed-expert matrix
  orthogonalized whole on one device (module docstring). The moved leaves keep their rank and
  matrix axes, so `weight_dimension_numbers` (`optax.MaskedNode` where not Muon) holds for
  them too. State: `optax.contrib.MuonState`, in the parameters' layout."""
  dims = weight_dimension_numbers
  muon = scale_by_muon_in(ns_dtype, ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta,
                          nesterov=nesterov, weight_dimension_numbers=dims)
  momentum = momentum_stage(ns_coeffs=ns_coeffs, beta=beta, nesterov=nesterov,
                            weight_dimension_numbers=dims)
  iterate = iteration_stage(ns_coeffs=ns_coeffs, ns_steps=ns_steps, weight_dimension_numbers=dims)
  dtype = jax.numpy.dtype(ns_dtype)
  is_dims = lambda x: isinstance(x, MuonDimensionNumbers)
  is_owner = lambda x: x is None or isinstance(x, _Owner)

  def update_fn(updates, state, params=None):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
      return muon.update(updates, state, params)
    owners = jax.tree_util.tree_map_with_path(
        lambda path, leaf, d: _owner(path, leaf, d, mesh), updates, dims, is_leaf=is_dims)
    if all(o is None for o in jax.tree.leaves(owners, is_leaf=is_owner)):
      return muon.update(updates, state, params)
    normalized, state = momentum.update(updates, state)
    low = jax.tree.map(lambda x: x.astype(dtype), normalized)
    moved = jax.tree.map(lambda o, x: x if o is None else _to_owner(x, o), owners, low,
                         is_leaf=is_owner)
    out = jax.tree.map(
        lambda o, y, x: (y if o is None else _from_owner(y, o, x.shape[0])).astype(x.dtype),
        owners, iterate(moved), normalized, is_leaf=is_owner)
    return out, state

  return optax.GradientTransformation(momentum.init, update_fn)
