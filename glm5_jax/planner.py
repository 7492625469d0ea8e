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

The collectives come from the optimized HLO (`compiled.as_text()`), counted per instruction in
the text: an instruction inside a loop body counts once however often the loop runs.

Depth: `with_depth` builds the same model with fewer layers (one dense, the rest MoE), so a
few depths can be compiled and the figures extrapolated linearly in depth (`fit_line`); the
state's argument bytes at any depth are exact from abstract shapes (`sharded_bytes`).

tools/plan_memory.py is the command line; docs/scaling.md the measured numbers.
"""

import contextlib
import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from glm5_jax import cpu_standins
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
PLANNED_ACCELERATORS = ("v5p", "v6e", "h100", "h200")
ACCELERATOR_HBM_GIB = {name: ACCELERATORS[name].hbm_gib for name in PLANNED_ACCELERATORS}

COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                    "ragged-all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16}
# `name = <result type> <op>(`; async pairs are counted once, at their `-done` (whose result
# is the collective's output; a `-start` returns a tuple holding the input too).
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>" + "|".join(sorted(COLLECTIVE_KINDS, key=len, reverse=True)) +
    r")(?P<phase>-start|-done)?\(")
_ARRAY_TYPE = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


# ---------------------------------------------------------------------------- collectives

@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of an HLO module: its kind, name, result type and the bytes of
  its result (per device: the HLO is the per-device SPMD program)."""

  kind: str
  name: str
  result_type: str
  bytes: int


def _type_bytes(result_type: str) -> int:
  total = 0
  for dtype, dims in _ARRAY_TYPE.findall(result_type):
    if dtype not in _DTYPE_BYTES:
      raise ValueError(f"HLO result type {result_type!r}: unknown element type {dtype!r}")
    total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return int(total)


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective instruction of an HLO module's text (`compiled.as_text()`), in order.

  Kinds: `COLLECTIVE_KINDS`. Async `-start` / `-done` pairs count once (at `-done`). Bytes
  are those of the result: the gathered array of an all-gather, the reduced one of an
  all-reduce, the scattered shard of a reduce-scatter, the output buffer of a (ragged)
  all-to-all, the received array of a collective-permute; a tuple result sums its elements.
  """
  found = []
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m or m["phase"] == "-start":
      continue
    found.append(Collective(m["op"], m["name"], m["type"].strip(), _type_bytes(m["type"])))
  return found


def summarize_collectives(found: list[Collective]) -> dict[str, dict[str, int]]:
  """`{kind: {"count", "bytes"}}` over `found`, kinds in `COLLECTIVE_KINDS` order."""
  summary = {}
  for kind in COLLECTIVE_KINDS:
    of_kind = [c for c in found if c.kind == kind]
    if of_kind:
      summary[kind] = {"count": len(of_kind), "bytes": sum(c.bytes for c in of_kind)}
  return summary


# ---------------------------------------------------------------------------- memory

@dataclasses.dataclass(frozen=True)
class Memory:
  """Per-device bytes of a compiled program (see the module docstring)."""

  argument: int
  output: int
  alias: int
  temp: int
  generated_code: int

  @property
  def total(self) -> int:
    return self.argument + self.output - self.alias + self.temp

  @classmethod
  def of(cls, compiled) -> "Memory":
    stats = compiled.memory_analysis()
    return cls(argument=int(stats.argument_size_in_bytes),
               output=int(stats.output_size_in_bytes), alias=int(stats.alias_size_in_bytes),
               temp=int(stats.temp_size_in_bytes),
               generated_code=int(stats.generated_code_size_in_bytes))


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
  # Traced with `glm5_jax.cpu_standins` (on XLA:CPU): "MoE via stand-in".
  moe_standin: bool = False


def _needs_moe_standin(model: ModelConfig) -> bool:
  return jax.default_backend() == "cpu" and "E" in model.mlp_pattern


def _with_shardings(tree, shardings):
  return jax.tree_util.tree_map(
      lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s), tree, shardings)


def abstract_batch(config, mesh):
  """The train batch (`glm5_jax.data.pipeline`'s keys) as sharded `ShapeDtypeStruct`s."""
  sharding = batch_sharding(mesh, config.mesh.logical_axis_rules)
  shape = (config.data.batch_size, config.data.seq_len)
  return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                  sharding=sharding) for k in BATCH_KEYS}


def train_program(config) -> Program:
  """The trainer's train step (`make_train_step`, the config's optimizer, donated state) on
  `jax.device_count()` devices, with abstract state and batch."""
  model = ModelConfig.from_config(config.model)
  step_cfg = StepConfig.from_config(config.train)
  mesh = make_mesh(config.mesh)
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
                 sharded_bytes((state, batch)), _needs_moe_standin(model))


def serve_program(config) -> Program:
  """Prefill for serving: next-token logits `[B, Y]` (fp32) of a batch of `[B, L]` prompts,
  params only (no optimizer state), no MTP depths, inference's attention mode."""
  model = ModelConfig.from_config(config.model)
  mesh = make_mesh(config.mesh)
  rules = config.mesh.logical_axis_rules
  shapes, logical_axes = abstract_params_and_axes(model)
  params = _with_shardings(shapes, param_shardings(shapes, logical_axes, mesh, rules))
  tokens = abstract_batch(config, mesh)["tokens"]

  def prefill(params, tokens_BL):
    return forward(model, params, tokens_BL, mtp=False)["logits"][:, -1]

  fn = jax.jit(prefill, keep_unused=True, in_shardings=(jax.tree_util.tree_map(lambda p: p.sharding, params),
                                      tokens.sharding))
  return Program(fn, (params, tokens), mesh, rules, sharded_bytes((params, tokens)),
                 _needs_moe_standin(model))


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
  """What one compiled program reports."""

  memory: Memory
  collectives: tuple
  compile_s: float
  hlo_chars: int


def compile_program(program: Program) -> CompiledFigures:
  """Lowers and compiles `program` (nothing runs) and reads its memory and collectives."""
  standins = contextlib.ExitStack()
  if program.moe_standin:
    standins.enter_context(cpu_standins.ragged_dot_standin())
    standins.enter_context(cpu_standins.ragged_all_to_all_standin())
  start = time.perf_counter()
  with activation_sharding(program.mesh, program.rules), standins:
    compiled = program.fn.lower(*program.args).compile()
  compile_s = time.perf_counter() - start
  text = compiled.as_text()
  return CompiledFigures(Memory.of(compiled), tuple(collectives(text)), compile_s, len(text))
