"""The long-context retrieval suite: RULER-style tasks at several lengths and needle depths.

Tasks come from `glm5_jax.data.synthetic` (needle single / multi-key / multi-value /
multi-query, multi-hop variable tracking, MQAR). For every (task, length, depth) cell the suite
generates `examples_per_cell` examples from a seed on its own stream (`suite.stream`, 2 by
default: training uses stream 0 and the pipeline's held-out eval stream 1), so no eval example
was ever trained on. Tasks whose generator ignores `depth` (MQAR) get one cell per length with
`examples_per_cell * len(depths)` examples, so every task weighs the same.

Scoring is exact match on the answer tokens only, teacher-forced: an example counts as right
when, at every answer token, the argmax of the model's next-token logits given the true prefix
is that token. For the first answer this is exactly greedy decoding of it; later answers see the
true earlier answers and ", " separators rather than generating them, so over a whole example it
is an upper bound on free-running greedy exact match (equal for one-answer tasks; a greedy decode
that gets every answer token right can only still fail on a separator). It needs one forward
pass per batch instead of one per generated token. Also reported: the share of
answers fully right (`answer_accuracy`, RULER's partial credit for multi-value tasks) and of
answer tokens right (`token_accuracy`).

Batching: the examples of one length are padded to that length (pad token, segment id 0,
position 0) and cut into batches of `max(1, batch_tokens // length)` rows, the last one filled
with empty rows, so each length compiles exactly one jitted forward.

Results (JSON-able dict):
  cells            [{task, length, depth, examples, exact_match, answer_accuracy,
                     token_accuracy, mean_tokens}]; depth None for depth-free tasks
  by_task_length   {task: {length: exact match over the task's cells at that length}}
  by_length        {length: mean over tasks}
  score            mean over tasks and lengths (the headline number)
  answers_by_task_length, answers_by_length, answer_accuracy
                   the same for answer accuracy (partial credit)
  token_accuracy   answer-token accuracy over all examples
  meta             lengths, train_length, tasks, examples, seconds, ...
"""

import functools
import time

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from glm5_jax.api import forward
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ModelConfig
from glm5_jax.data import synthetic
from glm5_jax.seeds import crc32_seed

DEFAULT_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
                 "variable_tracking", "mqar")
DEPTH_FREE_TASKS = ("mqar", "copy")  # generators that accept and ignore `depth`
EVAL_STREAM = 2


def default_task_options() -> dict:
  """Per-task generator options sized for the tiny model: needle values with 2 digits and MQAR
  values with 1 as in its training mix (configs/tiny.py `tiny_data_sources`), short variable
  tracking chains; everything else is the generator's default."""
  return dict(
      niah_single=dict(value_digits=2),
      niah_multikey=dict(value_digits=2, num_distractors=3),
      niah_multivalue=dict(value_digits=2, num_values=3),
      niah_multiquery=dict(value_digits=2, num_queries=2),
      variable_tracking=dict(value_digits=2, num_chains=1, num_hops=2, var_chars=3),
      # 2-letter keys fill even 8x the tiny training length with pairs (1-letter keys, the tiny
      # mix's form, allow only 13 pairs, so the example would not grow with the length).
      mqar=dict(num_queries=4, key_chars=2, value_digits=1),
  )


def suite_config(**overrides) -> ml_collections.ConfigDict:
  """The suite's defaults, with `overrides` applied (`task_options` merges per task)."""
  c = ml_collections.ConfigDict()
  c.tasks = DEFAULT_TASKS
  c.length_multiples = (1, 2, 4, 8)  # x train_length, used when `lengths` is empty
  c.lengths = ()  # explicit token lengths; overrides length_multiples when non-empty
  c.train_length = ml_collections.config_dict.placeholder(int)  # None: the run's data.seq_len
  c.depths = (0.0, 0.25, 0.5, 0.75, 1.0)  # first needle's depth in the haystack
  c.examples_per_cell = 4
  c.seed = 0
  c.stream = EVAL_STREAM  # 0 = training, 1 = the pipeline's held-out eval
  c.batch_tokens = 8192  # rows per batch = max(1, batch_tokens // length)
  c.dsa_stage = "sparse"  # how DSA layers attend at eval (inference: top-k on)
  options = default_task_options()
  options.update(overrides.pop("task_options", {}) or {})
  c.task_options = ml_collections.ConfigDict(options)
  c.update(overrides)
  return c


def resolve_lengths(suite, train_length: int | None) -> list[int]:
  """The suite's context lengths: `lengths`, or `length_multiples` x the training length."""
  if suite.lengths:
    lengths = [int(x) for x in suite.lengths]
  else:
    base = suite.train_length or train_length
    if not base:
      raise ValueError("suite.train_length is unset and no run config gives data.seq_len; "
                       "set --suite.train_length or --suite.lengths")
    lengths = [int(round(m * base)) for m in suite.length_multiples]
  if not lengths or min(lengths) < 8:
    raise ValueError(f"suite lengths must be non-empty and >= 8 tokens, got {lengths}")
  return sorted(set(lengths))


def validate_suite(suite) -> None:
  """Rejects impossible suite settings with errors naming the `suite.` field."""
  unknown = sorted(set(suite.tasks) - set(synthetic.TASKS))
  if unknown or not suite.tasks:
    raise ValueError(f"suite.tasks: unknown or empty {unknown or list(suite.tasks)}; known: "
                     f"{sorted(synthetic.TASKS)}")
  for task, options in suite.task_options.items():
    if task not in synthetic.TASKS:
      raise ValueError(f"suite.task_options.{task}: unknown task; known: "
                       f"{sorted(synthetic.TASKS)}")
    allowed = synthetic.task_options(task)
    bad = sorted(set(options) - set(allowed))
    if bad:
      raise ValueError(f"suite.task_options.{task}: unknown options {bad}; known: "
                       f"{sorted(allowed)}")
  if not suite.depths or any(not 0.0 <= d <= 1.0 for d in suite.depths):
    raise ValueError(f"suite.depths must be a non-empty list in [0, 1], got {suite.depths}")
  for field in ("examples_per_cell", "batch_tokens"):
    if not isinstance(suite[field], int) or suite[field] < 1:
      raise ValueError(f"suite.{field} must be an int >= 1, got {suite[field]!r}")


def cell_depths(suite, task: str) -> list:
  return [None] if task in DEPTH_FREE_TASKS else [float(d) for d in suite.depths]


def build_examples(suite, tokenizer, length: int) -> list[tuple[dict, synthetic.SyntheticExample]]:
  """[(cell key {task, length, depth}, example)] for one length, reproducible from the seed.

  Each cell salts the example seed with its (task, length, depth), so no two cells share an
  example and adding a length or depth leaves the other cells' examples unchanged.
  """
  out = []
  for task in suite.tasks:
    depths = cell_depths(suite, task)
    count = suite.examples_per_cell * (len(suite.depths) if depths == [None] else 1)
    options = suite.task_options.get(task, None)
    options = options.to_dict() if options is not None else {}
    for depth in depths:
      salt = crc32_seed(task, length, depth)
      for i in range(count):
        try:
          example = synthetic.generate(task, tokenizer, i, length=length, seed=suite.seed,
                                       stream=suite.stream, salt=salt, depth=depth, **options)
        except ValueError as e:
          raise ValueError(f"suite.task_options.{task} at length {length}: {e}") from e
        out.append((dict(task=task, length=length, depth=depth), example))
  return out


def pad_examples(examples, length: int, rows: int, pad_id: int) -> dict:
  """Numpy batch `[rows, length]` of left-aligned examples: tokens (pad_id after), positions
  (0.. then 0), segment_ids (1 on the example, 0 on padding and on empty filler rows)."""
  tokens = np.full((rows, length), pad_id, np.int32)
  positions = np.zeros((rows, length), np.int32)
  segment_ids = np.zeros((rows, length), np.int32)
  for row, example in enumerate(examples):
    n = len(example.tokens)
    if n > length:
      raise ValueError(f"a {example.task} example has {n} tokens > length {length}")
    tokens[row, :n] = example.tokens
    positions[row, :n] = np.arange(n)
    segment_ids[row, :n] = 1
  return dict(tokens=tokens, positions=positions, segment_ids=segment_ids)


@functools.partial(jax.jit, static_argnames=("model", "dsa_stage"))
def predict_next_tokens(params, tokens_BL, positions_BL, segment_ids_BL, *, model: ModelConfig,
                        dsa_stage: str = "sparse"):
  """Argmax next-token predictions `[B, L - 1]` int32: entry i predicts token i + 1."""
  out = forward(model, params, tokens_BL, positions_BL, segment_ids_BL, mtp=False,
                mode=Mode(dsa_stage=dsa_stage))
  return jnp.argmax(out["logits"][:, :-1], axis=-1).astype(jnp.int32)


def score_example(example: synthetic.SyntheticExample, predictions_L) -> dict:
  """Teacher-forced scores of one example from its row's next-token predictions."""
  span_right, right_tokens, total_tokens = [], 0, 0
  for start, end in example.answer_spans:
    right = predictions_L[start - 1:end - 1] == example.tokens[start:end]
    span_right.append(bool(right.all()))
    right_tokens += int(right.sum())
    total_tokens += end - start
  return dict(exact_match=float(all(span_right)), answer_accuracy=float(np.mean(span_right)),
              token_accuracy=right_tokens / max(total_tokens, 1))


def run_suite(model, params, suite, tokenizer, *, train_length: int | None = None,
              progress: bool = True) -> dict:
  """Scores `params` of `model` (ConfigDict or ModelConfig) on the suite; see module doc."""
  model = ModelConfig.from_config(model)
  predict = functools.partial(predict_next_tokens, params, model=model,
                              dsa_stage=suite.dsa_stage)
  results = score_predictor(predict, suite, tokenizer, train_length=train_length,
                            max_length=model.max_position_embeddings, progress=progress)
  results["meta"]["attention_pattern"] = model.attention_pattern
  return results


def score_predictor(predict, suite, tokenizer, *, train_length: int | None = None,
                    max_length: int | None = None, progress: bool = True) -> dict:
  """The suite's results (module doc) of any next-token predictor.

  Args:
    predict: `(tokens_BL, positions_BL, segment_ids_BL) -> [B, L - 1]` argmax predictions
      (entry i predicts token i + 1): a model's (`run_suite`), or a reference in a test.
    max_length: the longest length the predictor handles (a model's max positions).
  """
  validate_suite(suite)
  lengths = resolve_lengths(suite, train_length)
  too_long = [n for n in lengths if max_length is not None and n > max_length]
  if too_long:
    raise ValueError(f"suite lengths {too_long} exceed model.max_position_embeddings "
                     f"{max_length}")
  start_time, scored = time.time(), []
  for length in lengths:
    t0 = time.time()
    examples = build_examples(suite, tokenizer, length)
    rows = max(1, suite.batch_tokens // length)
    for b in range(0, len(examples), rows):
      chunk = examples[b:b + rows]
      batch = pad_examples([e for _, e in chunk], length, rows, tokenizer.pad_id)
      predictions = np.asarray(predict(batch["tokens"], batch["positions"],
                                       batch["segment_ids"]))
      for row, (key, example) in enumerate(chunk):
        scored.append((key, len(example.tokens), score_example(example, predictions[row])))
    if progress:
      mean = np.mean([s["exact_match"] for k, _, s in scored if k["length"] == length])
      logging.info("suite: length %d, %d examples, exact match %.3f (%.1f s)", length,
                   len(examples), mean, time.time() - t0)
  results = aggregate(scored, suite.tasks, lengths)
  results["meta"] = dict(lengths=lengths, train_length=suite.train_length or train_length,
                         tasks=list(suite.tasks), depths=[float(d) for d in suite.depths],
                         examples=len(scored), seconds=time.time() - start_time,
                         seed=suite.seed, stream=suite.stream,
                         scoring="teacher-forced argmax exact match")
  return results


def aggregate(scored, tasks, lengths) -> dict:
  """Cells, per task x length, per length and overall means from [(key, tokens, scores)]."""
  cells = {}
  for key, num_tokens, scores in scored:
    cell = cells.setdefault((key["task"], key["length"], key["depth"]),
                            dict(**key, examples=0, exact_match=0.0, answer_accuracy=0.0,
                                 token_accuracy=0.0, mean_tokens=0.0))
    cell["examples"] += 1
    for name in ("exact_match", "answer_accuracy", "token_accuracy"):
      cell[name] += scores[name]
    cell["mean_tokens"] += num_tokens
  for cell in cells.values():
    for name in ("exact_match", "answer_accuracy", "token_accuracy", "mean_tokens"):
      cell[name] /= cell["examples"]
  def task_length_means(metric):
    out = {}
    for task in tasks:
      out[task] = {}
      for length in lengths:
        hits = [c for c in cells.values() if c["task"] == task and c["length"] == length]
        n = sum(c["examples"] for c in hits)
        out[task][str(length)] = sum(c[metric] * c["examples"] for c in hits) / max(n, 1)
    return out

  by_task_length = task_length_means("exact_match")
  answers_by_task_length = task_length_means("answer_accuracy")
  over_tasks = lambda table: {str(n): float(np.mean([table[t][str(n)] for t in tasks]))
                              for n in lengths}
  by_length = over_tasks(by_task_length)
  answers_by_length = over_tasks(answers_by_task_length)
  return dict(cells=list(cells.values()), by_task_length=by_task_length, by_length=by_length,
              score=float(np.mean(list(by_length.values()))),
              answers_by_task_length=answers_by_task_length,
              answers_by_length=answers_by_length,
              answer_accuracy=float(np.mean(list(answers_by_length.values()))),
              token_accuracy=_example_mean(cells, "token_accuracy"))


def _example_mean(cells: dict, metric: str) -> float:
  n = sum(c["examples"] for c in cells.values())
  return sum(c[metric] * c["examples"] for c in cells.values()) / max(n, 1)
