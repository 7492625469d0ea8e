"""The collectives of an optimized HLO module (`jax.jit(f).lower(...).compile().as_text()`).

  for c in collectives(compiled.as_text()):
    print(c.op, c.dtype, c.shape, c.bytes)

A pure text parse: XLA has no Python API for the optimized module's instructions, and the text
form is stable across backends. `collectives` counts each instruction once, as written: a
collective inside a `while` body (a scanned layer) runs once per iteration. `step_collectives`
and `step_dot_flops` count per execution of the module (a train step): every instruction times
the trip counts of its enclosing loops (`glm5_jax.planning.hlo_loops`), with each collective's mesh
axes read back from its replica groups.
"""

import collections
import re
from typing import NamedTuple

import numpy as np

from glm5_jax.planning import hlo_loops

OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
       "collective-permute", "collective-broadcast")

# `%ag = f32[8,64]{1,0} all-gather(%p), ...`: the optimized text names operands without their
# shapes, so every instruction's result is recorded to resolve them. Async pairs print as
# `all-gather-start` / `-done` (counted at the start). Results may be tuples `(f32[..], ..)`.
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<result>\(.*?\)|\S+)\s+"
                   r"(?P<op>[a-z][a-z0-9-]*)\((?P<operands>[^)]*)\)", re.M)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_OPERAND = re.compile(r"%([^\s,)]+)")
# replica_groups={{0,1},{2,3}} | replica_groups=[4,2]<=[8] | replica_groups=mesh['a'=4,'b'=2] {'b'}
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[[0-9]+,([0-9]+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
# ... or with a device order: mesh['a'=2,'b'=4], device_ids=([2,2,2]T(1,0,2)) {'a'}
_GROUPS_MESH_IDS = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
                              r"(?:,\s*device_ids=\((?P<ids>[^)]*(?:\([0-9,]*\))?)\))?"
                              r"\s*\{(?P<grouped>[^}]*)\}")


# The TPU compiler's asynchronous collective fusions (libtpu's `--xla_tpu_enable_async_collective_
# fusion`): a fusion named `async-collective-start` starts the collective, fusions of compute
# calling `async_collective_fusion.N` carry it on beside their own work, and a fusion named
# `async-collective-done` ends it. Each of them holds a copy of the same collective (one
# `chain_id` in its frontend attributes), so only the start's copy is counted and priced. The
# channel_id alone does not tell the copies apart: the compiler numbers every all-reduce
# channel 1, a synchronous one (a reduce-scatter fusion) too.
ASYNC_COLLECTIVE = re.compile(r"^async-collective-(start|done)\b")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_CHAIN = re.compile(r'\bchain_id="?(\w+)')


def async_collective_role(instr) -> str | None:
  """"start" or "done" for the TPU compiler's async collective fusions (by their name, the
  only mark the optimized text carries), else None."""
  match = ASYNC_COLLECTIVE.match(instr.name) if instr.op == "fusion" else None
  return match[1] if match else None


def _copy_key(instr) -> str | None:
  """What the copies of one async collective share: its chain_id, else its channel_id."""
  if match := _CHAIN.search(instr.attributes):
    return f"chain {match[1]}"
  if match := _CHANNEL.search(instr.attributes):
    return f"channel {match[1]}"
  return None


def fused_copy_key(module, instr) -> str | None:
  """`_copy_key` of the collective inside the computation a fusion calls, or None."""
  for callee in instr.callees():
    for inner in module.computations.get(callee, ()):
      if inner.op in OPS and (key := _copy_key(inner)):
        return key
  return None


def collective_echoes(module) -> set[str]:
  """The computations whose collective repeats one an `async-collective-start` fusion started
  (those its continuation fusions and its done call): the same `_copy_key`, another fusion."""
  channel = {}  # computation -> the copy key of its first collective
  for name, instrs in module.computations.items():
    for inner in instrs:
      if inner.op in OPS and (key := _copy_key(inner)):
        channel[name] = key
        break
  fusions = [i for instrs in module.computations.values() for i in instrs if i.op == "fusion"]
  started = {channel.get(c) for i in fusions if async_collective_role(i) == "start"
             for c in i.callees()} - {None}
  return {c for i in fusions if async_collective_role(i) != "start" for c in i.callees()
          if channel.get(c) in started}


class Collective(NamedTuple):
  """One collective: `shape`/`dtype` of its largest array (the gathered result of an
  all-gather, the full operand of a reduce-scatter); `bytes` per device, the larger of its
  operands' and results' total (a combined all-to-all has one array per peer); `group` the
  devices per replica group; every `operands` / `results` array as `(dtype, shape)`."""
  op: str
  shape: tuple[int, ...]
  dtype: str
  bytes: int
  group: int
  operands: tuple[tuple[str, tuple[int, ...]], ...]
  results: tuple[tuple[str, tuple[int, ...]], ...]


def _arrays(text):
  return tuple((dtype, tuple(int(s) for s in dims.split(",") if s))
               for dtype, dims in _ARRAY.findall(text) if dtype != "token")


def array_bytes(dtype: str, shape) -> int:
  """Bytes of an HLO array: `f32` 4, `bf16` 2, `pred` 1, `f8e4m3fn` 1 (the first number is
  the bit width), rounded up for sub-byte types."""
  bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
  return -(-bits * int(np.prod(shape, dtype=np.int64)) // 8)


def _group_size(line: str) -> int:
  """Devices per replica group; 0 when the line does not say (`replica_groups={}`: all
  devices; collective-permute: pairs)."""
  if match := _GROUPS_LIST.search(line):
    return len(match[1].split(","))
  if match := _GROUPS_IOTA.search(line):
    return int(match[1])
  if match := _GROUPS_MESH.search(line):
    sizes = dict(re.findall(r"'([^']+)'=([0-9]+)", match[1]))
    return int(np.prod([int(sizes[a]) for a in re.findall(r"'([^']+)'", match[2])]))
  return 0


def _data_operands(op: str, operands: tuple) -> tuple:
  """The operands a collective moves. A `ragged-all-to-all`'s are `(input, output,
  input_offsets, send_sizes, output_offsets, recv_sizes)`: `output` is the receive buffer
  the result is written into (the result is that buffer again), so only `input` is data sent;
  counting the receive buffer as an operand as well doubled the instruction's bytes."""
  return operands[:1] if op == "ragged-all-to-all" else operands


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective instruction of `hlo_text` that moves data, in order (groups of one
  device, which XLA leaves for psums over size-1 mesh axes, are skipped)."""
  shapes, found = {}, []
  for match in _LINE.finditer(hlo_text):
    results = _arrays(match["result"])
    shapes[match["name"]] = results
    op = match["op"].removesuffix("-start")
    if op not in OPS:
      continue
    operands = sum((shapes.get(name, ()) for name in _OPERAND.findall(match["operands"])), ())
    if match["op"].endswith("-start") and len(results) > len(operands):
      results = results[len(operands):]  # an async start's result tuple repeats its inputs
    operands = _data_operands(op, operands)
    line_end = hlo_text.find("\n", match.end())
    group = _group_size(hlo_text[match.start():line_end if line_end >= 0 else None])
    if group == 1:
      continue
    dtype, shape = max(results + operands, key=lambda a: array_bytes(*a))
    size = max(sum(array_bytes(*a) for a in arrays) for arrays in (results, operands))
    found.append(Collective(op, shape, dtype, size, group, operands, results))
  return found


def summarize(found: list[Collective]) -> dict[str, tuple[int, int]]:
  """op -> (count, total bytes)."""
  totals = collections.defaultdict(lambda: [0, 0])
  for c in found:
    totals[c.op][0] += 1
    totals[c.op][1] += c.bytes
  return {op: tuple(v) for op, v in sorted(totals.items())}


# ---------------------------------------------------------------------------- per step

class StepCollective(NamedTuple):
  """A collective instruction and what it moves per step, per device.

  `bytes`: its largest side per execution (`Collective.bytes`); `runs`: executions per step
  (the product of its enclosing loops' trip counts); `link_bytes`: what one device sends per
  execution under the bandwidth-optimal (ring) algorithm over a group of n devices: an
  all-gather or all-to-all (n-1)/n of its full buffer, a reduce-scatter (n-1)/n of its full
  operand, an all-reduce twice that (a reduce-scatter then an all-gather), a
  collective-permute its whole array. `axes`: the mesh axes its groups span ("+"-joined, in
  mesh order), "" when a group is one device; `source`: its `op_name` metadata."""
  op: str
  name: str
  bytes: int
  link_bytes: float
  runs: int
  group: int
  axes: str
  source: str


def replica_groups(attributes: str, num_devices: int) -> list[list[int]] | None:
  """The device groups of a collective's attributes (`replica_groups=` in its explicit, iota
  or mesh form, or a collective-permute's `source_target_pairs=`), or None when its text has
  neither. `replica_groups={}` is every device in one group."""
  if match := re.search(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}", attributes):
    return [[int(x) for x in g.split(",")] for g in re.findall(r"\{([0-9,]+)\}", match[1])]
  if match := re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attributes):
    groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}",
                                                                       match[1])]
    return groups or [list(range(num_devices))]
  if match := re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?",
                        attributes):
    shape = [int(x) for x in match[1].split(",")]
    ids = np.arange(int(np.prod([int(x) for x in match[2].split(",")])))
    ids = ids.reshape([int(x) for x in match[2].split(",")])
    if match[3]:
      ids = ids.transpose([int(x) for x in match[3].split(",")])
    return ids.reshape(shape).reshape(-1, shape[-1]).tolist()
  if match := _GROUPS_MESH_IDS.search(attributes):
    sizes = [(a, int(s)) for a, s in re.findall(r"'([^']+)'=([0-9]+)", match["axes"])]
    grouped = re.findall(r"'([^']+)'", match["grouped"])
    names = [a for a, _ in sizes]
    ids = _device_ids(match["ids"], int(np.prod([s for _, s in sizes])))
    ids = ids.reshape([s for _, s in sizes])
    rest = [names.index(a) for a in names if a not in grouped]
    ids = ids.transpose(rest + [names.index(a) for a in grouped])
    return ids.reshape(-1, int(np.prod([dict(sizes)[a] for a in grouped]))).tolist()
  return None


def _device_ids(text: str | None, count: int) -> np.ndarray:
  """The flat device order of a mesh-form replica group: iota when absent, `[dims]T(perm)` an
  iota reshaped to dims and transposed, or an explicit list."""
  if not text:
    return np.arange(count)
  if match := re.fullmatch(r"\[([0-9,]+)\](?:<=\[([0-9,]+)\])?(?:T\(([0-9,]+)\))?", text):
    source = [int(x) for x in (match[2] or match[1]).split(",")]
    ids = np.arange(int(np.prod(source))).reshape(source)
    if match[3]:
      ids = ids.transpose([int(x) for x in match[3].split(",")])
    return ids.reshape(-1)
  return np.asarray([int(x) for x in text.split(",")])


def mesh_axes_of(groups: list[list[int]], mesh_shape: dict[str, int]) -> str:
  """The mesh axes along which the devices of any group differ, "+"-joined in mesh order.
  Device ids are positions in the mesh's flattened device array (jax's device assignment for
  a `NamedSharding`)."""
  shape = tuple(mesh_shape.values())
  total = int(np.prod(shape))
  varying = np.zeros(len(shape), bool)
  for group in groups:
    if max(group) >= total:
      raise ValueError(f"replica group {group} names a device beyond the mesh's {total}")
    coords = np.stack(np.unravel_index(np.asarray(group), shape))
    varying |= (coords != coords[:, :1]).any(axis=1)
  return "+".join(a for a, v in zip(mesh_shape, varying) if v)


def _link_bytes(op: str, size: int, group: int) -> float:
  if op in ("collective-permute", "collective-broadcast"):
    return float(size)
  fraction = (group - 1) / group if group else 1.0
  return size * fraction * (2 if op == "all-reduce" else 1)


def step_collectives(hlo_text: str, mesh_shape: dict[str, int],
                     module=None) -> list[StepCollective]:
  """Every data-moving collective of an optimized module with its executions per step and
  mesh axes (`mesh_shape`: `{axis: size}` in mesh order, the program's mesh)."""
  module = module or hlo_loops.parse_module(hlo_text)
  runs = module.executions()
  shapes = {i.name: _arrays(i.result_type) for instrs in module.computations.values()
            for i in instrs}
  num_devices = int(np.prod(list(mesh_shape.values())))
  echoes = collective_echoes(module)  # copies of an async collective fusion's collective
  found = []
  for computation, instrs in module.computations.items():
    for instr in instrs:
      op = instr.op.removesuffix("-start")
      if op not in OPS or computation not in runs or computation in echoes:
        continue
      results = _arrays(instr.result_type)
      operands = _arrays(instr.operand_text) or sum(
          (shapes.get(name, ()) for name in instr.operands), ())
      if instr.op.endswith("-start") and len(results) > len(operands):
        results = results[len(operands):]
      operands = _data_operands(op, operands)
      groups = replica_groups(instr.attributes, num_devices)
      if groups is None:
        raise ValueError(f"collective {instr.name}: no replica groups in {instr.attributes[:200]!r}")
      group = max(len(g) for g in groups) if op not in ("collective-permute",) else 2
      axes = mesh_axes_of(groups, mesh_shape)
      if group == 1 or (op == "collective-permute" and not axes):
        continue
      size = max(sum(array_bytes(*a) for a in arrays) for arrays in (results, operands))
      # A ragged all-to-all sends at most its input rows (its receive buffer may be larger).
      sent = sum(array_bytes(*a) for a in operands) if op == "ragged-all-to-all" else size
      found.append(StepCollective(op, instr.name, size, _link_bytes(op, sent, group),
                                  runs[computation], group, axes, instr.metadata("op_name")))
  return found


def summarize_step(found: list[StepCollective], key: str = "op") -> dict[str, dict]:
  """`{value of key: {"count", "bytes", "link_bytes"}}` per step (bytes times runs), largest
  bytes first; `key` is a `StepCollective` field ("op", "axes", "source")."""
  totals = collections.defaultdict(lambda: {"count": 0, "bytes": 0, "link_bytes": 0.0})
  for c in found:
    entry = totals[getattr(c, key)]
    entry["count"] += c.runs
    entry["bytes"] += c.bytes * c.runs
    entry["link_bytes"] += c.link_bytes * c.runs
  return dict(sorted(totals.items(), key=lambda kv: -kv[1]["bytes"]))


_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=([^_]*)_([^-]*)->(\S+?)[,\s]")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
# A Mosaic (Pallas TPU) custom call carries the kernel's `pl.CostEstimate` in its backend config.
_KERNEL_FLOPS = re.compile(r'cost_estimate\\?"\s*:\s*\{\\?"flops\\?"\s*:\s*\\?"?(\d+)')


def _convolution_flops(instr, lhs, kernel, result) -> float:
  """2 x output batch x output features x input features x the (output, window) position pairs
  that land on a real input element (padding and lhs dilation holes skipped), as XLA's
  HloCostAnalysis counts them: the TPU compiler writes some matmuls, e.g. `ragged_dot`'s weight
  gradient, as dilated convolutions over a window."""
  labels = _DIM_LABELS.search(instr.attributes + " ")
  lhs_l, kernel_l, out_l = labels[1], labels[2], labels[3]
  fields = {}
  if window := _WINDOW.search(instr.attributes):
    for item in window[1].split():
      key, _, value = item.partition("=")
      fields[key] = value.split("x")
  spatial = [c for c in kernel_l if c not in "io"]
  pairs = 1
  for n, dim in enumerate(spatial):
    get = lambda key, default, n=n: (int(fields[key][n]) if key in fields else default)
    pad = fields["pad"][n].split("_") if "pad" in fields else ("0", "0")
    size, stride = get("size", kernel[kernel_l.index(dim)]), get("stride", 1)
    lhs_dilate, rhs_dilate = get("lhs_dilate", 1), get("rhs_dilate", 1)
    inputs = lhs[lhs_l.index(dim)]
    outputs = result[out_l.index(dim)]
    pos = (np.arange(outputs)[:, None] * stride + np.arange(size)[None] * rhs_dilate
           - int(pad[0]))
    pairs *= int(((pos >= 0) & (pos <= (inputs - 1) * lhs_dilate) & (pos % lhs_dilate == 0)).sum())
  batch, features = result[out_l.index("b")], result[out_l.index("f")]
  return 2.0 * batch * features * kernel[kernel_l.index("i")] * pairs


def _ragged_dot_flops(instr, shapes) -> float | None:
  """FLOPs of the TPU compiler's `ragged-dot` custom call (`jax.lax.ragged_dot` and its
  transposes): 2 x rows x K x N, every row multiplied by one group's `[K, N]` matrix. Forward
  and input gradient: a 2-D result `[M, .]` and a 3-D `[G, K, N]` operand; weight gradient: a
  3-D result `[G, K, N]` and 2-D `[M, K]` / `[M, N]` operands."""
  arrays = _arrays(instr.operand_text) or sum((shapes.get(n, ()) for n in instr.operands), ())
  floats = [shape for dtype, shape in arrays if dtype.startswith(("bf", "f"))]
  result = _arrays(instr.result_type)[0][1]
  if len(result) == 2:
    groups = [s for s in floats if len(s) == 3]
    return 2.0 * result[0] * groups[0][1] * groups[0][2] if groups else None
  if len(result) == 3:
    _, k, n = result
    for shape in (s for s in floats if len(s) == 2):
      if shape[1] in (k, n) or shape[0] in (k, n):
        rows = shape[0] if shape[1] in (k, n) else shape[1]
        return 2.0 * rows * k * n
  return None


def step_dot_flops(hlo_text: str, module=None) -> dict[str, float]:
  """Matmul FLOPs per step of an optimized module: every `dot` (2 x result elements x
  contracted size) and `convolution` (2 x result elements x kernel elements per output
  feature) and TPU `ragged-dot` custom call (`_ragged_dot_flops`) and Pallas TPU kernel with a
  cost estimate (its `flops`, e.g. megablox's `gmm` / `tgmm`: 2 x rows x K x N) times its
  executions per step. Elementwise work is not counted (MFU counts matmuls), nor what other
  custom calls compute: `custom_calls` says how many ran."""
  module = module or hlo_loops.parse_module(hlo_text)
  runs = module.executions()
  shapes = {i.name: _arrays(i.result_type) for instrs in module.computations.values()
            for i in instrs}
  flops, custom_calls = 0.0, 0
  for computation, instrs in module.computations.items():
    times = runs.get(computation, 0)
    for instr in instrs:
      if not times or instr.op not in ("dot", "convolution", "custom-call"):
        continue
      if instr.op == "custom-call":
        ragged = _ragged_dot_flops(instr, shapes) if instr.name.startswith("ragged-dot") else None
        if ragged is None and (estimate := _KERNEL_FLOPS.search(instr.attributes)):
          ragged = float(estimate[1])  # a Pallas kernel's own `pl.CostEstimate` (megablox)
        if ragged is None:
          if "metadata" not in instr.name:
            custom_calls += times
          continue
        flops += ragged * times
        continue
      inline = _arrays(instr.operand_text)
      operands = inline if len(inline) >= 2 else [shapes[n][0] for n in instr.operands[:2]]
      result = _arrays(instr.result_type)[0][1]
      if instr.op == "dot":
        dims = _CONTRACTING.search(instr.attributes)
        lhs = operands[0][1]
        contracted = int(np.prod([lhs[int(d)] for d in dims[1].split(",") if d])) if dims else 1
      else:
        flops += _convolution_flops(instr, operands[0][1], operands[1][1], result) * times
        continue
      flops += 2.0 * float(np.prod(result, dtype=np.float64)) * contracted * times
  return {"flops": flops, "custom_calls": custom_calls, "unknown_loops": len(module.unknown_loops)}
