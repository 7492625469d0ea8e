"""The matmul-FLOP ledger of a train step's HLO: every dot, per category and phase, per step.

  text = lowered.compiler_ir("hlo").get_hlo_module().to_string()   # or compiled.as_text()
  rows, custom_calls, unknown_loops = ledger(text, platform="cuda")
  print(format_table(rows, model_flops))

Works on the program jax lowers for a platform (`jit(f).trace(...).lower(lowering_platforms=
("cuda",))`, from a CPU host: no device needed). A compiled module parses too, but a GPU
compiler writes most GEMMs as cuBLAS custom calls (`__cublas$gemm`, ...), which no rule here
prices yet: they are only counted (`custom_calls`), so run it on a device's HLO once those
rules exist (written against a real one). Why the
lowered module rather than XLA:CPU's compiled one: jax lowers `ragged_dot` per platform (CPU:
a dense masked einsum written by jax; GPU and TPU: an HLO `ragged-dot`), and Pallas kernels
exist only in the GPU lowering (custom calls). What a GPU compiler then does with a
`ragged-dot` is priced here by rule (`RAGGED_DOT_EXPANDS`): XLA GPU's `RaggedDotRewriter`
(openxla/xla `ragged_dot_rewriter.cc`, default flags; a ragged dot is kept only with
`xla_gpu_experimental_use_ragged_dot_fusion` and cuDNN >= 9.22) rewrites it as one dense dot
over all G groups with the rows outside each group masked: G times the useful FLOPs, for the
forward, the input gradient and the weight gradient (which expands both operands). The ledger
reports both: `flops` as the platform runs it, `useful_flops` a grouped matmul's.

Per dot: 2 x result elements x contracted size, times its executions per step (the product of
the trip counts of its enclosing while loops, `hlo_loops`); dead code, which a lowered module
still holds and a compiler removes, is left out (`_live`). Custom calls other than sharding
annotations are priced where a rule knows the kernel (`_custom_call_flops`: the sparse MLA,
indexer and grouped-matmul Pallas kernels by their operand and result shapes; dtype "kernel"),
the others counted by target (`custom_calls`).

Categories and phases come from each dot's `op_name` metadata. In a lowered module a scan
body's names are relative (`layers_1_3.body/layers_1_3/mlp/...`), so each instruction's name
is read after its callers' (`_walk`): a while / call contributes its own `op_name` as a prefix.
Phases: no `jvp(` in the name -> optimizer; `rematted_computation` (jax's name for the forward
a `jax.checkpoint` recomputes in the backward, scanned layers included) -> remat;
`transpose(` -> backward; else forward.
"""

import collections
import dataclasses
import re

import numpy as np

from glm5_jax.planning import hlo_loops

# platform -> whether its compiler expands an HLO `ragged-dot` into a dense masked dot over the
# groups at default flags (see the module docstring; TPU runs a grouped matmul).
# (On CPU jax writes the expansion itself: the program holds plain dots.)
RAGGED_DOT_EXPANDS = {"cuda": True, "rocm": False, "tpu": False}

# (category, substrings of the full op_name, any of which matches), first match wins. What an op
# is comes before where it is ("MTP layer"): XLA deduplicates identical computations of the
# scanned layers and the MTP layer, and the copy it keeps may carry the MTP layer's op_name (the
# 2026-11-30 H200 profile: every layer's indexer-KL scores, 416 kernels a step, named
# `mtp/layer/...`), so only what no op rule names is put down to the MTP layer.
CATEGORIES = (
    ("LM head", ("bld,dy->bly", "bcd,dy->bcy", "bcy,dy->bcd", "bcd,bcy->dy")),
    ("routed experts", ("ragged_dot", "/experts/")),
    ("shared expert", ("shared_expert",)),
    ("indexer KL target", ("kl_target",)),  # named scopes in glm5_jax.attention.mla
    ("indexer", ("indexer",)),
    ("router", ("mxd,mx->md", "mxsd,mx->msd")),
    ("dense FFN", ("/mlp/",)),
    ("attention core", ("sparse_mla", "blgrk,", "bgrls,", "bhls", "blht")),
    ("MTP layer", ("/mtp/",)),
    ("attention projections", ("self_attn",)),
)
PHASES = ("forward", "remat", "backward", "optimizer")
# Names of the routed experts' grouped products: jax's `ragged_dot` and the Triton gmm / tgmm
# kernels (`pallas_kernels.grouped_matmul_triton`, their pallas_call names).
_GROUPED = ("ragged_dot", "grouped_matmul_triton")

_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_BODY = re.compile(r"\bbody=%([^\s,}]+)")
_NOT_COMPUTE = ("Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "xla_python",
                "annotate_device_placement", "MoveToHost", "MoveToDevice")


@dataclasses.dataclass
class Row:
  """One (category, phase, dtype) line: FLOPs per step as the platform runs them, the useful
  share (differs for expanded `ragged-dot`s only), and the dots' executions."""

  category: str
  phase: str
  dtype: str
  flops: float = 0.0
  useful_flops: float = 0.0
  count: int = 0


def _arrays(text: str):
  return [(dtype, tuple(int(s) for s in dims.split(",") if s))
          for dtype, dims in _ARRAY.findall(text) if dtype != "token"]


def _full_name(prefix: str, own: str) -> str:
  """An instruction's op_name read after its caller's: absolute names (`jit(...)/...`) as they
  are, relative ones (inside a scan body or a called function) under the caller's."""
  if not own or own.startswith("jit(") or not prefix:
    return own or prefix
  return f"{prefix}/{own}"


def _live(module, computation: str) -> set:
  """Names of the instructions of `computation` that its root depends on, or that have side
  effects: what XLA keeps. A lowered module still holds dead code (e.g. logits only an unused
  output reads), which its compiler removes first."""
  instrs = {i.name: i for i in module.computations[computation]}
  todo = [module.root(computation).name]
  todo += [i.name for i in instrs.values() if "has_side_effect=true" in i.attributes]
  live = set()
  while todo:
    name = todo.pop()
    if name in live or name not in instrs:
      continue
    live.add(name)
    todo.extend(instrs[name].operands)
  return live


def _walk(module, computation: str, prefix: str, times: int, visit, depth: int = 0):
  """Calls `visit(instr, full_name, times)` for every live instruction (`_live`) reachable
  from `computation`, each with its executions per step (`times` x enclosing trip counts)."""
  if depth > 64:
    raise ValueError(f"HLO call depth > 64 at {computation}")
  live = _live(module, computation)
  for instr in module.computations[computation]:
    if instr.name not in live:
      continue
    name = _full_name(prefix, instr.metadata("op_name"))
    visit(instr, name, times)
    if instr.op.endswith("-done") or instr.op.endswith("-update"):
      continue
    body = _BODY.search(instr.attributes)[1] if instr.op == "while" else None
    for callee in instr.callees():
      if callee not in module.computations:
        continue
      weight = 1
      if instr.op == "while":
        trips = module.trip_count(instr)
        if trips is None:
          module.unknown_loops.append(instr.name)
        weight = (trips or 1) if callee == body else (trips or 0) + 1
      # A fusion's or reducer's body carries absolute names (or none): no prefix needed.
      _walk(module, callee, name, times * weight, visit, depth + 1)


def model_phase(name: str) -> str:
  """remat / backward / forward of an instruction of the model's differentiated program, from
  its full name (module docstring)."""
  if "rematted_computation" in name:
    return "remat"
  return "backward" if "transpose(" in name else "forward"


def phase(name: str) -> str:
  """optimizer / remat / backward / forward from a dot's full name (module docstring)."""
  return "optimizer" if "jvp(" not in name else model_phase(name)


def category(name: str, op: str) -> str:
  """The `CATEGORIES` entry whose substring occurs in `name` (or "other"); the optimizer's
  dots are "optimizer (Muon NS)" whatever their name, and every routed-expert matmul is
  "routed experts", the MTP layer's too."""
  if "jvp(" not in name:
    return "optimizer (Muon NS)"
  if op == "ragged-dot" or any(k in name for k in _GROUPED):  # the MTP layer's experts too
    return "routed experts"
  for label, keys in CATEGORIES:
    if any(k in name for k in keys):
      return label
  return "other"


def _dot_flops(instr, shapes) -> tuple[float, str]:
  """2 x result elements x contracted size, and the lhs dtype."""
  operands = _arrays(instr.operand_text)
  if len(operands) < 2:
    operands = [shapes[n] for n in instr.operands[:2]]
  result = _arrays(instr.result_type)[0][1]
  dims = _CONTRACTING.search(instr.attributes)
  lhs = operands[0][1]
  contracted = int(np.prod([lhs[int(d)] for d in dims[1].split(",") if d])) if dims else 1
  return 2.0 * float(np.prod(result, dtype=np.float64)) * contracted, operands[0][0]


def _ragged_dot_flops(instr, shapes) -> tuple[float, int, str]:
  """(useful FLOPs, groups G, lhs dtype) of an HLO `ragged-dot`: forward / input gradient
  `[M, K] x [G, K, N] -> [M, N]` (2 M K N), weight gradient `[M, K] x [M, N] -> [G, K, N]`
  with M the ragged contracted rows (2 M K N: each row meets one group)."""
  operands = _arrays(instr.operand_text)
  if len(operands) < 3:
    operands = [shapes[n] for n in instr.operands[:3]]
  (lhs_dtype, lhs), groups = operands[0], operands[2][1][0]
  result = _arrays(instr.result_type)[0][1]
  dims = _CONTRACTING.search(instr.attributes)
  contracted = int(np.prod([lhs[int(d)] for d in dims[1].split(",") if d]))
  total = 2.0 * float(np.prod(result, dtype=np.float64)) * contracted
  grouped_result = len(result) == 3 and result[0] == groups  # the weight gradient's [G, K, N]
  return (total / groups if grouped_result else total), groups, lhs_dtype


def _operand_arrays(instr, shapes) -> list:
  """A custom call's operand `(dtype, shape)`s: its layout constraints, else its operands'."""
  constraints = re.search(r"operand_layout_constraints=\{(.*?)\}, [a-z_]+=", instr.attributes)
  if constraints:
    return _arrays(constraints[1])
  return [shapes[n] for n in instr.operands if n in shapes]


def _custom_call_flops(name: str, operands: list, result: tuple = ()) -> float | None:
  """Matmul FLOPs of a known kernel (by its `op_name`) from its operand and result shapes, else
  None.

  sparse MLA (`sparse_mla_triton_*`: top-k `[B, L, T]`, q `[B, L, H, C]` + `[B, L, H, R]`):
  forward 2 B L H T (C + R + C) (scores over C + R, values over C), + 2 B L H T (C + R) for
  the second sweep of `sparse_mla_triton_forward_head_probs` (the KL target); backward
  2 B L H T (3 (C + R) + 2 C) (scores again, dP, dQ, and dKV from P^T dO and dS^T Q), the
  same for `sparse_mla_triton_backward_head_probs` (its KL target adds no matmul).
  Indexer top-k (`lightning_indexer_topk`: q `[B, L Hi, K]`, k `[B, S, K]`): causal scores,
  2 B (L Hi) K (S + 1) / 2.
  Grouped matmul (`grouped_matmul_triton_gmm`: x `[M, K]` the 5th operand, result `[M, N]`;
  `_tgmm`: x `[M, K]`, dy `[M, N]` the 3rd and 4th): 2 M K N, each row meeting one group (the
  useful work; a partial row tile per group boundary adds at most G tm K N, not counted).
  """
  if "grouped_matmul_triton_gmm" in name and len(operands) >= 6 and len(result) == 2:
    m, k = operands[4][1]
    return 2.0 * m * k * result[1]
  if "grouped_matmul_triton_tgmm" in name and len(operands) >= 4:
    (m, k), n = operands[2][1], operands[3][1][1]
    return 2.0 * m * k * n
  if "sparse_mla" in name and len(operands) >= 4:
    b, l, t = operands[1][1]
    h, c = operands[2][1][2:]
    r = operands[3][1][3]
    per = (c + r + c) if "forward" in name else (3 * (c + r) + 2 * c) if "backward" in name \
        else None
    if "forward_head_probs" in name:  # the backward's head sums ride on its own p
      per += c + r
    return None if per is None else 2.0 * b * l * h * t * per
  if "lightning_indexer" in name and len(operands) >= 5:
    b, rows, k = operands[0][1]
    keys = operands[4][1][1]
    return 2.0 * b * rows * k * (keys + 1) / 2
  return None


def ledger(hlo_text: str, platform: str = "cuda"):
  """`(rows, custom_calls, unknown_loops)`: `Row`s keyed `(category, phase, dtype)`, custom
  calls `{target: executions per step}` (sharding annotations left out), and the while loops
  whose trip count could not be read (counted once)."""
  module = hlo_loops.parse_module(hlo_text)
  module.unknown_loops = []
  shapes = {}
  for instrs in module.computations.values():
    for i in instrs:
      arrays = _arrays(i.result_type)
      if arrays:
        shapes[i.name] = arrays[0]
  rows, calls = {}, collections.Counter()
  expands = RAGGED_DOT_EXPANDS.get(platform, False)

  def visit(instr, name, times):
    if not times:
      return
    if instr.op == "custom-call":
      target = re.search(r'custom_call_target="([^"]*)"', instr.attributes)
      target = target[1] if target else "?"
      if any(t in target for t in _NOT_COMPUTE):
        return
      result = _arrays(instr.result_type)
      flops = _custom_call_flops(name, _operand_arrays(instr, shapes),
                                 result[0][1] if len(result) == 1 else ())
      if flops is None:
        calls[target] += times
        return
      useful, dtype = flops, "kernel"
    elif instr.op == "dot":
      flops, dtype = _dot_flops(instr, shapes)
      useful = flops
    elif instr.op == "ragged-dot":
      useful, groups, dtype = _ragged_dot_flops(instr, shapes)
      flops = useful * groups if expands else useful
    else:
      return
    key = (category(name, instr.op), phase(name), dtype)
    row = rows.setdefault(key, Row(*key))
    row.flops += flops * times
    row.useful_flops += useful * times
    row.count += times

  _walk(module, module.entry, "", 1, visit)
  return list(rows.values()), dict(calls), list(dict.fromkeys(module.unknown_loops))


def op_names(hlo_text: str) -> dict:
  """`{instruction name: (full op_name, opcode)}` for every live instruction of a module (a
  scan body's relative names read after their callers', `_walk`): what a profile's `hlo_op`
  (a top-level fusion, custom call or copy of a compiled module) maps to for `category` and
  `phase` (tools/device_suite_profile.py)."""
  module = hlo_loops.parse_module(hlo_text)
  module.unknown_loops = []
  names = {}
  _walk(module, module.entry, "", 1,
        lambda instr, name, times: names.setdefault(instr.name, (name, instr.op)))
  return names


def by_category(rows) -> dict:
  """`{category: {phase: flops, "total", "useful", "dtypes"}}`, largest total first."""
  out = {}
  for r in rows:
    entry = out.setdefault(r.category, {**dict.fromkeys(PHASES, 0.0), "total": 0.0,
                                        "useful": 0.0, "dtypes": set()})
    entry[r.phase] += r.flops
    entry["total"] += r.flops
    entry["useful"] += r.useful_flops
    entry["dtypes"].add(r.dtype)
  return dict(sorted(out.items(), key=lambda kv: -kv[1]["total"]))


def format_table(rows, model_flops: float | None = None) -> str:
  """A markdown table: per category, FLOPs per phase, total, share, useful, dtypes (TFLOP, or
  GFLOP for a step under 1 TFLOP); then the totals and, with `model_flops`, their ratio to it."""
  cats = by_category(rows)
  total = sum(c["total"] for c in cats.values())
  useful = sum(c["useful"] for c in cats.values())
  unit, label = (1e12, "TFLOP") if total >= 1e12 else (1e9, "GFLOP")
  lines = [f"| category ({label} / step) | " + " | ".join(PHASES)
           + " | total | % | useful | dtypes |",
           "|---" * (len(PHASES) + 6) + "|"]
  for name, c in cats.items():
    cells = [f"{c[p] / unit:.3f}" for p in PHASES]
    lines.append(f"| {name} | " + " | ".join(cells) + f" | {c['total'] / unit:.3f} | "
                 f"{100 * c['total'] / max(total, 1):.1f} | {c['useful'] / unit:.3f} | "
                 f"{', '.join(sorted(c['dtypes']))} |")
  phase_totals = [sum(c[p] for c in cats.values()) / unit for p in PHASES]
  lines.append("| **total** | " + " | ".join(f"{x:.3f}" for x in phase_totals)
               + f" | **{total / unit:.3f}** | 100 | {useful / unit:.3f} | |")
  lines.append("")
  if model_flops:
    lines.append(f"model FLOPs {model_flops / unit:.3f}; matmul / model = "
                 f"{total / model_flops:.2f} as run, {useful / model_flops:.2f} useful")
  if (experts := cats.get("routed experts")) and experts["useful"]:
    lines.append(f"routed experts: {experts['total'] / experts['useful']:.1f}x their useful "
                 "FLOPs as run")
  return "\n".join(lines)
