"""`tools/device_suite.py` sections (d) and (e): the train step of the GLM-5-shaped 3B config and
engine decoding, on whatever backend runs the suite.

(d) train step: `configs/glm5_gpu_3b.py` (8 x 4,096 tokens per step, `save_attn_lse` remat,
    fused chunked CE, bf16 Newton-Schulz; `--smoke`: `smoke_config()`) built by the trainer
    itself (`glm5_jax.train.trainer.build_trainer`, as tools/bench_train.py does): the DSA
    sparse stage's jitted step is compiled, run once, then timed over `train_steps` steps on one
    prefetched batch; tokens/s, model TFLOP/s and MFU (`glm5_jax.train.metrics`: FLOPs per
    token from the config, the chip's bf16 peak from `glm5_jax.accelerators`), per
    `model.dsa_impl` in `--train_impls` (default "pallas" = the GPU kernels; "xla" beside it on
    request; `--smoke`: "pallas_interpret", the TPU kernels interpreted, since the config field
    has no GPU-interpret value). Beside the times: XLA's FLOP / byte estimates and memory, the
    `ragged-dot`s left in the compiled program and its custom-call targets; the last impl's
    compiled HLO text is saved gzipped (`train_step.hlo.txt.gz`, input of tools/flop_ledger.py
    `--hlo`), and its compiled step kept for `train_profile` (tools/device_suite_profile.py).
(e) decode: `infer.generate` (the serving engine) at 1 / 32 / 128 slots (`--smoke`: 1 / 2),
    plain and with MTP speculation (`spec_k` draft steps), greedy: generated tokens/s after a
    compiling warm-up call of the same shapes, the speed-up and the mean accept length. Params:
    `--workdir`'s latest checkpoint (prompts: held-out Python-stdlib windows through its
    tokenizer, `bench_decode.stdlib_prompts`) or random init (`glm5_jax.init_params`, on the
    device; random prompts): a random model's accept length says nothing about MTP (its drafts
    are noise), and the table says so.
"""

import collections
import gzip
import os
import re
import time

import jax
import numpy as np

import glm5_jax
from configs import glm5_gpu_3b, tiny
from glm5_jax import data, infer, param_stats
from glm5_jax.config import ModelConfig
from glm5_jax.infer.loading import load_model
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


def compile_step(config) -> dict:
  """The trainer's jitted step for `config`, compiled (`Trainer.compile_first_step`),
  with its initial state and one prefetched batch: `{compiled, state, batch, compile_s,
  hlo_text, trainer}`."""
  t = build_trainer(config)
  compiled, state, batch, compile_s = t.compile_first_step()
  return dict(compiled=compiled, state=state, batch=batch, trainer=t, compile_s=compile_s,
              hlo_text=compiled.as_text(), dsa_impl=t.model.dsa_impl)


def compiled_facts(run: dict) -> dict:
  """What the compiler says about the step: its FLOP / byte estimates, memory, and whether
  the MoE's `ragged-dot`s survived to the GPU program (XLA GPU keeps one only with the cuDNN
  ragged-dot fusion flag; otherwise it is expanded to a dense masked dot, issue 41)."""
  facts = dict(ragged_dot_ops=run["hlo_text"].count(" ragged-dot("))
  targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', run["hlo_text"]))
  facts["custom_calls"] = dict(targets.most_common(12))
  try:
    cost = run["compiled"].cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    facts.update(xla_flops=cost.get("flops"), xla_bytes_accessed=cost.get("bytes accessed"))
  except Exception as e:  # an estimate only; the step's figures stand without it
    facts["cost_analysis"] = f"{type(e).__name__}: {e}"[:200]
  try:
    memory = run["compiled"].memory_analysis()
    facts.update(temp_gib=memory.temp_size_in_bytes / 2**30,
                 argument_gib=memory.argument_size_in_bytes / 2**30)
  except Exception as e:
    facts["memory_analysis"] = f"{type(e).__name__}: {e}"[:200]
  return facts


def measure_train(run: dict, config, steps: int) -> dict:
  """One warm-up step, then `steps` timed steps of `run` (`compile_step`; its state advances)."""
  compiled, batch = run["compiled"], run["batch"]
  state, metrics = compiled(run["state"], batch)
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  run["state"] = state
  step_s = (time.perf_counter() - start) / steps
  tokens = config.data.batch_size * config.data.seq_len
  flops = flops_per_token(run["trainer"].model, config.data.seq_len)
  peak = peak_flops_per_device()
  return dict(dsa_impl=run["dsa_impl"], batch=config.data.batch_size,
              seq_len=config.data.seq_len, remat=config.model.remat_policy,
              ce_chunk=config.train.ce_chunk, ns_dtype=config.optim.ns_dtype,
              compile_s=run["compile_s"], step_s=step_s,
              tokens_per_s=tokens / step_s, tflops=tokens * flops / step_s / 1e12,
              mfu_pct=100 * tokens * flops / step_s / (peak * jax.device_count()) if peak
              else None, loss=float(metrics["loss"]) if "loss" in metrics else None)


def _config_name(smoke: bool) -> str:
  return "configs/tiny.py cut (SMOKE_MODEL)" if smoke else "configs/glm5_gpu_3b.py"


def compiled_train_step(ctx, release: bool = False) -> dict:
  """The compiled step of the train step section's last impl (`ctx.train_impls[-1]`), with its
  state after the timed steps; compiled here (plus one step) if that section did not keep one.
  `release`: drop the section's reference (the caller's is the last one)."""
  run = ctx.shared.pop("train") if release else ctx.shared.get("train")
  if run is None:
    impl = ctx.train_impls[-1]
    config = train_config(ctx.smoke, impl)
    run = compile_step(config)
    run["config_name"] = _config_name(ctx.smoke)
    run["state"], metrics = run["compiled"](run["state"], run["batch"])
    jax.block_until_ready(metrics)
  return run


def train_section(ctx) -> dict:
  """(d) the train step per `ctx.train_impls` (default: Pallas DSA; xla beside it on request);
  the last impl's compiled HLO saved gzipped (`train_step.hlo.txt.gz`) and its step kept for
  `train_profile` (`ctx.keep_train_step`)."""
  rows = []
  for impl in ctx.train_impls:
    config = train_config(ctx.smoke, impl)
    last = impl == ctx.train_impls[-1]

    def measure(impl=impl, config=config, last=last):
      run = compile_step(config)
      run["config_name"] = _config_name(ctx.smoke)
      row = dict(measure_train(run, config, ctx.train_steps), **compiled_facts(run))
      if last:
        path = os.path.join(ctx.out_dir, "train_step.hlo.txt.gz")
        with gzip.open(path, "wt") as f:
          f.write(run["hlo_text"])
        row["hlo_file"] = os.path.basename(path)
        if ctx.keep_train_step:
          ctx.shared["train"] = run
      return row

    rows.append(ctx.case(f"train step dsa_impl={impl}", measure))
  by_impl = {r.get("dsa_impl"): r for r in rows if r.get("status") == "ok"}
  ratio = None
  if "pallas" in by_impl and "xla" in by_impl:
    ratio = by_impl["pallas"]["tokens_per_s"] / by_impl["xla"]["tokens_per_s"]
  config = train_config(ctx.smoke, "xla")
  return dict(rows=rows, pallas_over_xla=ratio, config=_config_name(ctx.smoke),
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
