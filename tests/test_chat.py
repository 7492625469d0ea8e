"""Chat format: golden renderings and loss masks of the three thinking modes, prompts, parsing,
tokenizer specials, bad input."""

import json
import pickle

import numpy as np
import pytest
import tokenizers

from glm5_jax import data
from glm5_jax.config import ConfigError
from glm5_jax.data import chat
from glm5_jax.data import tokenizers as toks

TOK = data.make_tokenizer("byte")

# The byte tokenizer's ids, written out: eos 2, the chat specials 3..18, byte b -> b + 20.
EOS, GMASK, SOP, SYSTEM, USER, ASSISTANT, OBSERVATION = 2, 3, 4, 5, 6, 7, 8
THINK, END_THINK, CALL, END_CALL, RESULT, END_RESULT = 9, 10, 11, 12, 13, 14
KEY, END_KEY, VALUE, END_VALUE = 15, 16, 17, 18


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def b(text):
  return [byte + 20 for byte in text.encode()]


def expand(golden):
  """[(id | text, mask)] -> (ids, mask) arrays."""
  ids, mask = [], []
  for piece, m in golden:
    piece = b(piece) if isinstance(piece, str) else [piece]
    ids += piece
    mask += [m] * len(piece)
  return np.asarray(ids, np.int32), np.asarray(mask, np.float32)


def check_golden(messages, mode, golden, text):
  rendered = chat.render(messages, TOK, thinking_mode=mode)
  ids, mask = expand(golden)
  np.testing.assert_array_equal(rendered.ids, ids)
  np.testing.assert_array_equal(rendered.loss_mask, mask)
  assert rendered.ids.dtype == np.int32 and rendered.loss_mask.dtype == np.float32
  assert TOK.decode(rendered.ids, skip_special=False) == text


def asst(content, thinking=None, calls=()):
  m = dict(role="assistant", content=content, thinking=thinking)
  return {**m, "tool_calls": list(calls)} if calls else m


# An earlier exchange, then a tool-call chain answering the last user message.
TOOL_CHAIN = [
    dict(role="user", content="q"), asst("A", thinking="p"),
    dict(role="user", content="hi"), asst("", thinking="a", calls=["f"]),
    dict(role="observation", content="3"), asst("ok", thinking="b"),
]


def test_specials_and_byte_ids():
  assert chat.CHAT_SPECIALS == toks.CHAT_SPECIAL_NAMES
  c = chat.special_ids(TOK)
  assert (c.gmask, c.sop, c.system, c.user, c.assistant, c.observation) == (3, 4, 5, 6, 7, 8)
  assert (c.think_open, c.think_close, c.tool_call_open, c.tool_call_close) == (9, 10, 11, 12)
  assert (c.tool_response_open, c.tool_response_close, c.eos) == (13, 14, 2)
  assert (c.arg_key_open, c.arg_key_close, c.arg_value_open, c.arg_value_close) == (
      15, 16, 17, 18)
  assert TOK.decode(range(3, 20), skip_special=False) == "".join(chat.CHAT_SPECIALS) + (
      "<|reserved_19|>")
  assert chat.stop_ids(TOK) == (USER, OBSERVATION, EOS, ASSISTANT, SYSTEM)
  with pytest.raises(ValueError, match=r"lacks the special tokens \['<x>'\]"):
    TOK.special_ids(["<x>"])


def test_decode_ids_past_the_vocab():
  """The tiny model's vocab (384) exceeds the byte tokenizer's (276)."""
  ids = b("a") + [300, -1] + b("b") + [USER, 383]
  assert TOK.decode(ids) == "ab"
  assert TOK.decode(ids, skip_special=False) == "a<|unk:300|><|unk:-1|>b<|user|><|unk:383|>"


def test_interleaved_golden():
  """Thinking of the chain answering the last user message stays (and is trained, with each
  turn's stop token); the earlier turn's thinking is dropped and that turn is context only."""
  golden = [(GMASK, 0), (SOP, 0), (USER, 0), ("q", 0),
            (ASSISTANT, 0), (END_THINK, 0), ("A", 0),
            (USER, 0), ("hi", 0),
            (ASSISTANT, 0), (THINK, 0), ("a", 1), (END_THINK, 1), (CALL, 1), ("f", 1),
            (END_CALL, 1),
            (OBSERVATION, 1), (RESULT, 0), ("3", 0), (END_RESULT, 0),
            (ASSISTANT, 0), (THINK, 0), ("b", 1), (END_THINK, 1), ("ok", 1), (EOS, 1)]
  check_golden(TOOL_CHAIN, "interleaved", golden,
               "[gMASK]<sop><|user|>q<|assistant|></think>A<|user|>hi<|assistant|><think>"
               "a</think><tool_call>f</tool_call><|observation|><tool_response>3</tool_response>"
               "<|assistant|><think>b</think>ok<eos>")


def test_preserved_golden():
  """Every turn keeps its thinking, and every turn is trained."""
  golden = [(GMASK, 0), (SOP, 0), (USER, 0), ("q", 0),
            (ASSISTANT, 0), (THINK, 0), ("p", 1), (END_THINK, 1), ("A", 1),
            (USER, 1), ("hi", 0),
            (ASSISTANT, 0), (THINK, 0), ("a", 1), (END_THINK, 1), (CALL, 1), ("f", 1),
            (END_CALL, 1),
            (OBSERVATION, 1), (RESULT, 0), ("3", 0), (END_RESULT, 0),
            (ASSISTANT, 0), (THINK, 0), ("b", 1), (END_THINK, 1), ("ok", 1), (EOS, 1)]
  check_golden(TOOL_CHAIN, "preserved", golden,
               "[gMASK]<sop><|user|>q<|assistant|><think>p</think>A<|user|>hi<|assistant|>"
               "<think>a</think><tool_call>f</tool_call><|observation|><tool_response>3"
               "</tool_response><|assistant|><think>b</think>ok<eos>")


def test_turn_level_golden():
  """Thinking off (None): `</think>` comes with the prompt, so only content, calls and the
  stop token are trained; a dropped earlier thinking turn is context only."""
  messages = [dict(role="system", content="S"), dict(role="user", content="q"),
              asst("A", thinking="p"), dict(role="user", content="r"), asst("B"),
              dict(role="user", content="hi"), asst("", calls=["f"]),
              dict(role="observation", content="3"), dict(role="observation", content="4"),
              asst("ok", thinking="b")]
  golden = [(GMASK, 0), (SOP, 0), (SYSTEM, 0), ("S", 0), (USER, 0), ("q", 0),
            (ASSISTANT, 0), (END_THINK, 0), ("A", 0),
            (USER, 0), ("r", 0),
            (ASSISTANT, 0), (END_THINK, 0), ("B", 1),
            (USER, 1), ("hi", 0),
            (ASSISTANT, 0), (END_THINK, 0), (CALL, 1), ("f", 1), (END_CALL, 1),
            (OBSERVATION, 1), (RESULT, 0), ("3", 0), (END_RESULT, 0),
            (RESULT, 0), ("4", 0), (END_RESULT, 0),
            (ASSISTANT, 0), (THINK, 0), ("b", 1), (END_THINK, 1), ("ok", 1), (EOS, 1)]
  check_golden(messages, "turn_level", golden,
               "[gMASK]<sop><|system|>S<|user|>q<|assistant|></think>A<|user|>r"
               "<|assistant|></think>B<|user|>hi<|assistant|></think><tool_call>f"
               "</tool_call><|observation|><tool_response>3</tool_response><tool_response>4"
               "</tool_response><|assistant|><think>b</think>ok<eos>")


def test_render_prompt_goldens():
  context = [dict(role="user", content="q"), asst("A", thinking="p"),
             dict(role="user", content="hi")]
  head = [GMASK, SOP, USER, *b("q"), ASSISTANT]
  for mode, prior in (("interleaved", [END_THINK]), ("preserved", [THINK, *b("p"), END_THINK])):
    prompt = chat.render_prompt(context, TOK, thinking_mode=mode)
    assert prompt.dtype == np.int32
    assert prompt.tolist() == head + prior + b("A") + [USER, *b("hi"), ASSISTANT, THINK]
    with pytest.raises(ValueError, match=f"thinking: False needs .*turn_level.*{mode}"):
      chat.render_prompt(context, TOK, thinking=False, thinking_mode=mode)
  for thinking, tail in ((True, [THINK]), (False, [END_THINK])):
    prompt = chat.render_prompt(context, TOK, thinking=thinking, thinking_mode="turn_level")
    assert prompt.tolist() == head + [END_THINK, *b("A"), USER, *b("hi"), ASSISTANT] + tail
  assert chat.render_prompt([], TOK).tolist() == [GMASK, SOP, ASSISTANT, THINK]


@pytest.mark.parametrize("mode", chat.THINKING_MODES)
def test_prompt_plus_generated_turn_is_the_rendering(mode):
  """Token in, token out: each turn of the last trajectory, generated after `render_prompt`,
  is exactly the rendering's next tokens, its trained ones, and parses back to the message."""
  messages = TOOL_CHAIN[:3] + [asst("", thinking="a", calls=["f", "g"]),
                               dict(role="observation", content="3"),
                               asst("ok", thinking=None if mode == "turn_level" else "b")]
  full = chat.render(messages, TOK, thinking_mode=mode)
  for k in (3, 5):
    thinking = messages[k]["thinking"] is not None
    prompt = chat.render_prompt(messages[:k], TOK, thinking=thinking, thinking_mode=mode)
    np.testing.assert_array_equal(full.ids[:len(prompt)], prompt)
    assert not full.loss_mask[:len(prompt)][-3:].any()
    untrained = np.flatnonzero(full.loss_mask[len(prompt):] == 0)
    end = len(prompt) + (untrained[0] if len(untrained) else len(full.ids) - len(prompt))
    turn = full.ids[len(prompt):end]
    assert turn[-1] in chat.stop_ids(TOK) and full.loss_mask[len(prompt):end].all()
    parsed = chat.parse_response(turn, TOK)
    want = messages[k]
    assert parsed == chat.Response(want["thinking"], want["content"],
                                   want.get("tool_calls", []), "<|observation|>" if k == 3
                                   else "<eos>")


def test_parse_response_never_raises():
  parse = lambda ids: chat.parse_response(ids, TOK)  # pylint: disable=unnecessary-lambda-assignment
  assert parse([]) == chat.Response(None, "", [], None)
  assert parse(b("4")) == chat.Response(None, "4", [], None)  # never stopped
  assert parse(b("t") + [END_THINK] + b("4") + [USER] + b("x")) == chat.Response(
      "t", "4", [], "<|user|>")  # ids past the stop are ignored
  assert parse([THINK] + b("t") + [END_THINK, 300] + b("4") + [RESULT, EOS]) == chat.Response(
      "t", "4", [], "<eos>")  # a self-written <think>; specials and unknown ids dropped
  assert parse([CALL] + b("x") + [CALL] + b("y") + [END_CALL, END_CALL, CALL] + b("z")) == (
      chat.Response(None, "xz", ["y"], None))  # unclosed calls stay content
  assert parse([END_THINK, END_THINK] + b("a")) == chat.Response("", "a", [], None)
  assert parse(np.array([[300, 383]])) == chat.Response(None, "", [], None)


@pytest.mark.parametrize("messages, mode, match", [
    ([dict(role="bot", content="x")], "interleaved", r"messages\[0\].role: 'bot'"),
    ([dict(role="user", content="x", thinking="t")], "turn_level",
     r"messages\[0\].thinking: not a field of a user message \(only assistant"),
    ([dict(role="user", content="x"), dict(role="assistant", content=None, thinking="t")],
     "interleaved", r"messages\[1\].content: expected a str, got NoneType"),
    ([dict(role="user", content="x"), dict(role="assistant", content="y")], "interleaved",
     r"messages\[1\].thinking: interleaved mode thinks on every assistant turn"),
    ([dict(role="user", content="x"), dict(role="assistant", content="y")], "preserved",
     r"messages\[1\].thinking: preserved mode"),
    ([dict(role="assistant", content="y", thinking=3)], "turn_level",
     r"messages\[0\].thinking: expected a str or None, got int"),
    ([dict(role="assistant", content="y", tool_calls="f")], "turn_level",
     r"messages\[0\].tool_calls: expected a list, got 'f'"),
    ([dict(role="assistant", content="y", tool_calls=[dict(name="f")])], "turn_level",
     r"messages\[0\].tool_calls\[0\]: expected a str or a dict with exactly the keys"),
    ([dict(role="assistant", content="y", tool_calls=[dict(name="f", arguments={1: "x"})])],
     "turn_level", r"messages\[0\].tool_calls\[0\].arguments: expected a dict with str keys"),
    ([dict(role="user", content="x", name="n")], "turn_level", r"messages\[0\].name: not a field"),
    (["hi"], "interleaved", r"messages\[0\]: expected a dict, got str"),
    ("hi", "interleaved", "messages: expected a list"),
    ([], "interleaved", "messages: empty conversation"),
    ([dict(role="user", content="x")], "interleaved_v2", "thinking_mode: 'interleaved_v2'"),
])
def test_bad_input(messages, mode, match):
  with pytest.raises(ValueError, match=match):
    chat.render(messages, TOK, thinking_mode=mode)


def hf_tokenizer(path, specials):
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=280, special_tokens=["<|endoftext|>"] + list(specials),
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["the user said hi to the assistant"] * 10, trainer=trainer)
  tok.save(str(path))
  return data.make_tokenizer(str(path))


def test_hf_tokenizer_specials(tmp_path):
  hf = hf_tokenizer(tmp_path / "tokenizer.json", chat.CHAT_SPECIALS)
  c = chat.special_ids(hf)
  assert [getattr(c, f) for f in ("gmask", "sop", "tool_response_close", "eos")] == [1, 2, 12, 0]
  # Text that spells a special stays text; specials come only from the layout.
  messages = [dict(role="user", content="hi <|assistant|>"),
              asst("the <tool_call>", thinking="</think>")]
  rendered = chat.render(messages, hf, thinking_mode="interleaved")
  want = ([c.gmask, c.sop, c.user] + hf.encode("hi <|assistant|>") +
          [c.assistant, c.think_open] + hf.encode("</think>") + [c.think_close] +
          hf.encode("the <tool_call>") + [c.eos])
  assert rendered.ids.tolist() == want
  assert len(hf.encode("<|assistant|>")) > 1 and len(hf.encode("</think>")) > 1
  unpickled = pickle.loads(pickle.dumps(hf))  # as grain workers get it
  assert unpickled.encode("<|assistant|>") == hf.encode("<|assistant|>")
  assert hf.decode(rendered.ids, skip_special=False) == (
      "[gMASK]<sop><|user|>hi <|assistant|><|assistant|><think></think></think>the <tool_call>"
      "<|endoftext|>")
  generated = rendered.ids[len(chat.render_prompt(messages[:1], hf)):]
  assert chat.parse_response(generated, hf) == chat.Response("</think>", "the <tool_call>", [],
                                                             "<|endoftext|>")
  assert hf.decode([hf.vocab_size + 3] + hf.encode("hi")) == "hi"
  assert hf.decode([hf.vocab_size], skip_special=False) == f"<|unk:{hf.vocab_size}|>"

  partial = hf_tokenizer(tmp_path / "partial.json", chat.CHAT_SPECIALS[:10])
  with pytest.raises(ValueError, match=r"partial.json.*lacks the special tokens "
                     r"\['<tool_response>', '</tool_response>', '<arg_key>', .*'</arg_value>'\]"):
    chat.render(messages, partial)


# ----------------------------------------------------------------------------------------------
# The chat_jsonl source (SFT data path)
# ----------------------------------------------------------------------------------------------


def conversations(n):
  """n short conversations, odd ones with a tool call."""
  out = []
  for i in range(n):
    messages = [dict(role="user", content=f"q{i}")]
    if i % 2:
      messages += [asst("", thinking="t", calls=[f"c{i}"]), dict(role="observation", content="r")]
    out.append(messages + [asst(f"a{i}", thinking=f"k{i}")])
  return out


def chat_config(glob, **options):
  source = data.source_config("chat_jsonl", glob=glob, holdout_fraction=0.0, part_bytes=256)
  source.update(options)
  return data.data_config(seq_len=64, batch_size=4, prefetch=0, sources=dict(sft=source))


def packed_documents(batch):
  for row in range(batch["tokens"].shape[0]):
    seg = batch["segment_ids"][row]
    for s in range(1, seg.max() + 1):
      yield batch["tokens"][row][seg == s], batch["loss_mask"][row][seg == s]


def test_chat_jsonl_pipeline_keeps_the_loss_mask(tmp_path):
  from glm5_jax.train import losses  # pylint: disable=g-import-not-at-top
  convs = conversations(12)
  path = tmp_path / "sft.jsonl"
  path.write_text("".join(json.dumps({"messages": m, "id": i}) + "\n"
                          for i, m in enumerate(convs)) + "\n")
  rendered = {tuple(r.ids): r.loss_mask for r in
              (chat.render(m, TOK, thinking_mode="interleaved") for m in convs)}
  iterator = data.make_train_iterator(chat_config(str(path)))
  seen = set()
  for _ in range(6):
    batch = next(iterator)
    for tokens, mask in packed_documents(batch):
      np.testing.assert_array_equal(mask, rendered[tuple(tokens)])  # whole, unsplit, its mask
      seen.add(tuple(tokens))
    # The trainer's targets are exactly the assistant's tokens (and their stop tokens).
    weights = np.asarray(losses.target_weights(batch["segment_ids"], batch["loss_mask"], 1))
    targets = batch["tokens"][:, 1:][weights > 0]
    trained = np.concatenate([t[m > 0] for t, m in packed_documents(batch)])
    np.testing.assert_array_equal(np.sort(targets), np.sort(trained))
  assert seen == set(rendered)
  iterator.close()


def test_chat_jsonl_overlong_and_errors(tmp_path, caplog):
  long = [dict(role="user", content="x" * 80), asst("y" * 10, thinking="z")]
  short = conversations(1)[0]
  path = tmp_path / "a.jsonl"
  path.write_text(json.dumps({"messages": short}) + "\n" + json.dumps({"messages": long}) + "\n")
  full = chat.render(long, TOK)
  docs = [d for d in next(data.make_train_iterator(chat_config(str(path))))["tokens"]]
  assert any(np.array_equal(d, full.ids[:64]) for d in docs)  # a row holding only the cut
  assert len(full.ids) == 98
  assert "a.jsonl:2: conversation of 98 tokens cut to seq_len 64 (1 cut" in caplog.text

  with pytest.raises(ValueError, match=r"a.jsonl:2: the conversation has 98 tokens > seq_len "
                     r"64; .*sources.sft.overlong='truncate'"):
    next(data.make_train_iterator(chat_config(str(path), overlong="error")))

  bad = {"not json": "b.jsonl:3: not a JSON object with a field 'messages'",
         json.dumps({"msgs": short}): "b.jsonl:3: not a JSON object with a field 'messages'",
         json.dumps({"messages": short[:1] + [asst("a")]}):
             r"b.jsonl:3: messages\[1\].thinking: interleaved mode thinks",
         json.dumps({"messages": short[:1]}): "b.jsonl:3: messages: no assistant message",
         json.dumps({"messages": short + short[:1]}):
             "b.jsonl:3: messages: no assistant turn is trained in interleaved mode"}
  for line, match in bad.items():
    (tmp_path / "b.jsonl").write_text(f"{json.dumps({'messages': short})}\n\n{line}\n")
    with pytest.raises(ValueError, match=match):  # found up front, before any batch
      data.make_train_iterator(chat_config(str(tmp_path / "b.jsonl")))
  # The messages field is an option, and so is the thinking mode.
  (tmp_path / "c.jsonl").write_text(json.dumps({"conv": short[:1] + [asst("a")]}) + "\n")
  cfg = chat_config(str(tmp_path / "c.jsonl"), messages_field="conv", thinking_mode="turn_level")
  tokens = next(data.make_train_iterator(cfg))["tokens"][0]
  assert TOK.decode(tokens, skip_special=False).startswith(
      "[gMASK]<sop><|user|>q0<|assistant|></think>a<eos>[gMASK]")


def test_chat_jsonl_config_errors(tmp_path):
  for field, value, match in (("thinking_mode", "always", "thinking_mode: 'always'; known"),
                              ("overlong", "drop", "overlong: 'drop'; known"),
                              ("messages_field", "", "messages_field: must name")):
    with pytest.raises(ConfigError, match=f"config.data.sources.sft.{match}"):
      data.make_train_iterator(chat_config(str(tmp_path / "*.jsonl"), **{field: value}))


def test_chat_jsonl_held_out_by_part(tmp_path):
  convs = conversations(40)
  path = tmp_path / "sft.jsonl"
  path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
  split = {}
  for name in ("train", "eval"):
    cfg = chat_config(str(path), holdout_fraction=0.3)
    batches = (data.make_eval_batches(cfg, num_batches=4) if name == "eval"
               else take(data.make_train_iterator(cfg), 8))
    split[name] = {tuple(t) for batch in batches for t, _ in packed_documents(batch)}
  assert split["train"] and split["eval"] and not split["train"] & split["eval"]
