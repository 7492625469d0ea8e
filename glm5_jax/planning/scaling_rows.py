"""docs/scaling.md's compiled rows: what each is (`ROWS`, the `tools/plan_memory.py` flags of
each), where a compiled row's files are, and the tables built from them
(`tools/scaling_rows.py` compiles and prints them; the module docstring there says how).

A row's files in the output directory: `<row>.log` (plan_memory's output; its last line the
JSON the tables read), `<row>.meta.json` (the commit and command it was compiled from, the
date, the wall time), `<row>.hlo.gz` (the optimized module, for `tools/plan_cost.py`).
"""

import dataclasses
import json
import os
import shlex
import subprocess
import sys

_TRAIN = ("--config=configs/glm5_744b.py", "--remat_policy=save_selections",
          "--config.model.dsa_impl=pallas", "--config.model.moe_impl=expert_parallel",
          "--config.model.moe_capacity_factor=1.25")
# On 1,024 chips Muon's Newton-Schulz runs in bf16 (`optim.ns_dtype`, the usual Muon practice):
# the iteration's matmuls and its whole-matrix exchanges at half the bytes, +2.5 GiB a device
# (docs/scaling.md, "Newton-Schulz in bf16; the expert matmuls' zeroing passes"). The 256-chip
# rows keep fp32: each device iterates 4x the matrices there, and bf16 put the 128K row at
# 100.1 GiB.
_HEADLINE = _TRAIN + ("--config.optim.ns_dtype=bfloat16", "--target=v5p:8x8x16",
                      "--mesh=fsdp=32,expert=32,tensor=1",
                      "--seq_len=4096", "--per_device_batch=2",
                      "--config.mesh.device_layout=expert=x8,y4:2;fsdp=y2,z16",
                      "--config.model.moe_dispatch_chunks=2")


# The sparse stage over every key and the fused chunked LM head: the current headline's flags
# beyond `_HEADLINE`.
_EVERY_KEY_FUSED_HEAD = ("--config.model.dsa_attention_keys=auto", "--config.train.ce_chunk=512",
                         "--config.train.ce_grad_in_forward=True")


def _with_policy(args: tuple, policy: str) -> tuple:
  return tuple(f"--remat_policy={policy}" if a.startswith("--remat_policy=") else a
               for a in args)


# The comparison rows (the gather path, the logits path) keep nothing in the rerun: under
# save_selections they need 104.7 / 95.4 GiB a device (the gather path keeps its forward's KL
# target too), over v5p's 95; under full remat both fit.
_HEADLINE_FULL = _with_policy(_HEADLINE, "full")
_LONG = _TRAIN + ("--target=v5p:4x8x8", "--per_device_batch=1",
                  "--config.mesh.context_layout=striped")


# The current headline's flags less its batch (`--per_device_batch` is given per row).
_ACCUMULATING = tuple(a for a in _HEADLINE if a != "--per_device_batch=2") + _EVERY_KEY_FUSED_HEAD


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  title: str
  args: tuple


ROWS = (
    Row("headline", "744B train, fsdp 32 x expert 32, 8,192 tokens/chip, gather sparse stage, "
        "logits path, full remat (the headline before the two rows below)", _HEADLINE_FULL),
    Row("headline_dense_keys", "the headline, sparse attention over every key "
        "(dsa_attention_keys=auto), full remat",
        _HEADLINE_FULL + ("--config.model.dsa_attention_keys=auto",)),
    Row("headline_fused_ce", "the headline, every key + the fused chunked LM head and loss "
        "(train.ce_chunk=512, ce_grad_in_forward), the attention's output and its projection "
        "kept (remat save_selections_attn_out): the current headline",
        _with_policy(_HEADLINE, "save_selections_attn_out")
        + _EVERY_KEY_FUSED_HEAD),
    # save_selections_o_proj would keep 1.5 x 7.6 GiB more here: ~99 GiB, over v5p's 95.
    Row("headline_12k", "the current headline at 3 sequences a device (12,288 tokens/chip), "
        "remat save_selections",
        tuple("--per_device_batch=3" if a == "--per_device_batch=2" else a for a in _HEADLINE)
        + _EVERY_KEY_FUSED_HEAD),
    # Gradient accumulation: the optimizer and the once-a-step work amortised over the
    # microbatches. The fp32 gradient sum and its copies take ~5 GiB: save_selections_attn_out
    # needed 98.79 GiB here, over v5p's 95; with the MoE layers' attention output in host
    # memory (save_selections_offload_attn_out) it fits (docs/scaling.md).
    Row("headline_accum", "the current headline in 4 microbatches of 8,192 tokens/chip "
        "(32,768 tokens/chip a step), the MoE layers' attention output in host memory (remat "
        "save_selections_offload_attn_out)",
        _with_policy(_ACCUMULATING, "save_selections_offload_attn_out")
        + ("--per_device_batch=8", "--config.train.microbatches=4")),
    Row("headline_accum_48k", "the same in 6 microbatches (49,152 tokens/chip a step, "
        "MaxText's DeepSeek-V3 v5p figure)",
        _with_policy(_ACCUMULATING, "save_selections_offload_attn_out")
        + ("--per_device_batch=12", "--config.train.microbatches=6")),
    Row("long_128k", "744B train at 131,072 tokens, expert 8 x context 32 (256 chips)",
        _LONG + ("--mesh=expert=8,context=32", "--seq_len=131072")),
    Row("long_200k", "744B train at 202,752 tokens, expert 4 x context 64 (256 chips)",
        _LONG + ("--mesh=expert=4,context=64", "--seq_len=202752")),
)
BY_NAME = {row.name: row for row in ROWS}

def command(row: Row, out_dir: str) -> list[str]:
  """The row's plan_memory command line (argv[0] the interpreter), run from the repository root."""
  return [sys.executable, os.path.join("tools", "plan_memory.py"), *row.args, "--json",
          f"--hlo_out={os.path.join(out_dir, row.name + '.hlo.gz')}"]


def read_row(out_dir: str, name: str) -> tuple[dict | None, dict | None]:
  """`(plan JSON, meta)` of a compiled row, or Nones where its log has no JSON line yet."""
  log, meta = (os.path.join(out_dir, name + suffix) for suffix in (".log", ".meta.json"))
  if not (os.path.exists(log) and os.path.exists(meta)):
    return None, None
  with open(log) as f:
    lines = [line for line in f if line.startswith("{")]
  if not lines:
    return None, None
  with open(meta) as f:
    return json.loads(lines[-1]), json.load(f)


def _gib(n: float) -> str:
  return f"{n / 2 ** 30:,.2f} GiB"


# What a row's figures depend on (git pathspecs): a commit that changed none of these since a
# row was compiled leaves the row current. This registry is left out: a row whose flags
# change is older by its recorded command instead.
CODE_PATHS = ("glm5_jax", "pallas_kernels", "configs", "tools/plan_memory.py", "setup.cfg",
              ":(exclude)glm5_jax/planning/scaling_rows.py")


def is_stale(row: Row, meta: dict, out_dir: str, root: str) -> bool:
  """Whether a compiled row is older than the code: compiled with other flags than the row's
  now, or from a commit whose code differs from the checkout's."""
  return (meta.get("command") != shlex.join(command(row, out_dir)[1:])
          or code_changed_since(meta["commit"], root))


def code_changed_since(commit: str, root: str) -> bool:
  """Whether the checkout's code (`CODE_PATHS`) differs from `commit`'s: a row compiled from
  uncommitted changes, or from a commit git does not know, always counts as older."""
  if commit.endswith("+changes"):
    return True
  proc = subprocess.run(["git", "diff", "--quiet", commit, "--", *CODE_PATHS], cwd=root,
                        capture_output=True)
  return proc.returncode != 0


def _host_cell(transfers: dict) -> str:
  """"to / from host s" of a row's host link transfers, "- / -" for a row with none."""
  if not transfers:
    return "- / -"
  return " / ".join(f"{transfers.get(d, {}).get('seconds', 0.0):.2f}"
                    for d in ("to host", "from host")) + " s"


def format_tables(rows: list[tuple[Row, dict, dict]], stale: set) -> str:
  """docs/scaling.md's two tables: each row's memory and collectives, and its step by the
  TPU compiler's estimate (per category) with the bound beside it; the rows named in `stale`
  marked as compiled from older code."""
  gib = 2 ** 30
  lines = ["| row | compiled from | memory / device | collectives per step | compile |",
           "|---|---|---|---|---|"]
  for row, plan, meta in rows:
    kinds = plan["compiled"][-1]["collectives_per_step"]["op"]
    total = sum(k["bytes"] for k in kinds.values())
    parts = ", ".join(f"{op} {k['bytes'] / gib:,.1f}" for op, k in
                      sorted(kinds.items(), key=lambda kv: -kv[1]["bytes"]) if k["bytes"])
    mark = " (older than the code)" if row.name in stale else ""
    host = plan["compiled"][-1].get("memory", {}).get("host_temp", 0)
    memory = _gib(plan["total"]) + (f" (+ {_gib(host)} in host memory)" if host else "")
    lines.append(f"| {row.title} | {meta['commit']}, {meta['date'][:10]}{mark} | "
                 f"{memory} | {total / gib:,.1f} GiB ({parts}) | "
                 f"{plan['compiled'][-1]['compile_s']:,.0f} s |")
  estimated = [(row, plan) for row, plan, _ in rows if plan.get("compiler_estimate")]
  if not estimated:
    return "\n".join(lines)
  categories = []
  for _, plan in estimated:
    for name in plan["compiler_estimate"]["compute_by_category"]:
      if name not in categories:
        categories.append(name)
  head = "| per step per device (compiler estimate) | " + " | ".join(
      row.name for row, _ in estimated) + " |"
  lines += ["", head, "|---" * (len(estimated) + 1) + "|"]

  def cells(fn):
    return " | ".join(fn(plan["compiler_estimate"], plan) for _, plan in estimated)

  for name in categories:
    lines.append(f"| {name} | " + cells(
        lambda c, _, name=name: f"{c['compute_by_category'].get(name, 0.0):.2f} s"
        + (f" (custom calls {c['kernels_by_category'][name]:.2f} s)"
           if c["kernels_by_category"].get(name) else "")) + " |")
  lines.append("| **compute** | " + cells(lambda c, _: f"**{c['times']['compute']:.2f} s**")
               + " |")
  lines.append("| collectives on the torus / exposed in the schedule | " + cells(
      lambda c, _: f"{c['times']['collectives']:.2f} / "
                   f"{c['times']['schedule'] - c['times']['compute']:.2f} s") + " |")
  if any(c["compiler_estimate"].get("host_transfers") for _, c in estimated):
    lines.append("| host link, to / from host memory (the chip's stated host link) | " + cells(
        lambda c, _: _host_cell(c.get("host_transfers", {}))) + " |")
  for way, label in (("schedule", "**step, the compiled schedule's overlap (MFU)**"),
                     ("none", "step, no overlap (MFU)"), ("ideal", "step, ideal overlap (MFU)")):
    bold = "**" if way == "schedule" else ""
    lines.append(f"| {label} | " + cells(
        lambda c, _, way=way, bold=bold: f"{bold}{c['times'][way]:.2f} s "
                                         f"({c['mfu'][way]:.1%}){bold}") + " |")
  lines.append("| bound (roofline): MFU overlap / none | " + cells(
      lambda _, p: f"{p['estimate']['mfu']['overlap']:.1%} / {p['estimate']['mfu']['serial']:.1%}")
               + " |")
  lines.append("| tokens per chip per step | " + cells(
      lambda c, _: f"{c['tokens_per_chip']:,.0f}") + " |")
  return "\n".join(lines)
