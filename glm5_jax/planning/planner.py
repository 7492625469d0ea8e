"""Ahead-of-time memory planning: compile the real train step (or a serving forward) for a mesh
of simulated devices from abstract inputs, and read its per-device memory and collectives.

Nothing is allocated: the state and the batch are `jax.ShapeDtypeStruct`s carrying the
`NamedSharding`s the trainer uses (`glm5_jax.train.trainer`), and the step is only lowered and
compiled. XLA then reports, per device (`compiled.memory_analysis()`):

  argument   the inputs' shards (train state + batch)
  output     the outputs' shards (the new state aliases the donated old one)
  alias      output bytes that reuse argument buffers (donation)
  temp       everything live during the step besides arguments and outputs (activations
             kept for the backward pass, gradients, optimizer temporaries)
  total      argument + output - alias + temp: the step's peak HBM, before the runtime's own
             reserve and fragmentation

The collectives and matmul FLOPs come from the optimized HLO (`compiled.as_text()`), per step:
every instruction times the trip counts of its enclosing loops (`glm5_jax.planning.hlo_loops`), each
collective with the mesh axes its replica groups span (`glm5_jax.planning.hlo_stats.step_collectives`).

Compilers: by default the simulated CPU devices' XLA:CPU, with `glm5_jax.planning.cpu_standins` for
the MoE ops it lacks; with `devices` from `glm5_jax.planning.aot_targets.tpu_devices` the real TPU
compiler (libtpu, ahead of time, no TPU needed) and no stand-ins.

Depth: `with_depth` builds the same model with fewer layers (one dense, the rest MoE), so a
few depths can be compiled and the figures extrapolated linearly in depth (`fit_line`); the
state's argument bytes at any depth are exact from abstract shapes (`sharded_bytes`).

tools/plan_memory.py is the command line; docs/scaling.md the measured numbers.
"""

import contextlib
import dataclasses
import gzip
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.planning import cpu_standins, hlo_loops, hlo_stats, roofline
from glm5_jax.accelerators import ACCELERATORS
from glm5_jax.api import abstract_params_and_axes, forward
from glm5_jax.config import ModelConfig, require
from glm5_jax.data.packing import BATCH_KEYS
from glm5_jax.param_stats import kv_cache_bytes_per_token
from glm5_jax.sharding import (activation_sharding, batch_mesh_axes, batch_sharding, make_mesh,
                               param_shardings, state_shardings, validate_mesh_config)
from glm5_jax.train.step import StepConfig, make_train_step
from glm5_jax.train.trainer import make_init_state, optimizer_and_param_shardings

GIB = 1024 ** 3
# The chips a plan is checked against, and their HBM per chip (per GPU), GiB.
PLANNED_ACCELERATORS = ("v5p", "v5e", "v6e", "h100", "h200")
ACCELERATOR_HBM_GIB = {name: ACCELERATORS[name].hbm_gib for name in PLANNED_ACCELERATORS}


# ---------------------------------------------------------------------------- memory

@dataclasses.dataclass(frozen=True)
class Memory:
  """Per-device bytes of a compiled program (see the module docstring)."""

  argument: int
  output: int
  alias: int
  temp: int
  generated_code: int
  host_temp: int = 0  # host memory the program keeps (a remat policy's offloaded residuals)

  @property
  def total(self) -> int:
    return self.argument + self.output - self.alias + self.temp

  @classmethod
  def of(cls, compiled) -> "Memory":
    stats = compiled.memory_analysis()
    return cls(argument=int(stats.argument_size_in_bytes),
               output=int(stats.output_size_in_bytes), alias=int(stats.alias_size_in_bytes),
               temp=int(stats.temp_size_in_bytes),
               generated_code=int(stats.generated_code_size_in_bytes),
               host_temp=int(getattr(stats, "host_temp_size_in_bytes", 0) or 0))


def fits(total_bytes: float) -> dict[str, bool]:
  """`{accelerator: total_bytes <= its HBM}` for `ACCELERATOR_HBM_GIB`."""
  return {name: total_bytes <= gib * GIB for name, gib in ACCELERATOR_HBM_GIB.items()}


def sharded_bytes(tree) -> int:
  """Per-device bytes of a tree of `ShapeDtypeStruct`s with shardings: the largest shard of
  each leaf (the first device's; every device holds an equal shard under even sharding)."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
  return total


def fit_line(xs, ys) -> tuple[float, float]:
  """Least-squares `(slope, intercept)` of `ys` against `xs` (at least two distinct xs)."""
  if len(set(xs)) < 2:
    raise ValueError(f"a linear fit needs two distinct depths, got {sorted(set(xs))}")
  slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
  return float(slope), float(intercept)


# ---------------------------------------------------------------------------- configs

def with_depth(config, layers: int):
  """A copy of `config` whose model has `layers` decoder layers: the first one dense when
  the model has any dense layer (`first_k_dense_replace` >= 1), the rest MoE, each attention
  kind the first `layers` letters of the pattern. Returns `(config, description)`.

  GLM-5 is 3 dense + 75 MoE layers; a depth-k copy is 1 dense + (k - 1) MoE, so a line through
  several depths, evaluated at 78, counts two dense layers as MoE: an upper bound (a dense
  layer has fewer weights and activations than an MoE one).
  """
  model = config.model
  require(not model.mlp_pattern, "model.mlp_pattern", "planning at reduced depth derives the "
          "dense/MoE mix from first_k_dense_replace; leave mlp_pattern empty")
  require(1 <= layers <= model.num_hidden_layers, "model.num_hidden_layers",
          f"a planned depth must be in [1, {model.num_hidden_layers}], got {layers}")
  config = config.copy_and_resolve_references()
  pattern = model.attention_pattern
  if len(pattern) > 1:
    config.model.attention_pattern = pattern[:layers]
  config.model.num_hidden_layers = layers
  dense = model.first_k_dense_replace
  if layers < model.num_hidden_layers:
    dense = min(dense, 1)
  config.model.first_k_dense_replace = dense
  return config, f"{dense} dense + {layers - dense} MoE"


def with_layout(config, num_devices: int, mesh_axes: dict[str, int], seq_len: int,
                per_device_batch: int):
  """A copy of `config` for `num_devices`: `mesh.shape` updated by `mesh_axes` and resolved
  (the `-1` axis made explicit), `data.seq_len`, and `data.batch_size` = `per_device_batch` x
  the devices the `batch` rule splits the batch over."""
  config = config.copy_and_resolve_references()
  config.mesh.shape.update(mesh_axes)
  config.mesh.shape.update(validate_mesh_config(config.mesh, num_devices))
  ways = math.prod(config.mesh.shape[a] for a in batch_mesh_axes(config.mesh.logical_axis_rules))
  config.data.seq_len = seq_len
  config.data.batch_size = per_device_batch * ways
  return config


# ---------------------------------------------------------------------------- programs

@dataclasses.dataclass
class Program:
  """A function, its abstract sharded arguments, and what it runs under."""

  fn: object  # jitted
  args: tuple
  mesh: jax.sharding.Mesh
  rules: object
  state_bytes: int  # per-device bytes of the arguments (exact, from their shardings)
  # Traced with `glm5_jax.planning.cpu_standins` (on XLA:CPU): "MoE via stand-in".
  moe_standin: bool = False
  # A decode program's (`glm5_jax.planning.planner_decode`), per device: the cache among the arguments,
  # and the cache bytes one DSA decode step reads.
  cache_bytes: int = 0
  read_bytes: int = 0

  @property
  def platform(self) -> str:
    return self.mesh.devices.flat[0].platform

  @property
  def compiler(self) -> str:
    """Which compiler the figures come from, as the report labels them."""
    if self.platform == "tpu":
      return f"TPU compiler (libtpu, ahead of time, {self.mesh.devices.flat[0].device_kind})"
    return f"XLA:{self.platform.upper()}" + (" with MoE stand-ins" if self.moe_standin else "")


def _needs_moe_standin(model: ModelConfig, mesh) -> bool:
  return mesh.devices.flat[0].platform == "cpu" and "E" in model.mlp_pattern


def _with_shardings(tree, shardings):
  return jax.tree_util.tree_map(
      lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s), tree, shardings)


def abstract_batch(config, mesh):
  """The train batch (`glm5_jax.data.pipeline`'s keys) as sharded `ShapeDtypeStruct`s."""
  sharding = batch_sharding(mesh, config.mesh.logical_axis_rules)
  shape = (config.data.batch_size, config.data.seq_len)
  return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                  sharding=sharding) for k in BATCH_KEYS}


def train_program(config, devices=None) -> Program:
  """The trainer's train step (`make_train_step`, the config's optimizer, donated state) on
  `devices` (default: jax's; or an AOT target's, `glm5_jax.planning.aot_targets`), with abstract state
  and batch."""
  model = ModelConfig.from_config(config.model)
  step_cfg = StepConfig.from_config(config.train, config.mesh.context_layout)
  mesh = make_mesh(config.mesh, devices)
  optimizer, schedule, params_sharding, _ = optimizer_and_param_shardings(
      config, model, step_cfg, mesh)
  init_state = make_init_state(model, optimizer, params_sharding)
  rng_data = jax.random.key_data(jax.random.key(config.seed))
  shapes = jax.eval_shape(init_state, rng_data)
  state = _with_shardings(shapes, state_shardings(shapes, params_sharding, mesh))
  batch = abstract_batch(config, mesh)
  state_sharding = jax.tree_util.tree_map(lambda s: s.sharding, state)
  # keep_unused: the real run holds every batch array on device, read or not (source_id).
  fn = jax.jit(make_train_step(model, step_cfg, optimizer, schedule), keep_unused=True,
               in_shardings=(state_sharding, batch["tokens"].sharding),
               out_shardings=(state_sharding, None), donate_argnums=0)
  return Program(fn, (state, batch), mesh, config.mesh.logical_axis_rules,
                 sharded_bytes((state, batch)), _needs_moe_standin(model, mesh))


def serve_program(config, devices=None) -> Program:
  """Prefill for serving: next-token logits `[B, Y]` (fp32) of a batch of `[B, L]` prompts,
  params only (no optimizer state), no MTP depths, inference's attention mode."""
  model = ModelConfig.from_config(config.model)
  mesh = make_mesh(config.mesh, devices)
  rules = config.mesh.logical_axis_rules
  shapes, logical_axes = abstract_params_and_axes(model)
  params = _with_shardings(shapes, param_shardings(shapes, logical_axes, mesh, rules))
  tokens = abstract_batch(config, mesh)["tokens"]

  def prefill(params, tokens_BL):
    return forward(model, params, tokens_BL, mtp=False)["logits"][:, -1]

  fn = jax.jit(prefill, keep_unused=True, in_shardings=(jax.tree_util.tree_map(lambda p: p.sharding, params),
                                      tokens.sharding))
  return Program(fn, (params, tokens), mesh, rules, sharded_bytes((params, tokens)),
                 _needs_moe_standin(model, mesh))


def kv_cache_bytes(config) -> int:
  """Per-device bytes of the serving KV cache for `data.batch_size` sequences of
  `data.seq_len` tokens (the prefill's batch, each slot filled to its length), computed, not
  compiled: `glm5_jax.param_stats.kv_cache_bytes_per_token` (bf16; MLA's 576-number latent per
  token and layer, plus the DSA indexer's keys) of the main layers, times the tokens, over the
  devices the batch is split across (`batch_mesh_axes`). The cache is replicated over the
  other axes (`tensor`: an MLA latent is shared by every head). MTP's own layer is not counted
  (one more layer's worth when speculative decoding runs it)."""
  model = ModelConfig.from_config(config.model)
  ways = math.prod(config.mesh.shape[a] for a in batch_mesh_axes(config.mesh.logical_axis_rules))
  tokens = config.data.batch_size * config.data.seq_len
  return int(math.ceil(kv_cache_bytes_per_token(model)["total"] * tokens / ways))


@dataclasses.dataclass(frozen=True)
class CompiledFigures:
  """What one compiled program reports, per device and per step (loops multiplied)."""

  memory: Memory
  collectives: tuple  # hlo_stats.StepCollective
  flops: float  # matmul FLOPs per step (hlo_stats.step_dot_flops)
  custom_calls: int  # custom-call executions per step, whose FLOPs are not counted
  cost_analysis_flops: float  # compiled.cost_analysis()["flops"]: loop bodies counted once
  unknown_loops: tuple  # while loops whose trip count could not be read (counted once)
  compile_s: float
  hlo_chars: int
  compiler: str
  # The compiler-estimated cost of the step (`step_cost.CostReport`), when `compile_program`
  # was given a `price` function (TPU targets).
  cost: object = None


@contextlib.contextmanager
def _backend_seen_by_model(platform: str):
  """While tracing for an AOT target, `jax.default_backend()` answers the target's platform,
  so the code's backend choices (`pallas_kernels.blocking`: Pallas kernels compiled rather than
  interpreted, accelerator-sized query blocks) are the target's, not the host CPU's."""
  original = jax.default_backend
  jax.default_backend = lambda: platform
  try:
    yield
  finally:
    jax.default_backend = original


def mesh_layout(mesh) -> dict:
  """`{"axes": {axis: size}, "coords": [[x, y, z], ...]}`: each mesh position's chip coordinates
  in the slice's torus, in the mesh's flattened order (the device ids of the HLO's replica
  groups), or `coords` None for devices without coordinates (CPU)."""
  flat = list(mesh.devices.flat)
  coords = [list(d.coords) for d in flat] if hasattr(flat[0], "coords") else None
  return {"axes": {a: int(s) for a, s in mesh.shape.items()}, "coords": coords}


def write_hlo(text: str, mesh, path: str) -> None:
  """Writes an optimized module's text to `path` (gzip when it ends in .gz) and its mesh's
  layout (`mesh_layout`) beside it, `<path without .gz>.mesh.json`, so that the saved module
  can be priced later (`glm5_jax.planning.step_cost`) without compiling again."""
  with (gzip.open(path, "wt") if path.endswith(".gz") else open(path, "w")) as f:
    f.write(text)
  with open(path.removesuffix(".gz") + ".mesh.json", "w") as f:
    json.dump(mesh_layout(mesh), f)


def compile_program(program: Program, hlo_out: str | None = None,
                    price=None) -> CompiledFigures:
  """Lowers and compiles `program` (nothing runs) and reads its memory, per-step collectives
  and matmul FLOPs; `hlo_out`: a file to write the optimized HLO text to (`write_hlo`);
  `price(module) -> step_cost.CostReport`: the op-by-op cost of the parsed module."""
  standins = contextlib.ExitStack()
  if program.moe_standin:
    standins.enter_context(cpu_standins.ragged_dot_standin())
    standins.enter_context(cpu_standins.ragged_all_to_all_standin())
  if program.platform != jax.default_backend():
    standins.enter_context(_backend_seen_by_model(program.platform))
  start = time.perf_counter()
  with activation_sharding(program.mesh, program.rules), standins:
    compiled = program.fn.lower(*program.args).compile()
  compile_s = time.perf_counter() - start
  text = compiled.as_text()
  if hlo_out:
    write_hlo(text, program.mesh, hlo_out)
  module = hlo_loops.parse_module(text)
  mesh_shape = dict(program.mesh.shape)
  found = hlo_stats.step_collectives(text, mesh_shape, module)
  flops = hlo_stats.step_dot_flops(text, module)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return CompiledFigures(Memory.of(compiled), tuple(found), flops["flops"], flops["custom_calls"],
                         float((cost or {}).get("flops", 0.0)), tuple(module.unknown_loops),
                         compile_s, len(text), program.compiler,
                         price(module) if price else None)


def step_estimate(figures: CompiledFigures, program: Program, chip: str, tokens_per_chip: float,
                  model_flops_per_token: float | None) -> roofline.Estimate:
  """`roofline.estimate` of a compiled step on `chip` (a `roofline.CHIPS` key)."""
  by_axes = {axes: s["link_bytes"]
             for axes, s in hlo_stats.summarize_step(list(figures.collectives), "axes").items()}
  return roofline.estimate(roofline.CHIPS[chip], figures.flops, by_axes,
                           dict(program.mesh.shape), tokens_per_chip, model_flops_per_token)
