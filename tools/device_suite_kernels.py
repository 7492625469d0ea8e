"""`tools/device_suite.py` sections (a) to (c): the GPU DSA kernels against their references,
their speed, and DSA against cuDNN dense attention.

Shapes (`Dims`): GLM-5's (docs/reference.md section 1): H 64 heads, latent C 512 + RoPE R 64
(sparse MLA, absorbed form, scale K^-0.5 = 1/16 with K = 256), indexer J 32 heads x I 128
(scale I^-0.5), top-k T 2048; dense attention has per-head K = V = 256 (192 + 64, and V 256).
One sequence (B 1), one document, bf16 inputs. `--smoke` shrinks every dim (`SMOKE_DIMS`).

Inputs: random normal, bf16. The sparse MLA's selection (`causal_selection`) is T distinct keys
of each query's causal prefix spread over all of it (every key while the prefix is <= T), at a
random rotation per query, so the gathers are scattered as an indexer's would be.

Correctness rules (module constants, printed in the report):
  sparse MLA   vs `sparse_mla_xla` (the XLA gather path, itself checked against the dense
               reference on CPU: the dense reference does not fit at 64K): forward output,
               lse and the gradients of q, q_rope, kv, k_rope for a random output cotangent;
               relative error max|got - want| / max|want| <= MLA_RTOL (bf16 inputs, fp32
               accumulation in both, different summation orders and atomics).
  indexer      vs `indexer_topk_xla` (exact scores from the same bf16 inputs, the project's
               tie rule): recall = |kernel selection & reference selection| / |reference
               selection| averaged over queries >= RECALL_MIN, and every key the kernel picked
               that the reference did not has a reference score >= the reference's k-th score
               - SCORE_ATOL x (1 + |k-th score|) (threshold rule: only near-ties may differ,
               since fp32 sums in another order can swap them). Exact equality is reported too.

Speed: each jitted function runs once to compile (compile_s), once more as a warm-up, then
`repeats` times, each ended by `block_until_ready`; the median is reported. FLOPs count only
useful work (valid, causal slots):
  sparse MLA forward   2 (C + R) + 2 C  = 2176 per (query, head, valid slot)
  sparse MLA backward  2 (C + R) x 3 + 2 C x 2 = 5504 (recomputed logits, dp, dq, dkv)
  (the same for the train step's path, "fwd+bwd+kl_target": forward, then the backward that
  also writes the indexer KL's head-mean target; the head sums are no matmul)
  indexer              2 J I per (query, visible key), causal: L (L + 1) / 2 keys
  dense attention      forward 4 K per (query, head, visible key) (K = V); backward 2.5x
"""

import dataclasses
import functools
import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.accelerators import accelerator_of
import pallas_kernels as pk
from pallas_kernels.blocking import empty_out_of_range
from tools.timing import median_seconds

MLA_RTOL = 2e-2
RECALL_MIN = 0.99
SCORE_ATOL = 1e-2
# op -> the module of its GPU kernel
GPU_MODULES = {"indexer_topk": "pallas_kernels.lightning_indexer_triton",
               "sparse_mla": "pallas_kernels.sparse_mla_triton"}


@dataclasses.dataclass(frozen=True)
class Dims:
  heads: int = 64
  latent: int = 512
  rope: int = 64
  index_heads: int = 32
  index_dim: int = 128
  topk: int = 2048
  dense_head_dim: int = 256  # K = V of the expanded (dense) attention


GLM5_DIMS = Dims()
SMOKE_DIMS = Dims(heads=16, latent=64, rope=16, index_heads=4, index_dim=32, topk=16,
                  dense_head_dim=32)


class Missing(Exception):
  """A GPU kernel module is not in this build (recorded as status "missing")."""


def present_kernels() -> set:
  """The ops (`GPU_MODULES` keys) whose GPU kernel module is in this build."""
  return {op for op, module in GPU_MODULES.items() if importlib.util.find_spec(module)}


def require_gpu_kernels(smoke: bool, ops=tuple(GPU_MODULES)) -> bool:
  """True: run the GPU kernels in interpret mode (smoke, off GPU). Raises `Missing` when none
  of `ops` has its module, RuntimeError off GPU without --smoke."""
  if not present_kernels() & set(ops):
    raise Missing(f"not in this build: {[GPU_MODULES[op] for op in ops]}")
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not smoke:
    raise RuntimeError("the GPU kernels need a GPU; --smoke runs them in interpret mode")
  return not on_gpu


def missing_row(name: str, op: str) -> dict:
  return dict(case=name, status="missing", error=f"not in this build: {GPU_MODULES[op]}")


@functools.lru_cache(maxsize=None)
def gpu_ops(interpret: bool) -> pk.DSAOps:
  """The GPU kernels (one object per mode, so the jitted functions below hit their caches)."""
  return pk.dsa_ops("pallas", platform="gpu", interpret=interpret)


@functools.lru_cache(maxsize=None)
def mla_parts(interpret: bool):
  """The GPU sparse MLA kernels as `SparseMLAParts` (one object per mode: jit cache hits)."""
  return gpu_ops(interpret).sparse_mla_parts()


def timed(fn, args, repeats: int) -> dict:
  """Compile time, then the median of `repeats` warm calls (seconds)."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - start
  jax.block_until_ready(fn(*args))
  return dict(compile_s=compile_s, median_s=median_seconds(fn, args, repeats), repeats=repeats)


# ---- inputs ----------------------------------------------------------------------------------


def causal_selection(length: int, topk: int, seed: int = 0):
  """`[1, L, T]` int32: query l's T distinct keys of [0, l] spread over the prefix (slot t ->
  floor(t (l + 1) / T)), rotated by a random offset mod l + 1; every key 0..l and -1 after
  when l + 1 <= T."""
  l_L1 = jnp.arange(length, dtype=jnp.int32)[:, None]
  t_1T = jnp.arange(topk, dtype=jnp.int32)[None, :]
  prefix = l_L1 + 1
  spread = t_1T * prefix // topk  # < 2^31 for T <= 2048, L <= 1M
  rotation = jax.random.randint(jax.random.key(seed), (length, 1), 0, 1 << 30) % prefix
  keys = jnp.where(prefix > topk, (spread + rotation) % prefix, jnp.where(t_1T < prefix, t_1T, -1))
  return keys[None].astype(jnp.int32)


def valid_slots(length: int, topk: int) -> int:
  """Useful (query, slot) pairs of `causal_selection`: sum over l of min(l + 1, T)."""
  full = max(length - topk, 0)
  return full * topk + min(length, topk) * (min(length, topk) + 1) // 2


def mla_inputs(length: int, d: Dims, seed: int = 0):
  keys = jax.random.split(jax.random.key(seed), 5)
  bf16 = jnp.bfloat16
  shapes = ((1, length, d.heads, d.latent), (1, length, d.heads, d.rope), (1, length, d.latent),
            (1, length, d.rope), (1, length, d.heads, d.latent))
  q, q_rope, kv, k_rope, cotangent = (jax.random.normal(k, s, bf16) for k, s in zip(keys, shapes))
  return (q, q_rope, kv, k_rope, causal_selection(length, d.topk, seed)), cotangent


def indexer_inputs(length: int, d: Dims, seed: int = 0):
  keys = jax.random.split(jax.random.key(seed + 1), 3)
  q = jax.random.normal(keys[0], (1, length, d.index_heads, d.index_dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, length, d.index_dim), jnp.bfloat16)
  w = jax.random.normal(keys[2], (1, length, d.index_heads), jnp.float32) * d.index_heads ** -0.5
  pos = jnp.arange(length, dtype=jnp.int32)[None]
  seg = jnp.ones((1, length), jnp.int32)
  return q, k, w, pos, seg, seg


# ---- the ops as jitted functions (module level: sections (a) to (c) share compilations) -------


def mla_scale(d: Dims) -> float:
  """The model's softmax scale K^-0.5 (K = N + R = 256 in GLM-5, the dense head dim here)."""
  return d.dense_head_dim ** -0.5


@functools.partial(jax.jit, static_argnames=("op", "scale"))
def mla_forward(q, q_rope, kv, k_rope, topk, *, op, scale):
  return op(q, q_rope, kv, k_rope, topk, scale=scale)


def _mla_forward_backward(q, q_rope, kv, k_rope, topk, cotangent, *, op, scale):
  """Output, lse and the gradients of q, q_rope, kv, k_rope for `<out, cotangent>`."""
  def loss(*arrays):
    out, lse = op(*arrays, topk, scale=scale)
    return jnp.vdot(out.astype(jnp.float32), cotangent.astype(jnp.float32)), (out, lse)
  grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, q_rope, kv, k_rope)
  return out, lse, grads


mla_forward_backward = jax.jit(_mla_forward_backward, static_argnames=("op", "scale"))


@functools.partial(jax.jit, static_argnames=("parts", "scale"))
def mla_forward_backward_kl_target(q, q_rope, kv, k_rope, topk, cotangent, *, parts, scale):
  """What a GPU train step runs for a layer with an indexer (`glm5_jax.attention.dsa_kl_fused`):
  the forward kernel (no target sweep), then the backward kernel that also writes the indexer
  KL's target, the head-mean probabilities (`mla_backward_probs` of
  tools/check_triton_compile.py), for the output cotangent: out, lse, grads, probs."""
  topk = empty_out_of_range(topk, kv.shape[1])  # the parts take indices as checked
  out, lse = parts.forward(q, q_rope, kv, k_rope, topk, scale)
  *grads, probs = parts.backward(q, q_rope, kv, k_rope, topk, out, lse, cotangent,
                                 jnp.zeros_like(lse), scale)
  return out, lse, grads, probs


@functools.partial(jax.jit, static_argnames=("op", "topk", "scale"))
def indexer_topk(q, k, w, pos, q_seg, k_seg, *, op, topk, scale):
  return op(q, k, w, pos, q_seg, k_seg, topk=topk, scale=scale)


@jax.jit
def _relative_error(got, want):
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  finite = jnp.isfinite(want)  # lse is -inf for a query with no valid slot (none here)
  diff = jnp.where(finite, jnp.abs(got - want), 0.0)
  return diff.max() / jnp.maximum(jnp.where(finite, jnp.abs(want), 0.0).max(), 1e-30)


def relative_error(got, want) -> float:
  """max|got - want| / max|want| over finite reference values, computed on the device."""
  return float(_relative_error(got, want))


def mla_flops(d: Dims, backward: bool) -> int:
  """Per (query, head, valid slot): forward logits over C + R and the output over C;
  backward recomputed logits, dp, dq (C + R each way) and dkv (C and C + R)."""
  c, r = d.latent, d.rope
  return 6 * (c + r) + 4 * c if backward else 2 * (c + r) + 2 * c


def topk_agreement(got_LT, want_LT, want_scores_LT, scores_LS) -> dict:
  """Recall and the threshold rule of the module docstring (numpy, one sequence)."""
  recalls, worst_margin = [], np.inf
  for l in range(want_LT.shape[0]):
    want = set(want_LT[l][want_LT[l] >= 0].tolist())
    got = set(got_LT[l][got_LT[l] >= 0].tolist())
    if not want:
      continue
    recalls.append(len(got & want) / len(want))
    kth = float(want_scores_LT[l][want_LT[l] >= 0].min())
    for key in got - want:
      worst_margin = min(worst_margin, (float(scores_LS[l, key]) - kth)
                         + SCORE_ATOL * (1 + abs(kth)))
  recall = float(np.mean(recalls)) if recalls else 1.0
  return dict(recall=recall, threshold_ok=bool(worst_margin >= 0),
              ok=bool(recall >= RECALL_MIN and worst_margin >= 0))


# ---- block options ----------------------------------------------------------------------


def _grad_errors(got, want) -> dict:
  (out, _, grads), (out0, _, grads0) = got, want
  names = ("dq", "dq_rope", "dkv", "dk_rope")
  errors = {"out": relative_error(out, out0)}
  errors.update({n: relative_error(g, g0) for n, g, g0 in zip(names, grads, grads0)})
  return {k: round(v, 6) for k, v in errors.items()}


def tune_sparse_mla(length: int, dims: Dims, grid, *, repeats: int, budget_s: float,
                    interpret: bool = False) -> list[dict]:
  """tools/tune_sparse_mla.py's rows: one per option dict of `grid` (`sparse_mla_triton` block
  options; the first must be `{}`, the defaults: every row's errors are against its results),
  forward and forward + backward timed; prints each row as it is done."""
  if not grid or grid[0] != {}:
    raise ValueError(f"grid: the first option set must be {{}} (the defaults), got {grid[:1]}")
  from pallas_kernels.sparse_mla_triton import sparse_mla_triton  # absent from some builds
  args, cotangent = mla_inputs(length, dims)
  scale = mla_scale(dims)
  chip = accelerator_of(jax.devices()[0].device_kind)
  slots = valid_slots(length, dims.topk) * dims.heads
  flops = {b: slots * mla_flops(dims, b) for b in (False, True)}
  rows, reference, end = [], None, time.perf_counter() + budget_s
  for options in grid:
    row = dict(options=options)
    if time.perf_counter() > end:
      rows.append(dict(row, status="skipped (budget)"))
      print(f"  {options}: skipped (budget)", flush=True)
      continue
    # A fresh function per option set: the options are static, so each compiles its own 
    op = lambda *a, scale, o=tuple(sorted(options.items())): sparse_mla_triton(
        *a, scale=scale, interpret=interpret, **dict(o))
    try:
      fwd = timed(lambda *a: mla_forward(*a, op=op, scale=scale), args, repeats)
      both = timed(
          lambda *a: mla_forward_backward(*a, cotangent, op=op, scale=scale), args,
          repeats)
      result = jax.device_get(mla_forward_backward(*args, cotangent, op=op, scale=scale))
      reference = reference if reference is not None else result
      backward_s = both["median_s"] - fwd["median_s"]
      row.update(status="ok", compile_s=round(fwd["compile_s"] + both["compile_s"], 2),
                 forward_ms=1e3 * fwd["median_s"], fwd_bwd_ms=1e3 * both["median_s"],
                 backward_ms=1e3 * backward_s,
                 forward_tflops=flops[False] / fwd["median_s"] / 1e12,
                 backward_tflops=flops[True] / backward_s / 1e12 if backward_s > 0 else None,
                 **_grad_errors(result, reference))
      if chip:
        row["forward_peak_pct"] = 100 * flops[False] / fwd["median_s"] / chip.peak_flops
    except Exception as e:  # recorded: a launch over the shared-memory limit, say
      row.update(status="error", error=f"{type(e).__name__}: {e}"[:600])
    rows.append(row)
    shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()
             if k != "options"}
    print(f"  {options}: {shown}", flush=True)
  return rows


# ---- sections --------------------------------------------------------------------------------


def correctness_section(ctx) -> dict:
  """(a) each GPU kernel against its reference, forward and backward, per L."""
  interpret = require_gpu_kernels(ctx.smoke)
  d, ops, present = ctx.dims, gpu_ops(interpret), present_kernels()
  rows = []
  for length in ctx.seq_lens:
    for op, check in (("sparse_mla", _check_mla), ("indexer_topk", _check_indexer)):
      name = f"{op} L={length}"
      rows.append(ctx.case(name, lambda check=check, length=length: check(length, d, ops))
                  if op in present else missing_row(name, op))
  return dict(rows=rows, rules=dict(mla_rtol=MLA_RTOL, recall_min=RECALL_MIN,
                                    score_atol=SCORE_ATOL, interpret=interpret))


def _check_mla(length, d, ops):
  args, cotangent = mla_inputs(length, d)
  scale = mla_scale(d)
  got = mla_forward_backward(*args, cotangent, op=ops.sparse_mla, scale=scale)
  want = mla_forward_backward(*args, cotangent, op=pk.sparse_mla_xla, scale=scale)
  errors = {"out": relative_error(got[0], want[0]), "lse": relative_error(got[1], want[1])}
  for name, g, w in zip(("dq", "dq_rope", "dkv", "dk_rope"), got[2], want[2]):
    errors[name] = relative_error(g, w)
  return dict(op="sparse_mla", L=length, reference="sparse_mla_xla", **errors,
              ok=all(e <= MLA_RTOL for e in errors.values()))


def _check_indexer(length, d, ops, max_rows: int = 256):
  args = indexer_inputs(length, d)
  scale = d.index_dim ** -0.5
  got, _ = indexer_topk(*args, op=ops.indexer_topk, topk=d.topk, scale=scale)
  want, want_scores = indexer_topk(*args, op=pk.indexer_topk_xla, topk=d.topk, scale=scale)
  got, want, want_scores = (np.asarray(x[0]) for x in (got, want, want_scores))
  differ = np.nonzero((got != want).any(axis=-1))[0]
  checked = differ[:max_rows]  # dense reference scores only for (some of) the rows that differ
  q, k, w, pos, q_seg, k_seg = args
  scores = np.asarray(pk.indexer_scores_reference(
      q[:, checked], k, w[:, checked], pos[:, checked], q_seg[:, checked], k_seg,
      scale=scale)[0]) if len(checked) else np.zeros((0, length), np.float32)
  agreement = topk_agreement(got[checked], want[checked], want_scores[checked], scores)
  return dict(op="indexer_topk", L=length, reference="indexer_topk_xla",
              rows_differing=int(len(differ)), rows_checked=int(len(checked)), **agreement,
              exact_all_rows=bool(len(differ) == 0))


def timing_section(ctx) -> dict:
  """(b) each GPU kernel's median time, TFLOP/s and share of the chip's bf16 peak, per L."""
  interpret = require_gpu_kernels(ctx.smoke)
  d, ops, present = ctx.dims, gpu_ops(interpret), present_kernels()
  scale = mla_scale(d)
  rows = []
  for length in ctx.seq_lens:
    slots = valid_slots(length, d.topk) * d.heads
    def mla_cases(length=length, slots=slots):
      args, cotangent = mla_inputs(length, d)
      fwd = timed(functools.partial(mla_forward, op=ops.sparse_mla, scale=scale), args,
                  ctx.repeats)
      both = timed(functools.partial(mla_forward_backward, op=ops.sparse_mla, scale=scale),
                   args + (cotangent,), ctx.repeats)
      forward, backward = mla_flops(d, False), mla_flops(d, True)
      return [ctx.rate(dict(op="sparse_mla fwd", L=length, **fwd), slots * forward),
              ctx.rate(dict(op="sparse_mla fwd+bwd", L=length, **both),
                       slots * (forward + backward))]
    rows.extend(ctx.cases(f"sparse_mla L={length}", mla_cases) if "sparse_mla" in present
                else [missing_row(f"sparse_mla L={length}", "sparse_mla")])
    def kl_target_case(length=length, slots=slots):
      args, cotangent = mla_inputs(length, d)
      fn = functools.partial(mla_forward_backward_kl_target, parts=mla_parts(interpret),
                             scale=scale)
      # The head sums add no matmul: the same useful FLOPs as the plain forward + backward.
      return ctx.rate(dict(op="sparse_mla fwd+bwd+kl_target", L=length,
                           **timed(fn, args + (cotangent,), ctx.repeats)),
                      slots * (mla_flops(d, False) + mla_flops(d, True)))
    rows.append(ctx.case(f"sparse_mla L={length} kl_target", kl_target_case)
                if "sparse_mla" in present
                else missing_row(f"sparse_mla L={length} kl_target", "sparse_mla"))
    def indexer_case(length=length):
      args = indexer_inputs(length, d)
      fn = functools.partial(indexer_topk, op=ops.indexer_topk, topk=d.topk,
                             scale=d.index_dim ** -0.5)
      flops = 2 * d.index_heads * d.index_dim * length * (length + 1) // 2
      return ctx.rate(dict(op="indexer_topk", L=length, **timed(fn, args, ctx.repeats)), flops)
    rows.append(ctx.case(f"indexer_topk L={length}", indexer_case) if "indexer_topk" in present
                else missing_row(f"indexer_topk L={length}", "indexer_topk"))
  return dict(rows=rows, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("ops", "d", "scale", "index_scale"))
def dsa_forward_backward(index_args, mla_args, cotangent, *, ops, d, scale, index_scale):
  """Indexer + top-k (forward: top-k passes no gradient) and sparse MLA forward + backward."""
  topk, _ = ops.indexer_topk(*index_args, topk=d.topk, scale=index_scale)
  return _mla_forward_backward(*mla_args, topk, cotangent, op=ops.sparse_mla, scale=scale)


@functools.partial(jax.jit, static_argnames=("implementation", "scale"))
def dense_forward_backward(q, k, v, cotangent, *, implementation, scale):
  def loss(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                       implementation=implementation)
    return jnp.vdot(out.astype(jnp.float32), cotangent.astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def dsa_vs_dense_section(ctx) -> dict:
  """(c) DSA (indexer + top-k + sparse MLA, forward + backward) against cuDNN dense causal
  attention (forward + backward) per L: DSA on the GPU kernels ("pallas") and on the XLA path
  ("xla"; also what runs when the kernel modules are missing), and DSA's growth per 4x L."""
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not ctx.smoke:
    raise RuntimeError("cuDNN needs a GPU; --smoke runs the XLA twin of the call on CPU")
  implementation = "cudnn" if on_gpu else "xla"
  dsa_impls, missing = {"xla": pk.DSA_OPS["xla"]}, sorted(set(GPU_MODULES) - present_kernels())
  if not missing:  # DSA on the GPU kernels needs both
    dsa_impls = {"pallas": gpu_ops(require_gpu_kernels(ctx.smoke)), **dsa_impls}
  d, rows, times = ctx.dims, [], {}
  for length in ctx.dense_seq_lens:
    def dense_case(length=length):
      keys = jax.random.split(jax.random.key(length), 4)
      shape = (1, length, d.heads, d.dense_head_dim)
      args = tuple(jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
      run = timed(functools.partial(dense_forward_backward, implementation=implementation,
                                    scale=d.dense_head_dim ** -0.5), args, ctx.repeats)
      times[("dense", length)] = run["median_s"]
      flops = 3.5 * 4 * d.dense_head_dim * d.heads * length * (length + 1) // 2
      return ctx.rate(dict(path=f"dense ({implementation})", L=length, **run), flops)
    rows.append(ctx.case(f"dense L={length}", dense_case))
    for name, ops in dsa_impls.items():
      def dsa_case(length=length, name=name, ops=ops):
        mla_args, cotangent = mla_inputs(length, d)
        run = timed(functools.partial(dsa_forward_backward, ops=ops, d=d, scale=mla_scale(d),
                                      index_scale=d.index_dim ** -0.5),
                    (indexer_inputs(length, d), mla_args[:4], cotangent), ctx.repeats)
        times[(name, length)] = run["median_s"]
        dense_s = times.get(("dense", length))
        flops = (valid_slots(length, d.topk) * d.heads * (mla_flops(d, False) + mla_flops(d, True))
                 + d.index_heads * d.index_dim * length * (length + 1))
        return ctx.rate(dict(path=f"dsa ({name})", L=length, **run,
                             speedup_vs_dense=dense_s / run["median_s"] if dense_s else None),
                        flops)
      rows.append(ctx.case(f"dsa {name} L={length}", dsa_case))
  growth = {f"{name} {l}->{4 * l}": times[(name, 4 * l)] / times[(name, l)]
            for (name, l) in times if (name, 4 * l) in times}
  return dict(rows=rows, growth_per_4x_L=growth,
              gpu_kernels=f"missing: {missing}" if missing else "present",
              note="attention cores only: the latent expansion (dense) and query absorption "
                   "(DSA) projections are excluded; dense has one head of K = V = "
                   f"{d.dense_head_dim} per query head; DSA FLOPs = sparse MLA fwd+bwd on "
                   "valid slots + the causal indexer scores")
