"""The AOT memory planner: its HLO collectives parser, its figures on 8 simulated devices, the
state shardings it derives (equal to the trainer's), and the fits / does-not-fit verdict."""

import json
import os
import re
import subprocess
import sys

import pytest

from glm5_jax import planner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_HLO = """
HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0})->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (p: f32[4,8]) -> f32[] {
  %p = f32[4,8]{1,0} parameter(0)
  %all-gather.1 = f32[16,8]{1,0} all-gather(f32[4,8]{1,0} %p), channel_id=1, dimensions={0}
  %all-reduce.2 = (f32[16,8]{1,0}, bf16[3]{0}) all-reduce(%all-gather.1, %c), to_apply=%add
  %ags = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(bf16[4,8]{1,0} %q), dimensions={0}
  %agd = bf16[16,8]{1,0} all-gather-done((bf16[4,8]{1,0}, bf16[16,8]{1,0}) %ags)
  %reduce-scatter = f32[1,8]{1,0} reduce-scatter(f32[4,8]{1,0} %p), dimensions={0}, to_apply=%add
  %a2a = s32[4,8]{1,0} all-to-all(s32[4,8]{1,0} %i), dimensions={0}
  %r = bf16[64,16]{1,0} ragged-all-to-all(%x, %out, %o1, %s1, %o2, %s2)
  ROOT %cp = f32[2,2]{1,0} collective-permute(f32[2,2]{1,0} %z), source_target_pairs={{0,1}}
  %not = f32[16,8]{1,0} add(%all-gather.1, %all-gather.1)
}
"""


def test_collectives_parses_every_kind_and_counts_async_once():
  found = planner.collectives(_HLO)
  assert [(c.kind, c.name, c.bytes) for c in found] == [
      ("all-gather", "all-gather.1", 16 * 8 * 4),
      ("all-reduce", "all-reduce.2", 16 * 8 * 4 + 3 * 2),  # a tuple result sums its elements
      ("all-gather", "agd", 16 * 8 * 2),  # the -done only, with the gathered output
      ("reduce-scatter", "reduce-scatter", 8 * 4),
      ("all-to-all", "a2a", 4 * 8 * 4),
      ("ragged-all-to-all", "r", 64 * 16 * 2),
      ("collective-permute", "cp", 2 * 2 * 4),
  ]
  summary = planner.summarize_collectives(found)
  assert summary["all-gather"] == {"count": 2, "bytes": 16 * 8 * 4 + 16 * 8 * 2}
  assert list(summary) == list(planner.COLLECTIVE_KINDS)


def test_collectives_rejects_an_unknown_element_type():
  with pytest.raises(ValueError, match="unknown element type 'q7'"):
    planner.collectives("  %x = q7[4]{0} all-reduce(%y), to_apply=%add")


def test_fits_compares_with_each_accelerators_hbm():
  gib = planner.GIB
  assert planner.fits(32 * gib) == {"v5p": True, "v6e": True, "h100": True, "h200": True}
  assert planner.fits(32 * gib + 1) == {"v5p": True, "v6e": False, "h100": True, "h200": True}
  assert planner.fits(90 * gib) == {"v5p": True, "v6e": False, "h100": False, "h200": True}
  assert planner.fits(200 * gib) == dict.fromkeys(planner.ACCELERATOR_HBM_GIB, False)


def test_fit_line_recovers_slope_and_intercept_and_needs_two_depths():
  assert planner.fit_line([2, 4, 8], [7, 11, 19]) == pytest.approx((2.0, 3.0))
  with pytest.raises(ValueError, match="two distinct depths"):
    planner.fit_line([4, 4], [1, 2])


def test_with_depth_keeps_one_dense_layer_and_the_pattern_prefix():
  from configs import glm5_744b, tiny  # pylint: disable=g-import-not-at-top
  config, mix = planner.with_depth(glm5_744b.get_config(), 4)
  assert (config.model.num_hidden_layers, config.model.first_k_dense_replace) == (4, 1)
  assert config.model.attention_pattern == "DDDD" and mix == "1 dense + 3 MoE"
  config, mix = planner.with_depth(tiny.get_config("SMSM"), 3)
  assert config.model.attention_pattern == "SMS" and mix == "1 dense + 2 MoE"
  with pytest.raises(Exception, match="model.num_hidden_layers"):
    planner.with_depth(tiny.get_config(), 5)


def _run(args, script=None, timeout=900):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  if script is not None:
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    cmd = [sys.executable, "-c", script]
  else:
    cmd = [sys.executable, os.path.join(ROOT, "tools", "plan_memory.py"), *args]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


_COMPILED_COLLECTIVES = r"""
import json, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from glm5_jax import planner
mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
x = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
def f(x_MD):  # an all-gather of x to every device, an all-reduce of the column sums
  full = jax.lax.with_sharding_constraint(x_MD * 2, NamedSharding(mesh, P()))
  return full, x_MD.sum(0)
text = jax.jit(f, out_shardings=NamedSharding(mesh, P())).lower(x).compile().as_text()
found = planner.collectives(text)
from glm5_jax.cpu_standins import ragged_all_to_all_standin
def exchange(x_PD, out_RD, sizes_E):  # XLA:CPU cannot compile the real ragged-all-to-all
  return jax.lax.ragged_all_to_all(x_PD, out_RD, sizes_E, sizes_E, sizes_E, sizes_E,
                                   axis_name="fsdp")
# float32: XLA:CPU runs a bf16 all-to-all in f32 (converts around it), doubling its bytes
rows = lambda r: jax.ShapeDtypeStruct((8 * r, 16), jnp.float32)
sizes = jax.ShapeDtypeStruct((64,), jnp.int32)
standin = {}
for out_rows in (6, 20):  # per-device output buffer smaller / larger than the 10 rows sent
  mapped = jax.shard_map(exchange, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
  with jax.set_mesh(mesh), ragged_all_to_all_standin():
    compiled = jax.jit(mapped).lower(rows(10), rows(out_rows), sizes).compile()
  standin[out_rows] = [[c.kind, c.bytes] for c in planner.collectives(compiled.as_text())]
  standin[f"shape{out_rows}"] = list(compiled.out_info.shape)
print(json.dumps({"found": [[c.kind, c.bytes] for c in found], "standin": standin,
                  "mentions": {k: text.count(" " + k + "(") for k in planner.COLLECTIVE_KINDS}}))
"""


@pytest.mark.slow  # a subprocess with 8 host devices (~15 s)
def test_collectives_of_a_compiled_8_device_program_and_the_ragged_all_to_all_standin():
  result = json.loads(_run(None, _COMPILED_COLLECTIVES).strip().splitlines()[-1])
  kinds = [k for k, _ in result["found"]]
  assert ["all-gather", 64 * 16 * 4] in result["found"], result
  assert any(k == "all-reduce" and b == 16 * 4 for k, b in result["found"]), result
  # every collective instruction the text holds was found, none invented
  assert {k: kinds.count(k) for k in planner.COLLECTIVE_KINDS} == result["mentions"], result
  # the ragged-all-to-all stand-in: one all-to-all of the (row-padded) send buffer, shaped
  # like the output buffer
  for out_rows in ("6", "20"):
    assert result["standin"][out_rows] == [["all-to-all", 16 * 16 * 4]], result
    assert result["standin"][f"shape{out_rows}"] == [8 * int(out_rows), 16], result


_STATE_SHARDINGS = r"""
import json, jax
from configs import tiny
from glm5_jax import planner
from glm5_jax.train.trainer import build_trainer
config = tiny.get_config()
config.mesh.shape.update(data=1, fsdp=2, expert=2, tensor=2)
config.model.num_hidden_layers = 2
trainer = build_trainer(config)  # compiles the real init, whose output shardings XLA picks
program = planner.train_program(config)
ours, theirs = program.args[0], trainer.abstract_state
same = lambda a, b: a.shape == b.shape and a.sharding.is_equivalent_to(b.sharding, len(a.shape))
params = [same(a, b) for a, b in zip(jax.tree_util.tree_leaves(ours),
                                     jax.tree_util.tree_leaves(theirs))]
# Every optimizer moment of the trainer's real state is sharded like its param (XLA alone would
# replicate `zeros_like(param)`; `glm5_jax.sharding.state_shardings` states it).
by_shape = {}
for p in jax.tree_util.tree_leaves(theirs.params):
  by_shape.setdefault(p.shape, set()).add(p.sharding.spec)
moments = [leaf.sharding.spec in by_shape[leaf.shape]
           for leaf in jax.tree_util.tree_leaves(theirs.opt_state) if leaf.shape in by_shape]
print(json.dumps({"params": len(params), "same": sum(params), "moments": len(moments),
                  "moments_like_params": sum(moments),
                  "sharded": sum(not a.sharding.is_fully_replicated
                                 for a in jax.tree_util.tree_leaves(ours))}))
"""


@pytest.mark.slow  # a subprocess with 8 host devices compiling the trainer's init (~60 s)
def test_planner_state_shardings_equal_the_trainers_and_moments_follow_params():
  result = json.loads(_run(None, _STATE_SHARDINGS).strip().splitlines()[-1])
  assert result["params"] == result["same"] > 10, result
  assert result["moments"] == result["moments_like_params"] > 10, result
  assert result["sharded"] > result["params"] * 0.5, result


@pytest.mark.slow  # the tool in a subprocess, 8 host devices, two compiles (~2 min on 2 cores)
def test_plan_memory_tiny_on_8_devices(tmp_path):
  out = _run(["--config=configs/tiny.py", "--devices=8", "--mesh=fsdp=2,expert=2,tensor=2",
              "--layers=1,2", "--accelerator=v6e", "--json",
              "--config.model.num_hidden_layers=3", "--config.model.mtp_depths=1"])
  result = json.loads(out.strip().splitlines()[-1])
  assert "compiling depth 1 (1 dense + 0 MoE) ..." in out and "extrapolated" in out
  assert [c["layers"] for c in result["compiled"]] == [1, 2]
  for c in result["compiled"]:
    memory = c["memory"]
    assert min(memory["argument"], memory["output"], memory["temp"]) > 0, memory
    assert 0 < memory["alias"] <= memory["argument"]  # the donated state
    assert c["compile_s"] > 0 and c["collectives"]["all-reduce"]["count"] > 0
  deeper = [c["memory"]["argument"] for c in result["compiled"]]
  assert deeper[1] > deeper[0]
  # arguments at depth 3 (exact, not compiled) hold one more MoE layer. (Not 2 * d2 - d1: at
  # depth 1 the model has no MoE layer, so its MTP layer is dense too.)
  assert result["full_depth"]["argument"] > deeper[1]
  assert "(exact)" in out
  assert result["extrapolated"] and result["total"] > 0
  assert result["fits"] == planner.fits(result["total"]) and result["fits"]["v6e"]
  assert re.search(r"v6e +32 GiB  fits  <== chosen", out), out


def test_ragged_dot_standin_has_ragged_dots_shapes_and_is_undone():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from glm5_jax.cpu_standins import ragged_dot_standin  # pylint: disable=g-import-not-at-top
  args = (jax.ShapeDtypeStruct((37, 16), jnp.bfloat16),  # P not a multiple of E: padded
          jax.ShapeDtypeStruct((8, 16, 24), jnp.bfloat16), jax.ShapeDtypeStruct((8,), jnp.int32))
  real = jax.eval_shape(jax.lax.ragged_dot, *args)
  with ragged_dot_standin():
    text = jax.jit(lambda *a: jax.lax.ragged_dot(*a)).lower(*args).as_text()
    standin = jax.eval_shape(jax.lax.ragged_dot, *args)
  assert (standin.shape, standin.dtype) == (real.shape, real.dtype) == ((37, 24), jnp.bfloat16)
  assert "ragged_dot" not in text and "5x16" in text  # C = ceil(37 / 8) = 5 rows per expert
  assert jax.eval_shape(jax.lax.ragged_dot, *args) == real
  assert "ragged_dot" in jax.jit(jax.lax.ragged_dot).lower(*args).as_text()  # restored


def test_serve_program_compiles_prefill_and_counts_the_kv_cache():
  """`--mode=serve`: the prefill compiles from abstract params (no optimizer state) to
  next-token logits `[B, Y]`, its arguments are exactly the params' and prompts' bytes, and the
  KV cache it adds is `param_stats`' bytes per token (MLA's 576-number latent at GLM-5 width,
  plus the DSA indexer keys) times the batch's tokens over the devices the batch splits over."""
  import jax
  from configs import tiny
  from glm5_jax.config import ModelConfig
  from glm5_jax.param_stats import kv_cache_bytes_per_token

  config = tiny.get_config()
  config.model.num_hidden_layers = 2
  config.model.attention_pattern = "D"
  config = planner.with_layout(config, jax.device_count(), {}, seq_len=32, per_device_batch=3)
  program = planner.serve_program(config)
  figures = planner.compile_program(program)
  assert figures.memory.argument == program.state_bytes
  params = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(program.args[0]))
  assert program.state_bytes == params + 3 * jax.device_count() * 32 * 4  # + int32 prompts
  assert figures.memory.temp > 0
  logits = jax.eval_shape(program.fn, *program.args)
  assert logits.shape == (3 * jax.device_count(), config.model.vocab_size)
  model = ModelConfig.from_config(config.model)
  per_token = kv_cache_bytes_per_token(model)["total"]
  # 2 DSA layers: (64 latent + 8 rope + 16 indexer-key numbers) x 2 bytes each.
  assert per_token == 2 * (64 + 8 + 16) * 2
  assert planner.kv_cache_bytes(config) == per_token * 3 * 32
