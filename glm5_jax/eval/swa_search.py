"""Beam search over which layers of a full-attention model become sliding-window attention.

docs/reference.md section 3 (long-context ablation, report Tables 4-5): "Searched SWA = beam
search (width 8, 2 layers a step) over which layers become SWA, scored on a retrieval
benchmark." Starting from the trained model's pattern, each step takes every pattern on the beam
and converts `layers_per_step` more of its convertible layers to `letter` in every possible way,
scores each new candidate training-free, and keeps the best `beam_width`. After
ceil(num_convert / layers_per_step) steps (the last one converting the remainder) every pattern
on the beam has exactly `num_convert` converted layers; the best is the result.

The search is a pure function of a scoring callable (pattern string -> higher-is-better float),
so it is testable without a model; `tools/search_swa_pattern.py` scores with the retrieval suite
on a converted checkpoint. Each distinct pattern is scored once; ties break toward the
lexicographically smaller pattern, so the search is deterministic.
"""

import dataclasses
import itertools
import math
from typing import Callable

SWA_LETTER = "S"


@dataclasses.dataclass(frozen=True)
class SearchResult:
  """`pattern` is the best fully converted pattern; `history[s]` lists step s's candidates as
  (pattern, score), best first; `scores` holds every pattern scored."""

  pattern: str
  score: float
  history: tuple[tuple[tuple[str, float], ...], ...]
  scores: dict

  def to_json(self) -> dict:
    return dict(pattern=self.pattern, score=self.score, evaluations=len(self.scores),
                history=[[list(c) for c in step] for step in self.history],
                scores=dict(sorted(self.scores.items())))


def num_candidates(num_free: int, num_convert: int, beam_width: int,
                   layers_per_step: int) -> int:
  """An upper bound on how many patterns the search scores, for `num_free` convertible layers
  (for progress lines and time estimates)."""
  total, beam, converted = 0, 1, 0
  while converted < num_convert:
    k = min(layers_per_step, num_convert - converted)
    step = min(beam * math.comb(num_free - converted, k), math.comb(num_free, converted + k))
    total, beam, converted = total + step, min(beam_width, step), converted + k
  return max(total, 1)


def beam_search_pattern(base_pattern: str, num_convert: int,
                        score_fn: Callable[[str], float], *, beam_width: int = 8,
                        layers_per_step: int = 2, letter: str = SWA_LETTER,
                        convertible: str | None = None,
                        progress: Callable[[int, str, float], None] | None = None
                        ) -> SearchResult:
  """Best pattern with `num_convert` of `base_pattern`'s layers turned into `letter`.

  Args:
    base_pattern: the trained model's per-layer pattern (one letter per layer), e.g. "MMMM".
    num_convert: how many layers become `letter` (e.g. half the layers).
    score_fn: pattern -> score, higher is better (e.g. retrieval exact match).
    beam_width: patterns kept after each step.
    layers_per_step: layers converted per step.
    letter: the attention letter converted layers get.
    convertible: letters of `base_pattern` that may be converted; default every letter other
      than `letter`.
    progress: called as `progress(evaluations_so_far, pattern, score)` after each new score.
  """
  if beam_width < 1 or layers_per_step < 1:
    raise ValueError(f"beam_width and layers_per_step must be >= 1, got {beam_width} and "
                     f"{layers_per_step}")
  if convertible is None:
    free_layers = [i for i, c in enumerate(base_pattern) if c != letter]
  else:
    free_layers = [i for i, c in enumerate(base_pattern) if c in convertible and c != letter]
  if not 0 <= num_convert <= len(free_layers):
    raise ValueError(f"num_convert={num_convert}: pattern {base_pattern!r} has "
                     f"{len(free_layers)} convertible layers")
  scores: dict[str, float] = {}

  def score(pattern: str) -> float:
    if pattern not in scores:
      scores[pattern] = float(score_fn(pattern))
      if progress is not None:
        progress(len(scores), pattern, scores[pattern])
    return scores[pattern]

  beam, history, converted = [base_pattern], [], 0
  while converted < num_convert:
    k = min(layers_per_step, num_convert - converted)
    candidates = set()
    for pattern in beam:
      free = [i for i in free_layers if pattern[i] != letter]
      for layers in itertools.combinations(free, k):
        chars = list(pattern)
        for i in layers:
          chars[i] = letter
        candidates.add("".join(chars))
    ranked = sorted(((p, score(p)) for p in sorted(candidates)), key=lambda t: (-t[1], t[0]))
    history.append(tuple(ranked))
    beam = [p for p, _ in ranked[:beam_width]]
    converted += k
  best = beam[0]
  return SearchResult(pattern=best, score=score(best), history=tuple(history), scores=scores)
