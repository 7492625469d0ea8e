"""The planner's decode mode (`glm5_jax.planning.planner_decode`): the engine's decode step compiled
with a W4A8 model's params and the decode cache as sharded arguments, on a tiny config."""

import jax
import jax.numpy as jnp
import pytest

from configs import tiny
from glm5_jax.planning import planner, planner_decode
from glm5_jax.config import ModelConfig
from glm5_jax.infer.cache import cache_bytes, cache_specs
from glm5_jax.param_stats import kv_cache_bytes_per_token
from glm5_jax.sharding import batch_mesh_axes

S = 64  # cache rows per sequence; tiny's index_topk (16) selects fewer


def _config():
  config = tiny.get_config()
  config.model.num_hidden_layers = 2
  config.model.attention_pattern = "D"
  config.model.update(dsa_impl="xla", moe_impl="ragged", quant="w4a8", quant_group_size=16,
                      param_dtype="bfloat16", cache_dtype="bfloat16")
  return planner.with_layout(config, jax.device_count(), {}, seq_len=S, per_device_batch=1)


def test_decode_program_holds_the_quantized_params_and_the_donated_cache():
  config = _config()
  ways = 1
  for axis in batch_mesh_axes(config.mesh.logical_axis_rules):
    ways *= config.mesh.shape[axis]
  b = 2 * ways
  program = planner_decode.decode_program(config, cache_len=S, sequences=b)
  figures = planner.compile_program(program)
  params, cache = program.args[:2]
  assert any(x.dtype == jnp.uint8 for x in jax.tree.leaves(params))  # packed INT4 experts
  # the cache is the engine's own tree, one [layers, B, S, ...] array per latent / key, and
  # its bytes are param_stats' per token (2 D layers, bf16) times the B x S rows
  model = ModelConfig.from_config(config.model)
  assert program.cache_bytes * ways == cache_bytes(cache_specs(model, b, S, mtp_depths=0))
  assert program.cache_bytes * ways == kv_cache_bytes_per_token(model)["total"] * b * S
  assert {x.shape[1:3] for x in jax.tree.leaves(cache)} == {(b, S)}
  # every argument compiled, the donated cache aliased by the new one
  assert figures.memory.argument == program.state_bytes > program.cache_bytes > 0
  assert figures.memory.alias >= program.cache_bytes and figures.flops > 0
  # DSA reads every row's indexer keys but the latent and RoPE key of 16 of the 64 rows
  per_row = 2 * 2 * b // ways  # layers x bf16 bytes x slots per device
  assert program.read_bytes == per_row * (S * 16 + 16 * (64 + 8))
  tokens = jax.eval_shape(program.fn, *program.args)[2][0]  # (cache, counts, sampled, ..)
  assert tokens.shape == (b,) and tokens.dtype == jnp.int32



def test_read_bytes_take_top_k_rows_only_in_dsa_layers():
  """A plain MLA layer (M) attends to every cached row: its whole latent is read."""
  config = _config()
  config.model.attention_pattern = "MD"
  ways = 1
  for axis in batch_mesh_axes(config.mesh.logical_axis_rules):
    ways *= config.mesh.shape[axis]
  b = 2 * ways
  program = planner_decode.decode_program(config, cache_len=S, sequences=b)
  per_row = 2 * b // ways  # bf16 bytes x slots per device, one layer
  assert program.read_bytes == per_row * (S * (64 + 8) + S * 16 + 16 * (64 + 8))

def test_paged_decode_program_holds_the_pool_and_page_tables():
  config = _config()
  program = planner_decode.decode_program(config, cache_len=S, sequences=2, cache_layout="paged",
                                          page_size=16)
  pool = jax.tree.leaves(program.args[1])
  # every slot's 4 pages + the reserved page 0, in pages of 16 rows; the pool has no slot
  # axis to split, so every device holds all of it
  assert {x.shape[1:3] for x in pool} == {(2 * 4 + 1, 16)}
  assert all(x.sharding.is_fully_replicated for x in pool)
  assert program.args[-1].shape == (2, 4)  # the page tables
  assert program.cache_bytes == sum(x.size * x.dtype.itemsize for x in pool)
  with pytest.raises(ValueError, match="cache_layout"):
    planner_decode.decode_program(config, cache_len=S, sequences=2, cache_layout="ring")


def test_most_sequences_is_a_multiple_of_the_batch_devices_that_fits():
  # 100 - 60 - 10 = 30 bytes of room, 7 per sequence: 4 fit, 0 as a multiple of 8, 4 of 2
  assert planner_decode.most_sequences(100, 60, 7, 10, 2) == 4
  assert planner_decode.most_sequences(100, 60, 7, 10, 8) == 0
  assert planner_decode.most_sequences(100, 95, 7, 10, 1) == 0  # over already: none


@pytest.mark.slow  # the tool in a subprocess, 8 host devices, two small compiles (~40 s)
def test_plan_memory_decode_mode_on_8_devices():
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cmd = [sys.executable, "tools/plan_memory.py", "--config=configs/tiny.py", "--devices=8",
         "--mesh=expert=8,fsdp=1,data=1", "--mode=decode", "--cache_len=64",
         "--sequences=8,16", "--accelerator=h200", "--json",
         "--config.model.attention_pattern=DD", "--config.model.num_hidden_layers=2",
         "--config.model.dsa_impl=xla", "--config.model.quant=w4a8",
         "--config.model.quant_group_size=16", "--config.model.param_dtype=bfloat16",
         "--config.model.cache_dtype=bfloat16", "--config.model.moe_impl=expert_parallel"]
  proc = subprocess.run(cmd, cwd=root, env=dict(os.environ, PYTHONPATH=root),
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  one, two = result["compiled"]
  assert (one["sequences"], two["sequences"]) == (8, 16)
  assert two["cache"] == 2 * one["cache"] > 0  # one and two sequences per device
  for c in (one, two):
    assert c["memory"]["alias"] >= c["cache"] and c["flops_per_step"] > 0
  assert result["most_sequences"]["h200"] > 16 and result["most_sequences"]["h200"] % 8 == 0
  assert "per-step report for 16 sequences" in proc.stdout and "HBM" in proc.stdout
  # the expert-parallel exchange (XLA:CPU: the ragged all-to-all's dense stand-in)
  assert two["collectives_per_step"]["op"]["all-to-all"]["count"] > 0


_ALL_REFUSED = """
import runpy, sys
import jax
from glm5_jax.planning import planner
def refuse(*args, **kwargs):  # what the TPU compiler raises for a program over its HBM
  raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: over HBM (test)")
planner.compile_program = refuse
sys.argv = ["tools/plan_memory.py", "--config=configs/tiny.py", "--devices=1", "--mode=decode",
            "--cache_len=64", "--sequences=8", "--config.model.num_hidden_layers=2"]
runpy.run_path("tools/plan_memory.py", run_name="__main__")
"""


@pytest.mark.slow  # the tool in a subprocess, compiles nothing (~3 s)
def test_plan_memory_decode_mode_says_when_every_count_was_refused():
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-c", _ALL_REFUSED], cwd=root,
                        env=dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "does not fit v5p: the compiler refused it" in proc.stdout
  assert "no sequence count compiled: [8] all refused" in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
