"""Pallas kernels for GLM-5's DeepSeek Sparse Attention, each beside a plain-jnp reference.

Two ops, four implementations each, one signature per op:

| op (function prefix)           | reference (dense) | XLA (gather) | TPU (Mosaic) | GPU (Triton) |
|--------------------------------|-------------------|--------------|--------------|--------------|
| indexer top-k `indexer_topk_*` | `_reference`      | `_xla`       | `_pallas`    | `_triton`    |
| sparse MLA `sparse_mla_*`      | `_reference`      | `_xla`       | `_pallas`    | `_triton`    |

plus `indexer_scores_at` (differentiable index scores at the selected keys) and
`sparse_mla_head_mean_probs` (the indexer KL's target), both XLA, which the sparse training
stage needs on every path, except that the Pallas rows' sparse MLA emit the target from their
own forward kernels (`DSAOps.sparse_mla_with_probs`: `sparse_mla_pallas_with_head_probs`,
`sparse_mla_triton_with_head_probs`) and the XLA row from its attention pass
(`sparse_mla_xla_with_kl_target`); the GPU row's backward kernel emits it too
(`DSAOps.sparse_mla_parts`, for `glm5_jax.attention.dsa_kl_fused`), so a GPU train step runs no
forward pass for it.
`sparse_mla_dense` (XLA, any backend) computes the sparse MLA over every key with the selection
as per-key counts, no gather or scatter (`model.dsa_attention_keys`); its parts
(`sparse_mla_dense_parts`) give the KL target from their backward, as the GPU row's do.
`sparse_mla_dense_expanded` is the same over per-head keys and values (the expanded form,
fewer FLOPs where `N + V < 2 C`, as at GLM-5's dims), with parts of the same kind; XLA, the
reference of `sparse_mla_dense_expanded_pallas`, its flash-attention TPU kernels (the TPU row's
`DSAOps.dense_expanded_parts`), which the model runs over every key with `dsa_impl` "pallas";
their parts' backward gives the indexer KL's target over every key, and the KL's gradient is
TPU kernels too (`indexer_kl_grads_pallas`, beside its reference: `jax.vjp` of the KL at the
selection).
`dsa_ops(model.dsa_impl)` (`pallas_kernels.dispatch`) is the row that runs: "xla"; "pallas" =
the TPU kernels on TPU, the GPU kernels on GPU, an error naming `model.dsa_impl` elsewhere;
"pallas_interpret" = the TPU kernels in interpret mode (CPU tests).
The GPU modules are imported on first use, so a build without them fails only where chosen.

Index contract (every op, reference, XLA and Pallas, forward and backward):

- Empty slots. A selected-key index outside [0, S) is an empty slot, exactly like -1: -1,
  any other negative value, S and above. It adds no term to the softmax (a query with no valid
  slot gets a zero output and lse -inf), gets score -inf from `indexer_scores_at` and
  probability 0 from `sparse_mla_head_mean_probs`, and sends no gradient to any key row. Every
  op that takes indices maps them once on entry (`blocking.empty_out_of_range`), so a gather
  never clamps an index >= S to row S - 1, a Pallas DMA never reads past the keys, and the
  backward sees the selection the forward saw.
- Duplicates. Each slot is one term; nothing is deduplicated (that would cost a sort per
  query). A key selected twice counts twice: in the sparse attention its softmax weight is that
  of a single copy with logit + log 2, and it receives the gradients of both slots (scatter-add);
  `indexer_scores_at` and `sparse_mla_head_mean_probs` give each copy the same score /
  probability (the probabilities of a row still sum to 1 over its slots). The indexer's own
  top-k never selects a key twice (`select_topk` returns distinct positions), so duplicates only
  come from a selection made elsewhere. (The model's "dense_mask" path builds a boolean mask
  from the selection and so counts a duplicated key once: the paths agree only on distinct
  selections, which is what the model produces.)
- Indexer signs. `I[t, s] = sum_j w[t, j] ReLU(q[t, j] . k[s] * scale)` holds as written for
  any sign of the weights `w` and of `scale`: no path takes absolute values or assumes scores
  >= 0. A negative weight makes its head vote against the keys it matches (the model's weights
  come from a linear projection, so they take either sign); a negative scale flips which dot
  products pass the ReLU. Negative and zero scores of visible keys are ordinary candidates,
  ranked above every invisible key (-inf). +0.0 and -0.0 are one score: `select_topk` maps
  -0.0 to +0.0 before sorting (a float sort ranks +0.0 above -0.0), so signed zeros,
  which depend on a backend's accumulation order, cannot change which key wins a tie.

`tests/test_dsa_kernels.py` checks each point on every path.

Every Pallas kernel is compiled for its platform and runs in interpret mode only when asked
(`interpret=True`, or `model.dsa_impl="pallas_interpret"`): nothing falls back to it silently.
The TPU kernels are checked by lowering them for TPU from a CPU host
(`jax.export(..., platforms=["tpu"])`) and by interpret-mode runs; the GPU kernels by lowering
for CUDA from a CPU host and by interpret-mode runs, and on a GPU by `tools/device_suite.py`.
This package imports only jax.
"""

# The GPU (Triton) kernels are not imported here: `dispatch` imports them on first use, and
# their modules' names are the functions' (`pallas_kernels.sparse_mla_triton.sparse_mla_triton`).
from pallas_kernels.dispatch import DSA_OPS, PALLAS_IMPLS, DSAOps, dsa_ops
from pallas_kernels.lightning_indexer import (indexer_scores_at, indexer_scores_reference,
                                              indexer_topk_decode, indexer_topk_reference,
                                              indexer_topk_xla, select_topk)
from pallas_kernels.lightning_indexer_pallas import indexer_scores_pallas, indexer_topk_pallas
from pallas_kernels.sparse_mla import sparse_mla_head_mean_probs, sparse_mla_reference
from pallas_kernels.sparse_mla_pallas import sparse_mla_pallas, sparse_mla_pallas_with_head_probs
from pallas_kernels.sparse_mla_dense import (sparse_mla_dense, sparse_mla_dense_parts,
                                             sparse_mla_dense_with_kl_target)
from pallas_kernels.sparse_mla_dense_expanded import (sparse_mla_dense_expanded,
                                                      sparse_mla_dense_expanded_parts)
from pallas_kernels.indexer_kl_pallas import indexer_kl_grads_pallas
from pallas_kernels.sparse_mla_dense_expanded_pallas import (
    sparse_mla_dense_expanded_pallas, sparse_mla_dense_expanded_pallas_parts)
from pallas_kernels.sparse_mla_xla import sparse_mla_xla, sparse_mla_xla_with_kl_target

__all__ = [
    "DSAOps", "DSA_OPS", "PALLAS_IMPLS", "dsa_ops", "indexer_kl_grads_pallas",
    "indexer_scores_at", "indexer_scores_pallas",
    "indexer_scores_reference", "indexer_topk_decode", "indexer_topk_pallas",
    "indexer_topk_reference",
    "indexer_topk_xla", "select_topk", "sparse_mla_head_mean_probs",
    "sparse_mla_dense", "sparse_mla_dense_expanded", "sparse_mla_dense_expanded_pallas",
    "sparse_mla_dense_expanded_pallas_parts", "sparse_mla_dense_expanded_parts",
    "sparse_mla_dense_parts", "sparse_mla_dense_with_kl_target",
    "sparse_mla_pallas", "sparse_mla_pallas_with_head_probs", "sparse_mla_reference",
    "sparse_mla_xla", "sparse_mla_xla_with_kl_target",
]
