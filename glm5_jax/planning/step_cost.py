"""A compiled TPU step priced op by op: the per-category table, the collectives on the torus,
and the step time and MFU three ways. Every figure here is a **compiler estimate** (the TPU
compiler's own cost model, `op_costs`), beside which the planner keeps the **bound**
(`roofline.py`: every matmul at peak, nothing else costs, every collective at the chip's whole
ICI bandwidth).

  report = price_text(hlo_text, "v5p:8x8x16", layout, tokens_per_chip, model_flops_per_token)
  print(format_report(report))

`layout` is `planner.mesh_layout(mesh)` (`{"axes": {axis: size}, "coords": [[x, y, z], ...]}`,
saved beside a module by `planner.write_hlo`), so a saved module is priced without compiling.
"""

import dataclasses

import numpy as np

from glm5_jax.accelerators import ACCELERATORS
from glm5_jax.planning import (aot_targets, flop_ledger, hlo_loops, hlo_stats, op_costs,
                               schedule)
from glm5_jax.planning.torus import Torus

WAYS = ("none", "schedule", "ideal")
WAY_LABELS = {"none": "no overlap", "schedule": "the compiled schedule's overlap",
              "ideal": "ideal overlap"}


@dataclasses.dataclass(frozen=True)
class CostReport:
  """Seconds per step per device, each a compiler estimate (module docstring)."""

  target: str
  compute_by_category: dict  # category -> seconds (compiler estimates and kernels)
  kernels_by_category: dict  # category -> seconds (the custom calls' share, at the stated efficiency)
  collectives_by_kind: dict  # opcode -> seconds on the torus (+ the SparseCore's work beside offloaded ones)
  collectives_by_axes: dict  # mesh axes -> seconds on the torus
  times: dict  # WAYS + "compute", "collectives"
  mfu: dict  # WAYS -> MFU, None without model FLOPs
  tokens_per_chip: float
  model_flops: float | None  # per chip per step
  unpriced: dict  # opcode -> executions per step of instructions with no price
  top_ops: tuple  # the costliest instructions per step: (seconds, category, kind, runs, op_name)
  # kernel -> {phase: calls per step}: which custom calls run how often in the forward, the
  # remat recompute and the backward (`kernel_calls`)
  kernel_calls: dict = dataclasses.field(default_factory=dict)
  # the largest waits the compiled schedule exposes, each charged to its collective
  # (`schedule.exposed_waits`): (seconds per step, kind, the collective's op_name)
  top_waits: tuple = ()
  # category -> {phase: seconds}: the compute split by forward / remat / backward
  # (`compute_by_phase`)
  compute_by_phase: dict = dataclasses.field(default_factory=dict)
  # "to host" / "from host" -> {"seconds", "bytes"} per step: transfers between device and host
  # memory (a remat policy's offloaded residuals) on the chip's stated host link
  host_transfers: dict = dataclasses.field(default_factory=dict)


def torus_of(target: str) -> Torus:
  """The physical torus of a TPU slice (`aot_targets.parse_target`), its links' bandwidth from
  the chip table (`Accelerator.ici_bytes_s / ici_links`, one link one way)."""
  chip, dims = aot_targets.parse_target(target)
  spec = ACCELERATORS[chip]
  if spec.ici_links is None:
    raise ValueError(f"{target}: Accelerator.ici_links of {chip} is None (glm5_jax/accelerators.py)")
  wrap = aot_targets.torus_wrap(chip, dims)[:len(dims)]
  return Torus(tuple(dims), tuple(wrap), spec.ici_bytes_s / spec.ici_links)


def _axes_of(cost, module_instrs, layout) -> str:
  instr = module_instrs[cost.groups_from]
  groups = hlo_stats.replica_groups(instr.attributes, len(layout["coords"]))
  return hlo_stats.mesh_axes_of(groups, layout["axes"]) if groups else "?"


def _unpriced(module, costs) -> dict[str, int]:
  """Opcodes of instructions that may move data but got no price (asynchronous copies between
  memory spaces, which the schedule overlaps), with their executions per step."""
  priced = {(c.computation, c.name) for c in costs}
  fused = op_costs.fused_computations(module)
  runs = module.executions()
  found = {}
  for computation, instrs in module.computations.items():
    if computation in fused or not runs.get(computation):
      continue
    for instr in instrs:
      if ((computation, instr.name) in priced or instr.op in op_costs.FREE - {"copy-start"}
          or instr.op.endswith("-done") or hlo_stats.async_collective_role(instr) == "done"
          or op_costs.allocates_only(instr)):
        continue
      found[instr.op] = found.get(instr.op, 0) + runs[computation]
  return dict(sorted(found.items(), key=lambda kv: -kv[1]))


PHASES = ("forward", "remat", "backward")  # flop_ledger.model_phase's


def kernel_calls(costs) -> dict[str, dict[str, int]]:
  """`{kernel: {phase: calls per step}}` of the custom calls priced as kernels, named by the
  jax scope that called them (`.../sparse_mla_backward/pallas_call` -> sparse_mla_backward,
  `jit(gmm)` -> gmm). Against the model's layer count it shows what the compiler recomputes
  on its own: a forward kernel called twice per layer in the forward is the compiler's copy,
  not the model's."""
  found = {}
  for c in costs:
    if not c.kind.startswith("kernel"):
      continue
    parts = c.source.split("/")
    name = parts[-2] if len(parts) > 1 else c.name
    name = name.removeprefix("jit(").removesuffix(")")
    calls = found.setdefault(name, dict.fromkeys(PHASES, 0))
    calls[flop_ledger.model_phase(c.source)] += c.runs
  return dict(sorted(found.items()))


def host_transfers(costs, instrs: dict, bytes_per_s: float | None) -> dict[str, dict[str, float]]:
  """`{"to host" | "from host": {"seconds", "bytes"}}` per step of the host link's transfers
  (`op_costs`, "host link"; `instrs`: the module's instructions by name)."""
  found = {}
  for c in costs:
    row = found.setdefault(op_costs.host_transfer_direction(instrs[c.name]),
                           {"seconds": 0.0, "bytes": 0.0})
    row["seconds"] += c.seconds * c.runs
    row["bytes"] += c.seconds * c.runs * bytes_per_s
  return found


def compute_by_phase(costs) -> dict[str, dict[str, float]]:
  """`{category: {phase: seconds per step}}` of the priced compute (collectives left out), the
  categories largest first; phases as `PHASES`."""
  table = {}
  for c in costs:
    if c.kind in ("torus", op_costs.HOST_LINK):
      continue
    row = table.setdefault(c.category, dict.fromkeys(PHASES, 0.0))
    row[flop_ledger.model_phase(c.source)] += c.seconds * c.runs
  return dict(sorted(table.items(), key=lambda kv: -sum(kv[1].values())))


def price_module(module, target: str, layout: dict, tokens_per_chip: float,
                 model_flops_per_token: float | None, top: int = 10,
                 host_bytes_s: float | None = None) -> CostReport:
  """The report of a parsed module (`hlo_loops.parse_module`) compiled for `target`;
  `host_bytes_s`: the host link's bandwidth in place of the chip's stated one."""
  chip = ACCELERATORS[aot_targets.parse_target(target)[0]]
  if host_bytes_s is not None:
    chip = dataclasses.replace(chip, host_bytes_s=host_bytes_s)
  torus = torus_of(target)
  coords = np.asarray(layout["coords"])
  costs = op_costs.price_module(module, chip, coords, torus)
  offloaded = schedule.sparsecore_collectives(module)  # their work is the collectives' time
  compute = [c for c in costs if c.kind not in ("torus", op_costs.HOST_LINK)
             and c.computation not in offloaded]
  host = [c for c in costs if c.kind == op_costs.HOST_LINK]
  collectives = [c for c in costs if c.kind == "torus"]
  instrs = {i.name: i for v in module.computations.values() for i in v}
  by_kind, by_axes = {}, {}
  for c in collectives:
    base = c.op.removesuffix("-start")
    by_kind[base] = by_kind.get(base, 0.0) + c.seconds * c.runs
    axes = _axes_of(c, instrs, layout)
    by_axes[axes] = by_axes.get(axes, 0.0) + c.seconds * c.runs
  beside = sum(c.seconds * c.runs for c in costs
               if c.kind not in ("torus", op_costs.HOST_LINK) and c.computation in offloaded)
  if beside:
    by_kind["SparseCore work beside offloaded collectives"] = beside
  times, waits = schedule.step_times_and_waits(module, costs)
  model = None if model_flops_per_token is None else model_flops_per_token * tokens_per_chip
  mfu = {way: (model / (times[way] * chip.peak_flops) if model and times[way] else None)
         for way in WAYS}
  ranked = sorted(costs, key=lambda c: -c.seconds * c.runs)[:top]
  sources = {(c.computation, c.name): c.source for c in costs}
  waits = tuple((seconds, kind, sources.get((computation, name), name))
                for seconds, kind, name, computation in waits[:top])
  return CostReport(
      target, op_costs.by_category(compute),
      op_costs.by_category([c for c in compute if c.kind.startswith("kernel")]),
      dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
      dict(sorted(by_axes.items(), key=lambda kv: -kv[1])), times, mfu, tokens_per_chip,
      model, _unpriced(module, costs),
      tuple((c.seconds * c.runs, c.category, c.kind, c.runs, c.source) for c in ranked),
      kernel_calls(compute), waits, compute_by_phase(compute),
      host_transfers(host, instrs, chip.host_bytes_s))


def price_text(hlo_text: str, target: str, layout: dict, tokens_per_chip: float,
               model_flops_per_token: float | None) -> CostReport:
  """`price_module` of an optimized module's text."""
  return price_module(hlo_loops.parse_module(hlo_text), target, layout, tokens_per_chip,
                      model_flops_per_token)


def format_report(report: CostReport, bound=None) -> str:
  """The report as text; `bound`: the roofline's `Estimate` of the same step, printed as the
  bound beside the compiler estimates."""
  lines = [f"compiler estimate on {report.target} (the TPU compiler's estimated_cycles; custom "
           f"calls at {op_costs.KERNEL_EFFICIENCY:.0%} of peak; collectives on the torus): "
           "seconds per step per device"]
  total = report.times["compute"]
  for name, seconds in report.compute_by_category.items():
    kernel = report.kernels_by_category.get(name, 0.0)
    note = f"  (custom calls {kernel:.3f} s)" if kernel else ""
    lines.append(f"  {name:<28}{seconds:9.3f} s  {seconds / total:6.1%}{note}")
  lines.append(f"  {'compute':<28}{total:9.3f} s")
  for name, seconds in report.collectives_by_kind.items():
    lines.append(f"  {'collective ' + name:<28}{seconds:9.3f} s")
  for axes, seconds in report.collectives_by_axes.items():
    lines.append(f"    over {axes or '(one device)':<23}{seconds:9.3f} s")
  lines.append(f"  {'collectives':<28}{report.times['collectives']:9.3f} s")
  for direction, row in report.host_transfers.items():
    lines.append(f"  {'host link, ' + direction:<28}{row['seconds']:9.3f} s  "
                 f"({row['bytes'] / 2 ** 30:,.1f} GiB at "
                 f"{row['bytes'] / row['seconds'] / 1e9:.0f} GB/s one way)")
  # what the compiled schedule leaves uncovered: its step time beyond the compute alone
  exposed = report.times["schedule"] - total
  lines.append(f"  {'  exposed in the schedule':<28}{exposed:9.3f} s  (step with the schedule's "
               "overlap - compute)")
  for way in WAYS:
    mfu = report.mfu[way]
    lines.append(f"  step, {WAY_LABELS[way]:<34}{report.times[way]:9.3f} s"
                 + (f"   MFU {mfu:6.1%} (compiler estimate)" if mfu is not None else ""))
  if bound is not None and bound.mfu.get("serial") is not None:
    lines.append(f"  bound (roofline: matmuls at peak, collectives at full ICI): step "
                 f"{bound.overlap_s:.3f} / {bound.serial_s:.3f} s, MFU {bound.mfu['overlap']:.1%}"
                 f" / {bound.mfu['serial']:.1%} (overlap / none)")
  if report.unpriced:
    lines.append("  not priced (executions per step): " + ", ".join(
        f"{op} {n}" for op, n in list(report.unpriced.items())[:8]))
  if report.kernel_calls:
    lines.append("  kernel calls per step (" + " / ".join(PHASES) + "): " + ", ".join(
        f"{name} " + " / ".join(str(calls[p]) for p in PHASES)
        for name, calls in report.kernel_calls.items()))
  lines.append("  costliest instructions per step:")
  for seconds, category, kind, runs, source in report.top_ops:
    lines.append(f"    {seconds:8.3f} s  {category:<22} {kind:<18} x{runs:<6} ...{source[-70:]}")
  if report.top_waits:
    lines.append("  largest waits the schedule exposes per step (each charged to its collective; "
                 "queued: a synchronous one behind those in flight):")
    for seconds, kind, source in report.top_waits:
      lines.append(f"    {seconds:8.3f} s  {kind:<7} ...{source[-90:]}")
  return "\n".join(lines)
