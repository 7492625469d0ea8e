"""Asynchronous RL across slices (issue 15): the trainer, the rollout workers, the launcher and
the pieces they share through one run directory (`experiments/rl.py --mode=async`).

  layout         the run directory's paths: the only thing the processes share
  param_sync     the trainer publishes policy versions through orbax; workers restore them
                 with their own shardings (PolicyPublisher, PolicySubscriber)
  trajectories   durable rollout batch files and the trainer's exactly-once ledger
  orders         rollout orders from the trainer to the workers, as files
  orchestrator   the trainer's orchestrator: which orders to issue, to which worker, and when
  staleness      version-gap admission, AReaL's capacity rule (the IS loss itself is
                 `glm5_jax.posttrain.algorithms.is_policy_loss`)
  routing        rollout id -> worker by consistent hashing with bounded loads
  async_trainer  the trainer's loop: consumes rollout files, trains, publishes versions
  worker         a rollout worker's loop: orders in, rollout files out
  launcher       one machine: starts the trainer and the workers, restarts a worker that dies
  serve_policy   a server that loads each newly published policy version while serving
  agent_rollout  agent episodes against a server, trained from the gateway's records (the
                 agent programs live beside their environments: posttrain/envs/*_agent.py)
  agent_server   a rollout worker's own OpenAI-compatible server, for agent episodes
"""
