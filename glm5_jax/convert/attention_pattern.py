"""Loading params into a model whose per-layer attention pattern differs (e.g. M -> S/N/L/D).

The long-context ablation (docs/reference.md section 3) starts from a trained full-attention
model and converts some of its layers; the DSA recipe converts M layers to D. Every attention
kind stores either the M layer's parameters plus kind-specific extras (the "mla" family) or
GQA's own (the "gqa" family). Converting a layer within a family:

  reused   every parameter both kinds have (for the mla family: `MLA_PARAMS` - the q/k/v
           projections, latent norms and o_proj - plus their biases), copied bit for bit;
  new      the target kind's extras the source layer lacks keep their fresh initialization;
  dropped  the source kind's extras the target layer lacks are discarded.

Each kind's family and extras are its `AttentionKind` entry (`glm5_jax.attention.kinds`):
M, R, S, G add nothing, D adds `indexer`, N its convs / gates / output norm, L two scalars
per head ("learned" gates only).

So M -> S / R is a pure copy, M -> D adds a fresh indexer, M -> N adds the conv/gate/norm parts
(initialized so that the convs start as the identity), M -> L adds nothing ("fixed") or two
scalars per head ("learned"), and N -> M or D -> M drops the extras.
Between families (M <-> G) nothing carries over: an error.

`merge_pattern_params` applies these rules from the param trees alone (extras are named
uniquely per kind, so the trees say which kinds arrive and leave); a layer whose kind keeps
its extras must match exactly, and everything outside attention must match exactly. Any other
missing, unexpected or reshaped parameter is an error listing the parameters.
`convert_attention_pattern` is the config-level entry point.

Scanned params (`model.scan_layers`) are converted in the unrolled layout
(`glm5_jax.layer_runs`): a new pattern regroups the runs, so the stacked trees of the two models
need not have the same entries. `merge_pattern_params` itself takes unrolled trees.
"""

import jax
import jax.numpy as jnp
from flax import traverse_util

from glm5_jax.api import abstract_params, init_params
from glm5_jax.attention.kinds import ATTENTION_KINDS, KINDS_BY_NAME
from glm5_jax import layer_runs
from glm5_jax.config import ModelConfig
from glm5_jax.layer_runs import as_unrolled

ATTENTION_SCOPE = "self_attn"


def _attention_children(flat: dict) -> dict:
  """`{path to a self_attn scope: set of its children's names}`."""
  blocks = {}
  for path in flat:
    if ATTENTION_SCOPE in path:
      i = path.index(ATTENTION_SCOPE)
      blocks.setdefault(path[:i + 1], set()).add(path[i + 1])
  return blocks


def _changing_extras(fresh_children: set, loaded_children: set) -> tuple[set, set]:
  """(extras that arrive, extras that leave) in one attention block: a kind's extras arrive
  when the loaded block has none of them, and leave when the fresh block has none."""
  arriving, leaving = set(), set()
  for extras in (k.extra_params for k in ATTENTION_KINDS.values() if k.extra_params):
    if not extras & loaded_children:
      arriving |= extras & fresh_children
    if not extras & fresh_children:
      leaving |= extras & loaded_children
  return arriving, leaving


def merge_pattern_params(fresh, loaded, source: str, context: str = "config.train.init_from"):
  """Params shaped like `fresh` taken from `loaded` (see the module docstring for the rules).

  Args:
    fresh: this model's freshly initialized params, or its `jax.ShapeDtypeStruct`s (then the
      new parameters come back as those structs, for the caller to initialize).
    loaded: the other model's params.
    source: names `loaded` in error messages (e.g. a checkpoint path and its pattern).
    context: the config field or function the error message starts with.
  Returns:
    a nested dict of arrays in `fresh`'s dtypes (new parameters: `fresh`'s leaves).
  Raises:
    ValueError: listing every parameter missing from `loaded`, unexpected in it, or of another
      shape, that the conversion rules do not account for.
  """
  flat_fresh, flat_loaded = traverse_util.flatten_dict(fresh), traverse_util.flatten_dict(loaded)
  fresh_blocks, loaded_blocks = _attention_children(flat_fresh), _attention_children(flat_loaded)
  arriving, leaving = set(), set()  # (block path, child name)
  for block in set(fresh_blocks) | set(loaded_blocks):
    new, gone = _changing_extras(fresh_blocks.get(block, set()), loaded_blocks.get(block, set()))
    arriving |= {block + (name,) for name in new}
    leaving |= {block + (name,) for name in gone}

  def extra_of(path, blocks):
    return any(path[:n] in blocks for n in range(1, len(path) + 1))

  problems = []
  for path in sorted(set(flat_loaded) - set(flat_fresh)):
    if not extra_of(path, leaving):
      problems.append(f"{'/'.join(path)} is in {source} but not in this model")
  merged = {}
  for path, value in flat_fresh.items():
    if path not in flat_loaded:
      if not extra_of(path, arriving):
        problems.append(f"{'/'.join(path)} is missing from {source}")
      merged[path] = value
    elif flat_loaded[path].shape != value.shape:
      problems.append(f"{'/'.join(path)} has shape {flat_loaded[path].shape} in {source}, "
                      f"{value.shape} here")
    else:
      merged[path] = jnp.asarray(flat_loaded[path], value.dtype)
  if problems:
    raise ValueError(f"{context}: incompatible params:\n  " + "\n  ".join(problems[:30])
                     + (f"\n  ... and {len(problems) - 30} more" if len(problems) > 30 else ""))
  return traverse_util.unflatten_dict(merged)


def layer_kinds(cfg: ModelConfig) -> dict[str, str]:
  """`{"layers_{i}" or "mtp": attention kind}` of every attention layer of the model."""
  kinds = {f"layers_{i}": cfg.attention_kind(i) for i in range(cfg.num_hidden_layers)}
  if cfg.num_nextn_predict_layers:
    kinds["mtp"] = cfg.attention_kind(cfg.num_hidden_layers)
  return kinds


def convert_attention_pattern(loaded_params, source_model_config, target_model_config, rng):
  """Params of the target model from a source model's params, layer by layer.

  Args:
    loaded_params: params of the source model (checked against `source_model_config`).
    source_model_config, target_model_config: `model` ConfigDicts or `ModelConfig`s; they may
      differ in `attention_pattern` and the attention-variant fields (`sliding_window`,
      `gdn_*`, `simple_gdn_*`), everything that shapes other parameters must agree.
    rng: PRNG key for the target's fresh init, which the new parameters keep.
  Returns:
    the target model's params (nested dict of arrays).
  Raises:
    ValueError: the source params do not match the source config; a layer would change
      family (MLA kinds <-> GQA); or any parameter the rules do not account for.
  """
  source = ModelConfig.from_config(source_model_config)
  target = ModelConfig.from_config(target_model_config)
  if source.num_hidden_layers != target.num_hidden_layers:
    raise ValueError(f"convert_attention_pattern: model.num_hidden_layers differs "
                     f"({source.num_hidden_layers} in the source, {target.num_hidden_layers} "
                     "in the target); only the attention pattern may change")
  expected = {p: v.shape for p, v in traverse_util.flatten_dict(abstract_params(source)).items()}
  got = {p: v.shape for p, v in traverse_util.flatten_dict(loaded_params).items()}
  if expected != got:
    wrong = sorted(set(expected.items()) ^ set(got.items()))
    raise ValueError("convert_attention_pattern: loaded_params do not match source_model_config "
                     f"(pattern {source.attention_pattern!r}); differing entries: "
                     + ", ".join(f"{'/'.join(p)} {s}" for p, s in wrong[:10]))
  source_kinds, target_kinds = layer_kinds(source), layer_kinds(target)
  crossing = [f"{layer}: {source_kinds[layer]} -> {kind}" for layer, kind in target_kinds.items()
              if layer in source_kinds and KINDS_BY_NAME[source_kinds[layer]].family
              != KINDS_BY_NAME[kind].family]
  if crossing:
    raise ValueError("convert_attention_pattern: model.attention_pattern "
                     f"{source.attention_pattern!r} -> {target.attention_pattern!r} changes "
                     "the attention family of " + ", ".join(crossing) + "; GQA and MLA-family "
                     "layers share no parameters, so nothing would carry over")
  # Merge into the target's shapes first: every error surfaces before anything is compiled,
  # and only the parameters that are really new get initialized.
  merged = traverse_util.flatten_dict(merge_pattern_params(
      as_unrolled(abstract_params(target), target), as_unrolled(loaded_params, source),
      f"the source model (pattern {source.attention_pattern!r})",
      context="convert_attention_pattern"))
  new_paths = tuple(p for p, v in merged.items() if isinstance(v, jax.ShapeDtypeStruct))
  if new_paths:
    merged.update(zip(new_paths, _fresh_leaves(target, new_paths, rng)))
  return layer_runs.as_layout_of(target, traverse_util.unflatten_dict(merged))


def _fresh_leaves(cfg: ModelConfig, paths: tuple, rng) -> list:
  """The leaves at `paths` of `init_params(cfg, rng)`, bit for bit; under one jit XLA drops
  the initialization of every other parameter, so the full model is never materialized."""
  return jax.jit(lambda key: [
      traverse_util.flatten_dict(as_unrolled(init_params(cfg, key), cfg))[p] for p in paths])(rng)
