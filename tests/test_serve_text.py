"""glm5_jax.serve.text / choices: what a client sees of generated ids, fed one id at a time as
a stream is: incremental UTF-8, stop strings that span tokens, GLM's reasoning / content /
tool-call split (no model: the byte tokenizer and hand-written ids)."""

import json
import re

import pytest

from glm5_jax.data import chat, make_tokenizer
from glm5_jax.infer.engine import Event
from glm5_jax.serve.choices import Choice, completion_logprobs, echo_prompt
from glm5_jax.serve.text import ChoiceText, Detokenizer, StopText

TOK = make_tokenizer("byte")
C = chat.special_ids(TOK)


def _feed(text: ChoiceText, ids) -> list:
  """Deltas, one per id (empty dicts where the id showed nothing yet), then the final one."""
  deltas = []
  for i in ids:
    deltas.append({})
    text.add(i, deltas[-1])
  deltas.append({})
  text.finish(deltas[-1])
  return deltas


def _joined(deltas, field):
  return "".join(d.get(field, "") for d in deltas)


def test_a_multibyte_character_is_sent_once_complete():
  detok = Detokenizer(TOK)
  ids = TOK.encode("hé!")
  assert [detok.add(i) for i in ids] == ["h", "", "é", "!"]
  detok.add(TOK.encode("é")[0])
  assert detok.flush() == "\ufffd"  # an unfinished character at the end is shown as such


def test_ids_decoded_in_runs_give_the_text_of_ids_decoded_one_by_one():
  ids = TOK.encode("naïve café ✓ done")
  one = Detokenizer(TOK)
  by_one = "".join(one.add(i) for i in ids) + one.flush()
  runs = Detokenizer(TOK)  # runs that end inside a character (ï, ✓)
  in_runs = "".join(runs.add_many(ids[a:b]) for a, b in ((0, 3), (3, 4), (4, 13), (13, 40)))
  assert by_one == in_runs + runs.flush() == "naïve café ✓ done"
  with pytest.raises(ValueError, match="per token"):  # a stop string needs each id's text
    ChoiceText(TOK, ("x",)).add_run(ids, {})


def test_a_stop_string_split_over_tokens_is_never_sent():
  text = ChoiceText(TOK, ("END", "xyz"))
  deltas = _feed(text, TOK.encode("abc EN") + TOK.encode("D tail"))
  assert _joined(deltas, "text") == "abc " and text.stopped == "END"
  # "E" and "N" were held back while "END" could still complete; nothing after the cut.
  assert [d.get("text", "") for d in deltas[:6]] == ["a", "b", "c", " ", "", ""]
  assert text.kept == len("abc END")  # the completing token is the last one kept
  held = ChoiceText(TOK, ("END",))
  assert _joined(_feed(held, TOK.encode("a EN")), "text") == "a EN"  # flushed at the end


def test_the_earliest_stop_string_wins_and_plain_text_passes():
  stop = StopText(("cd", "bce"))  # "b" is held (it may start "bce"), then sent before "cd"
  assert stop.push("ab") == "a" and stop.push("cdef") == "b" and stop.matched == "cd"
  earliest = StopText(("cd", "bcd"))
  assert earliest.push("abcd") == "a" and earliest.matched == "bcd"
  assert StopText(()).push("anything") == "anything"


def test_chat_turn_streams_reasoning_content_and_tool_calls():
  ids = (TOK.encode("plan") + [C.think_close] + TOK.encode("ok ")
         + [C.tool_call_open] + TOK.encode("calc") + [C.arg_key_open] + TOK.encode("expr")
         + [C.arg_key_close, C.arg_value_open] + TOK.encode("2*3")
         + [C.arg_value_close, C.tool_call_close, C.observation])
  text = ChoiceText(TOK, (), chat_turn=True, thinking=True)
  deltas = _feed(text, ids)
  assert _joined(deltas, "reasoning_content") == "plan" and _joined(deltas, "content") == "ok "
  calls = [c for d in deltas for c in d.get("tool_calls", [])]
  assert re.fullmatch("call_[A-Za-z0-9]{24}", calls[0]["id"]), calls
  assert calls == [{"index": 0, "id": calls[0]["id"], "type": "function",
                    "function": {"name": "calc", "arguments": json.dumps({"expr": "2*3"})}}]
  # Ids are unique within a conversation: another call (here, another reply's) never repeats one.
  again = [c for d in _feed(ChoiceText(TOK, (), chat_turn=True, thinking=True), ids + ids)
           for c in d.get("tool_calls", [])]
  assert len({c["id"] for c in again + calls}) == 3
  # Same parts as the non-streaming parser's.
  parsed = chat.parse_response(ids, TOK)
  assert (parsed.thinking, parsed.content) == ("plan", "ok ")
  # Thinking off: everything is content; an unclosed call is content too.
  text = ChoiceText(TOK, (), chat_turn=True, thinking=False)
  deltas = _feed(text, TOK.encode("a") + [C.tool_call_open] + TOK.encode("f"))
  assert _joined(deltas, "content") == "af" and "reasoning_content" not in str(deltas)


def test_choice_keeps_tokens_to_the_stop_and_drops_a_stop_token_from_the_text():
  class Done:
    finish_reason = "stop"
  ids = TOK.encode("hi!") + [C.eos]
  choice = Choice(0, ChoiceText(TOK, ()), (C.eos,), top=1)
  delta = {}
  top = [([i], [-0.5]) for i in ids]
  kept = choice.feed(Event(0, ids, [0.0] * 4, [-1.0] * 4, top, Done()), delta)
  assert delta == {"text": "hi!"} and choice.tokens == ids and choice.finish_reason == "stop"
  lp = completion_logprobs(TOK, kept, choice, len(delta["text"]), final=True)
  assert lp["token_logprobs"] == [-1.0] * 4 and lp["top_logprobs"][0] == {"h": -0.5}
  assert lp["text_offset"] == [0, 1, 2, 3] and lp["tokens"] == ["h", "i", "!", ""]
  stopped = Choice(0, ChoiceText(TOK, ("i",)), (C.eos,))
  delta = {}
  stopped.feed(Event(0, ids, [0.0] * 4, [-1.0] * 4), delta)
  assert delta == {"text": "h"} and stopped.tokens == ids[:2] and stopped.finish_reason == "stop"


@pytest.mark.parametrize("stops, batch", [((), 99), ((), 1), (("é!",), 2), (("b",), 3)])
def test_text_offset_indexes_the_returned_text_streamed_or_not(stops, batch):
  """Every reported token's text is at its offset in the returned text (split UTF-8
  characters, a stop token, stop strings that cut the text), whether the text and log-probs
  come in one reply or in chunks of `batch` tokens."""
  class Done:
    finish_reason = "stop"
  ids = TOK.encode("ab€cé!dé") + [C.eos]  # multi-byte characters split over byte tokens
  choice = Choice(0, ChoiceText(TOK, stops), (C.eos,))
  text = ""
  lp = {"tokens": [], "text_offset": [], "token_ids": []}
  for start in range(0, len(ids), batch):
    part, delta = ids[start:start + batch], {}
    last = start + batch >= len(ids)
    kept = choice.feed(Event(0, part, [0.0] * len(part), [-1.0] * len(part), None,
                             Done() if last else None), delta)
    text += delta.get("text", "")
    choice.text_chars = len(text)
    out = completion_logprobs(TOK, kept, choice, len(text), choice.finish_reason is not None)
    for key in lp:
      lp[key] += out[key]
    if choice.finish_reason is not None:
      break
  assert text == ("ab€cé!dé" if not stops else "ab€c" if stops == ("é!",) else "a")
  assert lp["token_ids"] == choice.tokens
  for token, offset in zip(lp["tokens"], lp["text_offset"]):
    assert text[offset:offset + len(token)] == token, (token, offset, text)
  assert "".join(lp["tokens"]) == text  # and together they are the text


def test_echo_prompt_is_the_text_the_prompt_ids_make():
  """A prompt given as ids comes back as their text, characters split over byte tokens joined."""
  assert echo_prompt(TOK, TOK.encode("pré €!")) == "pré €!"
