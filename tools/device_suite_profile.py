"""`tools/device_suite.py` section `train_profile`: where the 3B train step's time goes.

The train step section's compiled step (or one compiled here if that section did not run) runs
`PROFILE_STEPS` (2) more steps under `jax.profiler.start_trace`; the trace the profiler writes
(`*.trace.json.gz`, Chrome trace-event JSON, timestamps in microseconds) is copied to the out
dir as `train_profile.trace.json.gz` (open it in Perfetto; not kept over `MAX_TRACE_BYTES`)
and parsed here into:

  kernels     per kernel name: launches, total ms, ms per step, % of the GPU's busy time, and
              the HLO instruction (`hlo_op`) that launched it most often, with its category;
  categories  ms per step per category x phase: each kernel's `hlo_op` is looked up in the
              compiled module's text (`flop_ledger.op_names`: the instruction's full
              `op_name`), then put in the FLOP ledger's category and phase
              (`flop_ledger.category` / `phase`: forward / remat / backward / optimizer); a
              kernel whose `hlo_op` is not in the module is "unattributed";
  idle        the span from the first kernel's start to the last one's end, the union of the
              kernel intervals (busy), and span - busy: time the GPU ran nothing (launch gaps,
              host waits); the host's wall time of the traced steps beside it.

Which events are kernels (`device_kernels`): a trace has one process per device plane. On a GPU
that is `/device:GPU:N`, whose CUDA stream lines (thread names `Stream #...`) hold one event per
kernel with `args.hlo_op` / `args.hlo_module`; the plane's other lines (`XLA Modules`, `XLA
Ops`, `Framework ...`, `Steps`, ...) are derived from those and are skipped. On a CPU host
there is no device plane: XLA:CPU's thunk executor events (any thread of `/host:CPU` with an
`hlo_op` argument) stand in, which is what the CPU test parses. The GPU rule is written from the
xprof trace-viewer format (tests use a synthetic trace of that shape) and read the H200 traces
of 2026-11-30 (docs/device_runs/2026-11-30-h200.md). A kernel XLA launches inside a CUDA graph
(command buffer) carries the graph's name as its `hlo_op`, which no instruction has: the suite
turns command buffers off (tools/device_suite.py).

The tables again from a run's saved files (a changed category rule, say), on any host:

  python3 tools/device_suite_profile.py --trace=train_profile.trace.json.gz \
      --hlo=train_step.hlo.txt.gz [--steps=2]
"""

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile
import time

import jax

if __name__ == "__main__":  # `python3 tools/device_suite_profile.py`: the repository root
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5_jax.planning import flop_ledger  # pylint: disable=g-import-not-at-top,wrong-import-position

PROFILE_STEPS = 2
TOP_KERNELS = 40
# A larger trace is parsed but not kept (what a device run brings back is size-limited).
MAX_TRACE_BYTES = 20 * 2**20
# Lines of a device plane that xprof derives from the stream lines (their events repeat the
# kernels' time as ops / modules / scopes): skipped when a plane has no `Stream` lines.
DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Framework Name Scope",
                 "Framework Ops", "TensorFlow Name Scope", "TensorFlow Ops", "Source code",
                 "Steps", "Launch Stats", "Host Threads")


def load_trace(path: str) -> dict:
  """A Chrome trace-event file (`.json` or `.json.gz`) as a dict with `traceEvents`."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    trace = json.load(f)
  return trace if isinstance(trace, dict) else {"traceEvents": trace}


def device_kernels(trace: dict) -> list[dict]:
  """The kernel events of `trace` (module docstring), each `{name, hlo_op, hlo_module, ts,
  dur}` (microseconds), start order."""
  events = trace["traceEvents"]
  processes, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      processes[e["pid"]] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[e["pid"], e.get("tid")] = e.get("args", {}).get("name", "")
  # `/device:CUSTOM:...` planes are tracers, not devices (libtpu, once loaded in the process,
  # adds "/device:CUSTOM:Megascale Trace" even to a CPU run's trace): no kernels there.
  devices = {pid for pid, name in processes.items()
             if name.startswith("/device:") and not name.startswith("/device:CUSTOM:")}
  streams = {key for key, name in threads.items() if key[0] in devices
             and name.lower().startswith("stream")}
  stream_devices = {pid for pid, _ in streams}

  def is_kernel(e) -> bool:
    if e.get("ph") != "X" or "dur" not in e:
      return False
    pid, key = e.get("pid"), (e.get("pid"), e.get("tid"))
    if pid in stream_devices:
      return key in streams
    if pid in devices:
      return threads.get(key, "") not in DERIVED_LINES
    return not devices and "hlo_op" in e.get("args", {})

  per_thread = collections.defaultdict(list)
  for e in events:
    if is_kernel(e):
      args = e.get("args", {})
      per_thread[e.get("pid"), e.get("tid")].append(dict(
          name=e["name"], hlo_op=args.get("hlo_op"), hlo_module=args.get("hlo_module"),
          ts=float(e["ts"]), dur=float(e["dur"])))
  kernels = [k for thread in per_thread.values() for k in _leaves(thread)]
  return sorted(kernels, key=lambda k: k["ts"])


def _leaves(events: list[dict]) -> list[dict]:
  """The events of one thread that contain no other: XLA:CPU's thunk executor nests a while
  loop's or a conditional's body events inside the loop's own event, which would count their
  time twice. (A GPU stream runs one kernel at a time: nothing nests there.)"""
  events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
  stack, containers = [], set()
  for i, e in enumerate(events):
    while stack and events[stack[-1]]["ts"] + events[stack[-1]]["dur"] <= e["ts"]:
      stack.pop()
    containers.update(stack)
    stack.append(i)
  return [e for i, e in enumerate(events) if i not in containers]


def busy_us(kernels) -> float:
  """The length of the union of the kernels' `[ts, ts + dur)` intervals."""
  total, end = 0.0, float("-inf")
  for k in sorted(kernels, key=lambda k: k["ts"]):
    start, stop = k["ts"], k["ts"] + k["dur"]
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total


def summarize(kernels: list[dict], names: dict, steps: int) -> dict:
  """Per-kernel and per-category tables of `kernels` over `steps` steps (module docstring);
  `names`: `flop_ledger.op_names` of the compiled module. Only the module with the most kernel
  time is kept (the step; a stray program traced beside it is left out and named)."""
  if not kernels:
    raise ValueError("no device kernels in the trace (module docstring: which events count)")
  per_module = collections.Counter()
  for k in kernels:
    per_module[k["hlo_module"]] += k["dur"]
  module = per_module.most_common(1)[0][0]
  kernels = [k for k in kernels if k["hlo_module"] == module]
  span = max(k["ts"] + k["dur"] for k in kernels) - kernels[0]["ts"]
  busy = busy_us(kernels)
  total = sum(k["dur"] for k in kernels)

  def where(hlo_op):
    if hlo_op not in names:
      return "unattributed", "unattributed"
    name, op = names[hlo_op]
    ph = flop_ledger.phase(name)
    return ("optimizer" if ph == "optimizer" else flop_ledger.category(name, op)), ph

  by_kernel = collections.defaultdict(lambda: dict(count=0, us=0.0, ops=collections.Counter()))
  by_category = collections.defaultdict(lambda: collections.defaultdict(float))
  for k in kernels:
    row = by_kernel[k["name"]]
    row["count"] += 1
    row["us"] += k["dur"]
    row["ops"][k["hlo_op"]] += k["dur"]
    cat, ph = where(k["hlo_op"])
    by_category[cat][ph] += k["dur"]
  kernel_rows = []
  for name, row in sorted(by_kernel.items(), key=lambda kv: -kv[1]["us"])[:TOP_KERNELS]:
    op = row["ops"].most_common(1)[0][0]
    kernel_rows.append(dict(kernel=name[:120], hlo_op=op, category="/".join(where(op)),
                            count=row["count"], ms_per_step=row["us"] / steps / 1e3,
                            pct_of_kernel_time=100 * row["us"] / total))
  phases = flop_ledger.PHASES + ("unattributed",)
  category_rows = []
  for cat, times in sorted(by_category.items(), key=lambda kv: -sum(kv[1].values())):
    category_rows.append(dict(category=cat, **{f"{p}_ms": times.get(p, 0.0) / steps / 1e3
                                               for p in phases},
                              total_ms=sum(times.values()) / steps / 1e3,
                              pct=100 * sum(times.values()) / total))
  return dict(
      hlo_module=module, other_modules={m: t / 1e3 for m, t in per_module.items() if m != module},
      kernels_traced=len(kernels), distinct_kernels=len(by_kernel),
      span_ms_per_step=span / steps / 1e3, busy_ms_per_step=busy / steps / 1e3,
      idle_ms_per_step=(span - busy) / steps / 1e3, idle_pct=100 * (span - busy) / span,
      kernel_rows=kernel_rows, category_rows=category_rows)


def trace_file(log_dir: str) -> str:
  """The trace-event file the profiler wrote under `log_dir` (`<host>.trace.json.gz`, else the
  Perfetto copy)."""
  found = (glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
           or glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True))
  if not found:
    raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}: "
                            f"{glob.glob(os.path.join(log_dir, '**'), recursive=True)[:20]}")
  return sorted(found)[-1]


def profile_section(ctx) -> dict:
  """`train_profile`: `PROFILE_STEPS` traced steps of the train step section's compiled step,
  per-kernel / per-category time and GPU idle time; the trace gzipped in the out dir."""
  from tools import device_suite_model  # the compiled step it shares (imports the model)
  if ctx.left() <= 0:
    ctx.shared.pop("train", None)
    return dict(rows=[dict(case="train profile", status="skipped (budget)")])
  # The step's state and compiled program are released after this section: the ones after it
  # need the device memory.
  run = device_suite_model.compiled_train_step(ctx, release=True)
  log_dir = tempfile.mkdtemp(prefix="train_profile_")
  state = run["state"]
  jax.block_until_ready(state)
  jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
  try:
    start = time.perf_counter()
    for _ in range(PROFILE_STEPS):
      state, metrics = run["compiled"](state, run["batch"])
    jax.block_until_ready(metrics)
    wall = time.perf_counter() - start
  finally:
    jax.profiler.stop_trace()
  path = trace_file(log_dir)
  trace_bytes = os.path.getsize(path)
  kept = None
  if trace_bytes <= MAX_TRACE_BYTES:
    kept = os.path.join(ctx.out_dir, "train_profile.trace.json.gz")
    shutil.copyfile(path, kept)
  summary = summarize(device_kernels(load_trace(path)), flop_ledger.op_names(run["hlo_text"]),
                      PROFILE_STEPS)
  shutil.rmtree(log_dir, ignore_errors=True)
  kernel_rows, category_rows = summary.pop("kernel_rows"), summary.pop("category_rows")
  return dict(summary, config=run["config_name"], dsa_impl=run["dsa_impl"],
              steps=PROFILE_STEPS, wall_ms_per_step=wall / PROFILE_STEPS * 1e3,
              trace=kept and os.path.basename(kept), trace_bytes=trace_bytes,
              rows=[dict(case="time per category x phase", status="ok", **r)
                    for r in category_rows],
              tables={f"top {TOP_KERNELS} kernels": kernel_rows})


def _table(rows: list) -> str:
  keys = list(rows[0])
  cell = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
  return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
                   + ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows])


def main(argv=None):
  parser = argparse.ArgumentParser(description="The train_profile tables from a saved trace "
                                   "and the compiled step's HLO text (module docstring).")
  parser.add_argument("--trace", required=True, help="train_profile.trace.json.gz")
  parser.add_argument("--hlo", required=True, help="train_step.hlo.txt.gz (or plain text)")
  parser.add_argument("--steps", type=int, default=PROFILE_STEPS, help="steps in the trace")
  args = parser.parse_args(argv)
  opener = gzip.open if args.hlo.endswith(".gz") else open
  with opener(args.hlo, "rt") as f:
    names = flop_ledger.op_names(f.read())
  summary = summarize(device_kernels(load_trace(args.trace)), names, args.steps)
  kernel_rows, category_rows = summary.pop("kernel_rows"), summary.pop("category_rows")
  print(json.dumps(summary, indent=1, default=str))
  print("\n## time per category x phase (ms per step)\n\n" + _table(category_rows))
  print(f"\n## top {TOP_KERNELS} kernels\n\n" + _table(kernel_rows))


if __name__ == "__main__":
  main()
