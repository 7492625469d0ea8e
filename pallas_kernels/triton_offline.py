"""Compile a Pallas Triton kernel with Triton's own compiler on a host without a GPU.

Two steps, each behind one small function:

1. `capture_ttir(fn, *abstract_args)`: the Triton IR (TTIR text) of the first `pallas_call`
   in `fn`, as jax's Pallas Triton lowering builds it for CUDA. Public jax only lowers
   (`jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))`), and on jaxlib <= 0.10.2 it
   hands XLA the TTIR as bytecode inside a custom call, while newer jaxlibs compile it right
   away (through the CUDA plugin, which a CPU host lacks). Neither exposes the IR, so this
   adapter wraps the ONE private function that builds it,
   `jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module` (looked up through
   `jax._src.pallas.triton.pallas_call_registration.lowering`, the module attribute the
   lowering rule calls), takes the `.module` of its result and stops the lowering there. If jax
   moves or renames it, `TritonLoweringAdapterError` names it: the fix is here only.
   `backward_program(fn, *args)` makes a custom-VJP backward the first (only) kernel lowered.
2. `compile_ttir(ttir, num_warps, num_stages)`: Triton's TTIR passes (`make_ttir`, which XLA's
   Triton pipeline runs first on the device too), then `triton.compile` for sm_90a (H100 / H200,
   `GPUTarget("cuda", 90, 32)`) down to a cubin; Triton runs `ptxas -v` itself and its log
   gives registers per thread and spill bytes; the shared memory is Triton's `metadata.shared`.

Nothing here runs a kernel: a compile proves the program is legal for Triton and ptxas and
gives its resource use, not that it is correct or fast (interpret-mode tests and the device
suite do that). Triton is an optional dependency (`pip install '.[gpu-check]'`, the version the
device image has); `import_triton()` says how to get it when it is missing.
"""

import contextlib
import dataclasses
import io
import os
import re
import subprocess
import tempfile
import time

import jax

H100_SHARED_LIMIT = 227 * 1024  # max dynamic shared memory per block on sm_90 (of 228 KiB/SM)
_ADAPTED = "jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module"


class TritonLoweringAdapterError(RuntimeError):
  """jax's private Triton lowering entry point moved (see the module docstring)."""


def import_triton():
  """The `triton` module, or an ImportError that says how to install it."""
  try:
    import triton  # pylint: disable=g-import-not-at-top
    import triton.backends.compiler  # pylint: disable=g-import-not-at-top  (GPUTarget)
  except ImportError as e:
    raise ImportError(
        "Triton is not importable, so the GPU kernels cannot be compiled offline. Install the "
        "optional extra (the Triton version of the device image, CPU-only use is fine): "
        "`pip install '.[gpu-check]'` (setup.cfg), or without touching the environment: "
        "`pip download triton==3.6.0 --no-deps` then `pip install --no-deps --target DIR "
        f"triton-3.6.0-*.whl` and PYTHONPATH=DIR. ({e})") from e
  return triton


def _lowering_module():
  try:
    # pylint: disable-next=g-import-not-at-top
    from jax._src.pallas.triton import pallas_call_registration
    module = pallas_call_registration.lowering
    getattr(module, "lower_jaxpr_to_triton_module")
  except (ImportError, AttributeError) as e:
    raise TritonLoweringAdapterError(
        f"pallas_kernels/triton_offline.py wraps the private jax function {_ADAPTED} (called "
        "through jax._src.pallas.triton.pallas_call_registration.lowering) to read the Triton "
        "IR; jax "
        f"{jax.__version__} does not have it there ({e}). Find where this jax builds the "
        "Triton module of a pallas_call and adapt `capture_ttir`.") from e
  return module


@dataclasses.dataclass(frozen=True)
class CapturedKernel:
  name: str  # the pallas_call's name= (the TTIR module's sym_name)
  ttir: str  # TTIR text


class _Captured(Exception):
  """Stops the lowering once the Triton module is built (carries it out)."""


def capture_ttir(fn, *abstract_args) -> CapturedKernel:
  """Lowers `jax.jit(fn)` for CUDA on abstract args up to its first pallas_call's Triton module
  and returns that module; the lowering stops there, so what jax does with the module next (on
  jaxlib > 0.10.2: compile it through the CUDA plugin, absent on a CPU host) never runs. Give
  `fn` the kernel first (a backward alone: `backward_program`)."""
  module = _lowering_module()
  original = module.lower_jaxpr_to_triton_module

  def recording(*args, **kwargs):
    result = original(*args, **kwargs)
    try:
      op = result.module.operation
      name = str(op.attributes["sym_name"]).strip('"')
      ttir = op.get_asm(enable_debug_info=False)
    except (AttributeError, KeyError) as e:
      raise TritonLoweringAdapterError(
          f"{_ADAPTED} no longer returns an object with a `.module` holding a named Triton "
          f"module (jax {jax.__version__}): {e}") from e
    raise _Captured(CapturedKernel(name, ttir))

  module.lower_jaxpr_to_triton_module = recording
  try:
    jax.jit(fn).trace(*abstract_args).lower(lowering_platforms=("cuda",))
  except _Captured as captured:
    return captured.args[0]
  finally:
    module.lower_jaxpr_to_triton_module = original
  raise TritonLoweringAdapterError(
      f"lowering for CUDA called no {_ADAPTED} (jax {jax.__version__}): either `fn` has no "
      "Pallas Triton kernel or jax builds the Triton module elsewhere now.")


def backward_program(fn, *abstract_args):
  """(function, abstract args) of `fn`'s VJP alone, for `capture_ttir`: the forward is traced
  for its residuals' shapes (`jax.eval_shape`) but not lowered. The cotangents are abstract
  like `fn`'s outputs."""
  outputs, vjp_fn = jax.eval_shape(lambda *x: jax.vjp(fn, *x), *abstract_args)
  return (lambda vjp_fn, cotangents: vjp_fn(cotangents)), (vjp_fn, outputs)


@dataclasses.dataclass(frozen=True)
class CompileResult:
  registers: int  # per thread
  spill_stores: int  # bytes
  spill_loads: int  # bytes
  shared_bytes: int
  seconds: float

  @property
  def fits(self) -> bool:
    """One program fits an H100 / H200 SM without spilling registers."""
    return self.shared_bytes <= H100_SHARED_LIMIT and not (self.spill_stores or self.spill_loads)


def _ttir_passes(ttir: str, tmp: str, target, options: dict) -> str:
  """`ttir` after Triton's TTIR stage (`make_ttir`: canonicalize, combine, CSE, loop unroll).

  `triton.compile` of a `.ttir` file starts at the next stage (it takes the file as already
  through its own), but the TTIR that jax lowers is raw: on the GPU, XLA's Triton pipeline
  (openxla/xla `backends/gpu/codegen/triton/compilation_pipeline_cuda.cc`, `MakeTTIR`) runs
  these passes first. Without them a compile here differs from the device's: e.g. `acc +
  dot(a, b)` stays a dot into zeros plus an add instead of one dot into the accumulator.
  """
  from triton._C.libtriton import ir  # pylint: disable=g-import-not-at-top
  from triton.compiler import compiler  # pylint: disable=g-import-not-at-top
  backend = compiler.make_backend(target)
  context = ir.context()
  ir.load_dialects(context)
  backend.load_dialects(context)
  raw = os.path.join(tmp, "raw.ttir")
  with open(raw, "w") as f:
    f.write(ttir)
  module = ir.parse_mlir_module(raw, context)
  module.context = context  # what `triton.compile` sets before its stages
  return str(backend.make_ttir(module, {}, backend.parse_options(options), target.arch))


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_ttir(ttir: str, num_warps: int, num_stages: int,
                 dump_to: str | None = None) -> CompileResult:
  """Triton 3.x for sm_90a: ttir -> ttgir -> llir -> ptx -> cubin, with ptxas -v's figures.

  Each call compiles from scratch (a fresh Triton cache directory), so the time is a real
  compile and ptxas always runs (its log is where the register and spill figures come from).
  `dump_to`: a path prefix; writes `<prefix>.ttgir`, `.ptx`, `.cubin` and, with the nvdisasm
  that the Triton wheel ships beside ptxas, `.sass` (where a spill's STL / LDL sit: before a
  loop or in it).
  """
  triton = import_triton()
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  target = GPUTarget("cuda", 90, 32)
  options = dict(num_warps=num_warps, num_stages=num_stages)
  with tempfile.TemporaryDirectory(prefix="triton_offline_") as tmp:
    path = os.path.join(tmp, "kernel.ttir")
    log = io.StringIO()
    with _env(TRITON_CACHE_DIR=os.path.join(tmp, "cache"), TRITON_DUMP_PTXAS_LOG="1"), \
        contextlib.redirect_stdout(log):
      start = time.perf_counter()
      with open(path, "w") as f:
        f.write(_ttir_passes(ttir, tmp, target, options))
      kernel = triton.compile(path, target=target, options=options)
      seconds = time.perf_counter() - start
  if dump_to:
    _dump(kernel, dump_to)
  text = log.getvalue()
  regs, spills = _PTXAS_REGS.findall(text), _PTXAS_SPILLS.findall(text)
  if len(regs) != 1 or len(spills) != 1:
    raise RuntimeError(f"expected one function in the ptxas -v log (TRITON_DUMP_PTXAS_LOG), "
                       f"got {len(regs)} register and {len(spills)} spill lines:\n{text}")
  return CompileResult(registers=int(regs[0]), spill_stores=int(spills[0][0]),
                       spill_loads=int(spills[0][1]), shared_bytes=int(kernel.metadata.shared),
                       seconds=seconds)


_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
_SASS_LOCAL = re.compile(r"\b(?:STL|LDL)(?:\.[A-Z0-9.]+)?\s")


def local_memory_ops_in_loops(sass: str) -> int:
  """Spill stores / loads (`STL`, `LDL`) inside loops of an nvdisasm listing (`compile_ttir`'s
  `.sass`): the instructions between a label and a later branch back to it. ptxas's spill
  bytes count every spill once; this tells the ones a loop repeats from those before or after
  it, which run once."""
  lines = sass.splitlines()
  labels, count, counted = {}, 0, set()
  for i, line in enumerate(lines):
    if (label := _SASS_LABEL.match(line)):
      labels[label[1]] = i
    elif (branch := _SASS_BRANCH.search(line)) and branch[1] in labels:
      for j in range(labels[branch[1]], i):
        if j not in counted and _SASS_LOCAL.search(lines[j]):
          counted.add(j)
          count += 1
  return count


def _dump(kernel, prefix: str):
  """The compiled kernel's IRs and cubin (and SASS, when nvdisasm is found) under `prefix`."""
  for ext in ("ttgir", "ptx", "cubin"):
    text = kernel.asm[ext]
    with open(f"{prefix}.{ext}", "wb" if isinstance(text, bytes) else "w") as f:
      f.write(text)
  import triton.backends.nvidia  # pylint: disable=g-import-not-at-top
  nvdisasm = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "nvdisasm")
  if os.path.exists(nvdisasm):
    with open(f"{prefix}.sass", "w") as f:
      subprocess.run([nvdisasm, "-c", f"{prefix}.cubin"], stdout=f, check=True)


@contextlib.contextmanager
def _env(**values):
  """Sets environment variables for the block (Triton reads its knobs from the environment)."""
  saved = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
