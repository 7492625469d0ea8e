"""Post-training (issue 14): SFT, verifiable environments and synchronous RL.

Modules:
  envs        verifiable environments (addition, countdown, strings, calculator, echo, code,
              repo_repair): tasks, rewards, worked solutions, `envs.make(name, **options)`;
              each agent program beside its environment (`calculator_agent`, ...)
  sft         SFT: the pre-training loop on chat_jsonl sources, with the `sft` section
  sft_data    the built-in SFT set: worked solutions of the environments written as jsonl
  config      the `rl` section: defaults (`rl_config`) and checks (`validate_rl_config`)
  rl_config_checks  the whole RL experiment config, checked once before anything is built
  algorithms  every policy loss and advantage by name (PPO + IcePop, the IS loss of
              asynchronous RL, GRPO, distillation); `glm5_jax.rl` imports it, never the reverse
  rl_step     the jitted RL train step on a rollout batch, and the teacher's log-probs
  rollout     samples through the inference engine (token in, token out) and the batch builder
  rl_run      an RL run, whichever loop drives it (the synchronous `loop`, the asynchronous
              `glm5_jax.rl.async_trainer`): harness, start, checkpoints, held-out evaluation,
              each step's record, the summary
  rl_update   one RL update on a step's samples: scoring, signal metrics, the train steps
  loop        the synchronous generate -> score -> train loop

The chat format (roles, thinking blocks, tool calls, rendering and loss masks) lives in
`glm5_jax.data.chat`, because the data pipeline renders conversations for SFT and `data` may not
import `posttrain`.
"""
