"""glm5_jax.infer.requests: every bad argument of `infer.generate` gets a ValueError naming it."""

import numpy as np
import pytest

from glm5_jax.infer.requests import GenerateResult, Request, validate_generate_args

VOCAB, MAX_LEN = 50, 16


def check(prompts, **kwargs):
  kwargs.setdefault("max_new_tokens", 2)
  return validate_generate_args(prompts, vocab_size=VOCAB, max_len=MAX_LEN, **kwargs)


def test_valid_arguments_give_requests():
  requests = check([[1, 2, 3], np.array([4, 49], np.int32), (np.int64(0),)], max_new_tokens=5,
                   temperature=0.7, top_p=0.9, top_k=3, seed=2**32 - 1, stop_tokens=[7])
  assert requests[1] == Request(1, (4, 49), 5, 0.7, 0.9, 3, 2**32 - 1, (7,))
  assert [r.prompt for r in requests] == [(1, 2, 3), (4, 49), (0,)]
  assert all(type(t) is int for r in requests for t in r.prompt)
  assert check([[1] * MAX_LEN], max_new_tokens=1)[0].prompt == (1,) * MAX_LEN
  result = GenerateResult(tokens=[[1]], logprobs=[[0.0]], raw_logprobs=[[-0.5]])
  assert result.logits is None and result.accept_lengths is None


@pytest.mark.parametrize("prompts,kwargs,message", [
    ([[1, 2], []], {}, r"prompts\[1\] is empty"),
    ([[1] * (MAX_LEN + 1)], {}, rf"prompts\[0\] has {MAX_LEN + 1} tokens, longer than max_len"),
    ([[1] * 10], {"max_new_tokens": 8}, r"prompts\[0\]: 10 prompt tokens \+ max_new_tokens 8"),
    ([[1] * 10], {"max_new_tokens": 5, "speculative_steps": 3}, r"= 17 cache positions"),
    ([[1, 2], [3, VOCAB]], {}, rf"prompts\[1\]\[1\] = {VOCAB} is >= the vocab size {VOCAB}"),
    ([[1, -1]], {}, r"prompts\[0\]\[1\] = -1 is negative"),
    ([[1, 2.0]], {}, r"prompts\[0\]\[1\] = 2.0 \(float\) is not an int"),
    ([[True]], {}, r"prompts\[0\]\[0\] = True \(bool\) is not an int"),
    ([np.array([1.0, 2.0])], {}, r"prompts\[0\]\[0\] = .*is not an int"),
    ([np.array([[1, 2]])], {}, r"prompts\[0\] must be a 1-D sequence"),
    (["abc"], {}, r"prompts\[0\] must be a sequence of int token ids"),
    ([], {}, "prompts is empty"),
    ("abc", {}, "prompts must be a list"),
    ([[1]], {"top_p": 0.0}, r"top_p must be in \(0, 1\]; got 0.0"),
    ([[1]], {"top_p": 1.5}, r"top_p must be in \(0, 1\]; got 1.5"),
    ([[1]], {"top_p": float("nan")}, "top_p must be a finite number"),
    ([[1]], {"temperature": -0.1}, "temperature must be >= 0"),
    ([[1]], {"temperature": float("inf")}, "temperature must be a finite number"),
    ([[1]], {"top_k": -1}, "top_k must be >= 0; got -1"),
    ([[1]], {"top_k": 2.5}, "top_k must be an int"),
    ([[1]], {"max_new_tokens": 0}, "max_new_tokens must be >= 1; got 0"),
    ([[1]], {"max_new_tokens": 3.0}, "max_new_tokens must be an int"),
    ([[1]], {"seed": -3}, "seed must be >= 0; got -3"),
    ([[1]], {"seed": 2**32}, r"seed must be in \[0, 2\*\*32\)"),
    ([[1]], {"speculative_steps": -1}, "speculative_steps must be >= 0"),
    ([[1]], {"return_logits": 1}, "return_logits must be a bool"),
    ([[1]], {"stop_tokens": [3, VOCAB + 4]}, rf"stop_tokens\[1\] = {VOCAB + 4} is >= the vocab"),
])
def test_bad_arguments_name_the_problem(prompts, kwargs, message):
  with pytest.raises(ValueError, match=message):
    check(prompts, **kwargs)
