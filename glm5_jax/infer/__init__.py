"""Inference over the training params: decode caches (`cache`, `cache_spec`) and the jitted
cached steps (`step`)."""
