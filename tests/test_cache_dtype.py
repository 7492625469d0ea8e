"""The served model's decode-cache dtype follows its compute dtype unless the caller picks one
(`glm5_jax.infer.loading`, `load_hf(cache_dtype=)`): a bf16 cache under an fp32 forward makes
cached decode leave the full forward."""

import pytest

from configs import tiny
from glm5_jax.infer.loading import load_model


def _tiny(dtype):
  config = tiny.get_config()
  config.model.dtype = dtype
  config.model.cache_dtype = "bfloat16"  # what the default model config says
  return config


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_init_cache_dtype_follows_dtype(dtype):
  served = load_model(random_init_config=_tiny(dtype))
  assert served.model.cache_dtype == dtype


def test_cache_dtype_chosen_by_caller():
  served = load_model(random_init_config=_tiny("float32"), cache_dtype="bfloat16")
  assert served.model.cache_dtype == "bfloat16"
  served = load_model(random_init_config=_tiny("float32"),
                      model_overrides={"cache_dtype": "bfloat16"})
  assert served.model.cache_dtype == "bfloat16"
  with pytest.raises(ValueError, match="cache_dtype"):
    load_model(random_init_config=_tiny("float32"), cache_dtype="float32",
               model_overrides={"cache_dtype": "bfloat16"})


def test_hf_cache_dtype_follows_stored_dtype(tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from glm5_jax.convert.hf import open_hf
  from test_convert_streaming import write_hf
  path = write_hf(tmp_path, shards=1)
  checkpoint = open_hf(path)  # headers only: nothing is read
  assert checkpoint.config.dtype == "float32"
  assert checkpoint.config.cache_dtype == "float32"
  assert open_hf(path, cache_dtype="bfloat16").config.cache_dtype == "bfloat16"
