"""Which optimizer moves each parameter, from its path: Muon (with a matrix layout) or AdamW.

docs/reference.md section 3 ("Muon Split"). Muon orthogonalizes a momentum *matrix* with
Newton-Schulz; `optax.contrib.MuonDimensionNumbers(reduction_axis, output_axis)` says which axes
of a stored kernel form that matrix's rows (inputs) and columns (outputs). Every axis named in
neither is a batch axis: each slice along it is orthogonalized on its own (`jax.vmap`).

  Muon Split: the MLA up-projections W_UQ, W_UK, W_UV are stored per head (`[in, H, head_dim]`),
  so reduction 0 / output 2 leaves the head axis as a batch axis and each head's `[in, head_dim]`
  slice is orthogonalized independently. Plain Muon treats the same kernel as one
  `[in, H * head_dim]` matrix (output axes (1, 2)).

Partition (`rule_for`), matched on the leaf name, plus its parent where the name alone is
ambiguous; the rank is checked too, so a layout change cannot silently change the treatment:

  path (suffix)                                   stored        Muon reduction / output
  ---------------------------------------------   -----------   ---------------------------------
  self_attn/{q_b,k_b,v_b}_proj  (MLA up-proj.)    [in, H, K]    0 / 2 per head (split), 0 / (1, 2)
  self_attn/{q_a_proj, kv_a_proj_with_mqa}        [D, out]      0 / 1
  self_attn/o_proj              (MLA and GQA)     [H, V, D]     (0, 1) / 2
  self_attn/{q,k,v}_proj        (GQA)             [D, H, K]     0 / (1, 2)
  self_attn/g_proj              (GDN output gate) [D, H, V]     0 / (1, 2)
  self_attn/{a,b}_proj          (GDN gate logits) [D, H]        AdamW (one scalar gate per head)
  self_attn/{q,k,v}_conv1d      (GDN short convs) [W, H, K]     AdamW, no weight decay
  indexer/wq_b                                    [Q, N, I]     0 / (1, 2)
  indexer/{wk, weights_proj}                      [D, out]      0 / 1
  experts/{gate,up,down}_proj   (routed experts)  [E, in, out]  1 / 2 per expert
  {gate,up,down}_proj           (dense, shared)   [in, out]     0 / 1
  mlp/gate                      (router)          [D, E]        0 / 1
  eh_proj                       (MTP)             [2D, D]       0 / 1
  embed_tokens, lm_head                           [V, D], [D, V]  AdamW
  any leaf of rank <= 1 (norm scale/bias, *_bias, the GDN / SimpleGDN per-head A_log,
    dt_bias, decay_rate_log, beta_logit)                          AdamW, no weight decay
  anything else                                                   UnknownParamError

Scanned layers (`model.scan_layers`, `glm5_jax.layer_runs`) store a run's kernels with a leading
`[layers]` axis: under `layers_<i>_<j>/` every rule's rank is one more and its Muon axes shift by
one, so the layers axis is a batch axis and each layer's matrices are orthogonalized on their
own, exactly as in the unrolled layout.

`e_score_correction_bias` (the MoE loss-free-balancing bias) is always frozen: the balancing rule
moves it outside the optimizer, never gradients (`FROZEN_LEAF_NAMES`).

Decoupled weight decay (`weight_decay_mask`) applies to every matrix that a matmul multiplies by,
i.e. all Muon kernels, `lm_head` and the GDN gate projections; not to norms, biases, per-head
gate scalars, the GDN convolutions (initialized to the identity, which decay would erode like a
norm scale), or the `embed_tokens` lookup table (decay would shrink the rows of rare tokens,
which get few gradient updates to push back).
"""

import dataclasses

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from glm5_jax.layer_runs import is_run_name

MUON, ADAM, FROZEN = "muon", "adam", "frozen"
OPTIMIZER_NAMES = ("muon_split", "muon", "adamw")
FROZEN_LEAF_NAMES = ("e_score_correction_bias",)

MATRIX = MuonDimensionNumbers(reduction_axis=0, output_axis=1)  # [in, out]
HEADS_OUT = MuonDimensionNumbers(reduction_axis=0, output_axis=(1, 2))  # [in, H, K] whole
HEADS_IN = MuonDimensionNumbers(reduction_axis=(0, 1), output_axis=2)  # [H, K, out] whole
PER_HEAD = MuonDimensionNumbers(reduction_axis=0, output_axis=2)  # [in, H, K], H batched
PER_EXPERT = MuonDimensionNumbers(reduction_axis=1, output_axis=2)  # [E, in, out], E batched


class UnknownParamError(ValueError):
  """A parameter path has no optimizer rule; the message names the path."""


@dataclasses.dataclass(frozen=True)
class Rule:
  """How one kind of parameter is optimized.

  Attributes:
    ndim: the rank the layout assumes (checked), or None for any rank <= 1.
    dims: Muon layout, or None for AdamW.
    split_heads: a per-head up-projection, orthogonalized per head only under Muon Split
      (`dims` is PER_HEAD); plain Muon uses HEADS_OUT.
    decay: gets decoupled weight decay.
  """

  ndim: int | None
  dims: MuonDimensionNumbers | None
  split_heads: bool = False
  decay: bool = True


_MATRIX = Rule(2, MATRIX)
_UP_PROJ_PER_HEAD = Rule(3, PER_HEAD, split_heads=True)
_ADAM_VECTOR = Rule(None, None, decay=False)

# Path suffix (leaf name, or (parent, leaf) where the name alone is ambiguous) -> rule.
# A two-element suffix wins over the leaf name alone.
RULES = {
    ("embed_tokens",): Rule(2, None, decay=False),
    ("lm_head",): Rule(2, None, decay=True),
    # MLA
    ("q_a_proj",): _MATRIX,
    ("kv_a_proj_with_mqa",): _MATRIX,
    ("q_b_proj",): _UP_PROJ_PER_HEAD,
    ("k_b_proj",): _UP_PROJ_PER_HEAD,
    ("v_b_proj",): _UP_PROJ_PER_HEAD,
    ("o_proj",): Rule(3, HEADS_IN),  # MLA [H, V, D] and GQA [H, K, D]
    # GQA
    ("q_proj",): Rule(3, HEADS_OUT),
    ("k_proj",): Rule(3, HEADS_OUT),
    ("v_proj",): Rule(3, HEADS_OUT),
    # Gated DeltaNet (N): output gate, gate logits, short convolutions
    ("g_proj",): Rule(3, HEADS_OUT),
    ("a_proj",): Rule(2, None),
    ("b_proj",): Rule(2, None),
    ("q_conv1d",): Rule(3, None, decay=False),
    ("k_conv1d",): Rule(3, None, decay=False),
    ("v_conv1d",): Rule(3, None, decay=False),
    # DSA lightning indexer
    ("indexer", "wq_b"): Rule(3, HEADS_OUT),
    ("indexer", "wk"): _MATRIX,
    ("indexer", "weights_proj"): _MATRIX,
    # FFN: routed experts, then dense FFN / shared experts, router
    ("experts", "gate_proj"): Rule(3, PER_EXPERT),
    ("experts", "up_proj"): Rule(3, PER_EXPERT),
    ("experts", "down_proj"): Rule(3, PER_EXPERT),
    ("gate_proj",): _MATRIX,
    ("up_proj",): _MATRIX,
    ("down_proj",): _MATRIX,
    ("mlp", "gate"): _MATRIX,
    # MTP
    ("eh_proj",): _MATRIX,
}


def path_names(path) -> tuple[str, ...]:
  """`jax.tree_util` key path -> tuple of names (dict keys, attribute names, indices)."""
  names = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        names.append(str(getattr(key, attr)))
        break
    else:
      names.append(str(key))
  return tuple(names)


def rule_for(names: tuple[str, ...], shape) -> Rule:
  """The rule for the parameter at path `names` with `shape`; raises `UnknownParamError`.

  Under a scanned run (`layers_<i>_<j>/...`) the leading layers axis is stripped before the
  rank check and added back to the rule's Muon axes.
  """
  path = "/".join(names)
  stacked = bool(names) and is_run_name(names[0])
  layer_shape = tuple(shape)[1:] if stacked else tuple(shape)
  rule = RULES.get(tuple(names[-2:])) or RULES.get(tuple(names[-1:]))
  if rule is None:
    if len(layer_shape) <= 1:  # norm scales/biases, attention biases, the router bias
      return _ADAM_VECTOR
    raise UnknownParamError(
        f"optimizer: no rule for parameter {path!r} (shape {tuple(shape)}): add its name to "
        "RULES in glm5_jax/optim/muon_split.py with a Muon layout (MuonDimensionNumbers) or "
        "AdamW (dims=None)")
  expected = rule.ndim if rule.ndim is not None else "<= 1"
  if (rule.ndim is None and len(layer_shape) > 1) or (rule.ndim is not None
                                                      and len(layer_shape) != rule.ndim):
    raise UnknownParamError(
        f"optimizer: parameter {path!r} has shape {tuple(shape)}"
        f"{' (after its scanned layers axis)' if stacked else ''} but its rule in "
        f"glm5_jax/optim/muon_split.py assumes rank {expected}; update the rule for the new "
        "layout")
  if stacked and rule.dims is not None:
    rule = dataclasses.replace(rule, dims=_shifted(rule.dims))
  return rule


def _shifted(dims: MuonDimensionNumbers) -> MuonDimensionNumbers:
  """`dims` of a layer's kernel -> of the same kernel stacked behind a leading layers axis."""
  shift = lambda axes: (tuple(a + 1 for a in axes) if isinstance(axes, tuple) else axes + 1)
  return MuonDimensionNumbers(reduction_axis=shift(dims.reduction_axis),
                              output_axis=shift(dims.output_axis))


def _map_rules(fn, params):
  """`fn(names, rule)` at every leaf of `params` (arrays or ShapeDtypeStructs)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: fn(path_names(path), rule_for(path_names(path), leaf.shape)), params)


def muon_dimension_numbers(params, split: bool = True):
  """Tree like `params`: the `MuonDimensionNumbers` of each Muon leaf, None for AdamW leaves.

  Args:
    params: the model params (arrays or `jax.ShapeDtypeStruct`s); only paths and shapes are read.
    split: Muon Split (per-head MLA up-projections) if True, whole-matrix Muon if False.
  Raises:
    UnknownParamError: naming the first path with no rule, or whose rank does not match it.
  """

  def dims(names, rule):
    if rule.split_heads and not split:
      return _shifted(HEADS_OUT) if is_run_name(names[0]) else HEADS_OUT
    return rule.dims

  return _map_rules(dims, params)


def weight_decay_mask(params):
  """Tree like `params` of bools: True where decoupled weight decay applies (see module doc)."""
  return _map_rules(lambda names, rule: rule.decay, params)


def param_labels(params, name: str = "muon_split", trainable=None):
  """Tree like `params` of group labels: `MUON`, `ADAM` or `FROZEN`.

  Args:
    params: the model params (arrays or ShapeDtypeStructs).
    name: "muon_split", "muon" (Muon leaves as in `muon_dimension_numbers`) or "adamw" (every
      trainable leaf ADAM).
    trainable: optional bool tree, the structure of `params` or a prefix of it; False leaves are
      FROZEN. Leaves named in `FROZEN_LEAF_NAMES` are FROZEN regardless.
  """
  if name not in OPTIMIZER_NAMES:
    raise ValueError(f"optimizer name must be one of {OPTIMIZER_NAMES}, got {name!r}")
  dims = muon_dimension_numbers(params, split=name == "muon_split")
  is_dims_leaf = lambda x: x is None or isinstance(x, MuonDimensionNumbers)
  labels = jax.tree.map(lambda d: MUON if d is not None and name != "adamw" else ADAM, dims,
                        is_leaf=is_dims_leaf)
  frozen_names = jax.tree_util.tree_map_with_path(
      lambda path, _: path_names(path)[-1] in FROZEN_LEAF_NAMES, params)
  train = broadcast_trainable(trainable, params)
  return jax.tree.map(lambda label, frozen, t: FROZEN if frozen or not t else label, labels,
                      frozen_names, train)


def broadcast_trainable(trainable, params):
  """`trainable` (None, or a bool tree that is `params`' structure or a prefix of it) as a full
  tree of Python bools."""
  if trainable is None:
    return jax.tree.map(lambda _: True, params)

  def expand(flag, subtree):
    if not isinstance(flag, (bool, int)) and getattr(flag, "shape", None) != ():
      raise ValueError(f"trainable leaves must be bools, got {flag!r}")
    return jax.tree.map(lambda _: bool(flag), subtree)

  return jax.tree.map(expand, trainable, params)


def masked_dimension_numbers(dims, labels, label: str = MUON):
  """`dims` where the label is `label` and `optax.MaskedNode()` elsewhere: the structure that
  group's Muon transform sees inside `optax.partition`."""
  return jax.tree.map(lambda got, d: d if got == label else optax.MaskedNode(), labels, dims)


def per_run_muon_labels(labels):
  """`labels` with each scanned run's Muon leaves relabelled `muon/<run name>`: a group per run,
  which the optimizer orthogonalizes layer by layer (`glm5_jax.optim.layer_map`)."""

  def relabel(path, label):
    run = path_names(path)[0]
    return f"{MUON}/{run}" if label == MUON and is_run_name(run) else label

  return jax.tree_util.tree_map_with_path(relabel, labels)


def per_layer_dimension_numbers(dims):
  """`dims` with a scanned run's leaves described per layer (their leading layers axis
  dropped), for a transform that sees one layer's slice at a time."""
  is_dims = lambda x: x is None or isinstance(x, MuonDimensionNumbers)

  def unshift(path, d):
    if d is None or not is_run_name(path_names(path)[0]):
      return d
    shift = lambda axes: (tuple(a - 1 for a in axes) if isinstance(axes, tuple) else axes - 1)
    return MuonDimensionNumbers(reduction_axis=shift(d.reduction_axis),
                                output_axis=shift(d.output_axis))

  return jax.tree_util.tree_map_with_path(unshift, dims, is_leaf=is_dims)
