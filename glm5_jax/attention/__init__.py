"""Attention variants, one module per kind, one call signature.

The kinds (pattern letters M D R G S N L) and every fact about them are in `kinds.py`; `mode.py`
holds `Mode`, how a forward pass computes. Every kind's module is called as

  module(x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT=None, *, mode=Mode())

and returns `(y_BLD, aux)`, where `aux` is a dict of named auxiliary outputs (possibly empty):
a DSA layer's `topk_indices`, `index_scores` and `indexer_kl` (see `mla.MLA`). In
`Mode(form="decode")` every module also takes `cache=` (the layer's cache dict, laid out by
`AttentionKind.decode_cache`) and returns the updated one as `aux["cache"]`; recurrent kinds
add `aux["cache_steps"]` for speculative rollback (`glm5_jax.infer.rollback`).
"""
