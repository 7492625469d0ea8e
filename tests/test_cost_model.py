"""The planner's cost model (glm5_jax/planning: op_costs, torus, schedule, step_cost) on programs
whose answer is known from their shapes. The fixtures are the TPU compiler's own optimized
modules (tests/fixtures/cost_model/make_fixtures.py, libtpu 0.0.42.1), read as text: no libtpu
and no compile here."""

import json
import pathlib

import numpy as np
import pytest

from glm5_jax.accelerators import ACCELERATORS
from glm5_jax.planning import hlo_loops, hlo_stats, op_costs, schedule, step_cost, torus
from tools import plan_cost

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "cost_model"
V5P = ACCELERATORS["v5p"]
LINK = V5P.ici_bytes_s / V5P.ici_links  # one v5p link, one way: 100 GB/s
ONE_CHIP = {"axes": {"x": 1}, "coords": [[0, 0, 0]]}


def _load(name):
  text = (FIXTURES / f"{name}.hlo").read_text()
  layout_file = FIXTURES / f"{name}.mesh.json"
  layout = json.loads(layout_file.read_text()) if layout_file.exists() else ONE_CHIP
  return text, layout


def _costs(name, target):
  text, layout = _load(name)
  module = hlo_loops.parse_module(text)
  costs = op_costs.price_module(module, V5P, np.asarray(layout["coords"]),
                                step_cost.torus_of(target))
  return module, costs


def test_one_large_matmul_runs_near_the_mxu_peak_by_the_compilers_cycles():
  """bf16 [8192, 8192] x [8192, 8192]: 2 x 8192^3 FLOPs, 2.40 ms at v5p's 459 TFLOP/s."""
  text, _ = _load("matmul")
  module, costs = _costs("matmul", "v5p:2x2x1")
  (matmul,) = [c for c in costs if c.kind == "compiler estimate" and c.seconds > 1e-4]
  assert matmul.seconds == pytest.approx(4_652_072 / 1.75e9)  # its estimated_cycles
  flops = hlo_stats.step_dot_flops(text, module)["flops"]
  assert flops == 2 * 8192 ** 3
  assert 0.85 < flops / (matmul.seconds * V5P.peak_flops) < 1.0  # 90% of peak
  assert matmul.category == "matmuls (unnamed)"
  times = schedule.step_times(module, costs)
  assert times["none"] == times["schedule"] == times["ideal"] == pytest.approx(matmul.seconds)


def test_an_all_gather_and_an_all_to_all_on_a_known_ring():
  """The z dimension of v5p:4x4x8 (8 chips, wrapped): the all-gather of a 16 MiB result sends
  7/8 of it over two links at once; the all-to-all of a 2 MiB buffer sends 2 MiB / 8 to each
  peer, sum over peers of the hop count 1+2+3+4+3+2+1 = 16, over 16 directed links."""
  module, costs = _costs("ring", "v5p:4x4x8")
  by_op = {c.op: c for c in costs if c.kind == "torus"}
  gathered = 8192 * 1024 * 2
  assert by_op["all-gather"].seconds == pytest.approx(7 / 8 * gathered / (2 * LINK))
  buffer = 1024 * 1024 * 2
  assert by_op["all-to-all"].seconds == pytest.approx(8 * (buffer / 8) * 16 / 16 / LINK)
  text, layout = _load("ring")
  report = step_cost.price_text(text, "v5p:4x4x8", layout, 1024.0, None)
  assert list(report.collectives_by_axes) == ["ring"]
  assert report.times["collectives"] == pytest.approx(
      by_op["all-gather"].seconds + by_op["all-to-all"].seconds)


def test_a_gather_bound_loop_prices_each_gather_by_its_rows_and_runs_it_per_trip():
  """16 iterations, each gathering 2,048 rows of 576 bf16 (2.36 MB) from a 65,536-row table:
  the compiler leaves the gather fusion unpriced, so it is read and written at HBM peak, the
  rows only (not the whole table), 16 times per step."""
  module, costs = _costs("gather_loop", "v5p:2x2x1")
  (gather,) = [c for c in costs if c.category == "gathers/scatters (unnamed)"]
  rows = 2048 * 576 * 2
  assert gather.kind == "HBM at peak" and gather.runs == 16
  assert gather.seconds == pytest.approx((2 * rows + 2048 * 4) / V5P.hbm_bytes_per_s)
  times = schedule.step_times(module, costs)
  body = [c for c in costs if c.runs == 16]
  assert len(body) >= 4
  assert times["schedule"] >= 16 * sum(c.seconds for c in body) * (1 - 1e-9)


_SCATTER_HLO = """HloModule m, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%inner (a0: f32[1024,640], i0: s32[4096,1], u0: f32[4096,640]) -> f32[1024,640] {
  %a0 = f32[1024,640] parameter(0)
  %i0 = s32[4096,1] parameter(1)
  %u0 = f32[4096,640] parameter(2)
  ROOT %sc = f32[1024,640] scatter(%a0, %i0, %u0), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

%outer (a1: f32[1024,640], i1: s32[4096,1], u1: f32[4096,640]) -> f32[1024,640] {
  %a1 = f32[1024,640] parameter(0)
  %i1 = s32[4096,1] parameter(1)
  %u1 = f32[4096,640] parameter(2)
  ROOT %nested = f32[1024,640] fusion(%a1, %i1, %u1), kind=kLoop, calls=%inner
}

ENTRY %main (acc: f32[1024,640], idx: s32[4096,1], upd: f32[4096,640]) -> f32[1024,640] {
  %acc = f32[1024,640] parameter(0)
  %idx = s32[4096,1] parameter(1)
  %upd = f32[4096,640] parameter(2)
  ROOT %scatter_custom_fusion = f32[1024,640] fusion(%acc, %idx, %upd), kind=kCustom, calls=%outer
}
"""


def test_a_scatter_reads_its_updates_whole():
  """A scatter-add of 4,096 fp32 rows of 640 into a 1,024-row accumulator, wrapped in a fusion
  inside a fusion as the TPU compiler writes it (`scatter_custom_fusion`), unpriced by the
  compiler: at HBM peak it reads the updates and indices whole and reads and writes the rows
  they touch (at most the accumulator: 2 x 2.6 MB), not just the result's size per operand."""
  (cost,) = op_costs.price_module(hlo_loops.parse_module(_SCATTER_HLO), V5P)
  updates, indices, accumulator = 4096 * 640 * 4, 4096 * 4, 1024 * 640 * 4
  assert cost.kind == "HBM at peak" and cost.category == "gathers/scatters (unnamed)"
  assert cost.seconds == pytest.approx(
      (updates + indices + 2 * accumulator) / V5P.hbm_bytes_per_s)


# A query-block loop's output written block by block into a buffer `jax.lax.empty` made, as the
# TPU compiler writes both (no estimated_cycles on either): the in-place update of one
# [2, 128, 64, 512] block into the [2, 4096, 64, 512] buffer, and the allocation.
_IN_PLACE_HLO = """HloModule m, is_scheduled=true

ENTRY %main (u: bf16[2,128,64,512], i: s32[]) -> bf16[2,4096,64,512] {
  %u = bf16[2,128,64,512]{3,1,2,0:T(8,128)(2,1)} parameter(0)
  %i = s32[] parameter(1)
  %zero = s32[] constant(0)
  %empty.1 = bf16[2,4096,64,512]{3,1,2,0:T(8,128)(2,1)} custom-call(), custom_call_target="AllocateBuffer", metadata={op_name="jit(f)/sparse_mla/empty"}
  ROOT %dynamic-update-slice.1 = bf16[2,4096,64,512]{3,1,2,0:T(8,128)(2,1)} dynamic-update-slice(%empty.1, %u, %zero, %i, %zero, /*index=5*/%zero), metadata={op_name="jit(f)/sparse_mla/while/body/dynamic_update_slice"}
}
"""


def test_an_in_place_update_moves_its_block_and_an_allocation_nothing():
  module = hlo_loops.parse_module(_IN_PLACE_HLO)
  (cost,) = op_costs.price_module(module, V5P)
  # the update's 8 MiB read and written, not the 512 MiB buffer
  assert (cost.op, cost.kind) == ("dynamic-update-slice", "HBM at peak")
  assert cost.seconds == pytest.approx(2 * 2 * 128 * 64 * 512 * 2 / V5P.hbm_bytes_per_s)
  assert step_cost._unpriced(module, [cost]) == {}  # the allocation is not "unpriced" either


# ---------------------------------------------------------------------------- the schedule

_ASYNC_HLO = """HloModule m, is_scheduled=true

%body (p: (s32[], bf16[8,128])) -> (s32[], bf16[8,128]) {
  %p = (s32[], bf16[8,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8,128] get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one), backend_config={"window_config":{"estimated_cycles":"0"}}
  %y = bf16[8,128] fusion(%x), kind=kLoop, calls=%f, backend_config={"window_config":{"estimated_cycles":"175000"}}
  ROOT %t = (s32[], bf16[8,128]) tuple(%next, %y)
}

%cond (p: (s32[], bf16[8,128])) -> pred[] {
  %p = (s32[], bf16[8,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT, backend_config={"window_config":{"estimated_cycles":"0"}}
}

%f (a: bf16[8,128]) -> bf16[8,128] {
  %a = bf16[8,128] parameter(0)
  ROOT %e = bf16[8,128] exponential(%a)
}

ENTRY %main (w: bf16[1048576,64], x: bf16[8,128]) -> (bf16[8388608,64], bf16[8,128]) {
  %w = bf16[1048576,64] parameter(0)
  %x = bf16[8,128] parameter(1)
  %ag = (bf16[1048576,64], bf16[8388608,64]) all-gather-start(%w), replica_groups=[1,8]<=[8], dimensions={0}
  %mm = bf16[8,128] fusion(%x), kind=kOutput, calls=%f, backend_config={"window_config":{"estimated_cycles":"1750000"}}
  %agd = bf16[8388608,64] all-gather-done(%ag)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,128]) tuple(%zero, %mm)
  %loop = (s32[], bf16[8,128]) while(%init), condition=%cond, body=%body
  %out = bf16[8,128] get-tuple-element(%loop), index=1
  %ar = bf16[8,128] all-reduce(%out), replica_groups=[1,8]<=[8], to_apply=%f
  ROOT %r = (bf16[8388608,64], bf16[8,128]) tuple(%agd, %ar)
}
"""


def test_an_async_collective_hides_behind_the_compute_scheduled_inside_it():
  """An all-gather (1 GiB result over an 8-chip ring: 7/8 GiB at 200 GB/s, 4.70 ms) started
  before a 1 ms fusion and done after it: 3.70 ms exposed; then a 3-trip loop of 0.1 ms and a
  synchronous all-reduce, fully exposed."""
  module = hlo_loops.parse_module(_ASYNC_HLO)
  layout = {"axes": {"ring": 8}, "coords": [[0, 0, z] for z in range(8)]}
  costs = op_costs.price_module(module, V5P, np.asarray(layout["coords"]),
                                torus.Torus((1, 1, 8), (False, False, True), LINK))
  by_name = {c.name: c for c in costs}
  gather = by_name["ag"].seconds
  assert gather == pytest.approx(7 / 8 * 2 ** 30 / (2 * LINK))
  reduce = by_name["ar"].seconds
  compute = 1e-3 + 3 * 1e-4
  times = schedule.step_times(module, costs)
  assert times["compute"] == pytest.approx(compute)
  assert times["none"] == pytest.approx(compute + gather + reduce)
  assert times["schedule"] == pytest.approx(max(gather, 1e-3) + 3 * 1e-4 + reduce)
  assert times["ideal"] == pytest.approx(max(times["compute"], gather + reduce))
  assert times["ideal"] < times["schedule"] < times["none"]
  # Each wait charged to its collective: the gather's uncovered part, the all-reduce whole.
  waits = {(kind, name): seconds for seconds, kind, name, _ in
           schedule.exposed_waits(module, costs)}
  assert waits == pytest.approx({("async", "ag"): gather - 1e-3, ("sync", "ar"): reduce})


_HOST_HLO = """HloModule host, is_scheduled=true

%f (a: bf16[8,128]) -> bf16[8,128] {
  %a = bf16[8,128] parameter(0)
  ROOT %e = bf16[8,128] exponential(%a)
}

ENTRY %main (h: bf16[2,4096,4096], x: bf16[4096,4096], y: bf16[8,128]) -> (bf16[2,4096,4096], bf16[1,4096,4096], bf16[8,128]) {
  %h = bf16[2,4096,4096]{2,1,0:T(8,128)(2,1)S(5)} parameter(0)
  %x = bf16[1,4096,4096]{2,1,0:T(8,128)(2,1)} parameter(1)
  %y = bf16[8,128] parameter(2)
  %i = s32[] constant(0)
  %out = ((bf16[2,4096,4096]{2,1,0:T(8,128)(2,1)S(5)}, bf16[1,4096,4096]{2,1,0:T(8,128)(2,1)}, s32[], s32[], s32[]), bf16[2,4096,4096]{2,1,0:T(8,128)(2,1)S(5)}, u32[]{:S(2)}) dynamic-update-slice-start(%h, %x, %i, %i, %i)
  %mm = bf16[8,128] fusion(%y), kind=kOutput, calls=%f, backend_config={"window_config":{"estimated_cycles":"1750000"}}
  %outd = bf16[2,4096,4096]{2,1,0:T(8,128)(2,1)S(5)} dynamic-update-slice-done(%out)
  %in = ((bf16[2,4096,4096]{2,1,0:T(8,128)(2,1)S(5)}, s32[], s32[], s32[]), bf16[1,4096,4096]{2,1,0:T(8,128)(2,1)}, u32[]{:S(2)}) dynamic-slice-start(%outd, %i, %i, %i), dynamic_slice_sizes={1,4096,4096}
  %ind = bf16[1,4096,4096]{2,1,0:T(8,128)(2,1)} dynamic-slice-done(%in)
  ROOT %r = (bf16[2,4096,4096], bf16[1,4096,4096], bf16[8,128]) tuple(%outd, %ind, %mm)
}
"""


def test_a_host_transfer_runs_on_its_own_stream_and_hides_behind_the_compute_inside_it():
  """A remat policy's residual out to host memory (32 MiB at the chip's stated host link,
  2.10 ms) started before a 1 ms fusion and done after it: 1.10 ms exposed; its read back with
  nothing between start and done: exposed whole. Neither is compute or a collective."""
  module = hlo_loops.parse_module(_HOST_HLO)
  costs = op_costs.price_module(module, V5P, np.asarray([[0, 0, 0]]),
                                step_cost.torus_of("v5p:2x2x1"))
  by_name = {c.name: c for c in costs}
  transfer = 32 * 2 ** 20 / V5P.host_bytes_s
  assert by_name["out"].kind == by_name["in"].kind == op_costs.HOST_LINK
  assert by_name["out"].seconds == by_name["in"].seconds == pytest.approx(transfer)
  times = schedule.step_times(module, costs)
  assert times["compute"] == pytest.approx(1e-3)
  assert times["host"] == pytest.approx(2 * transfer) and times["collectives"] == 0
  assert times["none"] == pytest.approx(1e-3 + 2 * transfer)
  assert times["schedule"] == pytest.approx(max(transfer, 1e-3) + transfer)
  assert times["ideal"] == pytest.approx(2 * transfer)
  waits = {(kind, name): seconds for seconds, kind, name, _ in
           schedule.exposed_waits(module, costs)}
  assert waits == pytest.approx({("host", "out"): transfer - 1e-3, ("host", "in"): transfer})


def test_an_offloaded_residual_goes_out_in_the_forward_and_back_in_the_backward():
  """host_offload.hlo (make_fixtures.py): 8 scanned layers each keep a [4096, 1024] bf16
  residual in host memory: 8 MiB out and 8 MiB back per layer, priced on the host link, left
  out of the compute's categories, on the report's own lines."""
  text, layout = _load("host_offload")
  report = step_cost.price_text(text, "v5p:2x2x1", layout, 4096, None)
  moved = 8 * 4096 * 1024 * 2
  assert set(report.host_transfers) == {"to host", "from host"}
  for row in report.host_transfers.values():
    assert row == pytest.approx({"seconds": moved / V5P.host_bytes_s, "bytes": moved})
  assert report.times["host"] == pytest.approx(2 * moved / V5P.host_bytes_s)
  assert sum(report.compute_by_category.values()) == pytest.approx(report.times["compute"])
  assert report.times["none"] == pytest.approx(report.times["compute"] + report.times["host"])
  assert report.times["compute"] < report.times["schedule"] < report.times["none"]
  assert "dynamic-update-slice-start" not in report.unpriced
  text = step_cost.format_report(report)
  assert "host link, to host" in text and "(0.1 GiB at 16 GB/s one way)" in text
  # At half the link (`tools/plan_cost.py --host_gb_s=8`) each transfer takes twice as long.
  slower = step_cost.price_module(hlo_loops.parse_module(_load("host_offload")[0]), "v5p:2x2x1",
                                  layout, 4096, None, host_bytes_s=8e9)
  assert slower.times["host"] == pytest.approx(2 * report.times["host"])
  assert slower.times["compute"] == pytest.approx(report.times["compute"])


def test_plan_cost_refuses_a_host_link_of_no_bandwidth(capsys):
  with pytest.raises(SystemExit):
    plan_cost.main(["--hlo=x.hlo", "--target=v5p:2x2x1", "--host_gb_s=0"])
  assert "--host_gb_s: a bandwidth in GB/s > 0, got 0.0" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the torus

def test_torus_rings_lines_strides_and_several_dimensions():
  coords = np.asarray([[x, y, 0] for x in range(8) for y in range(4)])
  tor = torus.Torus((8, 4, 1), (True, False, False), LINK)
  along_x = [[x * 4 + y for x in range(8)] for y in range(4)]  # a closed ring of 8
  assert torus.ring_rate(along_x, coords, tor) == pytest.approx(2 * LINK)
  along_y = [[x * 4 + y for y in range(4)] for x in range(8)]  # an open line of 4
  assert torus.ring_rate(along_y, coords, tor) == pytest.approx(LINK)
  every_other_x = [[x * 4 for x in range(0, 8, 2)], [x * 4 for x in range(1, 8, 2)]]
  assert torus.ring_rate(every_other_x, coords, tor) == pytest.approx(LINK)  # 2 groups share
  both = [list(range(32))]  # the ring and the line at once
  assert torus.ring_rate(both, coords, tor) == pytest.approx(3 * LINK)
  # a uniform all-to-all along the open line of 4: the middle link carries 2 x 2 pairs' bytes
  s = 4e6
  seconds = torus.collective_seconds("all-to-all", 0.0, s, along_y, coords, tor)
  assert seconds == pytest.approx(4 * s / 4 / LINK)
  # a permute to the next chip round the ring: one link each, the whole array
  pairs = [[x * 4, ((x + 1) % 8) * 4] for x in range(8)]
  assert torus.collective_seconds("collective-permute", 0.0, s, pairs, coords, tor) == \
      pytest.approx(s / LINK)


def test_a_group_on_no_torus_dimension_is_an_error():
  tor = torus.Torus((2, 1, 1), (False, False, False), LINK)
  with pytest.raises(ValueError, match="span no torus dimension"):
    torus.ring_rate([[0, 0]], np.asarray([[0, 0, 0], [1, 0, 0]]), tor)


def test_a_synchronous_all_gather_in_a_scanned_loop_is_fully_exposed():
  """The TPU compiler's schedule of 4 scanned steps, each gathering a [4096, 4096] weight over
  the ring and multiplying by it: the gather stays synchronous (no start/done pair), so the
  schedule-aware time is the no-overlap time."""
  module, costs = _costs("overlap", "v5p:4x4x8")
  (gather,) = [c for c in costs if c.kind == "torus"]
  assert gather.op == "all-gather" and gather.runs == 4
  assert gather.seconds == pytest.approx(7 / 8 * 4096 * 4096 * 2 / (2 * LINK))
  times = schedule.step_times(module, costs)
  assert times["schedule"] == pytest.approx(times["none"])
  assert times["ideal"] < times["none"]



def test_async_collective_fusions_hide_the_pipelined_gathers():
  """The same program compiled with libtpu's async-collective flags
  (aot_targets.ASYNC_COLLECTIVE_FLAGS) and its ICI all-gather pipelining
  (make_fixtures.ICI_AG_PIPELINING): the first gather is peeled and synchronous, the 3 later
  ones are async collective fusions issued an iteration ahead (start, a continuation fusing
  the matmul, done), each copy holding the same all-gather. Counted once each, 4 gathers per
  step as before; the 3 hidden behind their matmul, so only the peeled one is exposed."""
  module, costs = _costs("overlap_async", "v5p:4x4x8")
  seconds = 7 / 8 * 4096 * 4096 * 2 / (2 * LINK)
  gathers = [c for c in costs if c.kind == "torus"]
  assert sorted((c.op, c.runs) for c in gathers) == [("all-gather", 1), ("all-gather", 3)]
  assert all(c.seconds == pytest.approx(seconds) for c in gathers)
  layout = json.loads((FIXTURES / "overlap_async.mesh.json").read_text())
  found = hlo_stats.step_collectives((FIXTURES / "overlap_async.hlo").read_text(),
                                     layout["axes"], module)
  assert sum(c.runs for c in found) == 4
  times = schedule.step_times(module, costs)
  assert times["collectives"] == pytest.approx(4 * seconds)
  assert times["schedule"] == pytest.approx(times["compute"] + seconds)
  assert times["schedule"] < times["none"]
  # Per step the charged waits are what the schedule adds to the compute: the peeled gather.
  waits = schedule.exposed_waits(module, costs)
  assert sum(w[0] for w in waits) == pytest.approx(times["schedule"] - times["compute"])
  assert waits[0][0] == pytest.approx(seconds) and waits[0][1] == "sync"


def test_a_collective_offloaded_to_the_sparsecore_shares_the_links_with_the_tensorcores():
  """The TPU compiler's module with v5p's flags (aot_targets.ASYNC_COLLECTIVE_FLAGS["v5p"]): a
  [4096, 4096] reduce-scatter over the 8-chip ring runs on the SparseCore (`call-start` of a
  computation holding it), an all-to-all issued after it stays on the TensorCore. Both cross
  the same ICI links, so with transfers made 10x slower than the compute after them the
  all-to-all queues behind the reduce-scatter and the step waits for both in turn; the waits
  are charged to the all-to-all (what the TensorCore waits for), none inside the SparseCore's
  computation. At their own prices both hide behind the matmuls."""
  module, costs = _costs("offload_sc", "v5p:4x4x8")
  (reduce_scatter,) = [c for c in costs if c.op == "reduce-scatter"]
  (all_to_all,) = [c for c in costs if c.op == "all-to-all-start"]
  assert reduce_scatter.kind == all_to_all.kind == "torus"
  assert reduce_scatter.seconds == pytest.approx(7 / 8 * 4096 * 4096 * 2 / (2 * LINK))
  entry = [i.name for i in module.computations[module.entry]]
  call = entry.index("reduce-scatter.2.cloned.1.call-start")
  assert reduce_scatter.computation in module.computations[module.entry][call].attributes
  # The reduction the reduce-scatter calls runs on the SparseCore too: the collective's time.
  offloaded = schedule.sparsecore_collectives(module)
  assert offloaded == {reduce_scatter.computation, "region_0.0.clone"}
  beside = [c for c in costs if c.computation in offloaded and c.kind != "torus"]
  assert [c.op for c in beside] == ["add"]
  times = schedule.step_times(module, costs)
  assert times["compute"] == pytest.approx(sum(
      c.seconds * c.runs for c in costs if c.computation == module.entry and c.kind != "torus"))
  assert times["collectives"] == pytest.approx(
      reduce_scatter.seconds + all_to_all.seconds + beside[0].seconds)
  assert times["schedule"] == pytest.approx(times["compute"]) == times["ideal"]  # all hidden
  slow = [c._replace(seconds=10 * c.seconds) if c.kind == "torus" else c for c in costs]
  price = {c.name: c.seconds for c in slow if c.computation == module.entry}
  before = sum(price.get(name, 0.0) for name in entry[:call])
  after = price["copy.6"]  # the all-to-all's result copied out, after its done
  times = schedule.step_times(module, slow)
  assert times["schedule"] == pytest.approx(
      before + 10 * (reduce_scatter.seconds + all_to_all.seconds) + after)
  waits = schedule.exposed_waits(module, slow)
  assert [(kind, name) for _, kind, name, _ in waits] == [("async", "all-to-all-start")]
  assert waits[0][0] == pytest.approx(times["schedule"] - before - after
                                      - 2 * price["convolution_tanh_fusion"])


@pytest.mark.parametrize("op_name, expected", [
    ("jit(train_step)/transpose(jvp(GLM5))/GLM5._scanned_run/while/body/closed_call/checkpoint/"
     "layers_3_77.body/layers_3_77/self_attn/while/body/closed_call/blht,blhc->bltc/dot_general",
     "DSA sparse"),
    ("jit(train_step)/jvp(GLM5)/GLM5._scanned_run/while/body/closed_call/layers_3_77.body/"
     "layers_3_77/self_attn/closed_call/while/body/closed_call/while/body/blji,bsi->bljs/"
     "dot_general", "indexer"),
    ("jit(train_step)/jvp(GLM5)/GLM5._scanned_run/while/body/closed_call/layers_3_77.body/"
     "layers_3_77/self_attn/closed_call/while/body/closed_call/checkpoint/blji,blti->bljt/"
     "dot_general", "indexer"),
    ("jit(train_step)/transpose(jvp(GLM5))/GLM5._scanned_run/while/body/closed_call/checkpoint/"
     "layers_1_1.body/layers_1_1/self_attn/sparse_mla/while/body/closed_call/"
     "vmap(blgt,blgp->bltp)/dot_general", "DSA sparse"),
    ("jit(train_step)/jvp(GLM5)/GLM5._scanned_run/while/body/closed_call/layers_1_1.body/"
     "layers_1_1/self_attn/sparse_mla/concatenate", "DSA sparse"),
    ("jit(train_step)/jvp(GLM5)/GLM5._scanned_run/while/body/closed_call/layers_1_1.body/"
     "layers_1_1/self_attn/indexer_scores_at/while/body/closed_call/blji,blti->bljt/dot_general",
     "indexer"),
    ("jit(train_step)/jvp(GLM5)/GLM5._scanned_run/while/body/closed_call/layers_3_77.body/"
     "layers_3_77/self_attn/dot_general", "attention projections"),
    ("jit(train_step)/jvp(GLM5)/GLM5._scanned_run/while/body/closed_call/layers_3_77.body/"
     "layers_3_77/self_attn/shard_map/kl_target/while/body/closed_call/blhc,bltc->blht/"
     "dot_general", "DSA sparse"),  # the KL target's second pass (128K step)
    ("jit(train_step)/jvp(GLM5)/GLM5._scanned_run/while/body/closed_call/layers_3_77.body/"
     "layers_3_77/mlp/shard_map/jit(gmm)/pallas_call", "experts and FFN"),
    ("jit(train_step)/jvp(GLM5)/GLM5._scanned_run/while/body/closed_call/layers_3_77.body/"
     "layers_3_77/mlp/shard_map/ragged_all_to_all", "MoE dispatch/relayout"),
    ("jit(train_step)/jvp(GLM5)/GLM5._scanned_run/while/body/closed_call/layers_3_77.body/"
     "layers_3_77/mlp/top_k", "router"),
    ("jit(train_step)/while/body/closed_call/vmap()/closed_call/dot_general", "optimizer"),
    # Gradient accumulation: the model inside the microbatch loop (train.step.MICROBATCH_SCOPE).
    ("jit(train_step)/while/body/closed_call/microbatch/jvp(GLM5)/GLM5._scanned_run/while/body/"
     "closed_call/layers_3_77.body/layers_3_77/self_attn/dot_general", "attention projections"),
    ("jit(train_step)/while/body/closed_call/microbatch/transpose(jvp(GLM5))/bld,dy->bly/"
     "dot_general", "loss and LM head"),
    ("jit(train_step)/transpose(jvp(GLM5))/bld,dy->bly/dot_general", "loss and LM head"),
    ("jit(train_step)/jvp()/reduce_sum", "loss and LM head"),
    ("jit(train_step)/transpose(jvp(GLM5))/jit(_take)/scatter-add", "embedding"),
])
def test_the_headline_steps_op_names_fall_in_their_categories(op_name, expected):
  """op_names read from the headline step's optimized module (docs/scaling.md)."""
  assert op_costs.category(op_name, "fusion") == expected


def test_unnamed_ops_fall_back_on_what_they_compute():
  assert op_costs.category("", "fusion", frozenset({"convolution"})) == "matmuls (unnamed)"
  assert op_costs.category("", "fusion", frozenset({"gather"})) == "gathers/scatters (unnamed)"
  assert op_costs.category("", "copy") == "copies/transposes"
  assert op_costs.category("", "fusion", frozenset({"add", "multiply"})) == "elementwise"


def test_a_sparsecore_computation_closes_and_unknown_cycles_fall_back():
  """The TPU compiler closes a SparseCore computation with `}, execution_thread="sparsecore"`
  (the parser used to run on into the next computation), and writes INT64_MAX cycles for what
  it cannot estimate: priced at HBM peak instead."""
  text = """HloModule m, is_scheduled=true

%sc (a: s32[256]) -> s32[256] {
  ROOT %a = s32[256] parameter(0)
}, execution_thread="sparsecore"

%next (b: s32[256]) -> s32[256] {
  %b = s32[256] parameter(0)
  ROOT %n = s32[256] negate(%b), backend_config={"window_config":{"estimated_cycles":"9223372036854775807"}}
}

ENTRY %main (p: s32[256]) -> s32[256] {
  %p = s32[256] parameter(0)
  ROOT %c = s32[256] call(%p), to_apply=%next
}
"""
  module = hlo_loops.parse_module(text)
  assert [i.name for i in module.computations["next"]] == ["b", "n"]
  (cost,) = op_costs.price_module(module, V5P)
  assert cost.kind == "HBM at peak" and cost.seconds == pytest.approx(2048 / V5P.hbm_bytes_per_s)


def test_kernel_calls_count_each_kernel_per_phase():
  """Custom calls priced as kernels, counted per step by the phase their op_name puts them in:
  the remat recompute (`rematted_computation`, also inside `transpose(...)`), the backward
  (`transpose(...)`), else the forward; named by their jax scope; other ops not counted."""
  scan = "jit(train_step)/jvp(GLM5)/GLM5._scanned_run/while/body/closed_call/layers_3_77.body/"
  back = "jit(train_step)/transpose(jvp(GLM5))/GLM5._scanned_run/while/body/closed_call/checkpoint/"
  cost = lambda source, runs, kind="kernel at 60%": op_costs.OpCost(
      "k", "c", "custom-call", "DSA sparse", kind, 1e-3, runs, source)
  costs = [cost(scan + "self_attn/sparse_mla/shard_map/sparse_mla_forward/pallas_call", 74),
           cost(scan + "self_attn/sparse_mla/shard_map/sparse_mla_forward/pallas_call", 74),
           cost(back + "rematted_computation/layers_3_77.body/self_attn/sparse_mla/shard_map/"
                "sparse_mla_forward/pallas_call", 74),
           cost(back + "layers_3_77.body/self_attn/sparse_mla/shard_map/while/body/closed_call/"
                "sparse_mla_backward/pallas_call", 2368),
           cost(back + "layers_3_77.body/mlp/shard_map/jit(tgmm)/pallas_call", 74),
           cost(scan + "self_attn/dot_general", 74, kind="compiler estimate")]
  assert step_cost.kernel_calls(costs) == {
      "sparse_mla_forward": {"forward": 148, "remat": 74, "backward": 0},
      "sparse_mla_backward": {"forward": 0, "remat": 0, "backward": 2368},
      "tgmm": {"forward": 0, "remat": 0, "backward": 74}}


def test_plan_costs_compute_by_phase_splits_each_category_and_leaves_collectives_out():
  """`step_cost.compute_by_phase` (`tools/plan_cost.py --by_phase`): each priced instruction's
  seconds x runs in its category and the phase its op_name puts it in; the largest category
  first; torus-priced collectives are not compute."""
  scan = "jit(train_step)/jvp(GLM5)/GLM5._scanned_run/while/body/closed_call/layers_3_77.body/"
  back = "jit(train_step)/transpose(jvp(GLM5))/GLM5._scanned_run/while/body/closed_call/checkpoint/"
  cost = lambda category, source, seconds, runs, kind="compiler estimate": op_costs.OpCost(
      "i", "c", "fusion", category, kind, seconds, runs, source)
  costs = [cost("DSA sparse", scan + "self_attn/sparse_mla/while/exp", 1e-3, 75),
           cost("DSA sparse", back + "rematted_computation/layers_3_77.body/self_attn/x", 1e-3, 75),
           cost("DSA sparse", back + "layers_3_77.body/self_attn/sparse_mla/y", 2e-3, 75),
           cost("optimizer", "jit(train_step)/while/body/closed_call/vmap()/dot_general", 0.5, 1),
           cost("MoE dispatch/relayout", scan + "mlp/shard_map/ragged_all_to_all", 9.0, 75,
                kind="torus")]
  table = step_cost.compute_by_phase(costs)
  assert list(table) == ["optimizer", "DSA sparse"]
  assert table["DSA sparse"] == pytest.approx({"forward": 0.075, "remat": 0.075,
                                               "backward": 0.15})
  assert table["optimizer"] == {"forward": 0.5, "remat": 0.0, "backward": 0.0}
  text = plan_cost.format_by_phase(table)
  assert "  compute" in text and text.splitlines()[-1].split()[-1] == "0.800"


# A synchronous reduce-scatter fusion (an all-reduce whose root slices the device's part) beside
# an async collective fusion's start and done: the TPU compiler numbers every all-reduce channel
# 1, so only the `chain_id` the async copies share tells them from the synchronous one.
_CHAINED_HLO = """HloModule chained
%sum (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %add = bf16[] add(%a, %b)
}
%all-reduce-scatter.1 (input.1: bf16[8,4096], offset.1: s32[]) -> bf16[1,4096] {
  %input.1 = bf16[8,4096]{1,0} parameter(0)
  %offset.1 = s32[] parameter(1)
  %all-reduce.1 = bf16[8,4096]{1,0} all-reduce(%input.1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%sum, frontend_attributes={from-cross-replica-sharding="true"}
  %zero.1 = s32[] constant(0)
  ROOT %dynamic-slice.1 = bf16[1,4096]{1,0} dynamic-slice(%all-reduce.1, %offset.1, %zero.1), dynamic_slice_sizes={1,4096}
}
%fused_computation.start (param.2: bf16[8,4096]) -> bf16[8,4096] {
  %param.2 = bf16[8,4096]{1,0} parameter(0)
  ROOT %all-reduce.2 = bf16[8,4096]{1,0} all-reduce(%param.2), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%sum, frontend_attributes={chain_id="7"}
}
%fused_computation.done (param.3: bf16[8,4096]) -> bf16[8,4096] {
  %param.3 = bf16[8,4096]{1,0} parameter(0)
  ROOT %all-reduce.3 = bf16[8,4096]{1,0} all-reduce(%param.3), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%sum, frontend_attributes={chain_id="7"}
}
ENTRY %main (x: bf16[8,4096], y: bf16[8,4096], offset: s32[]) -> (bf16[1,4096], bf16[8,4096]) {
  %x = bf16[8,4096]{1,0} parameter(0)
  %y = bf16[8,4096]{1,0} parameter(1)
  %offset = s32[] parameter(2)
  %fusion.1 = bf16[1,4096]{1,0} fusion(%x, %offset), kind=kCustom, calls=%all-reduce-scatter.1
  %async-collective-start = bf16[8,4096]{1,0} fusion(%y), kind=kCustom, calls=%fused_computation.start
  %async-collective-done = bf16[8,4096]{1,0} fusion(%async-collective-start), kind=kCustom, calls=%fused_computation.done
  ROOT %tuple = (bf16[1,4096]{1,0}, bf16[8,4096]{1,0}) tuple(%fusion.1, %async-collective-done)
}
"""


def test_a_synchronous_reduce_scatter_fusion_is_not_an_async_collectives_copy():
  """Both collectives share channel 1: the done's copy of the async all-reduce is an echo (not
  priced again), the reduce-scatter fusion is a collective of its own (it was taken for an
  echo, and priced as a few bytes of HBM traffic: the 744B step's expert weight gradients)."""
  module = hlo_loops.parse_module(_CHAINED_HLO)
  assert hlo_stats.collective_echoes(module) == {"fused_computation.done"}
  fused = op_costs.fused_collectives(module)
  assert fused["all-reduce-scatter.1"][0] == "reduce-scatter"
  assert fused["fused_computation.start"][0] == "all-reduce"
  coords = np.array([[0, 0, z] for z in range(8)])
  costs = {c.name: c for c in op_costs.price_module(module, V5P, coords,
                                                    step_cost.torus_of("v5p:4x4x8"))}
  assert costs["fusion.1"].kind == "torus" and costs["fusion.1"].op == "reduce-scatter"
  assert costs["async-collective-start"].kind == "torus"
  assert "async-collective-done" not in costs
  # a reduce-scatter moves half an all-reduce's bytes on the same ring
  assert costs["fusion.1"].seconds == pytest.approx(costs["async-collective-start"].seconds / 2)
