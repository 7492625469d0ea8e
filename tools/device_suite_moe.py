"""`tools/device_suite.py` section `moe_matmul`: the routed experts' grouped matmul, A/B.

One routed-expert MLP forward + backward at the 3B config's shapes (`configs/glm5_gpu_3b.py`:
P = 8 x 4,096 tokens x 4 experts = 131,072 rows, D 2,048, F 512, E 32; `--smoke`: tiny),
bf16, rows sorted by expert with uneven group sizes (a fixed skewed routing draw):

  h = silu(gmm(x, w_gate)) * gmm(x, w_up);  y = gmm(h, w_down);  grads of <y, dy> in x and w

Useful FLOPs: 3 products of 2 P D F forward, twice that backward = 18 P D F. Variants:

  ragged_dot              `jax.lax.ragged_dot` at default flags (XLA GPU: a dense masked dot
                          over all E groups, `RaggedDotRewriter`)
  ragged_dot +cudnn_fusion  the same compiled with `xla_gpu_experimental_use_ragged_dot_fusion`
                          (XLA keeps a `ragged-dot` for cuDNN >= 9.22 only)
  ragged_dot +pallas_lowering  lowered with `jax_ragged_dot_use_gpu_pallas_triton_lowering` (a
                          jax option; "missing" where this jax has none)
  grouped_matmul:<impl>   every `glm5_jax.grouped_matmul.IMPLS` entry but "ragged_dot" and, off
                          TPU, "megablox" (a GPU grouped matmul there is timed as it lands)
  tokamax:<impl>          `tokamax.ragged_dot(..., implementation=)` "mosaic" / "triton" when
                          tokamax is installed ("missing" otherwise)
  dense bound             the same MLP as plain `[P, D] x [D, F]` GEMMs (one expert's weights for
                          every row): the useful FLOPs at dense-GEMM speed, the bound

Per variant: median ms, TFLOP/s on the useful FLOPs, % of peak, the largest difference from the
default's outputs and gradients (relative to their max), and what the compiled program holds
(`hlo`: counts of `ragged-dot`s, dots, custom-call targets and fusion kinds; `expanded`: a dot
with an `[E, P, ...]` operand, i.e. the dense masked expansion), so a flag that did not engage
shows as the default's program.
"""

import collections
import inspect
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from tools.timing import median_seconds

GLM5_3B = dict(rows=8 * 4096 * 4, hidden=2048, ffn=512, experts=32)
SMOKE = dict(rows=64, hidden=32, ffn=16, experts=4)
_CUDNN_FUSION = {"xla_gpu_experimental_use_ragged_dot_fusion": True}
_PALLAS_OPTION = "jax_ragged_dot_use_gpu_pallas_triton_lowering"


def group_sizes(rows: int, experts: int, seed: int = 0) -> np.ndarray:
  """Rows per expert from a skewed routing draw (Dirichlet 0.5 expert popularity), summing to
  `rows`: uneven, as a router's loads are."""
  rng = np.random.default_rng(seed)
  return rng.multinomial(rows, rng.dirichlet(np.full(experts, 0.5))).astype(np.int32)


def inputs(shape: dict, seed: int = 0):
  """`(x, w_gate, w_up, w_down, dy, sizes)`, bf16 (sizes int32)."""
  p, d, f, e = shape["rows"], shape["hidden"], shape["ffn"], shape["experts"]
  keys = jax.random.split(jax.random.key(seed), 5)
  normal = lambda k, s, scale: (scale * jax.random.normal(k, s)).astype(jnp.bfloat16)
  return (normal(keys[0], (p, d), 1.0), normal(keys[1], (e, d, f), d ** -0.5),
          normal(keys[2], (e, d, f), d ** -0.5), normal(keys[3], (e, f, d), f ** -0.5),
          normal(keys[4], (p, d), 1.0), jnp.asarray(group_sizes(p, e, seed)))


def mlp_fwd_bwd(gmm):
  """`(x, wg, wu, wd, dy, sizes) -> (y, dx, dwg, dwu, dwd)` of the expert MLP on `gmm(x, w,
  sizes)`."""
  def mlp(x, wg, wu, wd, sizes):
    return gmm(jax.nn.silu(gmm(x, wg, sizes)) * gmm(x, wu, sizes), wd, sizes)

  def run(x, wg, wu, wd, dy, sizes):
    y, pullback = jax.vjp(lambda *a: mlp(*a, sizes), x, wg, wu, wd)
    return (y,) + pullback(dy)
  return run


def dense_fwd_bwd(x, wg, wu, wd, dy, sizes):
  """The bound: the MLP as dense GEMMs with expert 0's weights for every row (same FLOPs)."""
  del sizes
  mm = lambda a, w, s: a @ w[0]
  return mlp_fwd_bwd(mm)(x, wg, wu, wd, dy, None)


def hlo_summary(text: str, shape: dict) -> dict:
  """Counts of what the compiled program runs, and whether a dot has an `[E, P, ...]`
  operand (the dense masked expansion)."""
  counts = collections.Counter()
  counts["ragged-dot"] = len(re.findall(r" ragged-dot\(", text))
  counts["dot"] = len(re.findall(r" dot\(", text))
  for target in re.findall(r'custom_call_target="([^"]+)"', text):
    counts[f"custom-call {target}"] += 1
  for kind in re.findall(r'"kind":"(__[a-z_]+)"', text):
    counts[f"fusion {kind}"] += 1
  expanded = f"[{shape['experts']},{shape['rows']}," in text.replace(" ", "")
  return dict(hlo=", ".join(f"{k} x{v}" for k, v in counts.most_common(8) if v),
              expanded=expanded)


def _grouped_impls():
  """`glm5_jax.grouped_matmul.IMPLS` other than the default ragged_dot (and megablox off TPU),
  read when the section runs: the GPU grouped matmul lands on another branch."""
  try:
    from glm5_jax import grouped_matmul
  except ImportError:
    return None, ()
  impls = [i for i in getattr(grouped_matmul, "IMPLS", ()) if i != "ragged_dot"
           and (i != "megablox" or jax.default_backend() == "tpu")]
  return grouped_matmul, tuple(impls)


def variants(smoke: bool) -> list:
  """`[(name, fn or None if missing, compiler_options, jax option or None)]`."""
  ragged = mlp_fwd_bwd(jax.lax.ragged_dot)
  out = [("ragged_dot", ragged, None, None),
         ("ragged_dot +cudnn_fusion", ragged, _CUDNN_FUSION, None),
         ("ragged_dot +pallas_lowering", ragged if hasattr(jax.config, _PALLAS_OPTION) else None,
          None, _PALLAS_OPTION)]
  module, impls = _grouped_impls()
  for impl in impls:
    options = {"impl": impl}
    if smoke and "interpret" in inspect.signature(module.grouped_matmul).parameters:
      options["interpret"] = True
    gmm = lambda x, w, s, options=options: module.grouped_matmul(x, w, s, **options)
    out.append((f"grouped_matmul:{impl}", mlp_fwd_bwd(gmm), None, None))
  try:
    import tokamax  # optional: an extra the device image may carry
  except ImportError:
    tokamax = None
  for impl in ("mosaic", "triton"):
    gmm = None if tokamax is None else (
        lambda x, w, s, impl=impl: tokamax.ragged_dot(x, w, s, implementation=impl))
    out.append((f"tokamax:{impl}", gmm and mlp_fwd_bwd(gmm), None, None))
  out.append(("dense bound", dense_fwd_bwd, None, None))
  return out


def _compile(fn, args, compiler_options, jax_option):
  """`jit(fn)` compiled for `args`, lowered with the jax option `jax_option` on (if any) and
  compiled with XLA `compiler_options` (if any)."""
  if jax_option:
    before = getattr(jax.config, jax_option)
    jax.config.update(jax_option, True)
    try:
      lowered = jax.jit(fn).lower(*args)
    finally:
      jax.config.update(jax_option, before)
  else:
    lowered = jax.jit(fn).lower(*args)
  return lowered.compile(compiler_options=compiler_options)


def _max_rel_diff(got, want) -> float:
  return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
                   / max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))), 1e-30))
             for g, w in zip(got, want))


def moe_section(ctx) -> dict:
  """The A/B rows (module docstring)."""
  shape = SMOKE if ctx.smoke else GLM5_3B
  args = inputs(shape, ctx.seed)
  useful = 18.0 * shape["rows"] * shape["hidden"] * shape["ffn"]
  reference = {}
  rows = []
  for name, fn, compiler_options, jax_option in variants(ctx.smoke):
    def measure(fn=fn, compiler_options=compiler_options, jax_option=jax_option, name=name):
      if fn is None:
        raise _Missing("not installed")
      start = time.perf_counter()
      compiled = _compile(fn, args, compiler_options, jax_option)
      compile_s = time.perf_counter() - start
      out = jax.block_until_ready(compiled(*args))
      if name == "ragged_dot":
        reference["out"] = out
      row = dict(variant=name, compile_s=compile_s,
                 median_s=median_seconds(compiled, args, ctx.repeats),
                 repeats=ctx.repeats, **hlo_summary(compiled.as_text(), shape))
      if name != "dense bound" and "out" in reference:
        row["max_rel_diff"] = _max_rel_diff(out, reference["out"])
      return ctx.rate(row, useful)

    rows.append(_missing_as_row(ctx.case(name, measure), name))
  return dict(rows=rows, shape=shape, useful_tflop=useful / 1e12,
              group_sizes=[int(s) for s in args[-1]][:64])


class _Missing(Exception):
  """A variant this install cannot run (no tokamax, no jax option)."""


def _missing_as_row(row: dict, name: str) -> dict:
  if row["status"] == "error" and row["error"].startswith("_Missing"):
    return dict(case=name, status="missing", error="not in this install")
  return row
