"""Generate completions with `glm5_jax.infer.generate` from a trained run or an HF checkpoint.

  python experiments/generate.py --workdir=workdir/tiny --prompt="def fib(n):"
  python experiments/generate.py --workdir=workdir/tiny --prompts_file=prompts.jsonl \
      --temperature=0.8 --top_p=0.95 --seed=1 --max_new_tokens=64 --output=out.jsonl
  python experiments/generate.py --hf_path=/data/GLM-5 --prompt="Hello" --speculative_steps=3
  python experiments/generate.py --random_init --config=configs/tiny.py --prompt=hi  # smoke

The model-loading flags are experiments/model_flags.py's (shared with serve.py and eval.py).
The model comes from exactly one of `--workdir` (a training run's latest checkpoint, its model
and tokenizer from the config saved with it), `--hf_path` (`glm5_jax.load_hf`, the directory's
tokenizer.json) or `--random_init` (`--config`'s model with random params: a smoke test of the
serving path). `--model.<field>=...` changes the served model (e.g. `--model.dsa_impl=pallas`).
Prompts: `--prompt` (repeatable; text through the tokenizer, its bos first) and/or
`--prompts_file` (jsonl, schema in `glm5_jax.infer.prompts`: {"prompt": "..."} or
{"tokens": [...]}, optional "id").

Prints each completion (text and ids) and the throughput. Timing is honest: a warm-up run of the
same calls compiles every shape first (`--warmup`), then the timed runs: the whole generation,
and a `max_new_tokens=1` run (prefill plus the first token) whose time is the prefill's; decode
tokens/s divides the tokens after the first by the difference. With `--speculative_steps=k`
(MTP drafting, k > 0) it also prints the mean accept length (tokens per verification step, the
bonus token included).

Exit status: 0 done; 1 failed, the last line on stderr is the cause (a bad flag, prompt file
line or checkpoint).
"""

import json
import os
import sys

# `experiments.model_flags` when run as `python experiments/X.py` (sys.path[0] is experiments/,
# and the package is not installed: setup.cfg installs glm5_jax, pallas_kernels and configs).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import time

from absl import app, flags
import jax
import numpy as np
from configs import overrides
from experiments import model_flags, serving_flags  # pylint: disable=wrong-import-position
from glm5_jax import infer
from glm5_jax.infer.loading import load_model
from glm5_jax.infer.prompts import Prompt, encode_text, read_prompts_file
from glm5_jax.train import console

_CONFIG = model_flags.define_random_init_config()
_PROMPT = flags.DEFINE_multi_string("prompt", [], "A text prompt (repeatable).")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, "jsonl of prompts: {\"prompt\": text} "
                                    "or {\"tokens\": [ids]}, optional \"id\".")
_ADD_BOS = flags.DEFINE_bool("add_bos", True, "Put the tokenizer's bos before text prompts.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate per prompt, at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass, in (0, 1] (1 = off).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k likeliest tokens (0 = off).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed (prompt i draws from (seed, i)); also "
                             "the init seed of --random_init.")
_STOP_TOKENS = flags.DEFINE_list("stop_tokens", [], "Token ids that end a completion (kept in it).")
_STOP_AT_EOS = flags.DEFINE_bool("stop_at_eos", True, "The tokenizer's eos ends a completion.")
_SPECULATIVE = flags.DEFINE_integer("speculative_steps", 0, "MTP draft tokens per verification "
                                    "step (0 = plain decoding; 3 is GLM-5's setting).")
_MTP_CACHE = flags.DEFINE_enum("mtp_cache", "per_depth", ["per_depth", "shared"], "The MTP "
                               "drafter's cache scheme with --speculative_steps > 0 "
                               "(glm5_jax.infer.cache).")
_SIZES = serving_flags.define_engine_sizes(
    slots=(0, "Sequences decoded at once (0: every prompt, at most 32)."),
    max_len=(0, "Cache positions per slot (0: what the longest prompt needs)."))
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile with a warm-up run before timing.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write one JSON line per completion here "
                              "(id, prompt and completion ids, log-probs, text).")


def _prompts(served) -> list[Prompt]:
  prompts = [Prompt(encode_text(text, served.tokenizer, add_bos=_ADD_BOS.value,
                                where=f"--prompt #{i}"), text, i)
             for i, text in enumerate(_PROMPT.value)]
  if _PROMPTS_FILE.value:
    prompts += read_prompts_file(_PROMPTS_FILE.value, served.tokenizer,
                                 vocab_size=served.model.vocab_size, add_bos=_ADD_BOS.value,
                                 first_id=len(prompts))
  if not prompts:
    raise ValueError("no prompts: give --prompt=TEXT (repeatable) or --prompts_file=FILE.jsonl")
  return prompts


def _stop_tokens(tokenizer) -> tuple:
  try:
    stop = [int(t) for t in _STOP_TOKENS.value]
  except ValueError:
    raise ValueError(f"--stop_tokens must be comma-separated int ids; got "
                     f"{_STOP_TOKENS.value}") from None
  if _STOP_AT_EOS.value and tokenizer is not None:
    stop.append(tokenizer.eos_id)
  return tuple(dict.fromkeys(stop))


def _text(tokenizer, ids) -> str:
  """`ids` decoded; ids the model can emit but the tokenizer lacks (a model vocab padded past
  the tokenizer's, as the tiny model's 384 over the byte tokenizer's 276) show as
  `<|unk:ID|>` rather than failing the decode or vanishing."""
  parts, run = [], []
  for i in ids:
    if i < tokenizer.vocab_size:
      run.append(i)
      continue
    parts += [tokenizer.decode(run), f"<|unk:{i}|>"]
    run = []
  return "".join(parts + [tokenizer.decode(run)])


def _timed(fn):
  start = time.perf_counter()
  out = fn()  # generate returns host lists: every device result is already read back
  return out, time.perf_counter() - start


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  console.quiet_library_info()
  console.announce_slow_compiles()
  try:
    output_dir = os.path.dirname(os.path.abspath(_OUTPUT.value or "."))
    if _OUTPUT.value and not os.path.isdir(output_dir):  # found before any generating
      raise FileNotFoundError(f"--output={_OUTPUT.value}: no directory {output_dir}")
    served = load_model(**model_flags.load_kwargs(_CONFIG.value, _SEED.value))
    prompts = _prompts(served)
    _generate_and_print(served, prompts)
  except (ValueError, FileNotFoundError) as e:  # the user's input: its message, no traceback
    sys.stderr.write("\n".join(console.failure_lines(e, "generation")) + "\n")
    sys.exit(console.EXIT_FAILED)
  except Exception as e:  # pylint: disable=broad-except
    console.exit_on_failure(e, "generation")


def _generate_and_print(served, prompts):
  k = _SPECULATIVE.value
  ids = [list(p.tokens) for p in prompts]
  # One max_len for the full and the prefill-only run, so they share compiled shapes.
  max_len = _SIZES.max_len.value or max(len(t) for t in ids) + _MAX_NEW.value - 1 + k
  common = dict(temperature=_TEMPERATURE.value, top_p=_TOP_P.value, top_k=_TOP_K.value,
                seed=_SEED.value, speculative_steps=k, stop_tokens=_stop_tokens(served.tokenizer),
                slots=_SIZES.slots.value or None, max_len=max_len,
                prefill_chunk=_SIZES.prefill_chunk.value)
  if k:
    common["mtp_cache"] = _MTP_CACHE.value
  full = lambda: infer.generate(served.model, served.params, ids, max_new_tokens=_MAX_NEW.value,
                                **common)
  prefill = lambda: infer.generate(served.model, served.params, ids, max_new_tokens=1, **common)
  print(f"model: {served.source}; pattern {served.model.attention_pattern}, "
        f"{served.model.num_hidden_layers} layers; backend {jax.default_backend()}")
  if _WARMUP.value:
    (_, compile_s), _ = _timed(full), _timed(prefill)
    print(f"warm-up (compiles every shape): {compile_s:.2f}s")
  result, total_s = _timed(full)
  _, prefill_s = _timed(prefill)

  tok = served.tokenizer
  records = []
  for prompt, tokens, logprobs, raw in zip(prompts, result.tokens, result.logprobs,
                                           result.raw_logprobs):
    text = _text(tok, tokens) if tok is not None else None
    print(f"\n== [{prompt.id}] {len(prompt.tokens)} prompt tokens -> {len(tokens)} generated")
    if prompt.text is not None:
      print(f"prompt: {prompt.text!r}")
    if text is not None:
      print(f"completion: {text!r}")
    print(f"ids: {tokens}")
    records.append(dict(id=prompt.id, prompt_tokens=list(prompt.tokens), tokens=tokens,
                        logprobs=logprobs, raw_logprobs=raw, text=text))

  generated = sum(len(t) for t in result.tokens)
  prompt_tokens = sum(len(t) for t in ids)
  print(f"\n== throughput ({'after warm-up' if _WARMUP.value else 'WITH compile time'}; "
        f"{len(ids)} prompts, slots {_SIZES.slots.value or min(len(ids), 32)}, max_len {max_len})")
  print(f"overall: {generated} tokens in {total_s:.3f}s = {generated / total_s:,.1f} tokens/s")
  print(f"prefill: {prompt_tokens} prompt tokens in {prefill_s:.3f}s (a max_new_tokens=1 run) = "
        f"{prompt_tokens / prefill_s:,.1f} tokens/s")
  decode_tokens, decode_s = generated - len(ids), total_s - prefill_s
  if decode_tokens > 0 and decode_s > 0:
    print(f"decode: {decode_tokens} tokens after the first in {decode_s:.3f}s = "
          f"{decode_tokens / decode_s:,.1f} tokens/s")
  if k:
    print(f"speculative ({k} draft steps, {_MTP_CACHE.value} MTP cache): mean accept length "
          f"{np.mean(result.accept_lengths):.3f} tokens per verification step "
          f"(per prompt: {[round(a, 3) for a in result.accept_lengths]})")
    for record, accept in zip(records, result.accept_lengths):
      record["accept_length"] = accept
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w", encoding="utf-8") as f:
      for record in records:
        f.write(json.dumps(record) + "\n")
    print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
