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

Supported kinds: `SUPPORTED_KINDS` (MLA, DSA, shared-top-k DSA, and SWA, which runs as
shared-top-k DSA handed its window). GQA (G) and the recurrent kinds (N, L: a chunked scan over
the whole sequence) are refused (`check_context_parallel`).

The split is contiguous: device i holds positions [i L / c, (i + 1) L / c). Causal attention
therefore gives later devices more keys per query than earlier ones (no load-balanced striping
yet; docs/scaling.md, "Context parallelism").

Notation (docs/design.md): B batch, L queries, S keys, C kv latent, R RoPE dim, I index head dim.
"""

from glm5_jax.attention.kinds import ATTENTION_KINDS, KINDS_BY_NAME
from glm5_jax.config import ConfigError
from glm5_jax.layers.axes import BATCH, LENGTH
from glm5_jax.layers.params import constrain, context_split

SUPPORTED_KINDS = ("mla", "dsa", "dsa_shared_topk", "swa")


def check_context_parallel(pattern: str, context: int, seq_len: int, seq_len_field: str):
  """Raises ConfigError unless a model with the expanded attention `pattern` (its MTP layer
  runs a kind of the same family letters, `AttentionKind.mtp_letter`) can split sequences of
  `seq_len` tokens over a `context` axis of that size.

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
  if seq_len % context:
    raise ConfigError(
        f"config.{seq_len_field}={seq_len} does not split over mesh.shape.context={context} "
        f"devices; use a multiple of {context}")


def context_ways() -> int:
  """How many ways the mesh in context (`jax.set_mesh`) splits the sequence; 1 outside one."""
  return context_split(LENGTH)


def gather_keys(x_BS_):
  """`x_BS_` (`[B, S, ...]`, one row of key state per token) replicated over the sequence's
  mesh axes, i.e. all-gathered over `context`, the batch left on its own devices."""
  return constrain(x_BS_, (BATCH,) + (None,) * (x_BS_.ndim - 1))

