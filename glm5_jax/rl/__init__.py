"""Asynchronous RL across slices (issue 15): the pieces the trainer, the rollout workers and the
launcher share.

  param_sync     the trainer publishes policy versions through orbax; workers restore them
                 with their own shardings (PolicyPublisher, PolicySubscriber)
  trajectories   durable rollout batch files and the trainer's exactly-once ledger
  staleness      version-gap admission, AReaL's capacity rule (the IS loss: posttrain/algorithms.py)
  routing        rollout id -> worker by consistent hashing with bounded loads
"""
