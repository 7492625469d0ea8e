"""Everything a training run needs before its first step, built from the config: mesh, data
iterator, optimizer, state shardings, and the jitted train / eval steps. Shared by the training
loop and tools/bench_train.py."""

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import data as data_lib
from glm5_jax import optim
from glm5_jax.api import abstract_params_and_axes, init_params
from glm5_jax.attention.kinds import ATTENTION_KINDS
from glm5_jax.config import ModelConfig
from glm5_jax.config_validation import validate_config
from glm5_jax.sharding import (activation_sharding, batch_sharding, make_mesh, param_shardings,
                               state_shardings)
from glm5_jax.train.state import TrainState, trainable_mask
from glm5_jax.train.step import StepConfig, make_eval_step, make_train_step


@dataclasses.dataclass
class Trainer:
  model: ModelConfig
  step_cfg: StepConfig
  mesh: jax.sharding.Mesh
  rules: Any
  train_iter: Any  # checkpointable grain iterator of local numpy batches
  optimizer: Any
  params_sharding: Any
  state_sharding: Any
  abstract_state: TrainState  # ShapeDtypeStructs carrying the shardings (restore target)
  init_state: Callable[[], TrainState]  # compiled fresh init from config.seed
  train_step: Callable  # jitted (state, device batch) -> (state, metrics), donates state
  eval_step: Callable  # jitted (params, device batch) -> (metrics, predictions, token nll)
  dense_steps: int  # `train.dsa_dense_steps` where the model has indexers, else 0
  dense_train_step: Callable | None  # the same two for those first steps (`StepConfig.dense_phase`)
  dense_eval_step: Callable | None
  to_device: Callable  # local numpy batch -> global sharded arrays

  def compile_first_step(self) -> tuple:
    """`(compiled, state, batch, compile_s)`: the train step compiled ahead of time, under the
    mesh's activation sharding, for a fresh state and the iterator's next batch (on device),
    and the seconds its lowering and compilation took. For the benchmarks
    (tools/bench_train.py, tools/device_suite_model.py); the loop jits on its first call."""
    state = self.init_state()
    batch = self.to_device(next(self.train_iter))
    start = time.perf_counter()
    with activation_sharding(self.mesh, self.rules):
      compiled = self.train_step.lower(state, batch).compile()
    return compiled, state, batch, time.perf_counter() - start


def optimizer_and_param_shardings(config, model: ModelConfig, step_cfg: StepConfig,
                                  mesh: jax.sharding.Mesh):
  """`(optimizer, schedule, params_sharding, param shapes)` from one shape-only trace of the
  model (also
  used by tools/plan_memory.py, which compiles the step from these without allocating)."""
  shapes, logical_axes = abstract_params_and_axes(model)
  optimizer, schedule = optim.build_optimizer(
      config.optim, shapes, total_steps=config.train.steps,
      trainable=trainable_mask(shapes, step_cfg.dsa_stage), logical_axes=logical_axes)
  return optimizer, schedule, param_shardings(shapes, logical_axes, mesh,
                                              config.mesh.logical_axis_rules), shapes


def make_init_state(model: ModelConfig, optimizer, params_sharding) -> Callable:
  """`init_state(rng_data) -> TrainState`: fresh params (constrained to `params_sharding`) and
  their optimizer state; jit it (or `jax.eval_shape` it for the abstract state)."""

  def init_state(rng_data):
    params = jax.lax.with_sharding_constraint(
        init_params(model, jax.random.wrap_key_data(rng_data)), params_sharding)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params), rng=rng_data)

  return init_state


def build_trainer(config) -> Trainer:
  """Builds everything from `config`, which is validated first: a bad field raises
  `ConfigError` before anything is compiled or written."""
  # ---- config and mesh
  validate_config(config, jax.device_count(), process_count=jax.process_count())
  model = ModelConfig.from_config(config.model)
  step_cfg = StepConfig.from_config(config.train, config.mesh.context_layout)
  mesh = make_mesh(config.mesh)
  rules = config.mesh.logical_axis_rules
  inputs_sharding = batch_sharding(mesh, rules)  # every batch array is [B, L]

  # ---- data
  tokenizer = data_lib.make_tokenizer(config.data.tokenizer)
  data_lib.check_vocab(tokenizer, model.vocab_size)
  train_iter = data_lib.make_train_iterator(config.data, process_index=jax.process_index(),
                                            process_count=jax.process_count())

  # ---- abstract state, shardings (the params' shapes and logical axes: one shape-only trace)
  optimizer, schedule, params_sharding, shapes = optimizer_and_param_shardings(
      config, model, step_cfg, mesh)
  init_state = make_init_state(model, optimizer, params_sharding)
  rng_data = jax.random.key_data(jax.random.key(config.seed))
  # Stated, not left to propagation: XLA would replicate every optimizer moment
  # (`state_shardings`).
  # (From the param shapes already traced: tracing `init_state` again would trace the model.)
  abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=shapes,
                        opt_state=jax.eval_shape(optimizer.init, shapes),
                        rng=jax.ShapeDtypeStruct(rng_data.shape, rng_data.dtype))
  state_sharding = state_shardings(abstract, params_sharding, mesh)
  with activation_sharding(mesh, rules):
    init_compiled = jax.jit(init_state, out_shardings=state_sharding).lower(rng_data).compile()
  abstract_state = jax.tree_util.tree_map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding),
      init_compiled.out_info)

  # ---- jitted steps
  def jitted_steps(cfg: StepConfig):
    return (jax.jit(make_train_step(model, cfg, optimizer, schedule),
                    in_shardings=(state_sharding, inputs_sharding),
                    out_shardings=(state_sharding, None), donate_argnums=0),
            jax.jit(make_eval_step(model, cfg),
                    in_shardings=(state_sharding.params, inputs_sharding)))

  train_step, eval_step = jitted_steps(step_cfg)
  # A model without indexers has no dense phase: it would compute what its sparse stage does.
  # A model without indexers computes in its dense phase exactly what its sparse stage does.
  has_indexer = any("indexer" in ATTENTION_KINDS[letter].extra_params
                    for letter in model.attention_pattern)
  dense_steps = config.train.dsa_dense_steps if has_indexer else 0
  dense_train_step, dense_eval_step = (
      jitted_steps(step_cfg.dense_phase()) if dense_steps else (None, None))

  def to_device(batch):
    return {k: jax.make_array_from_process_local_data(inputs_sharding, np.asarray(v))
            for k, v in batch.items()}

  return Trainer(model=model, step_cfg=step_cfg, mesh=mesh, rules=rules, train_iter=train_iter,
                 optimizer=optimizer, params_sharding=params_sharding,
                 state_sharding=state_sharding, abstract_state=abstract_state,
                 init_state=lambda: init_compiled(rng_data), train_step=train_step,
                 eval_step=eval_step, dense_steps=dense_steps, dense_train_step=dense_train_step,
                 dense_eval_step=dense_eval_step, to_device=to_device)
