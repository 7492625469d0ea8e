"""`glm5_jax.data.chat` against GLM-5's official chat template, token for token.

The fixture tests/fixtures/glm47_chat_template.jinja is the `chat_template.jinja` of
https://huggingface.co/zai-org/GLM-4.7/blob/main/chat_template.jinja (revision ed30813, as
mirrored in public copies), the template family GLM-5 ships (`[gMASK]<sop>`, no newlines, a lone
`</think>` for a turn without thinking, `clear_thinking` / `enable_thinking`). GLM-5's own file
(https://huggingface.co/zai-org/GLM-5/blob/main/chat_template.jinja) was not reachable verbatim;
PrimeIntellect-ai/renderers' `renderers/glm5.py`, tested against `apply_chat_template` of
zai-org/GLM-5, renders what this template renders. It is rendered here by transformers'
`apply_chat_template` (its jinja2 environment: trim_blocks, lstrip_blocks, `tojson`), the
rendered string is tokenized with specials parsed, and the ids must equal `chat.render` (without
its final eos) and `chat.render_prompt`.

Mapping of the fields: `observation` -> `tool`, `thinking` -> `reasoning_content`, a str tool
call -> {"name": str, "arguments": {}}; preserved mode -> `clear_thinking=False`; a non-thinking
prompt -> `enable_thinking=False`.
"""

import pathlib

import pytest
import tokenizers

from glm5_jax import data
from glm5_jax.data import chat

transformers = pytest.importorskip("transformers")

TEMPLATE = (pathlib.Path(__file__).parent / "fixtures" / "glm47_chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
  """(ours: HFTokenizer, official: transformers tokenizer, raw: tokenizers.Tokenizer) over one
  small byte-level BPE tokenizer.json holding the chat specials."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=320, special_tokens=["<|endoftext|>"] + list(chat.CHAT_SPECIALS),
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["the user asked the assistant what 3+5 is, then called a tool"] * 10,
                          trainer=trainer)
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  tok.save(str(path))
  official = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path),
                                                  eos_token="<|endoftext|>")
  return data.make_tokenizer(str(path)), official, tokenizers.Tokenizer.from_file(str(path))


def to_hf(messages):
  out = []
  for m in messages:
    m = dict(m, role="tool" if m["role"] == "observation" else m["role"])
    thinking = m.pop("thinking", None)
    if thinking is not None:
      m["reasoning_content"] = thinking
    if "tool_calls" in m:
      m["tool_calls"] = [{"name": c, "arguments": {}} if isinstance(c, str) else c
                         for c in m["tool_calls"]]
    out.append(m)
  return out


def official_ids(toks, messages, mode, *, prompt=False, thinking=True):
  _, official, raw = toks
  kwargs = dict(clear_thinking=False) if mode == "preserved" else {}
  if not thinking:
    kwargs["enable_thinking"] = False
  text = official.apply_chat_template(to_hf(messages), chat_template=TEMPLATE, tokenize=False,
                                      add_generation_prompt=prompt, **kwargs)
  return raw.encode(text, add_special_tokens=False).ids


def asst(content, thinking=None, calls=None):
  m = dict(role="assistant", content=content, thinking=thinking)
  return dict(m, tool_calls=calls) if calls is not None else m


CALL = {"name": "search", "arguments": {"query": "3+5", "top_k": 2, "opts": {"deep": True},
                                        "tags": ["a", "é"]}}
CONVERSATIONS = {
    # Two user turns; whitespace around thinking and content; a structured and a str call.
    "tools": [dict(role="system", content="  You help. "), dict(role="user", content=" q \n"),
              asst("\n the answer \n", thinking="  p  "),
              dict(role="user", content="what is 3+5?"),
              asst("  ", thinking="\nuse the tool\n", calls=[CALL, "calc(3+5)"]),
              dict(role="observation", content=" 8 "), dict(role="observation", content="ok"),
              asst(" 8 ", thinking="it is 8")],
    # Empty and whitespace-only thinking, empty content, a call with no arguments.
    "empty": [dict(role="user", content="hi"), asst("", thinking="", calls=["f"]),
              dict(role="observation", content=""), asst("done", thinking=" ")],
}
TURN_LEVEL = [dict(role="user", content="a"), asst("b", thinking="t"),
              dict(role="user", content="c"), asst(" d "),
              dict(role="user", content="e"), asst("", calls=[CALL]),
              dict(role="observation", content="r"), asst("f", thinking="u")]


@pytest.mark.parametrize("mode, name", [("interleaved", "tools"), ("interleaved", "empty"),
                                        ("preserved", "tools"), ("preserved", "empty"),
                                        ("turn_level", "tools"), ("turn_level", "turn")])
def test_render_equals_the_official_template(toks, mode, name):
  ours = toks[0]
  messages = TURN_LEVEL if name == "turn" else CONVERSATIONS[name]
  rendered = chat.render(messages, ours, thinking_mode=mode).ids.tolist()
  official = official_ids(toks, messages, mode)
  assert rendered[-1] == ours.eos_id and ours.eos_id not in official
  assert rendered[:-1] == official
  # Every prompt on the way, thinking or not, is the template's generation prompt.
  for k, m in enumerate(messages):
    if m["role"] == "assistant" or k + 1 < len(messages) and messages[k + 1]["role"] != (
        "assistant"):
      continue
    for thinking in (True, False) if mode == "turn_level" else (True,):
      prompt = chat.render_prompt(messages[:k + 1], ours, thinking=thinking,
                                  thinking_mode=mode).tolist()
      assert prompt == official_ids(toks, messages[:k + 1], mode, prompt=True,
                                    thinking=thinking), (k, thinking)
      assert ours.eos_id not in prompt


def test_tool_call_arguments_are_specials_and_parse_back(toks):
  ours = toks[0]
  c = chat.special_ids(ours)
  messages = CONVERSATIONS["tools"][:4]
  turn = asst("", thinking="x", calls=[CALL, "calc(3+5)"])
  ids = chat.render(messages + [turn], ours).ids
  generated = ids[len(chat.render_prompt(messages, ours)):].tolist()
  assert generated.count(c.arg_key_open) == generated.count(c.arg_value_close) == 4
  # Values come back as text: str ones as they were, the others as the JSON written.
  want = {"name": "search", "arguments": {"query": "3+5", "top_k": "2",
                                          "opts": '{"deep": true}', "tags": '["a", "é"]'}}
  assert chat.parse_response(generated, ours) == chat.Response(
      "x", "", [want, "calc(3+5)"], "<|endoftext|>")
  # Broken argument structure: the call's text, specials dropped.
  broken = [c.tool_call_open, *ours.encode("f"), c.arg_key_open, *ours.encode("k"),
            c.arg_value_open, c.tool_call_close]
  assert chat.parse_response(broken, ours).tool_calls == ["fk"]


def test_text_spelling_specials_stays_text(toks):
  """The deliberate difference (chat module docstring): the template turns text that spells a
  special into that special; `chat` keeps it text."""
  ours = toks[0]
  messages = [dict(role="user", content="say <|assistant|></think>"), asst("ok", thinking="t")]
  rendered = chat.render(messages, ours).ids.tolist()[:-1]
  official = official_ids(toks, messages, "interleaved")
  c = chat.special_ids(ours)
  assert official.count(c.assistant) == 2 and rendered.count(c.assistant) == 1
  assert ours.decode(rendered, skip_special=False) == ours.decode(official, skip_special=False)
