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

Counters (busy, idle and policy-load seconds, batches, samples, versions loaded, response
lengths, and the engine's prefix-cache counters: prompt tokens submitted, tokens actually
prefilled, hit rate = 1 - prefilled / submitted, session hits / misses / evictions; with the
gateway also its calls, re-tokenization mismatches and aborted calls under `gateway`) go to
`<root>/workers/<name>.json` after every batch and are carried over a restart; the benchmark
reads the idle fraction from them.

Sampling seeds: one per generation batch, a hash of (`rl.seed`, worker, first order id); every
request's seed also hashes the task index, sample and turn (`rollout.request_seed`).
"""

import os
import time

from absl import logging
import jax
import numpy as np

from glm5_jax.api import abstract_params_and_axes
from glm5_jax.config import ModelConfig, require_model_config
from glm5_jax.data import check_vocab, make_tokenizer
from glm5_jax.posttrain import rollout, tasks
from glm5_jax.posttrain.loop import hide_run_from_sandbox
from glm5_jax.posttrain.rl_config_checks import validate_rl_experiment
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


def to_records(samples, order: orders_lib.Order, version: int, worker: str) -> list:
  """The group of `order` as `TrajectoryRecord`s: token ids and raw log-probs exactly as the
  engine produced them, every generated token tagged with `version`, and with
  `rl.routing_replay` each token's MoE experts and DSA top-k (`Sample.routing`)."""
  out = []
  for j, s in enumerate(samples):
    versions = np.where(s.loss_mask > 0, version, -1).astype(np.int32)
    meta = {"order": order.id, "task": s.task.index, "env": s.task.env, "sample": j,
            "correct": bool(s.correct), "turns": s.turns, "worker": worker,
            "requeue_of": order.requeue_of,
            "truncated": bool(s.info.get("truncated", False))}
    out.append(trajectories.TrajectoryRecord(s.tokens, s.rollout_logp * s.loss_mask,
                                             s.loss_mask, versions, float(s.reward), meta,
                                             routing=s.routing))
  return out


def run_worker(config, root, name: str, *, max_batches: int | None = None) -> dict:
  """Serves orders addressed to `name` in the run directory `root` (module docstring) until
  the trainer is done, SIGTERM arrives (it stops between generation batches: `stopped_early`
  in the counters) or after `max_batches` generation batches. Returns the counters."""
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
      "response_lengths": [], "prefix": {}}
  stats.update(starts=stats["starts"] + 1, pid=os.getpid())
  write_json(dirs.worker_stats(name), stats)
  slots = rl.worker_groups * rl.group_size
  with StopSignal() as stop:
    stats["stopped_early"] = _serve(config, model, dirs, name, env, tokenizer, abstract,
                                    subscriber, stats, slots, max_batches, stop)
  write_json(dirs.worker_stats(name), stats)
  return stats


def _serve(config, model: ModelConfig, dirs, name, env, tokenizer, abstract, subscriber, stats,
           slots, max_batches, stop) -> bool:
  """The loop of the module docstring; returns whether SIGTERM stopped it (between batches)."""
  rl = config.rl
  version, params, batches, server = None, None, 0, None
  try:
    while not dirs.done.exists() and (max_batches is None or batches < max_batches):
      if stop.take():
        logging.warning("worker %s: SIGTERM: stopping (its outstanding orders stay for its next "
                        "start)", name)
        return True
      t0 = time.time()
      todo = orders_lib.outstanding_for(dirs.root, name)
      latest = subscriber.latest_version()
      if not todo or latest is None:
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
      t1 = time.time()
      batch = todo[:rl.worker_groups]
      seed = batch_seed(rl.seed, name, batch[0].id)
      if rl.rollout_via == "gateway":
        if server is None:
          server = _start_server(config, model, params, tokenizer, slots, version)
        groups, prefix = _gateway_groups(config, server, env, batch, seed, name, stats)
      else:
        groups, prefix = _engine_groups(config, model, params, env, batch, seed, name, version,
                                        tokenizer, slots)
      for key in ("prompt_tokens", "prefilled_tokens", "session_hits", "session_misses",
                  "evictions"):
        stats["prefix"][key] = stats["prefix"].get(key, 0) + int(prefix.get(key, 0))
      submitted = stats["prefix"]["prompt_tokens"]
      stats["prefix"]["hit_rate"] = (1 - stats["prefix"]["prefilled_tokens"] / submitted
                                     if submitted else 0.0)
      for order, records in zip(batch, groups):
        trajectories.write_batch(dirs.rollouts, records, worker=name, batch_index=order.id)
        stats["response_lengths"] += [int(r.loss_mask.sum()) for r in records]
      batches += 1
      stats["batches"] += 1
      stats["samples"] += sum(len(records) for records in groups)
      stats["busy_seconds"] += time.time() - t1
      write_json(dirs.worker_stats(name), stats)
      logging.info("worker %s: orders %d..%d (%d groups) with version %d in %.1f s", name,
                   batch[0].id, batch[-1].id, len(groups), version, time.time() - t1)
    return False
  finally:
    if server is not None:
      server.close()


def _engine_groups(config, model, params, env, batch, seed, name, version, tokenizer, slots):
  """`rl.rollout_via` "engine": (one record list per order, the engine's prefix counters)."""
  prefix = {}
  samples = rollout.generate_samples(config, params, env,
                                     [env.task(o.task, "train") for o in batch], seed=seed,
                                     tokenizer=tokenizer, slots=slots, stats=prefix, model=model)
  g = config.rl.group_size
  return [to_records(samples[i * g:(i + 1) * g], order, version, name)
          for i, order in enumerate(batch)], prefix


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
