"""A rollout worker: its own JAX process and mesh, fed by orders, answering with rollout files.

Loop (`run_worker`), until the trainer writes `control/done`:
  1. its outstanding orders (`orders.outstanding_for`: order files without a rollout file), by
     id; none: sleep `rl.poll_seconds` (idle time);
  2. the newest published policy version (`param_sync.PolicySubscriber`), restored into this
     worker's own shardings (`config.mesh` over this process's devices: orbax reshards from
     the trainer's layout) when it is newer than the one held. Versions switch only between
     generation batches, so every token of a rollout has one version;
  3. up to `rl.worker_groups` orders as one generation batch, each order's group written as
     one rollout file named by the order id (`trajectories.write_batch`: temporary name, fsync,
     rename). With `rl.rollout_via` "engine" (`rollout.generate_samples`) the engine plays
     every turn of each rollout in this process, keeping its cache between turns; with
     "gateway" an agent program plays each episode through the `openai` client against this
     worker's own OpenAI-compatible server over its engine (`agent_server.AgentServer`,
     started at the first version, params switched in place), and the TITO gateway's records
     are the samples (`agent_rollout.agent_samples`: the sampled ids, their log-probs, each
     token's version).
A worker killed at any point loses nothing: on restart it deletes its temporary files and
answers its outstanding orders again (those it had finished have files and are skipped).

Long-tail hand-off (`long_tail`, `rl.long_tail.worker_share` > 0): a REGULAR worker plays its
batch with `posttrain.handoff.HandOffRule` and writes a group that runs long as a hand-off file
for a long-tail worker the moment it is due, then goes on; a LONG-TAIL worker's outstanding work
is the hand-offs addressed to it, which it continues and answers with the orders' rollout files.

Counters (busy, idle and policy-load seconds, batches, samples, versions loaded, response
lengths, and the engine's prefix-cache counters: prompt tokens submitted, tokens actually
prefilled, hit rate = 1 - prefilled / submitted, session hits / misses / evictions; with the
gateway also its calls, re-tokenization mismatches and aborted calls under `gateway`) go to
`<root>/workers/<name>.json` after every batch and are carried over a restart; the benchmark
reads the idle fraction from them. `compiles` counts this start's XLA programs (`total`, of
them `cache_hits` loaded from the persistent compilation cache, `in_batches` during generation
batches), `warmup_seconds` and `warm_at` (the warm-up's end, Unix time).

Warm-up (`rl.worker_warmup`, engine rollouts): as soon as a policy version is published, work
or not (a long-tail worker has none until the first hand-off), the worker loads it and
compiles every program its engine can run (`Engine.warmup` on `rollout.rollout_engine`: each
prefill row and page bucket, each decode page bucket), so no batch waits on a compile of a
shape it meets first (a cold process otherwise compiles one per new bucket, batch after
batch). Its time counts as load time, not busy time.

Sampling seeds: one per generation batch, a hash of (`rl.seed`, worker, first order id); every
request's seed also hashes the task index, sample and turn (`rollout.request_seed`).
"""

import dataclasses
import os
import time

from absl import logging
import jax
import numpy as np

from glm5_jax.api import abstract_params_and_axes
from glm5_jax.config import ModelConfig, require_model_config
from glm5_jax.data import check_vocab, make_tokenizer
from glm5_jax.infer.compile_count import count_compiles
from glm5_jax.posttrain import handoff, rollout, learning_signal, tasks
from glm5_jax.posttrain.rl_run import hide_run_from_sandbox
from glm5_jax.posttrain.rl_config_checks import validate_rl_experiment
from glm5_jax.rl import long_tail
from glm5_jax.rl import orders as orders_lib
from glm5_jax.rl import trajectories
from glm5_jax.rl.layout import RunDirs, read_json, write_json
from glm5_jax.rl.param_sync import PolicySubscriber
from glm5_jax.seeds import derive_seed
from glm5_jax.sharding import make_mesh, param_shardings
from glm5_jax.train.stopping import StopSignal


def batch_seed(seed: int, worker: str, first_order: int) -> int:
  return derive_seed("rollout", seed, worker, first_order)


def abstract_worker_params(config, model: ModelConfig):
  """ShapeDtypeStructs of `model`'s params with this process's shardings (`config.mesh` over
  its devices, `config.mesh.logical_axis_rules`): what a published version is restored into."""
  require_model_config(model, "abstract_worker_params")
  shapes, logical = abstract_params_and_axes(model)
  mesh = make_mesh(config.mesh)
  shardings = param_shardings(shapes, logical, mesh, config.mesh.logical_axis_rules)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


def to_records(samples, order: orders_lib.Order, version, worker: str,
               handed_off_to: str = "") -> list:
  """The group of `order` as `TrajectoryRecord`s: token ids and raw log-probs exactly as the
  engine produced them, every generated token tagged with `version` (an int, or per sample an
  int32 [n] array of each token's version: a group continued after a hand-off), and with
  `rl.routing_replay` each token's MoE experts and DSA top-k (`Sample.routing`)."""
  out = []
  for j, s in enumerate(samples):
    versions = (np.where(s.loss_mask > 0, version, -1).astype(np.int32)
                if isinstance(version, int) else np.asarray(version[j], np.int32))
    meta = {"order": order.id, "task": s.task.index, "env": s.task.env, "sample": j,
            "correct": bool(s.correct), "turns": s.turns, "worker": worker,
            "requeue_of": order.requeue_of, "handed_off_to": handed_off_to,
            "truncated": bool(s.info.get("truncated", False))}
    if "reasoning_ok" in s.info:
      meta["reasoning_ok"] = bool(s.info["reasoning_ok"])
    out.append(trajectories.TrajectoryRecord(s.tokens, s.rollout_logp * s.loss_mask,
                                             s.loss_mask, versions, float(s.reward), meta,
                                             routing=s.routing))
  return out


def run_worker(config, root, name: str, *, workers=None, max_batches: int | None = None) -> dict:
  """Serves orders addressed to `name` in the run directory `root` (module docstring) until
  the trainer is done, SIGTERM arrives (it stops between generation batches: `stopped_early`
  in the counters) or after `max_batches` generation batches. `workers`: every rollout
  worker's name (needed with `rl.long_tail.worker_share` > 0: which are long-tail). Returns the
  counters."""
  validate_rl_experiment(config)
  hide_run_from_sandbox(config, root)
  dirs = RunDirs.at(root)
  rl = config.rl
  model = ModelConfig.from_config(config.model)  # once per worker
  tokenizer = make_tokenizer(config.data.tokenizer)
  check_vocab(tokenizer, model.vocab_size)
  env = tasks.make_env(rl)
  abstract = abstract_worker_params(config, model)
  subscriber = PolicySubscriber(dirs.policy)
  removed = trajectories.remove_temporaries(dirs.rollouts, name)
  if removed:
    logging.info("worker %s: deleted %d temporary rollout files of a previous run", name, removed)
  stats = read_json(dirs.worker_stats(name)) or {
      "worker": name, "busy_seconds": 0.0, "idle_seconds": 0.0, "load_seconds": 0.0,
      "batches": 0, "samples": 0, "starts": 0, "versions_loaded": [],
      "response_lengths": [], "prefix": {}, "handed_off": 0, "continued": 0}
  stats.update(starts=stats["starts"] + 1, pid=os.getpid())
  write_json(dirs.worker_stats(name), stats)
  share = rl.long_tail.worker_share
  if share > 0 and workers is None:
    raise ValueError(f"worker {name}: rl.long_tail.worker_share={share} needs every worker's "
                     "name (run_worker's workers; --rollout_workers)")
  regular, tails = long_tail.split_workers(workers or [name], share)
  if name not in regular + tails:
    raise ValueError(f"worker {name} is not one of this run's workers {regular + tails}")
  stats["role"] = "long_tail" if name in tails else "regular"
  slots = rl.worker_groups * rl.group_size
  stats["compiles"] = {"total": 0, "cache_hits": 0, "in_batches": 0}
  with StopSignal() as stop, count_compiles() as compiles:
    stats["stopped_early"] = _serve(config, model, dirs, name, env, tokenizer, abstract,
                                    subscriber, stats, slots, max_batches, stop, tails, compiles)
    stats["compiles"].update(total=compiles.count, cache_hits=compiles.cache_hits)
  write_json(dirs.worker_stats(name), stats)
  return stats


def _serve(config, model: ModelConfig, dirs, name, env, tokenizer, abstract, subscriber, stats,
           slots, max_batches, stop, tails, compiles) -> bool:
  """The loop of the module docstring; returns whether SIGTERM stopped it (between batches)."""
  rl = config.rl
  lt = rl.long_tail
  is_tail = name in tails
  rule = handoff.HandOffRule(lt.after_tokens, lt.after_seconds) if tails and not is_tail \
      else None
  version, params, batches, server, warm = None, None, 0, None, False
  try:
    while not dirs.done.exists() and (max_batches is None or batches < max_batches):
      if stop.take():
        logging.warning("worker %s: SIGTERM: stopping (its outstanding orders stay for its next "
                        "start)", name)
        return True
      t0 = time.time()
      todo = (long_tail.pending_for(dirs.root, name) if is_tail else
              orders_lib.outstanding_for(dirs.root, name, long_tail.handed_off(dirs.root)))
      latest = subscriber.latest_version()
      # The warm-up needs a policy, not work: a long-tail worker warms up before its first
      # hand-off arrives instead of holding that group back while it compiles.
      cold = rl.worker_warmup and rl.rollout_via == "engine" and not warm
      if latest is None or not (todo or cold):
        time.sleep(rl.poll_seconds)
        stats["idle_seconds"] += time.time() - t0
        continue
      if latest != version:
        version, params = subscriber.restore_latest(abstract)
        if server is not None:
          server.set_params(params, version)  # applied before the next batch's first step
        stats["versions_loaded"].append(version)
        stats["load_seconds"] += time.time() - t0
        logging.info("worker %s: policy version %d loaded (%.1f s)", name, version,
                     time.time() - t0)
        if cold:
          stats["load_seconds"] += _warm_up(config, model, params, slots, name, stats, compiles)
          warm = True
      if not todo:
        continue
      t1, compiled = time.time(), compiles.count
      batch = todo[:rl.worker_groups]
      if rl.rollout_via == "gateway":
        if server is None:
          server = _start_server(config, model, params, tokenizer, slots, version)
        groups, prefix = _gateway_groups(config, server, env, batch,
                                         batch_seed(rl.seed, name, batch[0].id), name, stats)
        for order, records in zip(batch, groups):
          trajectories.write_batch(dirs.rollouts, records, worker=name, batch_index=order.id)
        written, lengths = len(groups), [int(r.loss_mask.sum()) for rs in groups for r in rs]
      else:
        prefix = {}
        play = _continue if is_tail else _generate
        written, samples = play(config, model, dirs, name, env, tokenizer, params, version,
                                batch, slots, prefix, stats, rule, tails)
        lengths = [s.response_length for s in samples]
      for key in ("prompt_tokens", "prefilled_tokens", "session_hits", "session_misses",
                  "evictions"):
        stats["prefix"][key] = stats["prefix"].get(key, 0) + int(prefix.get(key, 0))
      submitted = stats["prefix"]["prompt_tokens"]
      stats["prefix"]["hit_rate"] = (1 - stats["prefix"]["prefilled_tokens"] / submitted
                                     if submitted else 0.0)
      stats["response_lengths"] += lengths
      batches += 1
      stats["batches"] += 1
      stats["samples"] += len(lengths)
      stats["busy_seconds"] += time.time() - t1
      stats["compiles"].update(total=compiles.count, cache_hits=compiles.cache_hits,
                               in_batches=stats["compiles"]["in_batches"]
                               + compiles.count - compiled)
      write_json(dirs.worker_stats(name), stats)
      logging.info("worker %s: %d groups written, %d handed off (%d samples) with version %d "
                   "in %.1f s", name, written, len(batch) - written, len(lengths), version,
                   time.time() - t1)
    return False
  finally:
    if server is not None:
      server.close()


def _warm_up(config, model, params, slots, name, stats, compiles) -> float:
  """Compiles every program of this worker's rollout engine (module docstring, Warm-up);
  returns its seconds (also added to `stats["warmup_seconds"]`)."""
  t0, before = time.time(), (compiles.count, compiles.cache_hits)
  rollout.rollout_engine(config, params, slots, model=model).warmup()
  seconds = time.time() - t0
  stats["warmup_seconds"] = stats.get("warmup_seconds", 0.0) + seconds
  stats["warm_at"] = time.time()  # when it ended (the benchmark's steady state starts after)
  logging.info("worker %s: engine warm-up: %d programs (%d from the persistent cache) in "
               "%.1f s", name, compiles.count - before[0], compiles.cache_hits - before[1],
               seconds)
  return seconds


def _generate(config, model, dirs, name, env, tokenizer, params, version, batch, slots, prefix,
              stats, rule, tails):
  """A regular worker's batch: new groups of `batch` (orders), handing off those that run long
  (`rule`, None: never) to the long-tail workers `tails`; the rest written as rollout files.
  Returns (groups written, their samples)."""
  rl = config.rl
  episodes = rollout.new_episodes([env.task(o.task, "train") for o in batch], rl.group_size,
                                  tokenizer, config.data.seq_len)

  def hand_off(group, mine):
    order = batch[group]
    to = long_tail.choose(dirs.root, tails, order.id)
    long_tail.write_handoff(dirs.root, order, to, mine, version)
    stats["handed_off"] += 1
    logging.info("worker %s: order %d handed off to %s (%d of %d samples unfinished)", name,
                 order.id, to, sum(e.result is None for e in mine), len(mine))

  seed = batch_seed(rl.seed, name, batch[0].id)
  samples, handed = rollout.play_episodes(
      config, params, env, episodes, seed=seed, tokenizer=tokenizer, slots=slots, stats=prefix,
      model=model, hand_off=rule, on_hand_off=hand_off)
  g = rl.group_size
  for round_ in range(1, rl.dynamic_sampling_rounds + 1):  # never with hand-off (validated)
    samples, remaining = _refill(config, model, env, tokenizer, params, batch, samples, round_,
                                 seed, slots, prefix)
    if not remaining:
      break
  kept = [order for g, order in enumerate(batch) if g not in handed]
  for i, order in enumerate(kept):
    trajectories.write_batch(dirs.rollouts,
                             to_records(samples[i * g:(i + 1) * g], order, version, name),
                             worker=name, batch_index=order.id)
  return len(kept), samples


def _refill(config, model, env, tokenizer, params, batch, samples, round_, seed, slots, prefix):
  """Dynamic sampling on a worker (`rl.dynamic_sampling_rounds`): each group of `samples`
  whose rewards are all equal is played again on its order's refill task of round `round_`
  (`learning_signal.refill_task_index`) and replaced by the new group. Returns (samples, how many
  groups were replayed)."""
  g = config.rl.group_size
  silent = [i for i in range(len(batch))
            if not learning_signal.has_signal([s.reward for s in samples[i * g:(i + 1) * g]])]
  if not silent:
    return samples, 0
  tasks = [env.task(learning_signal.refill_task_index(batch[i].task, round_), "train")
           for i in silent]
  episodes = rollout.new_episodes(tasks, g, tokenizer, config.data.seq_len)
  fresh, _ = rollout.play_episodes(config, params, env, episodes,
                                   seed=derive_seed(seed, "refill", round_), tokenizer=tokenizer,
                                   slots=slots, stats=prefix, model=model)
  samples = list(samples)
  for k, i in enumerate(silent):
    samples[i * g:(i + 1) * g] = [dataclasses.replace(s, group=i)
                                  for s in fresh[k * g:(k + 1) * g]]
  return samples, len(silent)


def _continue(config, model, dirs, name, env, tokenizer, params, version, batch, slots, prefix,
              stats, rule, tails):
  """A long-tail worker's batch: the hand-offs `batch` (file names) continued to their end and
  written as their orders' rollout files. Returns (groups written, their samples)."""
  del rule, tails
  rl = config.rl
  episodes, before, orders = [], [], []
  issued = {o.rollout_name: o for o in orders_lib.read_orders(dirs.root)}
  for group, file in enumerate(batch):
    order = issued.get(file)
    if order is None:
      raise ValueError(f"hand-off {file} in {dirs.root}/{long_tail.HANDOFFS}/{name} answers no "
                       "issued order")
    try:
      mine, versions = long_tail.read_handoff(dirs.root, name, file, env)
    except trajectories.CorruptTrajectoryError as e:
      long_tail.log_damaged(file, e)
      mine = rollout.new_episodes([env.task(order.task, "train")], rl.group_size, tokenizer,
                                  config.data.seq_len)
      versions = [np.zeros((0,), np.int32)] * len(mine)
    for e in mine:
      e.group = group
    episodes += mine
    before += versions
    orders.append(order)
  samples, _ = rollout.play_episodes(config, params, env, episodes,
                                     seed=batch_seed(rl.seed, name, orders[0].id),
                                     tokenizer=tokenizer, slots=slots, stats=prefix, model=model)
  g = rl.group_size
  for i, order in enumerate(orders):
    group = samples[i * g:(i + 1) * g]
    versions = [long_tail.continued_versions(before[i * g + j], s.loss_mask, version)
                for j, s in enumerate(group)]
    trajectories.write_batch(dirs.rollouts,
                             to_records(group, order, versions, order.worker, handed_off_to=name),
                             worker=order.worker, batch_index=order.id)
  stats["continued"] += len(orders)
  return len(orders), samples


def _start_server(config, model, params, tokenizer, slots, version):
  # Imported here: the server's stack (fastapi, uvicorn, openai: the `serve` extra) is needed
  # by rollout_via "gateway" only.
  from glm5_jax.rl.agent_server import AgentServer  # pylint: disable=import-outside-toplevel
  return AgentServer(model, params, tokenizer, slots=slots, seq_len=config.data.seq_len,
                     version=version, record_routing=bool(config.rl.routing_replay))


def _gateway_groups(config, server, env, batch, seed, name, stats):
  """`rl.rollout_via` "gateway": every episode of the batch played at once by the env's agent
  program against `server`; (one record list per order, the prefix counters of this batch).
  Adds the gateway's counters to `stats["gateway"]`."""
  from glm5_jax.rl import agent_rollout  # pylint: disable=import-outside-toplevel
  rl, g = config.rl, config.rl.group_size
  before = server.counters()
  pairs = agent_rollout.agent_samples(
      server.url, env, [env.task(o.task, "train") for o in batch], group_size=g, seed=seed,
      model=server.model_name, agent=agent_rollout.AGENTS[rl.env],
      max_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
      threads=len(batch) * g, run_id=f"{name}-o{batch[0].id}")
  delta = {k: v - before[k] for k, v in server.counters().items()}
  totals = stats.setdefault("gateway", {})
  for key in ("calls", "mismatches", "aborted", "tokens_generated"):
    totals[key] = totals.get(key, 0) + delta[key]
  return [agent_rollout.to_trajectory_records(pairs[i * g:(i + 1) * g], worker=name,
                                              order=order.id, requeue_of=order.requeue_of)
          for i, order in enumerate(batch)], delta
