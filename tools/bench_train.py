"""Steady-state training throughput of a config on the current backend.

  python tools/bench_train.py --config=configs/tiny.py [--steps=20] [--warmup=3]
  python tools/bench_train.py --config=configs/tiny.py:attention=M --config.data.seq_len=512

Builds the same trainer as experiments/train.py (mesh, shardings, jitted step), reports the
compile time separately, runs `--warmup` untimed steps, then times `--steps` steps on one
pre-fetched batch (device time only) and, side by side, the data pipeline's time per batch.
Prints tokens/s, step time, model TFLOP/s (FLOPs per token from the config), and MFU where the
device's peak is known (not on CPU).
"""

import json
import time

from absl import app, flags
import jax

from configs import overrides
from glm5_jax.train.metrics import flops_per_token, peak_flops_per_device
from glm5_jax.train.trainer import build_trainer

_CONFIG = overrides.define_config_file("config", "configs/tiny.py", "Experiment config.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps after compilation.")
_JSON = flags.DEFINE_bool("json", False, "Also print the results as one JSON line.")


def main(argv):
  del argv
  config = _CONFIG.value
  t = build_trainer(config)
  compiled, state, batch, compile_s = t.compile_first_step()

  for _ in range(_WARMUP.value):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(_STEPS.value):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  step_s = (time.perf_counter() - start) / _STEPS.value

  start = time.perf_counter()
  for _ in range(_STEPS.value):
    next(t.train_iter)
  data_s = (time.perf_counter() - start) / _STEPS.value

  tokens = config.data.batch_size * config.data.seq_len
  flops = flops_per_token(t.model, config.data.seq_len)
  peak = peak_flops_per_device()
  result = {
      "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
      "devices": jax.device_count(), "pattern": t.model.attention_pattern,
      "batch": config.data.batch_size, "microbatches": config.train.microbatches,
      "seq_len": config.data.seq_len,
      "compile_s": compile_s, "step_s": step_s, "tokens_per_sec": tokens / step_s,
      "flops_per_token": flops, "tflops_per_sec": tokens * flops / step_s / 1e12,
      "mfu": tokens * flops / step_s / (peak * jax.device_count()) if peak else None,
      "data_s_per_batch": data_s, "data_over_step": data_s / step_s,
  }
  rows = [("backend / devices", f"{result['backend']} ({result['device']}) x {result['devices']}"),
          ("batch x seq_len", f"{result['batch']} x {result['seq_len']} ({tokens:,} tokens)"
                              f" in {result['microbatches']} microbatch(es)"),
          ("compile", f"{compile_s:.2f} s"),
          ("step (steady state)", f"{step_s * 1e3:.1f} ms"),
          ("tokens/s", f"{result['tokens_per_sec']:,.0f}"),
          ("FLOPs/token (model)", f"{flops:,.0f}"),
          ("model TFLOP/s", f"{result['tflops_per_sec']:.4f}"),
          ("MFU", f"{result['mfu']:.1%}" if peak else "n/a (no known peak for this device)"),
          ("data pipeline / batch", f"{data_s * 1e3:.1f} ms ({result['data_over_step']:.2f}x "
                                    "the step)")]
  for name, value in rows:
    print(f"{name:<24} {value}")
  if _JSON.value:
    print(json.dumps(result))


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
