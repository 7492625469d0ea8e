"""Params, model config and tokenizer to serve, from one of three sources.

  workdir      a training run (experiments/train.py): its latest orbax checkpoint, read by
               `glm5_jax.eval.checkpoints.load_run` (the params verified against the fingerprint
               saved with them; the model and tokenizer from the config recorded in the
               checkpoint's `meta`)
  hf_path      a released GLM-5 HF directory (`glm5_jax.load_hf`); its tokenizer.json, if any
  random_init  a run config's model, freshly initialized: smoke tests of the serving path only

`model_overrides` ({field: value}) change the served model, e.g. {"dsa_impl": "pallas"}; a
changed attention pattern converts the params training-free, as in experiments/eval.py.
`quant` ("w8a8" / "w4a8", optionally after `rotate`) quantizes the loaded params for serving
(`glm5_jax.quant`; docs/quantization.md).

Cache dtype: the served model's `cache_dtype` is its compute `dtype` (an fp32 checkpoint decodes
with an fp32 cache, a bf16 one with bf16), so cached decode equals the full forward, unless the
caller chooses one (`cache_dtype=`, or `model_overrides={"cache_dtype": ...}`). A bfloat16 cache
under an fp32 forward halves the cache's bytes but rounds every cached latent and key to 8
mantissa bits: decode then leaves the full forward from the first cached token (on small fp32
checkpoints the relative logits error reached 1.7 and greedy outputs changed; docs/inference.md).
"""

import dataclasses
import os

import jax
import ml_collections

from glm5_jax.api import init_params
from glm5_jax.convert.hf import load_hf
from glm5_jax.data import check_vocab, make_tokenizer
from glm5_jax.quant import rotation, serve
from glm5_jax.eval.checkpoints import (apply_model_overrides, complete_model_config,
                                       convert_run_params, load_run)


@dataclasses.dataclass
class ServedModel:
  """What `load_model` returns.

  model: the model section (complete `model_config()`), as `infer.generate` takes it.
  params: its params.
  tokenizer: the source's tokenizer, or None (an HF directory without tokenizer.json).
  source: one line saying where the params came from (for the console).
  """

  model: ml_collections.ConfigDict
  params: dict
  tokenizer: object
  source: str


def load_model(*, workdir: str | None = None, hf_path: str | None = None,
               random_init_config=None, model_overrides: dict | None = None,
               tokenizer: str | None = None, seed: int = 0, quant: str = "none",
               quant_group_size: int | None = None, rotate: bool = False,
               cache_dtype: str | None = None) -> ServedModel:
  """The model to serve from exactly one source (module docstring).

  Args:
    workdir / hf_path / random_init_config: the source; give exactly one (the last is a run
      config: its `model` and `data.tokenizer` are used).
    model_overrides: model fields to change.
    tokenizer: "byte" or a tokenizer.json path, instead of the source's own.
    seed: init seed of random params, and of parts a pattern conversion adds.
    quant: "none", or serve quantized: "w8a8" / "w4a8" (`glm5_jax.quant.serve.quantize`).
    quant_group_size: W4A8's INT4 group size (default: the model's `quant_group_size`).
    rotate: fold a Hadamard rotation into the float weights first (`glm5_jax.quant.rotation`).
    cache_dtype: the decode cache's dtype; default: the model's `dtype` (module docstring).
  Raises:
    ValueError: no source or several; a tokenizer whose ids do not fit the model's vocab;
      `cache_dtype` and a `model_overrides` "cache_dtype" that differ.
    FileNotFoundError: a workdir without checkpoints, a missing HF directory.
    glm5_jax.train.checkpoint.CheckpointCorruptError: a damaged checkpoint step.
  """
  chosen = (model_overrides or {}).get("cache_dtype")
  if cache_dtype and chosen and cache_dtype != chosen:
    raise ValueError(f"cache_dtype={cache_dtype!r} and the model override cache_dtype="
                     f"{chosen!r} differ; give one")
  cache_dtype = cache_dtype or chosen
  given = [name for name, value in (("workdir", workdir), ("hf_path", hf_path),
                                    ("random_init", random_init_config)) if value]
  if len(given) != 1:
    raise ValueError(
        "give exactly one model source: --workdir (a training run's directory, its latest "
        "checkpoint), --hf_path (an HF GLM-5 checkpoint directory), or --random_init (random "
        f"params of --config's model, for smoke tests only); got {given or 'none'}")
  if workdir:
    if not os.path.isdir(workdir):
      raise FileNotFoundError(f"--workdir {workdir!r} does not exist (expected a directory "
                              "written by experiments/train.py)")
    run = load_run(workdir, model_overrides=model_overrides, seed=seed)
    model, params = run.model, run.params
    own_tokenizer = run.data.get("tokenizer", "byte")
    source = (f"workdir {workdir}, step {run.step}" +
              (f" (converted from pattern {run.source_model.attention_pattern})"
               if run.converted else ""))
  elif hf_path:
    if not os.path.isdir(hf_path):
      raise FileNotFoundError(f"--hf_path {hf_path!r} is not a directory (expected an HF "
                              "checkpoint directory with config.json and *.safetensors)")
    hf_model, params = load_hf(hf_path)
    source_model = complete_model_config(hf_model)
    model = apply_model_overrides(source_model, model_overrides)
    params = convert_run_params(params, source_model, model, seed=seed, description=hf_path)
    has_tokenizer = os.path.isfile(os.path.join(hf_path, "tokenizer.json"))
    own_tokenizer = hf_path if has_tokenizer else None
    source = f"HF checkpoint {hf_path}"
  else:
    model = apply_model_overrides(complete_model_config(random_init_config.model),
                                  model_overrides)
    params = init_params(model, jax.random.key(seed))
    own_tokenizer = random_init_config.data.get("tokenizer", "byte")
    source = f"random init (seed {seed}): smoke test, the completions are noise"
  model, params, done = quantize_for_serving(model, params, quant=quant,
                                             quant_group_size=quant_group_size, rotate=rotate,
                                             seed=seed)
  source += done
  model = apply_model_overrides(model, {"cache_dtype": cache_dtype or model.dtype},
                                "cache_dtype")
  name = tokenizer or own_tokenizer
  tok = make_tokenizer(name) if name else None
  if tok is not None:
    check_vocab(tok, model.vocab_size)
  return ServedModel(model=model, params=params, tokenizer=tok, source=source)


def quantize_for_serving(model, params, *, quant: str = "none",
                         quant_group_size: int | None = None, rotate: bool = False,
                         seed: int = 0):
  """`(model, params, what was done)` of loaded float params: rotated first when `rotate`
  (`glm5_jax.quant.rotation`), then quantized when `quant` is "w8a8" / "w4a8"
  (`glm5_jax.quant.serve.quantize`); the last item is ", rotated, quantized w4a8" or a part of
  it, for the source line. `load_model` and experiments/eval.py's loaded run use it."""
  done = ""
  if rotate:
    model, params = rotation.rotate(model, params, seed=seed)
    done += ", rotated"
  if quant != "none":
    model, params = serve.quantize(model, params, quant, quant_group_size)
    done += f", quantized {quant}"
  return model, params, done
