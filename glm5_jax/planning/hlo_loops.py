"""The structure of an optimized HLO module's text: its computations, who calls whom, and how
many times each computation runs per execution of the module (while loops' trip counts).

  module = parse_module(compiled.as_text())
  runs = module.executions()        # {computation name: times it runs per step}

Why a text parse: XLA's Python API gives neither the optimized module's instructions nor a
per-computation cost, and `compiled.cost_analysis()` counts a while loop's body once however
many times the loop runs (checked on XLA:CPU and the TPU compiler, jax 0.10.2), so anything
per step (collective bytes, FLOPs) must multiply each instruction by the trip counts of its
enclosing loops, nested loops multiplying.

Trip counts: XLA:CPU annotates a loop it has analysed with `backend_config={...
"known_trip_count":{"n":"7"}}`; the TPU compiler's text may not, so the loop condition is read
instead: `compare(get-tuple-element(param, index=i), constant(N)), direction=LT` (also wrapped
in a fusion), the initial value of tuple element i in the while's operand, and the step the
body adds to it. A loop whose count cannot be read is reported (`Module.unknown_loops`) and its
body counted once, never guessed.
"""

import dataclasses
import json
import math
import re

_HEADER = re.compile(r"^(ENTRY\s+)?%(?P<name>[^\s(]+)\s*\(")
_ASSIGN = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"\s*(?P<op>[a-z][a-z0-9\-]*)\(")
_CALLEES = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)="
                      r"%([^\s,}]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_OPERAND_NAME = re.compile(r"%([^\s,()]+)")


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at `text[start]` ('(' or '{')."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  i, stack = start, []
  while i < len(text):
    ch = text[i]
    if ch in pairs:
      stack.append(pairs[ch])
    elif stack and ch == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
    elif ch == '"':  # strings (metadata) may hold brackets
      i = text.index('"', i + 1)
    i += 1
  raise ValueError(f"unbalanced HLO text from {text[start:start + 80]!r}")


@dataclasses.dataclass
class Instruction:
  """One HLO instruction: `name = result_type op(operands), attributes`."""

  name: str
  result_type: str
  op: str
  operands: list  # operand instruction names, in order
  operand_text: str
  attributes: str  # the rest of the line after the operand list
  computation: str
  root: bool

  def callees(self) -> list[str]:
    found = [name for _, name in _CALLEES.findall(self.attributes)]
    for group in _BRANCHES.findall(self.attributes):
      found += _OPERAND_NAME.findall(group)
    return found

  def backend_config(self) -> dict:
    at = self.attributes.find("backend_config=")
    if at < 0 or self.attributes[at + 15] != "{":
      return {}
    end = _balanced(self.attributes, at + 15)
    try:
      return json.loads(self.attributes[at + 15:end])
    except json.JSONDecodeError:
      return {}

  def metadata(self, key: str) -> str:
    match = re.search(key + r'="([^"]*)"', self.attributes)
    return match[1] if match else ""


def parse_instruction(line: str, computation: str) -> Instruction | None:
  """The instruction on `line`, or None for a line that is not one."""
  head = _ASSIGN.match(line)
  if not head:
    return None
  i = head.end()
  if line[i] == "(":  # tuple result type
    j = _balanced(line, i)
  else:
    j = line.index(" ", i)
  result_type = line[i:j]
  opcode = _OPCODE.match(line, j)
  if not opcode:
    return None
  k = _balanced(line, opcode.end() - 1)
  operand_text = line[opcode.end():k - 1]
  return Instruction(head["name"], result_type, opcode["op"],
                     _OPERAND_NAME.findall(operand_text), operand_text, line[k:],
                     computation, line.lstrip().startswith("ROOT "))


@dataclasses.dataclass
class Module:
  """An HLO module: `computations[name]` lists its instructions; `entry` the ENTRY's name."""

  computations: dict
  entry: str
  unknown_loops: list = dataclasses.field(default_factory=list)  # while names, count unread

  def instruction(self, computation: str, name: str) -> Instruction | None:
    return self._by_name[computation].get(name)

  def __post_init__(self):
    self._by_name = {c: {i.name: i for i in instrs} for c, instrs in self.computations.items()}

  def root(self, computation: str) -> Instruction:
    instrs = self.computations[computation]
    return next((i for i in instrs if i.root), instrs[-1])

  def trip_count(self, loop: Instruction) -> int | None:
    """The number of times the body of `while` instruction `loop` runs, or None if unread."""
    known = loop.backend_config().get("known_trip_count", {}).get("n")
    if known is not None:
      return int(known)
    return _trip_count_from_condition(self, loop)

  def executions(self) -> dict[str, int]:
    """`{computation: times it runs per execution of the entry}`, for every computation
    reachable from the entry. A while body runs trip-count times per run of its caller, its
    condition once more; every other callee (fusions, reductions, branches, async wrappers)
    once per call. Calls from an async op's `-update` / `-done` are not counted again (its
    `-start` was)."""
    edges = {c: [] for c in self.computations}
    self.unknown_loops = []
    for c, instrs in self.computations.items():
      for instr in instrs:
        if instr.op.endswith("-done") or instr.op.endswith("-update"):
          continue
        for callee in instr.callees():
          weight = 1
          if instr.op == "while" and callee in (_attr(instr, "body"), _attr(instr, "condition")):
            trips = self.trip_count(instr)
            if trips is None and callee == _attr(instr, "body"):
              self.unknown_loops.append(instr.name)
            # the body runs `trips` times, the condition once more (the test that exits)
            weight = 1 if trips is None else trips + (callee != _attr(instr, "body"))
          edges[c].append((callee, weight))
    order, seen = [], set()

    def visit(c):  # post-order DFS: callees after... reversed below to callers-first
      seen.add(c)
      for callee, _ in edges.get(c, ()):
        if callee not in seen:
          visit(callee)
      order.append(c)

    visit(self.entry)
    runs = dict.fromkeys(order, 0)
    runs[self.entry] = 1
    for c in reversed(order):
      for callee, weight in edges.get(c, ()):
        runs[callee] += runs[c] * weight
    return runs


def _attr(instr: Instruction, key: str) -> str | None:
  match = re.search(rf"\b{key}=%([^\s,}}]+)", instr.attributes)
  return match[1] if match else None


def parse_module(text: str) -> Module:
  """Computations and instructions of an HLO module's text (`compiled.as_text()`)."""
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    if current is None:
      header = _HEADER.match(line)
      if header and line.rstrip().endswith("{"):
        current = header["name"]
        computations[current] = []
        if header.group(1):
          entry = current
      continue
    if line.startswith("}"):  # also `}, execution_thread="sparsecore"`
      current = None
      continue
    instr = parse_instruction(line, current)
    if instr is not None:
      computations[current].append(instr)
  if entry is None:
    raise ValueError("HLO text has no ENTRY computation")
  return Module(computations, entry)


# ---------------------------------------------------------------------------- trip counts

_DIRECTION = re.compile(r"direction=(LT|LE|GT|GE|NE)")
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")


def _resolve(module: Module, computation: str, name: str, depth: int = 0):
  """What a value is: `("const", int)`, `("element", tuple_index)` (of the computation's
  parameter), or None."""
  instr = module.instruction(computation, name)
  if instr is None or depth > 8:
    return None
  if instr.op == "constant":
    match = re.fullmatch(r"\s*(-?\d+)\s*", instr.operand_text)
    return ("const", int(match[1])) if match else None
  if instr.op == "get-tuple-element" and instr.operands:
    source = module.instruction(computation, instr.operands[0])
    index = re.search(r"index=(\d+)", instr.attributes)
    if source is not None and source.op == "parameter" and index:
      return ("element", int(index[1]))
    return None
  if instr.op in _PASS_THROUGH and instr.operands:
    return _resolve(module, computation, instr.operands[0], depth + 1)
  return None


def _compare_in(module: Module, computation: str, instr: Instruction):
  """`(direction, resolved lhs, resolved rhs)` of a compare, seen through a wrapping fusion."""
  if instr.op == "compare":
    direction = _DIRECTION.search(instr.attributes)
    if not direction or len(instr.operands) != 2:
      return None
    return (direction[1], *(_resolve(module, computation, o) for o in instr.operands))
  if instr.op == "fusion":
    fused = _attr(instr, "calls")
    inner = module.root(fused) if fused in module.computations else None
    if inner is None or inner.op != "compare":
      return None
    direction = _DIRECTION.search(inner.attributes)
    resolved = _fused_operands(module, computation, instr, fused)
    return (direction[1], *resolved) if direction and len(resolved) == 2 else None
  return None


def _fused_operands(module: Module, computation: str, fusion, fused: str) -> list:
  """`_resolve` of each operand of the fused computation's root, a fusion parameter followed
  out to the fusion's own operand in `computation`."""
  params = {p.name: int(p.operand_text) for p in module.computations[fused]
            if p.op == "parameter"}
  values = []
  for o in module.root(fused).operands:
    value = _resolve(module, fused, o)
    if value is None and o in params:
      value = _resolve(module, computation, fusion.operands[params[o]])
    values.append(value)
  return values


def _step(module: Module, body: str, index: int) -> int | None:
  """The constant the body adds to tuple element `index` each iteration."""
  root = module.root(body)
  if root.op != "tuple" or index >= len(root.operands):
    return None
  instr = module.instruction(body, root.operands[index])
  while instr is not None and instr.op in _PASS_THROUGH:
    instr = module.instruction(body, instr.operands[0])
  if instr is None:
    return None
  if instr.op == "fusion":  # a wrapped add
    fused = _attr(instr, "calls")
    inner = module.root(fused)
    if inner.op != "add":
      return None
    values = _fused_operands(module, body, instr, fused)
  elif instr.op == "add":
    values = [_resolve(module, body, o) for o in instr.operands]
  else:
    return None
  if sorted(v[0] for v in values if v) != ["const", "element"]:
    return None
  element = next(v for v in values if v[0] == "element")
  const = next(v for v in values if v[0] == "const")
  return const[1] if element[1] == index else None


def _passed_through(module: Module, body: str, index: int) -> bool:
  """Whether the body returns tuple element `index` unchanged (a loop invariant)."""
  root = module.root(body)
  return (root.op == "tuple" and index < len(root.operands)
          and _resolve(module, body, root.operands[index]) == ("element", index))


def _trip_count_from_condition(module: Module, loop: Instruction) -> int | None:
  cond, body = _attr(loop, "condition"), _attr(loop, "body")
  if cond not in module.computations or body not in module.computations:
    return None
  compare = _compare_in(module, cond, module.root(cond))
  if compare is None or None in compare[1:]:
    return None
  direction, lhs, rhs = compare
  if lhs[0] == "element" and rhs[0] == "element" and _passed_through(module, body, lhs[1]):
    lhs, rhs = rhs, lhs  # i < N with N carried: put the carried bound on the right
    direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE", "NE": "NE"}[direction]
  init_tuple = module.instruction(loop.computation, loop.operands[0]) if loop.operands else None
  if init_tuple is None or init_tuple.op != "tuple":
    return None

  def initial(element):  # a tuple element's value on entry, as a constant if it is one
    if element >= len(init_tuple.operands):
      return None
    return _resolve(module, loop.computation, init_tuple.operands[element])

  if rhs[0] == "element" and _passed_through(module, body, rhs[1]):
    rhs = initial(rhs[1]) or rhs  # a loop-invariant bound carried in the tuple
  if lhs[0] == "element" and rhs[0] == "element":
    return None
  if lhs[0] == "const" and rhs[0] == "element":  # N > i  ==  i < N
    lhs, rhs = rhs, lhs
    direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE", "NE": "NE"}[direction]
  if (lhs[0], rhs[0]) != ("element", "const"):
    return None
  index, bound = lhs[1], rhs[1]
  init = initial(index)
  step = _step(module, body, index)
  if init is None or init[0] != "const" or not step:
    return None
  start = init[1]
  if direction in ("LT", "NE") and step > 0:
    return max(0, math.ceil((bound - start) / step))
  if direction == "LE" and step > 0:
    return max(0, (bound - start) // step + 1)
  if direction == "GT" and step < 0:
    return max(0, math.ceil((start - bound) / -step))
  if direction == "GE" and step < 0:
    return max(0, (start - bound) // -step + 1)
  return None
