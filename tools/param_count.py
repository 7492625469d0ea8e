"""Parameter counts (total, per component, active per token) and KV-cache size of a config.

Shapes come from `glm5_jax.abstract_params` (`jax.eval_shape`), so nothing is allocated and the
744B config takes seconds on CPU. Run from the repository root:

  python tools/param_count.py --config=configs/glm5_744b.py
  python tools/param_count.py --config=configs/glm5_744b.py --json
  python -m tools.param_count --config=configs/tiny.py:attention=G
  python -m tools.param_count --config=configs/tiny.py --config.model.num_hidden_layers=2
  python tools/param_count.py --config=configs/glm5_744b.py --config.model.quant=w4a8 \
      --config.model.param_dtype=bfloat16     # bytes stored for W4A8 serving (glm5_jax.quant)

What is counted: see `glm5_jax.param_stats`.
"""

import json

from absl import app
from absl import flags

from configs import overrides
from glm5_jax.param_stats import summarize

_CONFIG = overrides.define_config_file(
    "config", None, "Experiment config file (its `model` section is counted).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")

def human(n: int) -> str:
  """`753.86B`, `951.58M`, `12.35K`, or the integer itself below a thousand."""
  for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
    if n >= scale:
      return f"{n / scale:.2f}{suffix}"
  return str(n)


def _rows(title: str, counts: dict[str, int]) -> list[str]:
  lines = [f"{title:<34}{'params':>10}{'exact':>20}"]
  lines += [f"  {name:<32}{human(n):>10}{n:>20,}" for name, n in counts.items()]
  return lines


def format_table(summary: dict) -> str:
  """The human-readable report printed by default."""
  totals = {k: summary[k] for k in ("total_params", "total_params_without_mtp", "active_params",
                                    "active_params_without_embeddings")}
  kv = summary["kv_cache_bytes_per_token"]
  lines = _rows("component", summary["breakdown"]) + [""]
  if summary["mtp_breakdown"]:
    lines += _rows("mtp layer", summary["mtp_breakdown"]) + [""]
  lines += _rows("totals", totals) + [""]
  lines.append(f"KV cache per token, bf16, {summary['num_hidden_layers']} main layers (bytes)")
  lines += [f"  {name:<32}{kv[name]:>30,}" for name in kv
            if isinstance(kv[name], int) and (kv[name] or name == "total")]
  lines.append(f"  {'GQA-8 / this model':<32}{kv['gqa8_ratio']:>29.2f}x")
  lines.append(f"  {'GQA-8 / this model w/o indexer':<32}"
               f"{kv['gqa8_ratio_without_indexer']:>29.2f}x")
  lines += ["", "params as stored (bytes)"]
  lines += [f"  {name:<32}{n:>30,}" for name, n in summary["param_bytes_by_dtype"].items()]
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  summary = summarize(_CONFIG.value.model)
  print(json.dumps(summary, indent=2) if _JSON.value else format_table(summary))


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, flags_parser=overrides.parse_flags)
