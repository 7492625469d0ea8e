"""Evaluate a trained run on the long-context retrieval suite (glm5_jax.eval.suite).

  python experiments/eval.py --workdir=workdir/tiny              # the run as trained
  python experiments/eval.py --workdir=/tmp/mla --model.attention_pattern=SMSM \
      --model.sliding_window=64                                   # training-free conversion
  python experiments/eval.py --workdir=/tmp/mla --config=configs/tiny.py:attention=M \
      --config.model.attention_pattern=DDDD --suite.examples_per_cell=8 \
      --suite.length_multiples=1,2,4,8,16 --suite.task_options.niah_single.value_digits=3

The model is the checkpoint's own (from its saved config) unless `--config` gives an explicit
run config, whose `model` section is then the target; `--model.<field>=...` flags (any field
of `glm5_jax.config.model_config`, typed and checked by ml_collections; only the fields given
count) change the target further. When the target differs from the trained model, the
checkpoint converts training-free (`glm5_jax.convert.attention_pattern`): trained parameters
are kept, new parts (indexers, GDN gates, ...) start from their init (`--seed`).
The model-loading flags are experiments/model_flags.py's, shared with serve.py and generate.py:
`--quant=w8a8|w4a8` (`--quant_group_size`, `--rotate`) evaluates the quantized model
(`glm5_jax.infer.loading.quantize_for_serving`), `--cache_dtype` its decode cache, and
`--tokenizer` replaces the run's; the source is a training run's `--workdir` only.
Lengths default to 1x, 2x, 4x and 8x the run's training length (`data.seq_len`). Writes
`<out_dir>/<name>.json` (every cell) and `<name>.md` (task x length and depth x length tables)
and prints the markdown.
"""

import dataclasses
import os
import sys

# `experiments.model_flags` when run as `python experiments/X.py` (sys.path[0] is experiments/,
# and the package is not installed: setup.cfg installs glm5_jax, pallas_kernels and configs).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging

from configs import overrides
from experiments import model_flags  # pylint: disable=wrong-import-position
from glm5_jax.data import make_tokenizer
from glm5_jax.eval.checkpoints import apply_model_overrides, load_run
from glm5_jax.eval.evaluate import evaluate_run
from glm5_jax.infer.loading import quantize_for_serving
from glm5_jax.eval.report import write_suite_results
from glm5_jax.eval.suite import suite_config
from glm5_jax.train import console

_CONFIG = overrides.define_config_file(
    "config", None, "Optional run config; its model section is the model evaluated.",
    lock_config=False)
_SUITE = overrides.define_config_dict("suite", suite_config(), "Retrieval suite settings.")
_SEED = flags.DEFINE_integer("seed", 0, "Init seed of parts a conversion adds.")
_OUT_DIR = flags.DEFINE_string("out_dir", "", "Output directory (default <workdir>/eval).")
_NAME = flags.DEFINE_string("name", "", "Output file stem (default eval_<pattern>).")


def _loaded_run(workdir: str, config, model_overrides: dict):
  """The run's params as `evaluate_run` loads them, then quantized and with the cache dtype of
  the model-loading flags (None: none of them given, `evaluate_run` loads the run itself)."""
  serving = model_flags.serving_kwargs()
  cache_dtype = serving.pop("cache_dtype")
  if serving["quant"] == "none" and not serving["rotate"] and cache_dtype is None:
    return None
  loaded = load_run(workdir, target_model=config.model if config else None,
                    model_overrides=model_overrides, seed=_SEED.value)
  model, params, _ = quantize_for_serving(loaded.model, loaded.params, seed=_SEED.value,
                                          **serving)
  if cache_dtype is not None:
    model = apply_model_overrides(model, {"cache_dtype": cache_dtype}, "cache_dtype")
  return dataclasses.replace(loaded, model=model, params=params)


def main(argv):
  del argv
  console.quiet_library_info()
  console.announce_slow_compiles()
  config = _CONFIG.value
  model_overrides = model_flags.model_overrides()
  workdir = model_flags.WORKDIR.value
  try:
    if not workdir or model_flags.HF_PATH.value or model_flags.RANDOM_INIT.value:
      raise ValueError("experiments/eval.py evaluates a training run: give --workdir (and no "
                       "--hf_path / --random_init)")
    tokenizer = model_flags.TOKENIZER.value or (config.data.tokenizer if config else None)
    results = evaluate_run(
        workdir, _SUITE.value, target_model=config.model if config else None,
        model_overrides=model_overrides, seed=_SEED.value,
        train_length=config.data.seq_len if config else None,
        tokenizer=make_tokenizer(tokenizer) if tokenizer else None,
        loaded=_loaded_run(workdir, config, model_overrides))
  except (ValueError, FileNotFoundError) as e:  # the user's input: its message, no traceback
    sys.stderr.write("\n".join(console.failure_lines(e, "evaluation")) + "\n")
    sys.exit(console.EXIT_FAILED)
  name = _NAME.value or f"eval_{results['meta']['attention_pattern']}"
  out_dir = _OUT_DIR.value or f"{workdir}/eval"
  json_path, md_path = write_suite_results(results, out_dir, name)
  with open(md_path) as f:
    print(f.read())
  logging.info("wrote %s and %s", json_path, md_path)
  print(f"results: {json_path}\nmarkdown: {md_path}")


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
