"""Every instruction of an optimized TPU module priced, and put in a category of the model.

  costs = price_module(module, chip, coords, torus)     # [OpCost], one per priced instruction
  by_category(costs)                                    # {category: seconds per step}

Three prices, each labelled with what it is (`OpCost.kind`):

  "compiler estimate"   the TPU compiler's own cost model: `estimated_cycles` in the
                        instruction's backend_config (`window_config`), written for every
                        fusion, copy, gather, ... it schedules; seconds = cycles / the chip's
                        clock (`Accelerator.clock_hz`)
  "kernel at N%"        a custom call the compiler does not price (a Mosaic kernel: megablox
                        `gmm` / `tgmm`, the DSA Pallas kernels; the native `ragged-dot`): its
                        FLOPs and bytes (the kernel's `pl.CostEstimate`, else the ragged
                        product's 2 x rows x K x N) at `KERNEL_EFFICIENCY` of the chip's peak
                        FLOP/s and HBM bandwidth, whichever is slower
  "HBM at peak"         an instruction the compiler left unpriced (a gather or scatter
                        fusion, a scalar op): its result plus each operand up to the result's
                        size (a gather reads only the rows it returns; a scatter reads its
                        updates whole and the rows they touch: `hbm_seconds`) at the chip's
                        HBM bandwidth, a bound
  "torus"               a collective (`torus.collective_seconds` on the slice's coordinates)
  "host link"           an asynchronous transfer between the device and host memory (a remat
                        policy's offloaded residuals: XLA's `dynamic-update-slice-start` into
                        a buffer in host memory, `dynamic-slice-start` out of one, a
                        `copy-start` either way): the bytes it moves at the chip's host link
                        (`Accelerator.host_bytes_s`, stated, not measured), on a stream of its
                        own in the schedule (`schedule.py`)

Instructions inside a fusion's computation are not priced again (the fusion's cycles are the
whole fusion's). An instruction's executions per step are its computation's
(`hlo_loops.Module.executions`: loops' trip counts multiplied).

Categories come from the instruction's `op_name` metadata (the jax function and flax module
path that emitted it; `CATEGORY_RULES`, first match wins), then, for what no rule names, from
what it computes: a matmul, a gather or scatter, a copy or transpose, else elementwise.
"""

import re
from typing import NamedTuple

import numpy as np

from glm5_jax.accelerators import Accelerator
from glm5_jax.planning import hlo_stats, torus as torus_lib

HOST_LINK = "host link"  # `OpCost.kind` of a transfer between device and host memory

# Stated, not measured: a Pallas kernel's share of the chip's peak FLOP/s and HBM bandwidth.
KERNEL_EFFICIENCY = 0.6

# (category, regex over op_name), first match wins. The op_name is the jax path that emitted
# an instruction: `jit(train_step)/` then `jvp(GLM5)/...` (forward), `transpose(jvp(GLM5))/...`
# (backward, remat recompute under `rematted_computation`), or the optimizer's own functions at
# the train step's top level (`while/` and `vmap()` of the per-layer Muon map, `jit(_pad)` of whole_matrices).
# Inside a layer: flax module names (`self_attn/`, `mlp/`, `mlp/shard_map/` for the
# expert-parallel dispatch, `jit(gmm)` / `jit(tgmm)` for megablox) and the einsum strings of
# pallas_kernels (the indexer's `blji,bsi->bljs`, the sparse MLA's `blhc,bltc->blht`). The DSA
# `xla` path runs a query-block loop (`self_attn/.../while/`): the indexer's key-block loop
# nested in it, its KL target (`blji,blti->bljt`) and the top-k sort are the indexer, the rest
# of the loop (row gathers, scores, softmax, values) the sparse attention; since the `xla`
# path's own custom VJP (`pallas_kernels/sparse_mla_xla.py`) its ops carry the `sparse_mla/`
# scope, the KL's target where a second pass computes it `kl_target/` (a sparse attention
# pass: DSA sparse), and the KL's scores at the selection `indexer_scores_at/` (the indexer's).
CATEGORY_RULES = (
    ("optimizer", r"^jit\(train_step\)/(while/|vmap|jit\(_pad\)|jit\(norm\))|opt_state|muon|adam"),
    ("loss and LM head", r"^jit\([^)/]*\)/(transpose\()?jvp\((jit\(take_along_axis\))?\)|"
                         r"bld,dy->bly|lm_head|shared_head|log_softmax|logsumexp"),
    ("embedding", r"^jit\([^)/]*\)/(transpose\()?jvp\(GLM5\)\)?/jit\(_take\)|embed"),
    ("router", r"/mlp/(?!shard_map|shared_experts|experts)"),
    ("experts and FFN", r"/mlp/shard_map/(jit\((gmm|tgmm|silu)\)|mul)|shared_experts|"
                        r"/mlp/experts|layers_0_\d+/mlp/"),
    ("MoE dispatch/relayout", r"/mlp/shard_map|^mxs?d,mx->ms?d|ragged_all_to_all"),
    ("indexer", r"self_attn/.*(while/body/closed_call/(checkpoint/)?(rematted_computation/)?"
                r"while/|blji|bljs|bljt|blj,|/sort|top_k|indexer)"),
    ("DSA sparse", r"self_attn/(closed_call/|checkpoint/|rematted_computation/)*while|"
                   r"self_attn/sparse_mla/|self_attn/.*kl_target/"),
    ("attention projections", r"self_attn/"),
)
_RULES = tuple((name, re.compile(pattern, re.I)) for name, pattern in CATEGORY_RULES)
# Gradient accumulation runs the model inside a loop (`glm5_jax.train.step.MICROBATCH_SCOPE`):
# `jit(train_step)/while/body/closed_call/microbatch/jvp(GLM5)/...`. Without its loop prefix an
# op_name reads as in a step of one pass (the rules above; the loop's own prefix is the
# optimizer's).
_MICROBATCH_LOOP = re.compile(r"(^|/)while/body/(closed_call/)*microbatch/")
_COPIES = ("copy", "transpose", "copy-start", "copy-done", "bitcast-convert", "reshape",
           "dynamic-slice", "dynamic-update-slice", "slice", "concatenate", "pad")
# Instructions that move no data of their own (or are priced through what they call).
FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                  "call", "conditional", "after-all", "partition-id", "replica-id",
                  "opt-barrier", "async-start", "async-update", "async-done", "copy-start",
                  "copy-done", "send", "recv", "send-done", "recv-done", "call-start",
                  "call-done"})
# The compiler writes INT64_MAX cycles for what it cannot estimate (SparseCore offloads).
_UNKNOWN_CYCLES = 2 ** 62
_CYCLES = re.compile(r'"estimated_cycles"\s*:\s*"?(\d+)')
_KERNEL_COST = re.compile(r'cost_estimate\\?"\s*:\s*\{\\?"flops\\?"\s*:\s*\\?"?(\d+)\\?"?\s*,'
                          r'\s*\\?"transcendentals\\?"\s*:\s*\\?"?(\d+)\\?"?\s*,'
                          r'\s*\\?"bytes_accessed\\?"\s*:\s*\\?"?(\d+)')
_CALLS = re.compile(r"\bcalls=%([^\s,}]+)")
# XLA's memory space of host memory (`Layout::kHostMemorySpace`), in a layout `{...S(5)}`.
HOST_MEMORY_SPACE = 5
_HOST_MEMORY = re.compile(rf"S\({HOST_MEMORY_SPACE}\)")
_HOST_TRANSFERS = ("dynamic-update-slice-start", "dynamic-slice-start", "copy-start")
_SLICE_SIZES = re.compile(r"dynamic_slice_sizes=\{([\d,]*)\}")
_ALLOCATE = re.compile(r'custom_call_target="AllocateBuffer"')
COLLECTIVES = hlo_stats.OPS


class OpCost(NamedTuple):
  """One priced instruction: `seconds` per execution, `runs` per step."""

  name: str
  computation: str
  op: str
  category: str
  kind: str  # "compiler estimate", "kernel at 60%", "torus"
  seconds: float
  runs: int
  source: str  # op_name
  groups_from: str = ""  # a collective: the instruction whose replica groups it runs over


def allocates_only(instr) -> bool:
  """`jax.lax.empty`'s XLA `AllocateBuffer` custom call: it reserves a buffer, moves no data."""
  return instr.op == "custom-call" and bool(_ALLOCATE.search(instr.attributes))


def category(op_name: str, op: str, contents: frozenset = frozenset()) -> str:
  """The model part an instruction belongs to (module docstring); `contents`: the opcodes of
  a fusion's computations (nested fusions' included)."""
  op_name = _MICROBATCH_LOOP.sub(r"\1", op_name, count=1)
  for name, pattern in _RULES:
    if pattern.search(op_name):
      return name
  ops = contents | {op.removesuffix("-start").removesuffix("-done")}
  if ops & set(COLLECTIVES):
    return "collectives (unnamed)"
  if ops & {"dot", "convolution", "ragged-dot"}:
    return "matmuls (unnamed)"
  if ops & {"gather", "scatter"}:
    return "gathers/scatters (unnamed)"
  if ops & set(_COPIES) and not ops - set(_COPIES) - {"parameter", "bitcast", "constant"}:
    return "copies/transposes"
  return "elementwise"


def fused_computations(module) -> set[str]:
  """Computations called by fusions (priced as their fusion) and their own callees."""
  fused = set()
  for instrs in module.computations.values():
    for instr in instrs:
      if instr.op == "fusion":
        fused.update(_CALLS.findall(instr.attributes))
  stack = list(fused)
  while stack:  # a fusion's nested fusions and reducers
    for instr in module.computations.get(stack.pop(), ()):
      for callee in instr.callees():
        if callee not in fused:
          fused.add(callee)
          stack.append(callee)
  return fused


def host_transfer_bytes(instr, shapes: dict) -> int | None:
  """The bytes an asynchronous transfer between device and host memory moves (the update a
  `dynamic-update-slice-start` writes, the slice a `dynamic-slice-start` reads, the array a
  `copy-start` copies), None when `instr` is not one."""
  if instr.op not in _HOST_TRANSFERS or not _HOST_MEMORY.search(instr.result_type):
    return None
  if instr.op == "dynamic-update-slice-start":
    update = shapes.get(instr.operands[1], ()) if len(instr.operands) > 1 else ()
    return sum(hlo_stats.array_bytes(*a) for a in update)
  results = hlo_stats._arrays(instr.result_type)
  if instr.op == "dynamic-slice-start":
    sizes = _SLICE_SIZES.search(instr.attributes)
    if sizes is None or not results:
      raise ValueError(f"{instr.name}: a dynamic-slice-start without dynamic_slice_sizes")
    return hlo_stats.array_bytes(results[0][0], [int(n) for n in sizes[1].split(",") if n])
  return hlo_stats.array_bytes(*results[0])


def host_transfer_direction(instr) -> str:
  """"to host" or "from host": a `dynamic-slice-start` reads host memory, a
  `dynamic-update-slice-start` writes it, a `copy-start` writes it when its destination (the
  first array of its result) is there."""
  if instr.op == "dynamic-slice-start":
    return "from host"
  if instr.op == "copy-start":
    first = re.search(r"\[[\d,]*\]\{[^}]*\}", instr.result_type)
    return "to host" if first and _HOST_MEMORY.search(first[0]) else "from host"
  return "to host"


def compiler_seconds(instr, chip: Accelerator) -> float | None:
  """The compiler's `estimated_cycles` of `instr` / the chip's clock, None when it has none."""
  match = _CYCLES.search(instr.attributes)
  if match is None or int(match[1]) >= _UNKNOWN_CYCLES:
    return None
  if chip.clock_hz is None:
    raise ValueError("the compiler's estimate needs the chip's clock: Accelerator.clock_hz is "
                     "None for this chip (glm5_jax/accelerators.py)")
  return int(match[1]) / chip.clock_hz


def kernel_work(instr, shapes: dict) -> tuple[float, float] | None:
  """A custom call's `(FLOPs, bytes)`: its `pl.CostEstimate`, else a ragged product's; None
  for a custom call with neither (its work is unknown)."""
  if match := _KERNEL_COST.search(instr.attributes):
    return float(match[1]), float(match[3])
  if instr.name.startswith("ragged-dot"):
    flops = hlo_stats._ragged_dot_flops(instr, shapes) or 0.0
    arrays = hlo_stats._arrays(instr.operand_text) or sum(
        (shapes.get(n, ()) for n in instr.operands), ())
    nbytes = sum(hlo_stats.array_bytes(*a) for a in arrays + hlo_stats._arrays(instr.result_type))
    return flops, nbytes
  return None


def kernel_seconds(instr, shapes: dict, chip: Accelerator,
                   efficiency: float = KERNEL_EFFICIENCY) -> float | None:
  """A custom call's FLOPs and bytes (`kernel_work`) at `efficiency` of peak (module
  docstring), or None when its work is unknown."""
  if (work := kernel_work(instr, shapes)) is None:
    return None
  flops, nbytes = work
  return max(flops / chip.peak_flops, nbytes / chip.hbm_bytes_per_s) / efficiency


def hbm_seconds(instr, shapes: dict, chip: Accelerator, scatter: bool = False) -> float:
  """An unpriced instruction's bytes at HBM peak: its result, plus each operand up to the
  result's size (a gather reads only the rows it returns). A `scatter` (a fusion around one)
  updates its first operand in place: every other operand (the updates, the indices) is read
  whole, and the rows the updates touch are read and written, at least once each (up to the
  result's size). A `dynamic-update-slice` also updates its buffer in place (XLA copies the
  buffer first, as its own instruction, where it cannot): it reads the update and writes it."""
  result = sum(hlo_stats.array_bytes(*a) for a in hlo_stats._arrays(instr.result_type))
  operands = hlo_stats._arrays(instr.operand_text) or sum(
      (shapes.get(n, ()) for n in instr.operands), ())
  if instr.op == "dynamic-update-slice" and len(operands) >= 2:
    return 2 * hlo_stats.array_bytes(*operands[1]) / chip.hbm_bytes_per_s
  if scatter and operands:
    read = sum(hlo_stats.array_bytes(*a) for a in operands[1:])
    return (read + 2 * min(read, result)) / chip.hbm_bytes_per_s
  moved = result + sum(min(hlo_stats.array_bytes(*a), result) for a in operands)
  return moved / chip.hbm_bytes_per_s


def collective_seconds(op: str, results: tuple, operands: tuple, attributes: str,
                       coords: np.ndarray, torus: torus_lib.Torus) -> float:
  """One execution of a collective on the torus (`torus.collective_seconds`): `results` /
  `operands` its `(dtype, shape)` arrays (an async start's without the repeated inputs),
  `attributes` the text holding its replica groups."""
  operands = hlo_stats._data_operands(op, operands)
  groups = hlo_stats.replica_groups(attributes, len(coords))
  if groups is None:
    raise ValueError(f"collective {op}: no replica groups in {attributes[:200]!r}")
  if op != "collective-permute" and max(len(g) for g in groups) == 1:
    return 0.0
  if op == "collective-permute" and all(len(set(g)) == 1 for g in groups):
    return 0.0
  size = max(sum(hlo_stats.array_bytes(*a) for a in arrays) for arrays in (results, operands))
  sent = sum(hlo_stats.array_bytes(*a) for a in operands) if op == "ragged-all-to-all" else size
  link = hlo_stats._link_bytes(op, sent, max(len(g) for g in groups))
  return torus_lib.collective_seconds(op, link, sent, groups, coords, torus)


def _collective_arrays(instr, shapes: dict) -> tuple[tuple, tuple]:
  results = hlo_stats._arrays(instr.result_type)
  operands = hlo_stats._arrays(instr.operand_text) or sum(
      (shapes.get(n, ()) for n in instr.operands), ())
  if instr.op.endswith("-start") and len(results) > len(operands):
    results = results[len(operands):]
  return results, operands


def fused_collectives(module) -> dict[str, tuple]:
  """`{fused computation: (op, inner collective)}` for the TPU compiler's collective fusions.
  An "all-reduce-scatter" fusion (an all-reduce whose only use is the device's dynamic-slice
  of it, the root) is a reduce-scatter of the all-reduce's operand. An async collective
  fusion's continuations and done (`hlo_stats.collective_echoes`) are not: their collective is
  the start's, and a continuation is priced as the compute it fuses."""
  found = {}
  echoes = hlo_stats.collective_echoes(module)
  for name, instrs in module.computations.items():
    inner = [i for i in instrs if i.op in COLLECTIVES]
    if len(inner) != 1 or name in echoes:
      continue
    root = module.root(name)
    scatter = inner[0].op == "all-reduce" and root.op == "dynamic-slice" and \
        root.operands[:1] == [inner[0].name]
    found[name] = ("reduce-scatter" if scatter else inner[0].op, inner[0])
  return found


def price(instr, shapes: dict, chip: Accelerator, coords, torus, fused: dict | None = None,
          contents: frozenset = frozenset()) -> tuple[str, float] | None:
  """`(kind, seconds per execution)` of one instruction, or None when it is not priced;
  `fused`: `fused_collectives` of its module (a collective fusion is priced as its
  collective); `contents`: the opcodes of a fusion's computations, nested ones included."""
  base = instr.op.removesuffix("-start")
  if hlo_stats.async_collective_role(instr) == "done":  # waits for its start, moves nothing
    return None
  if base in COLLECTIVES and not instr.op.endswith("-done"):
    if coords is None:
      return None
    results, operands = _collective_arrays(instr, shapes)
    return "torus", collective_seconds(base, results, operands, instr.attributes, coords, torus)
  if instr.op == "fusion" and fused and (called := _CALLS.search(instr.attributes)) and \
      called[1] in fused:
    if coords is None:
      return None
    op, inner = fused[called[1]]
    operands = _collective_arrays(inner, shapes)[1]
    results = operands if op == "reduce-scatter" else _collective_arrays(inner, shapes)[0]
    return "torus", collective_seconds(op, results, operands, inner.attributes, coords, torus)
  moved = host_transfer_bytes(instr, shapes)
  if moved is not None:
    if chip.host_bytes_s is None:
      return None  # listed as not priced
    return HOST_LINK, moved / chip.host_bytes_s
  seconds = compiler_seconds(instr, chip)
  if seconds is not None:
    return "compiler estimate", seconds
  if instr.op == "custom-call":
    seconds = kernel_seconds(instr, shapes, chip)
    if seconds is not None:
      return f"kernel at {KERNEL_EFFICIENCY:.0%}", seconds
  if instr.op in FREE or instr.op.endswith("-done") or allocates_only(instr):
    return None
  return "HBM at peak", hbm_seconds(instr, shapes, chip,
                                    scatter="scatter" in contents | {instr.op})


def _nested_ops(module, computation: str, cache: dict) -> frozenset:
  """The opcodes of `computation` and of every computation it calls (a fusion's nested
  fusions: the TPU compiler wraps a scatter in a fusion inside its `scatter_custom_fusion`)."""
  if computation not in cache:
    cache[computation] = frozenset()  # a cycle (none in HLO) would stop here
    instrs = module.computations.get(computation, ())
    cache[computation] = frozenset(i.op for i in instrs).union(
        *(_nested_ops(module, c, cache) for i in instrs for c in i.callees()))
  return cache[computation]


def price_module(module, chip: Accelerator, coords=None, torus=None) -> list[OpCost]:
  """Every priced instruction of `module` (an `hlo_loops.Module`) that runs per step; its
  collectives only when `coords` (`[devices, dims]`) and `torus` are given."""
  runs = module.executions()
  fused = fused_computations(module)
  shapes = {i.name: hlo_stats._arrays(i.result_type) for instrs in module.computations.values()
            for i in instrs}
  coords = None if coords is None else np.asarray(coords)
  collective_fusions = fused_collectives(module)
  nested_ops = {}
  found = []
  for computation, instrs in module.computations.items():
    if computation in fused or not runs.get(computation):
      continue
    for instr in instrs:
      inside = frozenset().union(*(_nested_ops(module, c, nested_ops) for c in _CALLS.findall(
          instr.attributes))) if instr.op == "fusion" else frozenset()
      priced = price(instr, shapes, chip, coords, torus, collective_fusions, inside)
      if priced is None:
        continue
      source = instr.metadata("op_name")
      op, groups_from = instr.op, instr.name if priced[0] == "torus" else ""
      if priced[0] == "torus" and instr.op == "fusion":  # a collective fusion: its collective
        op, inner = collective_fusions[_CALLS.search(instr.attributes)[1]]
        groups_from = inner.name
      found.append(OpCost(instr.name, computation, op, category(source, instr.op, inside),
                          priced[0], priced[1], runs[computation], source, groups_from))
  return found


def by_category(costs: list[OpCost], kinds: tuple[str, ...] | None = None) -> dict[str, float]:
  """`{category: seconds per step}` (seconds x runs), largest first; `kinds`: only those."""
  totals = {}
  for c in costs:
    if kinds is None or c.kind in kinds or (c.kind.startswith("kernel") and "kernel" in kinds):
      totals[c.category] = totals.get(c.category, 0.0) + c.seconds * c.runs
  return dict(sorted(totals.items(), key=lambda kv: -kv[1]))
