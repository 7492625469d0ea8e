"""Post-training (issue 14): SFT, verifiable environments and synchronous RL.

Modules:
  envs      verifiable environments (addition, countdown, strings, calculator): tasks, rewards,
            worked solutions; `envs.make(name, **options)`
  sft_data  the built-in SFT set: worked solutions of the environments written as jsonl
  algorithms  every policy loss and advantage (PPO + IcePop, the IS mask, GRPO, distillation)
  rl_step   the jitted RL train step on a rollout batch
  rollout   samples through the inference engine (token in, token out) and the batch builder
  loop      the synchronous generate -> score -> train loop

The chat format (roles, thinking blocks, tool calls, rendering and loss masks) lives in
`glm5_jax.data.chat`, because the data pipeline renders conversations for SFT and `data` may not
import `posttrain`.
"""
