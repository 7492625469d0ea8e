"""Long-tail hand-off (glm5_jax/posttrain/handoff.py, glm5_jax/rl/long_tail.py): the rule, a
turn played step by step with due groups cancelled (a fake engine), the worker split and its
config checks, hand-off files and what the orders, the orchestrator and a restarted worker make
of them; a worker's engine warm-up; and (slow) a trainer with a regular and a long-tail worker
in threads: groups are handed off, continued, and every rollout file is trained on exactly once.
"""

import dataclasses
import threading

import numpy as np
import pytest

from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.data import make_tokenizer
from glm5_jax.infer.compile_count import count_compiles
from glm5_jax.posttrain import envs, handoff, rollout, tasks
from glm5_jax.posttrain.config import long_tail_config, rl_config, validate_rl_config
from glm5_jax.rl import async_trainer, long_tail, orders, trajectories, worker
from glm5_jax.rl.layout import RunDirs, read_json
from glm5_jax.rl.orchestrator import Orchestrator
from test_rl_async import _check_exactly_once, small_async_config  # pylint: disable=import-error


def test_rule():
  rule = handoff.HandOffRule(after_tokens=5)
  assert not rule.due(4, 1e9) and rule.due(5, 0.0)
  timed = handoff.HandOffRule(after_seconds=2.0)
  assert not timed.due(10**6, 1.9) and timed.due(0, 2.0)
  assert not handoff.HandOffRule().due(10**6, 1e9)
  with pytest.raises(ValueError, match="after_tokens=-1"):
    handoff.HandOffRule(after_tokens=-1)


@dataclasses.dataclass
class _Done:
  tokens: list
  raw_logprobs: list


class _FakeEngine:
  """One token per step for every running request (2 slots, FIFO); request i ends after
  `lengths[i]` tokens. Token ids are 100 * request index + position."""

  def __init__(self, lengths, slots=2):
    self.lengths, self.slots = lengths, slots
    self.queue, self.running, self.cancelled, self.next = [], {}, [], 0

  @property
  def busy(self):
    return bool(self.queue or self.running)

  def submit(self, request):
    handle, self.next = self.next, self.next + 1
    self.queue.append((handle, request.index))
    return handle

  def cancel(self, handle):
    self.cancelled.append(handle)
    self.queue = [q for q in self.queue if q[0] != handle]
    return self.running.pop(handle, None) is not None

  def step(self):
    while self.queue and len(self.running) < self.slots:
      handle, index = self.queue.pop(0)
      self.running[handle] = (index, [])
    events = []
    for handle, (index, tokens) in sorted(self.running.items()):
      tokens.append(100 * index + len(tokens))
      done = len(tokens) >= self.lengths[index]
      events.append(type("E", (), dict(handle=handle, tokens=[tokens[-1]], raw_logprobs=[-1.0],
                                        completion=_Done(list(tokens), [-1.0] * len(tokens))
                                        if done else None)))
    for handle in [h for h, (i, t) in self.running.items() if len(t) >= self.lengths[i]]:
      del self.running[handle]
    return events


def _requests(n):
  return [type("R", (), {"index": k})() for k in range(n)]


def test_run_turn_cancels_due_groups_and_keeps_their_tokens():
  # Groups: 0 = requests 0, 1 (lengths 2, 9); 1 = requests 2, 3 (lengths 3, 2). 2 slots.
  lengths = [2, 9, 3, 2]
  engine = _FakeEngine(lengths)
  out = handoff.run_turn(engine, _requests(4), [0, 0, 1, 1], [0, 1, 0, 0],
                         handoff.HandOffRule(after_tokens=5), started=0.0, clock=lambda: 0.0)
  # Request 1 reaches 1 + 4 = 5 tokens at step 4: group 0 handed off; its request 0 had ended.
  assert out.handed == {0}
  assert sorted(out.completions) == [0, 2, 3] and out.partial == {1: ([100, 101, 102, 103],
                                                                      [-1.0] * 4)}
  assert not engine.busy and engine.cancelled == [1]
  # A rule that never fires: every request completes, as with Engine.run.
  out = handoff.run_turn(_FakeEngine(lengths), _requests(4), [0, 0, 1, 1], [0] * 4,
                         handoff.HandOffRule(after_tokens=100), started=0.0)
  assert sorted(out.completions) == [0, 1, 2, 3] and not out.partial and not out.handed
  assert [len(out.completions[k].tokens) for k in range(4)] == lengths
  # The time trigger hands off every group with a request in flight; a waiting request of a
  # due group has generated nothing and is only dropped from the queue.
  engine = _FakeEngine(lengths)
  out = handoff.run_turn(engine, _requests(4), [0, 0, 1, 1], [0] * 4,
                         handoff.HandOffRule(after_seconds=1.0), started=0.0, clock=lambda: 5.0)
  assert out.handed == {0, 1} and sorted(out.partial) == [0, 1] and not engine.busy


def test_config_checks_name_the_field():
  for overrides, field in [(dict(worker_share=1.0), "worker_share"),
                           (dict(worker_share=-0.1), "worker_share"),
                           (dict(after_tokens=-1), "after_tokens"),
                           (dict(after_seconds=float("nan")), "after_seconds"),
                           (dict(worker_share=0.5), "after_tokens")]:
    with pytest.raises(ConfigError, match=rf"config\.rl\.long_tail\.{field}"):
      validate_rl_config(rl_config(long_tail=long_tail_config(**overrides)))
  with pytest.raises(ConfigError, match=r"rl\.long_tail\.worker_share.*routing_replay"):
    validate_rl_config(rl_config(routing_replay=True, long_tail=long_tail_config(
        worker_share=0.5, after_tokens=8)))
  with pytest.raises(ConfigError, match=r"rl\.long_tail\.worker_share.*rollout_via"):
    validate_rl_config(rl_config(env="calculator", rollout_via="gateway",
                                 long_tail=long_tail_config(worker_share=0.5, after_tokens=8)))
  validate_rl_config(rl_config(long_tail=long_tail_config(worker_share=0.5, after_seconds=3.0)))


def test_split_workers():
  names = async_trainer.worker_names(4)
  assert long_tail.split_workers(names, 0.0) == (names, [])
  assert long_tail.split_workers(names, 0.25) == (names[:3], ["w3"])
  assert long_tail.split_workers(names, 0.5) == (names[:2], ["w2", "w3"])
  assert long_tail.split_workers(names[:2], 0.1) == (["w0"], ["w1"])  # at least one
  with pytest.raises(ConfigError, match=r"config\.rl\.long_tail\.worker_share: 0.5 of 1 "):
    long_tail.split_workers(names[:1], 0.5)


def _episodes(env, n=3):
  """A group of `n` samples of train task 0: one finished, the others partway (one mid-turn)."""
  tokens = [1, 2, 3]
  out = [rollout.Episode(env.task(0, "train"), 0, j, list(tokens), [0.0] * 3, [0.0] * 3,
                         [{"role": "user", "content": "x"}]) for j in range(n)]
  out[0].keep_partial([7, 8], [-0.5, -0.25])
  out[0].partial, out[0].turns, out[0].result = 0, 1, (1.0, True, {"error": None})
  out[1].keep_partial([9], [-2.0])  # an unfinished turn
  return out


def test_handoff_file_round_trip_and_who_answers_it(tmp_path):
  env = envs.make("echo")
  orch = Orchestrator(tmp_path, ["w0"], groups_per_step=2, max_staleness=0, total_steps=1,
                      group_size=3)
  first, second = orch.issue(0)
  assert orch.router.loads() == {"w0": 2}
  assert long_tail.choose(tmp_path, ["w1", "w2"], first.id) in ("w1", "w2")
  long_tail.write_handoff(tmp_path, first, "w1", _episodes(env), version=4)
  assert long_tail.choose(tmp_path, ["w1", "w2"], second.id) == "w2"  # fewest pending
  assert long_tail.handed_off(tmp_path) == {first.rollout_name: "w1"}
  assert long_tail.pending_for(tmp_path, "w1") == [first.rollout_name]
  # The regular worker (restarted, too) no longer plays it; the router frees its slot.
  assert orders.outstanding_for(tmp_path, "w0", long_tail.handed_off(tmp_path)) == [second]
  orch.settle(orders.answered(tmp_path), long_tail.handed_off(tmp_path))
  assert orch.router.loads() == {"w0": 1} and orch.running == 2
  restarted = Orchestrator(tmp_path, ["w0"], groups_per_step=2, max_staleness=0,
                           total_steps=1, group_size=3)
  assert restarted.router.loads() == {"w0": 1} and restarted.moved == {first.rollout_name: "w1"}
  episodes, versions = long_tail.read_handoff(tmp_path, "w1", first.rollout_name, env)
  want = _episodes(env)
  for e, w, v in zip(episodes, want, versions):
    assert (e.tokens, e.logp, e.mask, e.turns, e.partial, e.sample, e.messages, e.result) == \
        (w.tokens, w.logp, w.mask, w.turns, w.partial, w.sample, w.messages, w.result)
    assert list(v) == [-1, -1, -1] + [4] * (len(e.tokens) - 3)
  # The continuation appends ids with its own version; the handed-over ones keep theirs.
  assert list(long_tail.continued_versions(versions[1], [0, 0, 0, 1, 1, 0, 1], 6)) == \
      [-1, -1, -1, 4, 6, -1, 6]
  # Answered by the long-tail worker's rollout file: pending no more, the order settles.
  trajectories.write_batch(RunDirs.at(tmp_path).rollouts, [], worker="w0", batch_index=first.id)
  assert long_tail.pending_for(tmp_path, "w1") == []
  orch.settle(orders.answered(tmp_path), long_tail.handed_off(tmp_path))
  assert orch.running == 1 and orch.moved == {} and orch.router.loads() == {"w0": 1}
  # A file for another env's task is refused by name.
  long_tail.write_handoff(tmp_path, second, "w2", _episodes(env), version=0)
  with pytest.raises(trajectories.CorruptTrajectoryError, match="another run's environments"):
    long_tail.read_handoff(tmp_path, "w2", second.rollout_name, envs.make("addition"))


@pytest.mark.slow
def test_trainer_with_a_regular_and_a_long_tail_worker_in_threads(tmp_path, helpers):
  """Every group runs past 3 tokens, so the regular worker hands each off after its 3rd; the
  long-tail worker continues them; exactly once, every trained sample continued."""
  config = small_async_config(long_tail=long_tail_config(worker_share=0.5, after_tokens=3))
  params = helpers.random_params(ModelConfig.from_config(config.model), seed=0)
  root = str(tmp_path / "rl")
  names, errors = ["w0", "w1"], []

  def serve(name):
    try:
      worker.run_worker(config, root, name, workers=names)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in names]
  for t in threads:
    t.start()
  summary = async_trainer.run_async_trainer(config, root, names, params=params)
  for t in threads:
    t.join(timeout=60)
  assert not errors, errors
  assert summary["steps"] == config.rl.steps
  _check_exactly_once(root, config)
  stats = {w: read_json(RunDirs.at(root).worker_stats(w)) for w in names}
  assert stats["w0"]["role"] == "regular" and stats["w1"]["role"] == "long_tail"
  assert stats["w0"]["handed_off"] >= 1 and stats["w1"]["continued"] == stats["w0"]["handed_off"]
  assert all(o.worker == "w0" for o in orders.read_orders(root))  # orders go to regulars only
  records = [r for name in sorted(orders.answered(root))
             for r in trajectories.read_batch(RunDirs.at(root).rollouts / name).records]
  moved = [r for r in records if r.meta["handed_off_to"] == "w1"]
  assert moved and all(r.meta["worker"] == "w0" for r in records)
  for r in moved:  # each generated token versioned
    assert (r.versions[r.loss_mask > 0] >= 0).all()
  # The sample that made its group due was continued past the 3 tokens w0 generated.
  assert max(int(r.loss_mask.sum()) for r in moved) > 3
  assert np.isfinite([r.reward for r in records]).all()


@pytest.mark.slow  # ~50 s at load 8 on the 2-core CPU: ~130 programs
def test_worker_warm_up_compiles_every_program_a_batch_runs(helpers):
  """`rl.worker_warmup`'s engine (`rollout.rollout_engine`) has the shapes `play_episodes`
  uses: after the warm-up a batch with hand-offs and one without compile nothing. One group
  a batch (4 slots): the fewest row buckets."""
  config = small_async_config(worker_groups=1)
  model = ModelConfig.from_config(config.model)
  params = helpers.random_params(model, seed=0)
  env = tasks.make_env(config.rl)
  tokenizer = make_tokenizer(config.data.tokenizer)
  slots, stats = config.rl.worker_groups * config.rl.group_size, {}
  with count_compiles() as compiles:
    worker._warm_up(config, model, params, slots, "w0", stats, compiles)  # pylint: disable=protected-access
    warm = compiles.count
    for rule in (handoff.HandOffRule(after_tokens=2), None):
      episodes = rollout.new_episodes([env.task(0, "train")],
                                      config.rl.group_size, tokenizer, config.data.seq_len)
      rollout.play_episodes(config, params, env, episodes, seed=1, tokenizer=tokenizer,
                            slots=slots, model=model, hand_off=rule,
                            on_hand_off=lambda group, mine: None)
  assert stats["warmup_seconds"] > 0 and stats["warm_at"] > 0
  assert compiles.count == warm, f"{compiles.count - warm} programs compiled after warm-up"
