"""Forward pass of a config's model on random tokens: a quick end-to-end check of a config.

  python experiments/forward.py                                   # tiny GLM-5 (the default)
  python experiments/forward.py --config=configs/tiny.py:attention=G --batch=4
  python experiments/forward.py --config.model.index_topk=8

Initializes the model, runs the main head and the MTP depths, and prints parameter count,
compile and steady-state time, the init loss (about ln(vocab) for a fresh model), per-depth MTP
loss, the expert load spread per MoE layer, and the fraction of visible keys each DSA layer
keeps (the last only with `--config.model.scan_layers=False`: a scanned run does not return its
layers' selections).
"""

import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import glm5_jax
from configs import overrides
from glm5_jax.config import ModelConfig
from glm5_jax.config_validation import validate_config
from glm5_jax.layer_runs import layer_indices, unrolled_name
from glm5_jax.train import console, losses

_CONFIG = overrides.define_config_file("config", "configs/tiny.py", "Experiment config.")
_BATCH = flags.DEFINE_integer("batch", 2, "Batch size.")
_SEQ = flags.DEFINE_integer("seq", 64, "Sequence length.")


def main(argv):
  del argv
  console.quiet_library_info()  # before the first backend use: jax's TPU probe line
  console.announce_slow_compiles()
  config = _CONFIG.value
  validate_config(config)
  model = ModelConfig.from_config(config.model)
  seq = _SEQ.value
  rng_params, rng_tokens = jax.random.split(jax.random.key(config.get("seed", 0)))
  params = glm5_jax.init_params(model, rng_params)
  tokens = jax.random.randint(rng_tokens, (_BATCH.value, seq), 0, model.vocab_size)
  count = sum(x.size for x in jax.tree_util.tree_leaves(params))
  print(f"model: {model.num_hidden_layers} layers, pattern {model.attention_pattern}, "
        f"{model.n_routed_experts} experts top-{model.num_experts_per_tok}, index top-k "
        f"{model.index_topk}, MTP depths {model.mtp_depths}; {count:,} params; backend "
        f"{jax.default_backend()}")

  def forward_pass(p, t):  # named: the compile line says "compiling jit(forward_pass)"
    return glm5_jax.forward(model, p, t)

  forward = jax.jit(forward_pass)
  start = time.time()
  out = jax.block_until_ready(forward(params, tokens))
  compile_s = time.time() - start
  start = time.time()
  out = jax.block_until_ready(forward(params, tokens))
  print(f"forward [{_BATCH.value}, {seq}]: first call {compile_s:.2f}s (with compile), then "
        f"{time.time() - start:.3f}s")

  batch = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens),
           "loss_mask": jnp.ones(tokens.shape, jnp.float32)}
  print(f"init loss {float(losses.lm_losses(out, batch)['ce']):.3f} "
        f"(ln vocab = {np.log(model.vocab_size):.3f})")
  for d, depth in enumerate(losses.mtp_losses(out, batch), start=1):
    print(f"  MTP depth {d} loss {float(depth['ce']):.3f}")
  causal_keys = seq * (seq + 1) / 2
  for name, aux in out["aux"]["layers"].items():
    stacked = name != unrolled_name(layer_indices(name)[0])  # a scanned run: [layers, ...]
    for j, layer in enumerate(layer_indices(name)):
      parts = []
      if "topk_indices" in aux:
        kept = float((aux["topk_indices"] >= 0).sum()) / (_BATCH.value * causal_keys)
        parts.append(f"DSA keeps {kept:.1%} of visible keys")
      if "expert_counts" in aux:
        counts = np.asarray(aux["expert_counts"][j] if stacked else aux["expert_counts"])
        parts.append(f"expert load min/max {counts.min()}/{counts.max()}")
      if parts:
        print(f"  layer {layer}: " + "; ".join(parts))

if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
