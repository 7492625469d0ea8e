"""Logical axis names: the one spelling of every name a parameter or activation dimension carries.

`mesh.logical_axis_rules` (defaults: `glm5_jax.config.default_logical_axis_rules`) map these
names onto mesh axes, and a dimension whose name no rule lists stays replicated. A misspelled
name would therefore replicate a weight without any error, so code spells names only through
these constants, and `layers.params.param` and `constrain` refuse any name not in `ALL`.
"""

import jax


BATCH = "batch"  # B (activations)
LENGTH = "length"  # L (activations)
EMBED = "embed"  # D
VOCAB = "vocab"  # Y
MLP = "mlp"  # F of dense FFNs and shared experts
HEADS = "heads"  # H
KV_HEADS = "kv_heads"  # G
HEAD_DIM = "head_dim"  # K / V / N per head
Q_LORA = "q_lora"  # Q
KV_LORA = "kv_lora"  # C (+ R)
INDEX_HEADS = "index_heads"  # J
EXPERT = "expert"  # E
EXPERT_MLP = "expert_mlp"  # F of routed experts
NORM = "norm"  # norm scales and biases
LAYERS = "layers"  # stacked decoder layers of one scanned run (`glm5_jax.layer_runs`)
# S of a decode cache (row p = position p, `glm5_jax.infer.cache`); no default rule: replicated.
CACHE_LENGTH = "cache_length"

ALL = frozenset({BATCH, LENGTH, EMBED, VOCAB, MLP, HEADS, KV_HEADS, HEAD_DIM, Q_LORA, KV_LORA,
                 INDEX_HEADS, EXPERT, EXPERT_MLP, NORM, LAYERS, CACHE_LENGTH})


def check(axes, what: str) -> tuple:
  """`axes` as a tuple, each entry None or a name in `ALL`; else a ValueError naming `what`."""
  unknown = [a for a in axes if a is not None and a not in ALL]
  if unknown:
    raise ValueError(f"{what}: unknown logical axis names {unknown}; use the constants of "
                     f"glm5_jax.layers.axes ({sorted(ALL)})")
  return tuple(axes)


def spec_axes(entry) -> tuple[str, ...]:
  """One entry of a PartitionSpec (None, a mesh axis name, or a tuple of them) as a tuple of
  mesh axis names."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def context_mesh():
  """The mesh set by `jax.set_mesh` (`glm5_jax.sharding.activation_sharding`), or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh
