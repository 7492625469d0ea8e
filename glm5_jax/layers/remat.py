"""Named rematerialization policies for the decoder layers (`model.remat_policy`).

A policy says which intermediates of a layer's forward pass are kept for the backward pass;
everything else is recomputed from the layer's input (`jax.checkpoint`). Each layer runs under
the policy (`glm5_jax.model`), so with `full` only the residual stream between layers stays
live, one `[B, L, D]` per layer.

  none             keep everything (no `jax.checkpoint`; the most memory, no recompute)
  full             keep nothing inside the layer: recompute its whole forward
  dots             keep every matmul output (`dots_saveable`)
  dots_no_batch    keep matmul outputs without batch dims, i.e. the weight projections, not
                   attention scores (`dots_with_no_batch_dims_saveable`)
  save_qkv_proj    keep only the attention inputs tagged `query_proj`, `key_proj`,
                   `value_proj` (GQA: the projected q, k, v; MLA: the per-head queries and the
                   shared `[C + R]` key/value latent), recompute the rest
  save_qkv_attn    also keep the attention output (`attention_out`), so the backward pass
                   never reruns the attention itself
  save_attn_lse    keep the sparse attention's output and log-sum-exp (the residuals of the sparse
                   MLA kernels' custom VJP, `sparse_mla_out` / `sparse_mla_lse`, named inside its
                   forward rule), the DSA selection (`dsa_topk`) and the indexer KL's target
                   (`indexer_kl_target`, `[B, L, T]`), and the MoE's exchanged counts and weights
                   (below): the backward reruns the projections and the FFN / MoE (not the exchanges
                   of counts and weights), but none of the indexer top-k, the sparse forward or the
                   KL target pass (the KL's own scores need no name: they live inside
                   `indexer_scores_at`'s per-block checkpoint). Per DSA layer that keeps B L H C
                   (bf16) + 2 B L T (fp32 / int32) + B L H (fp32) numbers (3B config at 8 x 4,096
                   tokens: ~2.7 GB per layer). Layers without sparse attention save nothing under it
                   (full remat there). Where the KL target comes from the attention's backward
                   (`glm5_jax.attention.dsa_kl_fused`: the GPU kernels, and the sparse stage over
                   every key, `model.dsa_attention_keys`), there is no `indexer_kl_target` to keep.
  save_selections  keep only what the forward chose: the DSA selection (`dsa_topk`, int32
                   `[B, L, T]`), the indexer KL's target (`indexer_kl_target`, fp32 `[B, L, T]`,
                   where the attention pass forms it), and the expert-parallel dispatch's
                   exchanged counts and the router weights it sent with the rows
                   (`moe_exchanged_counts`, `moe_exchanged_weights`, `glm5_jax.moe_parallel`:
                   a few KiB, and ~160 KiB a chunk); recompute the rest. The backward's rerun
                   of the layer then runs no indexer top-k (its scores over every key, the
                   sort), no head-mean target and no count or weight exchange, but does rerun
                   the sparse attention's forward for its output and log-sum-exp. Up to
                   2 B L T 4-byte numbers per DSA layer (744B headline, 8,192 tokens a device,
                   the target from the backward: 64 MiB a layer, 4.7 GiB over its 75 sparse
                   layers).
  save_selections_o_proj
                   `save_selections`, and each layer's attention output after its output
                   projection (`o_proj_out`, `[B, L, D]`, what the layer adds to the residual
                   stream): the rerun then starts the FFN / MoE from `x + o_proj_out` and never
                   runs `o_proj`, the largest attention matmul (its backward needs only its
                   input). B L D numbers more per layer run (744B headline: 96 MiB, 7.6 GiB over
                   its 78 layers and the MTP layer's 3 depths; 20.41 -> 19.65 s a step by the
                   TPU compiler's estimate, docs/scaling.md). Also the query up-projection's
                   kernel as gathered over fsdp for the forward's product (`q_b_proj_gathered`,
                   `[Q, H, N + R]` in the compute dtype, its heads still split as the params
                   are): the rerun and the backward use it and do not gather it again (744B
                   headline: 64 MiB a layer, +5.8 GiB; a gather the TPU compiler issued late
                   in the backward, 0.27 s a step exposed, docs/scaling.md).
  save_selections_attn_out
                   `save_selections`, `o_proj_out`, and the sparse attention's output and
                   log-sum-exp (`sparse_mla_out`, `sparse_mla_lse`, as `save_attn_lse`): the
                   rerun then runs no sparse attention forward, only the projections its
                   backward needs, and the FFN / MoE. The query up-projection's gathered kernel
                   is not kept: the rerun gathers it again. 744B headline: `[B, L, H, V]` bf16
                   a DSA layer run (256 MiB) kept, `q_b_proj_gathered`'s 64 MiB not: 93.10
                   against 75.46 GiB a device, and 0.30 s a step less compute by the TPU
                   compiler's estimate, 0.25 s of it back as that gather's wait
                   (docs/scaling.md).
  save_selections_offload_attn_out
                   `save_selections_attn_out` with the sparse attention's output in host memory
                   (`pinned_host`) in the runs of MoE layers: the forward copies each such
                   layer's `[B, L, H, V]` out (XLA's asynchronous host transfers, which the TPU
                   compiler pipelines into the scan's next iteration) and the backward copies it
                   back before the attention's backward needs it. The dense layers and the MTP
                   depths keep theirs on the device (`checkpoint_policy(..., offload=False)`):
                   a few layers' worth, not worth their transfers. 744B accumulating headline (4
                   x 8,192 tokens a device): 256 MiB a MoE layer run, 18.75 GiB a microbatch, off
                   the device (docs/scaling.md). Backends with pinned host memory (TPU, GPU;
                   XLA:CPU, whose two memories are one RAM, compiles the copies away).
  offload_dots     `dots_no_batch`, but the kept projections go to host memory
                   (`offload_dot_with_no_batch_dims`; backends with pinned host memory, TPU/GPU)

The tagged names are set with `jax.ad_checkpoint.checkpoint_name` in the attention modules (and
in the sparse MLA kernels' VJP forward rules, `pallas_kernels.sparse_mla.named_residuals`: a
name on a custom VJP's result outside it does not stop jax from rerunning its forward for the
residuals).
"""

import jax

SAVED_NAMES = {
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "save_qkv_attn": ("query_proj", "key_proj", "value_proj", "attention_out"),
    "save_attn_lse": ("sparse_mla_out", "sparse_mla_lse", "dsa_topk", "indexer_kl_target",
                      "moe_exchanged_counts", "moe_exchanged_weights"),
    "save_selections": ("dsa_topk", "indexer_kl_target", "moe_exchanged_counts",
                        "moe_exchanged_weights"),
}
SAVED_NAMES["save_selections_o_proj"] = (*SAVED_NAMES["save_selections"], "o_proj_out",
                                         "q_b_proj_gathered")
SAVED_NAMES["save_selections_attn_out"] = (*SAVED_NAMES["save_selections"], "o_proj_out",
                                           "sparse_mla_out", "sparse_mla_lse")
# Kept on the device / sent to host memory, by name.
OFFLOADED_NAMES = {
    "save_selections_offload_attn_out": (
        (*SAVED_NAMES["save_selections"], "o_proj_out", "sparse_mla_lse"), ("sparse_mla_out",)),
}
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "save_qkv_proj", "save_qkv_attn",
                  "save_attn_lse", "save_selections", "save_selections_o_proj",
                  "save_selections_attn_out", "save_selections_offload_attn_out",
                  "offload_dots")


def checkpoint_policy(name: str, offload: bool = True):
  """The `jax.checkpoint` policy of `name`, or None for `none` (no remat at all); `offload`
  False: an offloading policy's host-memory names kept on the device instead."""
  policies = jax.checkpoint_policies
  if name == "none":
    return None
  if name == "full":
    return policies.nothing_saveable
  if name == "dots":
    return policies.dots_saveable
  if name == "dots_no_batch":
    return policies.dots_with_no_batch_dims_saveable
  if name in SAVED_NAMES:
    return policies.save_only_these_names(*SAVED_NAMES[name])
  if name in OFFLOADED_NAMES:
    kept, offloaded = OFFLOADED_NAMES[name]
    if not offload:
      return policies.save_only_these_names(*kept, *offloaded)
    return policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(kept), names_which_can_be_offloaded=list(offloaded),
        offload_src="device", offload_dst="pinned_host")
  if name == "offload_dots":
    return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
  raise ValueError(f"model.remat_policy: unknown policy {name!r}; known: {REMAT_POLICIES}")
