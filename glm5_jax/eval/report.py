"""Suite results as files: JSON (everything) and a markdown summary (task x length tables)."""

import json
import os

import numpy as np

from glm5_jax.files import write_atomic


def percent(value) -> str:
  return "-" if value is None else f"{100 * value:.1f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
  return "\n".join(lines)


def suite_markdown(results: dict, title: str = "Retrieval suite") -> str:
  """Exact match (%) per task x length, the per-length mean, and depth x length for the tasks
  that place needles by depth."""
  lengths = [str(n) for n in results["meta"]["lengths"]]
  rows = [[task] + [percent(by_length[n]) for n in lengths]
          for task, by_length in results["by_task_length"].items()]
  rows.append(["**mean**"] + [percent(results["by_length"][n]) for n in lengths])
  if "answers_by_length" in results:
    rows.append(["answer accuracy (mean)"]
                + [percent(results["answers_by_length"][n]) for n in lengths])
  meta = results["meta"]
  parts = [f"## {title}", "",
           f"Exact match (%) on answer tokens, teacher-forced argmax; pattern "
           f"`{meta['attention_pattern']}`, {meta['examples']} examples, seed {meta['seed']}, "
           f"stream {meta['stream']}. Overall: **{percent(results['score'])}**.", "",
           markdown_table(["task"] + [f"L={n}" for n in lengths], rows)]
  depths = sorted({c["depth"] for c in results["cells"] if c["depth"] is not None})
  if depths:
    depth_rows = []
    for depth in depths:
      row = [f"{depth:g}"]
      for n in lengths:
        hits = [c for c in results["cells"] if c["depth"] == depth and str(c["length"]) == n]
        row.append(percent(np.mean([c["exact_match"] for c in hits]) if hits else None))
      depth_rows.append(row)
    parts += ["", "Exact match (%) by needle depth (mean over depth-placed tasks):", "",
              markdown_table(["depth"] + [f"L={n}" for n in lengths], depth_rows)]
  return "\n".join(parts) + "\n"


def write_json(path: str, data) -> None:
  """Writes `data` as indented JSON atomically (`glm5_jax.files.write_atomic`)."""
  write_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


def write_suite_results(results: dict, out_dir: str, name: str = "eval",
                        title: str = "Retrieval suite") -> tuple[str, str]:
  """Writes `<out_dir>/<name>.json` and `<out_dir>/<name>.md`; returns both paths."""
  json_path = os.path.join(out_dir, f"{name}.json")
  md_path = os.path.join(out_dir, f"{name}.md")
  write_json(json_path, results)
  with open(md_path, "w") as f:
    f.write(suite_markdown(results, title))
  return json_path, md_path
