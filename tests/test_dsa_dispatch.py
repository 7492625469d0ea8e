"""Which kernels `model.dsa_impl` and `model.attention_impl` run (`pallas_kernels.dispatch`,
`glm5_jax.attention.mla`): the TPU or GPU Pallas kernels by platform, interpret mode only when
asked for, clear errors naming the field where a platform has no kernel, and cuDNN attention's
non-cuDNN twin equal to the XLA attention it replaces."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from glm5_jax.attention import common, mla
from glm5_jax.attention.mla import MLA
from glm5_jax.attention.mode import Mode
from glm5_jax.config import ConfigError, model_config, validate_model_config
from glm5_jax.train.step import StepConfig, _measured
from pallas_kernels import blocking, dispatch


def test_plain_rows_are_the_table():
  assert pk.dsa_ops("xla") is pk.DSA_OPS["xla"]
  assert pk.dsa_ops("reference") is pk.DSA_OPS["reference"]
  assert pk.DSA_OPS["pallas_tpu"] == (pk.indexer_topk_pallas, pk.sparse_mla_pallas,
                                     pk.sparse_mla_pallas_with_head_probs, None,
                                     pk.sparse_mla_dense_expanded_pallas_parts)


def test_pallas_picks_kernels_by_platform_compiled():
  assert pk.dsa_ops("pallas", platform="tpu") is pk.DSA_OPS["pallas_tpu"]
  gpu = pk.dsa_ops("pallas", platform="gpu")
  assert gpu is pk.DSA_OPS["pallas_gpu"]
  assert gpu == (dispatch.indexer_topk_triton, dispatch.sparse_mla_triton,
                 dispatch.sparse_mla_triton_with_head_probs, dispatch.sparse_mla_triton_parts,
                 None)


def test_pallas_on_cpu_is_an_error_naming_the_field():
  assert blocking.platform() == "cpu"
  with pytest.raises(ValueError, match=r"model\.dsa_impl='pallas'.*'cpu'.*'xla'.*"
                                       r"'pallas_interpret'"):
    pk.dsa_ops("pallas")
  with pytest.raises(ValueError, match=r"model\.dsa_impl.*'sparse'"):
    pk.dsa_ops("sparse")


def test_interpret_only_when_asked():
  ops = pk.dsa_ops("pallas_interpret")
  for op, kernel in zip(ops, pk.DSA_OPS["pallas_tpu"]):  # the KL target's kernels too
    if kernel is None:  # no `sparse_mla_parts` on TPU
      assert op is None
      continue
    assert isinstance(op, functools.partial) and op.func is kernel
    assert op.keywords == {"interpret": True}
  gpu = pk.dsa_ops("pallas", platform="gpu", interpret=True)
  assert [op and op.func for op in gpu] == list(pk.DSA_OPS["pallas_gpu"])
  assert not hasattr(blocking, "default_interpret")  # the silent fallback is gone
  # A TPU kernel called on CPU without interpret=True is not interpreted behind our back.
  b, l, s, h, c, r, t = 1, 8, 8, 2, 8, 4, 4
  arrays = [jnp.ones(shape, jnp.float32) for shape in ((b, l, h, c), (b, l, h, r), (b, s, c),
                                                       (b, s, r))]
  with pytest.raises(ValueError, match="interpret"):
    pk.sparse_mla_pallas(*arrays, jnp.zeros((b, l, t), jnp.int32), scale=0.1, block_t=4)


def test_platform_follows_the_context_mesh():
  mesh = jax.make_mesh((1,), ("data",))
  with jax.set_mesh(mesh):
    assert blocking.platform() == "cpu"
  assert jax.jit(lambda: jnp.int32(len(blocking.platform())))() == 3


def test_lowering_for_names_the_platform_being_lowered_for():
  """`blocking.lowering_for` (tools/flop_ledger.py lowers the GPU step on a CPU host): inside
  it "cuda" / "rocm" read as "gpu", and `dsa_ops("pallas")` picks the Triton kernels; after
  it, this host's platform again."""
  with blocking.lowering_for("cuda"):
    assert blocking.platform() == "gpu"
    assert pk.dsa_ops("pallas") == dispatch.DSA_OPS["pallas_gpu"]
  assert blocking.platform() == "cpu"


@pytest.mark.parametrize("module", ["lightning_indexer_triton", "sparse_mla_triton"])
def test_missing_gpu_module_fails_only_when_called(module):
  """Importing pallas_kernels never needs the GPU modules; calling an absent one names it and
  the field (skipped for a module the build has: the lead's merge brings both)."""
  if importlib.util.find_spec(f"pallas_kernels.{module}") is not None:
    pytest.skip(f"pallas_kernels.{module} is in this build")
  op = {"lightning_indexer_triton": dispatch.indexer_topk_triton,
        "sparse_mla_triton": dispatch.sparse_mla_triton}[module]
  with pytest.raises(ModuleNotFoundError, match=rf"pallas_kernels\.{module}.*"
                                                r"model\.dsa_impl='pallas'"):
    op()


_LAYER = {}


def _layer_params(helpers):
  """One DSA layer's params and inputs, built once (the fields the tests vary change no
  param)."""
  if _LAYER:
    return _LAYER["params"], _LAYER["args"]
  b, l = 1, 16
  cfg = helpers.config()
  x = jnp.asarray(np.random.default_rng(0).standard_normal((b, l, cfg.hidden_size)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(l), (b, l))
  segments = jnp.where(jnp.arange(l) >= 6, 2, 1).astype(jnp.int32)[None]
  params = helpers.random_tree(jax.eval_shape(
      lambda: MLA(cfg, kind="dsa").init(jax.random.key(0), x, positions, segments,
                                        mode=Mode(dsa_stage="dense"))))
  _LAYER.update(params=params, args=(x, positions, segments))
  return params, (x, positions, segments)


def _dsa_layer(helpers, **overrides):
  params, args = _layer_params(helpers)
  return MLA(helpers.config(**overrides), kind="dsa"), params, args


def test_model_pallas_on_cpu_names_the_field(helpers):
  module, params, args = _dsa_layer(helpers, dsa_impl="pallas")
  with pytest.raises(ValueError, match=r"model\.dsa_impl='pallas'.*'cpu'"):
    jax.eval_shape(functools.partial(module.apply, mode=Mode(dsa_stage="sparse")), params, *args)


# ---- model.attention_impl ---------------------------------------------------------------------


def test_attention_impl_validation():
  for impl in ("xla", "cudnn"):
    validate_model_config(model_config(attention_impl=impl))
  with pytest.raises(ConfigError, match=r"model\.attention_impl.*'xla', 'cudnn'.*'flash'"):
    validate_model_config(model_config(attention_impl="flash"))


@pytest.mark.parametrize("k,v", [(20, 16), (24, 24)])  # padded to 24; GLM-5's K = V as is
def test_flash_call_equals_attend(k, v):
  """`attend_flash` with implementation="xla" (the same jax.nn.dot_product_attention call that
  runs cuDNN on GPU) gives `attend`'s output and gradients, packed documents included."""
  b, l, h = 2, 12, 3
  rng = np.random.default_rng(0)
  q, kk, vv = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((b, l, h, k), (b, l, h, k), (b, l, h, v)))
  mask = common.causal_segment_mask(jnp.where(jnp.arange(l) >= 5, 2, 1)[None].repeat(b, 0))
  want = lambda *a: common.attend(*a, mask, 0.3)[0]
  got = lambda *a: common.attend_flash(*a, mask, 0.3, "xla")
  np.testing.assert_allclose(jax.jit(got)(q, kk, vv), jax.jit(want)(q, kk, vv), rtol=1e-5,
                             atol=1e-6)
  loss = lambda f: jax.jit(jax.grad(lambda *a: (f(*a) ** 2).sum(), argnums=(0, 1, 2)))(q, kk, vv)
  for g, w in zip(loss(got), loss(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_cudnn_on_cpu_names_the_field(helpers):
  module, params, args = _dsa_layer(helpers, attention_impl="cudnn", dtype="bfloat16")
  with pytest.raises(ConfigError, match=r"model\.attention_impl.*GPU only.*'cpu'"):
    jax.eval_shape(functools.partial(module.apply, mode=Mode(dsa_stage="warmup")), params, *args)


def test_cudnn_wiring_in_the_warmup_stage(helpers, monkeypatch):
  """The warm-up stage with attention_impl="cudnn", the platform taken as GPU and the cuDNN
  call swapped for its XLA twin: same output, top-k and indexer KL as "xla" (the KL's target
  recomputed beside cuDNN)."""
  monkeypatch.setattr(mla, "platform", lambda: "gpu")
  monkeypatch.setattr(mla, "attend_flash",
                      lambda *a: common.attend_flash(*a[:-1], "xla"))
  outs = {}
  for impl in ("xla", "cudnn"):
    module, params, args = _dsa_layer(helpers, attention_impl=impl, dtype="bfloat16")
    outs[impl] = jax.jit(functools.partial(module.apply, mode=Mode(dsa_stage="warmup")))(
        params, *args)
  (y, aux), (want_y, want_aux) = outs["cudnn"], outs["xla"]
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y, np.float32),
                             rtol=2e-2, atol=2e-2)
  np.testing.assert_array_equal(aux["topk_indices"], want_aux["topk_indices"])
  np.testing.assert_allclose(aux["indexer_kl"], want_aux["indexer_kl"], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not all(importlib.util.find_spec(f"pallas_kernels.{m}") for m in
                            ("lightning_indexer_triton", "sparse_mla_triton")),
                    reason="a GPU kernel module is not in this build")
def test_model_on_gpu_runs_the_gpu_kernels(helpers, monkeypatch):
  """A DSA layer with dsa_impl="pallas" traced as on GPU (the platform patched; the GPU row's
  kernels in interpret mode) takes the Triton kernels through the model's wiring (per-shard
  calls, keyword options; the sparse attention and the indexer KL as one op whose KL target
  comes from the attention's backward kernel, `dsa_kl_fused`) and gives the XLA path's output,
  top-k and gradients, attention and indexer params; its differentiated forward's KL is 0, its
  forward-only KL the XLA path's. (The forward-kernel target, used where heads are split over
  devices, is checked against `sparse_mla_head_mean_probs` in test_triton_sparse_mla.py.)"""
  calls = []

  def interpreted(op):
    def run(*args, **kwargs):
      calls.append(op.__name__)
      return op(*args, interpret=True, **kwargs)
    return run

  monkeypatch.setattr(dispatch, "current_platform", lambda: "gpu")
  monkeypatch.setitem(dispatch.DSA_OPS, "pallas_gpu", pk.DSAOps(
      *(interpreted(op) for op in dispatch.DSA_OPS["pallas_gpu"])))
  steps = {}
  for impl in ("xla", "pallas"):
    module, params, args = _dsa_layer(helpers, dsa_impl=impl)  # the same params for both
    forward = functools.partial(module.apply, mode=Mode(dsa_stage="sparse"))

    def loss(params, forward=forward, args=args):
      y, aux = forward(params, *args)
      return (y ** 2).sum() + aux["indexer_kl"].mean(), (y, aux)

    steps[impl] = jax.value_and_grad(loss, has_aux=True)
  # One program for the three (a compile each would cost more than the three runs).
  want, got, (_, forward_only_aux) = jax.jit(lambda p: (
      steps["xla"](p), steps["pallas"](p), forward(p, *args)))(params)
  assert sorted(set(calls)) == ["indexer_topk_triton", "sparse_mla_triton_parts"]
  (_, (y, aux)), grads = got
  (_, (want_y, want_aux)), want_grads = want
  np.testing.assert_array_equal(aux["topk_indices"], want_aux["topk_indices"])
  np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-5)
  assert not np.asarray(aux["indexer_kl"]).any()  # not computed in a differentiated forward
  np.testing.assert_allclose(forward_only_aux["indexer_kl"], want_aux["indexer_kl"],
                             rtol=1e-4, atol=1e-6)
  assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5 * max(float(np.abs(want).max()),
                                                                     1e-6))
  assert any(np.asarray(g).any() for g in jax.tree.leaves(grads["params"]["indexer"]))


def test_kl_target_in_backward_where_the_attention_backward_gives_it(helpers, monkeypatch):
  """`mla.kl_target_in_backward`: the GPU kernels (no other row has `sparse_mla_parts`), and,
  given the training sequences' length, the attention over every key on any sparse-stage impl
  (`dsa_attention_keys` "dense", or "auto" with S <= 2 T); then a train step's metrics drop
  `indexer_kl` in the sparse stage (`step._measured`: its value is 0 there), nowhere else."""
  impls = ("dense_mask", "xla", "pallas", "pallas_interpret")
  metrics = {"loss": 1.0, "indexer_kl": 0.0}
  sparse, warmup = StepConfig(dsa_stage="sparse"), StepConfig(dsa_stage="warmup")
  for platform, backward in (("cpu", ()), ("tpu", ()), ("gpu", ("pallas",))):
    monkeypatch.setattr(dispatch, "current_platform", lambda platform=platform: platform)
    for impl in impls:
      for keys, seq_len, dense in (("gather", 16, False), ("dense", 64, True),
                                   ("auto", 16, True), ("auto", 64, False)):
        cfg = helpers.config(dsa_impl=impl, dsa_attention_keys=keys)
        assert 8 < 16 <= 2 * cfg.index_topk < 64, cfg.index_topk  # "auto" goes dense at 16
        expect = impl in backward or (dense and impl != "dense_mask")
        batch = {"tokens": np.zeros((2, seq_len), np.int32)}
        assert mla.kl_target_in_backward(cfg, seq_len) == expect, (platform, impl, keys)
        assert mla.kl_target_in_backward(cfg) == (impl in backward), (platform, impl, keys)
        assert ("indexer_kl" in _measured(cfg, sparse, metrics, batch)) == (not expect)
        assert _measured(cfg, warmup, metrics, batch) == metrics
