"""AOT memory planner: does a config's train step (or serving prefill) fit a chip's HBM?

  python tools/plan_memory.py --config=configs/glm5_744b.py --devices=64 --mesh=fsdp=16,expert=4 \
      --layers=2,4 --seq_len=4096 --per_device_batch=1 --remat_policy=full --accelerator=v5p
  python tools/plan_memory.py --config=configs/tiny.py --devices=8 --mesh=fsdp=2,expert=2,tensor=2
  python tools/plan_memory.py --config=configs/glm5_744b.py --devices=64 --mesh=fsdp=16,expert=4 \
      --layers=2,4 --mode=serve --config.model.param_dtype=bfloat16
  python tools/plan_memory.py --config=configs/glm5_744b.py --target=v5p:8x8x16 \
      --mesh=fsdp=64,expert=4,tensor=4 --seq_len=4096 --remat_policy=full   # the TPU compiler
  python tools/plan_memory.py --config=configs/glm5_744b.py --target=v5p:2x2x2 --mesh=expert=8 \
      --mode=decode --cache_len=131072 --sequences=8,16 --config.model.quant=w4a8 \
      --config.model.moe_impl=ragged --config.model.param_dtype=bfloat16   # a served decode step

Compiler: with `--target=v5p:XxYxZ` (or `v5e:XxY`, `v6e:XxY`) the real TPU compiler compiles
for that slice ahead of time (`glm5_jax.planning.aot_targets`; needs the `tpu-aot` install extra, no
TPU), with no stand-ins, and by default with libtpu's asynchronous-collective flags
(`aot_targets.ASYNC_COLLECTIVE_FLAGS`, per chip: SparseCore offload on v5p and v6e,
continuation fusion on v5e; `--noasync_collectives`: libtpu's defaults). Otherwise XLA:CPU
compiles for `--devices` simulated CPU devices
(`--xla_force_host_platform_device_count`, set here before jax starts), with the MoE stand-ins
of `glm5_jax.planning.cpu_standins`; every figure is labelled with the compiler that produced it.
The mesh comes from the config's `mesh` section with `--mesh` axis sizes on top, and the real
step is compiled from abstract inputs (`glm5_jax.planning.planner`): nothing is allocated or run.
Prints per-device argument / output / alias / temp / generated-code bytes, their total against
each chip's HBM, and per step (every instruction times its loops' trip counts): the
collectives by kind, mesh axes and source, matmul FLOPs, and a roofline estimate of the step
time and MFU on the chosen chip (`glm5_jax.planning.roofline`: a bound, not a measurement); for
a `--target`, beside it the compiler's estimate op by op (`glm5_jax.planning.step_cost`: the TPU
compiler's cycles per instruction, custom calls at a stated efficiency, collectives on the torus,
the step time and MFU with no overlap, the compiled schedule's overlap, and ideal overlap).
`--mode=serve` adds the KV cache of the prefill's batch (computed from `glm5_jax.param_stats`,
not compiled) to the verdict. `--mode=decode` compiles the inference engine's decode step
(`glm5_jax.planning.planner_decode`: one token for each of `--sequences` slots of `--cache_len` cache
rows, the cache a real sharded argument) at each number of sequences given, fits the total
bytes per device as a line in the sequences, and prints the most sequences that fit each chip;
its roofline adds the HBM time of reading the params and the cache rows DSA reads.

`--peak_dump=DIR` keeps XLA's dump of each compiled program in DIR and prints what is live at
its memory peak, by model part and by source op (`glm5_jax.planning.peak_memory`): which
buffers a change that moved the temp bytes added or removed.

`--layers=2,4,8` compiles those depths (1 dense + k-1 MoE layers) and extrapolates linearly to
the config's depth; the argument bytes at full depth are exact (abstract shapes, no compile).
Every printed figure says whether it was compiled or extrapolated. Without `--layers` the full
depth is compiled. `--config.<field>=...` overrides any config field (e.g.
`--config.model.dsa_impl=xla`, `--config.model.scan_layers=False`).
"""

import functools
import json
import math
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

# XLA reads its dump options when the backend starts, so --peak_dump is applied here too.
_PEAK_DUMP_DIR = _flag_value(sys.argv, "peak_dump")
if _PEAK_DUMP_DIR:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_PEAK_DUMP_DIR}"
                             " --xla_dump_hlo_as_text").strip()

from absl import app, flags  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top

from configs import overrides  # pylint: disable=g-import-not-at-top
from glm5_jax.planning import aot_targets, hlo_stats, peak_memory, planner, planner_decode, roofline, step_cost  # pylint: disable=g-import-not-at-top
from glm5_jax.config import ConfigError  # pylint: disable=g-import-not-at-top
from glm5_jax.config_validation import validate_config  # pylint: disable=g-import-not-at-top
from glm5_jax.sharding import MESH_AXES, batch_mesh_axes  # pylint: disable=g-import-not-at-top
from glm5_jax.train import console  # pylint: disable=g-import-not-at-top
from glm5_jax.train.metrics import flops_per_token  # pylint: disable=g-import-not-at-top

_CONFIG = overrides.define_config_file("config", "configs/tiny.py", "Experiment config.")
_DEVICES_FLAG = flags.DEFINE_integer("devices", None, "Simulated CPU devices (the mesh's "
                                     "size); not with --target.")
_TARGET = flags.DEFINE_string("target", None, "Compile with the TPU compiler for this slice, "
                              "e.g. v5p:8x8x16, v5e:16x16, v6e:8x16 (needs the tpu-aot extra).")
_ASYNC_COLLECTIVES = flags.DEFINE_bool(
    "async_collectives", True, "--target: start libtpu with the flags that make collectives "
    "asynchronous and overlap them with compute (aot_targets.ASYNC_COLLECTIVE_FLAGS, per "
    "chip); "
    "--noasync_collectives compiles with libtpu's defaults.")
_MESH = flags.DEFINE_string("mesh", "", "Mesh axis sizes over the config's, e.g. "
                            "'fsdp=64,expert=4' (axes: data, fsdp, context, expert, tensor).")
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
_MODE = flags.DEFINE_enum("mode", "train", ["train", "serve", "decode"], "train: the train "
                          "step with optimizer state; serve: prefill logits, params only; decode: "
                          "the engine's decode step with its cache.")
_CACHE_LEN = flags.DEFINE_integer("cache_len", 131072, "--mode=decode: cache rows per sequence "
                                  "(the context every slot holds).")
_SEQUENCES = flags.DEFINE_list("sequences", ["8", "16"], "--mode=decode: sequences (slots) to "
                               "compile at; two or more also fit a line and give the most that "
                               "fit. Each a multiple of the batch axes' devices.")
_CACHE_LAYOUT = flags.DEFINE_enum("cache_layout", "contiguous", planner_decode.CACHE_LAYOUTS,
                                  "--mode=decode: the engine's contiguous cache, or its paged "
                                  "pool with page tables.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 64, "--mode=decode --cache_layout=paged: rows "
                                  "per page.")
_ARGUMENTS_ONLY = flags.DEFINE_bool("arguments_only", False, "Print the exact per-device "
                                    "argument bytes (params, optimizer state, batch) at full "
                                    "depth from the shardings and stop: no compile. A lower "
                                    "bound that rules a slice out in seconds.")
_TOP = flags.DEFINE_integer("top", 5, "Largest collectives and sources listed.")
_JSON = flags.DEFINE_bool("json", False, "Also print every figure as one JSON line.")
_PEAK_DUMP = flags.DEFINE_string("peak_dump", None, "Write XLA's dump of each compiled program "
                                 "into this directory (its schedule's live ranges among them) "
                                 "and print what is live at the memory peak, by model part and "
                                 "by source op (glm5_jax.planning.peak_memory).")
_HLO_OUT = flags.DEFINE_string("hlo_out", None, "Write the deepest compiled program's optimized "
                               "HLO text to this file (gzip if it ends in .gz) and its mesh's "
                               "chip coordinates beside it (<file>.mesh.json), for "
                               "tools/plan_cost.py.")


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
    devices = aot_targets.tpu_devices(_TARGET.value, _ASYNC_COLLECTIVES.value)
    where = (f"{len(devices)} {target_chip} chips ({_TARGET.value}), TPU compiler ahead of time, "
             f"async collective flags {'on' if _ASYNC_COLLECTIVES.value else 'off'}")
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
  if _MODE.value == "decode":
    if _PEAK_DUMP.value:
      raise SystemExit("--peak_dump: reports the train and serve programs' peaks; "
                       "--mode=decode compiles several programs and prints none")
    return _decode_main(config, devices, where, chip)
  full_depth = config.model.num_hidden_layers
  depths = sorted({int(k) for k in _LAYERS.value}) or [full_depth]
  build = functools.partial(
      planner.train_program if _MODE.value == "train" else planner.serve_program,
      devices=devices)
  m = config.model
  print(f"plan: {_MODE.value}, {where}, mesh "
        f"{dict(config.mesh.shape)}; seq_len {config.data.seq_len}, global batch "
        f"{config.data.batch_size} ({_PER_DEVICE_BATCH.value} per device"
        + (f", in {config.train.microbatches} microbatches"
           if _MODE.value == "train" and config.train.microbatches > 1 else "")
        + f"); remat "
        f"{m.remat_policy}, scan_layers {m.scan_layers}, dsa_impl {m.dsa_impl}, moe_impl "
        f"{m.moe_impl}; model depth {full_depth}", flush=True)

  if _ARGUMENTS_ONLY.value:
    state = build(config).state_bytes
    hbm = planner.ACCELERATOR_HBM_GIB[chip] * planner.GIB
    print(f"arguments at depth {full_depth} (exact, from the shardings; not compiled): "
          f"{state / planner.GIB:.2f} GiB ({state:,} bytes) per device, {state / hbm:.0%} of {chip}'s "
          f"{planner.ACCELERATOR_HBM_GIB[chip]} GiB"
          + ("" if state < hbm else ": does not fit before any activation"))
    return

  results, peaks = [], {}
  for k in depths:
    cfg, mix = planner.with_depth(config, k)
    print(f"compiling depth {k} ({mix}) ...", flush=True)
    program = build(cfg)
    if program.moe_standin:
      print("  MoE via stand-in (glm5_jax/planning/cpu_standins.py): ragged_dot as a capacity-padded "
            "grouped einsum [E, ceil(P/E), D] x [E, D, F], ragged-all-to-all as a dense "
            "all-to-all of the send buffer", flush=True)
    figures = planner.compile_program(program, hlo_out=_HLO_OUT.value,
                                      price=_pricer(cfg, program))
    mem = figures.memory
    print(f"  done in {figures.compile_s:.1f} s (HLO {figures.hlo_chars / 1e6:.1f} M chars): "
          f"argument {mem.argument / planner.GIB:.2f}, temp {mem.temp / planner.GIB:.2f}, total "
          f"{mem.total / planner.GIB:.2f} GiB per device"
          + (f"; host memory {mem.host_temp / planner.GIB:.2f} GiB per device (offloaded)"
             if mem.host_temp else ""), flush=True)
    if program.platform == "tpu":  # TPU layouts pad arrays to (8, 128) tiles
      print(f"  argument bytes with TPU tile padding {mem.argument / planner.GIB:.3f} GiB, "
            f"unpadded shards {program.state_bytes / planner.GIB:.3f} GiB", flush=True)
    elif figures.memory.argument != program.state_bytes:
      raise SystemExit(f"depth {k}: compiled argument bytes {figures.memory.argument} differ "
                       f"from the abstract inputs' shards {program.state_bytes}")
    if _PEAK_DUMP.value:
      live_ranges, module = peak_memory.find_dump(_PEAK_DUMP.value, module_pattern="")
      with open(live_ranges) as f, open(module) as g:
        report = peak_memory.peak_report(f.read(), g.read())
      peaks[k] = report
      print(peak_memory.format_report(report, top=max(_TOP.value, 15), compiler_temp=mem.temp),
            flush=True)
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
    mark = "  <== chosen" if name == chip else ""
    print(f"  {name:<5} {gib:4d} GiB  {'fits' if verdict[name] else 'does not fit'}{mark}")

  k, deepest, program, cfg = results[-1]
  per_token = _model_flops_per_token(cfg)
  estimate = _report_step(k, deepest, program, chip,
                          cfg.data.batch_size * cfg.data.seq_len / program.mesh.size, per_token)
  full_step = None
  if extrapolated:
    full_step = _report_extrapolated_step(depths, [r for _, r, *_ in results], full_depth,
                                          program, cfg, config, chip)

  if _JSON.value:
    print(json.dumps({
        "mode": _MODE.value, "devices": num_devices, "mesh": dict(config.mesh.shape),
        "accelerator": chip, "target": _TARGET.value, "compiler": deepest.compiler,
        "libtpu_flags": os.environ.get("LIBTPU_INIT_ARGS", "") if _TARGET.value else None,
        "depth": full_depth, "extrapolated": extrapolated,
        "verdict_depth": verdict_depth, "total": total, "kv_cache": cache,
        "moe_standin": program.moe_standin,
        "compiled": [{"layers": k, "compile_s": r.compile_s, "hlo_chars": r.hlo_chars,
                      "memory": {**dataclasses_asdict(r.memory), "total": r.memory.total},
                      "flops_per_step": r.flops, "cost_analysis_flops": r.cost_analysis_flops,
                      "unknown_loops": len(r.unknown_loops),
                      "peak": k in peaks and {
                          "total": peaks[k].total, "arguments": peaks[k].arguments,
                          "on_chip": peaks[k].on_chip, "by_category": peaks[k].by_category,
                          "by_source": peaks[k].by_source[:50]},
                      "collectives_per_step": {
                          key: hlo_stats.summarize_step(list(r.collectives), key)
                          for key in ("op", "axes")}}
                     for k, r, *_ in results],
        "estimate": dataclasses_asdict(estimate), "full_depth": extra, "fits": verdict,
        "compiler_estimate": deepest.cost and dataclasses_asdict(deepest.cost),
        "full_depth_step": full_step}))


def _model_flops_per_token(cfg) -> float:
  """Training FLOPs per token (a forward pass's third of them for --mode=serve)."""
  per_token = flops_per_token(planner.ModelConfig.from_config(cfg.model), cfg.data.seq_len)
  return per_token / 3 if _MODE.value == "serve" else per_token


def _pricer(cfg, program):
  """For a TPU target: the op-by-op compiler estimate of the compiled module
  (`step_cost.price_module`), else None."""
  if not _TARGET.value or program.platform != "tpu":
    return None
  tokens = cfg.data.batch_size * cfg.data.seq_len / program.mesh.size
  return functools.partial(step_cost.price_module, target=_TARGET.value,
                           layout=planner.mesh_layout(program.mesh), tokens_per_chip=tokens,
                           model_flops_per_token=_model_flops_per_token(cfg))


def _report_step(k, figures, program, chip, tokens, per_token, hbm_bytes=None):
  """Prints the per-step collectives, FLOPs and the roofline of the depth-k program (`tokens`
  per chip per step, `per_token` model FLOPs or None; `hbm_bytes`: bytes read from HBM per
  step, for a memory-bound decode step)."""
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

  est = planner.step_estimate(figures, program, chip, tokens, per_token)
  spec = roofline.CHIPS[chip]
  print(f"\nroofline on {chip} ({spec.peak_flops / 1e12:.0f} TFLOP/s bf16, "
        f"{spec.ici_bytes_s / 1e9:.0f} GB/s per direction"
        f"{'' if spec.scale_out_bytes_s is None else f' in a node, {spec.scale_out_bytes_s / 1e9:.0f} GB/s across'}"
        f"): a BOUND (every matmul at peak, nothing else costs, each mesh axis at the chip's "
        f"whole ICI bandwidth) on the program {figures.compiler} compiled, not a measurement")
  print(f"  compute {est.compute_s:8.3f} s   ({figures.flops:.4g} FLOPs / peak)")
  for axes, seconds in sorted(est.comm_s.items(), key=lambda kv: -kv[1]):
    print(f"  comm    {seconds:8.3f} s   over {axes or '(one device)'}")
  print(f"  step    {est.overlap_s:8.3f} s with perfect overlap, {est.serial_s:.3f} s without")
  print(f"  {tokens:.0f} tokens per chip per step: {est.tokens_per_s_per_chip['overlap']:.1f} / "
        f"{est.tokens_per_s_per_chip['serial']:.1f} tokens/s per chip (overlap / none)")
  if per_token is not None:
    print(f"  MFU {100 * est.mfu['overlap']:.1f}% / {100 * est.mfu['serial']:.1f}% (bound; overlap / "
          f"none; model FLOPs {per_token:.4g} per token, glm5_jax.train.metrics.flops_per_token"
          f"{' / 3' if _MODE.value == 'serve' else ''}, at depth {k})")
  if hbm_bytes is not None:
    hbm_s = hbm_bytes / spec.hbm_bytes_per_s
    step = max(est.overlap_s, hbm_s)
    print(f"  HBM     {hbm_s:8.4f} s   ({hbm_bytes / planner.GIB:.2f} GiB read at "
          f"{spec.hbm_bytes_per_s / 1e12:.2f} TB/s: every param, the DSA indexer keys of every "
          "cached row, the latent of the top-k rows)")
    print(f"  decode step {step:8.4f} s with perfect overlap of compute, communication and HBM, "
          f"{est.serial_s + hbm_s:.4f} s without: {tokens / step:.1f} / "
          f"{tokens / (est.serial_s + hbm_s):.1f} tokens/s per chip, "
          f"{1 / step:.1f} / {1 / (est.serial_s + hbm_s):.1f} tokens/s per sequence")
  if figures.cost is not None:
    print("\n" + step_cost.format_report(figures.cost, bound=est))
  return est


def _decode_main(config, devices, where, chip):
  """--mode=decode: the engine's decode step at each --sequences, the line through their totals,
  the most sequences that fit each chip, and the deepest count's per-step report."""
  if len(_LAYERS.value) > 1:
    raise SystemExit("--mode=decode compiles one depth (--layers=k, or none: the full depth) at "
                     "each of several --sequences")
  m = config.model
  depth = int(_LAYERS.value[0]) if _LAYERS.value else m.num_hidden_layers
  cfg, mix = planner.with_depth(config, depth)
  counts = sorted({int(n) for n in _SEQUENCES.value})
  ways = math.prod(config.mesh.shape[a] for a in batch_mesh_axes(config.mesh.logical_axis_rules))
  print(f"plan: decode, {where}, mesh {dict(config.mesh.shape)}; {_CACHE_LEN.value} cache rows "
        f"per sequence ({_CACHE_LAYOUT.value} cache, {m.cache_dtype}), sequences split over "
        f"{ways} devices; quant {m.quant}, param_dtype {m.param_dtype}, dsa_impl {m.dsa_impl}, "
        f"moe_impl {m.moe_impl}; depth {depth} ({mix}) of {m.num_hidden_layers}", flush=True)
  results, refused = [], []
  for n in counts:
    program = planner_decode.decode_program(cfg, devices, cache_len=_CACHE_LEN.value,
                                            sequences=n, cache_layout=_CACHE_LAYOUT.value,
                                            page_size=_PAGE_SIZE.value)
    print(f"compiling the decode step for {n} sequences ...", flush=True)
    if program.moe_standin:
      print("  MoE via stand-in (glm5_jax/planning/cpu_standins.py)", flush=True)
    try:
      figures = planner.compile_program(program, hlo_out=_HLO_OUT.value)
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program over its HBM
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      print(f"  does not fit {chip}: the compiler refused it: {str(e).splitlines()[0][:300]}",
            flush=True)
      refused.append(n)
      continue
    mem = figures.memory
    print(f"  done in {figures.compile_s:.1f} s (HLO {figures.hlo_chars / 1e6:.1f} M chars)",
          flush=True)
    if program.platform != "tpu" and mem.argument != program.state_bytes:
      raise SystemExit(f"{n} sequences: compiled argument bytes {mem.argument} differ from the "
                       f"abstract inputs' shards {program.state_bytes}")
    results.append((n, figures, program))

  if not results:
    raise SystemExit(f"no sequence count compiled: {refused} all refused")
  print(f"\nper-device memory, GiB ({results[-1][1].compiler}, depth {depth}, compiled)"
        f"{'':4}" + "".join(f"{str(n) + ' seqs':>12}" for n, *_ in results))
  rows = {"argument": lambda f, p: f.memory.argument,
          "  of which the cache": lambda f, p: p.cache_bytes,
          "  of which params + slot arrays": lambda f, p: f.memory.argument - p.cache_bytes,
          "output": lambda f, p: f.memory.output, "alias": lambda f, p: f.memory.alias,
          "temp": lambda f, p: f.memory.temp,
          "generated_code": lambda f, p: f.memory.generated_code,
          "total (arg + out - alias + temp)": lambda f, p: f.memory.total}
  for label, get in rows.items():
    print(f"  {label:<34}" + "".join(f"   {_gib(get(f, p))}" for _, f, p in results))
  counts = [n for n, *_ in results]
  totals = [f.memory.total for _, f, _ in results]
  for n, total in zip(counts, totals):
    chips = ", ".join(k for k, ok in planner.fits(total).items() if ok)
    print(f"  {n} sequences: {total / planner.GIB:.2f} GiB, fits {chips or 'none'}")
  # The most sequences that fit: params and slot arrays as compiled, the cache exact per
  # sequence, and the largest workspace compiled (temp + unaliased output) taken for any count.
  fixed = max(f.memory.argument - p.cache_bytes for _, f, p in results)
  per_sequence = results[-1][2].cache_bytes / counts[-1]
  work = max(f.memory.total - f.memory.argument for _, f, _ in results)
  most = {}
  print(f"\nthe most sequences that fit (a multiple of the {ways} batch devices): params and slot "
        f"arrays {fixed / planner.GIB:.2f} GiB + cache {per_sequence / planner.GIB:.4f} GiB per "
        f"sequence (exact) + the largest compiled temp {work / planner.GIB:.2f} GiB, per device:")
  for name, gib in planner.ACCELERATOR_HBM_GIB.items():
    most[name] = planner_decode.most_sequences(gib * planner.GIB, fixed, per_sequence, work, ways)
    if name == chip and refused:  # what the compiler refused bounds it
      most[name] = min(most[name], min(refused) - ways)
    total = fixed + work + per_sequence * most[name]
    print(f"  {name:<5} {gib:4d} GiB  {most[name]:5d} sequences ({total / planner.GIB:.2f} GiB)")

  # The roofline of the most sequences compiled that fit the chosen chip (else the fewest).
  fitting = [r for r in results if planner.fits(r[1].memory.total)[chip]]
  n, figures, program = fitting[-1] if fitting else results[0]
  print(f"\nper-step report for {n} sequences ({n / program.mesh.size:g} per device)")
  hbm = figures.memory.argument - program.cache_bytes + program.read_bytes
  estimate = _report_step(depth, figures, program, chip, n / program.mesh.size, None, hbm)
  if _JSON.value:
    print(json.dumps({
        "mode": "decode", "mesh": dict(config.mesh.shape), "accelerator": chip,
        "target": _TARGET.value, "compiler": figures.compiler, "depth": depth,
        "cache_len": _CACHE_LEN.value, "cache_layout": _CACHE_LAYOUT.value,
        "compiled": [{"sequences": n, "compile_s": f.compile_s, "cache": p.cache_bytes,
                      "read_bytes": p.read_bytes,
                      "memory": {**dataclasses_asdict(f.memory), "total": f.memory.total},
                      "flops_per_step": f.flops, "collectives_per_step": {
                          key: hlo_stats.summarize_step(list(f.collectives), key)
                          for key in ("op", "axes")}} for n, f, p in results],
        "refused": refused, "most_sequences": most, "estimate": dataclasses_asdict(estimate)}))


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
        f"{100 * est.mfu['overlap']:.1f}% / {100 * est.mfu['serial']:.1f}% (a BOUND)")
  return {"depths": list(depths), "flops": flops, "collectives_by_kind": by_kind,
          "link_bytes_by_axes": link, "estimate": dataclasses_asdict(est)}


def dataclasses_asdict(x):
  import dataclasses  # pylint: disable=g-import-not-at-top
  return dataclasses.asdict(x)


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
