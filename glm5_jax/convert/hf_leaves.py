"""The HF load plan arranged by the leaves of one param layout, and any slice of a leaf read alone.

`hf_layout.load_plan` says which HF tensors build each parameter of the unrolled layout
(`layers_{i}/...`). In the scanned layout (`cfg.scan_layers`, see `glm5_jax.layer_runs`) a
stacked leaf `layers_{a}_{b}/...` gathers the plan entries of layers a..b, at indices 0..b-a of
its leading axis (`layer_runs.scanned_location`). `read_slice` builds any rectangular slice of a
leaf, e.g. the shard one device holds, from the files:
  - of a stacked leaf it reads only the layers the slice covers, one layer at a time, into the
    slice's buffer;
  - of a routed-expert kernel `[E, ...]` only the experts it covers (per-expert HF tensors, or
    rows of the fused ones);
  - every other tensor is read whole (one HF tensor) and cut, since HF stores it transposed or
    with heads interleaved, so a slice of ours is scattered in the file.
So building a slice holds at most the slice, one layer's expert slice and one HF tensor. Both the
in-memory `load_hf` and the streaming converter (`streaming.py`) build every leaf through here.
"""

import dataclasses
from typing import Callable

from absl import logging
import jax
import numpy as np

from glm5_jax import layer_runs
from glm5_jax.convert.hf_files import CheckpointError, head
from glm5_jax.convert.hf_layout import expert_sliceable

Index = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class LeafSource:
  """One leaf of the target layout and the plan entries `(dest, names, build)` it is made of:
  one entry, or (`stacked`) one per layer along its leading axis, in index order."""

  path: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: np.dtype
  entries: tuple
  stacked: bool

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

  @property
  def name(self) -> str:
    return "/".join(self.path)


def leaf_sources(cfg, plan: list, shapes: dict, origin: str) -> list[LeafSource]:
  """The leaves of `shapes` (either layout; converted to the one `cfg.scan_layers` selects)
  with their plan entries, in tree order.

  Raises:
    CheckpointError: (naming `origin`, the checkpoint) a leaf no entry fills, or a layer of a
      stacked leaf that is missing.
  """
  target = layer_runs.as_layout_of(cfg, shapes)
  flat = {tuple(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]}
  by_leaf: dict[tuple, dict] = {}
  for dest, names, build in plan:
    path, index = layer_runs.scanned_location(cfg, dest) if cfg.scan_layers else (dest, None)
    if path not in flat:
      raise CheckpointError(f"internal: no parameter {'/'.join(path)} in the model")
    by_leaf.setdefault(path, {})[index] = (dest, names, build)
  unfilled = sorted("/".join(p) for p in flat if p not in by_leaf)
  if unfilled:
    raise CheckpointError(f"{origin}: params left unfilled: {head(unfilled)}")
  sources = []
  for path, leaf in flat.items():
    entries = by_leaf[path]
    stacked = None not in entries
    if stacked and sorted(entries) != list(range(leaf.shape[0])):
      raise CheckpointError(f"{origin}: {'/'.join(path)} stacks {leaf.shape[0]} layers but the "
                            f"plan fills indices {sorted(entries)}")
    ordered = tuple(entries[i] for i in sorted(entries)) if stacked else (entries[None],)
    sources.append(LeafSource(path, tuple(leaf.shape), np.dtype(leaf.dtype), ordered, stacked))
  return sources


def read_slice(source: LeafSource, read: Callable, index: Index, origin: str) -> np.ndarray:
  """`leaf[index]` of `source` (index: one slice per axis, as `jax.make_array_from_callback`
  passes), built from the HF tensors `read(name[, rows])` returns."""
  index = _normalize(index, source.shape)
  if not source.stacked:
    return _entry_slice(source.entries[0], read, source.dtype, index, source.shape, origin)
  layers, rest = index[0], index[1:]
  out = np.empty(tuple(s.stop - s.start for s in index), source.dtype)
  for j, layer in enumerate(range(layers.start, layers.stop)):
    out[j] = _entry_slice(source.entries[layer], read, source.dtype, rest, source.shape[1:],
                          origin)
  return out


def _entry_slice(entry, read, dtype, index: Index, shape: tuple, origin: str) -> np.ndarray:
  """One plan entry's `[index]`, its built shape checked against `shape` (the parameter's)."""
  dest, names, build = entry
  if expert_sliceable(dest):
    array = build(read, dtype, experts=index[0])
    want = (index[0].stop - index[0].start,) + tuple(shape[1:])
    index = (slice(None),) + index[1:]
  else:
    array, want = build(read, dtype), tuple(shape)
  if array.shape != want:
    raise CheckpointError(f"{origin}: {names[0]} gives {'/'.join(dest)} shape {array.shape}, but "
                          f"config.json implies {want}")
  bad = array.size - int(np.count_nonzero(np.isfinite(array)))
  if bad:  # loaded as stored, but a run from these weights would be NaN from the first step
    logging.warning("%s: %d non-finite values (NaN/inf) in %s (param %s)", origin, bad,
                    head(list(names)), "/".join(dest))
  if all(s == slice(None) or (s.start == 0 and s.stop == n) for s, n in zip(index, want)):
    return array
  return array[index].copy()  # a copy, so the whole tensor is freed now rather than viewed


def _normalize(index: Index, shape: tuple) -> Index:
  if len(index) != len(shape):
    raise ValueError(f"index {index} does not match shape {shape}")
  out = []
  for s, n in zip(index, shape):
    start, stop, step = s.indices(n)
    if step != 1:
      raise ValueError(f"index {index}: only unit-stride slices are supported")
    out.append(slice(start, stop))
  return tuple(out)
