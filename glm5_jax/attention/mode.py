"""`Mode`: how a forward pass runs its attention layers, one small hashable value.

Every attention module, `DecoderLayer`, `MTPLayer`, `GLM5` and `glm5_jax.forward` take it as
the keyword `mode` and hand it down unchanged; it is frozen and hashable, so it can be a static
jit argument (`jax.jit(..., static_argnames="mode")`).
"""

import dataclasses

FORMS = ("expanded", "absorbed", "decode")
DSA_STAGES = ("dense", "warmup", "sparse")
CONTEXT_LAYOUTS = ("contiguous", "striped")


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
                  slot at absolute `positions`, segment id 0 marks padding; each returns its
                  updated cache as `aux["cache"]` (the layout is its kind's
                  `AttentionKind.decode_cache`). MLA-family layers attend in the absorbed form
                  over the cached latent rows 0..position.
    dsa_stage: how DSA layers (D, R) attend (docs/reference.md section 3, "DSA adaptation"):
      "dense"   plain MLA; indexers do not run.
      "warmup"  the indexers run and learn (their KL in aux); attention stays dense.
      "sparse"  attention restricted to the top-k keys (inference, and training stage 2).
      S layers apply their window in every stage.
    context_layout: which sequence index each slot of the L axis holds (training / prefill
      forms; `glm5_jax.attention.context_parallel`):
      "contiguous"  slot l holds token l (the usual order);
      "striped"     the inputs (and so every `[B, L, ...]` output) are in the load-balanced
                    order `context_parallel.stripe_order(L, c)` for the context axis of c
                    devices in the mesh in context (the identity when c = 1): the sequence cut
                    into 2c chunks, device i holding chunks i and 2c - 1 - i, so every device
                    gets the same causal work. Attention masks, top-k, windows and MTP shifts
                    follow the tokens' sequence index, not their slot; top-k indices stay
                    sequence indices. Callers stripe their `[B, L]` inputs with
                    `context_parallel.stripe` (and unstripe outputs with `unstripe`).

  Decode with a cache is the form "decode", one branch per module, nothing else here:
    1. The cache is data, not mode: it travels as an argument (`cache=` on every module's
       `__call__`, a pytree of per-layer arrays: MLA's latent rows and indexer keys, GQA's
       K / V, GDN's state and conv inputs), so `Mode` stays hashable and static.
    2. Each module has one `if mode.form == "decode":` branch that writes this call's rows to
       its cache, attends over it (MLA: the absorbed computation, which "absorbed" already
       checks against "expanded", `attention/mla_decode.py`; the indexer with `q_pos` = the
       query positions, as `pallas_kernels` supports), and returns the updated cache in its
       aux.
    3. `GLM5` threads the cache tree through the layers (`glm5_jax.infer.cache`,
       `glm5_jax.infer.step`).
  """

  form: str = "expanded"
  dsa_stage: str = "sparse"
  context_layout: str = "contiguous"

  def __post_init__(self):
    if self.form not in FORMS:
      raise ValueError(f"Mode.form must be one of {FORMS}, got {self.form!r}")
    if self.dsa_stage not in DSA_STAGES:
      raise ValueError(f"Mode.dsa_stage must be one of {DSA_STAGES}, got {self.dsa_stage!r}")
    if self.context_layout not in CONTEXT_LAYOUTS:
      raise ValueError(f"Mode.context_layout must be one of {CONTEXT_LAYOUTS}, got "
                       f"{self.context_layout!r}")
    if self.context_layout == "striped" and self.form == "decode":
      raise ValueError("Mode.context_layout='striped' is for the training / prefill forms; "
                       "decode runs on the contiguous layout")
