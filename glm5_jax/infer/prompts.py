"""Prompts for `infer.generate` from text or a jsonl file, validated before anything runs.

A prompts file is JSON lines, one object per prompt (blank lines are skipped):

  {"prompt": "def fib(n):"}                 text, encoded with the model's tokenizer (its bos
                                            first when `add_bos`, as training rows begin)
  {"tokens": [1, 116, 117, 118]}            token ids, used exactly as given
  {"id": "q7", "prompt": "..."}             optional "id" (a string or an int), echoed in the
                                            output; default the prompt's 0-based index

Exactly one of "prompt" and "tokens"; any other key is an error (a misspelt "promt" must not be
skipped silently). Every error is a `ValueError` naming the file and line.
"""

import dataclasses
import json
import numbers

KEYS = ("id", "prompt", "tokens")


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One prompt: its token ids, its text (None when given as ids), and its id for the output."""

  tokens: tuple
  text: str | None
  id: str | int


def encode_text(text: str, tokenizer, *, add_bos: bool, where: str) -> tuple:
  """`text`'s ids (bos first when `add_bos`); `where` names the prompt in errors."""
  if tokenizer is None:
    raise ValueError(f"{where}: a text prompt needs a tokenizer, and the model has none (an HF "
                     "directory without tokenizer.json): pass --tokenizer, or give token ids")
  if not isinstance(text, str) or not text:
    raise ValueError(f"{where}: the prompt must be a non-empty string; got {text!r}")
  return ((tokenizer.bos_id,) if add_bos else ()) + tuple(tokenizer.encode(text))


def _token_list(value, vocab_size: int, where: str) -> tuple:
  if not isinstance(value, list) or not value:
    raise ValueError(f"{where}: \"tokens\" must be a non-empty list of int token ids; got "
                     f"{value!r:.80}")
  for j, token in enumerate(value):
    if not isinstance(token, numbers.Integral) or isinstance(token, bool):
      raise ValueError(f"{where}: tokens[{j}] = {token!r} is not an int")
    if not 0 <= token < vocab_size:
      raise ValueError(f"{where}: tokens[{j}] = {token} is outside [0, {vocab_size}) (the "
                       "model's vocab)")
  return tuple(int(t) for t in value)


def parse_prompt_line(line: str, tokenizer, *, vocab_size: int, add_bos: bool, where: str,
                      default_id) -> Prompt:
  """One jsonl line as a `Prompt` (module docstring for the schema)."""
  try:
    entry = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
  if not isinstance(entry, dict):
    raise ValueError(f"{where}: expected a JSON object like {{\"prompt\": \"...\"}} or "
                     f"{{\"tokens\": [...]}}; got {type(entry).__name__}")
  unknown = sorted(set(entry) - set(KEYS))
  if unknown:
    raise ValueError(f"{where}: unknown key(s) {unknown}; allowed {list(KEYS)}")
  if ("prompt" in entry) == ("tokens" in entry):
    raise ValueError(f"{where}: give exactly one of \"prompt\" (text) and \"tokens\" (ids)")
  prompt_id = entry.get("id", default_id)
  if not isinstance(prompt_id, (str, int)) or isinstance(prompt_id, bool):
    raise ValueError(f"{where}: \"id\" must be a string or an int; got {prompt_id!r}")
  if "tokens" in entry:
    return Prompt(_token_list(entry["tokens"], vocab_size, where), None, prompt_id)
  return Prompt(encode_text(entry["prompt"], tokenizer, add_bos=add_bos, where=where),
                entry["prompt"], prompt_id)


def read_prompts_file(path: str, tokenizer, *, vocab_size: int, add_bos: bool = True,
                      first_id: int = 0) -> list[Prompt]:
  """Every prompt of a jsonl file (module docstring); default ids count from `first_id`.

  Raises:
    FileNotFoundError: no such file.
    ValueError: a bad line (naming `path:line`), or a file with no prompt.
  """
  prompts = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, start=1):
      if line.strip():
        prompts.append(parse_prompt_line(
            line, tokenizer, vocab_size=vocab_size, add_bos=add_bos, where=f"{path}:{number}",
            default_id=first_id + len(prompts)))
  if not prompts:
    raise ValueError(f"{path}: no prompts (expected one JSON object per line)")
  return prompts
