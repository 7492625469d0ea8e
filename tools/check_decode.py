"""Cached decode against the full forward, per attention kind: the max relative error table.

  python tools/check_decode.py                       # every letter, configs/tiny.py shapes
  python tools/check_decode.py --letters=D,S --length=64 --dtype=bfloat16

For each letter X, a 2-layer model with pattern "XX" ("MR" for R, whose selection comes from a
D layer: "DR"), MoE in the second layer, random params: prefill the first half of a sequence in
one call, then decode the rest one token at a time, and compare every position's logits with
`glm5_jax.logits` over the whole sequence: max |decode - full| / max |full|. Top-k is active
(`index_topk` < length) and SWA's window is shorter than the sequence (its ring wraps).
"""

from absl import app, flags
import jax
import numpy as np

import glm5_jax
from glm5_jax.infer import cache as cache_lib
from glm5_jax.infer import step

_LETTERS = flags.DEFINE_list("letters", ["D", "R", "M", "G", "S", "N", "L"], "Pattern letters.")
_LENGTH = flags.DEFINE_integer("length", 32, "Sequence length.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "model.dtype (and cache_dtype).")
_DSA_IMPL = flags.DEFINE_string("dsa_impl", "xla", "model.dsa_impl.")

PATTERNS = {"R": "DR"}


def max_relative_error(letter: str, length: int, dtype: str, dsa_impl: str) -> float:
  import configs.tiny  # pylint: disable=g-import-not-at-top
  model = configs.tiny.get_config().model
  model.update(num_hidden_layers=2, attention_pattern=PATTERNS.get(letter, letter * 2),
               first_k_dense_replace=1, index_topk=max(length // 4, 1),
               sliding_window=max(length // 4, 1), dtype=dtype, cache_dtype=dtype,
               dsa_impl=dsa_impl)
  cfg = glm5_jax.ModelConfig.from_config(model)
  params = glm5_jax.init_params(cfg, jax.random.key(0))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, length)).astype(np.int32)
  full = np.asarray(glm5_jax.logits(cfg, params, tokens), np.float32)
  cache = cache_lib.init_cache(cfg, 2, length)
  half = length // 2
  got = []
  for start, stop in [(0, half)] + [(p, p + 1) for p in range(half, length)]:
    positions = np.broadcast_to(np.arange(start, stop, dtype=np.int32), (2, stop - start))
    out = step.decode_step(cfg, params, cache, tokens[:, start:stop], positions,
                           np.ones_like(positions))
    cache = out.cache
    got.append(np.asarray(out.logits_BQY, np.float32))
  got = np.concatenate(got, axis=1)
  return float(np.abs(got - full).max() / np.abs(full).max())


def main(argv):
  del argv
  print(f"cached decode vs full forward, length {_LENGTH.value}, {_DTYPE.value}, "
        f"dsa_impl {_DSA_IMPL.value} (prefill half, then one token per call)")
  print("| letter | pattern | max relative error |")
  print("|---|---|---|")
  for letter in _LETTERS.value:
    err = max_relative_error(letter, _LENGTH.value, _DTYPE.value, _DSA_IMPL.value)
    print(f"| {letter} | {PATTERNS.get(letter, letter * 2)} | {err:.1e} |", flush=True)


if __name__ == "__main__":
  app.run(main)
