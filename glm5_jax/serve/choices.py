"""The choices of one HTTP request, fed by the engine loop's events: text (`serve.text`),
kept tokens, log-probs in OpenAI's shapes, finish reasons; and the batches of events one
request's streams deliver.

Events are consumed in batches (`batches`): everything the engine loop delivered since the
consumer last ran. A streaming response sends one chunk per choice per batch, so when the HTTP
side falls behind the engine, a chunk carries several tokens instead of the backlog growing
by one chunk per token (and the HTTP work per engine step stays bounded).
"""

import asyncio

from glm5_jax.serve.text import ChoiceText


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
    self.offset = 0  # characters of the token texts reported so far (`text_offset`)

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


def completion_logprobs(tokenizer, kept, choice: Choice) -> dict:
  """`/v1/completions`' `logprobs` for the kept tokens: tokens, token_logprobs, top_logprobs
  (one `{token text: log-prob}` per token, None without top), text_offset (the token texts'
  offsets, counted on from the choice's earlier tokens); also `token_ids` (not in OpenAI's
  shape: token texts need not be unique)."""
  texts = [_piece(tokenizer, t) for t, _, _ in kept]
  offsets = []
  for text in texts:
    offsets.append(choice.offset)
    choice.offset += len(text)
  tops = [None if top is None else {_piece(tokenizer, i): v for i, v in zip(*top)}
          for _, _, top in kept]
  return {"tokens": texts, "token_logprobs": [raw for _, raw, _ in kept],
          "top_logprobs": tops if any(t is not None for t in tops) else None,
          "text_offset": offsets, "token_ids": [t for t, _, _ in kept]}


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
