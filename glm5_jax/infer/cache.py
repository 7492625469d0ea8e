"""The model's decode cache: one tree of preallocated arrays, built from the kinds' specs.

Each attention kind declares its per-layer cache (`AttentionKind.decode_cache`, arrays with a
leading slots dim B); this module lays those out for the whole model, mirroring the param
layout so a scanned run's cache scans with its params:

  {"layers_{first}_{last}": {name: [layers, B, ...]},   scanned runs (`model.scan_layers`)
   "layers_{i}":            {name: [B, ...]},           unrolled layers
   "mtp":                   {name: [U, B, ...]} or {name: [B, ...]}}   (see "MTP caches")

MTP caches (`mtp_cache`). The shared MTP layer is one decoder layer run at U depths; its
attention needs a cache of its own, and there are two schemes:

  "per_depth"  one cache per depth, `[U, B, ...]`: depth d at position i attends over the
               depth-d states of positions <= i, exactly as the depths are trained (training
               runs depth d over the whole sequence). A drafter runs depth d at position p with
               positions p (RoPE and cache row) into cache d - 1; it is exact: teacher-forced,
               every depth's logits equal the full forward's `mtp_logits`
               (tests/test_decode_cache.py). Each accepted position must then be run through
               every depth (teacher-forced, in one chunk per depth) to fill those rows.
  "shared"     one cache `[B, ...]` for all depths, with advancing positions (vLLM, SGLang):
               draft step d from position p is written at row / position p + d - 1, so it
               overwrites nothing a later main-model position reuses differently. Cheaper
               (one cache, no catch-up per depth), not what depths > 1 were trained on.

`glm5_jax.infer.step.mtp_step` takes either. Rows are positions in every MLA-family cache, and
a query at position p reads rows 0..p only, so rejected drafts need no rollback there.

Notation (docs/design.md): B slots, S cache rows (max_len), U MTP depths.
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from glm5_jax.attention.kinds import layer_kind
from glm5_jax.config import ModelConfig, require_model_config
from glm5_jax.attention.cache_spec import CacheSpec
from glm5_jax.layer_runs import layer_runs, unrolled_name
from glm5_jax.layers.axes import CACHE_LENGTH, LAYERS
from glm5_jax.sharding import logical_to_mesh_spec

MTP_CACHE_SCHEMES = ("per_depth", "shared")


def _positive_int(value, name: str):
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def layer_cache_specs(cfg: ModelConfig, layer: int, slots: int, max_len: int,
                      max_verify: int = 1) -> dict[str, CacheSpec]:
  """One layer's `{name: CacheSpec}` (layer `num_hidden_layers` is the MTP layer)."""
  kind = layer_kind(cfg.attention_pattern, layer)
  if kind.decode_cache is None:
    raise ValueError(f"decode cache for kind {kind.letter} ({kind.name}, layer {layer}) not "
                     "available: its attention module has no decode form yet")
  return kind.decode_cache(cfg, slots, max_len, max_verify)


def _stacked(specs: dict[str, CacheSpec], n: int, axis) -> dict[str, CacheSpec]:
  return {name: CacheSpec((n,) + s.shape, s.dtype, (axis,) + s.axes, s.fill)
          for name, s in specs.items()}


def cache_specs(config, slots: int, max_len: int, max_verify: int = 1,
                mtp_cache: str = "per_depth", *, mtp_depths: int | None = None) -> dict:
  """The cache tree of `CacheSpec`s (module docstring), nothing allocated.

  Args:
    config: the run's `ModelConfig` (built once by the caller).
    slots: sequences decoded at once (B).
    max_len: cache rows per slot (S): positions 0..max_len - 1 fit.
    max_verify: the most tokens one call brings per slot (k + 1 for verification; sizes ring
      buffers, position-indexed caches ignore it).
    mtp_cache: "per_depth" or "shared" (module docstring).
    mtp_depths: U for "per_depth" (default `model.mtp_depths`; more draft steps than trained
      depths need more).
  Raises:
    ValueError: a bad argument, or a layer kind without a decode cache.
  """
  cfg = require_model_config(config, "cache_specs")
  _positive_int(slots, "slots")
  _positive_int(max_len, "max_len")
  _positive_int(max_verify, "max_verify")
  if max_verify > max_len:
    raise ValueError(f"max_verify={max_verify} exceeds max_len={max_len}")
  if mtp_cache not in MTP_CACHE_SCHEMES:
    raise ValueError(f"mtp_cache must be one of {MTP_CACHE_SCHEMES}, got {mtp_cache!r}")
  depths = cfg.mtp_depths if mtp_depths is None else mtp_depths
  if not isinstance(depths, int) or isinstance(depths, bool) or depths < 0:
    raise ValueError(f"mtp_depths must be an int >= 0, got {mtp_depths!r}")

  spec = lambda layer: layer_cache_specs(cfg, layer, slots, max_len, max_verify)
  tree = {}
  for run in layer_runs(cfg):
    if cfg.scan_layers:
      tree[run.name] = _stacked(spec(run.first), run.length, LAYERS)
    else:
      tree.update({unrolled_name(i): spec(i) for i in range(run.first, run.last + 1)})
  if cfg.num_nextn_predict_layers and depths:
    mtp = spec(cfg.num_hidden_layers)
    tree["mtp"] = _stacked(mtp, depths, None) if mtp_cache == "per_depth" else mtp
  return tree


def _is_spec(x) -> bool:
  return isinstance(x, CacheSpec)


def cache_logical_axes(specs) -> dict:
  """The tree of logical-axis `PartitionSpec`s of a `cache_specs` tree."""
  return jax.tree.map(lambda s: PartitionSpec(*s.axes), specs, is_leaf=_is_spec)


def cache_shardings(specs, mesh, rules) -> dict:
  """`NamedSharding`s of a `cache_specs` tree on `mesh` under `mesh.logical_axis_rules`.

  Raises:
    ValueError: a cache dim not divisible by the mesh axes its logical axis maps to.
  """

  def sharding(path, s: CacheSpec):
    spec = logical_to_mesh_spec(PartitionSpec(*s.axes), rules)
    for dim, (size, axes) in enumerate(zip(s.shape, spec)):
      axes = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
      ways = math.prod(mesh.shape[a] for a in axes)
      if size % ways:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        raise ValueError(f"decode cache {name} dim {dim} (logical {s.axes[dim]!r}, size {size}) "
                         f"is not divisible by mesh axes {axes} ({ways} ways); e.g. use a "
                         "multiple of that many slots")
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(sharding, specs, is_leaf=_is_spec)


def init_cache(config, slots: int, max_len: int, max_verify: int = 1,
               mtp_cache: str = "per_depth", *, mtp_depths: int | None = None, mesh=None,
               rules=None) -> dict:
  """The empty cache tree (`cache_specs`, arguments and errors as there), each array filled
  with its spec's `fill`; sharded on `mesh` by `rules` (`mesh.logical_axis_rules`) when given.
  """
  specs = cache_specs(config, slots, max_len, max_verify, mtp_cache, mtp_depths=mtp_depths)
  return allocate(specs, mesh=mesh, rules=rules)


def allocate(specs, *, mesh=None, rules=None) -> dict:
  """The arrays of a tree of `CacheSpec`s (`cache_specs`, or `glm5_jax.infer.paged.
  paged_specs`), each filled with its spec's `fill`; sharded on `mesh` by `rules` when given."""
  if (mesh is None) != (rules is None):
    raise ValueError("init_cache: give both mesh and rules, or neither")

  def build():
    return jax.tree.map(lambda s: jnp.full(s.shape, s.fill, jnp.dtype(s.dtype)), specs,
                        is_leaf=_is_spec)

  if mesh is None:
    return build()
  return jax.jit(build, out_shardings=cache_shardings(specs, mesh, rules))()


def cache_numbers_per_token(config) -> dict[str, int]:
  """Numbers one token adds to each layer's cache (`layers_{i}`, and `mtp`), read from the
  specs: per position-indexed array (one with a `cache_length` axis), its size per row."""
  cfg = require_model_config(config, "cache_numbers_per_token")
  out = {}
  for layer in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
    specs = layer_cache_specs(cfg, layer, 1, 1)
    name = unrolled_name(layer) if layer < cfg.num_hidden_layers else "mtp"
    out[name] = sum(math.prod(s.shape[2:]) for s in specs.values()
                    if len(s.axes) > 1 and s.axes[1] == CACHE_LENGTH)
  return out


def cache_bytes(specs) -> int:
  """Bytes of a `cache_specs` tree once allocated."""
  return sum(s.size * jnp.dtype(s.dtype).itemsize
             for s in jax.tree.leaves(specs, is_leaf=_is_spec))
