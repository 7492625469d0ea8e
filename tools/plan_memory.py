"""AOT memory planner: does a config's train step (or serving prefill) fit a chip's HBM?

  python tools/plan_memory.py --config=configs/glm5_744b.py --devices=64 --mesh=fsdp=16,expert=4 \
      --layers=2,4 --seq_len=4096 --per_device_batch=1 --remat_policy=full --accelerator=v5p
  python tools/plan_memory.py --config=configs/tiny.py --devices=8 --mesh=fsdp=2,expert=2,tensor=2
  python tools/plan_memory.py --config=configs/glm5_744b.py --devices=64 --mesh=fsdp=16,expert=4 \
      --layers=2,4 --mode=serve --config.model.param_dtype=bfloat16

Simulates `--devices` CPU devices (`--xla_force_host_platform_device_count`, set here before jax
starts), builds the mesh from the config's `mesh` section with `--mesh` axis sizes on top, and
compiles the real step from abstract inputs (`glm5_jax.planner`): nothing is allocated or run.
Prints per-device argument / output / alias / temp / generated-code bytes, their total against
v5p / v6e / H100 / H200 HBM, and the collectives of the optimized HLO. `--mode=serve` adds the
KV cache of the prefill's batch (computed from `glm5_jax.param_stats`, not compiled) to the
verdict.

`--layers=2,4,8` compiles those depths (1 dense + k-1 MoE layers) and extrapolates linearly to
the config's depth; the argument bytes at full depth are exact (abstract shapes, no compile).
Every printed figure says whether it was compiled or extrapolated. Without `--layers` the full
depth is compiled. `--config.<field>=...` overrides any config field (e.g.
`--config.model.dsa_impl=xla`, `--config.model.scan_layers=False`).
"""

import json
import os
import sys


def _flag_value(argv, name):
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


# The simulated devices exist only if XLA sees the flag before jax initializes its backend, so
# it is read from argv here, before anything imports jax (absl parses it again below).
_DEVICES = _flag_value(sys.argv, "devices")
if _DEVICES is not None and _DEVICES.isdigit():
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={_DEVICES}").strip()
  os.environ["JAX_PLATFORMS"] = "cpu"

from absl import app, flags  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top

from configs import overrides
from glm5_jax import planner  # pylint: disable=g-import-not-at-top
from glm5_jax.config import ConfigError  # pylint: disable=g-import-not-at-top
from glm5_jax.config_validation import validate_config  # pylint: disable=g-import-not-at-top
from glm5_jax.sharding import MESH_AXES  # pylint: disable=g-import-not-at-top
from glm5_jax.train import console  # pylint: disable=g-import-not-at-top

_CONFIG = overrides.define_config_file("config", "configs/tiny.py", "Experiment config.")
_DEVICES_FLAG = flags.DEFINE_integer("devices", None, "Simulated devices (the mesh's size).",
                                     required=True)
_MESH = flags.DEFINE_string("mesh", "", "Mesh axis sizes over the config's, e.g. "
                            "'fsdp=64,expert=4' (axes: data, fsdp, expert, tensor).")
_LAYERS = flags.DEFINE_list("layers", [], "Depths to compile and extrapolate from, e.g. "
                            "2,4,8; empty: compile the config's full depth.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "data.seq_len (default: the config's).")
_PER_DEVICE_BATCH = flags.DEFINE_integer("per_device_batch", 1, "Sequences per device along "
                                         "the mesh axes the batch is split over.")
_REMAT = flags.DEFINE_string("remat_policy", None, "model.remat_policy (default: the "
                             "config's).")
_ACCELERATOR = flags.DEFINE_enum("accelerator", "v5p", list(planner.ACCELERATOR_HBM_GIB),
                                 "The chip whose HBM the verdict is for.")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "serve"], "train: the train step with "
                          "optimizer state; serve: prefill logits, params only.")
_TOP = flags.DEFINE_integer("top", 5, "Largest collectives listed.")
_JSON = flags.DEFINE_bool("json", False, "Also print every figure as one JSON line.")


def _parse_mesh(text: str) -> dict[str, int]:
  axes = {}
  for item in filter(None, text.split(",")):
    name, _, size = item.partition("=")
    if name not in MESH_AXES or not size.lstrip("-").isdigit():
      raise ConfigError(f"--mesh: expected comma-separated axis=size with axes {MESH_AXES}, "
                        f"got {item!r}")
    axes[name] = int(size)
  return axes


def _gib(n: float) -> str:
  return f"{n / planner.GIB:9.2f}"


def main(argv):
  del argv
  console.quiet_library_info()
  config = _CONFIG.value
  if jax.device_count() != _DEVICES_FLAG.value:
    raise SystemExit(f"--devices={_DEVICES_FLAG.value} but jax sees {jax.device_count()} "
                     "devices: pass --devices as its own argument, before jax starts")
  if _REMAT.value is not None:
    config.model.remat_policy = _REMAT.value
  config = planner.with_layout(config, jax.device_count(), _parse_mesh(_MESH.value),
                               _SEQ_LEN.value or config.data.seq_len, _PER_DEVICE_BATCH.value)
  validate_config(config, jax.device_count())
  full_depth = config.model.num_hidden_layers
  depths = sorted({int(k) for k in _LAYERS.value}) or [full_depth]
  build = planner.train_program if _MODE.value == "train" else planner.serve_program
  m = config.model
  print(f"plan: {_MODE.value}, {jax.device_count()} simulated devices, mesh "
        f"{dict(config.mesh.shape)}; seq_len {config.data.seq_len}, global batch "
        f"{config.data.batch_size} ({_PER_DEVICE_BATCH.value} per device); remat "
        f"{m.remat_policy}, scan_layers {m.scan_layers}, dsa_impl {m.dsa_impl}, moe_impl "
        f"{m.moe_impl}; model depth {full_depth}", flush=True)

  results = []
  for k in depths:
    cfg, mix = planner.with_depth(config, k)
    print(f"compiling depth {k} ({mix}) ...", flush=True)
    program = build(cfg)
    if program.moe_standin:
      print("  MoE via stand-in (glm5_jax/cpu_standins.py): ragged_dot as a capacity-padded "
            "grouped einsum [E, ceil(P/E), D] x [E, D, F], ragged-all-to-all as a dense "
            "all-to-all of the send buffer", flush=True)
    figures = planner.compile_program(program)
    mem = figures.memory
    print(f"  done in {figures.compile_s:.1f} s (HLO {figures.hlo_chars / 1e6:.1f} M chars): "
          f"argument {mem.argument / planner.GIB:.2f}, temp {mem.temp / planner.GIB:.2f}, total "
          f"{mem.total / planner.GIB:.2f} GiB per device", flush=True)
    if figures.memory.argument != program.state_bytes:
      raise SystemExit(f"depth {k}: compiled argument bytes {figures.memory.argument} differ "
                       f"from the abstract inputs' shards {program.state_bytes}")
    results.append((k, figures))
  label = " (MoE via stand-in)" if program.moe_standin else ""

  fields = ("argument", "output", "alias", "temp", "generated_code")
  rows = {f: [getattr(r.memory, f) for _, r in results] for f in fields}
  rows["total"] = [r.memory.total for _, r in results]
  extra = {}  # the last column: depth `full_depth`, when it was not compiled
  extrapolated = depths[-1] != full_depth and len(depths) >= 2
  if depths[-1] != full_depth:
    print(f"argument bytes at depth {full_depth}: exact from abstract shapes (no compile) ...",
          flush=True)
    extra["argument"] = build(config).state_bytes
  if extrapolated:
    for f in fields[1:]:
      slope, intercept = planner.fit_line(depths, rows[f])
      extra[f] = intercept + slope * full_depth
    extra["total"] = extra["argument"] + extra["output"] - extra["alias"] + extra["temp"]
  elif depths[-1] != full_depth:
    print(f"one depth compiled: nothing extrapolated to depth {full_depth} (give --layers two "
          "depths or more)")

  print(f"\nper-device memory, GiB{label}{'':10}" + "".join(f"{'depth ' + str(k):>12}" for k in depths)
        + (f"{'depth ' + str(full_depth):>14}" if extra else ""))
  print(f"{'':32}" + f"{'compiled':>12}" * len(depths) +
        (f"{'extrapolated' if extrapolated else '':>14}" if extra else ""))
  for f in list(fields) + ["total"]:
    label = {"total": "total (arg + out - alias + temp)"}.get(f, f)
    last = f"   {_gib(extra[f])}" if f in extra else ""
    last += "  (exact)" if f == "argument" and extra else ""
    print(f"  {label:<30}" + "".join(f"   {_gib(v)}" for v in rows[f]) + last)

  verdict_depth = full_depth if extrapolated or depths[-1] == full_depth else depths[-1]
  total = extra["total"] if extrapolated else rows["total"][-1]
  cache = 0
  if _MODE.value == "serve":
    cache_cfg, _ = planner.with_depth(config, verdict_depth)
    cache = planner.kv_cache_bytes(cache_cfg)
    print(f"  {'+ KV cache (computed, bf16)':<30}   {_gib(cache)}  for {config.data.batch_size} "
          f"sequences x {config.data.seq_len} tokens at depth {verdict_depth} "
          "(glm5_jax.param_stats; not part of the compiled prefill)")
    total += cache
  verdict = planner.fits(total)
  how = "extrapolated" if extrapolated else "compiled"
  print(f"\nfits HBM (depth {verdict_depth}, {how}: {total / planner.GIB:.2f} GiB per device):")
  for name, gib in planner.ACCELERATOR_HBM_GIB.items():
    mark = "  <== chosen" if name == _ACCELERATOR.value else ""
    print(f"  {name:<5} {gib:4d} GiB  {'fits' if verdict[name] else 'does not fit'}{mark}")

  k, deepest = results[-1]
  summary = planner.summarize_collectives(deepest.collectives)
  print(f"\ncollectives (compiled, depth {k}; per device, result bytes; an instruction in a "
        "loop body counts once):")
  for kind, s in summary.items():
    print(f"  {kind:<20} {s['count']:5d} ops  {s['bytes'] / planner.GIB:9.3f} GiB")
  if not summary:
    print("  none")
  for c in sorted(deepest.collectives, key=lambda c: -c.bytes)[:_TOP.value]:
    print(f"  largest: {c.kind:<18} {c.bytes / 2**20:10.1f} MiB  {c.result_type[:70]}")

  if _JSON.value:
    print(json.dumps({
        "mode": _MODE.value, "devices": jax.device_count(), "mesh": dict(config.mesh.shape),
        "accelerator": _ACCELERATOR.value, "depth": full_depth, "extrapolated": extrapolated,
        "verdict_depth": verdict_depth, "total": total, "kv_cache": cache,
        "moe_standin": program.moe_standin,
        "compiled": [{"layers": k, "compile_s": r.compile_s, "hlo_chars": r.hlo_chars,
                      "memory": {**dataclasses_asdict(r.memory), "total": r.memory.total},
                      "collectives": planner.summarize_collectives(r.collectives)}
                     for k, r in results],
        "full_depth": extra, "fits": verdict}))


def dataclasses_asdict(x):
  import dataclasses  # pylint: disable=g-import-not-at-top
  return dataclasses.asdict(x)


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
