"""Rollouts: environment tasks -> samples, through the inference engine, token in, token out.

`generate_samples` renders each task's prompt (`chat.render_prompt`), samples G completions of
it with `glm5_jax.infer.engine.Engine` (the G requests share one prompt, so the engine
prefills it once and copies the cache), stops each at a turn-ending token (`chat.stop_ids`),
parses it (`chat.parse_response`) and asks the environment for a reward. A multi-turn
environment may answer with an observation instead: its segment alone is rendered and
appended to the exact ids generated so far, and the next turn is generated from the whole
context. With engine sessions (the default for multi-turn envs) each episode is one session:
its slot keeps the cache between turns, so the next turn prefills only the last sampled token
and the observation segment (`glm5_jax.infer.sessions`; an episode evicted for want of slots
is re-prefilled whole). The samples are the same with or without sessions, to fp32 rounding of
the log-probs (tests/test_sessions.py); `stats` receives the engine's prefix counters.

Long-tail hand-off (`play_episodes` with a `handoff.HandOffRule`; asynchronous RL's regular
workers, glm5_jax/rl/long_tail.py): a group that runs long is stopped where it is and handed
to another worker, which plays the same `Episode`s on from their ids so far.

Token-in-token-out: a `Sample` holds the ids the engine produced and the raw (temperature 1)
log-probs it computed for them; generated text is never re-tokenized, so the trainer scores
exactly the tokens that were sampled. Prompt and observation tokens have loss mask 0.

Determinism: a request's tokens depend only on the params and its seed (`infer.engine`), and
the seed is a hash of (`seed`, split, task index, sample, turn). With the same params and seed
the samples are the same, which the loop's exact resume relies on.

Length: the whole conversation must fit `data.seq_len` (the trainer's row). Each turn may
generate `min(rl.max_new_tokens, room left)` tokens. A turn that ends without a stop token (its
budget ran out) finishes the episode with reward 0 (`info["error"]` says so), as does an
observation that would not fit: the model is never rewarded for an answer it did not finish.
So every sample fits its row, and `to_batch` refuses (never truncates) a longer one.

Notation (docs/design.md): B samples (rows), L sequence (`seq_len`); N samples as a flat axis.
"""

import concurrent.futures
import dataclasses
import time

import numpy as np

from glm5_jax import routing_replay
from glm5_jax.config import ModelConfig
from glm5_jax.data import chat, make_tokenizer
from glm5_jax.infer.engine import Engine
from glm5_jax.infer.requests import Request
from glm5_jax.posttrain import handoff
from glm5_jax.posttrain.envs import Env, Task
from glm5_jax.seeds import derive_seed

MAX_SLOTS = 64  # sequences decoded at once: bounds the cache; more requests wait for a slot
PREFILL_CHUNK = 32  # prompt tokens per prefill call (prompts here are short)
STEP_THREADS = 8  # episodes scored at once for envs with `concurrent_steps` (sandboxed code)


@dataclasses.dataclass
class Sample:
  """One episode of one task.

  tokens: int32 [n] the whole conversation as the model saw it (prompt, generated turns, each
    with its stop token, and observation segments).
  rollout_logp: float32 [n] the engine's raw log-prob of each generated token; 0 elsewhere.
  loss_mask: float32 [n] 1 on generated tokens, 0 on prompt and observation tokens.
  group: the task's position in the `tasks` list (GRPO's group id).
  messages: the conversation as message dicts (prompt, parsed assistant turns, observations):
    what the environment scored; for inspection only (the trainer reads `tokens`).
  routing: with `rl.routing_replay`, `{"moe": int32 [n, N_moe, X], "dsa": int32 [n, N_dsa, T]}`
    the routing each token went through in the engine (`glm5_jax.routing_replay`; -1 rows: not
    recorded); None otherwise. Multi-turn: `merge_routing`.
  """

  task: Task
  group: int
  tokens: np.ndarray
  rollout_logp: np.ndarray
  loss_mask: np.ndarray
  reward: float
  correct: bool
  turns: int
  messages: list
  info: dict
  routing: dict | None = None

  @property
  def response_length(self) -> int:
    """Generated tokens, all turns together."""
    return int(self.loss_mask.sum())


@dataclasses.dataclass
class Episode:
  """A sample being played: its conversation's ids so far (`tokens`, raw log-probs `logp` and
  `mask` per id, as `Sample`), the messages the env scores, the turns completed, and `partial`:
  how many of the last ids are an unfinished turn (a hand-off stopped it; its continuation
  appends the rest). `result` is (reward, correct, info) once finished."""
  task: Task
  group: int
  sample: int
  tokens: list
  logp: list
  mask: list
  messages: list
  turns: int = 0
  result: tuple | None = None  # (reward, correct, info) once finished
  routing: dict | None = None  # `Sample.routing`, so far
  partial: int = 0

  @property
  def response_length(self) -> int:
    return int(sum(self.mask))

  def keep_partial(self, tokens, raw_logprobs) -> None:
    """Appends generated ids (of the current, unfinished turn) and their raw log-probs."""
    self.tokens += [int(t) for t in tokens]
    self.logp += [float(x) for x in raw_logprobs]
    self.mask += [1.0] * len(tokens)
    self.partial += len(tokens)


def request_seed(seed: int, task: Task, sample: int, turn: int) -> int:
  """The uint32 sampling seed of one turn of one sample (module docstring)."""
  return derive_seed(seed, task.env, task.split, task.index, sample, turn)


def observation_tokens(observation: str, tokenizer, *, after_stop: int,
                       thinking_mode: str = "interleaved") -> np.ndarray:
  """int32: the ids to append after a generated turn that ended with `after_stop` for a tool
  result: `<|observation|><tool_response>...</tool_response><|assistant|><think>`, the
  observation segment rendered alone (`chat.render_prompt` of that one message, without the
  leading `[gMASK]<sop>`). The role token is left out when the model's stop token already was
  `<|observation|>` (it opened the segment), so the context equals the rendering of the whole
  conversation whenever the model ended its turn as the chat format does."""
  ids = chat.special_ids(tokenizer)
  rendered = chat.render_prompt([{"role": "observation", "content": observation}], tokenizer,
                                thinking_mode=thinking_mode)
  if list(rendered[:3]) != [ids.gmask, ids.sop, ids.observation]:
    raise AssertionError(f"chat.render_prompt of an observation starts {rendered[:3]}")
  return rendered[3:] if after_stop == ids.observation else rendered[2:]


def generate_samples(config, params, env: Env, tasks, *, seed: int, group_size: int | None = None,
                     temperature: float | None = None, tokenizer=None,
                     thinking_mode: str = "interleaved", sessions: bool | None = None,
                     stats: dict | None = None, slots: int | None = None,
                     model: ModelConfig | None = None) -> list[Sample]:
  """G samples of each task, played through `env` (module docstring).

  Args:
    config: the experiment config: `model`, `data.seq_len` (the conversation budget),
      `data.tokenizer`, and `rl` (group_size, max_new_tokens, temperature, top_p).
    params: the policy's params (any placement the engine's jitted steps accept).
    env: the environment that scores the tasks (and returns observations).
    tasks: the `Task`s to play.
    seed: the rollout seed (the loop passes one per step).
    group_size, temperature: override `rl.group_size` / `rl.temperature` (held-out evaluation
      plays 1 greedy sample per task: temperature 0).
    tokenizer: the tokenizer of `data.tokenizer`, if already built.
    sessions: keep each episode's cache between turns (default: when `env.max_turns > 1`).
    stats: a dict to update with the engine's `prefix_stats()` (prompt tokens submitted,
      tokens prefilled, hit rate, session hits / misses / evictions).
    slots: the engine's slots (default: one per sample, at most MAX_SLOTS). A caller whose
      batches vary in size (a rollout worker) passes a fixed number: the engine's steps are
      compiled per slot count.
    model: the run's `ModelConfig` of `config.model`, if already built (the RL loop's and a
      worker's), so a rollout does not convert and validate the model section again.
  Returns:
    `len(tasks) * G` samples, task-major (the G samples of task i are i*G .. i*G + G - 1).
  """
  rl = config.rl
  group_size = rl.group_size if group_size is None else group_size
  tokenizer = tokenizer or make_tokenizer(config.data.tokenizer)
  episodes = new_episodes(tasks, group_size, tokenizer, config.data.seq_len, thinking_mode)
  samples, _ = play_episodes(config, params, env, episodes, seed=seed, temperature=temperature,
                             tokenizer=tokenizer, thinking_mode=thinking_mode,
                             sessions=sessions, stats=stats, slots=slots, model=model)
  return samples


def new_episodes(tasks, group_size: int, tokenizer, seq_len: int,
                 thinking_mode: str = "interleaved") -> list:
  """`Episode`s of G samples of each task, task-major, before their first turn."""
  episodes = []
  for g, task in enumerate(tasks):
    prompt = [int(i) for i in chat.render_prompt(list(task.messages), tokenizer,
                                                 thinking_mode=thinking_mode)]
    if len(prompt) >= seq_len:
      raise ValueError(f"{task.env} task {task.index} ({task.split}): its prompt has "
                       f"{len(prompt)} tokens, data.seq_len={seq_len} leaves no room to answer")
    episodes += [Episode(task, g, j, list(prompt), [0.0] * len(prompt), [0.0] * len(prompt),
                         [dict(m) for m in task.messages]) for j in range(group_size)]
  return episodes


def rollout_engine(config, params, slots: int, *, model: ModelConfig | None = None,
                   record_routing: bool = False) -> Engine:
  """The engine `play_episodes` plays every turn of a batch through. Its shapes (slots,
  max_len = data.seq_len, chunk) depend on the config only, so a later engine with new params
  reuses the compiled steps, and `Engine.warmup` on one built here compiles them all up front
  (asynchronous RL's `rl.worker_warmup`)."""
  return Engine(config.model if model is None else model, params, slots=slots,
                max_len=config.data.seq_len, prefill_chunk=PREFILL_CHUNK,
                record_routing=record_routing)


def play_episodes(config, params, env: Env, episodes, *, seed: int,
                  temperature: float | None = None, tokenizer=None,
                  thinking_mode: str = "interleaved", sessions: bool | None = None,
                  stats: dict | None = None, slots: int | None = None,
                  model: ModelConfig | None = None, hand_off=None,
                  on_hand_off=None) -> tuple[list, set]:
  """Plays `episodes` (`new_episodes`, or episodes handed off by another worker, partway
  through a turn or between turns) to their end through one engine (`generate_samples`'
  arguments).

  With `hand_off` (a `handoff.HandOffRule`) every turn runs step by step and a group that
  runs long is stopped where it is (`handoff.run_turn`): its completed turns are played, the
  tokens of its unfinished turns kept (`Episode.partial`), its sessions released, and
  `on_hand_off(group, its episodes)` is called at once, so its new worker can start while
  this batch goes on. Not with `rl.routing_replay` (a cancelled request's routing is lost).

  Returns:
    (the samples of the groups not handed off, in `episodes` order; the handed-off groups).
  """
  rl, seq_len = config.rl, config.data.seq_len
  temperature = rl.temperature if temperature is None else temperature
  tokenizer = tokenizer or make_tokenizer(config.data.tokenizer)
  record_routing = bool(rl.get("routing_replay"))
  if hand_off is not None and record_routing:
    raise ValueError("play_episodes: hand-off with rl.routing_replay is not supported (a "
                     "cancelled request's routing is not kept)")
  stops = tuple(chat.stop_ids(tokenizer))
  engine = rollout_engine(config, params, slots or min(len(episodes), MAX_SLOTS), model=model,
                          record_routing=record_routing)
  sessions = env.max_turns > 1 if sessions is None else sessions
  started, handed = time.monotonic(), set()
  # Every active episode plays every turn, so all are at the same turn unless some were
  # handed over mid-episode; each request's seed uses its own episode's turn.
  while True:
    active = [(n, e) for n, e in enumerate(episodes)
              if e.result is None and e.group not in handed and e.turns < env.max_turns]
    if hand_off is not None:  # the time trigger, between turns
      due = {e.group for _, e in active
             if hand_off.due(e.response_length, time.monotonic() - started)}
      _hand_off(engine, episodes, due, handed, on_hand_off)
      active = [(n, e) for n, e in active if e.group not in due]
    if not active:
      break
    requests = [Request(index=k, prompt=tuple(e.tokens),
                        max_new_tokens=min(rl.max_new_tokens - e.partial,
                                           seq_len - len(e.tokens)),
                        temperature=float(temperature), top_p=float(rl.top_p), top_k=0,
                        seed=request_seed(seed, e.task, e.sample, e.turns), stop_tokens=stops,
                        session=n if sessions else None)
                for k, (n, e) in enumerate(active)]
    if hand_off is None:
      turn = handoff.TurnResult(dict(enumerate(engine.run(requests))), {}, set())
    else:
      turn = handoff.run_turn(engine, requests, [e.group for _, e in active],
                              [e.response_length for _, e in active], hand_off, started)
    done = [(active[k][1], c) for k, c in sorted(turn.completions.items())]
    play = lambda pair: _play_turn(pair[0], pair[1], env, tokenizer, seq_len, thinking_mode)
    if env.concurrent_steps:  # each step waits on a sandbox process: overlap them
      with concurrent.futures.ThreadPoolExecutor(STEP_THREADS) as pool:
        list(pool.map(play, done))
    else:
      for pair in done:
        play(pair)
    for k, (tokens, raw) in turn.partial.items():
      active[k][1].keep_partial(tokens, raw)
    for n, e in active:
      if sessions and e.result is not None:
        engine.release(n)  # its slot is free for the episodes still playing
    _hand_off(engine, episodes, turn.handed, handed, on_hand_off)
  if stats is not None:
    stats.update(engine.prefix_stats())
  kept = [e for e in episodes if e.group not in handed]
  for e in kept:
    if e.result is None:  # envs finish themselves by max_turns; never leave one open
      e.result = (0.0, False, {"error": f"no answer within max_turns={env.max_turns}"})
  return [_sample(e) for e in kept], handed


def _hand_off(engine, episodes, groups, handed: set, on_hand_off) -> None:
  """Hands `groups` off: releases their sessions' slots, tells `on_hand_off`."""
  for group in sorted(groups):
    handed.add(group)
    mine = [(n, e) for n, e in enumerate(episodes) if e.group == group]
    for n, _ in mine:
      engine.release(n)
    if on_hand_off is not None:
      on_hand_off(group, [e for _, e in mine])


def _play_turn(e: "Episode", completion, env: Env, tokenizer, seq_len: int,
               thinking_mode: str) -> None:
  if completion.routing is not None:
    e.routing = merge_routing(e.routing, completion.routing)
  e.keep_partial(completion.tokens, completion.raw_logprobs)
  turn = e.tokens[len(e.tokens) - e.partial:]  # a handed-over turn began on another worker
  e.partial = 0
  e.turns += 1
  response = chat.parse_response(turn, tokenizer)
  message = {"role": "assistant", "content": response.content, "thinking": response.thinking}
  if response.tool_calls:
    message["tool_calls"] = list(response.tool_calls)
  e.messages.append(message)
  if response.stop is None:
    e.result = (0.0, False, {"error": f"turn {e.turns} did not end within its "
                             f"{len(turn)} tokens", "truncated": True})
    return
  step = env.step(e.task, e.messages)
  if step.done:
    e.result = (float(step.reward), bool(step.info.get("correct", False)), dict(step.info))
    return
  segment = observation_tokens(step.observation, tokenizer, after_stop=turn[-1],
                               thinking_mode=thinking_mode)
  e.messages.append({"role": "observation", "content": step.observation})
  if len(e.tokens) + len(segment) >= seq_len:
    e.result = (0.0, False, {"error": f"the observation after turn {e.turns} does not fit "
                             f"data.seq_len={seq_len}", "truncated": True})
    return
  e.tokens += [int(i) for i in segment]
  e.logp += [0.0] * len(segment)
  e.mask += [0.0] * len(segment)


def merge_routing(old: dict | None, new: dict) -> dict:
  """The episode's routing after a turn: earlier rows where recorded (the earlier turns'
  log-probs came from them), this turn's elsewhere (the previous turn's unfed last token, the
  observation, this turn's tokens). This turn re-prefilled the earlier tokens and may have
  routed some differently: its log-probs then saw that routing, which one forward cannot
  replay together with the earlier one. With engine sessions (the default for multi-turn
  envs) no token is fed twice, so every row comes from the one forward that used it."""
  if old is None:
    return new
  out = {}
  for kind, rows in new.items():
    n = len(old[kind])
    kept = np.where(old[kind][:, :, :1] >= 0, old[kind], rows[:n])
    out[kind] = np.concatenate([kept, rows[n:]])
  return out


def _sample(e: "Episode") -> Sample:
  reward, correct, info = e.result
  return Sample(task=e.task, group=e.group, tokens=np.asarray(e.tokens, np.int32),
                rollout_logp=np.asarray(e.logp, np.float32),
                loss_mask=np.asarray(e.mask, np.float32), reward=reward, correct=correct,
                turns=e.turns, messages=e.messages, info=info, routing=e.routing)


def to_batch(samples, seq_len: int, advantages_N=None) -> dict:
  """The rollout batch of `glm5_jax.posttrain.rl_step` (numpy, every array `[B, L]`, B =
  len(samples), L = seq_len): each sample in its own row, left-aligned, padded with
  segment id 0. When the samples carry routing (`rl.routing_replay`), also `routing_moe`
  `[B, L, N_moe, X]` and `routing_dsa` `[B, L, N_dsa, T]` (int32, -1 = not recorded).

  Args:
    samples: `Sample`s.
    seq_len: L.
    advantages_N: one advantage per sample, broadcast over its loss tokens; None: zeros (the
      caller sets per-token advantages, e.g. distillation's).
  Raises:
    ValueError: a sample longer than seq_len (named; samples are never truncated: a cut
      conversation would train tokens whose reward was earned by the part cut away).
  """
  b = len(samples)
  batch = {"tokens": np.zeros((b, seq_len), np.int32),
           "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (b, seq_len)).copy(),
           "segment_ids": np.zeros((b, seq_len), np.int32),
           "loss_mask": np.zeros((b, seq_len), np.float32),
           "rollout_logp": np.zeros((b, seq_len), np.float32),
           "advantages": np.zeros((b, seq_len), np.float32)}
  for i, s in enumerate(samples):
    n = len(s.tokens)
    if n > seq_len:
      raise ValueError(f"to_batch: sample {i} ({s.task.env} task {s.task.index}) has {n} tokens, "
                       f"more than seq_len={seq_len}")
    batch["tokens"][i, :n] = s.tokens
    batch["segment_ids"][i, :n] = 1
    batch["loss_mask"][i, :n] = s.loss_mask
    batch["rollout_logp"][i, :n] = s.rollout_logp * s.loss_mask
    if advantages_N is not None:
      batch["advantages"][i, :n] = float(advantages_N[i]) * s.loss_mask
  recorded = [s.routing is not None for s in samples]
  if any(recorded):
    if not all(recorded):
      raise ValueError(f"to_batch: samples {[i for i, r in enumerate(recorded) if not r][:5]} "
                       "have no routing while others do (one engine setting per batch)")
    for kind in samples[0].routing:
      batch[f"routing_{kind}"] = routing_replay.pad_rows([s.routing[kind] for s in samples],
                                                         seq_len)
  return batch


def rollout_metrics(samples) -> dict:
  """Means over samples: reward, accuracy, response length, turns, the truncated share, and
  where the env checks reasoning (`info["reasoning_ok"]`) the share of samples whose reasoning
  is right (`reasoning_ok`) and whose answer is right with wrong reasoning (`lucky`)."""
  out = {"reward": float(np.mean([s.reward for s in samples])),
         "accuracy": float(np.mean([s.correct for s in samples])),
         "response_length": float(np.mean([s.response_length for s in samples])),
         "turns": float(np.mean([s.turns for s in samples])),
         "truncated_fraction": float(np.mean([bool(s.info.get("truncated")) for s in samples]))}
  if any("reasoning_ok" in s.info for s in samples):
    out["reasoning_ok"] = float(np.mean([bool(s.info.get("reasoning_ok")) for s in samples]))
    out["lucky"] = float(np.mean([s.correct and s.info.get("reasoning_ok") is False
                                  for s in samples]))
  return out


def metrics_by_env(samples) -> dict:
  """`rollout_metrics` of each environment's samples as `<env>/<metric>`, and `<env>/samples`
  (a task mixture's per-task metrics)."""
  out = {}
  for name in sorted({s.task.env for s in samples}):
    mine = [s for s in samples if s.task.env == name]
    out.update({f"{name}/{k}": v for k, v in rollout_metrics(mine).items()})
    out[f"{name}/samples"] = float(len(mine))
  return out
