"""Compile every GPU (Pallas Triton) kernel program for sm_90a offline: registers, spills, shared.

  pip install '.[gpu-check]'   # or PYTHONPATH=DIR holding triton 3.6 (see triton_offline.py)
  python tools/check_triton_compile.py                  # GLM-5 shapes, each kernel's defaults
  python tools/check_triton_compile.py --sweep          # plus the block options the docstrings name
  python tools/check_triton_compile.py --kernels=mla_backward --sweep --json=/tmp/out.json
  python tools/check_triton_compile.py --kernels=mla_backward --dump_dir=/tmp/k  # + ptx, SASS
                                        # and the spill instructions inside loops (SASS)

No GPU needed: jax lowers each kernel for CUDA, Triton 3.x compiles the Triton IR to a cubin
for sm_90a (H100 / H200) and ptxas -v reports its resources (`pallas_kernels/triton_offline.py`,
which also holds the one adapter to jax's private lowering). One row
per (kernel, options): registers per thread, spill stores / loads (bytes), shared memory,
whether one program fits an SM (shared <= 227 KiB and no spills) and the compile time. A
compile says nothing about speed or correctness (device suite, interpret-mode tests).

Kernel programs, bf16, at GLM-5 shapes (`Shapes`): the lightning indexer's fused top-k
(`indexer`: B 1, L = S = 4096, 32 index heads x 128, top-k 2048), sparse MLA's forward
(`mla_forward`: 64 heads, C 512, R 64, the same L, S, T), the same forward with the indexer
KL's head-mean probabilities from a second sweep (`mla_forward_probs`, what training runs for a
layer with an indexer, where the KL target does not come from the backward), its backward
(`mla_backward`), the backward that also writes the head-mean probabilities (`mla_backward_probs`,
what a GPU train step runs: `glm5_jax.attention.dsa_kl_fused`), and the split-k decode forward
(`mla_decode`: B 8, L 1 over 64K keys, split_k automatic).
The routed experts' grouped matmul (`pallas_kernels/grouped_matmul_triton.py`) at GLM-5's expert
shapes (`Shapes.moe`: 8 x 4096 tokens x top-8 rows, hidden D 6144, moe_intermediate F 2048, 256
experts; `--moe=3b`: configs/glm5_gpu_3b.py's 2 x 4096 x top-4, D 2048, F 512, 32 experts):
`gmm` (forward, x `[P, D]` @ w `[E, D, F]`), `gmm_dgrad` (the input gradient, dy `[P, D]` @
w_down^T, the transposed-weight form) and `tgmm` (weight gradient `[E, D, F]`).
"""

import dataclasses
import functools
import inspect
import itertools
import json
import os
import sys

from absl import app, flags
import jax
import jax.numpy as jnp

from pallas_kernels import grouped_matmul_triton, lightning_indexer_triton, sparse_mla_triton
from pallas_kernels import triton_offline

KERNELS = ("indexer", "mla_forward", "mla_forward_probs", "mla_backward", "mla_backward_probs",
           "mla_decode", "gmm", "gmm_dgrad", "tgmm")
MLA_BACKWARD_KERNELS = ("mla_backward", "mla_backward_probs")
GMM_KERNELS = ("gmm", "gmm_dgrad", "tgmm")
# (rows P, hidden D, expert intermediate F, experts E) of the routed experts' grouped matmul.
MOE_SHAPES = {"glm5": (8 * 4096 * 8, 6144, 2048, 256), "3b": (2 * 4096 * 4, 2048, 512, 32)}
_KERNELS = flags.DEFINE_list("kernels", list(KERNELS), f"Kernel programs, of {KERNELS}.")
_SWEEP = flags.DEFINE_bool("sweep", False, "Also compile the block options of `SWEEPS`.")
_MOE = flags.DEFINE_enum("moe", "glm5", list(MOE_SHAPES), "Expert shapes of the gmm kernels.")
_JSON = flags.DEFINE_string("json", None, "Write the rows as JSON to this path ('-': stdout).")
_DUMP_DIR = flags.DEFINE_string(
    "dump_dir", None, "Also write each program's ttgir, ptx, cubin and SASS (nvdisasm) here, "
    "named <kernel>[-<option>=<value>...].*")


@dataclasses.dataclass(frozen=True)
class Shapes:
  """GLM-5's DSA shapes (defaults); tests pass small ones."""
  length: int = 4096  # L = S for prefill / training
  heads: int = 64  # H
  latent: int = 512  # C
  rope: int = 64  # R
  index_heads: int = 32  # J
  index_dim: int = 128  # I
  topk: int = 2048  # T
  softmax_scale: float = 192 ** -0.5  # the model's (qk head dim 192); a constant in the kernel
  decode_batch: int = 8
  decode_keys: int = 65536
  moe: tuple = MOE_SHAPES["glm5"]  # (P, D, F, E) of the grouped matmul


def _defaults(fn, names):
  params = inspect.signature(fn).parameters
  return {n: params[n].default for n in names}


def default_options(kernel: str) -> dict:
  """The kernel's own defaults (its signature / options dataclass), for the tuned options."""
  if kernel == "indexer":
    return _defaults(lightning_indexer_triton.indexer_topk_triton,
                     ("block_q", "block_s", "chunk", "radix_bits", "num_warps", "num_stages"))
  if kernel in GMM_KERNELS:
    gmm = grouped_matmul_triton.GmmOptions()
    prefix = "tgmm_" if kernel == "tgmm" else ""
    return {prefix + n: getattr(gmm, prefix + n)
            for n in ("block_m", "block_k", "block_n", "num_warps", "num_stages")}
  mla = sparse_mla_triton.TritonMLAOptions()
  if kernel in MLA_BACKWARD_KERNELS:
    return {n: getattr(mla, n) for n in ("backward_head_block", "backward_block_t",
                                         "backward_c_chunk", "backward_dkv_chunk",
                                         "backward_num_warps", "backward_num_stages")}
  return {n: getattr(mla, n) for n in ("block_t", "num_warps", "num_stages")}


def _grid(**axes):
  return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


# Option sets of --sweep, as changes to the defaults: the alternatives each kernel's docstring
# names (indexer: one option at a time, as its docstring compares them; sparse MLA: the block_t
# x num_stages grid TritonMLAOptions asks for, and 4 or 16 warps: the [64, 512] fp32
# accumulator is 128 registers a thread at 8 warps, 64 at 16).
SWEEPS = {
    "indexer": [dict(block_q=16), dict(block_s=64), dict(chunk=128), dict(radix_bits=1),
                dict(radix_bits=4), dict(num_warps=4), dict(num_stages=3)],
    "mla_forward": (_grid(block_t=(16, 32, 64), num_stages=(1, 2, 3))
                    + _grid(block_t=(16, 32), num_warps=(4, 16))),
    "mla_backward": (_grid(backward_block_t=(16, 32, 64), backward_c_chunk=(64, 128, 256))
                     + [dict(backward_dkv_chunk=128)]
                     + _grid(backward_block_t=(16, 32), backward_num_warps=(16,))
                     + [dict(backward_num_stages=2)]
                     + _grid(backward_head_block=(32,), backward_block_t=(16, 32))),
    "mla_backward_probs": [dict(backward_block_t=16), dict(backward_dkv_chunk=128),
                           dict(backward_head_block=32)],
    "mla_forward_probs": _grid(block_t=(16, 64), num_stages=(1, 2)),
    "mla_decode": (_grid(block_t=(16, 32, 64), num_stages=(1, 2, 3))
                   + _grid(block_t=(16, 32), num_warps=(16,))),
    # A smaller row tile wastes less at group boundaries; wider N / deeper K tiles reuse more.
    "gmm": [dict(block_m=64), dict(block_n=256), dict(block_k=128), dict(num_stages=4),
            dict(num_warps=4)],
    "gmm_dgrad": [dict(block_m=64), dict(block_k=128), dict(num_warps=4)],
    "tgmm": [dict(tgmm_block_m=128), dict(tgmm_block_k=256), dict(tgmm_num_stages=4),
             dict(tgmm_num_warps=4)],
}


def _launch(kernel: str, options: dict) -> tuple[int, int]:
  """(num_warps, num_stages) of the compile, from the kernel's options."""
  prefix = {"mla_backward": "backward_", "mla_backward_probs": "backward_",
            "tgmm": "tgmm_"}.get(kernel, "")
  return options[prefix + "num_warps"], options[prefix + "num_stages"]


def _program(kernel: str, shapes: Shapes, options: dict):
  """(function, abstract args, pallas_call name, shape summary) of one kernel program."""
  sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
  s = shapes
  if kernel in GMM_KERNELS:
    p, d, f, e = s.moe
    opts = grouped_matmul_triton.GmmOptions(**options)
    sizes = sds((e,), i32)
    summary = f"P{p} D{d} F{f} E{e}"
    if kernel == "gmm":  # the gate / up projection: [P, D] x [E, D, F]
      fn = lambda x, w, n: grouped_matmul_triton.gmm(x, w, n, False, opts)
      return fn, (sds((p, d), bf16), sds((e, d, f), bf16), sizes), \
          "grouped_matmul_triton_gmm", summary
    if kernel == "gmm_dgrad":  # the down projection's input gradient: [P, D] x [E, F, D]^T
      fn = lambda dy, w, n: grouped_matmul_triton.gmm(dy, w, n, True, opts)
      return fn, (sds((p, d), bf16), sds((e, f, d), bf16), sizes), \
          "grouped_matmul_triton_gmm", summary
    fn = lambda x, dy, n: grouped_matmul_triton.tgmm(x, dy, n, opts)  # dW of gate / up
    return fn, (sds((p, d), bf16), sds((p, f), bf16), sizes), \
        "grouped_matmul_triton_tgmm", summary
  if kernel == "indexer":
    b, l = 1, s.length
    args = (sds((b, l, s.index_heads, s.index_dim), bf16), sds((b, l, s.index_dim), bf16),
            sds((b, l, s.index_heads), jnp.float32), sds((b, l), i32), sds((b, l), i32),
            sds((b, l), i32))
    fn = functools.partial(lightning_indexer_triton.indexer_topk_triton, topk=s.topk,
                           scale=s.index_dim ** -0.5, **options)
    return fn, args, "lightning_indexer_topk", (
        f"B1 L=S={l} J{s.index_heads} I{s.index_dim} T{s.topk}")
  b, l, keys = (s.decode_batch, 1, s.decode_keys) if kernel == "mla_decode" else (
      1, s.length, s.length)
  mla = functools.partial(sparse_mla_triton.sparse_mla_triton,
                          scale=s.softmax_scale, **options)
  args = (sds((b, l, s.heads, s.latent), bf16), sds((b, l, s.heads, s.rope), bf16),
          sds((b, keys, s.latent), bf16), sds((b, keys, s.rope), bf16),
          sds((b, l, s.topk), i32))
  summary = f"B{b} L{l} S{keys} H{s.heads} C{s.latent} R{s.rope} T{s.topk}"
  if kernel == "mla_forward_probs":
    probs = functools.partial(sparse_mla_triton.sparse_mla_triton_with_head_probs,
                              scale=s.softmax_scale, **options)
    return probs, args, "sparse_mla_triton_forward_head_probs", summary
  if kernel == "mla_backward_probs":  # the backward that also writes the KL target
    parts = sparse_mla_triton.sparse_mla_triton_parts(**options)
    per_head = lambda dtype, *last: sds((b, l, s.heads) + last, dtype)
    backward = lambda *x: parts.backward(*x, s.softmax_scale)
    return backward, args + (per_head(bf16, s.latent), per_head(jnp.float32),
                             per_head(bf16, s.latent), per_head(jnp.float32)), \
        "sparse_mla_triton_backward_head_probs", summary
  if kernel != "mla_backward":
    return mla, args, "sparse_mla_triton_forward", summary
  fn, args = triton_offline.backward_program(lambda *x: mla(*x[:4], x[4]), *args)
  return fn, args, "sparse_mla_triton_backward", summary


def compile_kernel(kernel: str, shapes: Shapes = Shapes(), changes: dict | None = None,
                   dump_dir: str | None = None) -> dict:
  """Lowers and compiles one kernel program; returns its table row (a dict). `dump_dir`: also
  write its compiled forms there (`triton_offline.compile_ttir`'s `dump_to`)."""
  options = {**default_options(kernel), **(changes or {})}
  fn, args, name, summary = _program(kernel, shapes, options)
  captured = triton_offline.capture_ttir(fn, *args)
  if captured.name != name:
    raise RuntimeError(f"{kernel}: expected the pallas_call {name!r} first in the lowering, "
                       f"got {captured.name!r}")
  num_warps, num_stages = _launch(kernel, options)
  dump_to = None
  if dump_dir:
    os.makedirs(dump_dir, exist_ok=True)
    dump_to = os.path.join(dump_dir, "-".join([kernel] + [f"{k}={v}" for k, v in
                                                         sorted((changes or {}).items())]))
  result = triton_offline.compile_ttir(captured.ttir, num_warps, num_stages, dump_to)
  row = dict(kernel=kernel, shapes=summary, options=options, changed=changes or {},
             registers=result.registers, spill_stores=result.spill_stores,
             spill_loads=result.spill_loads, shared_bytes=result.shared_bytes,
             fits=result.fits, compile_s=round(result.seconds, 1))
  if dump_to and os.path.exists(dump_to + ".sass"):  # spill instructions a loop repeats
    with open(dump_to + ".sass") as f:
      row["loop_spill_ops"] = triton_offline.local_memory_ops_in_loops(f.read())
  return row


def _options_text(row):
  text = ", ".join(f"{k}={v}" for k, v in row["options"].items())
  return text + (" (default)" if not row["changed"] else "")


def table(rows) -> str:
  lines = ["| kernel | options | registers/thread | spill stores / loads (B) | shared (KiB) "
           "| fits | compile (s) |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['kernel']} | {_options_text(r)} | {r['registers']} | "
                 f"{r['spill_stores']} / {r['spill_loads']} | {r['shared_bytes'] / 1024:g} | "
                 f"{'yes' if r['fits'] else 'NO'} | {r['compile_s']} |")
  return "\n".join(lines)


def main(argv):
  del argv
  unknown = set(_KERNELS.value) - set(KERNELS)
  if unknown:
    raise app.UsageError(f"--kernels: unknown {sorted(unknown)}; expected some of {KERNELS}")
  try:
    triton = triton_offline.import_triton()
  except ImportError as e:
    sys.exit(f"check_triton_compile: {e}")
  shapes = Shapes(moe=MOE_SHAPES[_MOE.value])
  print(f"jax {jax.__version__}, triton {triton.__version__}, target sm_90a (no GPU run); "
        f"shapes {shapes}", flush=True)
  rows = []
  for kernel in _KERNELS.value:
    for changes in [{}] + (SWEEPS[kernel] if _SWEEP.value else []):
      if changes and {**default_options(kernel), **changes} == default_options(kernel):
        continue  # a sweep point equal to the defaults
      print(f"compiling {kernel} {changes or 'defaults'} ...", flush=True)
      rows.append(compile_kernel(kernel, shapes, changes=changes, dump_dir=_DUMP_DIR.value))
      r = rows[-1]
      in_loops = (f", {r['loop_spill_ops']} spill instructions in loops"
                  if "loop_spill_ops" in r else "")
      print(f"  {r['registers']} registers, spills {r['spill_stores']}/{r['spill_loads']} B"
            f"{in_loops}, shared {r['shared_bytes']} B, {r['compile_s']} s", flush=True)
  print("\nshapes: " + "; ".join(sorted({f"{r['kernel']}: {r['shapes']}" for r in rows})))
  print(table(rows))
  if _JSON.value:
    text = json.dumps(rows, indent=1)
    if _JSON.value == "-":
      sys.stdout.write(text + "\n")
    else:
      with open(_JSON.value, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
