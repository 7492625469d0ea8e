"""Shared test fixtures: the tiny config with overrides, fast random params, a jitted forward.

Params come from `glm5_jax.abstract_params` filled by numpy rather than from `init_params`:
the jitted random init takes ~20 s to compile on CPU, the shape-only trace well under a second.
They are also larger than the HF init (std 0.1 instead of 0.02, random norm scales and router
bias), so attention is far from uniform and top-k selections matter.
"""

import functools
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import types

# One persistent XLA compilation cache for the whole test session: this process, the xdist
# workers and every subprocess inherit the variable (jax reads it at import). Compiling a train
# step takes ~100 s on a loaded 2-core machine and loading it ~1 s, and the end-to-end tests
# compile the same small programs again and again (a resumed run, a second process, the next
# test on the same config). A hit is the executable XLA built for the same HLO and options,
# so what a test proves does not change. A fresh directory per session (set
# JAX_COMPILATION_CACHE_DIR to keep one across runs); the process that made it removes it.
# Multi-process (jax.distributed) subprocesses must drop the variable: see test_multihost._env.
# The suite is compile-bound (most tests run a few steps of programs compiled for them), so its
# programs are compiled with LLVM's cheap passes only: `jax_disable_most_optimizations` sets XLA's
# backend optimization level 0 (and no expensive LLVM passes). HLO passes, fusion and buffer
# assignment are unchanged (what `memory_analysis()` and the HLO tests read); the machine code
# is slower and its floating-point results may differ from -O2 code in the last bits, which
# tests comparing two programs see alike. ~17% less CPU per test here (test_sessions,
# test_train's resume test). Inherited by every subprocess (the CLIs); set
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 to run the suite on fully optimized code.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# With the tpu-aot extra, test files on both xdist workers start libtpu (ahead-of-time compiles
# for a TPU topology; no chip is opened), and libtpu admits one process at a time through
# /tmp/libtpu_lockfile: the second failed with "Internal error when accessing libtpu
# multi-process lockfile" (4 tests of test_tpu_aot.py in a full run on 2026-12-01; alone they
# pass). Inherited by the subprocesses that compile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# XLA:CPU's MLIR fusion emitters take about half of a train step's compile here: test_train's
# `train(small_config(steps=8), ...)` run, uncached, with JAX_LOG_COMPILES=1, compiled its
# train step in 28.2 s with them and 14.7 s with the legacy emitters (all its programs 38.7 ->
# 21.7 s; 68.5 -> 53.4 s of CPU for the run; 2026-11-30, jaxlib 0.10.2). Like the -O0 above, this
# changes how each program's machine code is emitted, not what it computes beyond the last bits,
# and every program of a comparison is built alike. A jaxlib that does not know the flag aborts
# at backend start (an unknown flag in XLA_FLAGS is fatal), so the session's first process asks
# a subprocess once (~2 s) and exports the answer: workers and CLI subprocesses inherit
# XLA_FLAGS, and tests that set a device count use `host_devices_xla_flags`. Set
# GLM5_JAX_TEST_XLA_FLAGS="" to run the suite on XLA's default emitters.
_FAST_COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=false"
if "GLM5_JAX_TEST_XLA_FLAGS" not in os.environ:
  _probe = subprocess.run(
      [sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=_FAST_COMPILE_FLAGS), timeout=300)
  os.environ["GLM5_JAX_TEST_XLA_FLAGS"] = _FAST_COMPILE_FLAGS if _probe.returncode == 0 else ""
if os.environ["GLM5_JAX_TEST_XLA_FLAGS"] not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      f for f in (os.environ.get("XLA_FLAGS", ""), os.environ["GLM5_JAX_TEST_XLA_FLAGS"]) if f)


def host_devices_xla_flags(devices: int) -> str:
  """XLA_FLAGS for a subprocess with `devices` simulated CPU devices: the suite's flags (above)
  and the device count."""
  return " ".join(f for f in (os.environ.get("GLM5_JAX_TEST_XLA_FLAGS", ""),
                              f"--xla_force_host_platform_device_count={devices}") if f)


if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="glm5_jax_test_xla_cache_")
  os.environ["GLM5_JAX_TEST_CACHE_OWNER"] = str(os.getpid())
os.environ.setdefault("GLM5_JAX_TEST_CACHE_ROOT", os.environ["JAX_COMPILATION_CACHE_DIR"])
# Each xdist worker gets its own directories: one its subprocesses share, one for the worker
# process itself. jax writes a cache entry in place (`LRUCache.put`: `write_bytes`, no rename),
# so a process reading an entry another process is still writing can load a truncated
# executable; and an entry written by a CLI subprocess (other XLA flags, other device counts) was
# deserialized in a worker once and crashed it (SIGSEGV in `deserialize_executable`, a full run
# of 2026-11-27). Within a worker, tests and their subprocesses run one at a time, so every entry
# a process reads was written completely before, by itself or by an earlier subprocess.
_CACHE_ROOT = os.environ["GLM5_JAX_TEST_CACHE_ROOT"]
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_CACHE_ROOT, f"{_WORKER}-subprocesses")
_IN_PROCESS_CACHE_DIR = os.path.join(_CACHE_ROOT, f"{_WORKER}-in-process")
os.makedirs(os.environ["JAX_COMPILATION_CACHE_DIR"], exist_ok=True)
os.makedirs(_IN_PROCESS_CACHE_DIR, exist_ok=True)

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import glm5_jax
from glm5_jax.config import ModelConfig

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"

# In case a plugin imported jax before this file set the variable.
jax.config.update("jax_compilation_cache_dir", _IN_PROCESS_CACHE_DIR)

# In this (long-lived, many-test) process, only the trainer's programs are written to the cache:
# those are what the suite compiles again and again (`build_trainer` makes new jit wrappers on
# every call, so a test that trains, resumes and trains again would compile each step anew:
# test_train's dense-phase and resume tests took 237 s of CPU with the cache, 485 s without);
# the engine's programs are module-level jits, reused within a module by jax's in-memory cache,
# and serializing every one of them would only add time. (This hook was first added after
# `executable.serialize()` crashed a worker; that crash, like the others of those runs, was the
# process running out of memory mappings: `_release_compiled_programs` below.)
# Subprocesses (the CLIs) do not import this file and write every program as usual.
_TRAINER_PROGRAMS = ("jit_train_step", "jit_eval_step", "jit_init_state", "jit__all_checksums",
                     "jit_rl_train_step")


def _write_trainer_programs_only(write):
  def cache_write(*args, **kwargs):
    name = kwargs.get("module_name", args[2] if len(args) > 2 else None)
    if not isinstance(name, str) or name.startswith(_TRAINER_PROGRAMS):
      write(*args, **kwargs)
  return cache_write


from jax._src import compiler as _jax_compiler  # pylint: disable=g-import-not-at-top,wrong-import-position
if hasattr(_jax_compiler, "_cache_write"):  # a private hook: newer jax may name it otherwise
  _jax_compiler._cache_write = _write_trainer_programs_only(_jax_compiler._cache_write)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every compiled program when a test module ends.

  Each XLA:CPU executable holds ~8 memory mappings (JIT code and data pages) for as long as a
  jit cache references it, and Linux refuses a process's mapping number 65,530
  (`vm.max_map_count`). A long-lived xdist worker passed 26,000 halfway through the fast tests
  (a module compiles up to ~7,000), and the full suite's workers died near the end of the run
  with SIGSEGV in whatever was mapping memory then: a compile, a serialize, a deserialize
  (four CI and local runs, 2026-11-25..27). A module's programs are rarely needed by the next
  one; those the persistent cache holds load again in about a second.
  """
  yield
  jax.clear_caches()


def pytest_unconfigure(config):
  del config
  if os.environ.get("GLM5_JAX_TEST_CACHE_OWNER") == str(os.getpid()):
    shutil.rmtree(_CACHE_ROOT, ignore_errors=True)


def run_on_host_devices(script: str, devices: int = 8, timeout: int = 900) -> dict:
  """Runs python `script` in a subprocess with `devices` simulated CPU devices (they must be
  requested before jax initializes, hence the subprocess) and returns the JSON object its last
  stdout line holds; a failure shows the script's stderr."""
  env = dict(os.environ, XLA_FLAGS=host_devices_xla_flags(devices), JAX_PLATFORMS="cpu",
             PYTHONPATH=str(REPO_ROOT))
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def load_config_module(path):
  """The module of the `configs` package that is the file `path` (configs/tiny.py ->
  `configs.tiny`); `pythonpath = .` in setup.cfg puts the repository root on sys.path."""
  relative = pathlib.Path(path).resolve().relative_to(REPO_ROOT).with_suffix("")
  return importlib.import_module(".".join(relative.parts))


def tiny_model_config(**overrides):
  """The `model` section of configs/tiny.py, with `overrides` applied, as a `ModelConfig`."""
  model = load_config_module(CONFIG_DIR / "tiny.py").get_config().model
  model.update(overrides)
  return ModelConfig.from_config(model)


def random_tree(abstract, seed=0, std=0.1):
  """Numpy-random arrays shaped like `abstract` (a ShapeDtypeStruct tree).

  Norm scales are `1 + std * N(0, 1)`; everything else (kernels, biases, the router's correction
  bias) is `std * N(0, 1)`. Leaves are filled in the tree's (sorted) order, so the same seed
  gives the same values to the same paths across configs that share those paths.
  """
  abstract = nn.meta.unbox(abstract)  # e.g. `module.init` shapes still carry logical axes
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    values = std * rng.standard_normal(leaf.shape)
    if getattr(path[-1], "key", None) == "scale":
      values = 1.0 + values
    return jnp.asarray(values, leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, abstract)


@functools.lru_cache(maxsize=None)
def random_params(cfg, seed=0, std=0.1):
  """Random params for a `ModelConfig` (cached: configs are hashable, arrays immutable)."""
  return random_tree(glm5_jax.abstract_params(cfg), seed, std)


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "mtp"))
def _forward(params, tokens_BL, positions_BL, segment_ids_BL, *, cfg, mode, mtp):
  return glm5_jax.forward(cfg, params, tokens_BL, positions_BL, segment_ids_BL, mode=mode,
                          mtp=mtp)


def forward(cfg, params, tokens_BL, positions_BL=None, segment_ids_BL=None, *,
            mode=glm5_jax.Mode(), mtp=True):
  """Jitted `glm5_jax.forward`; positions and segment ids are always passed explicitly, so calls
  with and without them share one compilation per (config, shape, mode, mtp)."""
  tokens_BL = jnp.asarray(tokens_BL, jnp.int32)
  b, l = tokens_BL.shape
  if positions_BL is None:
    positions_BL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
  if segment_ids_BL is None:
    segment_ids_BL = jnp.ones((b, l), jnp.int32)
  return _forward(params, tokens_BL, jnp.asarray(positions_BL, jnp.int32),
                  jnp.asarray(segment_ids_BL, jnp.int32), cfg=cfg, mode=mode, mtp=mtp)


@pytest.fixture(scope="session")
def helpers():
  """The helpers above, for test modules (importing `conftest` directly is fragile)."""
  return types.SimpleNamespace(
      config=tiny_model_config, load_config_module=load_config_module, random_tree=random_tree,
      random_params=random_params, forward=forward)


@pytest.fixture(scope="session")
def tiny_cfg():
  """configs/tiny.py as shipped: every layer DSA (index_topk 16), MoE after layer 0, 3 MTP
  depths."""
  return tiny_model_config()


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
  return random_params(tiny_cfg, seed=0)


def lower_for_cuda(fn, *abstract_args) -> str:
  """StableHLO text of `fn` lowered for CUDA on this (CPU) host: proves a Pallas Triton kernel's
  lowering (block shapes, primitives) without a GPU.

  jaxlib <= 0.10.2 stops at the Triton IR; newer jaxlibs also compile it during lowering through
  a handler that only the CUDA plugin registers, so on a CPU-only host with such a jaxlib the
  test is skipped with that reason (`tools/check_triton_compile.py` compiles the kernels offline
  there, through Triton itself)."""
  try:
    return jax.jit(fn).trace(*abstract_args).lower(lowering_platforms=("cuda",)).as_text()
  except RuntimeError as e:
    if "does not have a Triton compilation handler" not in str(e):
      raise
    pytest.skip(f"jaxlib {jax.__version__} compiles Triton while lowering and this host has no "
                f"CUDA plugin to do it ({e}); use tools/check_triton_compile.py")
