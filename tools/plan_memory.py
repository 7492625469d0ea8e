"""AOT memory planner: does a config's train step (or serving prefill) fit a chip's HBM?

  python tools/plan_memory.py --config=configs/glm5_744b.py --devices=64 --mesh=fsdp=16,expert=4 \
      --layers=2,4 --seq_len=4096 --per_device_batch=1 --remat_policy=full --accelerator=v5p
  python tools/plan_memory.py --config=configs/tiny.py --devices=8 --mesh=fsdp=2,expert=2,tensor=2
  python tools/plan_memory.py --config=configs/glm5_744b.py --devices=64 --mesh=fsdp=16,expert=4 \
      --layers=2,4 --mode=serve --config.model.param_dtype=bfloat16
  python tools/plan_memory.py --config=configs/glm5_744b.py --target=v5p:8x8x16 \
      --mesh=fsdp=64,expert=4,tensor=4 --seq_len=4096 --remat_policy=full   # the TPU compiler

Compiler: with `--target=v5p:XxYxZ` (or `v5e:XxY`, `v6e:XxY`) the real TPU compiler compiles
for that slice ahead of time (`glm5_jax.aot_targets`; needs the `tpu-aot` install extra, no
TPU), with no stand-ins. Otherwise XLA:CPU compiles for `--devices` simulated CPU devices
(`--xla_force_host_platform_device_count`, set here before jax starts), with the MoE stand-ins
of `glm5_jax.cpu_standins`; every figure is labelled with the compiler that produced it.
The mesh comes from the config's `mesh` section with `--mesh` axis sizes on top, and the real
step is compiled from abstract inputs (`glm5_jax.planner`): nothing is allocated or run.
Prints per-device argument / output / alias / temp / generated-code bytes, their total against
each chip's HBM, and per step (every instruction times its loops' trip counts): the
collectives by kind, mesh axes and source, matmul FLOPs, and a roofline estimate of the step
time and MFU on the chosen chip (`glm5_jax.roofline`: an estimate, not a measurement).
`--mode=serve` adds the KV cache of the prefill's batch (computed from `glm5_jax.param_stats`,
not compiled) to the verdict.

`--layers=2,4,8` compiles those depths (1 dense + k-1 MoE layers) and extrapolates linearly to
the config's depth; the argument bytes at full depth are exact (abstract shapes, no compile).
Every printed figure says whether it was compiled or extrapolated. Without `--layers` the full
depth is compiled. `--config.<field>=...` overrides any config field (e.g.
`--config.model.dsa_impl=xla`, `--config.model.scan_layers=False`).
"""

import functools
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
if _flag_value(sys.argv, "target"):
  # The host compiles for the target through libtpu's topology API; jax's own backend stays
  # the CPU (it would otherwise try to open a local TPU).
  os.environ["JAX_PLATFORMS"] = "cpu"
elif _DEVICES is not None and _DEVICES.isdigit():
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={_DEVICES}").strip()
  os.environ["JAX_PLATFORMS"] = "cpu"

from absl import app, flags  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top

from configs import overrides  # pylint: disable=g-import-not-at-top
from glm5_jax import aot_targets, hlo_stats, planner, roofline  # pylint: disable=g-import-not-at-top
from glm5_jax.config import ConfigError  # pylint: disable=g-import-not-at-top
from glm5_jax.config_validation import validate_config  # pylint: disable=g-import-not-at-top
from glm5_jax.sharding import MESH_AXES  # pylint: disable=g-import-not-at-top
from glm5_jax.train import console  # pylint: disable=g-import-not-at-top
from glm5_jax.train.metrics import flops_per_token  # pylint: disable=g-import-not-at-top

_CONFIG = overrides.define_config_file("config", "configs/tiny.py", "Experiment config.")
_DEVICES_FLAG = flags.DEFINE_integer("devices", None, "Simulated CPU devices (the mesh's "
                                     "size); not with --target.")
_TARGET = flags.DEFINE_string("target", None, "Compile with the TPU compiler for this slice, "
                              "e.g. v5p:8x8x16, v5e:16x16, v6e:8x16 (needs the tpu-aot extra).")
_MESH = flags.DEFINE_string("mesh", "", "Mesh axis sizes over the config's, e.g. "
                            "'fsdp=64,expert=4' (axes: data, fsdp, expert, tensor).")
_LAYERS = flags.DEFINE_list("layers", [], "Depths to compile and extrapolate from, e.g. "
                            "2,4,8; empty: compile the config's full depth.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "data.seq_len (default: the config's).")
_PER_DEVICE_BATCH = flags.DEFINE_integer("per_device_batch", 1, "Sequences per device along "
                                         "the mesh axes the batch is split over.")
_REMAT = flags.DEFINE_string("remat_policy", None, "model.remat_policy (default: the "
                             "config's).")
_ACCELERATOR = flags.DEFINE_enum("accelerator", None, list(planner.ACCELERATOR_HBM_GIB),
                                 "The chip the verdict and the roofline are for (default: "
                                 "the --target's chip, else v5p).")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "serve"], "train: the train step with "
                          "optimizer state; serve: prefill logits, params only.")
_TOP = flags.DEFINE_integer("top", 5, "Largest collectives and sources listed.")
_JSON = flags.DEFINE_bool("json", False, "Also print every figure as one JSON line.")
_HLO_OUT = flags.DEFINE_string("hlo_out", None, "Write the deepest compiled program's optimized "
                               "HLO text to this file.")


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
  devices, chip = None, _ACCELERATOR.value or "v5p"
  if _TARGET.value:
    if _DEVICES_FLAG.value is not None:
      raise SystemExit("--target and --devices exclude each other: the target's slice sets "
                       "the device count")
    target_chip, _ = aot_targets.parse_target(_TARGET.value)
    if _ACCELERATOR.value not in (None, target_chip):
      raise SystemExit(f"--accelerator={_ACCELERATOR.value} contradicts --target="
                       f"{_TARGET.value}")
    chip = target_chip
    devices = aot_targets.tpu_devices(_TARGET.value)
    where = f"{len(devices)} {target_chip} chips ({_TARGET.value}), TPU compiler ahead of time"
  else:
    if _DEVICES_FLAG.value is None:
      raise SystemExit("give --devices=N (simulated CPU devices) or --target=<TPU slice>")
    if jax.device_count() != _DEVICES_FLAG.value:
      raise SystemExit(f"--devices={_DEVICES_FLAG.value} but jax sees {jax.device_count()} "
                       "devices: pass --devices as its own argument, before jax starts")
    where = f"{jax.device_count()} simulated devices, XLA:CPU (a CPU stand-in for {chip})"
  num_devices = len(devices) if devices else jax.device_count()
  if _REMAT.value is not None:
    config.model.remat_policy = _REMAT.value
  config = planner.with_layout(config, num_devices, _parse_mesh(_MESH.value),
                               _SEQ_LEN.value or config.data.seq_len, _PER_DEVICE_BATCH.value)
  validate_config(config, num_devices)
  full_depth = config.model.num_hidden_layers
  depths = sorted({int(k) for k in _LAYERS.value}) or [full_depth]
  build = functools.partial(
      planner.train_program if _MODE.value == "train" else planner.serve_program,
      devices=devices)
  m = config.model
  print(f"plan: {_MODE.value}, {where}, mesh "
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
    figures = planner.compile_program(program, hlo_out=_HLO_OUT.value)
    mem = figures.memory
    print(f"  done in {figures.compile_s:.1f} s (HLO {figures.hlo_chars / 1e6:.1f} M chars): "
          f"argument {mem.argument / planner.GIB:.2f}, temp {mem.temp / planner.GIB:.2f}, total "
          f"{mem.total / planner.GIB:.2f} GiB per device", flush=True)
    if program.platform == "tpu":  # TPU layouts pad arrays to (8, 128) tiles
      print(f"  argument bytes with TPU tile padding {mem.argument / planner.GIB:.3f} GiB, "
            f"unpadded shards {program.state_bytes / planner.GIB:.3f} GiB", flush=True)
    elif figures.memory.argument != program.state_bytes:
      raise SystemExit(f"depth {k}: compiled argument bytes {figures.memory.argument} differ "
                       f"from the abstract inputs' shards {program.state_bytes}")
    results.append((k, figures, program, cfg))
  label = " (MoE via stand-in)" if program.moe_standin else ""

  fields = ("argument", "output", "alias", "temp", "generated_code")
  rows = {f: [getattr(r.memory, f) for _, r, *_ in results] for f in fields}
  rows["total"] = [r.memory.total for _, r, *_ in results]
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

  k, deepest, program, cfg = results[-1]
  estimate = _report_step(k, deepest, program, cfg, chip)
  full_step = None
  if extrapolated:
    full_step = _report_extrapolated_step(depths, [r for _, r, *_ in results], full_depth,
                                          program, cfg, config, chip)

  if _JSON.value:
    print(json.dumps({
        "mode": _MODE.value, "devices": num_devices, "mesh": dict(config.mesh.shape),
        "accelerator": chip, "target": _TARGET.value, "compiler": deepest.compiler,
        "depth": full_depth, "extrapolated": extrapolated,
        "verdict_depth": verdict_depth, "total": total, "kv_cache": cache,
        "moe_standin": program.moe_standin,
        "compiled": [{"layers": k, "compile_s": r.compile_s, "hlo_chars": r.hlo_chars,
                      "memory": {**dataclasses_asdict(r.memory), "total": r.memory.total},
                      "flops_per_step": r.flops, "cost_analysis_flops": r.cost_analysis_flops,
                      "unknown_loops": len(r.unknown_loops),
                      "collectives_per_step": {
                          key: hlo_stats.summarize_step(list(r.collectives), key)
                          for key in ("op", "axes")}}
                     for k, r, *_ in results],
        "estimate": dataclasses_asdict(estimate), "full_depth": extra, "fits": verdict,
        "full_depth_step": full_step}))


def _report_step(k, figures, program, cfg, chip):
  """Prints the per-step collectives, FLOPs and the roofline of the depth-k program."""
  found = list(figures.collectives)
  gib = lambda n: f"{n / planner.GIB:10.2f}"
  print(f"\nper step, depth {k}, {figures.compiler}; per device; every instruction times the "
        "trip counts of its enclosing loops:")
  if figures.unknown_loops:
    print(f"  WARNING: {len(figures.unknown_loops)} while loops of unreadable trip count, their "
          f"bodies counted once: {', '.join(figures.unknown_loops[:5])}")
  print(f"  {'collectives by kind':<34}{'runs':>8}{'GiB':>11}{'sent GiB':>11}")
  for title, key in (("collectives by kind", "op"), ("by mesh axes", "axes")):
    if title != "collectives by kind":
      print(f"  {title}")
    for name, s in hlo_stats.summarize_step(found, key).items():
      print(f"    {name or '(one device)':<32}{s['count']:8d}{gib(s['bytes'])}"
            f"{gib(s['link_bytes'])}")
  if not found:
    print("    none")
  total = sum(c.bytes * c.runs for c in found)
  print(f"    {'total':<32}{'':8}{gib(total)}{gib(sum(c.link_bytes * c.runs for c in found))}")
  print(f"  largest sources (op_name), top {_TOP.value}:")
  for name, s in list(hlo_stats.summarize_step(found, "source").items())[:_TOP.value]:
    print(f"    {gib(s['bytes'])} GiB  {s['count']:6d} runs  ...{name[-90:]}")
  print("  largest collectives per step (bytes x runs):")
  for c in sorted(found, key=lambda c: -c.bytes * c.runs)[:_TOP.value]:
    print(f"    {c.op:<18} {gib(c.bytes * c.runs)} GiB = {c.bytes / 2**20:9.1f} MiB x {c.runs:5d}"
          f"  over {c.axes or '-'} ({c.group})  ...{c.source[-60:]}")
  print(f"  matmul FLOPs per step: {figures.flops:.4g} (dots and convolutions, loops "
        f"multiplied); compiled.cost_analysis(): {figures.cost_analysis_flops:.4g} (loop bodies "
        f"once); custom calls per step (FLOPs not counted): {figures.custom_calls}")

  model = planner.ModelConfig.from_config(cfg.model)
  tokens = cfg.data.batch_size * cfg.data.seq_len / program.mesh.size
  per_token = flops_per_token(model, cfg.data.seq_len)
  if _MODE.value == "serve":
    per_token /= 3  # a forward pass: a third of training's forward + backward
  est = planner.step_estimate(figures, program, chip, tokens, per_token)
  spec = roofline.CHIPS[chip]
  print(f"\nroofline on {chip} ({spec.peak_flops / 1e12:.0f} TFLOP/s bf16, "
        f"{spec.ici_bytes_s / 1e9:.0f} GB/s per direction"
        f"{'' if spec.scale_out_bytes_s is None else f' in a node, {spec.scale_out_bytes_s / 1e9:.0f} GB/s across'}"
        f"): an ESTIMATE from the program {figures.compiler} compiled, not a measurement")
  print(f"  compute {est.compute_s:8.3f} s   ({figures.flops:.4g} FLOPs / peak)")
  for axes, seconds in sorted(est.comm_s.items(), key=lambda kv: -kv[1]):
    print(f"  comm    {seconds:8.3f} s   over {axes or '(one device)'}")
  print(f"  step    {est.overlap_s:8.3f} s with perfect overlap, {est.serial_s:.3f} s without")
  print(f"  {tokens:.0f} tokens per chip per step: {est.tokens_per_s_per_chip['overlap']:.1f} / "
        f"{est.tokens_per_s_per_chip['serial']:.1f} tokens/s per chip (overlap / none)")
  print(f"  MFU {100 * est.mfu['overlap']:.1f}% / {100 * est.mfu['serial']:.1f}% (overlap / none; "
        f"model FLOPs {per_token:.4g} per token, glm5_jax.train.metrics.flops_per_token"
        f"{' / 3' if _MODE.value == 'serve' else ''}, at depth {k})")
  return est


def _report_extrapolated_step(depths, figures, full_depth, program, cfg, config, chip):
  """The per-step collectives (by kind, and sent bytes by mesh axes) and matmul FLOPs of the
  compiled depths, each fitted by a line in depth and evaluated at `full_depth` (as the memory
  columns are: the scanned layers' loop runs once per layer, so each is linear in depth), and
  the roofline of that step. Returns them for the JSON."""
  def at_full(ys):
    slope, intercept = planner.fit_line(depths, ys)
    return intercept + slope * full_depth
  summaries = [{key: hlo_stats.summarize_step(list(f.collectives), key) for key in ("op", "axes")}
               for f in figures]
  column = lambda key, name, field: [s[key].get(name, {}).get(field, 0.0) for s in summaries]
  by_kind = {name: at_full(column("op", name, "bytes"))
             for name in sorted({n for s in summaries for n in s["op"]})}
  link = {name: at_full(column("axes", name, "link_bytes"))
          for name in sorted({n for s in summaries for n in s["axes"]})}
  flops = at_full([f.flops for f in figures])
  per_token = flops_per_token(planner.ModelConfig.from_config(config.model), cfg.data.seq_len)
  if _MODE.value == "serve":
    per_token /= 3
  tokens = cfg.data.batch_size * cfg.data.seq_len / program.mesh.size
  est = roofline.estimate(roofline.CHIPS[chip], flops, link, dict(program.mesh.shape), tokens,
                          per_token)
  gib = planner.GIB
  print(f"\nper step at depth {full_depth}, EXTRAPOLATED linearly from depths {depths} "
        f"(collective GiB by kind, full buffers):")
  for name, value in by_kind.items():
    print(f"    {name:<32}{value / gib:10.2f}")
  print(f"    {'total':<32}{sum(by_kind.values()) / gib:10.2f}")
  print(f"  matmul FLOPs {flops:.4g}; compute {est.compute_s:.3f} s; comm "
        + ", ".join(f"{s:.3f} s over {a or '(one device)'}" for a, s in est.comm_s.items()))
  print(f"  step {est.overlap_s:.3f} s with perfect overlap, {est.serial_s:.3f} s without; MFU "
        f"{100 * est.mfu['overlap']:.1f}% / {100 * est.mfu['serial']:.1f}% (an ESTIMATE)")
  return {"depths": list(depths), "flops": flops, "collectives_by_kind": by_kind,
          "link_bytes_by_axes": link, "estimate": dataclasses_asdict(est)}


def dataclasses_asdict(x):
  import dataclasses  # pylint: disable=g-import-not-at-top
  return dataclasses.asdict(x)


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
