"""Verifiable environments: deterministic tasks, rewards and worked solutions (see `base`).

  make(name, **options) -> Env     one of NAMES, options validated (ValueError naming the option)
  NAMES                            "addition", "countdown", "strings", "calculator", "echo",
                                   "code", "repo_repair"
  Env.task(index, split) -> Task   deterministic; train and eval never share a problem
  Env.step(task, messages) -> Step reward in [0, 1] or an observation; never raises on model text
  Env.worked_solution(task)        the conversation (short thinking) that earns reward 1
  replay(env, task, messages)      steps an env through a whole conversation -> the last Step

Examples (prompt -> answer): addition "23+45=" -> "68"; countdown "Make 17 from 3 4 5 with
+ - * /" -> "3*4+5"; strings "reverse: abcde" -> "edcba"; calculator "What is 483*271?" ->
tool call "calc(483*271)", observation "130893", answer "130893"; echo "copy: qwhzk" -> "qwhzk"
(heavy-tailed lengths, for benchmarking long-tailed rollouts); code "Write a Python function
f(x) that returns ..." -> the function, scored by hidden tests in the sandbox; repo_repair (a
generated repository with a failing test) -> read_file / write_file / run_tests tool calls, then
"done", scored by hidden tests on the final repository.

An environment with an agent program for rollouts through an OpenAI-compatible server
(`rl.rollout_via="gateway"`) has it beside it: `calculator_agent`, `repo_repair_agent` (the
`openai` client and the env's own tools; `agent_chat`: one call, shared by both). They are not
imported here: the `openai` client is needed only where an agent runs.
"""

from glm5_jax.posttrain.envs.addition import Addition
from glm5_jax.posttrain.envs.base import SPLITS, Env, Step, Task, replay, split_of
from glm5_jax.posttrain.envs.calculator import Calculator
from glm5_jax.posttrain.envs.code import Code
from glm5_jax.posttrain.envs.countdown import Countdown
from glm5_jax.posttrain.envs.echo import Echo
from glm5_jax.posttrain.envs.repo_repair import RepoRepair
from glm5_jax.posttrain.envs.strings import Strings

REGISTRY = {env.name: env for env in (Addition, Countdown, Strings, Calculator, Echo, Code,
                                      RepoRepair)}
NAMES = tuple(REGISTRY)


def make(name: str, **options) -> Env:
  if name not in REGISTRY:
    raise ValueError(f"unknown environment {name!r}; expected one of {NAMES}")
  return REGISTRY[name](**options)
