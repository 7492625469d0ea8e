"""A damaged HF checkpoint directory is refused with an error naming the file or shard.

Tiny hand-made directories (numpy safetensors, no torch): a truncated file, a shard that lacks
a tensor the index maps to it, a corrupt shard, a shard the index names that does not exist.
"""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

import glm5_jax
from glm5_jax.convert.hf_files import INDEX_FILE, CheckpointError, TensorReader

TENSORS = {"model.embed_tokens.weight": np.ones((8, 4), np.float32),
           "model.norm.weight": np.ones((4,), np.float32),
           "lm_head.weight": np.ones((8, 4), np.float32)}


def write_dir(path, shards: dict[str, dict], index: dict | None = None):
  """config.json plus `shards` ({file: {tensor: array}}) and, if given, the index weight_map."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({"model_type": "glm_moe_dsa", "vocab_size": 64, "hidden_size": 48,
               "num_hidden_layers": 2, "num_attention_heads": 2}, f)
  for file, tensors in shards.items():
    save_file(tensors, os.path.join(path, file))
  if index is not None:
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump({"weight_map": index}, f)
  return str(path)


def truncate(file, keep_fraction=0.5):
  data = open(file, "rb").read()
  with open(file, "wb") as f:
    f.write(data[:int(len(data) * keep_fraction)])


def test_truncated_file_is_named(tmp_path):
  path = write_dir(tmp_path, {"model.safetensors": TENSORS})
  truncate(os.path.join(path, "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors "
                     r"file \(.*incomplete metadata"):
    glm5_jax.load_hf(path)


def split_in_two():
  names = sorted(TENSORS)
  shards = {"model-00001-of-00002.safetensors": {n: TENSORS[n] for n in names[:2]},
            "model-00002-of-00002.safetensors": {n: TENSORS[n] for n in names[2:]}}
  index = {n: f for f, tensors in shards.items() for n in tensors}
  return shards, index


def test_truncated_shard_is_named(tmp_path):
  shards, index = split_in_two()
  path = write_dir(tmp_path, shards, index)
  with open(os.path.join(path, "model-00002-of-00002.safetensors"), "wb") as f:
    f.write(b"\x00" * 3)  # not even a header
  with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: not a readable "
                     "safetensors file"):
    glm5_jax.load_hf(path)


def test_tensor_missing_from_the_shard_the_index_names(tmp_path):
  shards, index = split_in_two()
  moved = sorted(shards["model-00002-of-00002.safetensors"])[0]
  index[moved] = "model-00001-of-00002.safetensors"  # the index disagrees with the files
  path = write_dir(tmp_path, shards, index)
  with pytest.raises(CheckpointError) as error:
    glm5_jax.load_hf(path)
  message = str(error.value)
  assert "model-00001-of-00002.safetensors: does not hold 1 tensors" in message, message
  assert moved in message and INDEX_FILE in message, message


def test_shard_missing_from_the_directory(tmp_path):
  shards, index = split_in_two()
  path = write_dir(tmp_path, shards, index)
  os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
  with pytest.raises(CheckpointError, match=rf"{INDEX_FILE}: names shards that do not exist: "
                     r"model-00002-of-00002\.safetensors"):
    glm5_jax.load_hf(path)


def test_reader_names_the_file_of_a_tensor_it_cannot_read(tmp_path):
  path = write_dir(tmp_path, {"model.safetensors": TENSORS})
  with TensorReader(path, {"model.norm.weight": "model.safetensors",
                           "absent": "model.safetensors"}) as reader:
    np.testing.assert_array_equal(reader.read("model.norm.weight"), TENSORS["model.norm.weight"])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read tensor absent"):
      reader.read("absent")


def test_nan_weights_and_fp8_scales_are_refused_naming_the_tensor(tmp_path):
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  from glm5_jax.convert.hf_fp8 import Fp8Format  # pylint: disable=import-outside-toplevel
  nan_weight = np.ones((4, 4), np.float32)
  nan_weight[1, 2] = np.nan
  tensors = {"w": nan_weight, "q": np.ones((4, 4), ml_dtypes.float8_e4m3fn),
             "q_scale_inv": np.full((2, 2), np.nan, np.float32)}
  path = write_dir(tmp_path, {"model.safetensors": tensors})
  files = {name: "model.safetensors" for name in tensors}
  fp8 = Fp8Format((2, 2), {"q": (4, 4)})
  with TensorReader(path, files, fp8) as reader:
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor w has 1 non-finite "
                       r"values \(NaN or inf\) of 16; pass allow_nonfinite=True"):
      reader.read("w")
    with pytest.raises(CheckpointError, match=r"tensor q_scale_inv has 4 non-finite"):
      reader.read("q")
  with TensorReader(path, files, fp8, allow_nonfinite=True) as reader:
    assert np.isnan(reader.read("w")).sum() == 1 and np.isnan(reader.read("q")).all()
