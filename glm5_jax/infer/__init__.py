"""Inference over the training params.

  generate(config, params, prompts, ...) -> GenerateResult     the public entry point
  Engine                       slots, continuous batching, prefix sharing (`engine`)
  cache                        the decode caches (per-array specs: attention/cache_spec.py); step: the jitted cached steps
  sampling, speculative, accept_stats, oracle, requests: sampling and its bookkeeping
"""

from glm5_jax.infer.engine import Engine, generate
from glm5_jax.infer.requests import GenerateResult

__all__ = ["generate", "Engine", "GenerateResult"]
