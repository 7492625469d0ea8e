"""The collectives of an optimized HLO module (`jax.jit(f).lower(...).compile().as_text()`).

  for c in collectives(compiled.as_text()):
    print(c.op, c.dtype, c.shape, c.bytes)

A pure text parse: XLA has no Python API for the optimized module's instructions, and the text
form is stable across backends. Each instruction is counted once, as written: a collective
inside a `while` body (a scanned layer) runs once per iteration.
"""

import collections
import re
from typing import NamedTuple

import numpy as np

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
