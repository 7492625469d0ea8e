"""The AOT memory planner: its HLO collectives parser, its figures on 8 simulated devices, the
state shardings it derives (equal to the trainer's), and the fits / does-not-fit verdict."""

import json
import os
import re
import subprocess
import sys

import pytest

from glm5_jax.planning import hlo_stats, planner
from tests.conftest import host_devices_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two nested loops in the TPU compiler's form (no `known_trip_count`; the condition compares
# the induction variable with a constant, the body adds 1 to it), the outer one XLA:CPU's
# annotated form: 3 x 5 = 15 runs of the inner body's collectives.
_LOOPS_HLO = """
HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %ag = f32[16,8]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, metadata={op_name="jit(step)/gather_rows"}
  %ar = f32[4,8]{1,0} all-reduce(%x), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}, to_apply=%add, metadata={op_name="jit(step)/sum_a"}
  %w = f32[8,8]{1,0} broadcast(%one), dimensions={}
  %d = f32[4,8]{1,0} dot(%ar, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%next, %d)
}

%inner_cond (q: (s32[], f32[4,8])) -> pred[] {
  %q = (s32[], f32[4,8]{1,0}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %five = s32[] constant(5)
  ROOT %lt = pred[] compare(%k, %five), direction=LT
}

%outer_body (r: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %r = (s32[], f32[4,8]{1,0}) parameter(0)
  %zero = s32[] constant(0)
  %y = f32[4,8]{1,0} get-tuple-element(%r), index=1
  %init = (s32[], f32[4,8]{1,0}) tuple(%zero, %y)
  %loop = (s32[], f32[4,8]{1,0}) while(%init), condition=%inner_cond, body=%inner_body
  %cp = f32[4,8]{1,0} collective-permute(%y), channel_id=3, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  ROOT %out = (s32[], f32[4,8]{1,0}) tuple(%zero, %cp)
}

%outer_cond (u: (s32[], f32[4,8])) -> pred[] {
  %u = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %never = pred[] constant(false)
}

ENTRY %main (p0: f32[4,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %c0 = s32[] constant(0)
  %start = (s32[], f32[4,8]{1,0}) tuple(%c0, %p0)
  %outer = (s32[], f32[4,8]{1,0}) while(%start), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[1,8]{1,0} reduce-scatter(%p0), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  ROOT %res = f32[4,8]{1,0} get-tuple-element(%outer), index=1
}
"""


def test_step_collectives_multiply_nested_loop_trip_counts_and_map_groups_to_axes():
  from glm5_jax.planning import hlo_loops, hlo_stats  # pylint: disable=g-import-not-at-top
  module = hlo_loops.parse_module(_LOOPS_HLO)
  assert module.executions()["inner_body"] == 15 and module.unknown_loops == []
  found = {c.name: c for c in hlo_stats.step_collectives(_LOOPS_HLO, {"a": 2, "b": 4})}
  assert (found["ag"].runs, found["ag"].bytes, found["ag"].axes) == (15, 16 * 8 * 4, "b")
  assert found["ag"].link_bytes == 16 * 8 * 4 * 3 / 4 and found["ag"].source.endswith("rows")
  # the mesh form with a transposed device order: groups {0,2}, {1,3}, ...: mesh axis "b"
  assert (found["ar"].runs, found["ar"].group, found["ar"].axes) == (15, 2, "b")
  assert found["ar"].link_bytes == 4 * 8 * 4 * 2 * 1 / 2  # all-reduce: twice (n-1)/n
  assert (found["cp"].runs, found["cp"].axes, found["cp"].link_bytes) == (3, "b", 4 * 8 * 4)
  # reduce-scatter: the full operand, over the devices that differ along "b"
  assert (found["rs"].runs, found["rs"].bytes, found["rs"].axes) == (1, 4 * 8 * 4, "b")
  by_kind = hlo_stats.summarize_step(list(found.values()))
  assert by_kind["all-gather"] == {"count": 15, "bytes": 15 * 512, "link_bytes": 15 * 384.0}
  assert hlo_stats.step_dot_flops(_LOOPS_HLO)["flops"] == 15 * 2 * 4 * 8 * 8
  # the outer loop unannotated and its condition unreadable: reported, counted once
  unknown = hlo_loops.parse_module(_LOOPS_HLO.replace(
      ', backend_config={"known_trip_count":{"n":"3"}}', ""))
  assert unknown.executions()["inner_body"] == 5 and unknown.unknown_loops == ["outer"]


_RAGGED_HLO = """
HloModule jit_exchange, entry_computation_layout={(bf16[64,16]{1,0})->bf16[80,16]{1,0}}

ENTRY %main (x: bf16[64,16], out: bf16[80,16], off: s32[4]) -> bf16[80,16] {
  %x = bf16[64,16]{1,0} parameter(0)
  %out = bf16[80,16]{1,0} parameter(1)
  %off = s32[4]{0} parameter(2)
  ROOT %ra = bf16[80,16]{1,0} ragged-all-to-all(%x, %out, %off, %off, %off, %off), channel_id=1, replica_groups={{0,1,2,3}}
}
"""


def test_ragged_all_to_all_counts_its_larger_buffer_once_and_sends_its_input():
  """A ragged-all-to-all's operands are (input, receive buffer, 4 offset vectors): its bytes
  are the larger of the two buffers, not their sum, and a device sends at most its input."""
  from glm5_jax.planning import hlo_stats  # pylint: disable=g-import-not-at-top
  (found,) = hlo_stats.step_collectives(_RAGGED_HLO, {"expert": 4})
  assert (found.op, found.bytes, found.runs, found.axes) == ("ragged-all-to-all", 80 * 16 * 2,
                                                             1, "expert")
  assert found.link_bytes == 64 * 16 * 2 * 3 / 4
  (listed,) = hlo_stats.collectives(_RAGGED_HLO)
  assert listed.bytes == 80 * 16 * 2


def test_replica_group_forms():
  from glm5_jax.planning import hlo_stats  # pylint: disable=g-import-not-at-top
  groups = hlo_stats.replica_groups
  assert groups("replica_groups={}, x", 4) == [[0, 1, 2, 3]]
  assert groups("replica_groups=[4,2]<=[2,4]T(1,0), x", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", 8) == [
      [0, 1, 2, 3], [4, 5, 6, 7]]
  assert hlo_stats.mesh_axes_of([[0, 4], [1, 5]], {"a": 2, "b": 4}) == "a"
  assert hlo_stats.mesh_axes_of([[0, 1, 4, 5]], {"a": 2, "b": 2, "c": 2}) == "a+c"
  assert groups("dimensions={0}", 8) is None


_KNOWN_LOOP = r"""
import json, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from glm5_jax.planning import hlo_stats
mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)

def per_device(x_MD, w_DD):  # [32, 32] and [32, 32] on each device
  def inner(i, c):  # 7 runs per outer step: a [32, 32] matmul and a psum over "b"
    return c + jax.lax.psum(c @ w_DD, "b") * 0.5
  def outer(c, _):  # 3 runs: the inner loop, then a psum over "a" of 8 numbers
    c = jax.lax.fori_loop(0, 7, inner, c)
    return c, jax.lax.psum(c[0, :8], "a")
  return jax.lax.scan(outer, x_MD, None, length=3)

fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("a", "b"), P()),
                           out_specs=(P("a", "b"), P(None, "b"))))
x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))
w = jax.ShapeDtypeStruct((32, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
compiled = fn.lower(x, w).compile()
text = compiled.as_text()
found = hlo_stats.step_collectives(text, dict(mesh.shape))
print(json.dumps({"found": sorted([c.op, c.bytes, c.runs, c.group, c.axes, c.link_bytes]
                                  for c in found),
                  "flops": hlo_stats.step_dot_flops(text),
                  "cost_analysis": compiled.cost_analysis()["flops"]}))
"""


@pytest.mark.slow  # a subprocess with 8 host devices (~5 s)
def test_per_step_accounting_of_a_compiled_program_with_known_loops():
  """3 x 7 runs of a psum over "b" of a [32, 32] f32 block, 3 of a psum over "a" of 8 numbers,
  21 [32, 32] x [32, 32] matmuls: exact per-step bytes and FLOPs, which
  `compiled.cost_analysis()` (loop bodies counted once) does not give."""
  result = json.loads(_run(None, _KNOWN_LOOP).strip().splitlines()[-1])
  assert result["found"] == [["all-reduce", 32, 3, 2, "a", 32.0],
                             ["all-reduce", 32 * 32 * 4, 21, 4, "b", 32 * 32 * 4 * 2 * 3 / 4]]
  assert result["flops"] == {"flops": 21 * 2 * 32 ** 3, "custom_calls": 0, "unknown_loops": 0}
  assert result["cost_analysis"] < 2 * 2 * 32 ** 3  # one iteration's worth


def test_async_collective_flags_go_first_in_libtpu_args_and_are_set_once(monkeypatch):
  """libtpu reads LIBTPU_INIT_ARGS once: the async-collective flags go ahead of the user's
  (whose repeats win), and asking for the other setting later in the process is an error."""
  from glm5_jax.planning import aot_targets  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(aot_targets, "_applied_flags", None)
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_enable_async_all_gather=false")
  flags = aot_targets.start_libtpu_flags("v5p", True)
  assert flags.split() == list(aot_targets.ASYNC_COLLECTIVE_FLAGS["v5p"])
  assert os.environ["LIBTPU_INIT_ARGS"] == flags + " --xla_enable_async_all_gather=false"
  assert aot_targets.start_libtpu_flags("v5p", True) == flags
  with pytest.raises(RuntimeError, match="async_collectives=False"):
    aot_targets.start_libtpu_flags("v5p", False)
  with pytest.raises(RuntimeError, match="v5e, async_collectives=True"):
    aot_targets.start_libtpu_flags("v5e", True)
  monkeypatch.setattr(aot_targets, "_applied_flags", None)
  monkeypatch.delenv("LIBTPU_INIT_ARGS")
  assert aot_targets.start_libtpu_flags("v5p", False) == ""
  assert os.environ["LIBTPU_INIT_ARGS"] == ""


def test_continuation_fusion_only_where_libtpu_supports_it():
  """libtpu 0.0.42.1 supports continuation fusion on v5e only (on v5p it warns of incorrect
  results); the chips with SparseCores offload their collectives there instead."""
  from glm5_jax.planning import aot_targets  # pylint: disable=g-import-not-at-top

  def last_value(chip, name):
    values = [f.split("=")[1] for f in aot_targets.ASYNC_COLLECTIVE_FLAGS[chip]
              if f.split("=")[0] == name]
    return values[-1] if values else None

  assert set(aot_targets.ASYNC_COLLECTIVE_FLAGS) == set(aot_targets.TPU_CHIPS)
  for chip in aot_targets.TPU_CHIPS:
    fusion = last_value(chip, "--xla_tpu_enable_async_collective_fusion")
    offload = last_value(chip, "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter")
    assert (fusion, offload) == (("true", None) if chip == "v5e" else ("false", "true")), chip
    assert last_value(chip, "--xla_tpu_enable_async_ragged_all_to_all") == "true"


def test_fits_compares_with_each_accelerators_hbm():
  gib = planner.GIB
  assert planner.fits(16 * gib) == dict.fromkeys(planner.ACCELERATOR_HBM_GIB, True)
  assert planner.fits(32 * gib) == {"v5p": True, "v5e": False, "v6e": True, "h100": True,
                                    "h200": True}
  assert planner.fits(32 * gib + 1) == {"v5p": True, "v5e": False, "v6e": False, "h100": True,
                                        "h200": True}
  assert planner.fits(90 * gib) == {"v5p": True, "v5e": False, "v6e": False, "h100": False,
                                    "h200": True}
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
    env["XLA_FLAGS"] = host_devices_xla_flags(8)
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
from glm5_jax.planning import hlo_stats
mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
x = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
def f(x_MD):  # an all-gather of x to every device, an all-reduce of the column sums
  full = jax.lax.with_sharding_constraint(x_MD * 2, NamedSharding(mesh, P()))
  return full, x_MD.sum(0)
text = jax.jit(f, out_shardings=NamedSharding(mesh, P())).lower(x).compile().as_text()
found = hlo_stats.step_collectives(text, {"fsdp": 8})
from glm5_jax.planning.cpu_standins import ragged_all_to_all_standin
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
  standin[out_rows] = [[c.op, c.bytes]
                       for c in hlo_stats.step_collectives(compiled.as_text(), {"fsdp": 8})]
  standin[f"shape{out_rows}"] = list(compiled.out_info.shape)
print(json.dumps({"found": [[c.op, c.bytes] for c in found], "standin": standin,
                  "mentions": {k: text.count(" " + k + "(") for k in hlo_stats.OPS}}))
"""


@pytest.mark.slow  # a subprocess with 8 host devices (~15 s)
def test_collectives_of_a_compiled_8_device_program_and_the_ragged_all_to_all_standin():
  result = json.loads(_run(None, _COMPILED_COLLECTIVES).strip().splitlines()[-1])
  kinds = [k for k, _ in result["found"]]
  assert ["all-gather", 64 * 16 * 4] in result["found"], result
  assert any(k == "all-reduce" and b == 16 * 4 for k, b in result["found"]), result
  # every collective instruction the text holds was found, none invented
  assert {k: kinds.count(k) for k in hlo_stats.OPS} == result["mentions"], result
  # the ragged-all-to-all stand-in: one all-to-all of the (row-padded) send buffer, shaped
  # like the output buffer
  for out_rows in ("6", "20"):
    assert result["standin"][out_rows] == [["all-to-all", 16 * 16 * 4]], result
    assert result["standin"][f"shape{out_rows}"] == [8 * int(out_rows), 16], result


_STATE_SHARDINGS = r"""
import json, jax
from configs import tiny
from glm5_jax.planning import hlo_stats, planner
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
              "--config.model.num_hidden_layers=3", "--config.model.mtp_depths=1",
              f"--peak_dump={tmp_path / 'dump'}"])
  result = json.loads(out.strip().splitlines()[-1])
  assert "compiling depth 1 (1 dense + 0 MoE) ..." in out and "extrapolated" in out
  # --peak_dump: what is live at each compiled program's peak, from XLA's own dump
  assert out.count("HBM live at the schedule's peak") == 2
  for c in result["compiled"]:
    peak = c["peak"]
    assert peak["total"] == sum(peak["by_category"].values()) > peak["arguments"] > 0
    assert sum(b for b, *_ in peak["by_source"]) <= peak["total"]
  assert list((tmp_path / "dump").glob("*train_step*live-range.txt"))
  assert [c["layers"] for c in result["compiled"]] == [1, 2]
  for c in result["compiled"]:
    memory = c["memory"]
    assert min(memory["argument"], memory["output"], memory["temp"]) > 0, memory
    assert 0 < memory["alias"] <= memory["argument"]  # the donated state
    assert c["compile_s"] > 0 and c["collectives_per_step"]["op"]["all-reduce"]["count"] > 0
    assert c["flops_per_step"] > 0 and c["unknown_loops"] == 0
  deeper = [c["memory"]["argument"] for c in result["compiled"]]
  assert deeper[1] > deeper[0]
  # arguments at depth 3 (exact, not compiled) hold one more MoE layer. (Not 2 * d2 - d1: at
  # depth 1 the model has no MoE layer, so its MTP layer is dense too.)
  assert result["full_depth"]["argument"] > deeper[1]
  assert "(exact)" in out
  assert result["extrapolated"] and result["total"] > 0
  assert result["fits"] == planner.fits(result["total"]) and result["fits"]["v6e"]
  assert re.search(r"v6e +32 GiB  fits  <== chosen", out), out
  # the roofline of the deepest compile, on the chosen chip, labelled as a CPU-compiled estimate
  assert result["accelerator"] == "v6e" and result["compiler"].startswith("XLA:CPU")
  assert "roofline on v6e" in out and "a BOUND" in out and "not a measurement" in out
  assert 0 < result["estimate"]["mfu"]["serial"] <= result["estimate"]["mfu"]["overlap"] < 1
  # per-step figures at depth 3: each a line through depths 1 and 2, evaluated at 3
  step, (c1, c2) = result["full_depth_step"], result["compiled"]
  assert step["depths"] == [1, 2] and "EXTRAPOLATED linearly from depths [1, 2]" in out
  assert step["flops"] == pytest.approx(2 * c2["flops_per_step"] - c1["flops_per_step"])
  reduce = lambda c: c["collectives_per_step"]["op"]["all-reduce"]["bytes"]
  assert step["collectives_by_kind"]["all-reduce"] == pytest.approx(2 * reduce(c2) - reduce(c1))
  assert 0 < step["estimate"]["mfu"]["serial"] < 1


def test_ragged_dot_standin_has_ragged_dots_shapes_and_is_undone():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from glm5_jax.planning.cpu_standins import ragged_dot_standin  # pylint: disable=g-import-not-at-top
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


def test_aot_targets_parse_slices_and_refuse_a_libtpu_that_does_not_match_jax(monkeypatch):
  from glm5_jax.planning import aot_targets  # pylint: disable=g-import-not-at-top
  assert aot_targets.parse_target("v5p:8x8x16") == ("v5p", (8, 8, 16))
  assert aot_targets.parse_target("v6e:16x16") == ("v6e", (16, 16))
  for bad in ("v5p:8x8", "v4:2x2x1", "v5e:4-4"):
    with pytest.raises(ValueError, match="--target"):
      aot_targets.parse_target(bad)
  assert aot_targets.torus_wrap("v5p", (8, 8, 16)) == (True, True, True)
  assert aot_targets.torus_wrap("v5p", (2, 2, 1)) == (False, False, False)
  assert aot_targets.torus_wrap("v6e", (8, 16)) == (False, True, False)
  metadata = aot_targets.importlib.metadata
  monkeypatch.setattr(aot_targets.importlib.util, "find_spec", lambda name: object())
  monkeypatch.setattr(metadata, "requires", lambda name: [
      'jaxlib==0.10.2', 'libtpu==0.0.42.*; extra == "tpu"'])
  for have, ok in (("0.0.42.1", True), ("0.0.42", True), ("0.0.43", False), ("0.0.4", False)):
    monkeypatch.setattr(metadata, "version", lambda name, have=have: have)
    problem = aot_targets.libtpu_problem()
    assert (problem is None) == ok, (have, problem)
  assert "does not match jax" in problem and "libtpu==0.0.42.*" in problem


@pytest.mark.slow  # the tool in two subprocesses, 8 host devices, no compile (~15 s)
def test_arguments_only_reads_the_shardings_without_compiling():
  """`--arguments_only`: the exact per-device argument bytes from the shardings, no compile; a
  context axis splits params like fsdp (`sharding.default_logical_axis_rules`), data does not."""
  gib = {}
  for mesh in ("data=8", "fsdp=2,context=4"):
    out = _run(["--config=configs/tiny.py", "--devices=8", f"--mesh={mesh}", "--seq_len=256",
                "--arguments_only"])
    assert "compiling" not in out and "not compiled" in out, out
    gib[mesh] = int(re.search(r"GiB \(([0-9,]+) bytes\) per device", out)[1].replace(",", ""))
  assert 0 < gib["fsdp=2,context=4"] < gib["data=8"] / 4, gib
