"""Synthetic long-context retrieval tasks: RULER-style needles in a haystack, and MQAR.

RULER (Hsieh et al. 2024, arXiv 2404.06654, section 3.1) hides "magic number" needles in filler
text; MQAR (Arora et al. 2023, Zoology, arXiv 2312.04927, section 3) lists key-value pairs and
then queries many keys. Tasks:

  niah_single      one needle "The magic number for {key} is {value}." in the haystack.
  niah_multikey    that needle plus `num_distractors` needles with other keys.
  niah_multivalue  `num_values` needles sharing one key; the answer lists every value in order of
                   appearance.
  niah_multiquery  `num_queries` needles with different keys; one question asks for all.
  mqar             "k1:v1 k2:v2 ... kn:vn" then queries "k7:v7 k2:v2 ..." (a random subset);
                   each queried value is an answer. No filler; `depth` is ignored.
  copy             a random string, a newline, and the same string again as the answer: the
                   repeated-sequence task on which induction heads form (Olsson et al. 2022,
                   arXiv 2209.11895), with one target per token of the second copy. Meant
                   as a training curriculum (every task above needs the same look-back-and-copy
                   circuit) and as a probe of whether a model has that circuit at all.

Every example is `<bos> context question answers <eos>`, tokenized piece by piece (so answer
spans are exact for any tokenizer), with `loss_mask` = 1 on the answer tokens and 0 elsewhere
(the answers' ", " separators and the eos are not targets). Exact match = every answer span
predicted exactly; `SyntheticExample.prompt_len` is where generation would start.

Lengths and depths (for the RULER-style eval at several context lengths and needle depths):
`length` is the token budget of the whole example, an int or an inclusive (min, max) range drawn
per example. Filler sentences are added while they fit, so an example is at most `length` and
short of it by less than one sentence. When the needles, question and answers alone exceed
`length`, `strict=True` raises and `strict=False` returns the longer example (the caller checks
it against its row length). `depth` in [0, 1] puts the first needle of the first queried key at
that fraction of the haystack (0 = first sentence, 1 = just before the question); other needles
go to uniform random depths; `depth=None` draws it uniformly too.

Reproducibility: example `index` of (`seed`, `stream`, `salt`) uses its own numpy Generator
(`example_rng`), so any example can be rebuilt alone. The pipeline uses stream 0 for training and
stream 1 for held-out evaluation, and salts with the source name so two sources differ.
"""

import dataclasses
import inspect
import string

import numpy as np

NOUNS = (
    "river mountain garden teacher engine village window forest letter market student ship "
    "bridge castle farmer painter library island kitchen train cloud road lamp clock valley "
    "harbor doctor child tower meadow station museum orchard lantern wagon sailor poet "
    "stone field").split()
ADJECTIVES = (
    "quiet green old bright small distant heavy gentle narrow golden silent busy cold warm "
    "ancient empty tall simple strange careful patient hidden wooden crowded famous").split()
VERBS = (
    "watched crossed followed built found painted carried visited passed reached opened "
    "remembered described repaired covered noticed cleaned measured guarded praised").split()
TIMES = ("dawn", "noon", "sunset", "midnight", "winter", "spring", "the storm", "the festival",
         "the harvest")
TEMPLATES = (
    "The {a1} {n1} {v} the {a2} {n2}.",
    "A {n1} near the {n2} {v} a {a1} {n3}.",
    "Every {n1} {v} the {n2} before {t}.",
    "After {t}, the {a1} {n1} {v} the {n2}.",
    "Nobody {v} the {a1} {n1} until {t}.",
)
# RULER's repeated-sentence haystack ("noise").
NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.",
                   "Here we go.", "There and back again.")
KEY_WORDS = (
    "falcon otter walnut cobalt badger maple heron lynx cedar quartz beetle plum jasper "
    "coyote fig mango osprey raven salmon tulip viper willow yak zebra amber bison cricket "
    "dahlia eagle ferret gecko hazel iris jackal koala lemur marmot newt ocelot panda quail "
    "robin sparrow tapir urchin vole walrus ibex alpaca basil cactus daisy egret fennel "
    "garnet hornet ivy juniper kestrel lilac magpie nutmeg onyx pecan quince radish saffron "
    "thistle umber violet wren yarrow zinnia acorn birch clover dingo emu finch gopher "
    "hyena iguana jay kiwi llama mole narwhal opal pelican rhino squid topaz turtle").split()
MQAR_KEY_LETTERS = string.ascii_lowercase


@dataclasses.dataclass(frozen=True)
class SyntheticExample:
  """One example. `tokens` int32 [n] and `loss_mask` float32 [n] (1 on answer tokens);
  `answer_spans[i] = (start, end)` token offsets of `answers[i]`."""

  task: str
  tokens: np.ndarray
  loss_mask: np.ndarray
  answer_spans: tuple[tuple[int, int], ...]
  answers: tuple[str, ...]

  @property
  def prompt_len(self) -> int:
    """Tokens before the first answer: the prompt a generative eval would feed."""
    return self.answer_spans[0][0]


def example_rng(seed: int, index: int, *, stream: int = 0, salt: int = 0) -> np.random.Generator:
  """The Generator of example `index`; independent of every other example."""
  return np.random.default_rng([int(seed), int(stream), int(salt), int(index)])


class _Builder:
  """Accumulates token pieces; answers are recorded as spans."""

  def __init__(self, tokenizer):
    self._tok = tokenizer
    self._pieces = [np.asarray([tokenizer.bos_id], np.int32)]
    self.num_tokens = 1
    self._spans, self._answers = [], []

  def ids(self, ids):
    self._pieces.append(np.asarray(ids, np.int32))
    self.num_tokens += len(ids)

  def text(self, text):
    self.ids(self._tok.encode_array(text))

  def answer(self, text):
    start = self.num_tokens
    self.text(text)
    self._spans.append((start, self.num_tokens))
    self._answers.append(text)

  def finish(self, task) -> SyntheticExample:
    self.ids([self._tok.eos_id])
    tokens = np.concatenate(self._pieces)
    mask = np.zeros(len(tokens), np.float32)
    for start, end in self._spans:
      mask[start:end] = 1.0
    return SyntheticExample(task, tokens, mask, tuple(self._spans), tuple(self._answers))


def _filler_sentence(rng, haystack, i):
  if haystack == "noise":
    return NOISE_SENTENCES[i % len(NOISE_SENTENCES)]
  pick = lambda words: words[rng.integers(len(words))]
  template = TEMPLATES[rng.integers(len(TEMPLATES))]
  return template.format(a1=pick(ADJECTIVES), a2=pick(ADJECTIVES), n1=pick(NOUNS),
                         n2=pick(NOUNS), n3=pick(NOUNS), v=pick(VERBS), t=pick(TIMES))


def _haystack(rng, tokenizer, budget, needles, depths, haystack):
  """Filler sentences with `needles[j]` inserted at sentence boundary nearest `depths[j]`.

  Returns (token pieces, order) where `order` lists needle indices in text order. The filler
  fills `budget` minus the needles' tokens as far as whole sentences fit.
  """
  if haystack not in ("words", "noise"):
    raise ValueError(f"haystack {haystack!r}: expected 'words' or 'noise'")
  needle_ids = [tokenizer.encode_array(s + " ") for s in needles]
  filler_budget = budget - sum(len(x) for x in needle_ids)
  sentences, used = [], 0
  while True:
    ids = tokenizer.encode_array(_filler_sentence(rng, haystack, len(sentences)) + " ")
    if used + len(ids) > filler_budget:
      break
    sentences.append(ids)
    used += len(ids)
  boundaries = np.cumsum([0] + [len(s) for s in sentences])
  slots = [int(np.argmin(np.abs(boundaries - d * used))) for d in depths]
  pieces, order = [], []
  for b in range(len(sentences) + 1):
    for j in range(len(needles)):
      if slots[j] == b:
        pieces.append(needle_ids[j])
        order.append(j)
    if b < len(sentences):
      pieces.append(sentences[b])
  return pieces, order


def _distinct_numbers(rng, count, digits):
  low, high = 10 ** (digits - 1), 10 ** digits
  if count > high - low:
    raise ValueError(f"cannot draw {count} distinct {digits}-digit values")
  return [str(v) for v in low + rng.choice(high - low, size=count, replace=False)]


def _niah(tokenizer, rng, *, task, length, depth, haystack, value_digits, num_keys,
          values_per_key, num_queries):
  """Shared body of the four needle tasks: `num_keys` keys, the first `num_queries` queried."""
  if num_keys > len(KEY_WORDS):
    raise ValueError(f"{task}: at most {len(KEY_WORDS)} distinct keys, asked for {num_keys}")
  keys = [KEY_WORDS[i] for i in rng.choice(len(KEY_WORDS), size=num_keys, replace=False)]
  values = _distinct_numbers(rng, num_keys * values_per_key, value_digits)
  needle_kv = [(keys[k], values[k * values_per_key + v])
               for k in range(num_keys) for v in range(values_per_key)]
  needles = [f"The magic number for {key} is {value}." for key, value in needle_kv]
  depths = [rng.uniform() if depth is None else float(depth)]
  depths += list(rng.uniform(size=len(needles) - 1))
  queried = keys[:num_queries]
  if values_per_key > 1:
    question = f"\nQ: What are all the magic numbers for {queried[0]}?\nA: "
  elif num_queries > 1:
    question = f"\nQ: What are the magic numbers for {', '.join(queried)}?\nA: "
  else:
    question = f"\nQ: What is the magic number for {queried[0]}?\nA: "
  fixed = 2 + len(tokenizer.encode_array(question))  # bos, eos, question
  fixed += sum(len(tokenizer.encode_array(v)) + 2 for v in values[:max(num_queries,
                                                                       values_per_key)])
  pieces, order = _haystack(rng, tokenizer, length - fixed, needles, depths, haystack)
  if values_per_key > 1:  # every value of key 0, in order of appearance
    answers = [needle_kv[j][1] for j in order if needle_kv[j][0] == queried[0]]
  else:
    answers = [dict(needle_kv)[k] for k in queried]
  b = _Builder(tokenizer)
  for piece in pieces:
    b.ids(piece)
  b.text(question)
  for i, answer in enumerate(answers):
    if i:
      b.text(", ")
    b.answer(answer)
  return b.finish(task)


def niah_single(tokenizer, rng, *, length, depth=None, haystack="words", value_digits=5):
  return _niah(tokenizer, rng, task="niah_single", length=length, depth=depth,
               haystack=haystack, value_digits=value_digits, num_keys=1, values_per_key=1,
               num_queries=1)


def niah_multikey(tokenizer, rng, *, length, depth=None, haystack="words", value_digits=5,
                  num_distractors=3):
  return _niah(tokenizer, rng, task="niah_multikey", length=length, depth=depth,
               haystack=haystack, value_digits=value_digits, num_keys=1 + num_distractors,
               values_per_key=1, num_queries=1)


def niah_multivalue(tokenizer, rng, *, length, depth=None, haystack="words", value_digits=5,
                    num_values=3):
  return _niah(tokenizer, rng, task="niah_multivalue", length=length, depth=depth,
               haystack=haystack, value_digits=value_digits, num_keys=1,
               values_per_key=num_values, num_queries=1)


def niah_multiquery(tokenizer, rng, *, length, depth=None, haystack="words", value_digits=5,
                    num_queries=2):
  return _niah(tokenizer, rng, task="niah_multiquery", length=length, depth=depth,
               haystack=haystack, value_digits=value_digits, num_keys=num_queries,
               values_per_key=1, num_queries=num_queries)


def mqar(tokenizer, rng, *, length, depth=None, num_pairs=None, num_queries=4, key_chars=3,
         value_digits=2, separator=":"):
  """Multi-query associative recall. `num_pairs=None` fits as many pairs as `length` allows
  (at least `num_queries`). `depth` is accepted for a uniform signature and ignored.

  `separator` goes between each key and its value, in the context and in the queries. With
  `separator=""` and one-character keys the task is Zoology's original form (the answer follows
  the queried key token directly, so one induction head solves it); with ":" the prediction is
  made at the separator, one token after the key, which a model must first look back to (a
  second composition step that small models learn much later)."""
  del depth
  max_keys = len(MQAR_KEY_LETTERS) ** key_chars // 2
  letters = np.array(list(MQAR_KEY_LETTERS))

  def new_pair(seen):
    while True:
      key = "".join(letters[rng.integers(len(letters), size=key_chars)])
      if key not in seen:
        seen.add(key)
        value = str(rng.integers(10 ** value_digits)).zfill(value_digits)
        return key, value

  def cost(pair):  # tokens of "k:v " in the context plus at most the same again as a query
    return len(tokenizer.encode_array(f"{pair[0]}{separator}{pair[1]} "))

  seen, pairs = set(), []
  budget = length - 3  # bos, "\n", eos
  wanted = num_pairs if num_pairs is not None else max_keys
  if wanted < num_queries:
    raise ValueError(f"mqar: num_pairs={num_pairs} < num_queries={num_queries}")
  if wanted > max_keys and num_pairs is not None:
    raise ValueError(f"mqar: num_pairs={num_pairs} needs key_chars > {key_chars}")
  used, max_cost = 0, 0
  while len(pairs) < wanted:
    pair = new_pair(seen)
    c = cost(pair)
    if (num_pairs is None and len(pairs) >= num_queries
        and used + c + num_queries * max(c, max_cost) > budget):
      break
    pairs.append(pair)
    used, max_cost = used + c, max(c, max_cost)
  queries = rng.choice(len(pairs), size=num_queries, replace=False)
  b = _Builder(tokenizer)
  b.text(" ".join(f"{k}{separator}{v}" for k, v in pairs) + "\n")
  for i, q in enumerate(queries):
    key, value = pairs[q]
    b.text(f"{' ' if i else ''}{key}{separator}")
    b.answer(value)
  return b.finish("mqar")


def _distinct_names(rng, count, chars):
  """`count` distinct random upper-case names of `chars` letters."""
  if count > 26 ** chars // 2:
    raise ValueError(f"cannot draw {count} distinct {chars}-letter variable names")
  letters, names = np.array(list(string.ascii_uppercase)), []
  while len(names) < count:
    name = "".join(letters[rng.integers(26, size=chars)])
    if name not in names:
      names.append(name)
  return names


def variable_tracking(tokenizer, rng, *, length, depth=None, haystack="words", value_digits=5,
                      num_chains=1, num_hops=4, var_chars=5):
  """RULER's multi-hop variable tracking (Hsieh et al. 2024, section 3.1, "Multi-hop Tracing").

  Each of `num_chains` chains is `num_hops + 1` statements "VAR X1 = 12345." "VAR X2 = X1." ...
  "VAR X{h+1} = X{h}." hidden in the haystack in chain order; chains start from distinct values.
  The question asks which variables are assigned chain 0's value; the answers are chain 0's
  variable names in chain (= text) order. `depth` places chain 0's first statement; its later
  statements go to sorted uniform depths after it, and the other chains' to sorted uniform
  depths anywhere.
  """
  if num_chains < 1 or num_hops < 0:
    raise ValueError(f"variable_tracking: need num_chains >= 1 and num_hops >= 0, got "
                     f"{num_chains} and {num_hops}")
  values = _distinct_numbers(rng, num_chains, value_digits)
  names = _distinct_names(rng, num_chains * (num_hops + 1), var_chars)
  chains = [names[c * (num_hops + 1):(c + 1) * (num_hops + 1)] for c in range(num_chains)]
  needles, depths = [], []
  for c, chain in enumerate(chains):
    needles += [f"VAR {chain[0]} = {values[c]}."]
    needles += [f"VAR {chain[h]} = {chain[h - 1]}." for h in range(1, len(chain))]
    if c == 0:
      first = rng.uniform() if depth is None else float(depth)
      depths += [first] + sorted(rng.uniform(first, 1.0, size=num_hops))
    else:
      depths += sorted(rng.uniform(size=num_hops + 1))
  question = f"\nQ: Which variables are assigned the value {values[0]}?\nA: "
  fixed = 2 + len(tokenizer.encode_array(question))  # bos, eos, question
  fixed += sum(len(tokenizer.encode_array(name)) + 2 for name in chains[0])  # answers, ", "
  pieces, _ = _haystack(rng, tokenizer, length - fixed, needles, depths, haystack)
  b = _Builder(tokenizer)
  for piece in pieces:
    b.ids(piece)
  b.text(question)
  for i, name in enumerate(chains[0]):
    if i:
      b.text(", ")
    b.answer(name)
  return b.finish("variable_tracking")


def copy(tokenizer, rng, *, length, depth=None, alphabet="alphanumeric"):
  """A random string drawn uniformly from `alphabet` ("alphanumeric": a-z and 0-9, or
  "letters"), then "\n", then the same string again as the one answer span. The string fills
  `length` (bos, eos and the newline included) as two equal halves of at least 2 characters.
  `depth` is accepted for a uniform signature and ignored."""
  del depth
  symbols = {"alphanumeric": MQAR_KEY_LETTERS + string.digits, "letters": MQAR_KEY_LETTERS}
  if alphabet not in symbols:
    raise ValueError(f"copy: alphabet must be one of {sorted(symbols)}, got {alphabet!r}")
  letters = np.array(list(symbols[alphabet]))
  chars = max(2, (length - 3) // 2)
  text = "".join(letters[rng.integers(len(letters), size=chars)])
  b = _Builder(tokenizer)
  b.text(text + "\n")
  b.answer(text)
  return b.finish("copy")


TASKS = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "mqar": mqar,
    "variable_tracking": variable_tracking,
    "copy": copy,
}


def task_options(task: str) -> dict:
  """The task's own options and their defaults (everything but `length` and `depth`)."""
  if task not in TASKS:
    raise ValueError(f"unknown synthetic task {task!r}; known: {sorted(TASKS)}")
  params = inspect.signature(TASKS[task]).parameters.values()
  return {p.name: p.default for p in params
          if p.kind == p.KEYWORD_ONLY and p.name not in ("length", "depth")}


def generate(task: str, tokenizer, index: int, *, length, seed: int = 0, stream: int = 0,
             salt: int = 0, depth: float | None = None, strict: bool = True,
             **options) -> SyntheticExample:
  """Example `index` of `task`: see the module docstring for `length`, `depth` and seeding.

  `length` is an int or an inclusive (min, max) range; `options` are the task's own
  (`task_options(task)` lists them).
  """
  allowed = task_options(task)
  unknown = sorted(set(options) - set(allowed))
  if unknown:
    raise ValueError(f"synthetic task {task!r}: unknown options {unknown}; known: "
                     f"{sorted(allowed)}")
  if depth is not None and not 0.0 <= depth <= 1.0:
    raise ValueError(f"synthetic task {task!r}: depth must be in [0, 1], got {depth}")
  rng = example_rng(seed, index, stream=stream, salt=salt)
  if not isinstance(length, (int, np.integer)):
    low, high = length
    length = int(rng.integers(low, high + 1))
  example = TASKS[task](tokenizer, rng, length=int(length), depth=depth, **options)
  if strict and len(example.tokens) > length:
    raise ValueError(f"synthetic task {task!r} with options {options} needs "
                     f"{len(example.tokens)} tokens, more than length={length}")
  return example
