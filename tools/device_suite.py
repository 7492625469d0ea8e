"""One command that measures the project on an accelerator and explains its train step: the 3B
train step, its profile, the MoE grouped matmul A/B, the GPU DSA kernels, DSA against cuDNN and
decoding; writes `device_suite.json` and `device_suite.md` (and beside them the step's compiled
HLO and its profile trace, gzipped).

  # on the device machine (wheels from tools/fetch_device_wheels.sh; see docs/performance.md):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && \
      python3 tools/device_suite.py --out_dir=$OUT
  python3 tools/device_suite.py --smoke --out_dir=/tmp/suite       # CPU, interpret mode, < 1 min

Sections, in order (each guarded: a failure is recorded in the JSON and the rest still run; a
kernel module absent from the build is recorded as "missing"):
  train_step          (d) configs/glm5_gpu_3b.py's train step (8 x 4,096 tokens), per
                      --train_impls (default pallas): tokens/s and MFU, XLA's FLOP / memory
                      estimates, `ragged-dot`s and custom calls in the compiled program;
                      `train_step.hlo.txt.gz` (tools/device_suite_model.py)
  train_profile       (f) two more steps of that compiled step under jax.profiler: ms per step
                      per category x phase (forward / remat / backward / optimizer), the top
                      kernels, GPU idle time; `train_profile.trace.json.gz`
                      (tools/device_suite_profile.py)
  moe_matmul          (g) the routed experts' MLP forward + backward at the 3B shapes: default
                      ragged_dot, the XLA cuDNN ragged-dot fusion flag, jax's Pallas lowering
                      option, every glm5_jax.grouped_matmul impl, tokamax if installed, and a
                      dense GEMM bound; the compiled program's kernels per variant
                      (tools/device_suite_moe.py)
  kernel_correctness  (a) each GPU kernel against its reference, forward and backward, bf16,
                      GLM-5 shapes, L in --seq_lens (rules: tools/device_suite_kernels.py)
  kernel_timing       (b) each GPU kernel's median time, TFLOP/s, % of the chip's bf16 peak;
                      the sparse MLA's backward both plain and as a GPU train step runs it,
                      writing the indexer KL's target (`fwd+bwd+kl_target`)
  dsa_vs_dense        (c) indexer + top-k + sparse MLA against cuDNN dense causal attention,
                      forward + backward, L in --dense_seq_lens, and DSA's growth per 4x L
  decode              (e) engine tokens/s at --decode_slots, plain and MTP-speculative, accept
                      length (`--workdir`: a trained run; the flag is tools/bench_decode.py's,
                      whose module this one imports; its other flags are not read here)

Time: `--budget_s` (default 420 s, so the run ends within 8 minutes on one H100 / H200 with
start-up) is split between the sections by weight (`SECTIONS`); time a section leaves unused
passes to the next ones. The train step goes first: its compile (~1 min) and steps are the
largest share, and the profile that explains it is the section a short run must not lose. A case that would start past its section's deadline is recorded as
"skipped (budget)"; a running case is never interrupted, so a slow compile can overrun.
Both files are rewritten after every section, so a killed run still leaves what it finished.
Every table's header names the device, the jax / jaxlib versions, CUDA, cuDNN and the
driver (where the backend is a GPU), XLA_FLAGS and the date (`meta`; the JSON's meta also holds
`jax.print_environment_info()`'s text).
"""

import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

# The device machine runs the checkout as it is, not pip-installed: the repository root must be
# importable for `python3 tools/device_suite.py` (sys.path[0] is tools/).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from absl import app, flags  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jaxlib  # pylint: disable=g-import-not-at-top,wrong-import-position

from glm5_jax.accelerators import accelerator_of
from tools import bench_decode  # defines --workdir and --seed, read by the decode section
from tools import device_suite_kernels as kernels
from tools import device_suite_model as model_sections
from tools import device_suite_moe as moe_sections
from tools import device_suite_profile as profile_sections

_OUT = flags.DEFINE_string("out_dir", "device_suite_out", "Where the JSON and markdown go.")
_BUDGET = flags.DEFINE_float("budget_s", 420.0, "Seconds for all sections together.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes and configs, GPU kernels in interpret "
                           "mode off GPU: checks the suite itself on CPU (CI).")
_ONLY = flags.DEFINE_list("sections", [], "Run only these sections (default: all).")
# Run order: the cheapest first (a broken kernel fails fast), then the goals' lengths, so a
# section that runs out of budget loses the in-between ones.
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["4096", "65536", "16384", "32768", "8192"],
                              "L of the kernel sections (a), (b), in run order.")
_DENSE_LENS = flags.DEFINE_list("dense_seq_lens", ["16384", "65536", "8192", "32768"],
                                "L of the DSA vs dense section (c), in run order.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per measurement (median).")
_TRAIN_STEPS = flags.DEFINE_integer("train_steps", 3, "Timed train steps per dsa_impl.")
_TRAIN_IMPLS = flags.DEFINE_list("train_impls", ["pallas"], "model.dsa_impl values of the train "
                                 "step section (d), in run order; the last one is profiled.")
_SLOTS = flags.DEFINE_list("decode_slots", ["1", "32", "128"], "Slot counts of section (e).")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens generated per slot in (e).")
_PROMPT_LEN = flags.DEFINE_integer("decode_prompt_len", 128, "Prompt tokens per slot in (e).")
_SPEC_K = flags.DEFINE_integer("spec_k", 0, "MTP draft steps in (e); 0: the model's mtp_depths.")
_DECODE_DSA = flags.DEFINE_string("decode_dsa_impl", "pallas", "model.dsa_impl of the random-"
                                  "init decode model (--smoke: xla).")

# name -> (function, share of the budget)
SECTIONS = {
    "train_step": (model_sections.train_section, 0.3),
    "train_profile": (profile_sections.profile_section, 0.12),
    "moe_matmul": (moe_sections.moe_section, 0.1),
    "kernel_correctness": (kernels.correctness_section, 0.1),
    "kernel_timing": (kernels.timing_section, 0.1),
    "dsa_vs_dense": (kernels.dsa_vs_dense_section, 0.13),
    "decode": (model_sections.decode_section, 0.15),
}
SMOKE_LENS, SMOKE_DENSE_LENS, SMOKE_SLOTS = (64,), (64,), (1,)


@dataclasses.dataclass
class Context:
  """What the sections read: sizes, budget, and the guarded-case helpers."""

  smoke: bool
  dims: kernels.Dims
  seq_lens: tuple
  dense_seq_lens: tuple
  repeats: int
  train_steps: int
  decode_slots: tuple
  new_tokens: int
  prompt_len: int
  spec_k: int
  decode_dsa_impl: str
  workdir: str | None
  seed: int
  peak: float | None
  train_impls: tuple = ("pallas",)
  out_dir: str = "."
  keep_train_step: bool = False  # train_profile runs after train_step: keep its compiled step
  shared: dict = dataclasses.field(default_factory=dict)  # what one section hands the next
  deadline: float = 0.0

  def left(self) -> float:
    return self.deadline - time.perf_counter()

  def cases(self, name: str, fn) -> list:
    """`fn()` -> rows, each marked "ok"; one error row if it raises; a "skipped (budget)" row
    if the section's time is up. Prints one progress line per case."""
    if self.left() <= 0:
      print(f"  {name}: skipped (budget)", flush=True)
      return [dict(case=name, status="skipped (budget)")]
    start = time.perf_counter()
    try:
      rows = [dict(case=name, status="ok", **row) for row in fn()]
    except Exception as e:  # recorded, and the suite goes on
      rows = [dict(case=name, status="error", error=f"{type(e).__name__}: {e}"[:1500])]
    seconds = time.perf_counter() - start
    for row in rows:
      shown = {k: v for k, v in row.items() if k not in ("case", "status")}
      print(f"  {name}: {row['status']} in {seconds:.1f}s {_short(shown)}", flush=True)
    return rows

  def case(self, name: str, fn) -> dict:
    return self.cases(name, lambda: [fn()])[0]

  def rate(self, row: dict, flops: float) -> dict:
    """`row` with TFLOP/s and % of the chip's bf16 peak for `flops` in `row["median_s"]`."""
    per_s = flops / row["median_s"]
    return dict(row, tflop=flops / 1e12, tflops=per_s / 1e12,
                peak_pct=100 * per_s / self.peak if self.peak else None)


def _short(row: dict) -> str:
  return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                  for k, v in row.items())[:300]


def meta() -> dict:
  device = jax.devices()[0]
  chip = accelerator_of(device.device_kind)
  return dict(device=device.device_kind, backend=jax.default_backend(),
              devices=jax.device_count(), jax=jax.__version__, jaxlib=jaxlib.__version__,
              xla_flags=os.environ.get("XLA_FLAGS", ""), **gpu_versions(),
              date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              peak_bf16_tflops=chip.peak_flops / 1e12 if chip else None)


def _dotted(version, parts: int, step: int = 100) -> str:
  """12080 -> "12.8" (CUDA: major * 1000 + minor * 10); cuDNN 9: major * 10000 + minor * 100
  + patch -> "9.10.0"."""
  if parts == 2:
    return f"{version // 1000}.{version % 1000 // 10}"
  return f"{version // (step * step)}.{version // step % step}.{version % step}"


def gpu_versions() -> dict:
  """CUDA runtime, cuDNN and driver versions where jax has a CUDA plugin (else empty), and
  the environment text `jax.print_environment_info` prints (nvidia-smi's table included)."""
  out = {}
  from jax._src.lib import cuda_versions  # None without a CUDA plugin
  if cuda_versions is not None and jax.default_backend() == "gpu":
    for key, fn, parts in (("cuda", "cuda_runtime_get_version", 2),
                           ("cuda_build", "cuda_runtime_build_version", 2),
                           ("cudnn", "cudnn_get_version", 3),
                           ("cudnn_build", "cudnn_build_version", 3)):
      try:
        out[key] = _dotted(int(getattr(cuda_versions, fn)()), parts)
      except Exception as e:  # a plugin without that entry point: say so, go on
        out[key] = f"unknown ({type(e).__name__})"
  if shutil.which("nvidia-smi"):
    try:
      out["driver"] = subprocess.run(
          ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
          capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except Exception as e:
      out["driver"] = f"unknown ({type(e).__name__})"
  try:
    out["environment"] = jax.print_environment_info(return_string=True)
  except Exception as e:
    out["environment"] = f"{type(e).__name__}: {e}"
  return out


def header(m: dict) -> str:
  """The line under every table's title: device, versions, flags, date."""
  gpu = "".join(f" | {k} {m[k]}" for k in ("cuda", "cudnn", "driver") if m.get(k))
  return (f"device {m['device']} ({m['backend']}, bf16 peak "
          f"{m['peak_bf16_tflops'] or 'unknown'} TFLOP/s) | jax {m['jax']} | jaxlib "
          f"{m.get('jaxlib')}{gpu} | XLA_FLAGS {m.get('xla_flags') or '(none)'} | {m['date']}"
          f"{' | SMOKE (tiny shapes, interpret mode: no speed meaning)' if m['smoke'] else ''}")


def run_sections(ctx: Context, names, budget_s: float, on_section) -> dict:
  """Every section in `names` within `budget_s`, by weight; `on_section(results)` after each."""
  results, end = {}, time.perf_counter() + budget_s
  for i, name in enumerate(names):
    fn, weight = SECTIONS[name]
    rest = sum(SECTIONS[n][1] for n in names[i:])
    ctx.deadline = time.perf_counter() + max(end - time.perf_counter(), 0) * weight / rest
    print(f"== {name} ({max(ctx.left(), 0):.0f}s)", flush=True)
    start = time.perf_counter()
    try:
      out = dict(status="ok", **fn(ctx))
      bad = [r["status"] for r in out.get("rows", []) if r["status"] != "ok"]
      if bad and all(b == "missing" for b in bad) and len(bad) == len(out["rows"]):
        bad = ["missing"]
      if bad:
        out["status"] = "partial: " + ", ".join(sorted(set(bad)))
    except kernels.Missing as e:
      out = dict(status="missing", error=str(e))
    except Exception as e:  # recorded, and the suite goes on
      out = dict(status="error", error=f"{type(e).__name__}: {e}"[:1500],
                 traceback=traceback.format_exc()[-3000:])
    out["seconds"] = time.perf_counter() - start
    print(f"== {name}: {out['status']} in {out['seconds']:.1f}s", flush=True)
    results[name] = out
    on_section(results)
  return results


def _rows(report: dict, section: str, **match) -> list:
  rows = report["sections"].get(section, {}).get("rows", [])
  return [r for r in rows if r.get("status") == "ok"
          and all(r.get(k) == v for k, v in match.items())]


def goals(report: dict) -> list:
  """Issue 26's goals against this run's figures: (goal, measured, met); None = not measured."""
  value = lambda rows, key: rows[0].get(key) if rows else None
  top = max(report["meta"]["seq_lens"])
  peak = [r["peak_pct"] for r in _rows(report, "kernel_timing", op="sparse_mla fwd")
          if r.get("peak_pct") is not None]
  speedup = value(_rows(report, "dsa_vs_dense", path="dsa (pallas)", L=65536),
                  "speedup_vs_dense")
  growth = report["sections"].get("dsa_vs_dense", {}).get("growth_per_4x_L", {})
  growth = growth.get("pallas 16384->65536")
  index_s = value(_rows(report, "kernel_timing", op="indexer_topk", L=top), "median_s")
  mla_s = value(_rows(report, "kernel_timing", op="sparse_mla fwd", L=top), "median_s")
  train = _rows(report, "train_step", dsa_impl="pallas")
  mfu = value(train, "mfu_pct")
  tokens = value(train, "batch") * value(train, "seq_len") if train else None
  mtp = [r for r in _rows(report, "decode", slots=1) if r.get("speedup")]
  trained = bool(report["meta"].get("workdir"))
  check = lambda x, ok: None if x is None else bool(ok(x))
  return [
      ("sparse MLA forward >= 40% of bf16 peak (best L)", max(peak, default=None),
       check(max(peak, default=None), lambda x: x >= 40)),
      ("DSA fwd+bwd >= 3x faster than cuDNN dense at 64K", speedup,
       check(speedup, lambda x: x >= 3)),
      ("DSA time x4 +/- 20% for 16K -> 64K", growth, check(growth, lambda x: 3.2 <= x <= 4.8)),
      (f"indexer + top-k time / sparse MLA forward time at L={top} <= 1",
       index_s / mla_s if index_s and mla_s else None,
       check(index_s and mla_s and index_s / mla_s, lambda x: x <= 1)),
      ("train-step MFU >= 25% at >= 32K tokens per step (dsa_impl pallas; issue 41)", mfu,
       check(mfu, lambda x: x >= 25 and tokens >= 32768)),
      ("MTP speculation >= 1.5x decode tokens/s at 1 slot" + ("" if trained else
       " (random init: not meaningful)"), value(mtp, "speedup"),
       check(value(mtp, "speedup"), lambda x: x >= 1.5) if trained else None),
  ]


def markdown(report: dict) -> str:
  """One table per section, each headed by device, jax version and date."""
  m = report["meta"]
  head = header(m)
  lines = [f"# tools/device_suite.py: {m['command']}", "", "## goals (issues 26, 41)", "",
           f"_{head}_", "", "| goal | measured | met |", "|---|---|---|"]
  lines += [f"| {goal} | {_cell(measured)} | {'' if met is None else 'yes' if met else 'NO'} |"
            for goal, measured, met in goals(report)] + [""]
  for name, section in report["sections"].items():
    lines += [f"## {name}: {section['status']} ({section['seconds']:.0f} s)", "", f"_{head}_", ""]
    extras = {k: v for k, v in section.items()
              if k not in ("rows", "tables", "status", "seconds", "traceback")}
    lines += [f"- {k}: {json.dumps(v, default=str)}" for k, v in extras.items()] + [""]
    lines += _table(section.get("rows", []))
    for title, rows in section.get("tables", {}).items():
      lines += [f"### {name}: {title}", ""] + _table(rows)
  return "\n".join(lines)


def _table(rows: list) -> list:
  """Markdown lines of one table over the union of the rows' keys (none for no rows)."""
  columns = list(dict.fromkeys(k for row in rows for k in row))
  if not rows:
    return []
  return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
          + ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
          + [""])


def _cell(value) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  return "" if value is None else str(value).replace("|", "/").replace("\n", " ")


def smoke_context(workdir: str | None = None, seed: int = 0) -> Context:
  """`--smoke`'s fixed tiny sizes (no flag read: tests build it too)."""
  return Context(smoke=True, dims=kernels.SMOKE_DIMS, seq_lens=SMOKE_LENS,
                 dense_seq_lens=SMOKE_DENSE_LENS, repeats=1, train_steps=1,
                 decode_slots=SMOKE_SLOTS, new_tokens=2, prompt_len=8, spec_k=0,
                 decode_dsa_impl="xla", workdir=workdir, seed=seed, peak=None,
                 train_impls=("pallas_interpret",))


def flag_context(peak: float | None) -> Context:
  """The sections' sizes from the flags (GLM-5 shapes)."""
  ints = lambda values: tuple(int(v) for v in values)
  return Context(
      smoke=False, dims=kernels.GLM5_DIMS, seq_lens=ints(_SEQ_LENS.value),
      dense_seq_lens=ints(_DENSE_LENS.value), repeats=_REPEATS.value,
      train_steps=_TRAIN_STEPS.value, decode_slots=ints(_SLOTS.value),
      new_tokens=_NEW_TOKENS.value, prompt_len=_PROMPT_LEN.value, spec_k=_SPEC_K.value,
      decode_dsa_impl=_DECODE_DSA.value, workdir=bench_decode._WORKDIR.value,
      seed=bench_decode._SEED.value, peak=peak, train_impls=tuple(_TRAIN_IMPLS.value))


def run(ctx: Context, names, budget_s: float, out_dir: str, command: str) -> dict:
  """Runs `names`, rewriting `<out_dir>/device_suite.{json,md}` after each; the report."""
  info = meta()
  report = dict(meta=dict(info, smoke=ctx.smoke, budget_s=budget_s, command=command,
                          seq_lens=list(ctx.seq_lens), workdir=ctx.workdir), sections={})
  os.makedirs(out_dir, exist_ok=True)
  ctx.out_dir = out_dir
  names = list(names)
  ctx.keep_train_step = ("train_profile" in names and "train_step" in names
                         and names.index("train_profile") > names.index("train_step"))
  print(f"device_suite: {info['device']} ({info['backend']}), jax {info['jax']}, "
        f"{info['date']}, budget {budget_s:.0f}s{', SMOKE' if ctx.smoke else ''}", flush=True)

  def write(results):
    report["sections"] = results
    with open(os.path.join(out_dir, "device_suite.json"), "w") as f:
      json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out_dir, "device_suite.md"), "w") as f:
      f.write(markdown(report))

  run_sections(ctx, list(names), budget_s, write)
  print(f"wrote {out_dir}/device_suite.json and device_suite.md", flush=True)
  return report


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  # A kernel that XLA launches inside a CUDA graph (a command buffer) carries the graph's name
  # in the profile, not its HLO op's, so train_profile cannot attribute it (the 2026-11-30 H200
  # run: 99.6% of the step "unattributed"). The suite runs without command buffers unless
  # XLA_FLAGS names them (set before the first device query starts the backend; every table's
  # header shows XLA_FLAGS).
  if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_enable_command_buffer=").strip()
  names = _ONLY.value or list(SECTIONS)
  unknown = sorted(set(names) - set(SECTIONS))
  if unknown:
    raise app.UsageError(f"--sections: unknown {unknown}; known: {list(SECTIONS)}")
  peak = meta()["peak_bf16_tflops"]
  ctx = (smoke_context(bench_decode._WORKDIR.value, bench_decode._SEED.value) if _SMOKE.value
         else flag_context(peak and peak * 1e12))
  run(ctx, names, _BUDGET.value, _OUT.value,
      "python3 tools/device_suite.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
  app.run(main)
