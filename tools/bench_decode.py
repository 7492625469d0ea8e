"""Decode cost, measured side by side in one run on the current backend.

  python tools/bench_decode.py                                   # tiny GLM-5 on CPU, < 1 min
  python tools/bench_decode.py --workdir=workdir/tiny --speculative_steps=1,2,3,4 \
      --spec_prompts_from=stdlib
  python tools/bench_decode.py --config=configs/glm5_744b.py --layers=1 \
      --config.model.num_nextn_predict_layers=0 --config.model.mtp_depths=0 \
      --batch_sizes=1,4 --prompt_len=32 --decode_steps=3      # one GLM-5 layer, compiled

Sections (every time is taken after a compiling warm-up call of the same shapes, and ends with
`block_until_ready`):
  cache        values and bytes one token adds to each layer's cache, per array, read from the
               kinds' cache specs (`glm5_jax.infer.cache`), against GQA-8 of the same model
               (`attention_pattern="G"`, 8 KV heads of `gqa_head_dim`): GLM-5's MLA caches 512
               latent + 64 rope = 576 values (and its DSA indexer 128 keys) against 2 x 8 x 128
               = 2048.
  prefill      prompt tokens/s: the `--prompt_len` prompt of every slot, in chunks of
               `--prefill_chunk`, through `decode_step`, at each batch size.
  decode       tokens/s of one-token decode steps over B slots (`decode_step`, Q = 1, each
               step feeding the previous step's argmax without a host round trip), at each batch
               size B in `--batch_sizes`, and the ratio to the smallest B.
  speculative  `infer.generate` with `speculative_steps=k` against k = 0 on the same prompts
               (greedy): wall-clock speed-up and mean accept length (tokens per verification
               step, the bonus token included), for each MTP cache scheme in `--mtp_cache`
               ("per_depth", "shared"); `--speculative_steps=` (empty, the default) skips it.
               Random params accept ~1 token: use `--workdir` of a trained run.

Params: `--workdir` (a training run's latest checkpoint, `glm5_jax.infer.loading`) or random
(std 0.02) params of `--config`'s model; `--layers=N` keeps its first N layers. The last output
line is all figures as JSON.

Notation: B slots (batch), C prefill chunk, Q tokens per slot per call.
"""

import json
import os
import time

from absl import app, flags
from flax import linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import glm5_jax
from configs import overrides
from glm5_jax import data as data_lib
from glm5_jax.data import sources as data_sources
from glm5_jax import infer
from glm5_jax.config import ModelConfig, expand_pattern
from glm5_jax.attention.kinds import layer_kind
from glm5_jax.infer.cache import init_cache, layer_cache_specs
from glm5_jax.infer.loading import load_model
from glm5_jax.infer.step import decode_step
from glm5_jax.layers.axes import CACHE_LENGTH

_CONFIG = overrides.define_config_file("config", "configs/tiny.py", "Experiment config (its "
                                          "model is benchmarked unless --workdir is given).")
_WORKDIR = flags.DEFINE_string("workdir", None, "A training run: benchmark its latest params.")
_LAYERS = flags.DEFINE_integer("layers", 0, "Keep only the first N layers (0: all).")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Slots B to time decode at.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per slot.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 64, "Prompt tokens per slot per call.")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 16, "Timed decode steps per batch size.")
_SPECULATIVE = flags.DEFINE_list("speculative_steps", [], "Draft steps k to compare with plain "
                                 "decoding (e.g. 1,2,3,4); empty: skip.")
_MTP_CACHE = flags.DEFINE_list("mtp_cache", ["per_depth", "shared"], "MTP cache schemes to "
                               "measure in the speculative section.")
_SPEC_PROMPTS = flags.DEFINE_integer("spec_prompts", 4, "Prompts of the speculative section.")
_SPEC_NEW = flags.DEFINE_integer("spec_new_tokens", 32, "Tokens generated per prompt there.")
_GQA_KV_HEADS = flags.DEFINE_integer("gqa_kv_heads", 8, "KV heads of the GQA comparison.")
_SEED = flags.DEFINE_integer("seed", 0, "Params and prompt seed.")
_SPEC_FROM = flags.DEFINE_enum("spec_prompts_from", "random", ["random", "stdlib"],
                               "Speculative prompts: random token ids, or windows of the Python "
                               "standard library's source (the tiny runs' training text) through "
                               "the run's tokenizer.")


def keep_layers(model: ml_collections.ConfigDict, n: int) -> ml_collections.ConfigDict:
  """`model` cut to its first `n` layers (per-layer patterns cut to match)."""
  model = ml_collections.ConfigDict(model.to_dict())
  pattern = expand_pattern(model.attention_pattern, model.num_hidden_layers)
  model.attention_pattern = pattern[:n]
  if model.get("mlp_pattern"):
    model.mlp_pattern = model.mlp_pattern[:n]
  model.num_hidden_layers = n
  return model


def random_params(cfg: ModelConfig, seed: int):
  """Params of `cfg`, N(0, 0.02) (norm scales 1 + that), drawn by numpy leaf by leaf: no
  `init_params` compile (minutes at GLM-5 layer shapes on CPU; jitted threefry draws too take
  tens of seconds to compile there), and one leaf on the host at a time."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    x = rng.standard_normal(leaf.shape, np.float32)
    x *= 0.02
    if getattr(path[-1], "key", None) == "scale":
      x += 1
    return jnp.asarray(x, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, nn.meta.unbox(glm5_jax.abstract_params(cfg)))


# ---- cache footprint -------------------------------------------------------------------------


def _per_token(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
  """{array: (values, bytes)} one token adds to `layer`'s position-indexed cache arrays."""
  out = {}
  for name, spec in layer_cache_specs(cfg, layer, 1, 1).items():
    if len(spec.axes) > 1 and spec.axes[1] == CACHE_LENGTH:
      values = int(np.prod(spec.shape[2:]))
      out[name] = (values, values * jnp.dtype(spec.dtype).itemsize)
  return out


def gqa_variant(model: ml_collections.ConfigDict, kv_heads: int) -> ModelConfig:
  """The same model with every layer GQA ("G") of `kv_heads` KV heads."""
  model = ml_collections.ConfigDict(model.to_dict())
  model.update(attention_pattern="G", num_key_value_heads=kv_heads)
  return ModelConfig.from_config(model)


def gqa_per_token(gqa: ModelConfig) -> tuple[dict[str, tuple[int, int]], str]:
  """`_per_token` of a GQA layer, and where it came from: the G kind's cache spec, or, in a
  build whose G kind has no decode cache yet, GQA's layout itself (K and V rows of
  kv_heads x gqa_head_dim per token), said so in the output."""
  if layer_kind(gqa.attention_pattern, 0).decode_cache is not None:
    return _per_token(gqa, 0), "the G kind's cache spec"
  values = gqa.num_key_value_heads * gqa.gqa_head_dim
  nbytes = values * jnp.dtype(gqa.cache_dtype).itemsize
  return {"k": (values, nbytes), "v": (values, nbytes)}, (
      "K + V of kv_heads x gqa_head_dim: this build's G kind has no decode cache")


def cache_section(model: ml_collections.ConfigDict, kv_heads: int) -> dict:
  cfg = ModelConfig.from_config(model)
  if cfg.num_attention_heads % kv_heads:
    print(f"note: GQA-{kv_heads} does not fit {cfg.num_attention_heads} heads; comparing with "
          f"the config's own num_key_value_heads = {cfg.num_key_value_heads}")
    kv_heads = cfg.num_key_value_heads
  gqa_arrays, gqa_source = gqa_per_token(gqa_variant(model, kv_heads))
  gqa_values, gqa_bytes = (sum(v[i] for v in gqa_arrays.values()) for i in (0, 1))
  print(f"\n== cache per token per layer (dtype {cfg.cache_dtype}) vs GQA-{kv_heads}: "
        f"{gqa_values} values = {gqa_bytes} bytes "
        f"({', '.join(f'{n} {v}' for n, (v, _) in gqa_arrays.items())}; from {gqa_source})")
  rows, seen = {}, set()
  for layer in range(cfg.num_hidden_layers):
    arrays = _per_token(cfg, layer)
    kind = cfg.attention_kind(layer)
    key = (kind, tuple(sorted(arrays.items())))
    if key in seen:
      continue
    seen.add(key)
    values, nbytes = (sum(v[i] for v in arrays.values()) for i in (0, 1))
    detail = ", ".join(f"{n} {v}" for n, (v, _) in arrays.items())
    print(f"layer {layer} ({kind}): {values} values = {nbytes} bytes ({detail}); "
          f"x{values / gqa_values:.3f} of GQA-{kv_heads}")
    rows[f"layers_{layer}"] = dict(kind=kind, values=values, bytes=nbytes,
                                   arrays={n: v for n, (v, _) in arrays.items()},
                                   ratio_to_gqa=values / gqa_values)
  return dict(layers=rows, gqa=dict(kv_heads=kv_heads, values=gqa_values, bytes=gqa_bytes,
                                    source=gqa_source,
                                    arrays={n: v for n, (v, _) in gqa_arrays.items()}))


# ---- prefill and decode throughput -----------------------------------------------------------


def _prefill(cfg, params, cache, tokens_BL, chunk):
  b, length = tokens_BL.shape
  out = None
  for start in range(0, length, chunk):
    piece = tokens_BL[:, start:start + chunk]
    positions = start + jnp.broadcast_to(jnp.arange(piece.shape[1], dtype=jnp.int32), piece.shape)
    out = decode_step(cfg, params, cache, piece, positions, jnp.ones_like(piece))
    cache = out.cache
  return out


def _decode(cfg, params, cache, last_BY, start, steps):
  b = last_BY.shape[0]
  for i in range(steps):
    tokens = jnp.argmax(last_BY, axis=-1).astype(jnp.int32)[:, None]
    out = decode_step(cfg, params, cache, tokens, jnp.full((b, 1), start + i, jnp.int32),
                      jnp.ones((b, 1), jnp.int32))
    cache, last_BY = out.cache, out.logits_BQY[:, 0]
  return cache, last_BY


def throughput_section(cfg, params, batch_sizes, prompt_len, chunk, steps, seed) -> dict:
  print(f"\n== prefill ({prompt_len} tokens per slot, chunks of {chunk}) and decode "
        f"({steps} steps of 1 token per slot), backend {jax.default_backend()}")
  max_len = prompt_len + 2 * steps
  rows = {}
  for b in batch_sizes:
    tokens = jax.random.randint(jax.random.key(seed + b), (b, prompt_len), 0, cfg.vocab_size)
    cache = init_cache(cfg, b, max_len, mtp_depths=0)
    out = jax.block_until_ready(_prefill(cfg, params, cache, tokens, chunk))  # compiles
    start = time.perf_counter()
    out = jax.block_until_ready(_prefill(cfg, params, out.cache, tokens, chunk))
    prefill_s = time.perf_counter() - start
    last = out.logits_BQY[:, -1]
    cache, last = jax.block_until_ready(
        _decode(cfg, params, out.cache, last, prompt_len, steps))  # compiles
    start = time.perf_counter()
    jax.block_until_ready(_decode(cfg, params, cache, last, prompt_len + steps, steps))
    step_s = (time.perf_counter() - start) / steps
    rows[b] = dict(prefill_tokens_per_s=b * prompt_len / prefill_s, decode_step_ms=1e3 * step_s,
                   decode_tokens_per_s=b / step_s)
  base = rows[batch_sizes[0]]
  for b, r in rows.items():
    r["decode_speedup"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    print(f"B={b:<4d} prefill {r['prefill_tokens_per_s']:>10,.1f} tokens/s | decode "
          f"{r['decode_step_ms']:8.2f} ms/step = {r['decode_tokens_per_s']:>10,.1f} tokens/s "
          f"(x{r['decode_speedup']:.2f} of B={batch_sizes[0]})")
  return rows


# ---- speculative decoding --------------------------------------------------------------------


def stdlib_prompts(tokenizer, n_prompts: int, prompt_len: int, seed: int) -> list:
  """`n_prompts` windows of `prompt_len` tokens of the Python standard library's source (the
  kind of text the tiny runs train on), from files and offsets drawn with `seed`. Only the
  held-out files of the `python_stdlib` source (its default `holdout_fraction`) are used, so
  the accept length is not inflated by text the model was trained on."""
  if tokenizer is None:
    raise app.UsageError("--spec_prompts_from=stdlib needs a tokenizer (a --workdir run's, or "
                         "--config's data.tokenizer)")
  spec = data_sources.source_config("python_stdlib")
  root, paths = data_sources.list_files("python_stdlib", spec)
  files = [p for p in paths if data_sources.unit_hash(os.path.relpath(p, root))
           < spec.holdout_fraction]
  rng = np.random.default_rng(seed)
  prompts = []
  while len(prompts) < n_prompts:
    with open(files[rng.integers(len(files))], encoding="utf-8", errors="replace") as f:
      ids = list(tokenizer.encode(f.read()))
    if len(ids) > prompt_len:
      start = int(rng.integers(len(ids) - prompt_len))
      prompts.append(ids[start:start + prompt_len])
  return prompts


def speculative_section(cfg, params, ks, schemes, prompts, new_tokens) -> dict:
  n_prompts, prompt_len = len(prompts), max(len(p) for p in prompts)
  max_len = prompt_len + new_tokens + max(ks)
  print(f"\n== speculative decoding ({n_prompts} prompts of {prompt_len} tokens, "
        f"{new_tokens} new tokens each, greedy)")

  def timed(k, **scheme):
    run = lambda: infer.generate(cfg, params, prompts, max_new_tokens=new_tokens,
                                 speculative_steps=k, max_len=max_len, **scheme)
    run()  # compiles
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start

  plain, plain_s = timed(0)
  tokens = sum(len(t) for t in plain.tokens)
  print(f"    plain k=0: {plain_s:.3f}s = {tokens / plain_s:,.1f} tokens/s")
  rows = {"plain": dict(seconds=plain_s, tokens_per_s=tokens / plain_s)}
  for scheme in schemes:
    for k in ks:
      result, seconds = timed(k, mtp_cache=scheme)
      accept = float(np.mean(result.accept_lengths))
      row = rows[f"{scheme}/k={k}"] = dict(
          seconds=seconds, tokens_per_s=sum(len(t) for t in result.tokens) / seconds,
          speedup=plain_s / seconds, accept_length=accept,
          same_tokens=result.tokens == plain.tokens)
      print(f"{scheme:>9s} k={k}: {seconds:.3f}s = {row['tokens_per_s']:,.1f} tokens/s, "
            f"speed-up x{row['speedup']:.2f}, mean accept length {accept:.3f}; output "
            f"{'equals' if row['same_tokens'] else 'DIFFERS FROM'} plain greedy")
  return rows


def run_bench(model, params, *, batch_sizes, prompt_len, prefill_chunk, decode_steps,
              speculative_steps, mtp_cache, spec_prompts, spec_new_tokens, gqa_kv_heads,
              seed) -> dict:
  """Every section (module docstring) for `model` (a model ConfigDict) and its params.
  `spec_prompts`: the speculative section's prompts (token-id lists), or how many random ones
  of `prompt_len` tokens."""
  cfg = ModelConfig.from_config(model)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"model: {cfg.num_hidden_layers} layers, pattern {cfg.attention_pattern}, hidden "
        f"{cfg.hidden_size}, {n_params:,} params, dsa_impl {cfg.dsa_impl}")
  out = dict(model=dict(layers=cfg.num_hidden_layers, pattern=cfg.attention_pattern,
                        params=n_params, backend=jax.default_backend()))
  out["cache"] = cache_section(model, gqa_kv_heads)
  out["throughput"] = throughput_section(cfg, params, batch_sizes, prompt_len,
                                         min(prefill_chunk, prompt_len), decode_steps, seed)
  if speculative_steps:
    if isinstance(spec_prompts, int):  # random token ids
      spec_prompts = np.random.default_rng(seed).integers(
          0, cfg.vocab_size, (spec_prompts, prompt_len)).tolist()
    out["speculative"] = speculative_section(cfg, params, speculative_steps, mtp_cache,
                                             spec_prompts, spec_new_tokens)
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  tokenizer = None
  if _WORKDIR.value:
    served = load_model(workdir=_WORKDIR.value)
    model, params, tokenizer = served.model, served.params, served.tokenizer
    if _LAYERS.value:
      raise app.UsageError("--layers cuts a random-init model; a --workdir run is served whole")
  else:
    model = _CONFIG.value.model
    if _LAYERS.value:
      model = keep_layers(model, _LAYERS.value)
    params = random_params(ModelConfig.from_config(model), _SEED.value)
    if _SPEC_FROM.value == "stdlib":
      tokenizer = data_lib.make_tokenizer(_CONFIG.value.data.tokenizer)
  spec_prompts = _SPEC_PROMPTS.value
  if _SPEC_FROM.value == "stdlib" and _SPECULATIVE.value:
    spec_prompts = stdlib_prompts(tokenizer, spec_prompts, _PROMPT_LEN.value, _SEED.value)
  out = run_bench(model, params, batch_sizes=[int(b) for b in _BATCH_SIZES.value],
                  prompt_len=_PROMPT_LEN.value, prefill_chunk=_PREFILL_CHUNK.value,
                  decode_steps=_DECODE_STEPS.value,
                  speculative_steps=[int(k) for k in _SPECULATIVE.value],
                  mtp_cache=_MTP_CACHE.value,
                  spec_prompts=spec_prompts, spec_new_tokens=_SPEC_NEW.value,
                  gqa_kv_heads=_GQA_KV_HEADS.value, seed=_SEED.value)
  print(json.dumps(out, default=str))


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
