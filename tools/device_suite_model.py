"""`tools/device_suite.py` sections (d) and (e): the train step of the GLM-5-shaped 3B config and
engine decoding, on whatever backend runs the suite.

(d) train step: `configs/glm5_gpu_3b.py` (`--smoke`: `smoke_config()`) built by the trainer
    itself (`glm5_jax.train.trainer.build_trainer`, as tools/bench_train.py does): the DSA
    sparse stage's jitted step is compiled, run once, then timed over `train_steps` steps on one
    prefetched batch; tokens/s, model TFLOP/s and MFU (`glm5_jax.train.metrics`: FLOPs per
    token from the config, the chip's bf16 peak from `glm5_jax.accelerators`), once per
    `model.dsa_impl` ("xla", and "pallas" = the GPU kernels; `--smoke`: "pallas_interpret"
    alone, the TPU kernels interpreted, since the config field has no GPU-interpret value).
(e) decode: `infer.generate` (the serving engine) at 1 / 32 / 128 slots (`--smoke`: 1 / 2),
    plain and with MTP speculation (`spec_k` draft steps), greedy: generated tokens/s after a
    compiling warm-up call of the same shapes, the speed-up and the mean accept length. Params:
    `--workdir`'s latest checkpoint (prompts: held-out Python-stdlib windows through its
    tokenizer, `bench_decode.stdlib_prompts`) or random init (`glm5_jax.init_params`, on the
    device; random prompts): a random model's accept length says nothing about MTP (its drafts
    are noise), and the table says so.
"""

import time

import jax
import numpy as np

import glm5_jax
from configs import glm5_gpu_3b, tiny
from glm5_jax import data, infer, param_stats
from glm5_jax.config import ModelConfig
from glm5_jax.infer.loading import load_model
from glm5_jax.sharding import activation_sharding
from glm5_jax.train.metrics import flops_per_token, peak_flops_per_device
from glm5_jax.train.trainer import build_trainer
from tools import bench_decode
from tools.device_suite_kernels import GPU_MODULES, present_kernels


# --smoke: configs/tiny.py cut to one DSA layer (dense FFN) and one MTP depth, short rows of
# stdlib text: seconds to compile on CPU.
SMOKE_MODEL = dict(num_hidden_layers=1, first_k_dense_replace=1, mtp_depths=1)


def smoke_config():
  config = tiny.get_config()
  config.model.update(SMOKE_MODEL)
  config.optim.name = "adamw"  # compiles faster than Muon on CPU
  config.data = data.data_config(seq_len=32, batch_size=1, sources=dict(
      python_stdlib=data.source_config("python_stdlib")))
  config.train.dsa_dense_steps = 0
  return config


def train_config(smoke: bool, dsa_impl: str):
  if smoke:
    config = smoke_config()
    config.model.dsa_impl = dsa_impl
    return config
  return glm5_gpu_3b.get_config(f"dsa_impl={dsa_impl}")


def measure_train(config, steps: int) -> dict:
  """Compile, one warm-up step, then `steps` timed steps (the bench_train.py procedure)."""
  t = build_trainer(config)
  state = t.init_state()
  batch = t.to_device(next(t.train_iter))
  start = time.perf_counter()
  with activation_sharding(t.mesh, t.rules):
    compiled = t.train_step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  step_s = (time.perf_counter() - start) / steps
  tokens = config.data.batch_size * config.data.seq_len
  flops = flops_per_token(t.model, config.data.seq_len)
  peak = peak_flops_per_device()
  return dict(dsa_impl=t.model.dsa_impl, batch=config.data.batch_size,
              seq_len=config.data.seq_len, compile_s=compile_s, step_s=step_s,
              tokens_per_s=tokens / step_s, tflops=tokens * flops / step_s / 1e12,
              mfu_pct=100 * tokens * flops / step_s / (peak * jax.device_count()) if peak
              else None, loss=float(metrics["loss"]) if "loss" in metrics else None)


def train_section(ctx) -> dict:
  """(d) the train step, XLA vs Pallas DSA side by side."""
  # --smoke: the Pallas path only (the XLA train step is what tests/test_train.py runs), to
  # keep the CPU check short.
  impls = ("pallas_interpret",) if ctx.smoke else ("xla", "pallas")
  rows = [ctx.case(f"train step dsa_impl={impl}",
                   lambda impl=impl: measure_train(train_config(ctx.smoke, impl),
                                                   ctx.train_steps))
          for impl in impls]
  by_impl = {r.get("dsa_impl"): r for r in rows if r.get("status") == "ok"}
  ratio = None
  if len(by_impl) == 2:
    ratio = by_impl["pallas"]["tokens_per_s"] / by_impl["xla"]["tokens_per_s"]
  config = train_config(ctx.smoke, "xla")
  return dict(rows=rows, pallas_over_xla=ratio,
              config="configs/tiny.py cut (SMOKE_MODEL)" if ctx.smoke
              else "configs/glm5_gpu_3b.py",
              params=param_stats.summarize(config.model)["total_params"])


def decode_dsa_impl(ctx) -> str:
  """`ctx.decode_dsa_impl`, except "pallas" while a GPU kernel module is missing from the build:
  then "xla" (the section's output names the impl that ran)."""
  if ctx.decode_dsa_impl == "pallas" and present_kernels() != set(GPU_MODULES):
    return "xla"
  return ctx.decode_dsa_impl


def decode_model(ctx):
  """`(model ConfigDict, params, prompt maker, source)` for the decode section."""
  if ctx.workdir:
    served = load_model(workdir=ctx.workdir, model_overrides={"dsa_impl": decode_dsa_impl(ctx)})
    make_prompts = lambda n: bench_decode.stdlib_prompts(served.tokenizer, n, ctx.prompt_len,
                                                         ctx.seed)
    return served.model, served.params, make_prompts, f"checkpoint {ctx.workdir}"
  model = (smoke_config() if ctx.smoke else glm5_gpu_3b.get_config()).model
  model.param_dtype = "bfloat16"
  model.dsa_impl = decode_dsa_impl(ctx)
  cfg = ModelConfig.from_config(model)
  params = glm5_jax.init_params(cfg, jax.random.key(ctx.seed))  # jitted, on the device
  rng = np.random.default_rng(ctx.seed)
  make_prompts = lambda n: rng.integers(1, cfg.vocab_size, (n, ctx.prompt_len)).tolist()
  return model, params, make_prompts, "random init (accept lengths meaningless)"


def _generate(model, params, prompts, slots, k, new_tokens) -> tuple:
  run = lambda: infer.generate(model, params, prompts, max_new_tokens=new_tokens,
                               speculative_steps=k, slots=slots)
  run()  # compiles every shape the timed call uses
  start = time.perf_counter()
  result = run()
  return result, time.perf_counter() - start


def decode_section(ctx) -> dict:
  """(e) engine decode tokens/s per slot count, plain and with MTP speculation."""
  model, params, make_prompts, source = decode_model(ctx)
  k = ctx.spec_k or ModelConfig.from_config(model).mtp_depths
  rows = []
  for slots in ctx.decode_slots:
    prompts = make_prompts(slots)
    plain_s = {}

    def plain(slots=slots, prompts=prompts, plain_s=plain_s):
      result, seconds = _generate(model, params, prompts, slots, 0, ctx.new_tokens)
      tokens = sum(len(t) for t in result.tokens)
      plain_s["s"] = seconds
      return dict(slots=slots, mode="plain", tokens_per_s=tokens / seconds, seconds=seconds)

    def speculative(slots=slots, prompts=prompts, plain_s=plain_s):
      result, seconds = _generate(model, params, prompts, slots, k, ctx.new_tokens)
      tokens = sum(len(t) for t in result.tokens)
      return dict(slots=slots, mode=f"MTP k={k}", tokens_per_s=tokens / seconds,
                  seconds=seconds, speedup=plain_s["s"] / seconds if plain_s else None,
                  accept_length=float(np.mean(result.accept_lengths)))

    rows.append(ctx.case(f"decode slots={slots} plain", plain))
    if k:
      rows.append(ctx.case(f"decode slots={slots} MTP k={k}", speculative))
  return dict(rows=rows, params_source=source, dsa_impl=model.dsa_impl,
              dsa_impl_asked=ctx.decode_dsa_impl,
              new_tokens=ctx.new_tokens, prompt_len=ctx.prompt_len,
              note=None if ctx.workdir else "random-init params: the accept length (and so "
              "the MTP speed-up) is meaningless; pass --workdir of a trained run")
