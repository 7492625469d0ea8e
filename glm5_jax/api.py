"""The public model API: `init_params`, `logits`, `forward`, and parameter metadata.

`config` everywhere is the model section of an experiment config (`get_config().model`, the
same ConfigDict `glm5_jax.load_hf` returns) or an already-built `ModelConfig`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from glm5_jax.attention import context_parallel
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.model import GLM5

_INIT_SHAPE = (1, 2)  # smallest input that traces every layer (MoE, DSA, MTP)


def build_model(config) -> GLM5:
  return GLM5(ModelConfig.from_config(config))


def _boxed_init(model: GLM5, rng):
  # Under a mesh with a context axis (the trainer traces the init there) the sequence must
  # split into 2 chunks per context device; the params do not depend on its length.
  batch, length = _INIT_SHAPE
  tokens = jnp.zeros((batch, length * context_parallel.context_ways()), jnp.int32)
  return model.init(rng, tokens)["params"]


def init_params(config, rng):
  """Randomly initialized params (HF's scheme: N(0, initializer_range) kernels, unit norms).

  Returns:
    a plain nested dict of arrays (no partitioning boxes).
  """
  return _init_params(ModelConfig.from_config(config), rng)


@functools.partial(jax.jit, static_argnums=0)  # compiled once per distinct config
def _init_params(cfg: ModelConfig, rng):
  return nn.meta.unbox(_boxed_init(GLM5(cfg), rng))


def abstract_params_and_axes(config):
  """`(shapes, logical_axes)` of the params from one shape-only trace, nothing allocated.

  Returns:
    shapes: tree of `jax.ShapeDtypeStruct`, the structure of `init_params`'s result.
    logical_axes: the same tree of `PartitionSpec`s of logical axis names (for
      `glm5_jax.sharding.param_shardings`).
  """
  model = build_model(config)
  boxed = jax.eval_shape(functools.partial(_boxed_init, model), jax.random.key(0))
  return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def abstract_params(config):
  """`jax.ShapeDtypeStruct` tree of the params, computed without allocating anything."""
  return abstract_params_and_axes(config)[0]


def param_logical_axes(config):
  """Tree (same structure as params) of `PartitionSpec`s of logical axis names."""
  return abstract_params_and_axes(config)[1]


def check_token_ids(tokens_BL, vocab_size: int) -> None:
  """Refuses concrete token ids outside `[0, vocab_size)` or of a non-integer dtype.

  Traced ids (under jit) pass unchecked: their values are unknown here, and the model contains
  them instead (`GLM5`: a bad id embeds as zeros and NaNs only the logits that read it).

  The shape is checked traced or not: `[batch, seq]`, both >= 1 (a 1-D or empty array would
  fail deep in the model with an unpacking or a modulo-by-zero error).

  Raises:
    ValueError: naming the shape, or the first offending id, its position and `vocab_size`.
  """
  shape = tuple(np.shape(tokens_BL))
  if len(shape) != 2 or 0 in shape:
    raise ValueError(f"tokens_BL: expected token ids of shape [batch, seq], both >= 1, got shape "
                     f"{shape}" + (" (one sequence? add a batch axis: tokens[None])"
                                   if len(shape) == 1 and shape[0] else ""))
  if isinstance(tokens_BL, jax.core.Tracer):
    return
  tokens = np.asarray(tokens_BL)
  if not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens_BL: token ids must be integers, got dtype {tokens.dtype}")
  bad = (tokens < 0) | (tokens >= vocab_size)
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"tokens_BL: token id {int(tokens[first])} at position {first} is outside "
                     f"the vocabulary [0, vocab_size={vocab_size}) ({int(bad.sum())} of "
                     f"{tokens.size} ids are)")


def forward(config, params, tokens_BL, positions_BL=None, segment_ids_BL=None, *,
            mode: Mode = Mode(), mtp=True, cache=None, routing=None, return_routing=False):
  """Full model outputs (main logits, MTP logits, final hidden state, aux); see `GLM5`.

  `mode` (`glm5_jax.Mode`) picks the attention form and DSA stage, e.g.
  `Mode(form="absorbed")` or `Mode(dsa_stage="warmup")`; the default is inference's.
  Concrete `tokens_BL` must lie in `[0, vocab_size)` (`check_token_ids`); under jit, an id
  outside makes the logits that read it NaN and leaves the others finite (`GLM5`).
  `Mode(form="decode")` takes the decode `cache` (`glm5_jax.infer.cache`) and returns its update
  in `out["cache"]` (the jitted steps are `glm5_jax.infer.step`). `routing` replays recorded
  MoE experts / DSA keys and `return_routing` returns the ones used as `out["routing"]`
  (`glm5_jax.routing_replay`).
  """
  model = build_model(config)
  check_token_ids(tokens_BL, model.cfg.vocab_size)
  return model.apply({"params": params}, tokens_BL, positions_BL, segment_ids_BL, mode=mode,
                     mtp=mtp, cache=cache, routing=routing, return_routing=return_routing)


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg: ModelConfig, params, tokens_BL):
  return forward(cfg, params, tokens_BL, mtp=False)["logits"]


def logits(config, params, tokens_BL):
  """Main-head logits, float32 `[batch, seq, vocab]`, for int tokens `[batch, seq]`.

  Raises:
    ValueError: a concrete token id outside `[0, vocab_size)` (see `forward` for traced ids).
  """
  cfg = ModelConfig.from_config(config)
  check_token_ids(tokens_BL, cfg.vocab_size)
  return _logits(cfg, params, jnp.asarray(tokens_BL, jnp.int32))
