"""`Mode`: how a forward pass runs its attention layers, one small hashable value.

Every attention module, `DecoderLayer`, `MTPLayer`, `GLM5` and `glm5_jax.forward` take it as
the keyword `mode` and hand it down unchanged; it is frozen and hashable, so it can be a static
jit argument (`jax.jit(..., static_argnames="mode")`).
"""

import dataclasses

FORMS = ("expanded", "absorbed", "decode")
DSA_STAGES = ("dense", "warmup", "sparse")


@dataclasses.dataclass(frozen=True)
class Mode:
  """How the attention layers compute.

  Attributes:
    form: which of the equivalent computations each layer runs (same outputs, to rounding):
      "expanded"  training / prefill: MLA-family layers build per-head keys and values, GDN /
                  SimpleGDN run the chunked (WY) delta rule.
      "absorbed"  the decode computation over a whole sequence: MLA-family layers attend over
                  the shared C + R latent (W_kb folded into the query, W_vb applied after
                  attention), GDN / SimpleGDN step the recurrence position by position. GQA
                  has one form and ignores it.
      "decode"    cached decoding: the layers read and update a per-layer cache passed as
                  `cache=` (`glm5_jax.infer.cache`); the call's tokens are the new ones of each
                  slot at absolute `positions`, segment id 0 marks padding. MLA-family layers
                  attend in the absorbed form over the cached latent rows 0..position.
    dsa_stage: how DSA layers (D, R) attend (docs/reference.md section 3, "DSA adaptation"):
      "dense"   plain MLA; indexers do not run.
      "warmup"  the indexers run and learn (their KL in aux); attention stays dense.
      "sparse"  attention restricted to the top-k keys (inference, and training stage 2).
      S layers apply their window in every stage.

  Adding decode with a KV cache (the inference engine's next step) is one more `form` value
  and one branch per module, nothing else here:
    1. `FORMS` gains "decode".
    2. The cache is data, not mode: it travels as an argument (`cache=` on every module's
       `__call__`, a pytree of per-layer arrays: MLA's latent rows and indexer keys, GQA's
       K / V, GDN's state and conv inputs), so `Mode` stays hashable and static.
    3. Each module adds one `if mode.form == "decode":` branch that appends this step's rows
       to its cache, attends over it (MLA: the absorbed computation, which "absorbed" already
       checks against "expanded"; the indexer with `q_pos` = the cache positions, as
       `pallas_kernels` already supports), and returns the updated cache in its aux.
    4. `forward` threads the cache tree through the layers.
  Each module reads `mode.form` in exactly one place (grep `mode.form`): that is where its
  decode branch goes.
  """

  form: str = "expanded"
  dsa_stage: str = "sparse"

  def __post_init__(self):
    if self.form not in FORMS:
      raise ValueError(f"Mode.form must be one of {FORMS}, got {self.form!r}")
    if self.dsa_stage not in DSA_STAGES:
      raise ValueError(f"Mode.dsa_stage must be one of {DSA_STAGES}, got {self.dsa_stage!r}")
