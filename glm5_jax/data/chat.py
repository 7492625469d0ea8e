"""GLM-5's chat format: conversations -> token ids + loss mask, prompts, and responses back.

The layout is GLM-5's `chat_template.jinja` (the GLM-4.7 family; tests/test_chat_template.py
renders the official template, stored in tests/fixtures/, with transformers and compares token
for token in every mode):

  [gMASK]<sop>
  <|system|>{content}                                       system message
  <|user|>{content}                                         user message
  <|assistant|><think>{thinking}</think>{content}           assistant turn with thinking kept
  <|assistant|></think>{content}                            non-thinking (or cleared) turn
      <tool_call>{name}<arg_key>{k}</arg_key><arg_value>{v}</arg_value>...</tool_call>
                                                            one per entry of tool_calls
  <|observation|><tool_response>{content}</tool_response>   observation (a tool result);
      <tool_response>{content}</tool_response>              consecutive ones share one role token
  ...
  <eos>                                                     after a final assistant turn (`render`)

with no separators between the pieces. As the template does, an assistant turn's thinking and
content are `.strip()`ped (an empty content writes nothing), the thinking block is written only
for a non-empty thinking string (an empty one is a non-thinking turn: a lone `</think>`), and a
tool call's argument values are written as they are when str, else as JSON (`ensure_ascii=False`).
A tool call is `{"name": str, "arguments": {str: value}}`, or a str: a call with no arguments
(`<tool_call>{text}</tool_call>`), the free-text form the built-in environments use.

Where this differs from the template, on purpose:
  - escaping: each special is inserted as an id and each text piece is tokenized on its own
    (`tokenizer.encode`, which never turns text into a special), so a message that spells
    "<|user|>" or "</think>" stays text and cannot forge a role token or close a block. The
    template concatenates text and tokenizes the string, so there such text becomes specials
    (and assistant content holding `</think>` is split into reasoning and content);
  - `render` ends a conversation whose last message is an assistant turn with eos, its trained
    stop token (the template writes no eos). A prompt (`render_prompt`) never holds eos: turns
    inside a conversation end at the next role token;
  - roles and fields are this module's (`observation` for the template's `tool`, `thinking` for
    its `reasoning_content`); there is no tools block in the system message.

An assistant turn ends at the next role token (consecutive observations share the first), or at
eos when it is the conversation's last message; that token is the turn's stop token
(`stop_ids`: every role token and eos) and is trained, or the model never learns to stop.

Loss mask: 1 on exactly the tokens the model itself generates for a trained assistant turn,
i.e. everything after the generation prompt `render_prompt` ends with: the thinking text and
`</think>` (thinking turns; the prompt supplies `<|assistant|><think>`), the content, the tool
calls, and the stop token. On a non-thinking turn the prompt supplies `<|assistant|></think>`,
so only content, calls and stop are trained. SFT thus trains the same tokens that RL's rollouts
generate. Everything else (system, user and observation messages, role tokens that start a turn,
`[gMASK]<sop>`) is 0.

Thinking modes (`THINKING_MODES`; "the current trajectory" = the messages after the last user
message, i.e. the assistant / observation chain answering it):
  interleaved  the model thinks before every reply and every tool call: every assistant
               message must carry `thinking` (a str). Thinking of turns in the current
               trajectory stays in the context (so each step after a tool result still sees
               the reasoning that made the call); earlier turns' thinking is dropped (the
               template's default, `clear_thinking` unset). Prompts always open `<think>`.
  preserved    every assistant message must carry `thinking`, and every earlier turn keeps it
               in the context (the template's `clear_thinking=False`: the multi-turn
               coding-agent mode, whose context only ever grows, so rendering is prefix-stable
               across user turns too). Prompts always open `<think>`.
  turn_level   thinking is switched on or off per turn: `thinking` None (or absent) is a
               non-thinking turn, a str a thinking turn; `render_prompt`'s `thinking` chooses
               for the next turn (the template's `enable_thinking`). The context rule is
               interleaved's.
A turn whose thinking the context drops is not trained (its loss mask is all 0): its target
would be an answer without the reasoning that produced it, which teaches guessing. To train
every turn of a long multi-user conversation in interleaved mode, write one conversation per
user turn (prefixes), or use preserved. A turn with an empty thinking string renders as a
non-thinking turn (template), so it is trained as one, after `<|assistant|></think>`.

Consistency with token-in-token-out rollouts: within a trajectory the context never changes
(no user message is added), so `render_prompt(messages)` + the generated tokens (ending with
their stop token) + the observation's rendering is exactly `render_prompt` of the extended
conversation, as long as the generated text is what the template writes back (no whitespace
around thinking or content, a non-empty thinking).
"""

import dataclasses
import json
from typing import NamedTuple

import numpy as np

CHAT_SPECIALS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                 "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                 "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>",
                 "</arg_value>")  # the byte tokenizer's ids 3..18
THINKING_MODES = ("interleaved", "preserved", "turn_level")
ROLES = ("system", "user", "assistant", "observation")
# Fields each role may have; content is required.
FIELDS = dict(system=("role", "content"), user=("role", "content"),
              observation=("role", "content"), assistant=("role", "content", "thinking",
                                                          "tool_calls"))


@dataclasses.dataclass(frozen=True)
class ChatIds:
  """The id of each chat special (in `CHAT_SPECIALS` order), and the tokenizer's eos."""
  gmask: int
  sop: int
  system: int
  user: int
  assistant: int
  observation: int
  think_open: int
  think_close: int
  tool_call_open: int
  tool_call_close: int
  tool_response_open: int
  tool_response_close: int
  arg_key_open: int
  arg_key_close: int
  arg_value_open: int
  arg_value_close: int
  eos: int

  def role(self, role: str) -> int:
    return getattr(self, role)


class Rendered(NamedTuple):
  ids: np.ndarray  # int32 [n]
  loss_mask: np.ndarray  # float32 [n]: 1 on the tokens trained (module docstring)


class Response(NamedTuple):
  thinking: str | None  # None: the turn closed no thinking block
  content: str
  tool_calls: list  # str (no arguments) or {"name": str, "arguments": {str: str}} each
  stop: str | None  # the stop token's name ("<|observation|>", ...); None: never ended


def special_ids(tokenizer) -> ChatIds:
  """The chat specials' ids; ValueError naming any the tokenizer lacks."""
  by_name = tokenizer.special_ids(CHAT_SPECIALS)
  fields = [f.name for f in dataclasses.fields(ChatIds)][:len(CHAT_SPECIALS)]
  return ChatIds(**{f: by_name[name] for f, name in zip(fields, CHAT_SPECIALS)},
                 eos=tokenizer.eos_id)


def stop_ids(tokenizer) -> tuple[int, ...]:
  """The tokens that end an assistant turn: every role token, and eos."""
  c = special_ids(tokenizer)
  return tuple(dict.fromkeys((c.user, c.observation, c.eos, c.assistant, c.system)))


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _check_call(call, where):
  if isinstance(call, str):
    return
  if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
    raise ValueError(f"{where}: expected a str or a dict with exactly the keys 'name' and "
                     f"'arguments', got {call!r:.80}")
  if not isinstance(call["name"], str):
    raise ValueError(f"{where}.name: expected a str, got {type(call['name']).__name__}")
  args = call["arguments"]
  if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
    raise ValueError(f"{where}.arguments: expected a dict with str keys, got {args!r:.80}")
  for k, v in args.items():
    if not isinstance(v, str):
      try:
        json.dumps(v)
      except (TypeError, ValueError) as e:
        raise ValueError(f"{where}.arguments[{k!r}]: not JSON-serializable ({e})") from None


def _check(messages, thinking_mode):
  if thinking_mode not in THINKING_MODES:
    raise ValueError(f"thinking_mode: {thinking_mode!r}; known: {THINKING_MODES}")
  if not isinstance(messages, (list, tuple)):
    raise ValueError(f"messages: expected a list of message dicts, got "
                     f"{type(messages).__name__}")
  for i, m in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(m, dict):
      raise ValueError(f"{where}: expected a dict, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
      raise ValueError(f"{where}.role: {role!r}; known: {ROLES}")
    for key in m:
      if key not in FIELDS[role]:
        only = " (only assistant messages have it)" if key in FIELDS["assistant"] else ""
        raise ValueError(f"{where}.{key}: not a field of a {role} message{only}; fields: "
                         f"{FIELDS[role]}")
    if not isinstance(m.get("content"), str):
      raise ValueError(f"{where}.content: expected a str, got {type(m.get('content')).__name__}")
    if role != "assistant":
      continue
    thinking = m.get("thinking")
    if thinking is None and thinking_mode != "turn_level":
      raise ValueError(f"{where}.thinking: {thinking_mode} mode thinks on every assistant turn, "
                       "so it needs a str (turn_level allows None: a non-thinking turn)")
    if thinking is not None and not isinstance(thinking, str):
      raise ValueError(f"{where}.thinking: expected a str or None, got {type(thinking).__name__}")
    calls = m.get("tool_calls", [])
    if not isinstance(calls, (list, tuple)):
      raise ValueError(f"{where}.tool_calls: expected a list, got {calls!r:.80}")
    for k, call in enumerate(calls):
      _check_call(call, f"{where}.tool_calls[{k}]")


def _pieces(messages, tokenizer, c: ChatIds, thinking_mode):
  """[(ids, mask value)] of the conversation, and whether its last turn (an assistant one) is
  trained (then it still needs its stop token)."""
  last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
  pieces, open_trained = [([c.gmask, c.sop], 0.0)], False

  def text(s, mask):
    pieces.append((tokenizer.encode_array(s), mask))

  for i, m in enumerate(messages):
    role = m["role"]
    continued = role == "observation" and i > 0 and messages[i - 1]["role"] == "observation"
    if not continued:  # this role token ends an open assistant turn: its stop token
      pieces.append(([c.role(role)], float(open_trained)))
    open_trained = False
    if role == "observation":
      pieces.append(([c.tool_response_open], 0.0))
      text(m["content"], 0.0)
      pieces.append(([c.tool_response_close], 0.0))
    elif role != "assistant":
      text(m["content"], 0.0)
    else:
      thinking = m.get("thinking")
      # An empty thinking string is no thinking (the template tests `reasoning_content`).
      keep = bool(thinking) and (thinking_mode == "preserved" or i > last_user)
      trained = float(not thinking or keep)
      if keep:  # `<think>` ends the prompt; thinking and `</think>` are generated
        pieces.append(([c.think_open], 0.0))
        text(thinking.strip(), trained)
        pieces.append(([c.think_close], trained))
      else:  # ends the prompt (non-thinking turn), or context only (dropped thinking)
        pieces.append(([c.think_close], 0.0))
      if m["content"].strip():
        text(m["content"].strip(), trained)
      for call in m.get("tool_calls", []):
        pieces.append(([c.tool_call_open], trained))
        if isinstance(call, str):
          text(call, trained)
        else:
          text(call["name"], trained)
          for key, value in call["arguments"].items():
            value = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            pieces.append(([c.arg_key_open], trained))
            text(key, trained)
            pieces.append(([c.arg_key_close, c.arg_value_open], trained))
            text(value, trained)
            pieces.append(([c.arg_value_close], trained))
        pieces.append(([c.tool_call_close], trained))
      open_trained = bool(trained)
  return pieces, open_trained


def _join(pieces) -> Rendered:
  ids = np.concatenate([np.asarray(p, np.int32) for p, _ in pieces])
  mask = np.concatenate([np.full(len(p), m, np.float32) for p, m in pieces])
  return Rendered(ids, mask)


def check_trainable(messages, *, thinking_mode: str = "interleaved") -> None:
  """ValueError unless `messages` is a valid conversation (`render`'s checks) with a trained
  assistant turn: SFT data with nothing to train is a mistake (no assistant message, or only
  turns whose thinking the context drops, e.g. a conversation that ends with a user message)."""
  _check(messages, thinking_mode)
  if not messages:
    raise ValueError("messages: empty conversation")
  last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
  turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
  if not turns:
    raise ValueError("messages: no assistant message, so nothing to train (SFT trains the "
                     "assistant's turns)")
  if not any(not messages[i].get("thinking") or thinking_mode == "preserved" or i > last_user
             for i in turns):
    raise ValueError(f"messages: no assistant turn is trained in {thinking_mode} mode (each "
                     "one's thinking is dropped from the context: none follows the last user "
                     "message); end the conversation with an assistant turn, or use "
                     "thinking_mode='preserved'")


def render(messages, tokenizer, *, thinking_mode: str = "interleaved") -> Rendered:
  """The whole conversation as `Rendered(ids int32 [n], loss_mask float32 [n])` (layout, mask
  and modes in the module docstring). ValueError naming the message index and field on bad
  input."""
  _check(messages, thinking_mode)
  if not messages:
    raise ValueError("messages: empty conversation")
  c = special_ids(tokenizer)
  pieces, open_trained = _pieces(messages, tokenizer, c, thinking_mode)
  if messages[-1]["role"] == "assistant":
    pieces.append(([c.eos], float(open_trained)))
  return _join(pieces)


def render_prompt(messages, tokenizer, *, thinking: bool = True,
                  thinking_mode: str = "interleaved") -> np.ndarray:
  """int32 [n]: the context for the next assistant turn, ending with `<|assistant|><think>`
  (thinking) or `<|assistant|></think>` (not; turn_level mode only). Never holds eos."""
  _check(messages, thinking_mode)
  if not thinking and thinking_mode != "turn_level":
    raise ValueError(f"thinking: False needs thinking_mode='turn_level' ({thinking_mode} mode "
                     "thinks on every assistant turn)")
  c = special_ids(tokenizer)
  pieces, _ = _pieces(messages, tokenizer, c, thinking_mode)
  pieces.append(([c.assistant, c.think_open if thinking else c.think_close], 0.0))
  return _join(pieces).ids


# ---------------------------------------------------------------------------------------------
# Parsing a generated turn
# ---------------------------------------------------------------------------------------------


def _parse_call(ids, tokenizer, c: ChatIds):
  """One call's ids (between `<tool_call>` and `</tool_call>`) -> its str (no `<arg_key>`), or
  {"name", "arguments": {key: value str}}; arguments not in well-formed key/value pairs: the
  call's text with the specials dropped."""
  if c.arg_key_open not in ids:
    return tokenizer.decode(ids)
  k = ids.index(c.arg_key_open)
  name, rest, arguments = tokenizer.decode(ids[:k]), ids[k:], {}
  while rest:
    try:
      key_end = rest.index(c.arg_key_close)
      value_end = rest.index(c.arg_value_close)
    except ValueError:
      return tokenizer.decode(ids)
    if rest[0] != c.arg_key_open or rest[key_end + 1:key_end + 2] != [c.arg_value_open] or (
        value_end < key_end):
      return tokenizer.decode(ids)
    arguments[tokenizer.decode(rest[1:key_end])] = tokenizer.decode(rest[key_end + 2:value_end])
    rest = rest[value_end + 1:]
  return {"name": name, "arguments": arguments}


def parse_response(ids, tokenizer) -> Response:
  """One generated assistant turn (prompt excluded; its stop token last, if any) -> parts.

  The turn ends at its first stop token (later ids are ignored). Thinking is the text before
  the first `</think>` (after a leading `<think>`, when the model wrote one itself); with no
  `</think>` the turn closed no thinking block: thinking None. Each closed
  `<tool_call>...</tool_call>` is a tool call (`_parse_call`: argument values come back as
  text); the rest is content (an unclosed call's text included). Other specials and ids past
  the vocab are dropped from the text. Never raises on garbage.
  """
  c = special_ids(tokenizer)
  ids = [int(i) for i in np.asarray(ids, np.int64).ravel()]
  stops, stop = set(stop_ids(tokenizer)), None
  for k, i in enumerate(ids):
    if i in stops:
      ids, stop = ids[:k], tokenizer.decode([i], skip_special=False)
      break
  if ids[:1] == [c.think_open]:
    ids = ids[1:]
  thinking = None
  if c.think_close in ids:
    k = ids.index(c.think_close)
    thinking, ids = tokenizer.decode(ids[:k]), ids[k + 1:]
  content, calls, call = [], [], None  # `call`: ids of the open tool call
  for i in ids:
    if i == c.tool_call_open:
      content += call or []
      call = []
    elif i == c.tool_call_close and call is not None:
      calls.append(_parse_call(call, tokenizer, c))
      call = None
    elif call is not None:
      call.append(i)
    else:
      content.append(i)
  content += call or []
  return Response(thinking, tokenizer.decode(content), calls, stop)
