"""Ahead-of-time targets: the devices of an abstract TPU slice, compiled for by the real TPU
compiler on a host without a TPU.

  devices = tpu_devices("v5p:8x8x16")     # 1024 compile-only v5p devices
  mesh = glm5_jax.sharding.make_mesh(config.mesh, devices)

`jax.experimental.topologies.get_topology_desc` asks libtpu for a slice's devices; a program
jitted over a mesh of them lowers and compiles for that TPU (`compiled.memory_analysis()`,
`compiled.as_text()` are the TPU compiler's), nothing runs. It needs the `libtpu` that matches
the installed jax (the `tpu-aot` install extra, `pip install -e .[tpu-aot]`): a newer libtpu
than jaxlib returns HLO that jaxlib cannot read back, so a mismatch is an error here, not a
warning. Targets: `v5p:XxYxZ` (3D torus, two TensorCores per chip as one megacore device),
`v5e:XxY` and `v6e:XxY` (2D, one core per chip), the slice shapes Cloud TPU offers.
"""

import importlib.metadata
import importlib.util
import math
import os
import re

# libtpu flags that let the TPU compiler overlap collectives with compute, each checked to
# exist in libtpu 0.0.42.1 (an unknown flag stops libtpu at start). Without them (libtpu's
# defaults) the headline step's all-gathers, all-reduces and all-to-alls are all synchronous.
# docs/scaling.md measures them. Every chip gets the asynchronous forms; how a collective then
# progresses beside compute differs by chip:
# - v5e: continuation fusion (a collective starts in one fusion and progresses inside the
#   compute fusions scheduled after it), MaxText's TPU default (`benchmarks/xla_flags_library.py`,
#   CF_FOR_ALL_REDUCE_AND_ALL_GATHER). libtpu 0.0.42.1 supports it on v5e only: compiling for
#   v5p with it prints "Continuation fusion for AllGather is enabled on platform viperfish, but
#   it is not supported/recommended on platforms other than Viperlite ... incorrect results,
#   hang, SDC", so the TPU figures compiled with it before 2026-12-04 say so.
# - v5p, v6e (chips with SparseCores): continuation fusion off; all-gathers, reduce-scatters
#   and all-reduces offloaded to the SparseCores (`call-start ... async_execution_thread=
#   "sparsecore"`), the flags of public v6e/v7 recipes (MaxText's xla_flags_library,
#   ENABLE_SPARSECORE_OFFLOADING_FOR_*). Checked: libtpu accepts them and the headline compile
#   offloads its gradient reduce-scatters and all-reduces; not checked on a real v5p.
# Left out: libtpu's ICI all-gather pipelining (XLA's flag guidance, openxla/xla
# docs/flags_guidance.md: `--xla_tpu_enable_ici_ag_pipelining=true` with
# `--xla_should_allow_loop_variant_parameter_in_chain` and
# `--xla_should_add_loop_invariant_op_in_chain` enabled), which issues a scanned layer's
# weight gather one iteration ahead: with it the compiler computed every MoE layer's attention
# twice in the forward loop and twice in its remat (GLM-5 at depth 4: 7 forward output
# projections for 4 layers, 4 without; compute 3.11 -> 2.89 s a step, schedule-aware MFU
# 23.9 -> 25.6%, compiler estimates; `tools/plan_cost.py`'s kernel calls per phase show it).
_ASYNC_ANY_CHIP = (
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
    "--xla_enable_async_all_reduce=true",
    # the MoE dispatch
    "--xla_tpu_enable_async_all_to_all=true",
    "--xla_tpu_enable_async_ragged_all_to_all=true",
)
CONTINUATION_FUSION_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
)
SPARSECORE_OFFLOAD_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=false",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=false",
    "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_3d_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
    "--xla_tpu_enable_sparse_core_reduce_scatter_v2=true",
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
    "--xla_tpu_enable_concurrent_sparse_core_offloading=true",
    "--xla_tpu_use_tc_device_shape_on_sc=true",
    "--xla_sc_disable_megacore_partitioning=true",
)
# chip -> the flags `tpu_devices` starts libtpu with
ASYNC_COLLECTIVE_FLAGS = {
    "v5e": _ASYNC_ANY_CHIP + CONTINUATION_FUSION_FLAGS,
    "v5p": _ASYNC_ANY_CHIP + SPARSECORE_OFFLOAD_FLAGS,
    "v6e": _ASYNC_ANY_CHIP + SPARSECORE_OFFLOAD_FLAGS,
}
_LIBTPU_ARGS = "LIBTPU_INIT_ARGS"
_applied_flags = None  # what this process's libtpu was started with, once it was


# chip -> (libtpu's topology prefix, chip_config_name, dimensions)
TPU_CHIPS = {"v5p": ("v5", "megacore", 3), "v5e": ("v5e", "default", 2),
             "v6e": ("v6e", "default", 2)}


def parse_target(target: str) -> tuple[str, tuple[int, ...]]:
  """`"v5p:8x8x16"` -> `("v5p", (8, 8, 16))`; a ValueError names the accepted forms."""
  chip, _, shape = target.partition(":")
  if chip not in TPU_CHIPS or not re.fullmatch(r"\d+(x\d+)*", shape):
    raise ValueError(f"--target={target!r}: expected <chip>:<shape> with chip one of "
                     f"{sorted(TPU_CHIPS)}, e.g. v5p:8x8x16, v5e:16x16, v6e:8x16")
  dims = tuple(int(d) for d in shape.split("x"))
  if len(dims) != TPU_CHIPS[chip][2]:
    raise ValueError(f"--target={target!r}: {chip} slices are {TPU_CHIPS[chip][2]}-D "
                     f"(e.g. {'8x8x16' if chip == 'v5p' else '16x16'})")
  return chip, dims


def torus_wrap(chip: str, dims: tuple[int, ...]) -> tuple[bool, bool, bool]:
  """Which dimensions close into a torus: v5p slices of whole 4x4x4 cubes wrap in every
  dimension (Cloud TPU's full-cube shapes); v5e / v6e wrap a dimension of 16 chips (the pod's
  edge). A mesh axis over a wrapped dimension gets twice the links of an open one."""
  if chip == "v5p":
    cubes = all(d % 4 == 0 for d in dims)
    return (cubes,) * 3
  return tuple(d == 16 for d in dims) + (False,)


def libtpu_problem() -> str | None:
  """Why an ahead-of-time TPU compile cannot run here (None when it can): libtpu missing, or
  not the version the installed jax requires (`jax[tpu]`'s pin)."""
  if importlib.util.find_spec("libtpu") is None:
    return ("libtpu is not installed: `pip install -e .[tpu-aot]` installs the one matching "
            "the installed jax (the TPU compiler runs on this host; no TPU is needed)")
  try:
    have = importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None  # a libtpu module without package metadata (a source build): trusted as is
  wanted = [r for r in importlib.metadata.requires("jax") or []
            if r.startswith("libtpu") and 'extra == "tpu"' in r]
  for requirement in wanted:
    pin = re.search(r"==\s*([\w.]+?)(\.\*)?\s*(;|$)", requirement)
    if pin and not (have == pin[1] or (pin[2] and have.startswith(pin[1] + "."))):
      return (f"libtpu {have} does not match jax {importlib.metadata.version('jax')}, which "
              f"requires {requirement.split(';')[0].strip()}: a libtpu newer than jaxlib "
              "returns HLO that jaxlib cannot read (pip install -e .[tpu-aot])")
  return None


def start_libtpu_flags(chip: str, async_collectives: bool) -> str:
  """Puts `ASYNC_COLLECTIVE_FLAGS[chip]` (or none) in LIBTPU_INIT_ARGS ahead of whatever the
  user set there (a flag given twice takes its last value, so the user's win), and returns the
  flags. libtpu reads them once, when it starts (the first `tpu_devices`), so a process
  compiles with one setting: asking for another later is an error rather than silently ignored."""
  global _applied_flags
  flags = " ".join(ASYNC_COLLECTIVE_FLAGS[chip]) if async_collectives else ""
  if _applied_flags is not None:
    if flags != _applied_flags:
      raise RuntimeError(f"{chip}, async_collectives={async_collectives}: libtpu already "
                         "started in this process with other flags (they are read once)")
    return flags
  user = os.environ.get(_LIBTPU_ARGS, "")
  os.environ[_LIBTPU_ARGS] = f"{flags} {user}".strip()
  _applied_flags = flags
  return flags


def tpu_devices(target: str, async_collectives: bool = True):
  """The compile-only devices of the TPU slice `target` (`parse_target`), in libtpu's order
  (`glm5_jax.sharding.make_mesh` lays a mesh over them along the torus). `async_collectives`:
  start libtpu with the chip's `ASYNC_COLLECTIVE_FLAGS` (the default), else with its own
  defaults."""
  problem = libtpu_problem()
  if problem:
    raise RuntimeError(f"--target={target}: {problem}")
  chip, dims = parse_target(target)
  start_libtpu_flags(chip, async_collectives)
  prefix, chip_config, _ = TPU_CHIPS[chip]
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topology = topologies.get_topology_desc(
      f"{prefix}:{'x'.join(map(str, dims))}", platform="tpu", chip_config_name=chip_config,
      chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=torus_wrap(chip, dims))
  devices = list(topology.devices)
  if len(devices) != math.prod(dims):
    raise RuntimeError(f"--target={target}: libtpu gave {len(devices)} devices for "
                       f"{math.prod(dims)} chips")
  return devices
