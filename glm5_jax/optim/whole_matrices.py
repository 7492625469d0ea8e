"""Muon's Newton-Schulz on whole matrices: each matrix moved to one device first.

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
nothing splits the matrix dimensions, the transformation is `scale_by_muon_in` itself.

A scanned run's other Muon matrices (attention projections, shared expert, indexer: one matrix
per layer, split over `fsdp`) have no expert axis to spread; `whole_layer_matrices` moves them
the same way with the run's layer axis in the expert axis' place, after the per-layer momentum
(its docstring). It moves the run's routed experts with their layers too: each expert shard's
`layers * E / n_e` matrices padded together to a multiple of n_m. Layer by layer, the 744B
step's 8 local experts over 32 fsdp devices were padded to 32 matrices, three quarters of the
iteration's work on zeros. Written here because optax's Muon takes no layout for its iteration.
"""

import math
import typing

import jax
import optax
from flax import linen as nn
from jax.sharding import PartitionSpec
from optax.contrib import MuonDimensionNumbers

from glm5_jax.layers import axes as axes_lib
from glm5_jax.optim import muon_split
from glm5_jax.optim.layer_map import map_over_layers
from glm5_jax.optim.ns_precision import iteration_stage, momentum_stage, scale_by_muon_in

# Routed-expert kernels: name -> logical axes (`glm5_jax.moe`).
_EXPERT_KERNELS = {
    "gate_proj": (axes_lib.EXPERT, axes_lib.EMBED, axes_lib.EXPERT_MLP),
    "up_proj": (axes_lib.EXPERT, axes_lib.EMBED, axes_lib.EXPERT_MLP),
    "down_proj": (axes_lib.EXPERT, axes_lib.EXPERT_MLP, axes_lib.EMBED),
}


class _Owner(typing.NamedTuple):
  """How one `[E, ...]` leaf moves: its param spec, the mesh axes of axis 0 (spread over
  first) and those of every other axis (the matrix axes: split the matrices, gathered)."""
  spec: PartitionSpec
  expert_axes: tuple
  matrix_axes: tuple
  n_e: int
  n_m: int


_axes = axes_lib.spec_axes


def _owner_of(shape, spec, mesh) -> _Owner | None:
  """The move of a leaf of `shape` laid out as `spec` (mesh axes), or None where nothing splits
  its axes after the first (its matrices are whole already) or axis 0 does not divide."""
  spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  split = lambda entries: tuple(a for e in entries for a in _axes(e) if mesh.shape[a] > 1)
  expert_axes, matrix_axes = split(spec[:1]), split(spec[1:])
  n_e = math.prod(mesh.shape[a] for a in expert_axes)
  n_m = math.prod(mesh.shape[a] for a in matrix_axes)
  if n_m == 1 or shape[0] % n_e:
    return None
  return _Owner(PartitionSpec(*spec), expert_axes, matrix_axes, n_e, n_m)


def _expert_owner(path, leaf, dims, mesh) -> _Owner | None:
  """A routed-expert kernel's move, one layer's `[E, in, out]` (its logical axes known)."""
  names = muon_split.path_names(path)
  if (not _is_expert_kernel(names) or not isinstance(dims, MuonDimensionNumbers)
      or leaf.ndim != 3):
    return None
  return _owner_of(leaf.shape, nn.logical_to_mesh_axes(_EXPERT_KERNELS[names[-1]]), mesh)


def _is_expert_kernel(names) -> bool:
  return len(names) >= 2 and names[-2] == "experts" and names[-1] in _EXPERT_KERNELS


def _to_owner(x, o: _Owner):
  """`[E, ...]` -> `[n_e * ceil(E / n_e / n_m) * n_m, ...]`: the entries of each shard of axis
  0, zero-padded to a multiple of n_m, one whole matrix (or several) per device. The padded axis
  stays one axis (split over the expert and matrix axes): Muon's own reshape of several batch
  axes into one lost the split on the TPU compiler."""
  e, rest = x.shape[0], x.shape[1:]
  local = e // o.n_e
  x = x.reshape(o.n_e, local, *rest)
  x = jax.numpy.pad(x, ((0, 0), (0, -local % o.n_m)) + ((0, 0),) * len(rest))
  whole = (None,) * len(rest)
  x = jax.lax.with_sharding_constraint(
      x, PartitionSpec(o.expert_axes or None, o.matrix_axes, *whole))
  x = x.reshape((-1, *rest))
  return jax.lax.with_sharding_constraint(x, PartitionSpec(o.expert_axes + o.matrix_axes, *whole))


def _from_owner(y, o: _Owner, e: int):
  """The inverse of `_to_owner`, back in the parameter's layout."""
  y = y.reshape((o.n_e, -1) + y.shape[1:])
  y = jax.lax.with_sharding_constraint(
      y, PartitionSpec(o.expert_axes or None, None, *o.spec[1:]))
  y = y[:, :e // o.n_e].reshape((e,) + y.shape[2:])
  return jax.lax.with_sharding_constraint(y, o.spec)


class _StackedExperts(typing.NamedTuple):
  """The move of a scanned run's routed-expert kernel `[layers, E, in, out]`: folded to
  `[E * layers, in, out]` (each expert shard's layers and experts in one axis,
  `_experts_first`), which then moves as `owner` says."""
  spec: PartitionSpec  # the stacked leaf's
  owner: _Owner  # of the folded leaf
  layers: int


def _stacked_expert_owner(shape, spec, mesh) -> _StackedExperts | None:
  """A stacked routed-expert kernel's move (`_StackedExperts`), or None where nothing splits
  its matrices or the experts do not divide over their axes."""
  spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  owner = _owner_of((shape[0] * shape[1],) + tuple(shape[2:]), spec[1:], mesh)
  if owner is None or shape[1] % owner.n_e:
    return None
  return _StackedExperts(PartitionSpec(*spec), owner, shape[0])


def _experts_first(x, o: _StackedExperts):
  """`[layers, E, in, out]` -> `[E * layers, in, out]`, ordered (expert shard, layer, local
  expert): each expert shard's block stays on its devices (no data moves), and `_to_owner` pads
  each shard's `layers * E / n_e` matrices together, not each layer's `E / n_e` (the 744B step:
  8 local experts a layer over 32 fsdp devices were padded to 32, 4x the iteration's work)."""
  layers, e = x.shape[:2]
  x = x.reshape(layers, o.owner.n_e, e // o.owner.n_e, *x.shape[2:])
  x = jax.numpy.moveaxis(x, 0, 1).reshape(layers * e, *x.shape[3:])
  return jax.lax.with_sharding_constraint(x, o.owner.spec)


def _layers_first(y, o: _StackedExperts):
  """The inverse of `_experts_first`, in the stacked leaf's layout."""
  e = y.shape[0] // o.layers
  y = y.reshape(o.owner.n_e, o.layers, e // o.owner.n_e, *y.shape[1:])
  y = jax.numpy.moveaxis(y, 1, 0).reshape(o.layers, e, *y.shape[3:])
  return jax.lax.with_sharding_constraint(y, o.spec)


_is_dims = lambda x: isinstance(x, MuonDimensionNumbers)
_is_owner = lambda x: x is None or isinstance(x, (_Owner, _StackedExperts))


def _iterate_moved(iterate, owners, low):
  """`iterate(tree)` with each leaf that has an owner moved there and back (the others
  iterated where they are): `low` the normalized updates in the iteration's dtype."""
  moved = jax.tree.map(lambda o, x: x if o is None else _to_owner(x, o), owners, low,
                       is_leaf=_is_owner)
  return jax.tree.map(lambda o, y, x: y if o is None else _from_owner(y, o, x.shape[0]),
                      owners, iterate(moved), low, is_leaf=_is_owner)


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

  def update_fn(updates, state, params=None):
    mesh = axes_lib.context_mesh()
    if mesh is None:
      return muon.update(updates, state, params)
    owners = jax.tree_util.tree_map_with_path(
        lambda path, leaf, d: _expert_owner(path, leaf, d, mesh), updates, dims, is_leaf=_is_dims)
    if all(o is None for o in jax.tree.leaves(owners, is_leaf=_is_owner)):
      return muon.update(updates, state, params)
    normalized, state = momentum.update(updates, state)
    out = _iterate_moved(iterate, owners, jax.tree.map(lambda x: x.astype(dtype), normalized))
    return jax.tree.map(lambda y, x: y.astype(x.dtype), out, normalized), state

  return optax.GradientTransformation(momentum.init, update_fn)


def _one_matrix_at_a_time(iterate, o: _Owner, moved):
  """`iterate(moved)` for a leaf in its owner layout (`_to_owner`: `[n * k, ...]`, k entries on
  each of the n devices) as k steps of `[n, ...]`, one matrix per device each: the iteration's
  temporaries are one matrix's, not k's (all of a run's stacked leaves at once held ~30 GiB
  more per device in the 744B step, docs/scaling.md)."""
  n = o.n_e * o.n_m
  rest = moved.shape[1:]
  whole = (None,) * len(rest)
  devices = o.expert_axes + o.matrix_axes
  steps = jax.lax.with_sharding_constraint(
      jax.numpy.moveaxis(moved.reshape(n, -1, *rest), 1, 0),
      PartitionSpec(None, devices, *whole))
  done = jax.lax.map(lambda x: iterate(jax.lax.with_sharding_constraint(
      x, PartitionSpec(devices, *whole))), steps)
  return jax.lax.with_sharding_constraint(
      jax.numpy.moveaxis(done, 0, 1).reshape(moved.shape), PartitionSpec(devices, *whole))


def _masked(flags, tree):
  """`tree` with `optax.MaskedNode()` at the leaves `flags` (owners or None) moves."""
  return jax.tree.map(lambda o, x: x if o is None else optax.MaskedNode(), flags, tree,
                      is_leaf=_is_owner)


def _merge(flags, moved, kept):
  """The leaves of `moved` where `flags` moves, of `kept` elsewhere."""
  return jax.tree.map(lambda o, a, b: b if o is None else a, flags, moved, kept,
                      is_leaf=_is_owner)


def whole_layer_matrices(ns_dtype: str, *, ns_coeffs, ns_steps: int, beta: float, nesterov: bool,
                         run_dims, layer_dims, rest=(), logical_axes=None
                         ) -> optax.GradientTransformation:
  """A scanned run's Muon group: `map_over_layers(chain(whole_expert_matrices(...), *rest))`
  in state and numbers, with the Newton-Schulz iteration of its other split matrices run on
  whole matrices, the layers spread over the devices.

  Layer by layer (`layer_map`), an attention or shared-expert kernel sharded over `fsdp` is one
  matrix per layer, split over the devices: each iteration step gathers it or all-reduces its
  Gram matrix (collective-permutes of the output projection's rows, all-reduces of `[2048,
  2048]`: most of the 1.65 s of optimizer collectives that the TPU compiler's schedule left
  exposed in the 744B headline step, docs/scaling.md). Here, under a mesh and given the params'
  `logical_axes`, each such leaf `[layers, ...]` moves whole after the per-layer momentum
  (`_to_owner` over its layer axis: `ceil(layers / n) * n` matrices, n the devices splitting
  them, zero-padded), its layers iterated as the batch, and back; a routed-expert kernel
  `[layers, E, ...]` moves as `[E * layers, ...]`, its layers and local experts the batch
  (`_experts_first`). Per layer as before: the momentum (its state keeps the layer axis), the
  iteration of routed experts that do not move so (their own moves, `whole_expert_matrices`),
  `rest`. Without a mesh or `logical_axes`, or where nothing is split, it is the layer-by-layer
  chain itself.

  Args:
    ns_dtype, ns_coeffs, ns_steps, beta, nesterov: Muon's (`ns_precision.scale_by_muon_in`).
    run_dims: the group's `MuonDimensionNumbers` of the stacked leaves (layer axis 0;
      `optax.MaskedNode` outside the group).
    layer_dims: the same per layer (`muon_split.per_layer_dimension_numbers`).
    rest: the transformations after Muon, applied per layer (their states gain the layer axis).
    logical_axes: the group's params' logical axes (`PartitionSpec`s of logical names,
      `optax.MaskedNode` outside the group), or None.
  """
  muon_args = dict(ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta, nesterov=nesterov)
  layerwise = map_over_layers(optax.chain(
      whole_expert_matrices(ns_dtype, **muon_args, weight_dimension_numbers=layer_dims), *rest))
  momentum = momentum_stage(ns_coeffs=ns_coeffs, beta=beta, nesterov=nesterov,
                            weight_dimension_numbers=layer_dims)
  iteration = lambda dims: iteration_stage(ns_coeffs=ns_coeffs, ns_steps=ns_steps,
                                           weight_dimension_numbers=dims)
  tail = optax.chain(*rest)
  dtype = jax.numpy.dtype(ns_dtype)

  def stacked_owner(path, leaf, d, names, mesh):
    if not _is_dims(d):
      return None
    spec = nn.logical_to_mesh_axes(tuple(names))
    if _is_expert_kernel(muon_split.path_names(path)) and leaf.ndim == 4:
      return _stacked_expert_owner(leaf.shape, spec, mesh)
    return _owner_of(leaf.shape, spec, mesh)

  def update_fn(updates, state, params=None):
    mesh = axes_lib.context_mesh()
    if mesh is None or logical_axes is None:
      return layerwise.update(updates, state, params)
    stacked = jax.tree_util.tree_map_with_path(
        lambda path, leaf, d, names: stacked_owner(path, leaf, d, names, mesh),
        updates, run_dims, logical_axes, is_leaf=_is_dims)
    if all(o is None for o in jax.tree.leaves(stacked, is_leaf=_is_owner)):
      return layerwise.update(updates, state, params)
    layer_rest = _masked(stacked, layer_dims)
    iterate_layer = iteration(layer_rest)

    def first(args):  # one layer: the momentum; the iteration of every leaf but the stacked
      g, s = args
      normalized, s = momentum.update(g, s)
      low = jax.tree.map(lambda x: x.astype(dtype), normalized)
      others = _masked(stacked, low)
      experts = jax.tree_util.tree_map_with_path(
          lambda path, leaf, d: _expert_owner(path, leaf, d, mesh), others, layer_rest,
          is_leaf=_is_dims)
      return _merge(stacked, low, _iterate_moved(iterate_layer, experts, others)), s

    per_layer, muon_state = jax.lax.map(first, (updates, state[0]))

    def whole_layers(o, d, layer_d, x):  # one stacked leaf, moved, iterated, back
      if isinstance(o, _StackedExperts):
        moved = _to_owner(_experts_first(x, o), o.owner)
        done = _one_matrix_at_a_time(iteration(layer_d), o.owner, moved)
        return _layers_first(_from_owner(done, o.owner, math.prod(x.shape[:2])), o)
      moved = _to_owner(x, o)
      return _from_owner(_one_matrix_at_a_time(iteration(d), o, moved), o, x.shape[0])

    whole = jax.tree.map(
        lambda o, d, layer_d, x: None if o is None else whole_layers(o, d, layer_d, x),
        stacked, run_dims, layer_dims, per_layer, is_leaf=_is_owner)
    ortho = jax.tree.map(lambda y, g: y.astype(g.dtype), _merge(stacked, whole, per_layer),
                         updates)
    out, rest_state = map_over_layers(tail).update(ortho, tuple(state[1:]), params)
    return out, (muon_state, *rest_state)

  return optax.GradientTransformation(layerwise.init, update_fn)
