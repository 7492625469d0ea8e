"""DSA ops under a sharded mesh: batch and heads stay on their devices inside the loops.

Issue 25: with the batch as an index coordinate of the key-gradient scatter-add, the SPMD
partitioner kept the whole-batch `[B, S, C]` accumulator on every device and all-reduced it over
the batch devices in every query block of the sparse MLA backward; with the heads split over
`tensor`, every query block also all-reduced its `[B, Lq, T, C]` per-slot row gradients; the
indexer's `lax.top_k` all-gathered the global batch's scores per query block; the Pallas kernels
(not partitionable) gathered every input. The compiled programs, as the model's sparse stage
calls the ops (`glm5_jax.attention.mla`), must now hold no collective with a whole-batch operand
inside any while loop, and the sparse MLA backward one reduction over the head shards after its
loop. Shapes are tiny: B 8 over data x fsdp (2 x 2), H 4 over tensor (2), L = S = 32 in query
blocks of 4 (8 loop iterations).

Notation (docs/design.md): B batch, L queries, S keys, H heads, C latent dim, R RoPE dim,
T top-k slots, G head groups, J index heads, I index head dim.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from flax import linen as nn
from jax.extend import core as jax_core
from jax.sharding import AbstractMesh, AxisType
from glm5_jax.attention import mla
from glm5_jax import sharding
from glm5_jax.sharding import mesh_config
from pallas_kernels.sparse_mla import scatter_add_rows
from tests.conftest import run_on_host_devices

_COMPUTATION_START = re.compile(r"^(?:ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)"
                     r"=%([^\s,)}]+)")
_CALLED_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")


def loop_body_text(hlo_text: str) -> str:
  """The instructions of every `while` body of an optimized HLO module, with every computation
  they call (fusions, reductions, nested loops), so `hlo_stats.collectives` of the result is
  every collective that runs once per loop iteration."""
  computations, name = {}, None
  for line in hlo_text.splitlines():
    if name is None and (match := _COMPUTATION_START.match(line)):
      name, computations[match[1]] = match[1], []
    elif name is not None and line.strip() == "}":
      name = None
    elif name is not None:
      computations[name].append(line)

  def called(lines):
    text = "\n".join(lines)
    lists = [n.strip().lstrip("%") for group in _CALLED_LISTS.findall(text)
             for n in group.split(",")]
    return set(_CALLED.findall(text)) | {n for n in lists if n}

  todo = {m for lines in computations.values() for line in lines if " while(" in line
          for m in re.findall(r"\bbody=%([^\s,)}]+)", line)}
  seen = set()
  while todo:
    current = todo.pop()
    if current in seen or current not in computations:
      continue
    seen.add(current)
    todo |= called(computations[current])
  assert seen or " while(" not in hlo_text, "while bodies not found: the HLO text format moved"
  return "\n".join(line for n in sorted(seen) for line in computations[n])


def test_loop_body_text_finds_the_scan_and_its_fusions():
  """The walker on a scan whose body has a fusion: the body's instructions are found, the
  instructions outside the loop are not."""
  def f(x):
    return jax.lax.scan(lambda c, _: (jnp.sin(c) * 3.0, None), x, None, length=5)[0] + 7.0
  text = jax.jit(f).lower(jnp.ones(4)).compile().as_text()
  body = loop_body_text(text)
  assert "sine(" in body, body
  assert "constant(7)" in text and "constant(7)" not in body, body


def test_scatter_add_rows_equals_the_batch_indexed_scatter_bit_for_bit():
  """The vmapped scatter-add is the old batch-indexed one (`acc.at[arange(B), topk]`) bit for
  bit, -1 / negative / duplicate slots included, fp32 and bf16."""
  rng = np.random.default_rng(0)
  b, s, l, t, c = 3, 7, 5, 6, 4
  topk_BLT = rng.integers(-2, s, (b, l, t))
  topk_BLT[:, :, 1] = topk_BLT[:, :, 0]  # every query selects one row twice (or -1 twice)
  topk_BLT = jnp.asarray(topk_BLT, jnp.int32)
  assert (topk_BLT < 0).any() and (topk_BLT[..., 0] >= 0).any()
  for dtype in (jnp.float32, jnp.bfloat16):
    acc_BSC = jnp.asarray(rng.standard_normal((b, s, c)), dtype)
    rows_BLTC = jnp.asarray(rng.standard_normal((b, l, t, c)), dtype)
    safe_BLT = jnp.where(topk_BLT < 0, s, topk_BLT)
    want = acc_BSC.at[jnp.arange(b)[:, None, None], safe_BLT].add(rows_BLTC, mode="drop")
    got = jax.jit(scatter_add_rows)(acc_BSC, topk_BLT, rows_BLTC)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16 if dtype == jnp.bfloat16
                                                        else np.uint32),
                                  np.asarray(want).view(np.uint16 if dtype == jnp.bfloat16
                                                        else np.uint32))


def test_head_groups_give_the_same_gradients():
  """G = 2 head groups (the tensor-split layout: the backward kernel vmapped over the groups) and
  G = 1 agree to fp32 rounding on the Pallas path, -1 and duplicate slots included; G must
  divide H. (The XLA path's G = 2 is checked against the reference in the sharded test.)"""
  rng = np.random.default_rng(1)
  b, l, s, h, c, r, t = 2, 6, 9, 4, 8, 4, 5
  args = [jnp.asarray(rng.standard_normal(shape), jnp.float32)
          for shape in ((b, l, h, c), (b, l, h, r), (b, s, c), (b, s, r))]
  topk = rng.integers(-1, s, (b, l, t))
  topk[:, :, 2] = topk[:, :, 3]
  topk = jnp.asarray(topk, jnp.int32)

  def grads(groups):
    loss = lambda *a: (pk.sparse_mla_pallas(*a, topk, scale=0.3, block_t=4,
                                            backward_query_block=4, head_groups=groups,
                                            interpret=True)[0]
                       ** 2).sum()
    return jax.grad(loss, argnums=(0, 1, 2, 3))(*args)

  for one, two in zip(grads(1), grads(2)):
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="head_groups=3"):
    grads(3)


def _scan_lengths(jaxpr) -> list[int]:
  """The trip count of every `scan` in `jaxpr` and the jaxprs it calls (query-block loops)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      found.append(eqn.params["length"])
    for sub in jax_core.jaxprs_in_params(eqn.params):
      found += _scan_lengths(sub)
  return found


def test_query_blocks_are_sized_by_each_devices_batch_rows():
  """Traced with global shapes (XLA partitions the batch), the "xla" sparse stage's query-block
  loops are sized by each device's rows: B = 8 over 4 batch devices loops as B = 2 does, not as
  B = 8 (the 744B step's global batch of 2,048 had forced the 8-query minimum: 512 iterations a
  layer). Abstract shapes, nothing runs; through `mla` under a mesh whose `batch` rule splits
  data x fsdp (2 x 2) as the model calls the ops."""
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  l, s, h, c, r, j, i = 256, 1024, 64, 512, 64, 32, 128
  ops = {  # name: (inputs for a batch of b, op(batch_shards) -> [B, L, ...] output)
      "sparse_mla": (lambda b: (f32(b, l, h, c), f32(b, l, h, r), f32(b, s, c), f32(b, s, r),
                                i32(b, l, 256)),
                     lambda shards: lambda *a: pk.sparse_mla_xla(*a, scale=0.3,
                                                                 batch_shards=shards)[0]),
      # S = 2 T: the "dense" form (every key's score, then the slots picked)
      "indexer_scores_at": (lambda b: (f32(b, l, j, i), f32(b, 4 * s, i), f32(b, l, j),
                                       i32(b, l, 2 * s)),
                            lambda shards: lambda *a: pk.indexer_scores_at(
                                *a, scale=0.1, batch_shards=shards)),
      "indexer_scores_at_gather": (lambda b: (f32(b, l, j, i), f32(b, s, i), f32(b, l, j),
                                              i32(b, l, 1024)),
                                   lambda shards: lambda *a: pk.indexer_scores_at(
                                       *a, scale=0.1, batch_shards=shards, keys="gather")),
      "indexer_topk": (lambda b: (f32(b, 1024, j, i), f32(b, 2048, i), f32(b, 1024, j),
                                  i32(b, 1024), i32(b, 1024), i32(b, 2048)),
                       lambda shards: lambda *a: pk.indexer_topk_xla(
                           *a, topk=64, scale=0.1, batch_shards=shards)[0]),
  }
  lengths = lambda fn, args: _scan_lengths(jax.make_jaxpr(fn)(*args).jaxpr)
  for name, (inputs, op) in ops.items():
    whole, per_device = lengths(op(1), inputs(8)), lengths(op(4), inputs(8))
    assert per_device == lengths(op(1), inputs(2)) and per_device != whole, (name, whole,
                                                                             per_device)
  mesh = AbstractMesh((2, 2, 1, 1, 2), ("data", "fsdp", "context", "expert", "tensor"),
                      axis_types=(AxisType.Auto,) * 5)
  rules = sharding._rules(mesh_config().logical_axis_rules)  # as activation_sharding sets them
  with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(rules):
    attn = lengths(lambda *a: mla._sparse_mla_on_mesh("xla", 0.3)(*a)[0],
                   ops["sparse_mla"][0](8))
    topk = lengths(lambda *a: mla._indexer_topk_on_mesh("xla", topk=64, scale=0.1)(*a)[0],
                   ops["indexer_topk"][0](8))
    kl = lengths(lambda q, k, w, t: mla._indexer_kl_on_mesh(0.1)(q, k, w, t, t * 1.0)[0],
                 ops["indexer_scores_at"][0](8))
  assert attn == lengths(ops["sparse_mla"][1](4), ops["sparse_mla"][0](8)), attn
  assert topk == lengths(ops["indexer_topk"][1](4), ops["indexer_topk"][0](8)), topk
  assert kl == lengths(ops["indexer_scores_at"][1](4), ops["indexer_scores_at"][0](8)), kl


_SHARDED_BACKWARD = r"""
import json, jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import pallas_kernels as pk
from glm5_jax.planning import hlo_stats
from glm5_jax.attention import mla
from glm5_jax.sharding import activation_sharding, mesh_config
from tests.test_dsa_sharding import loop_body_text

mesh = jax.make_mesh((2, 2, 1, 1, 2), ("data", "fsdp", "context", "expert", "tensor"),
                     axis_types=(AxisType.Auto,) * 5)
B, L, S, H, C, R, T = 8, 32, 32, 4, 16, 8, 8
batch = ("data", "fsdp")
specs = (P(batch, None, "tensor"), P(batch, None, "tensor"), P(batch), P(batch), P(batch))
rng = np.random.default_rng(0)
topk = rng.integers(-1, S, (B, L, T))
topk[:, :, 1] = topk[:, :, 0]  # duplicate slots
values = [rng.standard_normal(shape).astype(np.float32)
          for shape in ((B, L, H, C), (B, L, H, R), (B, S, C), (B, S, R))] + [topk.astype(np.int32)]
args = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(values, specs)]
grad = lambda op: jax.jit(jax.grad(lambda *a: (op(*a)[0] ** 2).sum(), argnums=(0, 1, 2, 3)))
want = grad(lambda *a: pk.sparse_mla_reference(*a, scale=0.3))(*values)
# The op as the model's sparse stage calls it, with small blocks (8 backward query blocks).
blocks = {"xla": dict(query_block=4),
          "pallas_interpret": dict(block_t=4, backward_query_block=4)}
result = {}
for impl in ("xla", "pallas_interpret"):
  with activation_sharding(mesh, mesh_config().logical_axis_rules):
    step = grad(mla._sparse_mla_on_mesh(impl, 0.3, **blocks[impl]))
    text = step.lower(*args).compile().as_text()
    got = step(*args)
  summary = lambda cs: [[c.op, c.dtype, list(c.shape), c.group] for c in cs]
  result[impl] = {"all": summary(hlo_stats.collectives(text)),
                  "in_loops": summary(hlo_stats.collectives(loop_body_text(text))),
                  "loops": text.count(" while("),
                  "grad_error": max(float(np.abs(np.asarray(g) - np.asarray(w)).max()
                                          / np.abs(np.asarray(w)).max())
                                    for g, w in zip(got, want))}

# The indexer's top-k as the sparse stage calls it: J = 4 index heads over tensor.
J, I, K = 4, 8, 8
q_pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
segments = np.where(np.arange(L) < L // 2 + 3, 1, 2).astype(np.int32)[None].repeat(B, 0)
index_values = [rng.integers(-2, 3, shape).astype(np.float32)  # exact scores, many ties
                for shape in ((B, L, J, I), (B, L, I), (B, L, J))] + [q_pos, segments, segments]
index_specs = (P(batch, None, "tensor"), P(batch), P(batch, None, "tensor"), P(batch), P(batch),
               P(batch))
index_args = [jax.device_put(x, NamedSharding(mesh, spec))
              for x, spec in zip(index_values, index_specs)]
want_topk = pk.indexer_topk_reference(*index_values, topk=K, scale=0.5)[0]
index_blocks = {"xla": dict(query_block=8, key_block=16),
                "pallas_interpret": dict(block_q=8, block_s=16, query_block=16)}
for impl in ("xla", "pallas_interpret"):
  with activation_sharding(mesh, mesh_config().logical_axis_rules):
    select = jax.jit(lambda *a: mla._indexer_topk_on_mesh(impl, topk=K, scale=0.5,
                                                          **index_blocks[impl])(*a)[0])
    text = select.lower(*index_args).compile().as_text()
    got = select(*index_args)
  result["indexer_" + impl] = {
      "all": summary(hlo_stats.collectives(text)),
      "in_loops": summary(hlo_stats.collectives(loop_body_text(text))),
      "loops": text.count(" while("),
      "same_topk": bool((np.asarray(got) == np.asarray(want_topk)).all())}
print(json.dumps(result))
"""


@pytest.mark.slow  # a subprocess with 8 host devices
def test_sharded_dsa_ops_have_no_per_block_batch_or_head_collectives():
  """Compiled on 8 simulated devices (batch over data x fsdp, heads over tensor), through the
  model's `mla._sparse_mla_on_mesh`, and checked against the single-device reference gradients.
  Before the fix the XLA path's loop held `all-reduce f32[8,32,16]` (+ `f32[8,32,8]`: the whole
  batch's key gradients, over the 4 batch devices) and `all-reduce f32[2,4,8,16]` (+ 2 more:
  each block's row gradients, over tensor); the Pallas path the same whole-batch all-reduce and
  all-gathers of the whole batch's inputs (`[8,32,16]` keys, `[8,32,2,16]` queries, ...) for
  the kernels, which XLA does not partition."""
  result = run_on_host_devices(_SHARDED_BACKWARD, timeout=600)
  for impl in ("xla", "pallas_interpret"):
    found = result[impl]
    assert found["loops"] >= 1 and found["grad_error"] < 1e-5, found
    # Nothing per query block; one all-reduce over tensor (2 devices) of the device's
    # [B/4, S, C] (+ [B/4, S, R]) key gradients after the loop (the XLA path's joined
    # [B/4, S, C + R] rows: `sparse_mla_xla`).
    assert found["in_loops"] == [], found
    width = 16 + 8 if impl == "xla" else 16
    assert found["all"] == [["all-reduce", "f32", [2, 32, width], 2]], found
  # The indexer: its top-k all-gathered the global batch's scores (`f32[8,8,32]` per query block
  # on the XLA path: XLA's SPMD partitioner does not split a TopK op over batch dimensions; the
  # Pallas path gathered every input of the kernels). What may remain per block is the XLA
  # path's sum of the partial scores over the index-head shards, over tensor, on local rows.
  for impl in ("xla", "pallas_interpret"):
    found = result["indexer_" + impl]
    assert found["loops"] >= 1 and found["same_topk"], found
    assert not [c for c in found["all"] if c[2][:1] == [8]], found
    assert all(c[0] == "all-reduce" and c[3] == 2 for c in found["in_loops"]
               if c[2]), found
  found = result["indexer_pallas_interpret"]
  assert found["in_loops"] == [], found


# Context parallelism on the Pallas path (interpret mode here): one D layer, mesh data 2 x
# context 4, packed documents crossing the 8-token shards.
_CONTEXT_PALLAS = r"""
import json, jax, jax.numpy as jnp, numpy as np
import glm5_jax
from glm5_jax import sharding
from glm5_jax.attention.mode import Mode
from tests.sharded_tiny import on_mesh, packed_batch
cfg, mesh, model, params, sh_params = on_mesh(
    dict(data=2, fsdp=1, context=4, expert=1, tensor=1), num_hidden_layers=1,
    attention_pattern="D", mtp_depths=0, first_k_dense_replace=1, **DSA_OPTIONS)
rules = cfg.mesh.logical_axis_rules
tokens, positions, segments = packed_batch(model.vocab_size)
B, L = tokens.shape
weights = jax.random.normal(jax.random.key(2), (B, L, model.vocab_size))
def loss(p, t, pos, seg):
  out = glm5_jax.forward(model, p, t, pos, seg, mode=Mode(dsa_stage="sparse"), mtp=False)
  kl = sum(jnp.sum(a["indexer_kl"]) for a in out["aux"]["layers"].values() if "indexer_kl" in a)
  # The KL's gradient, not its value: unsharded, the attention over every key takes the KL
  # target from its backward (a differentiated forward's KL is 0 there), per device it does not.
  return jnp.sum(out["logits"] * weights) + kl - jax.lax.stop_gradient(kl), out["logits"]
step = jax.value_and_grad(loss, has_aux=True)
(ref_loss, ref_logits), ref_grads = jax.jit(step)(params, tokens, positions, segments)
seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "context"))
args = [jax.device_put(x, seq) for x in (tokens, positions, segments)]
with sharding.activation_sharding(mesh, rules):
  (cp_loss, cp_logits), cp_grads = jax.jit(step)(sh_params, *args)
diff = lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max())
scale = lambda a: float(np.abs(np.asarray(a)).max())
grad_err = max(diff(a, b) / max(scale(b), 1e-30) for a, b in zip(
    jax.tree_util.tree_leaves(cp_grads), jax.tree_util.tree_leaves(ref_grads)))
print(json.dumps({"loss": [float(ref_loss), float(cp_loss)], "logits": diff(cp_logits, ref_logits),
                  "grad_rel": grad_err}))
"""


@pytest.mark.slow  # a subprocess with 8 host devices
@pytest.mark.parametrize("options", [dict(dsa_impl="pallas_interpret"),
                                     dict(dsa_impl="xla", dsa_attention_keys="dense")])
def test_sparse_stage_under_context_parallelism(options):
  """The sparse stage with the sequence split over `context`, where its ops run per device on
  their own queries (the per_shard specs keep `length` split) over the whole sequence's keys:
  the Pallas kernels, and the sparse attention over every key (not causal there: the local
  queries are not the key positions). Loss, logits and gradients equal the unsharded model's."""
  result = run_on_host_devices(_CONTEXT_PALLAS.replace("DSA_OPTIONS", repr(options)),
                               timeout=600)
  ref_loss, cp_loss = result["loss"]
  assert abs(ref_loss - cp_loss) <= 1e-5 * max(1.0, abs(ref_loss)), result
  assert result["logits"] < 1e-5 and result["grad_rel"] < 1e-5, result
