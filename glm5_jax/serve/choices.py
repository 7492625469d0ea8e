"""The choices of one HTTP request, fed by the engine loop's events: text (`serve.text`),
kept tokens, log-probs in OpenAI's shapes, finish reasons; and the batches of events one
request's streams deliver.

Events are consumed in batches (`batches`): everything the engine loop delivered since the
consumer last ran. A streaming response sends one chunk per choice per batch, so when the HTTP
side falls behind the engine, a chunk carries several tokens instead of the backlog growing
by one chunk per token (and the HTTP work per engine step stays bounded).
"""

import asyncio
from typing import NamedTuple

from glm5_jax.serve.text import ChoiceText, Detokenizer


class Choice:
  """One choice. `feed(event)` -> the delta (text fields) and the tokens it kept, as
  `(id, raw log-prob, top or None)`; `finish_reason` is set once the choice ended.

  Args:
    index: the choice's index. text: its `ChoiceText`.
    stop_tokens: the request's stop token ids (an ending stop token is kept in `tokens` and
      the log-probs, but is no text: OpenAI leaves the stop sequence out of the text).
    top: top log-probs wanted per token (<= the engine's `top_logprobs`).
  """

  def __init__(self, index: int, text: ChoiceText, stop_tokens, top: int = 0):
    self.index, self.text, self.stop_tokens, self.top = index, text, frozenset(stop_tokens), top
    self.tokens: list[int] = []
    self.raw_logprobs: list[float] = []
    self.top_logprobs: list = []  # per kept token: (ids [top], raw log-probs [top])
    self.finish_reason: str | None = None
    # `/v1/completions` log-probs (`completion_logprobs`): the tokens' texts, decoded on their
    # own in context, their entries not reported yet, and the characters they cover so far.
    self.pieces = Detokenizer(text.tokenizer)
    self.unreported: list[TokenEntry] = []
    self.offset = 0
    self.text_chars = 0  # characters of text returned so far (the echoed prompt's included)

  def feed(self, event, delta: dict) -> list:
    """Adds `event`'s tokens; returns the kept ones `(id, raw, top)`. Ends the choice at its
    completion or at a stop string (the caller then cancels its engine request)."""
    if self.finish_reason is not None:
      return []
    ended, tokens = event.completion is not None, event.tokens
    textual = len(tokens) - int(ended and bool(tokens) and (
        event.completion.finish_reason == "stop" and tokens[-1] in self.stop_tokens))
    if self.text.plain:  # no stop string, no tool call: every token is kept, decoded at once
      self.text.add_run(tokens[:textual], delta)
      n = len(tokens)
    else:
      n = 0
      for j, token in enumerate(tokens):
        if j < textual:
          before = self.text.kept
          self.text.add(token, delta)
          if self.text.kept == before:  # after a stop string: not kept
            break
        n = j + 1
        if self.text.stopped is not None:
          break
    kept = [(int(tokens[j]), float(event.raw_logprobs[j]), self._top(event, j))
            for j in range(n)]
    for token, raw, top in kept:
      self.tokens.append(token)
      self.raw_logprobs.append(raw)
      self.top_logprobs.append(top)
    if self.text.stopped is not None:
      self.finish_reason = "stop"
    elif ended:
      self.text.finish(delta)
      self.finish_reason = event.completion.finish_reason
    if self.finish_reason == "stop" and self.text.tool_calls:
      self.finish_reason = "tool_calls"
    return kept

  def _top(self, event, j):
    if not self.top or event.top_logprobs is None:
      return None
    ids, values = event.top_logprobs[j]
    return [int(i) for i in ids[:self.top]], [float(v) for v in values[:self.top]]

  def end(self, delta: dict) -> None:
    """The stream ended without a completion (cancelled): flush, finish as "length"."""
    if self.finish_reason is None:
      self.text.finish(delta)
      self.finish_reason = "length"


async def batches(inbox: asyncio.Queue, streams: list):
  """Yields lists of `(choice index, event or None)`: everything delivered so far, at least
  one item each; None is a stream's end. Stops when every stream ended; raises what the engine
  raised for a request."""
  index = {id(s): i for i, s in enumerate(streams)}
  left = len(streams)
  while left:
    items = [await inbox.get()]
    while not inbox.empty():
      items.append(inbox.get_nowait())
    out = []
    for stream, item in items:
      if isinstance(item, Exception):
        raise item
      left -= item is None
      out.append((index[id(stream)], item))
    yield out


# ---- log-probs in OpenAI's shapes ----------------------------------------------------------


class TokenEntry(NamedTuple):
  """One token of `/v1/completions`' log-probs: its text (what it adds to the choice's text),
  that text's offset in the returned text, its log-prob, its top alternatives `{text: log-prob}` or None, its id."""
  text: str
  offset: int
  logprob: float
  top: dict | None
  token: int


def echo_prompt(tokenizer, prompt) -> str:
  """`echo`: the prompt's text, its ids decoded as a completion's are (so a prompt given as
  ids comes back as the text those ids make). `echo` with `logprobs` is refused
  (`routes.completions`): OpenAI then returns the prompt tokens' log-probs, which the engine
  does not compute."""
  pieces = Detokenizer(tokenizer)
  return "".join(pieces.add(token) for token in prompt) + pieces.flush()


def completion_logprobs(tokenizer, kept, choice: Choice, text_chars: int, final: bool) -> dict:
  """`/v1/completions`' `logprobs` after `kept` tokens (`Choice.feed`): tokens, token_logprobs,
  top_logprobs (one `{token text: log-prob}` per token, None without top), text_offset; also
  `token_ids` (not in OpenAI's shape: token texts need not be unique).

  A token's text is what it adds to the choice's text (decoded in context: a character split
  over several tokens belongs to the token that completes it; an ending stop token adds ""),
  so `text[offset:offset + len(token)] == token` for every token of the returned `text`
  (`text_chars` long so far, echoed prompt included). A token is reported once its text is
  all in the text returned so far; at the choice's end (`final`) the rest are reported cut
  to the text (a stop string's characters are not in it)."""
  ends_on_stop_token = final and choice.text.stopped is None and bool(choice.tokens) and (
      choice.tokens[-1] in choice.stop_tokens)
  for j, (token, raw, top) in enumerate(kept):
    text = "" if ends_on_stop_token and j == len(kept) - 1 else choice.pieces.add(token)
    tops = None if top is None else {_piece(tokenizer, i): v for i, v in zip(*top)}
    choice.unreported.append(TokenEntry(text, choice.offset, raw, tops, int(token)))
    choice.offset += len(text)
  if final:
    tail = choice.pieces.flush()
    last = next((i for i in range(len(choice.unreported) - 1, -1, -1)
                 if choice.unreported[i].logprob is not None), None)
    if tail and last is not None:
      e = choice.unreported[last]
      choice.unreported[last] = e._replace(text=e.text + tail)
  ready = len(choice.unreported) if final else next(
      (i for i, e in enumerate(choice.unreported) if e.offset + len(e.text) > text_chars),
      len(choice.unreported))
  entries, choice.unreported = choice.unreported[:ready], choice.unreported[ready:]
  entries = [e._replace(text=e.text[:max(0, text_chars - e.offset)],
                        offset=min(e.offset, text_chars)) for e in entries]
  tops = [e.top for e in entries]
  return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
          "top_logprobs": tops if any(t is not None for t in tops) else None,
          "text_offset": [e.offset for e in entries], "token_ids": [e.token for e in entries]}


def chat_logprobs(tokenizer, kept) -> dict:
  """`/v1/chat/completions`' `logprobs`: `{"content": [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}]}`."""
  def entry(token, value):
    text = _piece(tokenizer, token)
    return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
  return {"content": [
      {**entry(t, raw), "top_logprobs": [] if top is None else [
          entry(i, v) for i, v in zip(*top)]} for t, raw, top in kept]}


def _piece(tokenizer, token: int) -> str:
  return tokenizer.decode([token], skip_special=False)
