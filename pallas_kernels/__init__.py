"""Pallas kernels for GLM-5's DeepSeek Sparse Attention, each beside a plain-jnp reference.

Two ops, three implementations each, one signature per op:

| op | reference (jnp, dense) | XLA path (blockwise gather) | Pallas (TPU kernel) |
|---|---|---|---|
| indexer top-k | `indexer_topk_reference` | `indexer_topk_xla` | `indexer_topk_pallas` |
| sparse MLA    | `sparse_mla_reference`   | `sparse_mla_xla`   | `sparse_mla_pallas`   |

plus `indexer_scores_at` (differentiable index scores at the selected keys) and
`sparse_mla_head_mean_probs` (the indexer KL's target), both XLA, which the sparse training
stage needs on every path. `DSA_OPS[impl]` is what `model.dsa_impl` selects.

Pallas kernels target TPU (Mosaic) and run in interpret mode elsewhere. There is no GPU Pallas
variant: no GPU was available when they were written, so on GPU use "xla" (plain XLA, no
backend-specific code). The TPU kernels are checked by lowering them for TPU from a CPU host
(`jax.export(..., platforms=["tpu"])`) and by interpret-mode runs; they have not yet been
compiled or timed on a real TPU. This package imports only jax.
"""

import typing

from pallas_kernels.lightning_indexer import (indexer_scores_at, indexer_scores_reference,
                                              indexer_topk_reference, indexer_topk_xla,
                                              select_topk)
from pallas_kernels.lightning_indexer_pallas import indexer_scores_pallas, indexer_topk_pallas
from pallas_kernels.sparse_mla import (sparse_mla_head_mean_probs, sparse_mla_reference,
                                       sparse_mla_xla)
from pallas_kernels.sparse_mla_pallas import sparse_mla_pallas


class DSAOps(typing.NamedTuple):
  """One implementation of the two DSA ops (signatures as the references)."""

  indexer_topk: typing.Callable
  sparse_mla: typing.Callable


DSA_OPS = {
    "reference": DSAOps(indexer_topk_reference, sparse_mla_reference),
    "xla": DSAOps(indexer_topk_xla, sparse_mla_xla),
    "pallas": DSAOps(indexer_topk_pallas, sparse_mla_pallas),
}

__all__ = [
    "DSAOps", "DSA_OPS", "indexer_scores_at", "indexer_scores_pallas", "indexer_scores_reference",
    "indexer_topk_pallas", "indexer_topk_reference", "indexer_topk_xla", "select_topk",
    "sparse_mla_head_mean_probs", "sparse_mla_pallas", "sparse_mla_reference", "sparse_mla_xla",
]
