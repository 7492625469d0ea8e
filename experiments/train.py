"""Train GLM-5: the project's main job.

  python experiments/train.py                       # tiny GLM-5 on CPU into workdir/tiny, ~5 min
  python experiments/train.py --workdir=workdir/tiny --config.train.steps=2000  # on to 2000
  python experiments/train.py --config=configs/tiny.py --workdir=workdir/tiny_lr1e-3 \
      --config.optim.learning_rate=1e-3
  python experiments/train.py --config=configs/dsa_adaptation.py:warmup --workdir=workdir/warmup \
      --config.train.init_from=workdir/tiny_mla

With no flags it trains the tiny GLM-5 (MoE + MLA + DSA with top-k < sequence + 3 shared MTP
depths, Muon Split; attention dense for the first 300 of 600 steps while the indexers learn,
then top-k) on the built-in data mix (synthetic copy and long-context retrieval tasks and the
Python standard library's own source text) and prints a summary. Re-running with the same
--workdir resumes from its latest checkpoint. Launched as several processes (TPU pods, multi-
host GPU, SLURM), it calls `jax.distributed.initialize()` first, which finds the coordinator
and its process id from the cluster; elsewhere (several CPU processes, a hand-rolled launcher)
set all three of JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and JAX_PROCESS_ID in
each process. The same script and config run on 1 CPU, 8 simulated devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8), several CPU processes, a GPU or a pod.

Exit status:
  0   trained to `train.steps`
  75  stopped early (SIGTERM, e.g. a preemption, on any process): the checkpoint of the step
      it stopped at is committed; rerun the same command to resume (`EXIT_STOPPED_EARLY`,
      sysexits' EX_TEMPFAIL)
  1   failed; the last line on stderr is the root cause
"""

from absl import app, flags

from configs import overrides
from glm5_jax.train import console, multiprocess
from glm5_jax.train.loop import train

_CONFIG = overrides.define_config_file("config", "configs/tiny.py", "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", "workdir/tiny", "Checkpoints, metrics.jsonl and "
                               "TensorBoard logs go here; an existing one is resumed.")


def main(argv):
  del argv
  if multiprocess.launched_multiprocess():
    multiprocess.initialize_distributed()
  console.run_training_job(lambda: train(_CONFIG.value, _WORKDIR.value))


if __name__ == "__main__":
  app.run(main, flags_parser=overrides.parse_flags)
