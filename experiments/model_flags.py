"""The model-loading flags of experiments/serve.py, generate.py and eval.py, defined once here,
and the one place that reads them (`load_kwargs`: the arguments of
`glm5_jax.infer.loading.load_model`).

  --workdir / --hf_path / --random_init   the model's source (exactly one; eval.py: --workdir)
  --model.<field>=...                     served-model fields to change (e.g. dsa_impl)
  --tokenizer                             'byte' or a tokenizer.json instead of the source's
  --quant=w8a8|w4a8 [--quant_group_size]  serve quantized (docs/quantization.md)
  --rotate                                a Hadamard rotation folded in before quantizing
  --cache_dtype                           the decode cache's dtype

`--config` and `--seed` stay each entry point's own: serve.py and generate.py take `--config`
for `--random_init` only (`define_random_init_config`), eval.py as the evaluated run's target
config; `--seed` is generate.py's sampling seed too.
"""

from absl import flags
from ml_collections import config_flags

from configs import overrides
from glm5_jax.config import model_config

WORKDIR = flags.DEFINE_string("workdir", None, "Training run workdir: its latest checkpoint "
                              "(the model and tokenizer from the config saved with it).")
HF_PATH = flags.DEFINE_string("hf_path", None, "HF GLM-5 checkpoint directory (its "
                              "tokenizer.json, if any).")
RANDOM_INIT = flags.DEFINE_bool("random_init", False, "--config's model with random params "
                                "(smoke tests of the serving path only).")
MODEL = overrides.define_config_dict(
    "model", model_config(), "Model fields to change, e.g. --model.dsa_impl=pallas; only "
    "fields given here apply (a changed attention pattern converts the params training-free).")
TOKENIZER = flags.DEFINE_string("tokenizer", None, "'byte' or a tokenizer.json path instead of "
                                "the model source's own.")
QUANT = flags.DEFINE_enum("quant", "none", ["none", "w8a8", "w4a8"], "Quantize the loaded "
                          "params: INT8 weights (w8a8) or INT4 routed experts (w4a8), INT8 "
                          "activations per token (docs/quantization.md).")
QUANT_GROUP = flags.DEFINE_integer("quant_group_size", 0, "w4a8's INT4 group size (0: the "
                                   "model's quant_group_size, 128).")
ROTATE = flags.DEFINE_bool("rotate", False, "Fold a Hadamard rotation into the weights before "
                           "quantizing (QuaRot-style; logits unchanged in full precision).")
CACHE_DTYPE = flags.DEFINE_enum(
    "cache_dtype", None, ["float32", "bfloat16", "float16"], "The decode cache's dtype "
    "(default: the model's compute dtype, so cached decode equals the full forward; bfloat16 "
    "under an fp32 model halves the cache and rounds it: docs/inference.md).")


def define_random_init_config():
  """`--config`, the run config whose model `--random_init` builds (serve.py, generate.py; a
  function, as eval.py defines a `--config` of its own). Its holder: `load_kwargs`' `config`
  is its value."""
  return overrides.define_config_file(
      "config", None, "Run config for --random_init (its model and data.tokenizer), e.g. "
      "configs/tiny.py.", lock_config=False)


def model_overrides() -> dict:
  """The `--model.<field>` values given on the command line (only those)."""
  return config_flags.get_override_values(flags.FLAGS["model"])


def serving_kwargs() -> dict:
  """What is done to the loaded params before serving: `load_model`'s (and
  `loading.prepare_for_serving`'s) quant, quant_group_size, rotate and cache_dtype."""
  return dict(quant=QUANT.value, quant_group_size=QUANT_GROUP.value or None,
              rotate=ROTATE.value, cache_dtype=CACHE_DTYPE.value)


def load_kwargs(config, seed: int) -> dict:
  """`load_model`'s arguments from the flags (picklable: an engine process loads with them).
  `config`: the entry point's `--config` (for `--random_init` only); `seed`: the init seed of
  random params and of parts a conversion adds. ValueError on a contradictory source."""
  if RANDOM_INIT.value and config is None:
    raise ValueError("--random_init needs --config (e.g. --config=configs/tiny.py): the model "
                     "to initialize")
  if config is not None and not RANDOM_INIT.value:
    raise ValueError("--config is for --random_init only: a --workdir or --hf_path model is "
                     "the checkpoint's own (change fields with --model.<field>=...)")
  return dict(workdir=WORKDIR.value, hf_path=HF_PATH.value,
              random_init_config=config if RANDOM_INIT.value else None,
              model_overrides=model_overrides(), tokenizer=TOKENIZER.value, seed=seed,
              **serving_kwargs())
