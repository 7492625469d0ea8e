"""The inference engine: caches, cached decoding, speculative rollback."""
