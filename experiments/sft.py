"""Supervised fine-tuning on chat conversations (the first post-training stage).

  python experiments/sft.py                                         # built-in addition set
  python experiments/sft.py --config=configs/sft_tiny.py --workdir=/tmp/glm5_sft
  python experiments/sft.py --config=configs/sft_tiny.py:envs=addition+calculator,steps=600
  python experiments/sft.py --config=configs/sft_tiny.py \
      --config.data.sources.sft.glob='/data/chats/*.jsonl' --workdir=/tmp/glm5_sft_own

Trains with the pre-training loop (`glm5_jax.train.loop.train`: orbax checkpoints and exact
resume, Muon Split, metrics.jsonl, progress lines) on `chat_jsonl` sources, whose loss mask
is 1 on the assistant's tokens only. A `chat_jsonl` source with an empty glob reads the built-in
set, the worked solutions of `config.sft.envs`, written first to `<workdir>/sft_builtin.jsonl`
(`glm5_jax.posttrain.sft`); nothing is downloaded. Re-running with the same --workdir resumes.
The result is the starting point of experiments/rl.py (`--config.rl.init_from=<workdir>`).

Exit status: 0 trained to `train.steps`; 75 stopped early (SIGTERM), rerun to resume; 1 failed.
"""

from absl import app, flags

from configs import overrides
from glm5_jax.posttrain.sft import run_sft
from glm5_jax.train import console

_CONFIG = overrides.define_config_file("config", "configs/sft_tiny.py", "SFT config.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/glm5_sft", "Checkpoints, metrics.jsonl and the "
                               "built-in dataset go here; an existing one is resumed.")


def main(argv):
  del argv
  console.run_training_job(lambda: run_sft(_CONFIG.value, _WORKDIR.value), "SFT")


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
