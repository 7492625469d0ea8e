"""The released GLM-5: 744B total / ~40B active (GLM5_REFERENCE.md section 1).

  python -m tools.param_count --config=configs/glm5_744b.py
"""

import ml_collections

from glm5_jax.config import mesh_config, model_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = model_config(attention_pattern="D" * 78)  # every layer DSA, own indexer
  config.mesh = mesh_config(fsdp=-1, data=1)
  return config
