"""Which implementation of the DSA ops runs: the table, and `model.dsa_impl`'s choice by platform.

| `DSA_OPS` key  | indexer top-k            | sparse MLA             | compiled for          |
|----------------|--------------------------|------------------------|-----------------------|
| "reference"    | `indexer_topk_reference` | `sparse_mla_reference` | any backend (dense)   |
| "xla"          | `indexer_topk_xla`       | `sparse_mla_xla`       | any backend (gather)  |
| "pallas_tpu"   | `indexer_topk_pallas`    | `sparse_mla_pallas`    | TPU (Pallas Mosaic)   |
| "pallas_gpu"   | `indexer_topk_triton`    | `sparse_mla_triton`    | GPU (Pallas Triton)   |

`dsa_ops(impl)` maps a `model.dsa_impl` value to a row:

  "xla", "reference"  that row;
  "pallas"            "pallas_tpu" on TPU, "pallas_gpu" on GPU, compiled, by the platform of the
                      computation being traced (`blocking.platform`: the context mesh's devices,
                      else `jax.default_backend()`); a ValueError naming `model.dsa_impl` on a
                      platform with no kernel (CPU). Never interpret mode.
  "pallas_interpret"  the TPU kernels in Pallas interpret mode, on any platform: slow, for the
                      CPU tests. Interpret mode is only ever this explicit choice.

The GPU modules (`lightning_indexer_triton`, `sparse_mla_triton`) are imported when a GPU op is
first called, so a build without them fails only where they are chosen.
"""

import functools
import importlib
import typing

from pallas_kernels.blocking import platform as current_platform
from pallas_kernels.lightning_indexer import indexer_topk_reference, indexer_topk_xla
from pallas_kernels.lightning_indexer_pallas import indexer_topk_pallas
from pallas_kernels.sparse_mla import sparse_mla_reference
from pallas_kernels.sparse_mla_dense_expanded_pallas import sparse_mla_dense_expanded_pallas_parts
from pallas_kernels.sparse_mla_pallas import (sparse_mla_pallas,
                                              sparse_mla_pallas_with_head_probs)
from pallas_kernels.sparse_mla_xla import sparse_mla_xla

# `model.dsa_impl` values that run the ops through `dsa_ops` ("dense_mask" is the model's own
# masked dense attention and never reaches here).
PALLAS_IMPLS = ("pallas", "pallas_interpret")
# Platform -> the `DSA_OPS` row "pallas" picks there.
PALLAS_BY_PLATFORM = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}


class DSAOps(typing.NamedTuple):
  """One implementation of the two DSA ops (signatures as the references).

  sparse_mla_with_probs: where the sparse MLA kernel also emits the indexer KL's target,
  `(q, q_rope, kv, k_rope, topk, *, scale) -> (out, lse, head_mean_probs_BLT)` (probs equal to
  `sparse_mla_head_mean_probs`, no gradient); None where the caller computes the target with
  that separate XLA pass.
  sparse_mla_parts: where the kernels also come apart for a caller's own custom VJP, with the
  KL target from the backward kernel: `(**block_options) -> sparse_mla.SparseMLAParts`
  (`glm5_jax.attention.dsa_kl_fused`); None elsewhere.
  dense_expanded_parts: where there are kernels for the sparse MLA over every key in the
  expanded form (`sparse_mla_dense_expanded_pallas_parts`, the TPU row), its parts the same
  way; None elsewhere.
  """

  indexer_topk: typing.Callable
  sparse_mla: typing.Callable
  sparse_mla_with_probs: typing.Callable | None = None
  sparse_mla_parts: typing.Callable | None = None
  dense_expanded_parts: typing.Callable | None = None


def _missing(module: str, error: ModuleNotFoundError) -> ModuleNotFoundError:
  """The error for a GPU kernel module absent from this build (re-raised as is when the module
  is there but something it imports is not)."""
  if error.name != f"pallas_kernels.{module}":
    return error
  return ModuleNotFoundError(f"pallas_kernels.{module} (a GPU kernel) is not in this build; "
                             "model.dsa_impl='pallas' on GPU needs it (or use 'xla')",
                             name=error.name)


def _gpu_kernel(module: str, name: str):
  """`pallas_kernels.<module>.<name>`, imported (by name: the module may be absent) at the first
  call; the same signature."""

  def op(*args, **kwargs):
    try:
      kernel = getattr(importlib.import_module(f"pallas_kernels.{module}"), name)
    except ModuleNotFoundError as e:
      raise _missing(module, e) from e
    return kernel(*args, **kwargs)

  op.__name__ = op.__qualname__ = name
  return op


indexer_topk_triton = _gpu_kernel("lightning_indexer_triton", "indexer_topk_triton")
sparse_mla_triton = _gpu_kernel("sparse_mla_triton", "sparse_mla_triton")
sparse_mla_triton_with_head_probs = _gpu_kernel("sparse_mla_triton",
                                                "sparse_mla_triton_with_head_probs")
sparse_mla_triton_parts = _gpu_kernel("sparse_mla_triton", "sparse_mla_triton_parts")


DSA_OPS = {
    "reference": DSAOps(indexer_topk_reference, sparse_mla_reference),
    "xla": DSAOps(indexer_topk_xla, sparse_mla_xla),
    "pallas_tpu": DSAOps(indexer_topk_pallas, sparse_mla_pallas,
                         sparse_mla_pallas_with_head_probs,
                         dense_expanded_parts=sparse_mla_dense_expanded_pallas_parts),
    "pallas_gpu": DSAOps(indexer_topk_triton, sparse_mla_triton,
                         sparse_mla_triton_with_head_probs, sparse_mla_triton_parts),
}


def pallas_row(platform: str | None = None) -> str:
  """The `DSA_OPS` key of the compiled Pallas kernels for `platform` (None: the current one)."""
  platform = current_platform() if platform is None else platform
  if platform not in PALLAS_BY_PLATFORM:
    raise ValueError(
        f"model.dsa_impl='pallas': no compiled Pallas kernel for platform {platform!r} (there "
        f"are kernels for {sorted(PALLAS_BY_PLATFORM)}); use model.dsa_impl='xla' there, or "
        "'pallas_interpret' to run the TPU kernels in interpret mode (slow; tests)")
  return PALLAS_BY_PLATFORM[platform]


def dsa_ops(impl: str, *, platform: str | None = None, interpret: bool = False) -> DSAOps:
  """The ops `model.dsa_impl=impl` runs (module docstring).

  Args:
    impl: "reference", "xla", "pallas" or "pallas_interpret".
    platform: for "pallas", the platform to pick the kernels of ("tpu", "gpu"); None: the
      platform of the computation being traced. Tests pass "gpu" to run the GPU kernels on CPU.
    interpret: for "pallas", run the picked kernels in Pallas interpret mode (tests).
  """
  if impl in ("reference", "xla"):
    return DSA_OPS[impl]
  if impl == "pallas_interpret":
    impl, platform, interpret = "pallas", "tpu" if platform is None else platform, True
  if impl != "pallas":
    raise ValueError(f"model.dsa_impl: no DSA ops named {impl!r}; expected one of "
                     f"{('reference', 'xla') + PALLAS_IMPLS}")
  ops = DSA_OPS[pallas_row(platform)]
  if not interpret:
    return ops
  return DSAOps(*(op and functools.partial(op, interpret=True) for op in ops))
