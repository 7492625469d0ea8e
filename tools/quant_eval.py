"""Quantized serving measured on a trained run: held-out loss, greedy accuracy on an environment's
eval tasks, and greedy agreement with the unquantized model, one row per format.

  python tools/quant_eval.py --workdir=/tmp/glm5_sft --env=addition --tasks=200 \
      --quant_group_size=16
  python tools/quant_eval.py --workdir=/tmp/sft_qat ...   # a run trained with INT4 QAT
  python tools/quant_eval.py --workdir=/tmp/glm5_train --suite   # a pre-training run
  # several runs (e.g. a seeds study's, tools/seeds.py): each run's table, then every format's
  # mean and 95% t interval over the runs, and its accuracy change against the first format
  python tools/quant_eval.py --workdir=/tmp/glm5_seeds/default/sft0_rl0/rl,\
/tmp/glm5_seeds/default/sft1_rl0/rl,/tmp/glm5_seeds/default/sft2_rl0/rl --quant_group_size=16

Formats (`--formats`): `float` (the params as trained, in the run's dtype), `w8a8`, `w4a8`,
`w4a8_rotated` (`glm5_jax.quant`; docs/quantization.md). Every format serves the model without
its MTP layer (plain greedy decoding never runs it).

  held-out loss    mean token NLL of the assistant turns (loss-masked tokens) of the worked
                   solutions of the env's first `--tasks` eval tasks, teacher-forced
  accuracy         greedy completions of those tasks scored by the env (the RL eval's metric)
  agreement        tasks whose whole greedy conversation equals the first format's

With `--suite` (a pre-training run, which plays no environment) the prompts are the long-context
retrieval suite's examples at the run's training length (`glm5_jax.eval.suite`, its held-out
stream; `--suite_examples_per_cell` per task and needle depth):
  held-out loss    mean next-token NLL over the examples' tokens
  accuracy         the suite's score: teacher-forced exact match of the answers (for the first
                   answer, greedy decoding of it)
  agreement        examples whose argmax predictions at every answer token equal the first
                   format's
"""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app
from absl import flags

import glm5_jax
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.data import chat
from glm5_jax.eval import suite as suite_lib
from glm5_jax.eval.checkpoints import read_run_meta
from glm5_jax.infer.loading import load_model
from glm5_jax.posttrain import envs, rollout
from glm5_jax.posttrain.config import rl_config
from glm5_jax.quant import rotation, serve
from glm5_jax.sweeps import quant_table
from glm5_jax.train import console

_WORKDIR = flags.DEFINE_list("workdir", None, "Training run(s) (SFT or RL) to measure; several: "
                            "each run's table, then the means over them.")
_ENV = flags.DEFINE_string("env", "addition", "Environment whose eval tasks are played.")
_TASKS = flags.DEFINE_integer("tasks", 200, "Eval tasks (prompts).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Conversation budget (configs/rl_tiny.py's).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 48, "Tokens per turn (configs/rl_tiny.py's).")
_FORMATS = flags.DEFINE_list("formats", ["float", "w8a8", "w4a8", "w4a8_rotated"],
                             "Formats to measure; the first is the agreement reference.")
_GROUP = flags.DEFINE_integer("quant_group_size", 128, "W4A8's INT4 group size.")
_SUITE = flags.DEFINE_bool("suite", False, "Measure on the retrieval suite at the run's training "
                           "length instead of an environment (a pre-training run).")
_SUITE_EXAMPLES = flags.DEFINE_integer("suite_examples_per_cell", 8, "With --suite: examples per "
                                       "task and needle depth.")


def served_formats(model, params, formats, group):
  """`{format: (model, params)}` of the run's model without its MTP layer (greedy decoding and the
  suite never run it)."""
  model = ml_collections.ConfigDict(model.to_dict())
  model.update(num_nextn_predict_layers=0, mtp_depths=0)
  params = {k: v for k, v in params.items() if k != "mtp"}
  out = {}
  for fmt in formats:
    if fmt == "float":
      out[fmt] = (model, params)
      continue
    quant, _, rotated = fmt.partition("_")
    source = rotation.rotate(model, params) if rotated == "rotated" else (model, params)
    out[fmt] = serve.quantize(*source, quant, group)
  return out


def heldout_loss(model, params, env, tokenizer, tasks, seq_len) -> float:
  """Mean NLL of the assistant tokens of the tasks' worked solutions, teacher-forced."""
  rows = [chat.render(env.worked_solution(t), tokenizer) for t in tasks]
  n = min(max(len(r.ids) for r in rows), seq_len)
  ids = np.zeros((len(rows), n), np.int32)
  mask = np.zeros((len(rows), n), np.float32)
  for i, r in enumerate(rows):
    ids[i, :min(len(r.ids), n)] = r.ids[:n]
    mask[i, :min(len(r.ids), n)] = r.loss_mask[:n]
  logits = np.asarray(glm5_jax.logits(model, params, ids), np.float32)[:, :-1]
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -np.take_along_axis(np.asarray(logp), ids[:, 1:, None], axis=-1)[..., 0]
  return float((nll * mask[:, 1:]).sum() / mask[:, 1:].sum())


def suite_row(model, params, examples, tokenizer, length, dsa_stage) -> tuple[dict, list]:
  """`(row, answer_predictions)` of one format on the suite's `examples` (all of `length`)."""
  cfg = ModelConfig.from_config(model)

  @jax.jit
  def predict(tokens_BL, positions_BL, segment_ids_BL):
    out = glm5_jax.forward(cfg, params, tokens_BL, positions_BL, segment_ids_BL, mtp=False,
                           mode=Mode(dsa_stage=dsa_stage))
    logp_BLY = jax.nn.log_softmax(out["logits"][:, :-1].astype(jnp.float32), axis=-1)
    nll_BL = -jnp.take_along_axis(logp_BLY, tokens_BL[:, 1:, None], axis=-1)[..., 0]
    inside_BL = (segment_ids_BL[:, 1:] == 1) & (segment_ids_BL[:, :-1] == 1)
    return (jnp.argmax(logp_BLY, axis=-1), jnp.where(inside_BL, nll_BL, 0.0).sum(),
            inside_BL.sum())

  rows = max(1, 8192 // length)
  scores, answers, nll, count = [], [], 0.0, 0
  for b in range(0, len(examples), rows):
    chunk = examples[b:b + rows]
    batch = suite_lib.pad_examples(chunk, length, rows, tokenizer.pad_id)
    pred, total, n = predict(batch["tokens"], batch["positions"], batch["segment_ids"])
    pred = np.asarray(pred)
    nll, count = nll + float(total), count + int(n)
    for row, example in enumerate(chunk):
      scores.append(suite_lib.score_example(example, pred[row]))
      answers.append([pred[row][start - 1:end - 1].tolist()
                      for start, end in example.answer_spans])
  return {"heldout_loss": nll / count,
          "accuracy": float(np.mean([s["exact_match"] for s in scores]))}, answers


def main_suite(served, workdir: str):
  """The `--suite` table (module docstring)."""
  meta = read_run_meta(workdir)
  length = int(meta["config"]["data"]["seq_len"])
  suite = suite_lib.suite_config(lengths=(length,), examples_per_cell=_SUITE_EXAMPLES.value)
  examples = [e for _, e in suite_lib.build_examples(suite, served.tokenizer, length)]
  reference, rows = None, []
  for fmt, (model, params) in served_formats(served.model, served.params, _FORMATS.value,
                                             _GROUP.value).items():
    row, answers = suite_row(model, params, examples, served.tokenizer, length,
                             suite.dsa_stage)
    reference = reference or answers
    row = {"format": fmt, **row,
           "agreement": float(np.mean([a == b for a, b in zip(answers, reference)]))}
    rows.append(row)
    print(json.dumps(row), flush=True)
  return f"retrieval suite at length {length}, {len(examples)} held-out examples", rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  console.quiet_library_info()
  tables = []
  for workdir in _WORKDIR.value:
    served = load_model(workdir=workdir)
    what, rows = main_suite(served, workdir) if _SUITE.value else main_env(served)
    print_table(served.source, what, rows)
    tables.append(rows)
  if len(tables) > 1:
    print(quant_table.over_runs(tables))


def main_env(served):
  """The environment table (module docstring)."""
  env = envs.make(_ENV.value)
  tasks = [env.task(i, "eval") for i in range(_TASKS.value)]
  config = ml_collections.ConfigDict({
      "data": {"seq_len": _SEQ_LEN.value, "tokenizer": "byte"},
      "rl": rl_config(max_new_tokens=_MAX_NEW.value, eval_samples=0)})
  reference, rows = None, []
  for fmt, (model, params) in served_formats(served.model, served.params, _FORMATS.value,
                                             _GROUP.value).items():
    config.model = model
    samples = rollout.generate_samples(config, params, env, tasks, seed=0, group_size=1,
                                       temperature=0.0, tokenizer=served.tokenizer)
    conversations = [tuple(s.tokens.tolist()) for s in samples]
    reference = reference or conversations
    row = {"format": fmt,
           "heldout_loss": heldout_loss(model, params, env, served.tokenizer, tasks,
                                        _SEQ_LEN.value),
           "accuracy": float(np.mean([s.correct for s in samples])),
           "agreement": float(np.mean([a == b for a, b in zip(conversations, reference)]))}
    rows.append(row)
    print(json.dumps(row), flush=True)
  return f"{_ENV.value}, {_TASKS.value} eval tasks, greedy", rows


def print_table(source: str, what: str, rows: list[dict]) -> None:
  print(f"\n{source}; {what}")
  print(f"{'format':<16}{'held-out loss':>14}{'accuracy':>10}{'agreement':>11}")
  for row in rows:
    print(f"{row['format']:<16}{row['heldout_loss']:>14.4f}{row['accuracy']:>10.3f}"
          f"{row['agreement']:>11.3f}")


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")
  app.run(main)
