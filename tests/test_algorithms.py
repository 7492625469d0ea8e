"""Every policy loss and advantage (glm5_jax.posttrain.algorithms): GRPO advantages (population
and Bessel std), the clipped policy loss with IcePop (weighted as published, or mask-only), the
asynchronous IS loss, token and sample normalization, distillation advantages, against values
computed by hand in each test."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.config import ConfigError
from glm5_jax.posttrain import algorithms as grpo
from glm5_jax.posttrain.config import rl_config, validate_rl_config

LOG2 = np.float32(math.log(2.0))  # IcePop's bound for beta = 2, as float32 rounds it
ABOVE_LOG2 = np.nextafter(LOG2, np.float32(np.inf))

# Three groups of sizes 3, 2, 3 interleaved, plus a group of one:
#   group 7: rewards 1, 0.5, 0 -> mean 0.5, deviations +0.5, 0, -0.5,
#            population variance (0.25 + 0 + 0.25) / 3 = 1/6, so +-0.5 / sqrt(1/6) = +-sqrt(1.5)
#   group 3: rewards 0, 1     -> mean 0.5, deviations -0.5, +0.5, std 0.5 -> -1, +1
#   group 9: rewards 0.3 x 3  -> all equal: 0 exactly (0.3 * 3 / 3 is not 0.3 in floats)
#   group 5: reward 0.7 alone -> 0
REWARDS = [1.0, 0.0, 0.5, 0.3, 1.0, 0.0, 0.3, 0.3, 0.7]
GROUPS = [7, 3, 7, 9, 3, 7, 9, 9, 5]


def test_group_advantages_without_std():
  got = grpo.group_advantages(REWARDS, GROUPS, normalize_std=False)
  np.testing.assert_allclose(got, [0.5, -0.5, 0.0, 0.0, 0.5, -0.5, 0.0, 0.0, 0.0], atol=1e-7)
  assert got.dtype == jnp.float32


def test_group_advantages_with_population_std():
  s = math.sqrt(1.5)
  got = grpo.group_advantages(REWARDS, GROUPS, normalize_std=True)
  np.testing.assert_allclose(got, [s, -1.0, 0.0, 0.0, 1.0, -s, 0.0, 0.0, 0.0], rtol=1e-5)
  # A normalized group has root-mean-square 1 (population std), whatever its size.
  np.testing.assert_allclose(np.sqrt(np.mean(np.square(np.asarray(got)[[0, 2, 5]]))), 1.0,
                             rtol=1e-5)


@pytest.mark.parametrize("normalize_std", [False, True])
def test_group_advantages_constant_group_is_exactly_zero(normalize_std):
  got = np.asarray(grpo.group_advantages(REWARDS, GROUPS, normalize_std=normalize_std))
  assert np.all(np.isfinite(got))
  assert (got[[3, 6, 7, 8]] == 0.0).all()  # all-equal group and the singleton, not ~1e-8
  constant = grpo.group_advantages([0.1, 0.1, 0.1], [0, 0, 0], normalize_std=normalize_std)
  assert (np.asarray(constant) == 0.0).all()


def test_group_advantages_rejects_mismatched_shapes():
  with pytest.raises(ValueError, match="group_ids_N"):
    grpo.group_advantages([1.0, 0.0], [0, 0, 1], normalize_std=True)


def _loss_and_grad(logp, old_logp, rollout_logp, advantages, mask=None, **kwargs):
  """(loss, metrics, d loss / d logp) for one row of tokens."""
  row = lambda x: jnp.asarray([x], jnp.float32)
  mask = np.ones(len(logp)) if mask is None else mask
  fn = lambda lp: grpo.ppo_policy_loss(lp, row(old_logp), row(rollout_logp), row(advantages),
                                   row(mask), **kwargs)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(row(logp))
  return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad[0])


def test_clipping_both_sides_both_signs():
  # token: (ratio r, advantage A) -> token loss -min(rA, clip(r, 0.8, 1.28) A), d/dlogp
  #   (1.5,  1): above 1 + eps_high, A > 0: clipped   -> -1.28, grad 0     (clip high)
  #   (0.5,  1): below, A > 0: PPO leaves it           -> -0.5,  grad -0.5
  #   (0.5, -1): below 1 - eps_low, A < 0: clipped     ->  0.8,  grad 0     (clip low)
  #   (1.5, -1): above, A < 0: PPO leaves it           ->  1.5,  grad +1.5
  #   (1.1,  2): inside the range                      -> -2.2,  grad -2.2
  # loss = (-1.28 - 0.5 + 0.8 + 1.5 - 2.2) / 5 tokens = -0.336; d loss / d logp_t = grad_t / 5
  ratios = np.array([1.5, 0.5, 0.5, 1.5, 1.1])
  old = np.full(5, -1.0)
  loss, metrics, grad = _loss_and_grad(old + np.log(ratios), old, old, [1, 1, -1, -1, 2])
  np.testing.assert_allclose(loss, -0.336, rtol=1e-5)
  np.testing.assert_allclose(grad, np.array([0.0, -0.5, 0.0, 1.5, -2.2]) / 5, rtol=1e-5,
                             atol=1e-7)
  assert grad[0] == 0.0 and grad[2] == 0.0  # the clipped branch is a constant
  assert metrics["clip_high_fraction"] == pytest.approx(0.2)
  assert metrics["clip_low_fraction"] == pytest.approx(0.2)
  assert metrics["icepop_masked_fraction"] == 0.0
  assert metrics["ratio_mean"] == pytest.approx(5.1 / 5, rel=1e-5)
  assert metrics["loss_tokens"] == 5.0


def test_clip_range_is_asymmetric():
  # r = 1.25 lies inside [0.8, 1.28] (eps_high 0.28) but outside a symmetric [0.8, 1.2].
  old = np.full(1, -1.0)
  logp = old + np.log(1.25)
  _, metrics, grad = _loss_and_grad(logp, old, old, [1.0])
  assert metrics["clip_high_fraction"] == 0.0 and grad[0] != 0.0
  _, metrics, grad = _loss_and_grad(logp, old, old, [1.0], eps_high=0.2)
  assert metrics["clip_high_fraction"] == 1.0 and grad[0] == 0.0


@pytest.mark.parametrize("icepop, kept_weights", [("mask", [1.0, 1.0, 1.0]),
                                                  ("weight", [2.0, 0.5, 1.0])])
def test_icepop_boundary_is_inclusive(icepop, kept_weights):
  # k = exp(old - rollout): exactly beta and 1/beta are kept, the next float out is masked.
  #   t0: log k = +log 2 (kept, k = 2)   t1: log k = -log 2 (kept, k = 0.5)
  #   t2: log k just above log 2 (masked)   t3: just below -log 2 (masked)   t4: k = 1 (kept)
  # r = 1, A = 1: a kept token's loss is -c (c = 1 masking, c = k weighting), divided by the
  # ORIGINAL 5 tokens: mask -3 / 5; weight -(2 + 0.5 + 1) / 5 = -0.7.
  old = np.array([0.0, -LOG2, 0.0, -ABOVE_LOG2, -1.0], np.float32)
  rollout = np.array([-LOG2, 0.0, -ABOVE_LOG2, 0.0, -1.0], np.float32)
  loss, metrics, grad = _loss_and_grad(old, old, rollout, np.ones(5), icepop=icepop)
  w0, w1, w4 = kept_weights
  assert loss == pytest.approx(-(w0 + w1 + w4) / 5)
  np.testing.assert_allclose(grad, np.array([-w0, -w1, 0.0, 0.0, -w4]) / 5, rtol=1e-6)
  assert grad[2] == grad[3] == 0.0
  assert metrics["icepop_masked_fraction"] == pytest.approx(0.4)
  assert metrics["clip_low_fraction"] == metrics["clip_high_fraction"] == 0.0


def test_icepop_weights_a_kept_token_by_k_as_published():
  # One token, A = 1, old = logp (r = 1), rollout such that k = pi_old / pi_rollout = 1.5:
  # published IcePop (slime's `pg_loss * where(in band, exp(old - rollout), 0)`) gives loss
  # -1.5 and d loss / d logp = -1.5; mask-only gives -1.0. k is a constant: no gradient to
  # the rollout or old log-probs.
  logp = np.float32([-1.0])
  rollout = logp - np.float32(math.log(1.5))
  loss, _, grad = _loss_and_grad(logp, logp, rollout, [1.0])
  assert loss == pytest.approx(-1.5, rel=1e-6) and grad[0] == pytest.approx(-1.5, rel=1e-6)
  loss, _, grad = _loss_and_grad(logp, logp, rollout, [1.0], icepop="mask")
  assert loss == pytest.approx(-1.0) and grad[0] == pytest.approx(-1.0)
  row = lambda x: jnp.asarray([x], jnp.float32)
  grads = jax.grad(lambda old, ro: grpo.ppo_policy_loss(row(logp), old, ro, row([1.0]),
                                                        row([1.0]))[0], argnums=(0, 1))(
      row(logp), row(rollout))
  assert float(jnp.abs(grads[0]).sum()) == 0.0 and float(jnp.abs(grads[1]).sum()) == 0.0


def test_icepop_weight_multiplies_the_clipped_branch_too():
  # k = 1.5 and r = 1.5 > 1 + eps_high with A = 1: the clipped branch 1.28 * A is taken, times
  # k: loss -1.28 * 1.5 = -1.92, gradient 0 (the clipped branch is a constant).
  old = np.float32([-1.0])
  rollout = old - np.float32(math.log(1.5))
  loss, metrics, grad = _loss_and_grad(old + np.float32(math.log(1.5)), old, rollout, [1.0])
  assert loss == pytest.approx(-1.92, rel=1e-5) and grad[0] == 0.0
  assert metrics["clip_high_fraction"] == 1.0


def test_icepop_mode_is_checked():
  with pytest.raises(ValueError, match="icepop must be one of"):
    _loss_and_grad([0.0], [0.0], [0.0], [1.0], icepop="clip")


def test_icepop_masked_token_has_exactly_zero_gradient_even_if_its_ratio_overflows():
  # Token 0: old_logp - rollout_logp = -200 (masked) and logp - old_logp = 200 (exp overflows
  # float32); a multiply-by-zero mask would give a NaN gradient here.
  logp = np.array([0.0, -1.0], np.float32)
  old = np.array([-200.0, -1.0], np.float32)
  rollout = np.array([0.0, -1.0], np.float32)
  loss, metrics, grad = _loss_and_grad(logp, old, rollout, [3.0, 1.0])
  assert grad[0] == 0.0 and grad[1] == pytest.approx(-0.5)
  assert loss == pytest.approx(-0.5)
  assert all(math.isfinite(v) for v in metrics.values())


def test_masking_a_token_does_not_reweight_the_others():
  # The denominator is the loss-token count before IcePop: masking token 2 leaves every other
  # token's gradient exactly as it was.
  logp = np.array([-1.0, -2.0, -0.5, -3.0], np.float32)
  advantages = [1.0, -0.5, 2.0, 0.25]
  _, _, grad_all = _loss_and_grad(logp, logp, logp, advantages)
  rollout = logp.copy()
  rollout[2] = logp[2] - 1.0  # k = e > 2: masked
  _, metrics, grad_masked = _loss_and_grad(logp, logp, rollout, advantages)
  assert metrics["icepop_masked_fraction"] == 0.25 and metrics["loss_tokens"] == 4.0
  assert grad_masked[2] == 0.0
  np.testing.assert_array_equal(grad_masked[[0, 1, 3]], grad_all[[0, 1, 3]])
  np.testing.assert_allclose(grad_all, -np.array(advantages) / 4, rtol=1e-6)


def test_loss_mask_excludes_tokens_from_loss_metrics_and_denominator():
  logp = np.array([-1.0, -2.0, -0.5], np.float32)
  rollout = np.array([-1.0, -5.0, -0.5], np.float32)  # token 1 would be masked, but is no loss
  loss, metrics, grad = _loss_and_grad(logp, logp, rollout, [1.0, 7.0, 3.0], mask=[1, 0, 1])
  assert loss == pytest.approx(-2.0)  # (-1 - 3) / 2
  assert grad[1] == 0.0
  assert metrics["loss_tokens"] == 2.0 and metrics["icepop_masked_fraction"] == 0.0
  assert metrics["logp_mismatch_max"] == 0.0


def test_rollout_equal_to_trainer_gives_ratio_one_nothing_clipped_or_masked():
  rng = np.random.default_rng(0)
  logp_BL = jnp.asarray(np.log(rng.uniform(1e-4, 1.0, (3, 7))), jnp.float32)
  advantages_BL = jnp.asarray(rng.normal(size=(3, 7)) * 5, jnp.float32)
  mask_BL = jnp.asarray(rng.uniform(size=(3, 7)) < 0.7, jnp.float32)

  def loss_fn(lp):
    return grpo.ppo_policy_loss(lp, jax.lax.stop_gradient(lp), logp_BL, advantages_BL, mask_BL)

  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp_BL)
  assert metrics["ratio_mean"] == 1.0
  assert metrics["clip_low_fraction"] == metrics["clip_high_fraction"] == 0.0
  assert metrics["icepop_masked_fraction"] == 0.0
  assert metrics["logp_mismatch_mean"] == metrics["logp_mismatch_max"] == 0.0
  count = float(mask_BL.sum())
  np.testing.assert_allclose(loss, -float((advantages_BL * mask_BL).sum()) / count, rtol=1e-5)
  np.testing.assert_allclose(grad, -advantages_BL * mask_BL / count, rtol=1e-6)


def test_mismatch_metrics():
  logp = np.array([-1.0, -2.0, -0.5], np.float32)
  rollout = np.array([-1.25, -2.0, 0.0], np.float32)
  _, metrics, _ = _loss_and_grad(logp, logp, rollout, [1.0, 1.0, 1.0])
  assert metrics["logp_mismatch_mean"] == pytest.approx(0.75 / 3)
  assert metrics["logp_mismatch_max"] == pytest.approx(0.5)


def test_policy_loss_rejects_mismatched_shapes():
  with pytest.raises(ValueError, match="advantages_BL"):
    grpo.ppo_policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2, 1)),
                     jnp.ones((2, 3)))


def test_distill_advantage_sign_and_no_gradient():
  teacher = jnp.asarray([[-0.1, -3.0]], jnp.float32)
  student = jnp.asarray([[-2.0, -0.5]], jnp.float32)
  got = grpo.distill_advantages(teacher, student)
  # Teacher more confident in the sampled token than the student -> positive, and vice versa.
  np.testing.assert_allclose(got, [[1.9, -2.5]], rtol=1e-6)
  grads = jax.grad(lambda t, s: grpo.distill_advantages(t, s).sum(), argnums=(0, 1))(
      teacher, student)
  assert all((np.asarray(g) == 0).all() for g in grads)


def test_is_mask_boundaries():
  high = np.float32(math.log1p(0.28))
  low = np.float32(math.log1p(-0.2))
  up = lambda x: np.nextafter(x, np.float32(np.inf))
  down = lambda x: np.nextafter(x, np.float32(-np.inf))
  delta = np.array([[high, up(high), low, down(low), 0.0, 50.0, -50.0]], np.float32)
  keep = grpo.is_token_mask(delta, np.zeros_like(delta), eps_low=0.2, eps_high=0.28)
  assert keep.tolist() == [[True, False, True, False, True, False, False]]
  # eps_low = 1: no lower bound (r >= 0 always).
  assert bool(grpo.is_token_mask(np.float32([-1e4]), np.float32([0.0]), eps_low=1.0,
                               eps_high=0.0)[0])
  with pytest.raises(ValueError, match="eps_low=1.5"):
    grpo.is_token_mask(delta, delta, eps_low=1.5, eps_high=0.2)


def test_is_policy_loss_gradient_zero_outside_the_band():
  rollout = np.float32([[-1.0, -2.0, -0.5, -3.0, -1.0]])
  delta = np.float32([[0.1, -0.1, 0.4, 80.0, -0.5]])  # r: in, in, above, overflow-size, below
  logp = rollout + delta
  advantages = np.float32([[1.0, -2.0, 1.0, 1.0, 1.0]])
  mask = np.float32([[1, 1, 1, 1, 1]])
  grad_fn = jax.grad(lambda lp: grpo.is_policy_loss(lp, rollout, advantages, mask)[0])
  grad = np.asarray(grad_fn(jnp.asarray(logp)))
  r = np.exp(logp - rollout)
  expected = np.where([[1, 1, 0, 0, 0]], -r * advantages / 5.0, 0.0)
  np.testing.assert_allclose(grad, expected, rtol=1e-6)
  assert np.all(np.isfinite(grad))
  loss, metrics = grpo.is_policy_loss(logp, rollout, advantages, mask)
  np.testing.assert_allclose(loss, -(r[0, 0] * 1.0 + r[0, 1] * -2.0) / 5.0, rtol=1e-6)
  assert float(metrics["is_masked_fraction"]) == pytest.approx(0.6)
  assert float(metrics["loss_tokens"]) == 5.0
  # Tokens off the loss mask count nowhere, even inside the band.
  loss_masked, _ = grpo.is_policy_loss(logp, rollout, advantages, mask * [[1, 0, 1, 1, 1]])
  np.testing.assert_allclose(loss_masked, -r[0, 0] / 4.0, rtol=1e-6)


def test_sample_normalization_weights_each_sample_equally():
  # Row 0: 1 loss token; row 1: 3 loss tokens; row 2: none (not a sample of the loss). A = 1,
  # r = k = 1, so a token's loss is -1 times its weight:
  #   token:  w = 1 / 4 everywhere                  loss -1, grads -1/4
  #   sample: row 0 w = 1 / (1 * 2), row 1 w = 1 / (3 * 2)   loss -(1 + 1) / 2 = -1
  mask = np.float32([[0, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]])
  logp = jnp.asarray(np.full(mask.shape, -1.0, np.float32))
  adv = jnp.ones(mask.shape)

  def grads(normalization, loss_fn):
    return jax.value_and_grad(lambda lp: loss_fn(lp, normalization)[0])(logp)

  for name, loss_fn in [
      ("ppo", lambda lp, n: grpo.ppo_policy_loss(lp, lp, logp, adv, mask, normalization=n)),
      ("is", lambda lp, n: grpo.is_policy_loss(lp, logp, adv, mask, normalization=n))]:
    loss, grad = grads("token", loss_fn)
    assert float(loss) == pytest.approx(-1.0), name
    np.testing.assert_allclose(grad, -mask / 4, rtol=1e-6)
    loss, grad = grads("sample", loss_fn)
    assert float(loss) == pytest.approx(-1.0), name
    np.testing.assert_allclose(grad, -np.float32([[0, 1 / 2, 0, 0], [0, 1 / 6, 1 / 6, 1 / 6],
                                                  [0, 0, 0, 0]]), rtol=1e-6)
  # Microbatches of whole rows add up to the batch when they pass its denominators.
  whole = grpo.batch_denominators(mask)
  assert float(whole["tokens"]) == 4.0 and float(whole["samples"]) == 2.0
  parts = [grpo.ppo_policy_loss(logp[rows], logp[rows], logp[rows], adv[rows], mask[rows],
                                normalization="sample", denominators=whole)[0]
           for rows in (np.array([0]), np.array([1, 2]))]
  assert float(sum(parts)) == pytest.approx(-1.0)
  with pytest.raises(ValueError, match="normalization must be one of"):
    grpo.loss_weights(mask, normalization="sequence")


def test_group_advantages_with_bessel_std():
  # group 7: deviations +0.5, 0, -0.5; Bessel variance 0.5 / (3 - 1) = 0.25, std 0.5 -> +-1.
  # group 3: deviations -0.5, +0.5; Bessel variance 0.5 / 1, std sqrt(0.5) -> -+sqrt(0.5).
  # groups 9 (constant) and 5 (one sample: no Bessel std) -> 0.
  got = grpo.group_advantages(REWARDS, GROUPS, normalize_std=True, std="bessel", eps=0.0)
  h = math.sqrt(0.5)
  np.testing.assert_allclose(got, [1.0, -h, 0.0, 0.0, h, -1.0, 0.0, 0.0, 0.0], rtol=1e-6)
  with pytest.raises(ValueError, match="std must be one of"):
    grpo.group_advantages(REWARDS, GROUPS, normalize_std=True, std="sample")


@pytest.mark.parametrize("field, value", [("icepop", "clip"), ("loss_normalization", "seq"),
                                          ("group_std", "unbiased")])
def test_rl_config_rejects_unknown_options(field, value):
  validate_rl_config(rl_config(icepop="mask", loss_normalization="sample", group_std="bessel"))
  with pytest.raises(ConfigError, match=f"config.rl.{field}"):
    validate_rl_config(rl_config(**{field: value}))


def test_registries_name_every_loss_and_advantage():
  assert grpo.POLICY_LOSSES == {"ppo": grpo.ppo_policy_loss, "is": grpo.is_policy_loss}
  assert grpo.ADVANTAGES == {"grpo": grpo.group_advantages, "distill": grpo.distill_advantages}
