"""Tokenizers: a byte-level default that needs no files, and HF `tokenizer.json` files.

Both expose one small interface, all the data pipeline needs:
  encode(text) -> list[int]          no specials added, and none parsed out of the text
  encode_array(text) -> int32 [n]    the same ids as a numpy array (the pipeline's fast path)
  decode(ids, skip_special=True) -> str
  special_ids(names) -> {name: id}   special tokens by name; ValueError naming any missing
  vocab_size, bos_id, eos_id, pad_id

Byte-level layout (vocab 276, fits the tiny model's 384):
  0 pad, 1 bos, 2 eos, 3..18 the chat specials (`glm5_jax.data.chat.CHAT_SPECIALS`, in order:
  3 `[gMASK]`, 4 `<sop>`, 5 `<|system|>`, ... 14 `</tool_response>`, 15 `<arg_key>`, ...
  18 `</arg_value>`), 19 reserved (`<|reserved_19|>`), 20..275 the byte values 0..255
  (id = byte + 20).
`encode` maps UTF-8 bytes only, so text that spells a special's name never becomes a special.
An HF tokenizer is made to do the same (`encode_special_tokens`): a user message that contains
the text "<|assistant|>" must not forge a role token.

`decode` never fails on ids outside [0, vocab_size) (a model vocab padded past the tokenizer's
can emit them, as the tiny model's 384 over the byte tokenizer's 276): they are dropped, or
written as `<|unk:ID|>` when `skip_special=False`.
"""

import functools
import os

import numpy as np
import tokenizers

BYTE_OFFSET = 20
# `glm5_jax.data.chat.CHAT_SPECIALS` (tests/test_chat.py checks they agree), spelled out here so
# that the tokenizers do not depend on the chat format.
CHAT_SPECIAL_NAMES = (
    "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
    "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
    "</arg_key>", "<arg_value>", "</arg_value>")
SPECIAL_NAMES = ("<pad>", "<bos>", "<eos>") + CHAT_SPECIAL_NAMES + tuple(
    f"<|reserved_{i}|>" for i in range(3 + len(CHAT_SPECIAL_NAMES), BYTE_OFFSET))
assert len(SPECIAL_NAMES) == BYTE_OFFSET



def unknown_name(token_id: int) -> str:
  return f"<|unk:{token_id}|>"


def _decode_known(ids, vocab_size, decode_run, skip_special) -> str:
  """`decode_run` over the maximal runs of ids in [0, vocab_size); the others are dropped, or
  written as `<|unk:ID|>` when `skip_special=False`."""
  out, run = [], []
  for i in np.asarray(ids, np.int64).ravel().tolist():
    if 0 <= i < vocab_size:
      run.append(i)
      continue
    if run:
      out.append(decode_run(run))
      run = []
    if not skip_special:
      out.append(unknown_name(i))
  if run:
    out.append(decode_run(run))
  return "".join(out)


def _missing_specials(tokenizer, missing) -> ValueError:
  return ValueError(f"tokenizer {tokenizer!r} lacks the special tokens {list(missing)}; add them "
                    "to its added tokens (special: true)")


# Names looked up (in order) in an HF tokenizer's vocabulary when the caller names none.
HF_BOS_NAMES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]", "<sop>")
HF_EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "[SEP]", "<eop>")
HF_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")


class ByteTokenizer:
  """UTF-8 bytes shifted past 16 special ids; see the module docstring for the layout."""

  vocab_size = BYTE_OFFSET + 256
  pad_id, bos_id, eos_id = 0, 1, 2
  special_names = SPECIAL_NAMES

  def __repr__(self):
    return f"ByteTokenizer(vocab_size={self.vocab_size})"

  def encode_array(self, text: str) -> np.ndarray:
    data = np.frombuffer(text.encode("utf-8"), np.uint8)
    return data.astype(np.int32) + BYTE_OFFSET

  def encode(self, text: str) -> list[int]:
    return self.encode_array(text).tolist()

  def decode(self, ids, skip_special: bool = True) -> str:
    """Bytes decode as UTF-8 (invalid sequences become U+FFFD); specials and ids past the vocab
    are dropped, or written as their names (`<|unk:ID|>`) when `skip_special=False`."""
    return _decode_known(ids, self.vocab_size, functools.partial(
        self._decode_run, skip_special=skip_special), skip_special)

  @staticmethod
  def _decode_run(ids, skip_special):
    out, run = [], bytearray()
    for i in ids:
      if i >= BYTE_OFFSET:
        run.append(i - BYTE_OFFSET)
        continue
      out.append(run.decode("utf-8", errors="replace"))
      run = bytearray()
      if not skip_special:
        out.append(SPECIAL_NAMES[i])
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)

  def special_ids(self, names) -> dict[str, int]:
    ids = {name: SPECIAL_NAMES.index(name) for name in names if name in SPECIAL_NAMES}
    if missing := [name for name in names if name not in ids]:
      raise _missing_specials(self, missing)
    return ids


class HFTokenizer:
  """A `tokenizers.Tokenizer` loaded from a `tokenizer.json`, with bos/eos/pad ids resolved.

  bos/eos/pad are looked up by name in the vocabulary (the `*_NAMES` lists above, or the names
  given). A missing bos falls back to eos (GPT-2 style: one separator token); a missing pad falls
  back to 0, which is safe because padding is always masked out by segment id 0.
  """

  def __init__(self, path: str, *, bos: str | None = None, eos: str | None = None,
               pad: str | None = None):
    self.path = path
    self._tok = tokenizers.Tokenizer.from_file(path)
    self._tok.encode_special_tokens = True  # text never becomes a special (module docstring)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    eos_id = self._find(eos, HF_EOS_NAMES, "eos")
    bos_id = self._find(bos, HF_BOS_NAMES, "bos")
    if eos_id is None and bos_id is None:
      raise ValueError(
          f"tokenizer {path!r}: found no bos/eos token among {HF_BOS_NAMES + HF_EOS_NAMES}; "
          "pass their names with make_tokenizer(path, bos=..., eos=...)")
    self.eos_id = eos_id if eos_id is not None else bos_id
    self.bos_id = bos_id if bos_id is not None else self.eos_id
    pad_id = self._find(pad, HF_PAD_NAMES, "pad")
    self.pad_id = pad_id if pad_id is not None else 0

  def _find(self, name, candidates, role):
    if name is not None:
      token_id = self._tok.token_to_id(name)
      if token_id is None:
        raise ValueError(f"tokenizer {self.path!r}: {role} token {name!r} is not in the vocab")
      return token_id
    for candidate in candidates:
      token_id = self._tok.token_to_id(candidate)
      if token_id is not None:
        return token_id
    return None

  def __repr__(self):
    return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"

  def __setstate__(self, state):  # grain workers unpickle it; the flag is not pickled
    self.__dict__.update(state)
    self._tok.encode_special_tokens = True

  def special_ids(self, names) -> dict[str, int]:
    """The ids of `names` among the tokenizer.json's added tokens (a name that only exists as
    ordinary vocabulary text is missing: `encode` could produce it from text)."""
    added = {token.content: i for i, token in self._tok.get_added_tokens_decoder().items()}
    if missing := [name for name in names if name not in added]:
      raise _missing_specials(self, missing)
    return {name: added[name] for name in names}

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_array(self, text: str) -> np.ndarray:
    return np.asarray(self.encode(text), np.int32)

  def decode(self, ids, skip_special: bool = True) -> str:
    return _decode_known(ids, self.vocab_size, functools.partial(
        self._tok.decode, skip_special_tokens=skip_special), skip_special)


def make_tokenizer(name_or_path: str, *, bos: str | None = None, eos: str | None = None,
                   pad: str | None = None):
  """"byte" -> `ByteTokenizer()`; a `tokenizer.json` (or a directory holding one) -> HFTokenizer.

  `bos`/`eos`/`pad` name the HF special tokens when the defaults in `HF_*_NAMES` do not fit.
  """
  if name_or_path == "byte":
    return ByteTokenizer()
  path = os.path.expanduser(str(name_or_path))
  if os.path.isdir(path):
    path = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"tokenizer {name_or_path!r}: no such file {path!r} "
        "(expected 'byte' or a path to an HF tokenizer.json)")
  try:
    return HFTokenizer(path, bos=bos, eos=eos, pad=pad)
  except Exception as e:  # tokenizers raises a bare Exception on malformed files
    if isinstance(e, ValueError) and str(e).startswith("tokenizer "):
      raise
    raise ValueError(f"tokenizer {path!r}: not a valid HF tokenizer.json ({e})") from e


def check_vocab(tokenizer, model_vocab_size: int) -> None:
  """Raises if the tokenizer's ids do not all fit the model's embedding table."""
  if tokenizer.vocab_size > model_vocab_size:
    raise ValueError(
        f"tokenizer {tokenizer!r} has vocab_size {tokenizer.vocab_size} > model vocab_size "
        f"{model_vocab_size}; raise model.vocab_size or pick a smaller tokenizer")
