"""Context parallelism: one sequence's tokens split over the `context` mesh axis.

The `length` logical axis maps to the `context` mesh axis (`glm5_jax.sharding`), so the
residual stream `[B, L, D]` holds each device's own positions, and every token-wise op (norms,
projections, dense FFN, MoE routing and dispatch) runs on them unchanged. Only attention mixes
positions: an MLA / DSA layer keeps its queries local and gathers over `context` the small
per-token key state its queries need, the kv latent (`ckv [B, S, C]` and `k_rope [B, S, R]`,
C + R = 576 per token for GLM-5) and the DSA indexer keys (`k_BSI`, I = 128 per token), never
per-head keys or values. The gather is stated as sharding constraints (`gather_keys`), and
XLA's SPMD partitioner places the all-gather; the DSA top-k then runs over every visible key
of the whole sequence; the keys' document (segment) ids reach every device too (the partitioner
gathers them where the key side reads them), so packed documents that straddle a shard boundary
are respected.

Supported kinds: `SUPPORTED_KINDS` (MLA, DSA, shared-top-k DSA, SWA, which runs as shared-top-k
DSA handed its window, and GQA, whose per-token K and V, 2 G K numbers, are gathered the same
way). The recurrent kinds (N, L: a chunked scan over the whole sequence) are refused
(`check_context_parallel`).

Layouts (`Mode.context_layout`):
  "contiguous"  device i holds positions [i L / c, (i + 1) L / c). Causal attention gives later
                devices more keys per query: the last device does 2c - 1 times the first's
                dense attention work (`causal_work`).
  "striped"     the caller permutes its `[B, L]` inputs by `stripe_order(L, c)` (`stripe`): the
                sequence in 2c chunks, device i holding chunks i and 2c - 1 - i, so each device
                does the same causal work (exactly, for one document per row). Inside attention
                the gathered key state is put back in sequence order (`whole_sequence`: a static
                permutation of rows every device already holds), each query carries its
                sequence index (`query_index`), and the masks, the indexer's top-k (its tie rule
                prefers the lower sequence index), the sliding windows and the MTP shift use
                that index. Top-k indices are sequence indices in both layouts.

Notation (docs/design.md): B batch, L queries, S keys, C kv latent, R RoPE dim, I index head dim.
"""

import jax.numpy as jnp
import numpy as np

from glm5_jax.attention.kinds import ATTENTION_KINDS, KINDS_BY_NAME
from glm5_jax.config import ConfigError
from glm5_jax.layers.axes import BATCH, LENGTH
from glm5_jax.layers.params import constrain, context_split

SUPPORTED_KINDS = ("mla", "dsa", "dsa_shared_topk", "swa", "gqa")


def check_context_parallel(pattern: str, context: int, seq_len: int, seq_len_field: str,
                           layout: str = "contiguous"):
  """Raises ConfigError unless a model with the expanded attention `pattern` (its MTP layer
  runs a kind of the same family letters, `AttentionKind.mtp_letter`) can split sequences of
  `seq_len` tokens over a `context` axis of that size in `layout` (`Mode.context_layout`; the
  striped layout cuts the sequence into 2 x context chunks).

  Args:
    seq_len_field: the config field the sequence length came from, for the error.
  """
  if context == 1:
    return
  letters = set(pattern) | {ATTENTION_KINDS[pattern[-1]].mtp_letter}
  bad = sorted(ATTENTION_KINDS[x].name for x in letters
               if ATTENTION_KINDS[x].name not in SUPPORTED_KINDS)
  if bad:
    supported = "".join(k.letter for k in KINDS_BY_NAME.values() if k.name in SUPPORTED_KINDS)
    raise ConfigError(
        f"config.mesh.shape.context={context}: attention kinds {bad} do not support context "
        f"parallelism (supported: {SUPPORTED_KINDS}, pattern letters {supported!r}); set "
        "mesh.shape.context=1 or change model.attention_pattern")
  chunks = context * (2 if layout == "striped" else 1)
  if seq_len % chunks:
    what = (f"mesh.shape.context={context} devices" if layout == "contiguous" else
            f"the {chunks} chunks of the striped layout over mesh.shape.context={context}")
    raise ConfigError(f"config.{seq_len_field}={seq_len} does not split over {what}; use a "
                      f"multiple of {chunks}")


def context_ways() -> int:
  """How many ways the mesh in context (`jax.set_mesh`) splits the sequence; 1 outside one."""
  return context_split(LENGTH)


def gather_keys(x_BS_):
  """`x_BS_` (`[B, S, ...]`, one row of key state per token) replicated over the sequence's
  mesh axes, i.e. all-gathered over `context`, the batch left on its own devices."""
  return constrain(x_BS_, (BATCH,) + (None,) * (x_BS_.ndim - 1))



def stripe_order(length: int, ways: int) -> np.ndarray:
  """int32 `[L]`: the sequence index each slot of the striped layout holds. The sequence is cut
  into 2 `ways` chunks of L / (2 ways); the i-th of the `ways` equal parts of the axis (device
  i's under a contiguous split) holds chunks i and 2 ways - 1 - i. The identity for ways = 1."""
  if length % (2 * ways) and ways > 1:
    raise ValueError(f"stripe_order: length {length} is not a multiple of 2 x {ways} chunks")
  if ways == 1:
    return np.arange(length, dtype=np.int32)
  m = length // (2 * ways)
  chunks = [k for i in range(ways) for k in (i, 2 * ways - 1 - i)]
  return np.concatenate([np.arange(k * m, (k + 1) * m) for k in chunks]).astype(np.int32)


def stripe(x, ways: int, axis: int = 1):
  """`x` with its sequence axis (length L) in the striped order for `ways` devices."""
  return jnp.take(x, stripe_order(x.shape[axis], ways), axis=axis)


def unstripe(x, ways: int, axis: int = 1):
  """Inverse of `stripe`: the sequence axis back in sequence order."""
  return jnp.take(x, np.argsort(stripe_order(x.shape[axis], ways)), axis=axis)


def layout_ways(layout: str) -> int:
  """The ways the striped `layout` permutes the sequence for: the context axis in context; 1
  (no permutation) for the contiguous layout."""
  return context_ways() if layout == "striped" else 1


def query_index(batch: int, length: int, layout: str):
  """int32 `[B, L]`: the sequence index of each of the L local-order queries."""
  order = stripe_order(length, layout_ways(layout))
  return jnp.broadcast_to(jnp.asarray(order), (batch, length))


def whole_sequence(x_BS_, layout: str):
  """Per-token key state `x_BS_` (`[B, S, ...]`, slots in `layout`'s order) on every device of
  the context axis (`gather_keys`), in sequence order: row s holds token s."""
  if context_ways() > 1:
    x_BS_ = gather_keys(x_BS_)
  ways = layout_ways(layout)
  return x_BS_ if ways == 1 else unstripe(x_BS_, ways)


def along_sequence(fn, x_BL, layout: str):
  """`fn` (a map of `[B, L]` arrays in sequence order, e.g. the MTP shift) applied to `x_BL`,
  whose slots are in `layout`'s order; the result in that order. For int ids and masks: the
  permutations move 4 bytes per token."""
  ways = layout_ways(layout)
  return fn(x_BL) if ways == 1 else stripe(fn(unstripe(x_BL, ways)), ways)


def causal_work(segment_ids_BL: np.ndarray, ways: int, layout: str) -> np.ndarray:
  """int `[ways]`: the (query, key) pairs each device's queries attend to under causal,
  same-document attention (dense attention's work; the DSA indexer's score pass is the same
  mask), for natural-order document ids `segment_ids_BL` split `ways` ways in `layout`."""
  seg = np.asarray(segment_ids_BL)
  length = seg.shape[1]
  index = np.arange(length)
  visible_BLS = (index[None, None, :] <= index[None, :, None]) & (seg[:, :, None] == seg[:, None, :])
  per_query_L = visible_BLS.sum(axis=(0, 2))
  order = stripe_order(length, ways) if layout == "striped" else index
  return per_query_L[order].reshape(ways, -1).sum(axis=1)
