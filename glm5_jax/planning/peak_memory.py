"""What is live at a compiled program's memory peak, by the model part that made each buffer.

`compiled.memory_analysis()` gives one temp total; when a change moves it, this says which
buffers did it. XLA writes the schedule's live ranges when asked to dump a module
(`XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"`): `*after_optimizations-live-range.txt`
lists the buffers live at the peak instruction ("Live ranges at N (peak):", one line per buffer,
`name{shape index}: bytes`), and `*after_optimizations.txt` is the module whose instructions
carry the `op_name` each buffer came from. No library reads these files back, so this does.

  report = peak_report(live_range_text, module_text)
  report.by_category      # {"DSA sparse": bytes, ...}  (op_costs.category's parts)
  report.by_source        # [(bytes, buffers, shape, op_name), ...] largest first

The peak is XLA's `HloLiveRange` of the scheduled module, logical buffer sizes: it can differ
from the TPU compiler's own heap total (memory-space assignment, padding, fragmentation), which
the report prints beside it.
"""

import collections
import glob
import os
import re
from typing import NamedTuple

from glm5_jax.planning import hlo_loops, op_costs

_PEAK_HEADER = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_ARRAY = re.compile(r"[a-z]+[0-9]*\[[0-9,]*\](?:\{[^}]*\})?")
_SPACE = re.compile(r":[^}]*\bS\((\d+)\)")
_LIVE = re.compile(r"^\s+(?P<name>\S+?)\{(?P<index>[0-9,]*)\}: (?P<bytes>\d+) bytes")


class PeakReport(NamedTuple):
  """The HBM buffers live at the peak: `total` bytes (`arguments` of them the program's
  inputs); `by_category` and `by_source` split it. `on_chip`: bytes in other memory spaces
  (the TPU's VMEM / SMEM, `S(n)` layouts) live at the same point, not in `total`; `host`: bytes
  in host memory (`S(5)`: a remat policy's offloaded residuals), not in `total` either."""

  position: int  # the peak instruction's index in the flattened schedule
  total: int
  arguments: int
  on_chip: int
  by_category: dict  # category -> bytes, largest first
  by_source: list  # (bytes, buffers, shape, op_name), largest first
  host: int = 0


def live_at_peak(live_range_text: str) -> tuple[int, list[tuple[str, str, int]]]:
  """`(position, [(instruction, shape index, bytes), ...])` from a live-range dump."""
  lines = live_range_text.splitlines()
  for at, line in enumerate(lines):
    header = _PEAK_HEADER.match(line)
    if header:
      break
  else:
    raise ValueError("no 'Live ranges at N (peak):' section in the live-range dump (was it "
                     "written by XLA's --xla_dump_to with --xla_dump_hlo_as_text?)")
  live = []
  for line in lines[at + 1:]:
    entry = _LIVE.match(line)
    if not entry:
      break
    live.append((entry["name"], entry["index"], int(entry["bytes"])))
  return int(header[1]), live


def _type_at(result_type: str, index: str) -> str:
  """The array type, layout included, at tuple `index` ("" = the whole result)."""
  if not index:
    return result_type
  arrays = _ARRAY.findall(result_type)
  position = int(index.split(",")[0])
  return arrays[position] if position < len(arrays) else result_type


def memory_space(array_type: str) -> int:
  """The memory space of an array type's layout (`{1,0:T(8,128)S(1)}` -> 1); 0 is HBM."""
  space = _SPACE.search(array_type)
  return int(space[1]) if space else 0


def peak_report(live_range_text: str, module_text: str) -> PeakReport:
  """The peak's buffers grouped by op_name (and result shape) and by model part."""
  position, live = live_at_peak(live_range_text)
  module = hlo_loops.parse_module(module_text)
  instructions = {i.name: i for instrs in module.computations.values() for i in instrs}
  sources = collections.defaultdict(lambda: [0, 0])
  categories = collections.Counter()
  on_chip = host = 0
  for name, index, size in live:
    instr = instructions.get(name)
    if instr is None:
      op_name, shape, part = f"<{name}: not in the module>", "", "unattributed"
    else:
      shape = _type_at(instr.result_type, index)
      if not shape.startswith("(") and memory_space(shape) == op_costs.HOST_MEMORY_SPACE:
        host += size
        continue
      if index and memory_space(shape):  # a whole tuple's index table is in HBM
        on_chip += size
        continue
      if instr.op == "parameter" and instr.computation == module.entry:
        op_name, part = "<arguments>", "arguments"
      elif instr.op == "while":
        # a loop's state: a scan's carry and the per-layer stacks it writes
        op_name, part = instr.metadata("op_name") or "<while>", "loop state (while)"
      else:
        op_name = instr.metadata("op_name") or f"<{instr.op}, no op_name>"
        part = op_costs.category(op_name, instr.op)
    shape = re.sub(r"\{[^}]*\}", "", shape)  # layouts and tiling out: the logical type
    sources[(shape, op_name)][0] += size
    sources[(shape, op_name)][1] += 1
    categories[part] += size
  by_source = sorted(((b, n, shape, op) for (shape, op), (b, n) in sources.items()),
                     reverse=True)
  return PeakReport(position, sum(categories.values()), categories["arguments"], on_chip,
                    dict(categories.most_common()), by_source, host)


def find_dump(directory: str, module_pattern: str = "train_step") -> tuple[str, str]:
  """`(live-range file, module file)` of the last-written dumped module whose name contains
  `module_pattern`; a FileNotFoundError names the directory and what was looked for."""
  ranges = sorted(glob.glob(os.path.join(directory, f"*{module_pattern}*"
                                                    "after_optimizations-live-range.txt")),
                  key=os.path.getmtime)
  if not ranges:
    raise FileNotFoundError(f"{directory}: no *{module_pattern}*after_optimizations-live-range.txt"
                            " (XLA writes it with --xla_dump_to and --xla_dump_hlo_as_text)")
  module = ranges[-1].replace("-live-range.txt", ".txt")
  if not os.path.exists(module):
    raise FileNotFoundError(f"{module}: the optimized module beside {ranges[-1]} is missing")
  return ranges[-1], module


def format_report(report: PeakReport, top: int = 15, compiler_temp: int | None = None) -> str:
  """Lines for people: the peak by model part, then the `top` largest sources."""
  unit, name = (2.0 ** 30, "GiB") if report.total >= 2 ** 30 else (2.0 ** 20, "MiB")
  lines = [f"HBM live at the schedule's peak (instruction {report.position}; XLA's "
           f"HloLiveRange, logical sizes): {report.total / unit:.2f} {name}, "
           f"{(report.total - report.arguments) / unit:.2f} {name} besides the arguments"
           + (f" (the compiler's temp: {compiler_temp / unit:.2f} {name})"
              if compiler_temp is not None else "")
           + (f"; on-chip memories {report.on_chip / unit:.2f} {name} more"
              if report.on_chip else "")
           + (f"; host memory {report.host / unit:.2f} {name} more" if report.host else "")]
  for part, size in report.by_category.items():
    lines.append(f"  {part:<28s} {size / unit:9.2f} {name}")
  lines.append("  largest sources (bytes, buffers x logical type, op_name):")
  for size, count, shape, op_name in report.by_source[:top]:
    short = op_name if len(op_name) <= 100 else "..." + op_name[-97:]
    lines.append(f"  {size / unit:9.2f} {name} {count:4d} x {shape:<28s} {short}")
  return "\n".join(lines)
