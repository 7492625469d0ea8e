"""DSA cost against dense MLA attention, side by side on the current backend.

  python tools/bench_dsa.py                    # CPU: L = 1K..8K, top-k 128, scaled-down dims
  python tools/bench_dsa.py --quick            # seconds: two short lengths, tiny dims
  python tools/bench_dsa.py --seq_lens=4096,16384,65536,131072 --topk=2048 --heads=64 \\
      --head_dim=256 --latent_dim=512 --rope_dim=64 --index_heads=32 --index_dim=128  # GLM-5

For every sequence length L (one sequence, S = L keys) it times, forward and forward+backward:
  dense       causal MLA attention in the expanded form (H heads, qk = v = `head_dim`) through
              `jax.nn.dot_product_attention` (XLA on CPU / TPU, cuDNN flash on GPU when
              available): the best dense path JAX itself offers;
  dense_mask  the DSA reference (`model.dsa_impl="dense_mask"`): the same attention with a
              `[L, S]` mask of the top-k keys, so still quadratic;
  xla         `pallas_kernels.sparse_mla_xla`: absorbed attention over the T selected latent
              rows (C latent + R rope), gathered per query block;
  pallas      `pallas_kernels.sparse_mla_pallas` (TPU kernel; "interpret" off TPU, slow, and only
              up to `--interpret_max_len`);
and the indexer separately (forward only: top-k passes no gradient): `indexer_reference`
(dense `[L, S]` scores + top-k), `indexer_xla`, `indexer_pallas`.

Columns: time (median of `--repeats` after a warm-up), the ratio to dense at the same L and
pass, FLOPs (useful work: causal (query, key) pairs for dense and dense_mask, selected slots for
the sparse paths; backward = 2x forward for dense, per the sparse VJP for sparse), achieved
TFLOP/s, and on an accelerator the estimated HBM traffic rate and both against the device peak;
peak memory is XLA's compiled temp allocation (`memory_analysis()`), which is what the path
needs beyond its inputs and outputs. The summary line says from which L the whole of DSA
(indexer + sparse attention, best path on this backend) beats dense, and by how much at the
longest L. Absolute times only mean something on an accelerator; on CPU read the ratios and how
they grow with L.

Notation: B batch, L queries (= S keys), H heads, C latent, R rope dim, T top-k.
"""

import dataclasses
import functools
import json
import os
import sys

# The repository root, for `tools` when run as `python tools/X.py` (sys.path[0] is tools/).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from glm5_jax.accelerators import accelerator_of
from glm5_jax.attention.common import attend, causal_segment_mask
from glm5_jax.attention.dsa import topk_mask
from glm5_jax.train.metrics import peak_flops_per_device
from tools.timing import median_seconds

_SEQ_LENS = flags.DEFINE_list("seq_lens", None, "Sequence lengths (default: per backend).")
_TOPK = flags.DEFINE_integer("topk", None, "Selected keys per query (GLM-5: 2048; CPU: 128).")
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences per call.")
_HEADS = flags.DEFINE_integer("heads", None, "Attention heads H (GLM-5: 64; CPU: 4).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", None, "Dense per-head qk = v dim (GLM-5: 256).")
_LATENT = flags.DEFINE_integer("latent_dim", None, "MLA latent C (GLM-5: 512; CPU: 128).")
_ROPE = flags.DEFINE_integer("rope_dim", None, "MLA rope dim R (GLM-5: 64; CPU: 32).")
_INDEX_HEADS = flags.DEFINE_integer("index_heads", None, "Indexer heads (GLM-5: 32; CPU: 4).")
_INDEX_DIM = flags.DEFINE_integer("index_dim", None, "Indexer head dim (GLM-5: 128; CPU: 32).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Default: bf16 off CPU.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per measurement (median).")
_INTERPRET_MAX = flags.DEFINE_integer("interpret_max_len", 2048, "Longest L for the Pallas "
                                      "paths in interpret mode (off TPU).")
_QUICK = flags.DEFINE_bool("quick", False, "Seconds-long smoke run: L = 256, 512, tiny dims.")
_JSON = flags.DEFINE_bool("json", False, "Also print every row as one JSON line.")

@dataclasses.dataclass(frozen=True)
class Dims:
  batch: int
  topk: int
  heads: int
  head_dim: int
  latent: int
  rope: int
  index_heads: int
  index_dim: int
  dtype: str


def resolve_dims(backend: str) -> tuple[list[int], Dims]:
  """Flags, else defaults for the backend: GLM-5's sizes on accelerators, scaled on CPU."""
  if _QUICK.value:
    lens, base = [256, 512], Dims(1, 32, 2, 32, 32, 8, 2, 16, "float32")
  elif backend == "cpu":
    lens, base = [1024, 2048, 4096, 8192], Dims(1, 128, 4, 64, 128, 32, 4, 32, "float32")
  else:
    lens, base = [4096, 16384, 65536, 131072], Dims(1, 2048, 64, 256, 512, 64, 32, 128,
                                                    "bfloat16")
  overrides = {"batch": _BATCH.value, "topk": _TOPK.value, "heads": _HEADS.value,
               "head_dim": _HEAD_DIM.value, "latent": _LATENT.value, "rope": _ROPE.value,
               "index_heads": _INDEX_HEADS.value, "index_dim": _INDEX_DIM.value,
               "dtype": _DTYPE.value}
  dims = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
  if _SEQ_LENS.value:
    lens = [int(x) for x in _SEQ_LENS.value]
  return lens, dims


def measure(fn, args, repeats):
  """(median seconds, compiled temp bytes) of `jax.jit(fn)(*args)`; compile excluded."""
  compiled = jax.jit(fn).lower(*args).compile()
  analysis = compiled.memory_analysis()
  temp = getattr(analysis, "temp_size_in_bytes", None) if analysis is not None else None
  jax.block_until_ready(compiled(*args))
  return median_seconds(compiled, args, repeats), temp


def forward_backward(fn):
  """`fn(*arrays) -> outputs` -> a function returning the gradients of a fixed random
  projection of the outputs with respect to every float array (a training step's cost)."""
  def run(*arrays):
    float_idx = [i for i, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.floating)]

    def loss(*floats):
      full = list(arrays)
      for i, a in zip(float_idx, floats):
        full[i] = a
      outs = jax.tree.leaves(fn(*full))
      return sum(jnp.sum(jnp.where(jnp.isfinite(o), o, 0).astype(jnp.float32) * jnp.cos(
          jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))) for o in outs)

    return jax.grad(loss, argnums=tuple(range(len(float_idx))))(*[arrays[i] for i in float_idx])
  return run


def build_cases(length: int, d: Dims, interpret: bool):
  """`{name: (kind, fn, args, flops_fwd, flops_fwd_bwd, bytes_fwd, bytes_fwd_bwd)}`."""
  dtype = jnp.dtype(d.dtype)
  size = dtype.itemsize
  rng = np.random.default_rng(0)
  arr = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.5, dtype)
  b, l, h, t = d.batch, length, d.heads, min(d.topk, length)
  pairs = b * l * (l + 1) // 2  # causal (query, key) pairs
  pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
  seg = jnp.ones((b, l), jnp.int32)
  index_args = (arr(b, l, d.index_heads, d.index_dim), arr(b, l, d.index_dim),
                jnp.asarray(rng.standard_normal((b, l, d.index_heads)), jnp.float32), pos, seg,
                seg)
  index_scale = d.index_dim ** -0.5
  topk_BLT = jax.jit(functools.partial(pk.indexer_topk_xla, topk=t, scale=index_scale))(
      *index_args)[0]
  index_flops = 2 * pairs * d.index_heads * d.index_dim
  index_bytes = 2 * b * l * l * 4 + b * l * d.index_heads * d.index_dim * size

  q, k, v = arr(b, l, h, d.head_dim), arr(b, l, h, d.head_dim), arr(b, l, h, d.head_dim)
  dense_flops = 2 * pairs * h * 2 * d.head_dim
  scale = d.head_dim ** -0.5

  def dense(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale)

  def dense_mask(q, k, v, topk_BLT):
    visible_BLS = causal_segment_mask(seg) & topk_mask(topk_BLT, l)
    return attend(q, k, v, visible_BLS, scale)[0]

  c, r = d.latent, d.rope
  sparse_args = (arr(b, l, h, c), arr(b, l, h, r), arr(b, l, c), arr(b, l, r), topk_BLT)
  slots = b * l * t * h
  sparse_fwd, sparse_bwd = 2 * slots * (2 * c + r), 2 * slots * (5 * c + 3 * r)
  gathered = b * l * t * (c + r) * size
  sparse_bytes = gathered + b * l * h * (2 * c + r) * size
  sparse_bytes_fb = 3 * sparse_bytes + 2 * b * l * t * (c + r) * 4  # + fp32 dkv contributions
  mla_scale = (c + r) ** -0.5  # any fixed scale: the cost does not depend on it
  cases = {
      "dense": ("attention", dense, (q, k, v), dense_flops, 3 * dense_flops, None, None),
      "dense_mask": ("attention", dense_mask, (q, k, v, topk_BLT), dense_flops, 3 * dense_flops,
                     None, None),
      "xla": ("attention", functools.partial(pk.sparse_mla_xla, scale=mla_scale), sparse_args,
              sparse_fwd, sparse_fwd + sparse_bwd, sparse_bytes, sparse_bytes_fb),
      "pallas": ("attention", functools.partial(pk.sparse_mla_pallas, scale=mla_scale,
                                                interpret=interpret),
                 sparse_args, sparse_fwd, sparse_fwd + sparse_bwd, sparse_bytes, sparse_bytes_fb),
  }
  for name, fn in (("indexer_reference", pk.indexer_topk_reference),
                   ("indexer_xla", pk.indexer_topk_xla),
                   ("indexer_pallas", functools.partial(pk.indexer_topk_pallas,
                                                        interpret=interpret))):
    cases[name] = ("indexer", functools.partial(fn, topk=t, scale=index_scale), index_args,
                   index_flops, None, index_bytes, None)
  return cases


def fmt_bytes(n):
  return "-" if n is None else f"{n / 2**20:,.1f}"


def main(argv):
  del argv
  backend = jax.default_backend()
  device = jax.devices()[0].device_kind
  lens, d = resolve_dims(backend)
  interpret = backend != "tpu"
  peak_flops = peak_flops_per_device()
  accelerator = accelerator_of(device)
  peak_hbm = accelerator.hbm_bytes_per_s if accelerator else None
  best_sparse = "pallas" if backend == "tpu" else "xla"
  best_indexer = "indexer_" + best_sparse
  print(f"backend {backend} ({device}); batch {d.batch}, heads {d.heads}, dense head dim "
        f"{d.head_dim}, latent {d.latent} + rope {d.rope}, top-k {d.topk}, indexer "
        f"{d.index_heads} x {d.index_dim}, {d.dtype}; pallas: "
        f"{'interpret mode (slow, CPU)' if interpret else 'compiled'}")
  header = (f"{'L':>7} {'path':<27} {'pass':<8} {'ms':>10} {'x dense':>8} {'GFLOP':>10} "
            f"{'TFLOP/s':>8} {'GB/s':>8} {'%peak':>11} {'temp MiB':>10}")
  print(header)
  print("-" * len(header))
  rows, totals = [], {}
  for length in lens:
    cases = build_cases(length, d, interpret)
    dense_time = {}
    for name, (kind, fn, args, flops_f, flops_fb, bytes_f, bytes_fb) in cases.items():
      passes = [("fwd", fn, flops_f, bytes_f)]
      if kind == "attention":
        passes.append(("fwd+bwd", forward_backward(fn), flops_fb, bytes_fb))
      for pass_name, run_fn, flops, nbytes in passes:
        label = name + (" (interpret)" if interpret and "pallas" in name else "")
        if interpret and "pallas" in name and length > _INTERPRET_MAX.value:
          print(f"{length:>7} {label:<27} {pass_name:<8} {'skipped (L > interpret_max_len)':>30}")
          continue
        seconds, temp = measure(run_fn, args, 1 if "pallas" in name and interpret
                                else _REPEATS.value)
        if name == "dense":
          dense_time[pass_name] = seconds
        ratio = seconds / dense_time[pass_name] if pass_name in dense_time else None
        if kind == "indexer":
          ratio = seconds / dense_time["fwd"]
        tflops = flops / seconds / 1e12
        gbs = nbytes / seconds / 1e9 if nbytes and not interpret and backend != "cpu" else None
        pct = []
        if peak_flops and backend != "cpu":
          pct.append(f"{tflops * 1e12 / peak_flops:.0%}F")
        if peak_hbm and gbs:
          pct.append(f"{gbs * 1e9 / peak_hbm:.0%}B")
        row = dict(L=length, path=name, mode="interpret" if interpret and "pallas" in name
                   else "compiled", pass_=pass_name, ms=seconds * 1e3, x_dense=ratio,
                   flops=flops, tflops_per_s=tflops, gb_per_s=gbs, temp_bytes=temp)
        rows.append(row)
        totals[(length, name, pass_name)] = seconds
        print(f"{length:>7} {label:<27} {pass_name:<8} {seconds * 1e3:>10.2f} "
              f"{'-' if ratio is None else f'{ratio:.3f}':>8} {flops / 1e9:>10.3f} "
              f"{tflops:>8.4f} {'-' if gbs is None else f'{gbs:.0f}':>8} "
              f"{' '.join(pct) or '-':>11} {fmt_bytes(temp):>10}", flush=True)
  print()
  for pass_name in ("fwd", "fwd+bwd"):
    wins = []
    for length in lens:
      parts = [totals.get((length, best_indexer, "fwd")), totals.get((length, best_sparse,
                                                                        pass_name))]
      dense_s = totals.get((length, "dense", pass_name))
      if None not in parts and dense_s:
        wins.append((length, dense_s / sum(parts)))
    if not wins:
      continue
    first = next((length for length, speedup in wins if speedup > 1), None)
    text = ", ".join(f"L={length}: {speedup:.2f}x" for length, speedup in wins)
    verdict = f"DSA faster from L={first}" if first else "DSA not faster at any length run"
    print(f"DSA ({best_indexer} + {best_sparse}) vs dense, {pass_name}: dense time / DSA time = "
          f"{text}; {verdict}")
  if _JSON.value:
    for row in rows:
      print(json.dumps(row))


if __name__ == "__main__":
  app.run(main)
