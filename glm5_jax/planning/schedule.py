"""A step's time three ways from its priced instructions (`op_costs.OpCost`): no overlap, the
overlap the compiled schedule gives, and ideal overlap.

  times = step_times(module, costs)   # {"none", "schedule", "ideal", "compute", "collectives"}

The optimized TPU module is scheduled (`is_scheduled=true`): each computation's instructions
are in the order they run. The schedule-aware time walks that order with two streams, compute
and collectives:

  compute instruction   the compute stream advances by its price
  collective (sync)     waits for the collective stream, then both streams advance by its price:
                        fully exposed
  X-start ... X-done    an asynchronous collective: it starts when issued (once the collective
                        stream is free) and runs while the compute between its start and its
                        done proceeds; at the done, compute waits for it to finish. The part not
                        covered by that compute is exposed. `async-start` / `async-done` pairs
                        wrapping a computation are the same, priced as their computation.
  while / call          its computation's own schedule-aware time (x the trip count), run as
                        compute: an asynchronous collective issued before it keeps running
  call-start ... -done  an asynchronous call on the SparseCore (the compiler's scatter
                        offloads): a third stream, waited for at its done; a call whose
                        computation holds a collective (a reduce-scatter, all-reduce or
                        all-gather offloaded to the SparseCore) goes on the collective stream
                        instead, since its bytes cross the same links, and the work the
                        computation does beside the collective counts with the collectives,
                        not the compute. Waits inside a SparseCore computation are the
                        SparseCore's, not charged to the step
  host transfer start ... done
                        an asynchronous transfer between device and host memory (a remat
                        policy's offloaded residuals; `op_costs`, "host link"): a fourth stream,
                        the host link's, one transfer at a time; at its done, compute waits for
                        it ("host")
  async-collective-start ... async-collective-done
                        the TPU compiler's async collective fusions (`hlo_stats.
                        async_collective_role`): the start fusion issues its collective, the
                        fusions between carry it on beside their compute (priced as that
                        compute), the done fusion with the same channel_id waits for it

Collectives are serialised on one stream (two in flight queue, they do not share links), and a
loop body's collectives do not contend with one issued outside it. No overlap: the sum of every
compute, collective and host transfer price per step; ideal: the largest of the three sums
(the SparseCore's scatter offloads, counted in the compute, overlapping the rest of it).

What the schedule exposes, collective by collective (`exposed_waits`): every time the walk
moves the compute clock past where compute alone would have it, the wait is charged to the
collective that caused it: a synchronous one's queueing behind those in flight ("queued") and
its own transfer ("sync"), an asynchronous one's part not covered by the compute before its done
("async"), a host transfer's part not covered ("host"), and what is still in flight when a
computation ends ("tail"); a SparseCore call
outlasting the compute before its done is "call". Per step, the charges add up to the
schedule-aware time minus the compute the walk runs (all of it, but the SparseCore calls').
"""

import re

from glm5_jax.planning import hlo_stats, op_costs

_ASYNC_DONE = "-done"


def _is_collective(cost: op_costs.OpCost) -> bool:
  return cost.kind == "torus"


def _is_host_transfer(cost: op_costs.OpCost) -> bool:
  return cost.kind == op_costs.HOST_LINK


class _Walker:
  """Schedule-aware time of each computation, memoised (one walk per computation)."""

  def __init__(self, module, costs):
    self.module = module
    self.price = {(c.computation, c.name): c for c in costs}
    self.memo = {}
    self.waits = {}  # (computation, kind, the waiting instruction's name) -> seconds a run
    self.offloaded = set()  # computations run by `call-start` on the SparseCore
    self.offloaded_collectives = sparsecore_collectives(module)

  def block(self, computation: str) -> tuple[float, bool]:
    """`(seconds, holds a collective)` of one run of `computation`."""
    if computation not in self.memo:
      self.memo[computation] = self._walk(computation)
    return self.memo[computation]

  def _nested(self, instr) -> float:
    """A while loop's, call's or conditional's time, as one compute block."""
    if instr.op == "while":
      body = _attr(instr, "body")
      cond = _attr(instr, "condition")
      trips = self.module.trip_count(instr) or 1
      return trips * self.block(body)[0] + (trips + 1) * self.block(cond)[0]
    callees = [c for c in instr.callees() if c in self.module.computations]
    times = [self.block(c)[0] for c in callees]
    if instr.op == "conditional":
      return max(times, default=0.0)
    return sum(times)

  def _walk(self, computation: str) -> tuple[float, bool]:
    now = stream = side = host = 0.0  # the compute, collective, SparseCore, host link clocks
    pending, has_collective = {}, False
    issued_by = {}  # pending key -> (kind of wait, the issuing instruction's name)

    def wait_until(t, kind, name):
      nonlocal now
      if t > now:
        key = (computation, kind, name)
        self.waits[key] = self.waits.get(key, 0.0) + t - now
        now = t

    for instr in self.module.computations[computation]:
      cost = self.price.get((computation, instr.name))
      role = hlo_stats.async_collective_role(instr)
      if role == "done":
        key = hlo_stats.fused_copy_key(self.module, instr)
        wait_until(pending.pop(key, now), *issued_by.pop(key, ("async", instr.name)))
      elif role == "start" and cost is not None and _is_collective(cost):
        has_collective = True
        stream = max(now, stream) + cost.seconds
        key = hlo_stats.fused_copy_key(self.module, instr)
        pending[key], issued_by[key] = stream, ("async", instr.name)
      elif instr.op.endswith(_ASYNC_DONE):
        key = instr.operands[0] if instr.operands else None
        wait_until(pending.pop(key, now), *issued_by.pop(key, ("async", instr.name)))
      elif instr.op == "call-start":  # an asynchronous call on another unit (SparseCore)
        callee = _attr(instr, "to_apply") or ""
        self.offloaded.add(callee)
        seconds, _ = self.block(callee)
        if callee in self.offloaded_collectives:  # its bytes cross the TensorCore's ICI links
          has_collective = True
          stream = pending[instr.name] = max(now, stream) + seconds
          issued_by[instr.name] = ("async", instr.name)
        else:
          side = pending[instr.name] = max(now, side) + seconds
          issued_by[instr.name] = ("call", instr.name)
      elif instr.op == "async-start":
        seconds, inner = self.block(_attr(instr, "calls") or "")
        if inner:  # a wrapped collective: on the collective stream
          start = max(now, stream)
          stream = pending[instr.name] = start + seconds
          issued_by[instr.name] = ("async", instr.name)
          has_collective = True
        else:
          now += seconds
      elif cost is not None and _is_host_transfer(cost):
        host = pending[instr.name] = max(now, host) + cost.seconds
        issued_by[instr.name] = ("host", instr.name)
      elif cost is not None and _is_collective(cost):
        has_collective = True
        start = max(now, stream)
        stream = start + cost.seconds
        if instr.op.endswith("-start"):
          pending[instr.name], issued_by[instr.name] = stream, ("async", instr.name)
        else:
          wait_until(start, "queued", instr.name)
          wait_until(stream, "sync", instr.name)
      elif cost is not None:
        now += cost.seconds
      elif instr.op in ("while", "call", "conditional"):
        seconds = self._nested(instr)
        has_collective |= any(self.block(c)[1] for c in instr.callees()
                              if c in self.module.computations)
        now += seconds
    for key, t in pending.items():  # in flight at the end: the computation ends with it
      wait_until(t, "tail", issued_by.get(key, ("tail", key))[1])
    return now, has_collective


def sparsecore_collectives(module) -> frozenset[str]:
  """The computations a `call-start` runs on the SparseCore that hold a collective (the TPU
  compiler's collective offload), and the computations they call (the reductions): their work
  beside the collective is the collective's time."""
  found = set()
  for instrs in module.computations.values():
    for instr in instrs:
      callee = _attr(instr, "to_apply") if instr.op == "call-start" else None
      if callee in module.computations and any(
          i.op.removesuffix("-start") in hlo_stats.OPS for i in module.computations[callee]):
        found.add(callee)
  todo = list(found)
  while todo:
    for instr in module.computations[todo.pop()]:
      for callee in instr.callees():
        if callee in module.computations and callee not in found:
          found.add(callee)
          todo.append(callee)
  return frozenset(found)


def _attr(instr, key: str) -> str | None:
  match = re.search(rf"\b{key}=%([^\s,}}]+)", instr.attributes)
  return match[1] if match else None


def step_times_and_waits(module, costs: list) -> tuple[dict[str, float], list]:
  """`(step_times(...), exposed_waits(...))` from one walk of the schedule."""
  walker = _Walker(module, costs)
  scheduled, _ = walker.block(module.entry)
  # An offloaded collective's computation runs on the SparseCore, its copies and fusions
  # with it: they are the collective's time, not the TensorCore's compute.
  on_chip = [c for c in costs if not _is_collective(c) and not _is_host_transfer(c)]
  beside = sum(c.seconds * c.runs for c in on_chip
               if c.computation in walker.offloaded_collectives)
  compute = sum(c.seconds * c.runs for c in on_chip) - beside
  collectives = sum(c.seconds * c.runs for c in costs if _is_collective(c)) + beside
  host = sum(c.seconds * c.runs for c in costs if _is_host_transfer(c))
  # The SparseCore's other calls (the compiler's scatter offloads) stay in the compute, but
  # run beside the TensorCore's: ideal overlap hides them too.
  scatters = sum(c.seconds * c.runs for c in on_chip
                 if c.computation in walker.offloaded - walker.offloaded_collectives)
  times = {"none": compute + collectives + host, "schedule": scheduled,
           "ideal": max(compute - scatters, scatters, collectives, host), "compute": compute,
           "collectives": collectives, "host": host}
  runs = module.executions()
  waits = sorted(((seconds * max(runs.get(computation, 1), 1), kind, name, computation)
                  for (computation, kind, name), seconds in walker.waits.items()
                  if computation not in walker.offloaded), reverse=True)
  return times, waits


def exposed_waits(module, costs: list) -> list[tuple[float, str, str, str]]:
  """What the compiled schedule exposes, per collective (module docstring): `(seconds per step,
  kind, the collective's instruction, its computation)`, largest first; kinds "queued", "sync",
  "async", "host", "tail" and "call"."""
  return step_times_and_waits(module, costs)[1]


def step_times(module, costs: list) -> dict[str, float]:
  """Seconds per step (module docstring): `none` (every price added), `schedule` (the compiled
  schedule's overlap), `ideal` (max of compute, collectives and host transfers), and the three
  sums (`compute`, `collectives`, `host`)."""
  return step_times_and_waits(module, costs)[0]
