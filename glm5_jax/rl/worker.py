"""A rollout worker: its own JAX process and mesh, fed by orders, answering with rollout files.

Loop (`run_worker`), until the trainer writes `control/done`:
  1. its outstanding orders (`orders.outstanding_for`: order files without a rollout file), by
     id; none: sleep `rl.poll_seconds` (idle time);
  2. the newest published policy version (`param_sync.PolicySubscriber`), restored into this
     worker's own shardings (`config.mesh` over this process's devices: orbax reshards from
     the trainer's layout) when it is newer than the one held. Versions switch only between
     generation batches, so every token of a rollout has one version;
  3. up to `rl.worker_groups` orders as one generation batch (`rollout.generate_samples`: the
     engine plays every turn of each rollout in this process, keeping its cache between turns),
     each order's group written as one rollout file named by the order id
     (`trajectories.write_batch`: temporary name, fsync, rename).
A worker killed at any point loses nothing: on restart it deletes its temporary files and
answers its outstanding orders again (those it had finished have files and are skipped).

Counters (busy, idle and policy-load seconds, batches, samples, versions loaded, response
lengths, and the engine's prefix-cache counters: prompt tokens submitted, tokens actually
prefilled, hit rate = 1 - prefilled / submitted, session hits / misses / evictions) go to
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
  version, params, batches = None, None, 0
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
      stats["versions_loaded"].append(version)
      stats["load_seconds"] += time.time() - t0
      logging.info("worker %s: policy version %d loaded (%.1f s)", name, version,
                   time.time() - t0)
    t1 = time.time()
    batch = todo[:rl.worker_groups]
    tasks = [env.task(o.task, "train") for o in batch]
    prefix = {}
    samples = rollout.generate_samples(config, params, env, tasks,
                                       seed=batch_seed(rl.seed, name, batch[0].id),
                                       tokenizer=tokenizer, slots=slots, stats=prefix,
                                       model=model)
    for key in ("prompt_tokens", "prefilled_tokens", "session_hits", "session_misses",
                "evictions"):
      stats["prefix"][key] = stats["prefix"].get(key, 0) + int(prefix.get(key, 0))
    submitted = stats["prefix"]["prompt_tokens"]
    stats["prefix"]["hit_rate"] = (1 - stats["prefix"]["prefilled_tokens"] / submitted
                                   if submitted else 0.0)
    g = rl.group_size
    for i, order in enumerate(batch):
      group = samples[i * g:(i + 1) * g]
      trajectories.write_batch(dirs.rollouts, to_records(group, order, version, name),
                               worker=name, batch_index=order.id)
      stats["response_lengths"] += [s.response_length for s in group]
    batches += 1
    stats["batches"] += 1
    stats["samples"] += len(samples)
    stats["busy_seconds"] += time.time() - t1
    write_json(dirs.worker_stats(name), stats)
    logging.info("worker %s: orders %d..%d (%d samples) with version %d in %.1f s", name,
                 batch[0].id, batch[-1].id, len(samples), version, time.time() - t1)
  return False
