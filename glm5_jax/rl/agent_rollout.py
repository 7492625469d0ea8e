"""RL episodes played by an agent program against a server, trained from the gateway's records.

The rollout worker's path for agents written against the OpenAI API (GLM-5's RL setup: the
agent talks text, the gateway keeps the tokens). `agent_samples` plays G episodes of each task
at once (threads: the server batches their calls continuously), each as the agent program
(default the env's, `AGENTS`) with its own trajectory id; when an episode ends it
finishes the trajectory on the server (`POST /v1/trajectories/{id}/finish`), reads its records,
scores the agent's transcript with the environment, and builds the training sample from the
records alone (`gateway.to_sample`: the sampled ids and their log-probs, never the agent's
text). `to_trajectory_records` turns them into the asynchronous trainer's rollout records with
each token's param version, so a server whose params switched mid-episode
(`glm5_jax.rl.serve_policy`) gives each token the version that sampled it.

A rollout worker with `rl.rollout_via = "gateway"` runs this against its own server
(`glm5_jax.rl.agent_server`), with the agent program of the run's environment (`AGENTS`).
"""

import concurrent.futures
import uuid

import httpx
import openai

from glm5_jax.posttrain.envs import calculator_agent, repo_repair_agent
from glm5_jax.rl.trajectories import TrajectoryRecord
from glm5_jax.seeds import derive_seed
from glm5_jax.serve.gateway import records_from_json, to_sample

# The built-in agent program of each environment (`posttrain.config.AGENT_ENVS` names them):
# `agent(client, env, task, *, model, trajectory_id, max_turns, max_tokens, temperature, top_p,
# seed, thinking) -> agent_chat.AgentResult`.
AGENTS = {"calculator": calculator_agent.play, "repo_repair": repo_repair_agent.play}


def score(env, task, transcript) -> tuple[float, bool, dict]:
  """(reward, correct, info) of an agent's transcript (env message form): the env's step on the
  conversation up to its last assistant message; an episode the env would continue (the agent
  stopped first) earns 0."""
  last = max((i for i, m in enumerate(transcript) if m["role"] == "assistant"), default=None)
  if last is None:
    return 0.0, False, {"error": "the agent made no call"}
  step = env.step(task, transcript[:last + 1])
  if not step.done:
    return 0.0, False, {"error": "the agent stopped before the env finished the episode"}
  return float(step.reward), bool(step.info.get("correct", False)), dict(step.info)


def agent_samples(base_url: str, env, tasks, *, group_size: int, seed: int,
                  model: str = "glm5-jax", agent=None,
                  max_turns: int | None = None, max_tokens: int = 64, temperature: float = 1.0,
                  top_p: float = 1.0, thinking: bool = True, threads: int = 16, run_id: str | None = None,
                  timeout_s: float = 600.0) -> list:
  """`[(Sample, versions int32 [n])]` for G episodes of each task, task-major (module
  docstring). `base_url`: the server's root (`http://host:port`); `agent`: the agent program
  (default `AGENTS[env.name]`)."""
  if agent is None:
    if env.name not in AGENTS:
      raise ValueError(f"agent_samples: env {env.name!r} has no built-in agent program "
                       f"(AGENTS: {sorted(AGENTS)}); pass agent=")
    agent = AGENTS[env.name]
  client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                         timeout=timeout_s)
  run_id = run_id or uuid.uuid4().hex[:12]
  episodes = [(g, j, task) for g, task in enumerate(tasks) for j in range(group_size)]

  def play(episode):
    g, j, task = episode
    tid = f"{run_id}-{task.env}-{task.split}-{task.index}-{j}"
    result = agent(client, env, task, model=model, trajectory_id=tid,
                   max_turns=max_turns or env.max_turns, max_tokens=max_tokens,
                   temperature=temperature, top_p=top_p,
                   seed=derive_seed(seed, task.env, task.split, task.index, j),
                   thinking=thinking)
    if result.turns == 0:
      raise ValueError(f"{task.env} task {task.index} ({task.split}): the server refused the "
                       f"agent's first call: its prompt + max_tokens {max_tokens} do not fit the "
                       "server's max_len (data.seq_len for a rollout worker)")
    with httpx.Client(base_url=base_url, timeout=timeout_s) as http:
      r = http.post(f"/v1/trajectories/{tid}/finish")
      r.raise_for_status()
      body = r.json()
      http.delete(f"/v1/trajectories/{tid}").raise_for_status()
    reward, correct, info = score(env, task, result.transcript)
    info = {**info, "mismatches": body["mismatches"], "aborted_calls": body["aborted"],
            "trajectory_id": tid, "truncated": result.context_full}
    return to_sample(records_from_json(body), task=task, group=g, reward=reward,
                     correct=correct, messages=result.transcript, info=info)

  with concurrent.futures.ThreadPoolExecutor(max(1, min(threads, len(episodes)))) as pool:
    return list(pool.map(play, episodes))


def to_trajectory_records(pairs, *, worker: str, order: int,
                          requeue_of: str = "") -> list[TrajectoryRecord]:
  """`agent_samples`' pairs -> the trainer's rollout records (`trajectories.write_batch`):
  tokens, raw log-probs on generated tokens, loss mask, each token's version, reward; meta as
  the engine path's (`worker.to_records`) plus `agent` and the gateway's `mismatches`."""
  out = []
  for j, (s, versions) in enumerate(pairs):
    meta = {"order": order, "task": s.task.index, "env": s.task.env, "sample": j,
            "correct": bool(s.correct), "turns": s.turns, "worker": worker, "agent": True,
            "requeue_of": requeue_of, "truncated": bool(s.info.get("truncated", False)),
            "mismatches": int(s.info.get("mismatches", 0))}
    out.append(TrajectoryRecord(s.tokens, s.rollout_logp * s.loss_mask, s.loss_mask, versions,
                                float(s.reward), meta, routing=s.routing))
  return out
