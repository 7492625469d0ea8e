"""Metrics: JSONL + TensorBoard writers, the progress line, FLOPs per token and MFU.

FLOPs per token (training, forward + backward = 3x forward): 6 x the active matmul parameters
(embedding lookups excluded; the LM head and the MTP depths counted) plus 3 x the attention
score and value products over the keys a query attends to (L/2 on average for causal dense
attention, at most top-k for DSA, at most the window for SWA), or for the linear-attention
layers (GDN, SimpleGDN) the delta rule's chunked form, linear in L: each layer's
`AttentionKind.attention_flops_per_token` (glm5_jax.attention.kinds).
MFU divides achieved FLOP/s by the devices' peak bf16 FLOP/s, known for common accelerators;
on CPU (or an unknown device) MFU is reported as unavailable rather than guessed.
"""

import json
import os
import time

from absl import logging
from etils import epath
import jax
import numpy as np

from glm5_jax.accelerators import accelerator_of
from glm5_jax.attention.kinds import layer_kind
from glm5_jax.config import ModelConfig
from glm5_jax.files import write_atomic
from glm5_jax.param_stats import summarize



def flops_per_token(model: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token: 6 x active non-embedding params + causal attention (MTP included
  at one layer per depth)."""
  summary = summarize(model)
  active = summary["active_params"] - summary["breakdown"]["embedding"]
  mtp_layer = summary["breakdown"]["mtp"]
  if mtp_layer and model.mtp_depths:  # one MTP layer pass (with its routed experts' top-k share)
    routed = summary["mtp_breakdown"].get("routed_experts", 0)
    mtp_active = mtp_layer - routed + routed * model.num_experts_per_tok // model.n_routed_experts
    active += model.mtp_depths * (mtp_active + summary["breakdown"]["lm_head"])
  n = model.num_hidden_layers
  kinds = [layer_kind(model.attention_pattern, i) for i in range(n)]
  kinds += [layer_kind(model.attention_pattern, n)] * model.mtp_depths * bool(mtp_layer)
  attention = sum(kind.attention_flops_per_token(model, seq_len) for kind in kinds)
  return 6.0 * active + 3.0 * attention


def peak_flops_per_device() -> float | None:
  """Dense bf16 peak FLOP/s of this process's first device (`glm5_jax.accelerators`), or None."""
  accelerator = accelerator_of(jax.devices()[0].device_kind)
  return accelerator.peak_flops if accelerator else None


class MetricWriter:
  """Appends one JSON object per record to `<workdir>/metrics.jsonl` and mirrors scalars to
  TensorBoard under `<workdir>/tensorboard` (process 0 only).

  A remote workdir (`gs://...`, through etils) cannot be appended to: the whole file is
  uploaded again after each record (it holds one line per step: small), and the TensorBoard
  mirror is off (a warning says so)."""

  def __init__(self, workdir: str):
    self.enabled = jax.process_index() == 0
    self.remote = "://" in workdir
    self.path = f"{workdir.rstrip('/')}/metrics.jsonl" if self.remote else \
        os.path.join(workdir, "metrics.jsonl")
    self._tb = None
    self._text = ""
    if not self.enabled:
      return
    if self.remote:
      path = epath.Path(self.path)
      path.parent.mkdir(parents=True, exist_ok=True)
      self._text = path.read_text() if path.exists() else ""
      self._text = self._text[:self._text.rfind("\n") + 1]  # a torn last line, if any
      logging.warning("%s is remote: no TensorBoard mirror; metrics go to metrics.jsonl only",
                      workdir)
      return
    os.makedirs(workdir, exist_ok=True)
    _cut_torn_last_line(self.path)
    from tensorboardX import SummaryWriter  # imported here: only process 0 writes
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: dict, prefix: str = "train"):
    if not self.enabled:
      return
    record = {"step": step, "split": prefix, "time": time.time(),
              **{k: _plain(v) for k, v in metrics.items()}}
    line = json.dumps(record) + "\n"
    if self.remote:
      self._text += line
      write_atomic(self.path, self._text)
      return
    with open(self.path, "a") as f:
      f.write(line)
    for name, value in record.items():
      if name not in ("step", "split", "time") and isinstance(value, (int, float)):
        self._tb.add_scalar(f"{prefix}/{name}", value, step)

  def close(self):
    if self._tb is not None:
      self._tb.close()


def _cut_torn_last_line(path: str) -> None:
  """Drops a last line left without its newline by a writer that died mid-write, so that the
  next record starts a line of its own instead of corrupting this one."""
  if not os.path.exists(path):
    return
  with open(path, "rb+") as f:
    text = f.read()
    if text and not text.endswith(b"\n"):
      keep = text.rfind(b"\n") + 1
      logging.warning("%s: cutting a torn last line (%d bytes) left by a crash", path,
                      len(text) - keep)
      f.truncate(keep)


def _plain(value):
  value = np.asarray(value)
  return value.item() if value.size == 1 else value.tolist()


def progress_line(step: int, total: int, metrics: dict) -> str:
  """`step 120/600 | loss 2.314 (lm 2.101 mtp 2.71 kl 0.12) | lr 2.9e-03 | gnorm 0.81 | ...`"""
  # No `indexer_kl` where a train step does not compute its value (glm5_jax.train.step._measured).
  kl = f"{metrics['indexer_kl']:.3f}" if "indexer_kl" in metrics else "-"
  parts = [f"step {step}/{total}", f"loss {metrics['loss']:.3f} (lm {metrics['lm_loss']:.3f}"
           f" mtp {metrics['mtp_loss']:.3f} kl {kl})",
           f"acc {metrics['accuracy']:.3f}", f"lr {metrics['learning_rate']:.2e}",
           f"gnorm {metrics['grad_norm']:.2f}"]
  if "expert_load_max" in metrics:
    parts.append(f"load {metrics['expert_load_min']:.2f}-{metrics['expert_load_max']:.2f}")
  parts.append(f"{metrics['tokens_per_sec']:,.0f} tok/s")
  if metrics.get("mfu") is not None:
    parts.append(f"MFU {metrics['mfu']:.1%}")
  return " | ".join(parts)
