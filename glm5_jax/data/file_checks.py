"""Up-front checks of source files, so that bad data fails when a source is opened, naming the
file (and line), instead of mid-run: binary files among text_files, malformed or untrainable
chat_jsonl lines."""

import functools
import json

from glm5_jax.data import chat

TEXT_PROBE_BYTES = 1 << 16


@functools.lru_cache(maxsize=4096)
def check_file(name, kind, options, path, size, mtime_ns):  # pylint: disable=unused-argument
  """Refuses what would otherwise fail mid-run, naming the source and the file: a text file
  that is binary (a NUL byte or invalid UTF-8 in its first 64 KiB), a chat_jsonl line that is
  malformed or has nothing to train (`chat.check_trainable`), with its line number. Cached by
  (path, size, mtime): the train and eval splits list the same files."""
  where = f"source {name!r} ({kind}): {path}"
  if kind == "text_files":
    with open(path, "rb") as f:
      head = f.read(TEXT_PROBE_BYTES)
    try:
      head.decode("utf-8")
      bad = b"\0" in head
    except UnicodeDecodeError as e:  # a multibyte character cut by the probe is fine
      bad = not (len(head) == TEXT_PROBE_BYTES and e.start >= len(head) - 3)
    if bad:
      raise ValueError(f"{where}: not a UTF-8 text file (binary data in its first "
                       f"{TEXT_PROBE_BYTES} bytes); text_files reads text only: narrow the glob")
    return
  field, mode = dict(options)["messages_field"], dict(options)["thinking_mode"]
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        messages = json.loads(line)[field]
      except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{where}:{lineno}: not a JSON object with a field {field!r} "
                         f"({e!r})") from None
      try:
        chat.check_trainable(messages, thinking_mode=mode)
      except ValueError as e:
        raise ValueError(f"{where}:{lineno}: {e}") from None
