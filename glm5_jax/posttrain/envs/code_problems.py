"""The built-in function-synthesis problems: generated families with parameters.

A problem is (family, params): `draw(rng)` picks both; `key` is the canonical problem key (the
family and its params, so "poly a=2 b=0 c=1" is one problem however it is drawn); `prompt`
the task text with one worked example; `solution` reference source code (the worked answer,
also what computes the hidden tests' expected values in the caller, never in the sandbox);
`cases(rng, n)` n hidden test inputs (argument tuples).

Families (name, function, what it must do; params):
  digit_sum   f(n)       the sum of n's digits in base b                         b in 2..10
  poly        f(x)       a*x*x + b*x + c                                     a, b, c in -5..5
  clamp       f(x)       x limited to [lo, hi]                      -20 <= lo < hi <= 20
  running     f(xs)      running max / min / sum of a list                 op (3 choices)
  caesar      f(s)       lowercase letters shifted by k (others unchanged)        k in 1..25
  words       f(s)       the words (split on sep) reversed, joined by sep   sep in " ,-;|"
  fizz        f(n)       "Fizz" if a | n, "Buzz" if b | n, both: "FizzBuzz", else str(n)
                                                                       2 <= a < b <= 9
  count       f(s)       how many times the letter c occurs in s                  c in a..z
"""

import string

import numpy as np

LETTERS = string.ascii_lowercase
FAMILIES = ("digit_sum", "poly", "clamp", "running", "caesar", "words", "fizz", "count")


def _int(rng, lo, hi) -> int:
  return int(rng.integers(lo, hi, endpoint=True))


def draw(rng: np.random.Generator, families=FAMILIES) -> tuple[str, dict]:
  family = families[_int(rng, 0, len(families) - 1)]
  if family == "digit_sum":
    params = {"b": _int(rng, 2, 10)}
  elif family == "poly":
    params = {"a": _int(rng, -5, 5), "b": _int(rng, -5, 5), "c": _int(rng, -5, 5)}
  elif family == "clamp":
    lo = _int(rng, -20, 19)
    params = {"lo": lo, "hi": _int(rng, lo + 1, 20)}
  elif family == "running":
    params = {"op": ("max", "min", "sum")[_int(rng, 0, 2)]}
  elif family == "caesar":
    params = {"k": _int(rng, 1, 25)}
  elif family == "words":
    params = {"sep": " ,-;|"[_int(rng, 0, 4)]}
  elif family == "fizz":
    a = _int(rng, 2, 8)
    params = {"a": a, "b": _int(rng, a + 1, 9)}
  else:
    params = {"c": LETTERS[_int(rng, 0, 25)]}
  return family, params


def key(family: str, params: dict) -> str:
  return family + " " + " ".join(f"{k}={params[k]!r}" for k in sorted(params))


def describe(family: str, p: dict) -> tuple[str, str]:
  """(signature, what it returns)."""
  return {
      "digit_sum": lambda: ("f(n)", "returns the sum of the digits of the integer n >= 0 "
                            f"written in base {p['b']}"),
      "poly": lambda: ("f(x)", f"returns {p['a']}*x*x + {p['b']}*x + {p['c']} for an integer x"),
      "clamp": lambda: ("f(x)", f"returns x limited to the range [{p['lo']}, {p['hi']}]"),
      "running": lambda: ("f(xs)",
                          f"returns the list of running {p['op']}s of the list of integers xs"),
      "caesar": lambda: ("f(s)", f"returns s with each lowercase letter shifted {p['k']} places "
                         "forward in the alphabet (z wraps to a), other characters unchanged"),
      "words": lambda: ("f(s)", f"returns the words of s (split on {p['sep']!r}) in reverse "
                        f"order, joined by {p['sep']!r}"),
      "fizz": lambda: ("f(n)", f"returns 'FizzBuzz' if n is divisible by {p['a']} and "
                       f"{p['b']}, 'Fizz' if by {p['a']}, 'Buzz' if by {p['b']}, else str(n)"),
      "count": lambda: ("f(s)", f"returns how many times the letter {p['c']!r} occurs in s"),
  }[family]()


def solution(family: str, p: dict) -> str:
  """Reference source defining f (short, the worked answer SFT teaches)."""
  return {
      "digit_sum": lambda: ("def f(n):\n    t = 0\n    while n:\n"
                    f"        t += n % {p['b']}\n        n //= {p['b']}\n    return t\n"),
      "poly": lambda: f"def f(x):\n    return {p['a']}*x*x + {p['b']}*x + {p['c']}\n",
      "clamp": lambda: f"def f(x):\n    return min(max(x, {p['lo']}), {p['hi']})\n",
      "running": lambda: ("def f(xs):\n    out = []\n    for x in xs:\n"
                  + {"max": "        out.append(x if not out else max(out[-1], x))\n",
                     "min": "        out.append(x if not out else min(out[-1], x))\n",
                     "sum": "        out.append(x + (out[-1] if out else 0))\n"}[p["op"]]
                  + "    return out\n"),
      "caesar": lambda: ("def f(s):\n    return ''.join(chr((ord(ch) - 97 + "
                 f"{p['k']}) % 26 + 97) if 'a' <= ch <= 'z' else ch for ch in s)\n"),
      "words": lambda: f"def f(s):\n    return {p['sep']!r}.join(s.split({p['sep']!r})[::-1])\n",
      "fizz": lambda: ("def f(n):\n    s = ''\n"
               f"    if n % {p['a']} == 0:\n        s += 'Fizz'\n"
               f"    if n % {p['b']} == 0:\n        s += 'Buzz'\n    return s or str(n)\n"),
      "count": lambda: f"def f(s):\n    return s.count({p['c']!r})\n",
  }[family]()


def _text(rng, n_lo, n_hi, alphabet=LETTERS) -> str:
  return "".join(alphabet[i] for i in rng.integers(len(alphabet), size=_int(rng, n_lo, n_hi)))


def cases(family: str, p: dict, rng: np.random.Generator, n: int) -> list[tuple]:
  """n argument tuples (the hidden tests' inputs; the first is the prompt's example)."""
  out = []
  for _ in range(n):
    if family == "digit_sum":
      out.append((_int(rng, 0, 10**6),))
    elif family in ("poly", "clamp"):
      out.append((_int(rng, -30, 30),))
    elif family == "running":
      out.append(([_int(rng, -9, 9) for _ in range(_int(rng, 0, 6))],))
    elif family == "caesar":
      out.append((_text(rng, 1, 10, LETTERS + " .!"),))
    elif family == "words":
      out.append((p["sep"].join(_text(rng, 1, 5) for _ in range(_int(rng, 1, 4))),))
    elif family == "fizz":
      out.append((_int(rng, 1, 100),))
    else:
      out.append((_text(rng, 0, 12, p["c"] * 4 + LETTERS[:6]),))
  return out


def reference(family: str, p: dict):
  """The reference f, compiled from `solution` (trusted code: ours)."""
  scope = {}
  exec(compile(solution(family, p), f"<{family}>", "exec"), scope)  # pylint: disable=exec-used
  return scope["f"]
