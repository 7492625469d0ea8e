"""The MoE router and dropless dispatch against a naive numpy loop (docs/reference.md section 2,
"MoE router"), at odd sizes: 13 tokens, 5 experts, top-3, hidden 7, expert width 11.

Notation: N tokens, D hidden, E experts, X experts per token, F expert intermediate.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.moe import MoE, dispatch_experts, route, sequence_balance_loss

N, D, E, X, F = 13, 7, 5, 3, 11
SCALE = 2.5


def sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def silu(z):
  return z * sigmoid(z)


def naive_route(x_ND, w_gate_DE, bias_E, k, scale=SCALE, norm=True, n_group=1, topk_group=1):
  """float64 loop: `(weights_NX, experts_NX)`, experts by descending biased score."""
  scores_NE = sigmoid(x_ND.astype(np.float64) @ w_gate_DE.astype(np.float64))
  weights, experts = [], []
  for s_E in scores_NE:
    choice_E = s_E + bias_E
    if n_group > 1:
      groups_GM = choice_E.reshape(n_group, -1)
      group_score_G = np.sort(groups_GM, axis=-1)[:, -2:].sum(-1)
      keep_G = np.zeros(n_group, bool)
      keep_G[np.argsort(-group_score_G, kind="stable")[:topk_group]] = True
      choice_E = np.where(np.repeat(keep_G, groups_GM.shape[1]), choice_E, -np.inf)
    chosen = np.argsort(-choice_E, kind="stable")[:k]
    w = s_E[chosen]
    if norm:
      w = w / w.sum()
    weights.append(w * scale)
    experts.append(chosen)
  return np.array(weights), np.array(experts)


def naive_experts(x_ND, weights_NX, experts_NX, w_gate_EDF, w_up_EDF, w_down_EFD):
  """float64 per-token loop over the chosen experts."""
  x_ND = x_ND.astype(np.float64)
  y_ND = np.zeros_like(x_ND)
  for n in range(x_ND.shape[0]):
    for w, e in zip(weights_NX[n], experts_NX[n]):
      h_F = silu(x_ND[n] @ w_gate_EDF[e]) * (x_ND[n] @ w_up_EDF[e])
      y_ND[n] += w * (h_F @ w_down_EFD[e])
  return y_ND


def naive_sequence_balance_loss(scores_BLE, experts_BLX, valid_BL, k):
  """float64 loop of DeepSeek-V3's complementary sequence-wise balance loss (report section
  2.1.2), per row (sequence) of T real tokens, then averaged over rows:

    f_e = E / (k T) * #{tokens t of the row whose top-k experts include e}
    P_e = 1 / T * sum_t s[t, e] / sum_e' s[t, e']
    loss_row = sum_e f_e P_e
  """
  num_rows, length, num_experts = scores_BLE.shape
  row_losses = []
  for b in range(num_rows):
    tokens = [t for t in range(length) if valid_BL[b, t]]
    total = 0.0
    for e in range(num_experts):
      chosen = sum(1 for t in tokens if e in experts_BLX[b, t])
      f = num_experts / (k * len(tokens)) * chosen
      p = sum(scores_BLE[b, t, e] / scores_BLE[b, t].sum() for t in tokens) / len(tokens)
      total += f * p
    row_losses.append(total)
  return float(np.mean(row_losses))


def sort_by_expert(weights_NX, experts_NX):
  order = np.argsort(experts_NX, axis=-1)
  return (np.take_along_axis(np.asarray(weights_NX), order, -1),
          np.take_along_axis(np.asarray(experts_NX), order, -1))


@functools.partial(jax.jit, static_argnames=("k", "norm", "n_group", "topk_group"))
def jax_route(x_ND, w_gate_DE, bias_E, k, norm=True, n_group=1, topk_group=1):
  return route(x_ND, w_gate_DE, bias_E, num_experts_per_tok=k, routed_scaling_factor=SCALE,
               norm_topk_prob=norm, n_group=n_group, topk_group=topk_group)


jax_dispatch = jax.jit(dispatch_experts)


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  return dict(x=f32(N, D), w_gate=f32(D, E), bias=0.1 * f32(E), gate=f32(E, D, F) / 3,
              up=f32(E, D, F) / 3, down=f32(E, F, D) / 3)


def check_route_and_dispatch(data, bias, k=X, norm=True):
  """route + dispatch_experts == the numpy loop; returns `(weights, experts, counts)`."""
  weights, experts = jax_route(data["x"], data["w_gate"], bias, k, norm)
  ref_weights, ref_experts = naive_route(data["x"], data["w_gate"], bias, k, norm=norm)
  weights_sorted, experts_sorted = sort_by_expert(weights, experts)
  ref_weights_sorted, ref_experts_sorted = sort_by_expert(ref_weights, ref_experts)
  np.testing.assert_array_equal(experts_sorted, ref_experts_sorted, err_msg="expert choice")
  np.testing.assert_allclose(weights_sorted, ref_weights_sorted, rtol=1e-5, atol=1e-6)
  assert experts.dtype == jnp.int32 and weights.dtype == jnp.float32

  y, counts = jax_dispatch(data["x"], weights, experts, data["gate"], data["up"], data["down"])
  ref_y = naive_experts(data["x"], np.asarray(weights), np.asarray(experts), data["gate"],
                        data["up"], data["down"])
  np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5, err_msg="dispatch != naive loop")
  np.testing.assert_array_equal(counts, np.bincount(np.asarray(experts).ravel(), minlength=E))
  return np.asarray(weights), np.asarray(experts), np.asarray(counts)


@pytest.mark.parametrize("norm", [True, False])
def test_route_and_dispatch_match_naive_loop(data, norm):
  weights, experts, counts = check_route_and_dispatch(data, data["bias"], norm=norm)
  assert counts.sum() == N * X
  assert all(len(set(row)) == X for row in experts.tolist()), "a token chose an expert twice"
  if norm:
    np.testing.assert_allclose(weights.sum(-1), SCALE, rtol=1e-6)


def test_correction_bias_changes_selection_not_weights(data):
  """b steers which experts win, but the weights stay the *unbiased* sigmoid scores of the
  chosen experts, normalized, times routed_scaling_factor."""
  _, unbiased_experts, _ = check_route_and_dispatch(data, np.zeros(E, np.float32))
  bias = np.zeros(E, np.float32)
  least_chosen = np.bincount(unbiased_experts.ravel(), minlength=E).argmin()
  bias[least_chosen] = 1.0  # sigmoid scores lie in (0, 1): this expert now always wins
  weights, experts, counts = check_route_and_dispatch(data, bias)
  assert counts[least_chosen] == N
  assert np.any(np.sort(experts, -1) != np.sort(unbiased_experts, -1)), "bias changed nothing"
  scores_NE = sigmoid(data["x"].astype(np.float64) @ data["w_gate"])
  chosen = np.take_along_axis(scores_NE, experts, -1)
  np.testing.assert_allclose(weights, chosen / chosen.sum(-1, keepdims=True) * SCALE, rtol=1e-5)
  biased = np.take_along_axis(scores_NE + bias, experts, -1)
  assert not np.allclose(weights, biased / biased.sum(-1, keepdims=True) * SCALE, rtol=1e-3), (
      "router weights come from the biased scores")


@pytest.mark.parametrize("k,hot", [(1, [2]), (X, [0, 2, 4])])
def test_no_token_dropped_when_all_pick_the_same_experts(data, k, hot):
  bias = np.zeros(E, np.float32)
  bias[hot] = 10.0
  _, experts, counts = check_route_and_dispatch(data, bias, k=k)
  assert set(experts.ravel()) == set(hot)
  np.testing.assert_array_equal(counts, [N if e in hot else 0 for e in range(E)])


def test_group_limited_routing():
  """n_group = 4 groups of 3 experts, topk_group = 2: every token's experts lie in the two
  groups whose top-2 biased scores sum highest."""
  e, n_group, topk_group, k = 12, 4, 2, 3
  rng = np.random.default_rng(1)
  x = rng.standard_normal((N, D)).astype(np.float32)
  w_gate = rng.standard_normal((D, e)).astype(np.float32)
  bias = (0.1 * rng.standard_normal(e)).astype(np.float32)
  weights, experts = jax_route(x, w_gate, bias, k, True, n_group, topk_group)
  ref_weights, ref_experts = naive_route(x, w_gate, bias, k, n_group=n_group,
                                         topk_group=topk_group)
  weights_sorted, experts_sorted = sort_by_expert(weights, experts)
  ref_weights_sorted, ref_experts_sorted = sort_by_expert(ref_weights, ref_experts)
  np.testing.assert_array_equal(experts_sorted, ref_experts_sorted)
  np.testing.assert_allclose(weights_sorted, ref_weights_sorted, rtol=1e-5)

  choice = sigmoid(x.astype(np.float64) @ w_gate) + bias
  group_score = np.sort(choice.reshape(N, n_group, -1), -1)[..., -2:].sum(-1)
  top_groups = np.argsort(-group_score, -1)[:, :topk_group]
  for n in range(N):
    assert set(np.asarray(experts[n]) // (e // n_group)) <= set(top_groups[n]), (
        f"token {n} chose experts {experts[n]} outside its top groups {top_groups[n]}")
  _, ungrouped = jax_route(x, w_gate, bias, k)
  assert np.any(np.sort(ungrouped, -1) != experts_sorted), "group limit changed nothing"


def test_dispatch_arbitrary_assignment(data):
  """Dispatch alone, for any distinct per-token experts and weights (not only the router's)."""
  rng = np.random.default_rng(2)
  experts = np.stack([rng.permutation(E)[:X] for _ in range(N)]).astype(np.int32)
  weights = rng.standard_normal((N, X)).astype(np.float32)
  y, counts = jax_dispatch(data["x"], weights, experts, data["gate"], data["up"], data["down"])
  np.testing.assert_allclose(y, naive_experts(data["x"], weights, experts, data["gate"],
                                              data["up"], data["down"]), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(counts, np.bincount(experts.ravel(), minlength=E))


# ---------------------------------------------------------------------------------------------
# The MoE module
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_setup(helpers):
  cfg = helpers.config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=X,
                       moe_intermediate_size=F, routed_scaling_factor=SCALE, n_shared_experts=1)
  module = MoE(cfg)
  x_BLD = jnp.asarray(np.random.default_rng(3).standard_normal((1, N, D)), jnp.float32)
  params = helpers.random_tree(jax.eval_shape(lambda: module.init(jax.random.key(0), x_BLD)),
                               seed=4, std=0.3)["params"]
  return module, params, x_BLD


def test_moe_module_matches_naive(moe_setup):
  module, params, x_BLD = moe_setup
  y_BLD, aux = jax.jit(lambda p: module.apply({"params": p}, x_BLD))(params)
  x_ND = np.asarray(x_BLD[0])
  weights, experts = naive_route(x_ND, np.asarray(params["gate"]),
                                 np.asarray(params["e_score_correction_bias"]), X)
  ex = params["experts"]
  routed = naive_experts(x_ND, weights, experts, np.asarray(ex["gate_proj"]),
                         np.asarray(ex["up_proj"]), np.asarray(ex["down_proj"]))
  sh = {k: np.asarray(v, np.float64) for k, v in params["shared_experts"].items()}
  shared = (silu(x_ND @ sh["gate_proj"]) * (x_ND @ sh["up_proj"])) @ sh["down_proj"]
  np.testing.assert_allclose(y_BLD[0], routed + shared, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(aux["expert_counts"], np.bincount(experts.ravel(), minlength=E))


def test_moe_correction_bias_gets_no_gradient(moe_setup):
  module, params, x_BLD = moe_setup
  probe = jnp.asarray(np.random.default_rng(5).standard_normal(x_BLD.shape), jnp.float32)
  loss = lambda p: jnp.sum(module.apply({"params": p}, x_BLD)[0] * probe)
  grads = jax.jit(jax.grad(loss))(params)
  np.testing.assert_array_equal(grads["e_score_correction_bias"], np.zeros(E),
                                err_msg="the selection-only bias must get no gradient")
  assert np.any(grads["gate"] != 0), "router kernel gets no gradient"
  for name, g in grads["experts"].items():
    assert np.any(g != 0), f"experts.{name} gets no gradient"


# ---------------------------------------------------------------------------------------------
# Sequence-wise balance loss (DeepSeek-V3's auxiliary loss, `train.sequence_balance_weight`)
# ---------------------------------------------------------------------------------------------


def test_sequence_balance_loss_matches_naive_loop():
  """Rows with different numbers of padding tokens (which count in neither f nor P), experts
  chosen by biased top-k while P uses the unbiased scores."""
  b, l, e, k = 3, 9, 6, 2
  rng = np.random.default_rng(7)
  scores = sigmoid(rng.standard_normal((b, l, e)))
  experts = np.argsort(-(scores + 0.3 * rng.standard_normal(e)), axis=-1, kind="stable")[..., :k]
  valid = np.arange(l)[None, :] < np.array([[9], [6], [2]])
  chosen = np.zeros((b, l, e), np.float32)
  np.put_along_axis(chosen, experts, 1.0, axis=-1)
  chosen *= valid[..., None]
  got = jax.jit(sequence_balance_loss, static_argnums=3)(
      jnp.asarray(scores, jnp.float32), jnp.asarray(chosen), jnp.asarray(valid), k)
  np.testing.assert_allclose(got, naive_sequence_balance_loss(scores, experts, valid, k),
                             rtol=1e-5)


def test_sequence_balance_loss_is_one_when_balanced_and_e_over_k_when_collapsed():
  """The loss's scale: uniform scores with every expert chosen equally often give exactly 1;
  every token on the same k experts, with all its score there, gives E / k."""
  e, k, l = 4, 2, 8
  valid = jnp.ones((1, l), bool)
  uniform = jnp.full((1, l, e), 0.5, jnp.float32)
  balanced = np.zeros((1, l, e), np.float32)
  for t in range(l):
    balanced[0, t, [t % e, (t + 1) % e]] = 1.0
  np.testing.assert_allclose(sequence_balance_loss(uniform, jnp.asarray(balanced), valid, k),
                             1.0, rtol=1e-6)
  peaked = np.full((1, l, e), 1e-7, np.float32)
  peaked[..., :k] = 1.0
  collapsed = np.zeros((1, l, e), np.float32)
  collapsed[..., :k] = 1.0
  np.testing.assert_allclose(
      sequence_balance_loss(jnp.asarray(peaked), jnp.asarray(collapsed), valid, k), e / k,
      rtol=1e-5)


def test_moe_module_sequence_balance_loss_matches_naive(moe_setup):
  """The module feeds the loss its unbiased sigmoid scores, its biased top-k choice and the
  padding mask: equal to the loop on the naive router's choice."""
  module, params, x_BLD = moe_setup
  valid_BL = jnp.arange(N)[None, :] < N - 4
  _, aux = jax.jit(lambda p: module.apply({"params": p}, x_BLD, valid_BL))(params)
  x_ND = np.asarray(x_BLD[0])
  _, experts = naive_route(x_ND, np.asarray(params["gate"]),
                           np.asarray(params["e_score_correction_bias"]), X)
  scores = sigmoid(x_ND.astype(np.float64) @ np.asarray(params["gate"], np.float64))
  want = naive_sequence_balance_loss(scores[None], experts[None], np.asarray(valid_BL), X)
  np.testing.assert_allclose(aux["sequence_balance_loss"], want, rtol=1e-5)
  np.testing.assert_array_equal(aux["expert_counts"],
                                np.bincount(experts[:N - 4].ravel(), minlength=E))
