"""Attention variants, one module per variant, one call signature.

Every variant is called as `module(x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT)` and
returns `(y_BLD, aux)` where `aux` is a dict of named auxiliary outputs (possibly empty), e.g.
the DSA layer's `topk_indices` and `index_scores`.
"""
