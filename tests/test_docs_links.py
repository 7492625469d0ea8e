"""Every relative link in README.md and docs/*.md points at a file that exists, and every
`#anchor` at a heading of its target (GitHub's heading ids); README's examples read the run its
quickstart trains. Reads text only: no jax."""

import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
# [text](target) and ![alt](target); the target ends at whitespace or ")".
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _doc_files() -> list[pathlib.Path]:
  return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose_lines(path: pathlib.Path):
  """(line number, line) of `path` outside fenced code blocks."""
  fenced = False
  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
    if _FENCE.match(line):
      fenced = not fenced
      continue
    if not fenced:
      yield number, line


def _slug(heading: str) -> str:
  """GitHub's id of a heading: lowercase, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
  text = re.sub(r"[^\w\- ]", "", text.strip().lower())
  return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
  """The ids of every heading of a markdown file, duplicates numbered as GitHub does."""
  seen = collections.Counter()
  ids = set()
  for _, line in _prose_lines(path):
    match = _HEADING.match(line)
    if match:
      slug = _slug(match.group(2))
      ids.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
      seen[slug] += 1
  return ids


def broken_links(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
  """'file:line: target (why)' for each relative link of `path` that does not resolve (paths
  shown relative to `root`)."""
  problems = []
  for number, line in _prose_lines(path):
    line = re.sub(r"`[^`]*`", "", line)  # code spans hold example syntax, not links
    for target in _LINK.findall(line):
      if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        continue
      file_part, _, anchor = target.partition("#")
      resolved = (path.parent / file_part).resolve() if file_part else path
      where = f"{path.relative_to(root)}:{number}: {target}"
      if not resolved.exists():
        problems.append(f"{where} (no such file)")
      elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        problems.append(f"{where} (no heading with id #{anchor} in "
                        f"{resolved.relative_to(root)})")
  return problems


def test_doc_links_resolve():
  problems = [p for path in _doc_files() for p in broken_links(path)]
  assert not problems, "broken links:\n" + "\n".join(problems)


def test_checker_catches_a_broken_file_and_anchor(tmp_path):
  doc = tmp_path / "doc.md"
  (tmp_path / "other.md").write_text("# Other\n\n## Two words: here\n", encoding="utf-8")
  doc.write_text("# Top\n\n[ok](other.md#two-words-here) [self](#top)\n"
                 "[gone](missing.md) [bad anchor](other.md#nowhere)\n"
                 "```\n[in a fence](missing_too.md)\n```\n", encoding="utf-8")
  problems = broken_links(doc, root=tmp_path)
  assert problems == ["doc.md:4: missing.md (no such file)",
                      "doc.md:4: other.md#nowhere (no heading with id #nowhere in other.md)"]


def test_readme_examples_read_the_run_the_quickstart_trains():
  """The quickstart (`experiments/train.py`, no flags) trains into train.py's default
  --workdir; every README example that reads or continues a tiny run names that directory."""
  train_py = (ROOT / "experiments" / "train.py").read_text(encoding="utf-8")
  default = re.search(r'DEFINE_string\("workdir", "([^"]+)"', train_py).group(1)
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  readers = re.findall(r"experiments/(?:eval|generate|serve)\.py --workdir=(\S+)", readme)
  continued = re.findall(r"experiments/train\.py --config=configs/tiny\.py --workdir=(\S+)",
                         readme)
  assert readers and continued
  assert set(readers + continued) == {default}, (default, readers, continued)
