"""Routing replay (glm5_jax/routing_replay.py): the engine records each token's MoE experts and
DSA keys, the trainer replays them and scores the rollout exactly as the engine did."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import traverse_util

import glm5_jax
from glm5_jax.config import ConfigError
from glm5_jax.infer.engine import Engine
from glm5_jax.infer.requests import Request
from glm5_jax.moe import MoE
from glm5_jax.posttrain import rl_step, rollout
from glm5_jax.posttrain.config import rl_config, validate_rl_config
from glm5_jax.rl import trajectories as tj
from glm5_jax.train import losses

MAX_LEN = 40


def _shift_selection_params(params, seed=7, scale=0.1):
  """`params` with the router correction biases and the DSA indexers' projections moved:
  exactly the params that steer selection only (the bias is never a gate weight, the indexer
  only ranks keys), as the balancing update and a changed indexer move them between a rollout
  and its training step. Everything else is untouched, so a replayed forward must give the
  same numbers as before the move."""
  flat = traverse_util.flatten_dict(params)
  rng = np.random.default_rng(seed)
  out = {}
  for path, x in flat.items():
    if "e_score_correction_bias" in path or ("indexer" in path and path[-1] in ("wk", "wq_b")):
      x = x + scale * jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    out[path] = x
  return traverse_util.unflatten_dict(out)


def _rollouts(cfg, params):
  """Four sampled completions (two share a prompt, so one is a prefix-shared copy) recorded
  by the engine, prefill in chunks of 8 (prompts span several chunks)."""
  rng = np.random.default_rng(0)
  prompts = [tuple(int(t) for t in rng.integers(0, cfg.vocab_size, n)) for n in (5, 11, 11, 19)]
  requests = [Request(index=i, prompt=p, max_new_tokens=14, temperature=1.0, top_p=1.0, top_k=0,
                      seed=100 + i, stop_tokens=()) for i, p in enumerate(prompts)]
  engine = Engine(cfg, params, slots=4, max_len=MAX_LEN, prefill_chunk=8, record_routing=True)
  done = engine.run(requests)
  return [rollout.Sample(task=None, group=0, tokens=np.asarray(c.sequence, np.int32),
                         rollout_logp=np.asarray([0.0] * len(c.request.prompt) + c.raw_logprobs,
                                                 np.float32),
                         loss_mask=np.asarray([0.0] * len(c.request.prompt) + [1.0] * len(
                             c.tokens), np.float32),
                         reward=0.0, correct=False, turns=1, messages=[], info={},
                         routing=c.routing) for c in done]


@functools.partial(jax.jit, static_argnames="cfg")
def _scored(cfg, params, batch):
  """Log-probs `[B, L]` and the routing the forward used."""
  out = glm5_jax.forward(cfg, params, batch["tokens"], batch["positions"], batch["segment_ids"],
                         mtp=False, routing=rl_step.batch_routing(batch), return_routing=True)
  return losses.token_logprobs(out["logits"], batch["tokens"])[0], out["routing"]


@pytest.mark.parametrize("dsa_impl,scan_layers", [("dense_mask", True), ("xla", False)])
def test_replay_reproduces_engine_logprobs(helpers, dsa_impl, scan_layers):
  cfg = helpers.config(dsa_impl=dsa_impl, scan_layers=scan_layers)
  params = helpers.random_params(cfg)
  samples = _rollouts(cfg, params)
  for s in samples:
    n = len(s.tokens)
    assert {k: v.shape for k, v in s.routing.items()} == {
        "moe": (n, 3, cfg.num_experts_per_tok), "dsa": (n, 4, cfg.index_topk)}
    assert (s.routing["moe"][-1] == -1).all() and (s.routing["moe"][:-1] >= 0).all()
  batch = rollout.to_batch(samples, MAX_LEN)
  rl_step.check_rl_batch(batch, vocab_size=cfg.vocab_size)
  mask = batch["loss_mask"] > 0
  fed = (batch["routing_moe"][:, :, 0, 0] >= 0)
  moved = _shift_selection_params(params)
  no_replay = {k: v for k, v in batch.items() if not k.startswith("routing_")}

  # Same params, no replay: the trainer routes as the engine did (fp32, fp32 cache).
  logp, used = _scored(cfg, params, no_replay)
  np.testing.assert_allclose(np.asarray(logp)[mask], batch["rollout_logp"][mask], atol=1e-5)
  for kind in ("moe", "dsa"):
    np.testing.assert_array_equal(np.asarray(used[kind])[fed], batch[f"routing_{kind}"][fed])

  # Selection params moved after the rollout: replay gives the engine's log-probs ...
  logp, used = _scored(cfg, moved, batch)
  np.testing.assert_allclose(np.asarray(logp)[mask], batch["rollout_logp"][mask], atol=1e-5)
  np.testing.assert_array_equal(np.asarray(used["moe"])[fed], batch["routing_moe"][fed])
  np.testing.assert_array_equal(np.asarray(used["dsa"])[fed], batch["routing_dsa"][fed])
  # ... and the jitted RL step's path (policy_logprobs reads the batch's routing) agrees.
  policy = jax.jit(functools.partial(rl_step.policy_logprobs, cfg))(moved, batch)
  np.testing.assert_allclose(np.asarray(policy)[mask], batch["rollout_logp"][mask], atol=1e-5)

  # Without replay the moved params route differently and the log-probs drift far past it.
  logp, used = _scored(cfg, moved, no_replay)
  gap = np.abs(np.asarray(logp) - batch["rollout_logp"])[mask]
  assert gap.max() > 1e-2, gap.max()
  for kind in ("moe", "dsa"):
    differs = ~(np.sort(np.asarray(used[kind]), -1) == np.sort(batch[f"routing_{kind}"], -1)
                ).all(-1)
    assert differs[fed].mean() > 0.05, (kind, differs[fed].mean())


def test_replayed_gates_keep_the_router_gradient(helpers):
  """Under replay the gate weights are the current router scores at the recorded experts:
  the router's gradient is the one of a forward that chose those experts itself."""
  cfg = helpers.config()
  module = MoE(cfg)
  x_BLD = jnp.asarray(np.random.default_rng(1).standard_normal((2, 12, cfg.hidden_size)),
                      jnp.float32)
  params = helpers.random_tree(jax.eval_shape(lambda: module.init(jax.random.key(0), x_BLD)),
                               seed=2, std=0.3)["params"]

  @jax.jit
  def run(p, recorded):
    def loss(p):
      y_BLD, aux = module.apply({"params": p}, x_BLD, None, recorded)
      return jnp.sin(y_BLD).sum(), aux["experts"]
    return jax.grad(loss, has_aux=True)(p)

  own_grads, own = run(params, None)
  grads, used = run(params, own)
  np.testing.assert_array_equal(used, own)
  gate = grads["gate"]
  assert float(jnp.abs(gate).sum()) > 0
  np.testing.assert_allclose(gate, own_grads["gate"], rtol=1e-5, atol=1e-7)
  # Replaying other experts uses them, and the router's gradient follows (-1 rows: its own).
  other = ((own + 1) % cfg.n_routed_experts).at[0, :3].set(-1)
  moved_grads, used = run(params, other)
  np.testing.assert_array_equal(used[0, :3], own[0, :3])
  np.testing.assert_array_equal(used[0, 3:], other[0, 3:])
  assert float(jnp.abs(moved_grads["gate"] - gate).max()) > 1e-4


def test_routing_checks_name_the_entry(helpers):
  cfg = helpers.config()
  params = helpers.random_params(cfg)
  tokens = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match=r"routing\['moe'\]: shape"):
    glm5_jax.forward(cfg, params, tokens, routing={"moe": jnp.zeros((1, 8, 2, 2), jnp.int32)})
  with pytest.raises(ValueError, match="unknown keys"):
    glm5_jax.forward(cfg, params, tokens, routing={"experts": jnp.zeros((1, 8, 3, 2), jnp.int32)})


def test_multi_turn_keeps_earlier_rows():
  old = {"moe": np.array([[[1, 2]], [[3, 4]], [[-1, -1]]], np.int32)}  # last token unfed
  new = {"moe": np.array([[[5, 6]], [[5, 6]], [[7, 0]], [[0, 1]], [[-1, -1]]], np.int32)}
  merged = rollout.merge_routing(old, new)["moe"][:, 0]
  np.testing.assert_array_equal(merged, [[1, 2], [3, 4], [7, 0], [0, 1], [-1, -1]])


def test_trajectory_files_round_trip_routing(tmp_path):
  rng = np.random.default_rng(0)

  def record(n, routing=True):
    return tj.TrajectoryRecord(
        tokens=rng.integers(0, 100, n).astype(np.int32), logp=np.zeros(n, np.float32),
        loss_mask=np.ones(n, np.float32), versions=np.zeros(n, np.int32), reward=1.0,
        routing={"moe": rng.integers(-1, 8, (n, 3, 2)).astype(np.int32),
                 "dsa": rng.integers(-1, 40, (n, 4, 16)).astype(np.int32)} if routing else None)

  records = [record(5), record(9), record(0)]
  batch = tj.read_batch(tj.write_batch(tmp_path, records, worker="w", batch_index=0))
  for a, b in zip(records, batch.records):
    assert set(b.routing) == {"moe", "dsa"}
    for kind in a.routing:
      assert b.routing[kind].dtype == np.int32
      np.testing.assert_array_equal(a.routing[kind], b.routing[kind])
  # Files without routing (every file before it existed) read as routing None.
  plain = tj.read_batch(tj.write_batch(tmp_path, [record(4, routing=False)], worker="w",
                                       batch_index=1))
  assert plain.records[0].routing is None
  with pytest.raises(ValueError, match="have no routing while others do"):
    tj.write_batch(tmp_path, [record(3), record(3, routing=False)], worker="w", batch_index=2)
  short = record(4)
  short.routing["moe"] = short.routing["moe"][:3]
  with pytest.raises(ValueError, match=r"routing\['moe'\] has shape"):
    tj.write_batch(tmp_path, [short], worker="w", batch_index=2)


def test_recording_refuses_speculative_decoding(helpers):
  cfg = helpers.config()
  with pytest.raises(ValueError, match="record_routing=True .* speculative_steps=2"):
    Engine(cfg, helpers.random_params(cfg), slots=2, max_len=16, speculative_steps=2,
           record_routing=True)


def test_rl_config_field_is_validated():
  assert rl_config().routing_replay is False
  validate_rl_config(rl_config(routing_replay=True))
  with pytest.raises(ConfigError, match="rl.routing_replay"):
    validate_rl_config(ml_collections.ConfigDict({**rl_config().to_dict(), "routing_replay": "on"}))
