"""The planner's decode program: the inference engine's own decode step, compiled from abstract
inputs with the decode cache as a real, sharded program argument.

What compiles is `glm5_jax.infer.programs.decode_and_sample`, the jitted function
`Engine._decode` calls for every generated token: one token per slot through the main model
(`infer.step.decode_step`: the layers read and update the cache in place), then sampling
(temperature / top-k / top-p per slot). Its arguments, as `ShapeDtypeStruct`s with the
`NamedSharding`s `Engine` places them with (`mesh.logical_axis_rules`):

  params    the served model's params (`model.quant` quantized leaves included: W4A8 stores the
            routed experts as packed INT4 + fp32 group scales, the other kernels INT8)
  cache     `infer.cache.cache_specs(model, sequences, cache_len)`, the MLA latent, RoPE key
            and DSA indexer keys of every layer, slots split over the batch axes
            ("contiguous"); or the paged pool (`infer.paged.paged_specs`, pages of `page_size`
            rows, enough for every slot at `cache_len`) with each slot's page table, as the
            engine's default paged cache ("paged")
  the slot arrays: pending token, fed rows, active flags, sampling settings, seeds, index

The cache is donated, as the engine donates it: the new cache aliases the old one, so the
compiled `argument` bytes hold params + cache and `temp` is the step's own workspace.

Notation (docs/design.md): B slots (= sequences), S cache rows per slot (cache_len), N pages
per slot in a paged step's view.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from glm5_jax.api import abstract_params_and_axes
from glm5_jax.attention.cache_spec import CacheSpec
from glm5_jax.attention.kinds import layer_kind
from glm5_jax.config import ModelConfig
from glm5_jax.infer import paged
from glm5_jax.infer.cache import cache_shardings, cache_specs
from glm5_jax.infer.penalties import MAX_BIASED_TOKENS, Penalties
from glm5_jax.infer.programs import Paging, decode_and_sample
from glm5_jax.infer.sampling import SamplingParams
from glm5_jax.layer_runs import layer_indices
from glm5_jax.layers.axes import BATCH
from glm5_jax.planning.planner import Program, _needs_moe_standin, _with_shardings, sharded_bytes
from glm5_jax.sharding import logical_to_mesh_spec, make_mesh, param_shardings

CACHE_LAYOUTS = ("contiguous", "paged")
# The cache arrays a DSA decode step (a layer that selects top-k rows, or reuses the previous
# layer's selection) reads only at its top-k rows (the indexer keys `index_k` are scored at
# every row); other kinds (M, S, ...) read every row they hold.
_TOPK_READ = ("ckv", "k_rope")


def _is_spec(x) -> bool:
  return isinstance(x, CacheSpec)


def decode_program(config, devices=None, *, cache_len: int, sequences: int,
                   cache_layout: str = "contiguous", page_size: int = 64) -> Program:
  """The engine's decode step for `sequences` slots of `cache_len` cache rows (module
  docstring) on `devices` (default: jax's; or an AOT target's). `Program.cache_bytes` and
  `Program.read_bytes` (per device) are set for the report.

  Raises:
    ValueError: an unknown `cache_layout`; slots that do not split over the batch axes
      (`infer.cache.cache_shardings` names the array and the axes).
  """
  if cache_layout not in CACHE_LAYOUTS:
    raise ValueError(f"cache_layout must be one of {CACHE_LAYOUTS}, got {cache_layout!r}")
  model = ModelConfig.from_config(config.model)
  mesh = make_mesh(config.mesh, devices)
  rules = config.mesh.logical_axis_rules
  shapes, logical_axes = abstract_params_and_axes(model)
  params = _with_shardings(shapes, param_shardings(shapes, logical_axes, mesh, rules))
  specs = cache_specs(model, sequences, cache_len, mtp_depths=0)  # plain decode: no MTP cache
  paging, table = None, None
  slot_sharding = NamedSharding(mesh, logical_to_mesh_spec(PartitionSpec(BATCH), rules))
  row_sharding = NamedSharding(mesh, logical_to_mesh_spec(PartitionSpec(BATCH, None), rules))
  if cache_layout == "paged":
    pages = paged.pages_for(cache_len, page_size)
    layout = paged.page_layout(specs)
    specs = paged.paged_specs(specs, page_size, sequences * pages + 1)  # + the reserved page 0
    paging = Paging(layout, min(model.index_topk, cache_len))
    table = jax.ShapeDtypeStruct((sequences, pages), jnp.int32, sharding=row_sharding)
  cache = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)), specs,
                       is_leaf=_is_spec)
  cache_sharding = cache_shardings(specs, mesh, rules)
  cache = _with_shardings(cache, cache_sharding)
  slot = lambda dtype: jax.ShapeDtypeStruct((sequences,), dtype, sharding=slot_sharding)
  settings = SamplingParams(slot(jnp.float32), slot(jnp.int32), slot(jnp.float32))
  rows = lambda shape, dtype: jax.ShapeDtypeStruct((sequences,) + shape, dtype,
                                                   sharding=row_sharding)
  counts = rows((model.vocab_size,), jnp.int32)
  adjust = Penalties(slot(jnp.float32), slot(jnp.float32), rows((MAX_BIASED_TOKENS,), jnp.int32),
                     rows((MAX_BIASED_TOKENS,), jnp.float32))
  args = (params, cache, counts, slot(jnp.int32), slot(jnp.int32), slot(jnp.bool_), settings,
          slot(jnp.uint32), adjust, slot(jnp.int32), table)

  def step(params, cache, counts_BY, pending_B, fed_B, active_B, settings, seeds_B, adjust,
           index_B, table_BN):
    return decode_and_sample(model, params, cache, counts_BY, pending_B, fed_B, active_B,
                             settings, seeds_B, adjust, index_B, table_BN, return_logits=False,
                             paging=paging)

  shardings = jax.tree.map(lambda a: a.sharding, args)
  fn = jax.jit(step, keep_unused=True, in_shardings=shardings,
               out_shardings=(cache_sharding, None, None, None), donate_argnums=(1, 2))
  return Program(fn, args, mesh, rules, sharded_bytes(args), _needs_moe_standin(model, mesh),
                 cache_bytes=sharded_bytes(cache),
                 read_bytes=dsa_read_bytes(cache, model, cache_len))


def dsa_read_bytes(cache, model: ModelConfig, cache_len: int) -> int:
  """Per-device cache bytes one decode step reads at full context: in a DSA layer the indexer
  keys of every row, the latent and RoPE key (`_TOPK_READ`) of the `model.index_topk` selected
  rows only; every other layer's cache whole. `cache`: a `cache_specs` tree without MTP."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
    shard = sharded_bytes([leaf])
    name = str(getattr(path[-1], "key", path[-1]))
    kind = layer_kind(model.attention_pattern, layer_indices(path[0].key)[0])
    topk = kind.provides_topk or kind.needs_prev_topk
    total += (shard * min(model.index_topk, cache_len) // cache_len
              if topk and name in _TOPK_READ else shard)
  return total


def most_sequences(hbm_bytes: float, fixed: float, per_sequence: float, workspace: float,
                   ways: int) -> int:
  """The most sequences (a multiple of `ways`, the devices the slots split over) whose decode
  step fits `hbm_bytes` per device: `fixed` (params and slot arrays) + `per_sequence` x n (the
  cache, per device per sequence of the total) + `workspace` (temp and unaliased output)."""
  room = hbm_bytes - fixed - workspace
  return max(int(room // per_sequence) // ways * ways, 0) if per_sequence > 0 else 0
