"""glm5-jax: GLM-5 (arXiv 2602.15763) in JAX.

Public API:
  load_hf(path) -> (config, params)        read a released GLM-5 HF checkpoint directory
  init_params(config, rng) -> params       random params for a model config
  logits(config, params, tokens) -> fp32 [batch, seq, vocab]
  forward(config, params, tokens, positions=None, segment_ids=None, *, mode=Mode(), mtp=True)
                                           logits, MTP logits, hidden state and aux
  Mode(form="expanded"|"absorbed", dsa_stage="dense"|"warmup"|"sparse")
                                           how the attention layers compute
  validate_config(config, num_devices) checks every section of an experiment config
"""

from glm5_jax.api import (abstract_params, abstract_params_and_axes, forward, init_params, logits,
                          param_logical_axes)
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ConfigError, ModelConfig, model_config
from glm5_jax.config_validation import validate_config
from glm5_jax.convert.hf import load_hf

__all__ = [
    "load_hf", "init_params", "logits", "forward", "abstract_params", "abstract_params_and_axes",
    "param_logical_axes", "model_config", "validate_config", "ModelConfig", "ConfigError", "Mode",
]
