"""Long-context decode on the tiny model: chunked prefill memory, and decode cost per token
against the context length, DSA (D) beside dense MLA (M), side by side in one run.

  python tools/bench_long_context.py                                   # CPU, a few minutes
  python tools/bench_long_context.py --prefill_len=131072 --sections=prefill
  python tools/bench_long_context.py --contexts=8192,65536 --sections=decode,ops
  python tools/bench_long_context.py --sections=ops --ops_model=glm5    # GLM-5's shapes
  python tools/bench_long_context.py --sections=decode --decode_model=glm5   # GLM-5's widths

Model: configs/tiny.py's (random params), `max_position_embeddings` raised to fit, MTP off
(the main model's steps), `dsa_impl="xla"`, one slot (B = 1). `--decode_model=glm5`: the
decode section's model has GLM-5's widths and `--decode_layers` layers instead
(`tools/glm5_decode_width.py` says what is real and what is reduced).

Sections:
  prefill   (1) the compiled memory of one chunk step (`glm5_jax.infer.step.decode_step` with
            Q = chunk new tokens over a cache of S rows; XLA's `memory_analysis`): arguments
            (the cache and params) and temporaries, for each `--chunks` x `--analysis_lens`,
            D and M: what the chunk costs beyond the cache. (2) D only: a `--prefill_len`-token
            prompt prefilled in chunks of the first `--chunks` entry, timed, with the process's
            peak resident memory (`ru_maxrss`) before and after and the cache's own bytes.
  decode    one-token decode steps (Q = 1) at the last row of a cache of each `--contexts`
            length (random cache contents: the cost does not depend on them), for D and M,
            with the layers unrolled and scanned (`model.scan_layers`): the least time per step
            over `--rounds` rounds of `--steps` steps, and each one's ratio to the shortest
            context. The tiny model's step is a fraction of a millisecond of constant work, so
            its ratio is the indexer's (linear in the context by design). `--decode_model=glm5`:
            GLM-5's per-token widths (scanned layers only), with one layer's FLOPs and bytes
            read per token split into the constant part and the context-dependent part
            (attention over the cache, the indexer's scores), counted from the shapes
            (`glm5_decode_width.layer_work`), and the compiled step's matmul FLOPs
            (`hlo_stats.step_dot_flops`) to check the count by; `--decode_slots` B decodes B
            slots a step, all at the context's last row.
  ops       the D layer's two attention ops alone (the indexer's scoring and
            top-k over every cached key, `pallas_kernels.indexer_topk_decode`; the sparse
            attention over its T selected rows, `sparse_mla_xla`) and M's dense absorbed
            attention over every row, per layer, with the tiny model's attention shapes or
            (`--ops_model=glm5`) GLM-5's.

The last output line is all figures as JSON.
"""

import json
import resource
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from configs import tiny
from glm5_jax.planning import hlo_stats
from glm5_jax.api import init_params
from glm5_jax.attention.mla import _absorbed_attention, _Latents
from glm5_jax.config import ModelConfig, model_config as glm5_model_config
from glm5_jax.infer.cache import init_cache
from glm5_jax.infer.step import _decode_step, decode_step
from tools import glm5_decode_width

_SECTIONS = flags.DEFINE_list("sections", ["prefill", "decode", "ops"], "Sections to run.")
_CONTEXTS = flags.DEFINE_list("contexts", ["8192", "65536"], "Decode context lengths.")
_PREFILL_LEN = flags.DEFINE_integer("prefill_len", 32768, "Prompt tokens of the prefill run.")
_CHUNKS = flags.DEFINE_list("chunks", ["512", "2048"], "Prefill chunk sizes (the run uses the "
                            "first).")
_ANALYSIS_LENS = flags.DEFINE_list("analysis_lens", ["16384", "131072"], "Cache rows S of the "
                                   "compiled chunk-step memory analysis.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed decode steps per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timing rounds (the least time counts).")
_OPS_MODEL = flags.DEFINE_enum("ops_model", "tiny", ["tiny", "glm5"], "Attention shapes of the "
                               "per-layer ops: the tiny model's or GLM-5's (64 heads, C 512, "
                               "R 64, J 32, I 128, top-k 2048).")
_DECODE_MODEL = flags.DEFINE_enum("decode_model", "tiny", ["tiny", "glm5"], "The decode "
                                  "section's model: the tiny one, or GLM-5's per-token widths "
                                  "with --decode_layers layers (tools/glm5_decode_width.py).")
_DECODE_LAYERS = flags.DEFINE_integer("decode_layers", 1, "Layers of the glm5 decode model.")
_DECODE_FFN = flags.DEFINE_enum("decode_ffn", "dense", list(glm5_decode_width.FFNS), "The glm5 "
                                "decode model's FFN: the MoE's active width as one dense SwiGLU, "
                                "or the MoE with 8 experts (XLA:CPU computes each on every row).")
_DECODE_SLOTS = flags.DEFINE_integer("decode_slots", 1, "Slots (B) of the glm5 decode step, "
                                     "every one at the context's last row.")


def model_config(pattern: str, scan: bool, max_len: int) -> ModelConfig:
  """The tiny model with `pattern` ("D" or "M" for every layer), MTP off."""
  cfg = tiny.get_config(pattern).model
  cfg.update(max_position_embeddings=max(max_len, cfg.max_position_embeddings), dsa_impl="xla",
             num_nextn_predict_layers=0, mtp_depths=0, scan_layers=scan)
  return ModelConfig.from_config(cfg)


def least_seconds(fn, rounds: int, steps: int) -> float:
  """The least mean time per call of `fn()` (which blocks) over `rounds` rounds of `steps`."""
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(steps):
      fn()
    best = min(best, (time.perf_counter() - start) / steps)
  return best


def random_cache(cfg, max_len: int, seed: int = 0, slots: int = 1):
  """A cache of `slots` x `max_len` rows of random numbers, each array drawn in one fused
  program (no zero-filled cache or random-bits array beside it: at GLM-5's widths and 64K rows
  a slot's layer is 185 MiB)."""
  shapes = jax.eval_shape(lambda: init_cache(cfg, slots, max_len))
  for path, x in jax.tree_util.tree_leaves_with_path(shapes):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"random_cache fills float caches only; {jax.tree_util.keystr(path)} is "
                       f"{x.dtype}")
  draw = jax.jit(lambda key, shape, dtype: jax.random.normal(key, shape, dtype),
                 static_argnums=(1, 2))
  return jax.tree.map(lambda x: draw(jax.random.key(seed), x.shape, x.dtype), shapes)


def random_params(cfg, seed: int = 0):
  """Params of `cfg`'s shapes, each leaf drawn on its own (no whole-model init temporaries)."""
  shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(seed)))
  leaves, tree = jax.tree.flatten(shapes)
  draw = jax.jit(lambda key, shape, dtype: 0.02 * jax.random.normal(key, shape, dtype),
                 static_argnums=(1, 2))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return tree.unflatten([draw(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros(x.shape, x.dtype)
                         for k, x in zip(keys, leaves)])


def tokens_at(positions, vocab: int):
  positions = jnp.asarray(positions, jnp.int32)[None]
  return positions % vocab, positions, jnp.ones_like(positions)


def chunk_memory(pattern: str, chunk: int, rows: int) -> dict:
  """`memory_analysis` of one compiled chunk step (abstract cache: nothing allocated)."""
  cfg = model_config(pattern, True, rows)
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  cache = jax.eval_shape(lambda: init_cache(cfg, 1, rows))
  q = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
  stats = _decode_step.lower(params, cache, q, q, q, cfg=cfg, dsa_stage="sparse").compile(
  ).memory_analysis()
  return {"argument_MiB": round(stats.argument_size_in_bytes / 2**20, 1),
          "temp_MiB": round(stats.temp_size_in_bytes / 2**20, 1)}


def prefill_run(length: int, chunk: int) -> dict:
  """D: a `length`-token prompt in chunks, timed; peak RSS before and after."""
  cfg = model_config("D", True, length)
  params = init_params(cfg, jax.random.key(0))
  cache = init_cache(cfg, 1, length)
  cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  start = time.perf_counter()
  for first in range(0, length, chunk):
    out = decode_step(cfg, params, cache, *tokens_at(np.arange(first, first + chunk),
                                                     cfg.vocab_size))
    cache = out.cache
  out.logits_BQY.block_until_ready()
  return {"prompt": length, "chunk": chunk, "seconds": round(time.perf_counter() - start, 1),
          "cache_MiB": round(cache_bytes / 2**20, 1), "peak_rss_MiB_before": round(rss_before),
          "peak_rss_MiB_after": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def decode_step_ms(pattern: str, scan: bool, context: int) -> float:
  cfg = model_config(pattern, scan, context)
  params = init_params(cfg, jax.random.key(0))
  state = {"cache": random_cache(cfg, context)}
  args = tokens_at([context - 1], cfg.vocab_size)

  def one():
    out = decode_step(cfg, params, state["cache"], *args)
    state["cache"] = out.cache
    out.logits_BQY.block_until_ready()

  one()  # compiles
  return 1e3 * least_seconds(one, _ROUNDS.value, _STEPS.value)


def glm5_decode(pattern: str, contexts: list[int]) -> dict:
  """`pattern` ("D" or "M") at GLM-5's widths (`--decode_layers`, `--decode_ffn`): per
  context, the least ms per decode step, one real layer's per-token FLOPs and bytes split
  (`glm5_decode_width.layer_work`, fp32) and the compiled step's matmul GFLOPs (all layers
  and the reduced LM head). The contexts' caches live side by side and each round times every
  context in turn, so a burst of load on the shared machine hits them alike. With
  `--decode_slots` B > 1 every slot decodes at the same row; FLOPs and bytes stay per token,
  the weights' bytes shared by the B tokens of a step."""
  cfg = glm5_decode_width.glm5_width_config(pattern, _DECODE_LAYERS.value, max(contexts),
                                            _DECODE_FFN.value)
  params = random_params(cfg)
  slots = _DECODE_SLOTS.value
  q = jax.ShapeDtypeStruct((slots, 1), jnp.int32)
  out, caches, best = {}, {}, {n: float("inf") for n in contexts}
  for n in contexts:
    compiled = _decode_step.lower(params, jax.eval_shape(lambda n=n: init_cache(cfg, slots, n)),
                                  q, q, q, cfg=cfg, dsa_stage="sparse").compile()
    work = glm5_decode_width.layer_work(cfg, pattern, n, slots=slots)
    out[str(n)] = {"step_dot_gflop": round(hlo_stats.step_dot_flops(compiled.as_text())["flops"]
                                           / 1e9, 3),
                   **{f"layer_g{unit}_{part}": round(work[unit + "s"][part] / 1e9, 3)
                      for unit in ("flop", "byte") for part in ("constant", "context")}}
    caches[n] = random_cache(cfg, n, slots=slots)

  def one(n):
    rows = jnp.full((slots, 1), n - 1, jnp.int32)
    step = decode_step(cfg, params, caches[n], rows % cfg.vocab_size, rows, jnp.ones_like(rows))
    caches[n] = step.cache
    step.logits_BQY.block_until_ready()

  for n in contexts:
    one(n)  # compiles
  for _ in range(_ROUNDS.value):
    for n in contexts:
      best[n] = min(best[n], least_seconds(lambda n=n: one(n), 1, _STEPS.value))
  rss = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
  for n in contexts:
    out[str(n)].update(ms=round(1e3 * best[n], 1), peak_rss_MiB=rss)
  return out


def attention_ops_ms(context: int, which: str) -> dict:
  """Per layer, one query at the last of `context` rows: D's two ops and M's dense attention,
  with the attention shapes of `which` ("tiny" or "glm5", `--ops_model`)."""
  cfg = (model_config("D", True, context) if which == "tiny" else
         ModelConfig.from_config(glm5_model_config()))
  h, c, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
  j, i, t = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
  normal = lambda *shape: jax.random.normal(jax.random.key(len(shape)), shape)
  ckv, k_rope, index_k = normal(1, context, c), normal(1, context, r), normal(1, context, i)
  q_latent, q_rope = normal(1, 1, h, c), normal(1, 1, h, r)
  q_pos, ones = jnp.full((1, 1), context - 1, jnp.int32), jnp.ones((1, 1), jnp.int32)
  k_seg = jnp.ones((1, context), jnp.int32)
  indexer = jax.jit(lambda q, k, w: pallas_kernels.indexer_topk_decode(
      q, k, w, q_pos, ones, k_seg, topk=t, scale=i ** -0.5)[0])
  topk = indexer(normal(1, 1, j, i), index_k, normal(1, 1, j))
  sparse = jax.jit(lambda *a: pallas_kernels.sparse_mla_xla(*a, scale=0.1)[0])
  w_kb, w_vb = jnp.eye(c)[:, None, :c].repeat(h, 1), jnp.eye(c)[:, None, :].repeat(h, 1)
  dense = jax.jit(lambda ql, qr, ckv, kr: _absorbed_attention(
      _Latents(ql, qr, ckv, kr, w_kb, w_vb),
      (jnp.arange(context) <= context - 1)[None, None], 0.1)[0])
  runs = {"indexer_topk": lambda: indexer(normal(1, 1, j, i), index_k, normal(1, 1, j)),
          "sparse_mla": lambda: sparse(q_latent, q_rope, ckv, k_rope, topk),
          "dense_mla": lambda: dense(q_latent, q_rope, ckv, k_rope)}
  out = {}
  for name, fn in runs.items():
    fn().block_until_ready()
    out[name] = round(1e3 * least_seconds(lambda: fn().block_until_ready(), _ROUNDS.value,
                                          _STEPS.value), 3)
  return out


def main(argv):
  del argv
  result = {}
  if "prefill" in _SECTIONS.value:
    chunks = [int(x) for x in _CHUNKS.value]
    result["prefill_run"] = prefill_run(_PREFILL_LEN.value, chunks[0])
    print("prefill run (D):", result["prefill_run"], flush=True)
    result["chunk_memory"] = {}
    for pattern in ("D", "M"):
      for chunk in chunks:
        for rows in (int(x) for x in _ANALYSIS_LENS.value):
          stats = chunk_memory(pattern, chunk, rows)
          result["chunk_memory"][f"{pattern} chunk={chunk} S={rows}"] = stats
          print(f"chunk step {pattern}: chunk {chunk:6d}, cache rows {rows:7d}: {stats}",
                flush=True)
  if "decode" in _SECTIONS.value and _DECODE_MODEL.value == "glm5":
    contexts = [int(x) for x in _CONTEXTS.value]
    print(f"decode at GLM-5's widths: {_DECODE_LAYERS.value} scanned layers, FFN "
          f"{_DECODE_FFN.value!r}, vocab {glm5_decode_width.VOCAB}, fp32, "
          f"{_DECODE_SLOTS.value} slot(s); one real layer's FLOPs and bytes read per token (constant + context-dependent; the real "
          "MoE's active work), and the compiled step's matmuls", flush=True)
    result["glm5_decode"] = {}
    for pattern in ("D", "M"):
      runs = result["glm5_decode"][pattern] = glm5_decode(pattern, contexts)
      first = runs[str(contexts[0])]
      total = lambda r, unit: r[f"layer_g{unit}_constant"] + r[f"layer_g{unit}_context"]
      for n in contexts:
        r = runs[str(n)]
        parts = "; ".join(
            f"layer {label} {r[f'layer_g{unit}_constant']:.3f} constant + "
            f"{r[f'layer_g{unit}_context']:.3f} context ({total(r, unit) / total(first, unit):.2f}x)"
            for unit, label in (("flop", "GFLOP"), ("byte", "GB read")))
        print(f"decode step {pattern} (glm5): {n:6d} rows: {r['ms']:8.1f} ms "
              f"({r['ms'] / first['ms']:5.2f}x); {parts}; step matmuls "
              f"{r['step_dot_gflop']:.3f} GFLOP; peak RSS {r['peak_rss_MiB']} MiB", flush=True)
  elif "decode" in _SECTIONS.value:
    contexts = [int(x) for x in _CONTEXTS.value]
    result["decode_ms"] = {}
    for pattern in ("D", "M"):
      for scan in (False, True):
        name = f"{pattern} {'scanned' if scan else 'unrolled'}"
        times = [decode_step_ms(pattern, scan, n) for n in contexts]
        result["decode_ms"][name] = {str(n): round(ms, 2) for n, ms in zip(contexts, times)}
        print(f"decode step {name:11s}: " + "  ".join(
            f"{n}: {ms:8.2f} ms ({ms / times[0]:5.2f}x)" for n, ms in zip(contexts, times)),
            flush=True)
  if "ops" in _SECTIONS.value:
    contexts = [int(x) for x in _CONTEXTS.value]
    result["attention_ops_ms"] = {}
    for n in contexts:
      result["attention_ops_ms"][str(n)] = attention_ops_ms(n, _OPS_MODEL.value)
    for op in ("indexer_topk", "sparse_mla", "dense_mla"):
      times = [result["attention_ops_ms"][str(n)][op] for n in contexts]
      print(f"per layer {op:12s} ({_OPS_MODEL.value}): " + "  ".join(
          f"{n}: {ms:8.3f} ms ({ms / times[0]:5.2f}x)" for n, ms in zip(contexts, times)))
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
