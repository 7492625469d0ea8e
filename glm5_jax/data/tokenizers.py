"""Tokenizers: a byte-level default that needs no files, and HF `tokenizer.json` files.

Both expose one small interface, all the data pipeline needs:
  encode(text) -> list[int]          no specials added
  encode_array(text) -> int32 [n]    the same ids as a numpy array (the pipeline's fast path)
  decode(ids, skip_special=True) -> str
  vocab_size, bos_id, eos_id, pad_id

Byte-level layout (vocab 272, fits the tiny model's 384):
  0 pad, 1 bos, 2 eos, 3..15 reserved special symbols (`<|reserved_3|>` ...; free for later tasks,
  e.g. chat roles in RL), 16..271 the byte values 0..255 (id = byte + 16).
`encode` maps UTF-8 bytes only, so text that spells a special's name never becomes a special.
"""

import os

import numpy as np
import tokenizers

BYTE_OFFSET = 16
SPECIAL_NAMES = ("<pad>", "<bos>", "<eos>") + tuple(
    f"<|reserved_{i}|>" for i in range(3, BYTE_OFFSET))

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
    return "ByteTokenizer(vocab_size=272)"

  def encode_array(self, text: str) -> np.ndarray:
    data = np.frombuffer(text.encode("utf-8"), np.uint8)
    return data.astype(np.int32) + BYTE_OFFSET

  def encode(self, text: str) -> list[int]:
    return self.encode_array(text).tolist()

  def decode(self, ids, skip_special: bool = True) -> str:
    """Bytes decode as UTF-8 (invalid sequences become U+FFFD); specials are dropped, or written
    as their names when `skip_special=False`."""
    out, run = [], bytearray()
    for i in np.asarray(ids, np.int64).ravel().tolist():
      if i >= BYTE_OFFSET:
        run.append(i - BYTE_OFFSET)
        continue
      out.append(run.decode("utf-8", errors="replace"))
      run = bytearray()
      if not skip_special:
        out.append(SPECIAL_NAMES[i])
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)


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

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_array(self, text: str) -> np.ndarray:
    return np.asarray(self.encode(text), np.int32)

  def decode(self, ids, skip_special: bool = True) -> str:
    ids = np.asarray(ids, np.int64).ravel().tolist()
    return self._tok.decode(ids, skip_special_tokens=skip_special)


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
