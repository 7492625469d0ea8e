"""Price a saved optimized TPU module op by op, without compiling it again.

  python tools/plan_cost.py --hlo=/work/plan_artifacts/headline_fsdp32_expert32.hlo.gz \
      --target=v5p:8x8x16 --plan_log=/work/plan_artifacts/headline.log [--json]

`--hlo`: the text `tools/plan_memory.py --hlo_out=...` wrote (gzip or plain), with its mesh's
chip coordinates beside it (`<hlo without .gz>.mesh.json`, or `--mesh_json`). `--plan_log`: the
output of that `plan_memory.py --json` run, whose last JSON line gives the tokens per chip, the
model FLOPs and the roofline bound of the same step (else `--tokens_per_chip` and
`--model_flops_per_token`). Prints `glm5_jax.planning.step_cost.format_report`: seconds per step
by category (the TPU compiler's estimated_cycles; custom calls at a stated efficiency), the
collectives on the slice's torus, and the step time and MFU with no overlap, the compiled
schedule's overlap, and ideal overlap, each a compiler estimate, beside the bound; then the
costliest instructions and the largest waits the schedule exposes, each charged to the
collective that caused it (`glm5_jax.planning.schedule.exposed_waits`). `--by_phase`: then the
compute of each category split by the phase of the model's program its instructions belong to
(`flop_ledger.model_phase`: forward; remat, every rematerialized computation, i.e. the
backward's rerun of each layer and the checkpoints inside a layer such as the indexer KL's
query blocks; backward; the optimizer and the loss outside the layers count as forward): what
the recompute costs, and where.
"""

import argparse
import dataclasses
import gzip
import json
import sys
import time
import types

from glm5_jax.planning import hlo_loops, step_cost


def _read(path: str) -> str:
  with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
    return f.read()


def _plan_json(path: str) -> dict:
  """The last JSON line of a `plan_memory.py --json` output."""
  with open(path) as f:
    lines = [line for line in f if line.startswith("{")]
  if not lines:
    raise SystemExit(f"--plan_log={path}: no JSON line (run plan_memory.py with --json)")
  return json.loads(lines[-1])


def format_by_phase(table: dict[str, dict[str, float]]) -> str:
  phases = step_cost.PHASES
  lines = ["compute by phase (seconds per step; compiler estimates, custom calls at the stated "
           "efficiency):", f"  {'':28s}" + "".join(f"{p:>10s}" for p in phases) + f"{'total':>10s}"]
  for name, row in list(table.items()) + [("compute", {p: sum(r[p] for r in table.values())
                                                        for p in phases})]:
    lines.append(f"  {name:28s}" + "".join(f"{row[p]:10.3f}" for p in phases)
                 + f"{sum(row.values()):10.3f}")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hlo", required=True)
  parser.add_argument("--target", required=True, help="the slice it was compiled for, e.g. "
                      "v5p:8x8x16")
  parser.add_argument("--mesh_json", default=None)
  parser.add_argument("--plan_log", default=None)
  parser.add_argument("--tokens_per_chip", type=float, default=None)
  parser.add_argument("--model_flops_per_token", type=float, default=None)
  parser.add_argument("--host_gb_s", type=float, default=None, help="price transfers to and "
                      "from host memory (a remat policy's offloaded residuals) at this many GB/s "
                      "one way, in place of the chip's stated host link "
                      "(glm5_jax/accelerators.py)")
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--by_phase", action="store_true", help="also the compute of each "
                      "category per phase: forward / remat (recompute) / backward")
  args = parser.parse_args(argv)
  if args.host_gb_s is not None and not args.host_gb_s > 0:
    parser.error(f"--host_gb_s: a bandwidth in GB/s > 0, got {args.host_gb_s}")
  layout_path = args.mesh_json or args.hlo.removesuffix(".gz") + ".mesh.json"
  with open(layout_path) as f:
    layout = json.load(f)
  tokens, per_token, bound = args.tokens_per_chip, args.model_flops_per_token, None
  if args.plan_log:
    estimate = _plan_json(args.plan_log)["estimate"]
    tokens = tokens or estimate["tokens_per_chip"]
    per_token = per_token or estimate["model_flops"] / estimate["tokens_per_chip"]
    bound = types.SimpleNamespace(**estimate)
  if tokens is None:
    raise SystemExit("give --plan_log, or --tokens_per_chip (and --model_flops_per_token for MFU)")
  start = time.perf_counter()
  module = hlo_loops.parse_module(_read(args.hlo))
  report = step_cost.price_module(
      module, args.target, layout, tokens, per_token,
      host_bytes_s=None if args.host_gb_s is None else args.host_gb_s * 1e9)
  print(f"{args.hlo}: parsed and priced in {time.perf_counter() - start:.0f} s; "
        f"{tokens:.0f} tokens per chip per step", file=sys.stderr)
  print(step_cost.format_report(report, bound=bound))
  if args.by_phase:
    print(format_by_phase(report.compute_by_phase))
  if args.json:
    print(json.dumps(dataclasses.asdict(report)))


if __name__ == "__main__":
  main()
