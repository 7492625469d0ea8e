"""Search which layers of a trained full-attention model become sliding-window attention.

  python tools/search_swa_pattern.py --workdir=/tmp/mla --model.sliding_window=64
  python tools/search_swa_pattern.py --workdir=/tmp/mla --beam_width=4 --layers_per_step=1 \
      --num_convert=2 --length=1024 --suite.examples_per_cell=4 --output=/tmp/swa.json

The report's beam search (docs/reference.md section 3; glm5_jax.eval.swa_search): from the
checkpoint's pattern, convert `--layers_per_step` more layers to `--letter` per step in every
possible way, score each candidate training-free (checkpoint params, SWA needs no new ones) by
retrieval exact match at one context length (`--length`, default `--length_multiple` x the
run's training length), keep the best `--beam_width`, until `--num_convert` layers (default
half) are converted. Prints the best pattern and saves it with every candidate's score to
`--output` (default <workdir>/swa_search.json); its `pattern` field feeds
`--config.model.attention_pattern` or experiments/eval.py `--model.attention_pattern`.
"""

import json

from absl import app, flags
from ml_collections import config_flags

from configs import overrides
from glm5_jax.config import model_config
from glm5_jax.eval.evaluate import search_swa_pattern
from glm5_jax.eval.report import write_json
from glm5_jax.eval.suite import suite_config
from glm5_jax.train import console

RETRIEVAL_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "mqar")

_WORKDIR = flags.DEFINE_string("workdir", None, "Full-attention training run to convert.",
                               required=True)
_SUITE = overrides.define_config_dict(
    "suite", suite_config(tasks=RETRIEVAL_TASKS, depths=(0.0, 0.5, 1.0), examples_per_cell=2),
    "Retrieval suite that scores each candidate (its lengths are replaced by --length).")
_LENGTH = flags.DEFINE_integer("length", 0, "Context length scored; 0 = --length_multiple x "
                               "the run's training length.")
_LENGTH_MULTIPLE = flags.DEFINE_float("length_multiple", 4.0, "See --length.")
_NUM_CONVERT = flags.DEFINE_integer("num_convert", -1, "Layers to convert; -1 = half.")
_BEAM_WIDTH = flags.DEFINE_integer("beam_width", 8, "Patterns kept per step.")
_LAYERS_PER_STEP = flags.DEFINE_integer("layers_per_step", 2, "Layers converted per step.")
_LETTER = flags.DEFINE_string("letter", "S", "Attention letter of converted layers.")
_MODEL = overrides.define_config_dict(
    "model", model_config(), "Model fields to change in the converted model, e.g. "
    "--model.sliding_window=64; only fields given here apply.")
_SEED = flags.DEFINE_integer("seed", 0, "Init seed of parts a conversion adds (none for SWA).")
_OUTPUT = flags.DEFINE_string("output", "", "JSON output (default <workdir>/swa_search.json).")


def main(argv):
  del argv
  console.quiet_library_info()
  overrides = config_flags.get_override_values(flags.FLAGS["model"])
  result = search_swa_pattern(
      _WORKDIR.value, _SUITE.value, length=_LENGTH.value or None,
      length_multiple=_LENGTH_MULTIPLE.value,
      num_convert=None if _NUM_CONVERT.value < 0 else _NUM_CONVERT.value,
      beam_width=_BEAM_WIDTH.value, layers_per_step=_LAYERS_PER_STEP.value,
      letter=_LETTER.value, model_overrides=overrides, seed=_SEED.value)
  output = _OUTPUT.value or f"{_WORKDIR.value}/swa_search.json"
  write_json(output, result)
  print("\n== SWA pattern search ==")
  print(f"base {result['base_pattern']} -> {result['num_convert']} layers to "
        f"{result['letter']!r} at length {result['length']}, beam {result['beam_width']}, "
        f"{result['layers_per_step']} per step: {result['evaluations']} candidates scored in "
        f"{result['seconds']:.0f} s")
  for step, ranked in enumerate(result["history"], start=1):
    print(f"step {step}: " + ", ".join(f"{p} {s:.3f}" for p, s in ranked[:8]))
  print(f"best pattern: {result['pattern']} (score {result['score']:.4f})")
  print(f"saved: {output}")
  print(json.dumps({"pattern": result["pattern"], "score": result["score"]}))


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
