"""What the config files share: `parse_arg`, the parser of `get_config`'s string argument."""

import inspect
import os

import ml_collections

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """`get_config(arg)`'s argument as typed values, big_vision style.

  `arg` is `key=value` items separated by commas (`configs/tiny.py:attention=G`). A bare `key`
  sets that bool key to True (`configs/sweeps/muon_split.py:quick`); a lone bare value that is
  not a bool key sets the first key (`configs/dsa_adaptation.py:sparse` is `stage=sparse`).
  Each value takes its default's type: bool (true/false/1/0/yes/no), int, float or str.

  Args:
    arg: the text after `:` in `--config=path:arg`, or None/"" for the defaults.
    **defaults: every key the config accepts, with its default value.
  Returns:
    a ConfigDict of every key (dot access), defaults filled in.
  Raises:
    ValueError: an unknown key or a value not of its key's type; the message names the config
      file that called `parse_arg`, the key and the keys it accepts.
  """
  where = _display(inspect.currentframe().f_back.f_code.co_filename)  # the config file
  items = [item for item in (arg or "").split(",") if item]
  if len(items) == 1 and "=" not in items[0] and defaults:
    first = next(iter(defaults))
    if items[0] not in defaults and not isinstance(defaults[first], bool):
      items = [f"{first}={items[0]}"]
  values = dict(defaults)
  for item in items:
    key, sep, text = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"{where}: unknown argument {key!r} in {arg!r}; it accepts "
                       f"{_accepted(defaults)}")
    if not sep and not isinstance(defaults[key], bool):
      raise ValueError(f"{where}: argument {key!r} needs a value ({key}=...)")
    values[key] = _typed(text.strip() if sep else "true", defaults[key], f"{where}: {key}")
  return ml_collections.ConfigDict(values, type_safe=False)


def _typed(text: str, default, what: str):
  if isinstance(default, bool):
    if text.lower() not in _TRUE + _FALSE:
      raise ValueError(f"{what}={text!r}: expected a bool (true/false)")
    return text.lower() in _TRUE
  if isinstance(default, (int, float)):
    try:
      return type(default)(text)
    except ValueError:
      raise ValueError(f"{what}={text!r}: expected {type(default).__name__}") from None
  return text


def _accepted(defaults: dict) -> str:
  return ", ".join(f"{k} (default {v!r})" for k, v in defaults.items()) or "no arguments"


def _display(path: str) -> str:
  """`path` relative to the working directory when under it (as a user typed it)."""
  relative = os.path.relpath(path)
  return path if relative.startswith("..") else relative
