"""Generated token ids -> the text a client sees, incrementally (streamed or not, the same code).

  Detokenizer  ids -> text one id at a time; a trailing incomplete UTF-8 sequence (U+FFFD at
               the end) is held until the next id completes it or the choice ends
  StopText     OpenAI `stop` strings: the text is cut before the earliest stop string; while
               streaming, a tail that could still become a stop string (a prefix of one) is
               held back, so a stop string split over several tokens is never sent
  ChoiceText   one choice: plain text (completions), or GLM's assistant turn split into
               `reasoning_content` (before `</think>`), `content` and `tool_calls`
               (`<tool_call>...</tool_call>`, parsed with `glm5_jax.data.chat`'s rules)

Stop strings are matched in the visible text (a chat's reasoning and content, each on its own:
a stop string does not span `</think>`), never inside a tool call. The token that completes a
stop string is the last one kept (its id and log-prob stay in the choice's `token_ids` /
`logprobs`); the text ends before the stop string.
"""

import json
import secrets
import string

from glm5_jax.data import chat

_ID_CHARS = string.ascii_letters + string.digits


def tool_call_id() -> str:
  """A fresh tool-call id, `call_` and 24 random letters and digits as OpenAI's: unique within
  a conversation (a client matches each tool result to its call by id across all turns). A
  streamed call's chunk and the reply's message carry the one id made here."""
  return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


class Detokenizer:
  """Incremental decode. Each `add` decodes a short window (the ids since the last emitted
  text, with the previous emission's ids before them as context), not the whole sequence."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.ids: list[int] = []
    self._prefix = self._read = 0  # ids[prefix:read]: context already emitted

  def add(self, token: int) -> str:
    return self.add_many([token])

  def add_many(self, tokens) -> str:
    """`add` of several ids at once (one decode of the window instead of one per id)."""
    if not tokens:
      return ""
    self.ids.extend(tokens)
    decode = self.tokenizer.decode
    before = decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
    text = decode(self.ids[self._prefix:])
    if len(text) <= len(before) or text.endswith("\ufffd"):
      return ""  # nothing visible yet, or a multi-byte character not complete yet
    self._prefix, self._read = self._read, len(self.ids)
    return text[len(before):]

  def flush(self) -> str:
    """What `add` held back (an incomplete character at the end stays U+FFFD)."""
    if self._read == len(self.ids):
      return ""
    decode = self.tokenizer.decode
    before = decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
    text = decode(self.ids[self._prefix:])
    self._prefix = self._read = len(self.ids)
    return text[len(before):]


class StopText:
  """Text through `stops` (non-empty strings): `push` returns what is safe to emit; `matched`
  is the stop string found (then everything after it is dropped)."""

  def __init__(self, stops: tuple[str, ...]):
    self.stops = stops
    self.matched: str | None = None
    self._held = ""

  def push(self, text: str) -> str:
    if self.matched is not None or not text:
      return ""
    if not self.stops:
      return text
    buf = self._held + text
    hits = [(buf.find(s), s) for s in self.stops if s in buf]
    if hits:
      at, self.matched = min(hits)
      self._held = ""
      return buf[:at]
    # The longest tail of buf that a stop string starts with: it may complete later.
    keep = next((k for k in range(min(len(buf), max(map(len, self.stops)) - 1), 0, -1)
                 if any(s.startswith(buf[-k:]) for s in self.stops)), 0)
    self._held = buf[len(buf) - keep:]
    return buf[:len(buf) - keep]

  def flush(self) -> str:
    """The held tail, at the end of its text (it never became a stop string)."""
    out, self._held = self._held, ""
    return out


class ChoiceText:
  """One choice's text. `add(token, delta)` adds the token's visible effect to `delta` (a dict
  of `text` for plain choices; `reasoning_content` / `content` / `tool_calls` for chat);
  `finish(delta)` adds what was held back. After a stop string (`stopped`) every later token
  is ignored; `kept` counts the tokens before that point, the completing one included.

  Args:
    tokenizer: the server's tokenizer.
    stops: stop strings (may be empty).
    chat_turn: parse GLM's assistant turn (thinking, tool calls); else plain text.
    thinking: a chat prompt that ended with `<think>` (generation starts in the reasoning).
  """

  def __init__(self, tokenizer, stops=(), *, chat_turn: bool = False, thinking: bool = False):
    self.tokenizer, self.stops = tokenizer, tuple(stops)
    self.ids = chat.special_ids(tokenizer) if chat_turn else None
    self.channel = "reasoning_content" if chat_turn and thinking else (
        "content" if chat_turn else "text")
    self._detok, self._stop = Detokenizer(tokenizer), StopText(self.stops)
    self._call: list | None = None  # ids of an open `<tool_call>`
    # Plain text without stop strings: no id needs looking at on its own (`add_run`).
    self.plain = self.ids is None and not self.stops
    self.tool_calls = 0
    self.kept = 0
    self.stopped: str | None = None

  def _emit(self, delta, channel, text) -> None:
    if text:
      delta[channel] = delta.get(channel, "") + text

  def _text(self, delta, text) -> None:
    self._emit(delta, self.channel, self._stop.push(text))
    self.stopped = self._stop.matched

  def _close_channel(self, delta) -> None:
    """Ends the current text run (its held tail is text after all)."""
    self._text(delta, self._detok.flush())
    self._emit(delta, self.channel, self._stop.flush())
    self._detok, self._stop = Detokenizer(self.tokenizer), StopText(self.stops)

  def add(self, token: int, delta: dict) -> None:
    if self.stopped is not None:
      return
    self.kept += 1
    c = self.ids
    if c is None:
      self._text(delta, self._detok.add(token))
      return
    if self._call is not None:
      if token == c.tool_call_close:
        call = chat._parse_call(self._call, self.tokenizer, c)
        name, arguments = (call, {}) if isinstance(call, str) else (call["name"],
                                                                    call["arguments"])
        delta.setdefault("tool_calls", []).append(
            {"index": self.tool_calls, "id": tool_call_id(), "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments)}})
        self.tool_calls += 1
        self._call = None
      else:
        self._call.append(token)
      return
    if token in (c.think_open, c.think_close, c.tool_call_open):
      self._close_channel(delta)
      if self.stopped is not None:  # the held tail completed a stop string after all
        return
      if token == c.tool_call_open:
        self._call = []
      else:
        self.channel = "reasoning_content" if token == c.think_open else "content"
      return
    self._text(delta, self._detok.add(token))

  def add_run(self, tokens, delta: dict) -> None:
    """`add` of each of `tokens`, for a `plain` choice."""
    if not self.plain:
      raise ValueError("ChoiceText.add_run: a chat turn or stop strings need add() per token")
    self.kept += len(tokens)
    self._text(delta, self._detok.add_many(tokens))

  def finish(self, delta: dict) -> None:
    if self.stopped is not None:
      return
    if self._call is not None:  # an unclosed call is content, as `chat.parse_response` says
      self._close_channel(delta)
      self.channel = "content"
      for token in self._call:
        self._text(delta, self._detok.add(token))
      self._call = None
    self._close_channel(delta)
