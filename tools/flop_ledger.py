"""The train step's matmul FLOPs per category and phase, as a platform runs them, from this host.

  nice python tools/flop_ledger.py --config=configs/glm5_gpu_3b.py:dsa_impl=xla \
      --platform=cuda --set=model.num_hidden_layers=3 [--hlo_out=step.hlo.gz] [--json]
  python tools/flop_ledger.py --hlo=step.hlo.gz --platform=cuda --config=...   (saved text)

Lowers the trainer's own jitted step (`glm5_jax.planning.planner.train_program`: the config's
optimizer, donated state, remat, scan) for `--platform` with
`jit(...).trace(...).lower(lowering_platforms=(platform,))` -- no device of that kind needed,
nothing compiled -- and prints `glm5_jax.planning.flop_ledger.format_table`: TFLOP per step per
category x phase (forward / remat / backward / optimizer), the dots' dtypes, and the ratio to
the model FLOPs (`train.metrics.flops_per_token` x tokens per step). `ragged-dot`s are priced as
the platform's compiler runs them at default flags (XLA GPU: a dense masked dot over all
groups) beside their useful FLOPs (a grouped matmul's). `--hlo` reads a saved module instead
(one `--hlo_out` wrote, or the device suite's `train_step.hlo.txt.gz`; a device's compiled
module parses, but its cuBLAS GEMM custom calls are counted, not priced:
`glm5_jax.planning.flop_ledger`).

`--set=a.b=value` overrides one config field (repeatable; value parsed as a Python literal,
else a string). Lowering the 3B config at 3 layers takes ~1 min on this 2-core host.
"""

import argparse
import ast
import gzip
import importlib.util
import json
import sys
import time

import jax


def load_config(spec: str, overrides: list[str]):
  """`path[:arg]` -> the module's `get_config(arg)` with each `a.b=value` of `overrides`."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("ledger_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(arg or None)
  for item in overrides:
    key, _, text = item.partition("=")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    if leaf not in node:
      raise SystemExit(f"--set={item}: config has no field {key!r}")
    node[leaf] = value
  return config


def lowered_text(config, platform: str) -> str:
  """The HLO text (with op_name metadata) of the train step lowered for `platform`."""
  from glm5_jax import sharding
  from glm5_jax.planning import planner
  from pallas_kernels import blocking
  program = planner.train_program(config)
  # `lowering_for`: `dsa_impl="pallas"` picks the platform's kernels (Triton on a GPU).
  with sharding.activation_sharding(program.mesh, program.rules), blocking.lowering_for(platform):
    lowered = program.fn.trace(*program.args).lower(lowering_platforms=(platform,))
  return lowered.compiler_ir("hlo").get_hlo_module().to_string()


def model_flops(config) -> float:
  """The model FLOPs of one step: `flops_per_token` x batch x sequence."""
  from glm5_jax.config import ModelConfig
  from glm5_jax.train.metrics import flops_per_token
  model = ModelConfig.from_config(config.model)
  tokens = config.data.batch_size * config.data.seq_len
  return flops_per_token(model, config.data.seq_len) * tokens


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True, help="path[:arg] of a configs/*.py")
  parser.add_argument("--set", action="append", default=[], help="a.b=value override")
  parser.add_argument("--platform", default="cuda", help="cuda | rocm | tpu | cpu")
  parser.add_argument("--hlo", default=None, help="a saved HLO text (gzip or plain) instead")
  parser.add_argument("--hlo_out", default=None, help="write the lowered HLO text (.gz: gzip)")
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)
  from glm5_jax.planning import flop_ledger

  config = load_config(args.config, args.set)
  start = time.perf_counter()
  if args.hlo:
    with (gzip.open(args.hlo, "rt") if args.hlo.endswith(".gz") else open(args.hlo)) as f:
      text = f.read()
  else:
    text = lowered_text(config, args.platform)
  if args.hlo_out:
    with (gzip.open(args.hlo_out, "wt") if args.hlo_out.endswith(".gz")
          else open(args.hlo_out, "w")) as f:
      f.write(text)
  rows, calls, unknown = flop_ledger.ledger(text, args.platform)
  print(f"{args.config} {' '.join(args.set)}: {args.platform}, "
        f"{time.perf_counter() - start:.0f} s, jax {jax.__version__}", file=sys.stderr)
  reference = model_flops(config)
  print(flop_ledger.format_table(rows, reference))
  if calls:
    print("custom calls per step (FLOPs not counted):",
          ", ".join(f"{k} x{v}" for k, v in sorted(calls.items())))
  if unknown:
    print(f"{len(unknown)} while loops with no readable trip count, counted once: {unknown}")
  if args.json:
    print(json.dumps({"platform": args.platform, "model_flops": reference,
                      "rows": [vars(r) for r in rows], "custom_calls": calls,
                      "unknown_loops": unknown}))


if __name__ == "__main__":
  main()
