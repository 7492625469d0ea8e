"""`rl.rollout_via = "gateway"`: an asynchronous rollout worker serves its engine over the
OpenAI-compatible app, plays each episode with the calculator agent program (the `openai`
client only), and answers its orders with the TITO gateway's records (the sampled ids, their
log-probs, each token's version)."""

import jax
import numpy as np
import pytest

from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.posttrain import loop
from glm5_jax.posttrain.rl_config_checks import validate_rl_experiment
from glm5_jax.rl import orders, trajectories, worker
from glm5_jax.rl.layout import RunDirs
from glm5_jax.rl.param_sync import PolicyPublisher
from test_rl_async import small_async_config  # pylint: disable=import-error


def gateway_config(**rl):
  config = small_async_config(rollout_via="gateway", env="calculator", steps=2, **rl)
  config.rl.env_options = {"max_turns": 2}
  # The calculator prompt is 71 byte tokens: room for one reply, not for a second call (the
  # agent's retry message alone is ~60 tokens), which the server refuses: the episode ends.
  config.data.seq_len = 96
  return config


def test_rollout_via_is_checked_and_the_sync_loop_refuses_the_gateway(tmp_path):
  for value, env, match in (("http", "calculator", "must be one of"),
                            ("gateway", "addition", "only the environments")):
    config = gateway_config()
    config.rl.update(rollout_via=value, env=env)
    with pytest.raises(ConfigError, match=f"rl.rollout_via.*{match}"):
      validate_rl_experiment(config)
  with pytest.raises(ConfigError, match="rl.rollout_via.*synchronous"):
    loop.rl_train(gateway_config(), str(tmp_path))


def test_a_gateway_worker_answers_orders_with_the_tokens_its_engine_sampled(tmp_path, helpers):
  config = gateway_config()
  model = ModelConfig.from_config(config.model)
  params = helpers.random_params(model, seed=0)
  dirs = RunDirs.at(tmp_path)
  publisher = PolicyPublisher(dirs.policy, keep=1, async_save=False)
  publisher.publish(3, params, block=True)
  publisher.close()
  g = config.rl.group_size
  for i in range(2):
    orders.write_order(tmp_path, orders.Order(i, "w0", task=i, group_size=g, issued_version=3))
  stats = worker.run_worker(config, str(tmp_path), "w0", max_batches=1)
  files = sorted(orders.answered(tmp_path))
  assert len(files) == 2 and stats["batches"] == 1 and stats["versions_loaded"] == [3]
  records = [r for name in files for r in trajectories.read_batch(dirs.rollouts / name).records]
  assert [r.meta["task"] for r in records] == [0] * g + [1] * g
  gateway = stats["gateway"]
  # Every token the server's engine sampled is in a sample and nothing else is trained: the
  # samples are the gateway's records, never the agent's text re-tokenized.
  assert sum(int(r.loss_mask.sum()) for r in records) == gateway["tokens_generated"] > 0
  assert gateway["aborted"] == 0 and gateway["calls"] == sum(r.meta["turns"] for r in records)
  # The tiny model answers garbage, the agent asks again, and that call does not fit: the
  # episode ends there (0 reward, `truncated`), as the engine path ends one at seq_len.
  assert all(r.meta["turns"] == 1 and r.meta["truncated"] and r.reward == 0 for r in records)
  # Their log-probs are the policy's for exactly these tokens (one full forward).
  tokens = np.zeros((len(records), config.data.seq_len), np.int32)
  for i, r in enumerate(records):
    assert r.meta["agent"] and len(r.tokens) <= config.data.seq_len
    tokens[i, :len(r.tokens)] = r.tokens
  logits = helpers.forward(model, params, tokens, mtp=False)["logits"]
  logp = np.asarray(jax.nn.log_softmax(logits.astype(np.float32), -1))
  for i, r in enumerate(records):
    generated = r.loss_mask > 0
    assert (r.versions[generated] == 3).all() and (r.versions[~generated] == -1).all()
    assert not generated[0]
    want = np.take_along_axis(logp[i, :len(r.tokens) - 1], r.tokens[1:, None], -1)[:, 0]
    np.testing.assert_allclose(r.logp[1:][generated[1:]], want[generated[1:]], atol=2e-4)
