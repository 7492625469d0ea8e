"""Runs of identical decoder layers, scanned as one stacked module each (`model.scan_layers`).

A run is a maximal stretch of consecutive layers with the same attention kind and the same FFN
(dense or MoE). GLM-5 (`attention_pattern="D"`, 3 dense then 75 MoE layers) has two runs,
`layers_0_2` and `layers_3_77`; an ablation pattern like "SMSM" has four runs of one layer.
Each run is one `nn.scan` over a `DecoderLayer` whose params carry a leading `[layers, ...]`
axis (logical name `layers`), so the compiled program holds one copy of each distinct layer
body, whatever the depth.

Param layouts:
  unrolled (`scan_layers=False`):  `layers_{i}/<layer params>`
  scanned  (`scan_layers=True`):   `layers_{first}_{last}/<layer params with a leading axis of
                                    size last - first + 1>`, layer i at index i - first

`stack_layers` / `unstack_layers` convert a param tree (or any tree with that top level, e.g.
gradients or abstract shapes) between the two; `scanned_location` maps one unrolled path to its
stacked leaf and index, for importers that write one layer at a time.
"""

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_UNROLLED = re.compile(r"layers_(\d+)$")
_SCANNED = re.compile(r"layers_(\d+)_(\d+)$")


@dataclasses.dataclass(frozen=True)
class LayerRun:
  """Layers `first..last` (inclusive), all `attention_kind` with MoE FFN iff `moe`."""

  first: int
  last: int
  attention_kind: str
  moe: bool

  @property
  def name(self) -> str:
    return f"layers_{self.first}_{self.last}"

  @property
  def length(self) -> int:
    return self.last - self.first + 1


def layer_runs(cfg) -> tuple[LayerRun, ...]:
  """The runs of a `ModelConfig`, in layer order."""
  runs = []
  for i in range(cfg.num_hidden_layers):
    kind, moe = cfg.attention_kind(i), cfg.is_moe_layer(i)
    if runs and (runs[-1].attention_kind, runs[-1].moe) == (kind, moe):
      runs[-1] = dataclasses.replace(runs[-1], last=i)
    else:
      runs.append(LayerRun(i, i, kind, moe))
  return tuple(runs)


def unrolled_name(layer: int) -> str:
  return f"layers_{layer}"


def is_layer_module(name: str) -> bool:
  """True for a top-level decoder-layer entry of either layout."""
  return bool(_UNROLLED.match(name) or _SCANNED.match(name))


def layer_indices(name: str) -> range:
  """The layers a top-level entry holds: `layers_5` -> range(5, 6), `layers_3_77` -> 3..77."""
  if m := _UNROLLED.match(name):
    return range(int(m[1]), int(m[1]) + 1)
  if m := _SCANNED.match(name):
    return range(int(m[1]), int(m[2]) + 1)
  raise ValueError(f"{name!r} is not a decoder-layer entry (layers_<i> or layers_<i>_<j>)")


def is_run_name(name: str) -> bool:
  """True for a scanned run's entry `layers_<i>_<j>` (its leaves have a leading layers axis)."""
  return bool(_SCANNED.match(name))


def is_scanned(params: dict) -> bool:
  """Whether a param tree holds stacked runs (any `layers_<i>_<j>` entry)."""
  return any(_SCANNED.match(name) for name in params)


def scanned_location(cfg, path: tuple[str, ...]) -> tuple[tuple[str, ...], int | None]:
  """`(path in the scanned layout, index along its layers axis)` of an unrolled-layout path.

  Paths outside the decoder layers (embedding, head, MTP) map to themselves with index None.
  """
  if path and (m := _UNROLLED.match(path[0])):
    layer = int(m[1])
    for run in layer_runs(cfg):
      if run.first <= layer <= run.last:
        return (run.name,) + tuple(path[1:]), layer - run.first
    raise ValueError(f"{path[0]}: the model has {cfg.num_hidden_layers} layers")
  return tuple(path), None


def stack_layers(tree: dict, cfg) -> dict:
  """Unrolled -> scanned layout: each run's `layers_{i}` subtrees stacked on a new axis 0.

  Leaves may be arrays (stacked with `jnp.stack`, or `np.stack` for numpy leaves) or
  `jax.ShapeDtypeStruct`s (their shapes gain the axis).
  """
  out = {k: v for k, v in tree.items() if not _UNROLLED.match(k)}
  for run in layer_runs(cfg):
    members = [tree[unrolled_name(i)] for i in range(run.first, run.last + 1)]
    out[run.name] = jax.tree_util.tree_map(_stack, *members)
  return out


def unstack_layers(tree: dict, cfg) -> dict:
  """Scanned -> unrolled layout (the inverse of `stack_layers`)."""
  out = {k: v for k, v in tree.items() if not _SCANNED.match(k)}
  for run in layer_runs(cfg):
    stacked = tree[run.name]
    for j in range(run.length):
      out[unrolled_name(run.first + j)] = jax.tree_util.tree_map(
          lambda leaf, j=j: _index(leaf, j), stacked)
  return out


def as_unrolled(tree: dict, cfg) -> dict:
  """`tree` in the unrolled layout, whichever layout it is in."""
  return unstack_layers(tree, cfg) if is_scanned(tree) else tree


def as_layout_of(cfg, tree: dict) -> dict:
  """`tree` (either layout) in the layout `cfg.scan_layers` selects."""
  unrolled = as_unrolled(tree, cfg)
  return stack_layers(unrolled, cfg) if cfg.scan_layers else unrolled


def _stack(*leaves: Any):
  first = leaves[0]
  if isinstance(first, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(leaves),) + tuple(first.shape), first.dtype)
  if isinstance(first, np.ndarray):
    return np.stack(leaves)
  return jnp.stack(leaves)


def _index(leaf: Any, j: int):
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(tuple(leaf.shape[1:]), leaf.dtype)
  return leaf[j]
