"""Which flax module computes each attention kind: the one table above the modules.

`glm5_jax.attention.kinds` holds every other fact about a kind and sits below
`glm5_jax.config` (which validates patterns with it); the modules here import `glm5_jax.config`,
so the table that names them lives above both (docs/design.md, Dependency direction).

Every module is called as `module(x_BLD, positions_BL, segment_ids_BL, prev_topk_BLT,
mode=Mode)` and returns `(y_BLD, aux)` (`glm5_jax.attention` package docstring).
"""

from typing import Any

from flax import linen as nn

from glm5_jax.attention.gdn import GatedDeltaNet
from glm5_jax.attention.gqa import GQA
from glm5_jax.attention.kinds import KINDS_BY_NAME
from glm5_jax.attention.mla import MLA
from glm5_jax.attention.simple_gdn import SimpleGatedDeltaNet
from glm5_jax.attention.swa import SlidingWindowMLA
from glm5_jax.config import ModelConfig

# kind name -> (module class, extra constructor arguments). M, D and R are one module, MLA,
# told its kind.
ATTENTION_MODULES: dict[str, tuple[type[nn.Module], dict[str, Any]]] = {
    "mla": (MLA, {"kind": "mla"}),
    "dsa": (MLA, {"kind": "dsa"}),
    "dsa_shared_topk": (MLA, {"kind": "dsa_shared_topk"}),
    "gqa": (GQA, {}),
    "swa": (SlidingWindowMLA, {}),
    "gdn": (GatedDeltaNet, {}),
    "simple_gdn": (SimpleGatedDeltaNet, {}),
}
if set(ATTENTION_MODULES) != set(KINDS_BY_NAME):
  raise ValueError(f"ATTENTION_MODULES covers {sorted(ATTENTION_MODULES)}, the kinds registry "
                   f"{sorted(KINDS_BY_NAME)}: give every kind its module")


def build_attention(kind: str, cfg: ModelConfig, name: str) -> nn.Module:
  """The flax module of attention kind `kind` (a name in `KINDS_BY_NAME`) for `cfg`."""
  module, kwargs = ATTENTION_MODULES[kind]
  return module(cfg, name=name, **kwargs)
