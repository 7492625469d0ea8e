"""HF import in both param layouts, and the streaming sharded conversion (`convert/streaming.py`).

Tiny random HF checkpoints (written as in test_hf_parity): the scanned import equals the
stacked unrolled one; a streamed conversion restores to exactly `load_hf`'s params, is written
whole or not at all, stays within a host-memory bound set by its largest leaf (tracemalloc
traces numpy's allocations: the slices read, orbax's host copies), and restores resharded onto
a different mesh of 8 simulated devices.
"""

import os
import subprocess
import sys
import tracemalloc

import jax
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import glm5_jax  # noqa: E402
from glm5_jax import layer_runs  # noqa: E402
from glm5_jax.config import ModelConfig  # noqa: E402
from glm5_jax.convert import streaming  # noqa: E402
from glm5_jax.convert.converted import CONFIG_FILE, PARAMS_DIR, load_converted  # noqa: E402
from glm5_jax.sharding import make_mesh, mesh_config  # noqa: E402
from test_hf_parity import _hf_model, _write_checkpoint  # noqa: E402
from tests.conftest import host_devices_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_hf(path, layout="per_expert", shards=3, seed=1, **hf):
  model = _hf_model({"num_hidden_layers": 5, **hf}, seed=seed)
  _write_checkpoint(str(path), model, dict(model.state_dict()), layout, shards)
  return str(path)


def assert_trees_equal(got, want):
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
    assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def one_device_mesh():
  return make_mesh(mesh_config(data=1, fsdp=1), devices=jax.devices()[:1])


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_scanned_import_equals_stacked_unrolled(layout, tmp_path):
  path = write_hf(tmp_path, layout)
  config, scanned = glm5_jax.load_hf(path, param_dtype="bfloat16")
  unrolled_config, unrolled = glm5_jax.load_hf(path, param_dtype="bfloat16", scan_layers=False)
  assert config.scan_layers and not unrolled_config.scan_layers
  cfg = ModelConfig.from_config(config)
  assert sorted(k for k in scanned if layer_runs.is_layer_module(k)) == ["layers_0_0", "layers_1_4"]
  assert_trees_equal(scanned, layer_runs.stack_layers(unrolled, cfg))
  assert_trees_equal(layer_runs.as_unrolled(scanned, cfg), unrolled)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_streaming_roundtrip_equals_load_hf(scan_layers, tmp_path):
  path = write_hf(tmp_path / "hf", "fused", n_routed_experts=8)
  lines = []
  out = str(tmp_path / "out")
  stats = streaming.convert_streaming(path, out, mesh=one_device_mesh(), scan_layers=scan_layers,
                                      group_bytes=100_000, progress=lines.append)
  assert stats.groups == len(lines) > 1 and lines[-1].startswith(f"[{stats.groups}/")
  assert sorted(os.listdir(out)) == [CONFIG_FILE, PARAMS_DIR]
  config, params = load_converted(out)
  ref_config, ref_params = glm5_jax.load_hf(path, scan_layers=scan_layers)
  assert config.to_dict() == ref_config.to_dict()
  assert_trees_equal(params, ref_params)
  with pytest.raises(FileExistsError, match="already exists"):
    streaming.convert_streaming(path, out, mesh=one_device_mesh())


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
  path = write_hf(tmp_path / "hf")
  out = tmp_path / "out"
  real_build, calls = streaming._build, []

  def failing_build(*args):
    calls.append(1)
    if len(calls) == 10:
      raise OSError("disk full")
    return real_build(*args)

  monkeypatch.setattr(streaming, "_build", failing_build)
  with pytest.raises(OSError, match="disk full"):
    streaming.convert_streaming(path, str(out), mesh=one_device_mesh(), progress=lambda _: None)
  assert not (out / CONFIG_FILE).exists() and not (out / PARAMS_DIR).exists()
  monkeypatch.setattr(streaming, "_build", real_build)
  streaming.convert_streaming(path, str(out), mesh=one_device_mesh(), progress=lambda _: None)
  assert_trees_equal(load_converted(str(out))[1], glm5_jax.load_hf(path)[1])


@pytest.mark.slow  # a ~95 MB model converted under tracemalloc
def test_streaming_memory_is_bounded_by_the_largest_leaf(tmp_path):
  path = write_hf(tmp_path / "hf", "per_expert", shards=4, num_hidden_layers=16, hidden_size=256,
                  moe_intermediate_size=128, n_routed_experts=16)
  tracemalloc.start()
  try:
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    checkpoint = streaming.open_hf(path, scan_layers=False)
    largest = max(leaf.nbytes for leaf in checkpoint.leaves)
    stats = streaming.convert_streaming(path, str(tmp_path / "out"), mesh=one_device_mesh(),
                                        scan_layers=False, group_bytes=2 * largest,
                                        progress=lambda _: None)
    peak = tracemalloc.get_traced_memory()[1] - base
  finally:
    tracemalloc.stop()
  # The constant: Python objects of tracing the model's shapes and of orbax's bookkeeping.
  bound = 3 * 2 * largest + 16_000_000
  print(f"model {stats.bytes / 1e6:.1f} MB in {stats.groups} groups, largest leaf "
        f"{largest / 1e6:.2f} MB, peak traced host allocation {peak / 1e6:.2f} MB "
        f"(bound {bound / 1e6:.2f} MB)")
  assert stats.largest_leaf_bytes == largest and stats.largest_group_bytes <= 2 * largest
  assert peak < bound, (peak, bound)
  assert stats.bytes > 2 * bound, (stats.bytes, bound)


RESHARD = r"""
import json, sys
import jax, numpy as np
import glm5_jax
from glm5_jax.convert import streaming
from glm5_jax.convert.converted import layout_shardings, load_converted
from glm5_jax.sharding import make_mesh, mesh_config
hf, out = sys.argv[1], sys.argv[2]
assert jax.device_count() == 8
# data 2 x fsdp 4: the tiny checkpoint's q_lora (28) splits 4 ways, not 8.
write_mesh = make_mesh(mesh_config(data=2, fsdp=4))
read_mesh = make_mesh(mesh_config(data=1, expert=4, fsdp=2))
streaming.convert_streaming(hf, out, mesh=write_mesh, progress=lambda _: None)
config, params = load_converted(out, mesh=read_mesh)
_, ref = glm5_jax.load_hf(hf)
want = layout_shardings(config, read_mesh)
leaves = jax.tree_util.tree_leaves_with_path(params)
assert len(leaves) == len(jax.tree_util.tree_leaves(ref))
split = 0
for (path, got), expected, sharding in zip(leaves, jax.tree_util.tree_leaves(ref),
                                           jax.tree_util.tree_leaves(want)):
  name = jax.tree_util.keystr(path)
  assert got.sharding.is_equivalent_to(sharding, got.ndim), (name, got.sharding, sharding)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=name)
  split += "expert" in str(sharding.spec)
print(json.dumps({"leaves": len(leaves), "expert_sharded": split}))
"""


@pytest.mark.slow  # a subprocess with 8 simulated CPU devices
def test_restore_onto_a_different_mesh_reshards(tmp_path):
  path = write_hf(tmp_path / "hf", "per_expert", n_routed_experts=8, hidden_size=64)
  env = dict(os.environ, XLA_FLAGS=host_devices_xla_flags(8),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", RESHARD, path, str(tmp_path / "out")], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = proc.stdout.strip().splitlines()[-1]
  print(result)
  assert '"expert_sharded": 0' not in result
