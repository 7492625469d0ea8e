"""glm5_jax.param_stats and tools/param_count.py: the released GLM-5 figures, exactness against real params, scaling.

Run from the repository root: `python -m pytest tests/test_param_count.py -q`.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

import glm5_jax
from configs import glm5_744b, tiny
from glm5_jax import param_stats as param_count

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# docs/reference.md section 1: 75 MoE layers x 256 experts x SwiGLU (3 matrices) of 6144 x 2048.
ROUTED_744B = 75 * 256 * 3 * 6144 * 2048


@pytest.fixture(scope="module", autouse=True)
def cli_744b(request):
  """The CLI on the 744B config, started first so it runs alongside the in-process tests;
  not started when `test_cli_json_744b` is deselected (e.g. `-m "not slow"`)."""
  if not any(item.originalname == "test_cli_json_744b" for item in request.session.items):
    yield None
    return
  process = subprocess.Popen(
      [sys.executable, "tools/param_count.py", "--config=configs/glm5_744b.py", "--json"],
      cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  yield process
  if process.poll() is None:
    process.kill()
  process.communicate()


@pytest.fixture(scope="module")
def summary_744b():
  return param_count.summarize(glm5_744b.get_config().model)


def tiny_model(**overrides):
  model = tiny.get_config().model
  model.update(overrides)
  return model


def check_released_figures(summary):
  assert round(summary["total_params"] / 1e9, 2) == 753.86
  assert round(summary["total_params_without_mtp"] / 1e9, 2) == 743.91
  assert 38e9 < summary["active_params"] < 43e9


def test_744b_released_figures(summary_744b):
  check_released_figures(summary_744b)
  assert summary_744b["breakdown"]["routed_experts"] == ROUTED_744B
  assert sum(summary_744b["breakdown"].values()) == summary_744b["total_params"]
  assert sum(summary_744b["mtp_breakdown"].values()) == summary_744b["breakdown"]["mtp"]
  assert summary_744b["active_params_without_embeddings"] == (
      summary_744b["active_params"] - 2 * 154880 * 6144)


def test_744b_kv_cache(summary_744b):
  kv = summary_744b["kv_cache_bytes_per_token"]
  assert kv["mla_latent"] == 78 * (512 + 64) * 2
  assert kv["dsa_indexer_keys"] == 78 * 128 * 2
  assert kv["gqa8_equivalent"] == 78 * 2 * 8 * 128 * 2
  assert kv["gqa8_ratio"] == pytest.approx(2048 / (576 + 128))


def test_tiny_counts_equal_real_params():
  model = tiny_model()
  real = glm5_jax.init_params(model, jax.random.key(0))
  assert param_count.summarize(model)["total_params"] == sum(
      x.size for x in jax.tree_util.tree_leaves(real))
  assert param_count.component_counts(real) == param_count.component_counts(
      glm5_jax.abstract_params(model))


@pytest.mark.parametrize("attention", ["G", "MDRG"])
def test_tiny_counts_cover_every_param(attention):
  model = tiny_model(attention_pattern=attention)
  summary = param_count.summarize(model)
  total = sum(size for _, size in param_count.param_paths(glm5_jax.abstract_params(model)))
  assert sum(summary["breakdown"].values()) == summary["total_params"] == total


def test_routed_experts_scale():
  base = param_count.summarize(tiny_model())
  more = param_count.summarize(tiny_model(n_routed_experts=16))
  wider = param_count.summarize(tiny_model(moe_intermediate_size=64))
  # tiny: 3 MoE layers (first_k_dense_replace=1 of 4), D=64, F=32, 8 experts, top-2.
  assert base["breakdown"]["routed_experts"] == 3 * 8 * 3 * 64 * 32
  assert base["mtp_breakdown"]["routed_experts"] == 8 * 3 * 64 * 32
  assert more["breakdown"]["routed_experts"] == 2 * base["breakdown"]["routed_experts"]
  assert wider["breakdown"]["routed_experts"] == 2 * base["breakdown"]["routed_experts"]
  assert wider["breakdown"]["shared_experts"] == 2 * base["breakdown"]["shared_experts"]
  assert more["mtp_breakdown"]["routed_experts"] == 2 * base["mtp_breakdown"]["routed_experts"]
  # Twice the experts at the same top-k: active routed params stay; only the router grows.
  router_growth = more["breakdown"]["router"] - base["breakdown"]["router"]
  assert router_growth == 3 * (64 * 8 + 8)
  assert more["active_params"] - base["active_params"] == router_growth
  routed_active = base["breakdown"]["routed_experts"] * 2 // 8
  non_routed = base["total_params_without_mtp"] - base["breakdown"]["routed_experts"]
  assert base["active_params"] == non_routed + routed_active


def test_gqa_kv_cache():
  kv = param_count.summarize(tiny_model(attention_pattern="G"))["kv_cache_bytes_per_token"]
  assert kv["mla_latent"] == kv["dsa_indexer_keys"] == 0
  assert kv["total"] == kv["gqa_kv"] == 4 * 2 * 2 * 16 * 2  # layers x K,V x heads x dim x bytes


def test_unknown_param_path_is_an_error():
  with pytest.raises(ValueError, match="layers_0/mystery"):
    param_count.component(("layers_0", "mystery", "kernel"))


@pytest.mark.slow  # a subprocess running the CLI on the 744B config
def test_cli_json_744b(cli_744b, summary_744b):
  stdout, stderr = cli_744b.communicate(timeout=120)
  assert cli_744b.returncode == 0, stderr
  summary = json.loads(stdout)
  assert summary == summary_744b
  check_released_figures(summary)
  assert summary["breakdown"]["routed_experts"] == ROUTED_744B
