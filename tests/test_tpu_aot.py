"""The real TPU compiler, ahead of time on this host (`glm5_jax.planning.aot_targets`): the Pallas TPU
kernels compiled by Mosaic (elsewhere they are only lowered), and the planner's train step on a
small v5p slice with no CPU stand-ins. Runs where the `tpu-aot` extra (libtpu matching jax) is
installed; skipped, with the reason, where it is not. Each case is a subprocess with
`JAX_PLATFORMS=cpu`: jax itself must not try to open a local TPU."""

import json
import os
import subprocess
import sys

import pytest

from glm5_jax.planning import aot_targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROBLEM = aot_targets.libtpu_problem()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_PROBLEM is not None, reason=f"no TPU compiler: {_PROBLEM}")]


def _run(args, timeout=900):
  path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


_KERNEL = r"""
import functools, json, sys, jax, jax.numpy as jnp
import pallas_kernels as pk
from glm5_jax import grouped_matmul
from glm5_jax.planning import aot_targets, hlo_stats
device = aot_targets.tpu_devices("v5p:2x2x1")[0]
on_tpu = jax.sharding.SingleDeviceSharding(device)
sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_tpu)
b, l, s, j, i, h, c, r, t = 1, 256, 1024, 8, 128, 16, 512, 64, 640  # t: not a multiple of 512
bf16, i32 = jnp.bfloat16, jnp.int32

def sparse_mla(q, q_rope, kv, k_rope, topk):  # both forward kernels and the backward
  def loss(*arrays):
    out, lse = pk.sparse_mla_pallas(*arrays, topk, scale=0.07, interpret=False)
    _, _, probs = pk.sparse_mla_pallas_with_head_probs(*arrays, topk, scale=0.07)
    return out.astype(jnp.float32).sum() + lse.sum() + probs.sum()
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, q_rope, kv, k_rope)

def experts(impl, x, w, sizes):  # the routed experts' matmul and both its gradients
  gmm = functools.partial(grouped_matmul.grouped_matmul, impl=impl, interpret=False)
  loss = lambda x, w: gmm(x, w, sizes).astype(jnp.float32).sum()
  return jax.grad(loss, argnums=(0, 1))(x, w)

gmm_args = (sds((4096, 512), bf16), sds((64, 512, 1024), bf16), sds((64,), i32))
programs = {
    "indexer": (functools.partial(pk.indexer_topk_pallas, topk=t, scale=i ** -0.5,
                                  interpret=False),
                (sds((b, l, j, i), bf16), sds((b, s, i), bf16), sds((b, l, j), jnp.float32),
                 sds((b, l), i32), sds((b, l), i32), sds((b, s), i32))),
    "sparse_mla": (sparse_mla, (sds((b, l, h, c), bf16), sds((b, l, h, r), bf16),
                                sds((b, s, c), bf16), sds((b, s, r), bf16),
                                sds((b, l, t), i32))),
    "megablox": (functools.partial(experts, "megablox"), gmm_args),
    "ragged_dot": (functools.partial(experts, "ragged_dot"), gmm_args),
}
fn, args = programs[sys.argv[1]]
compiled = jax.jit(fn).lower(*args).compile()
text = compiled.as_text()
print(json.dumps({"kernels": text.count('custom_call_target="tpu_custom_call"'),
                  "head_probs": text.count("sparse_mla_forward_head_probs"),
                  "convolutions": text.count(" convolution("),
                  "flops": hlo_stats.step_dot_flops(text)["flops"],
                  "kind": device.device_kind,
                  "temp": compiled.memory_analysis().temp_size_in_bytes}))
"""


def test_indexer_kernel_compiles_for_tpu():
  result = json.loads(_run(["-c", _KERNEL, "indexer"]).strip().splitlines()[-1])
  assert result["kernels"] >= 1 and result["kind"].startswith("TPU v5"), result
  assert result["temp"] > 0


def test_sparse_mla_kernels_compile_for_tpu():
  """bf16 forward (with and without the KL target) and backward: a one-row DMA into a bf16 VMEM
  buffer is rejected by Mosaic (sublane tile of 16 rows), so the kernel gathers 32-bit words
  (`_pack_halves`)."""
  result = json.loads(_run(["-c", _KERNEL, "sparse_mla"]).strip().splitlines()[-1])
  assert result["kernels"] >= 3 and result["head_probs"] >= 1, result


def test_megablox_experts_gradient_is_grouped_not_dense_over_the_experts():
  """`ragged_dot`'s weight gradient is a dense dilated convolution over all 64 groups (64x the
  ragged product); megablox's is `tgmm`: 2 x 2 x 4096 x 512 x 1024 FLOPs for both gradients."""
  mega = json.loads(_run(["-c", _KERNEL, "megablox"]).strip().splitlines()[-1])
  ragged = json.loads(_run(["-c", _KERNEL, "ragged_dot"]).strip().splitlines()[-1])
  assert mega["kernels"] == 2 and mega["convolutions"] == 0, mega
  assert mega["flops"] == 2 * 2 * 4096 * 512 * 1024, mega
  assert ragged["convolutions"] == 1 and ragged["flops"] > 30 * mega["flops"], ragged


def test_plan_memory_compiles_the_train_step_with_the_tpu_compiler():
  """The tiny model's train step (one MoE layer, expert-parallel with the real
  ragged-all-to-all and ragged_dot, MTP) on a v5p 2x2x1 slice: the TPU compiler's memory,
  per-step collectives with every loop's trip count read from its text, the roofline bound and
  the compiler's estimate op by op."""
  out = _run([os.path.join("tools", "plan_memory.py"), "--config=configs/tiny.py",
              "--target=v5p:2x2x1", "--mesh=fsdp=2,expert=2", "--json",
              "--config.model.num_hidden_layers=2", "--config.model.mtp_depths=1",
              "--config.model.moe_impl=expert_parallel"])
  result = json.loads(out.strip().splitlines()[-1])
  assert result["compiler"].startswith("TPU compiler") and not result["moe_standin"], result
  assert result["devices"] == 4 and result["accelerator"] == "v5p"
  compiled = result["compiled"][0]
  assert compiled["memory"]["temp"] > 0 and compiled["unknown_loops"] == 0
  assert "ragged-all-to-all" in compiled["collectives_per_step"]["op"], compiled
  assert set(compiled["collectives_per_step"]["axes"]) <= {"fsdp", "expert", "fsdp+expert"}
  assert compiled["flops_per_step"] > 0 and 0 < result["estimate"]["mfu"]["serial"] < 1
  assert "MoE via stand-in" not in out and "a BOUND" in out
  # beside the bound, the compiler's estimate op by op: every way slower than the bound
  cost = result["compiler_estimate"]
  assert "compiler estimate on v5p:2x2x1" in out and cost["times"]["compute"] > 0, cost
  assert cost["times"]["ideal"] <= cost["times"]["schedule"] <= cost["times"]["none"]
  assert 0 < cost["mfu"]["none"] <= cost["mfu"]["schedule"] < result["estimate"]["mfu"]["overlap"]
