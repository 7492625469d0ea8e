"""Random valid OpenAI requests for checking that a warm server compiles nothing more
(tools/check_serve_warm.py, tests/test_serve.py): what a request can vary that reaches a
different program (n, max_tokens, temperature, top_p, top_k, stop strings, streaming, logprobs,
prompt lengths as text or token ids, tools, thinking on or off, penalties and logit_bias, echo)."""

import random

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate",
                                           "parameters": {"type": "object"}}}]
WORDS = "the a model engine token cache page slot prefill decode warm compile".split()


def random_bodies(rng: random.Random, count: int, *, max_len: int, max_top: int):
  """`count` `(path, body)` pairs of random valid requests for a server of `max_len` positions
  keeping `max_top` alternatives (module docstring: what varies). Prompts stay under half of
  max_len; with tools (~400 tokens of template: the byte tokenizer's), a few words, so every
  request fits."""
  out = []
  for _ in range(count):
    body = {"n": rng.choice([1, 1, 1, 2, 3]), "max_tokens": rng.randint(1, 24),
            "temperature": rng.choice([0.0, 0.7, 1.0, 1.3]), "top_p": rng.choice([1.0, 0.9]),
            "top_k": rng.choice([0, 0, 5, 40]), "seed": rng.randrange(1 << 31),
            "stream": rng.random() < 0.4}
    if rng.random() < 0.3:
      body["stop"] = rng.sample(["e", "th", "\n", "ok"], rng.randint(1, 2))
    if rng.random() < 0.3:  # OpenAI's adjustments (a tokenizer of at least 256 ids)
      body["frequency_penalty"] = rng.choice([0.0, 0.5, -1.0, 2.0])
      body["presence_penalty"] = rng.choice([0.0, 1.0, -2.0])
      body["logit_bias"] = {str(rng.randrange(256)): rng.uniform(-100, 100)
                            for _ in range(rng.randint(0, 5))}
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_len // 16)))
    tools = max_len >= 512 and rng.random() < 0.3  # the tools block is ~400 tokens
    if rng.random() < 0.5:
      path = "/v1/completions"
      body["prompt"] = words if rng.random() < 0.5 else [
          rng.randrange(1, 256) for _ in range(rng.randint(1, max_len // 2))]
      if rng.random() < 0.4:
        body["logprobs"] = rng.randint(0, max_top)
      body["ignore_eos"] = rng.random() < 0.5
      body["echo"] = "logprobs" not in body and rng.random() < 0.3
    else:
      path = "/v1/chat/completions"
      body["messages"] = [{"role": "user", "content": words[:max_len // 16] if tools else words}]
      if tools:
        body["tools"] = TOOLS
      if rng.random() < 0.4:
        body["logprobs"], body["top_logprobs"] = True, rng.randint(0, max_top)
      body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    out.append((path, body))
  return out
