"""Long-context attention conversion (docs/reference.md section 3, report Tables 4-5), tiny scale.

  python experiments/sweep.py --sweep=configs/sweeps/attention_conversion.py        # ~22 min
  python experiments/sweep.py --sweep=configs/sweeps/attention_conversion.py:quick
  python experiments/sweep.py --sweep=configs/sweeps/attention_conversion.py \
      --sweep.size.continue_steps=600 --sweep.size.sliding_window=32

Pretrain a full-attention baseline (dense MLA, pattern M) on the default tiny mixture, then
convert half its layers (GDN N, SimpleGDN L, SWA S interleaved or at the layers the beam search
picks) or all of them (DSA D) and evaluate each variant on the retrieval suite at 1x-8x the
training length twice: training-free (the baseline's params, new parts freshly initialized)
and after the same continued-training budget (`train.init_from` = the baseline). DSA goes
through its two stages (configs/dsa_adaptation.py, stage warmup then sparse; the warm-up trains
only the indexers and is extra to the budget). `dense_continued` continues the baseline itself
for the same budget, the control DSA is compared with. The report's ordering: SWA interleave
collapses past its window, searched SWA is much better, DSA stays within noise of dense.

Runs (dependencies in brackets):
  baseline                   pretrain M
  swa_search                 [baseline] beam search: which layers become S
  free_<variant>             [baseline (+ swa_search)] training-free eval
  dense_continued            [baseline] continued training, M
  trained_<variant>          [baseline (+ swa_search)] continued training, then eval
  dsa_warmup -> trained_dsa  [baseline] indexer warm-up, then sparse adaptation

Default size: measured 21.6 min wall on an idle 2-core CPU (baseline 600 steps 241 s, each
300-step continued run 128-176 s, DSA warm-up 62 s, each training-free suite evaluation 19-26 s,
SWA search 10 s); results in docs/ablations.md.

`arg`: "quick" = 2 dense-FFN layers without MTP, batch 2, a few steps, 2 lengths, 1 example per
cell: the plumbing end to end in minutes (tests/test_sweep.py runs part of it); its report marks
every ordering "too short to show" (each check's `min_steps`).
"""

import ml_collections

from configs.common import parse_arg
from glm5_jax.eval.suite import suite_config
from glm5_jax.sweeps.spec import check, eval_run, search_run, train_run


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  quick = parse_arg(arg, quick=False).quick
  num_layers = 2 if quick else 4
  c = ml_collections.ConfigDict()
  c.name = "attention_conversion"
  c.base_config = "configs.tiny:attention=M"
  c.size = ml_collections.ConfigDict(dict(
      pretrain_steps=3 if quick else 600,
      continue_steps=2 if quick else 300,
      dsa_warmup_steps=2 if quick else 100,
      batch_size=2 if quick else 8,
      sliding_window=32 if quick else 64,  # S layers: keys each query sees (train length 256)
      examples_per_cell=1 if quick else 2,
      # The one length the SWA search scores at: the training length, where the 4-layer window-64
      # model still has retrieval signal (the tiny baseline does not extrapolate past it).
      search_length=256,
  ))
  size = lambda name: c.size.get_ref(name)
  c.suite = suite_config(
      examples_per_cell=size("examples_per_cell"),
      depths=(0.5,) if quick else (0.0, 0.5, 1.0),
      length_multiples=(1, 2) if quick else (1, 2, 4, 8))
  model = dict(attention_pattern="M")
  if quick:  # 2 dense-FFN layers, no MTP: compiles fast
    model.update(num_hidden_layers=num_layers, first_k_dense_replace=num_layers, mtp_depths=0)
  optim = dict(warmup_steps=1) if quick else {}  # the configs' warm-ups exceed quick runs
  common = lambda pattern, **train: dict(
      model=dict(model, attention_pattern=pattern, sliding_window=size("sliding_window")),
      data=dict(batch_size=size("batch_size")), train=train, optim=optim)
  half = num_layers // 2

  runs = ml_collections.ConfigDict()
  runs.baseline = train_run(overrides=common("M", steps=size("pretrain_steps")),
                            group="baseline", variant="dense MLA (baseline)")
  runs.swa_search = search_run(
      checkpoint="{baseline.workdir}", model=dict(sliding_window=size("sliding_window")),
      num_convert=half, beam_width=8, layers_per_step=1 if quick else 2,
      length=size("search_length"), suite=dict(
          tasks=("niah_single", "niah_multikey", "niah_multiquery", "mqar"),
          depths=(0.0, 0.5, 1.0), examples_per_cell=1 if quick else 4))
  variants = dict(
      swa_interleave="SM" * half,
      swa_searched="{swa_search.pattern}",
      gdn="NM" * half,
      simple_gdn="LM" * half,
      dsa="D",
  )
  for variant, pattern in variants.items():
    runs[f"free_{variant}"] = eval_run(
        checkpoint="{baseline.workdir}", group="training-free", variant=variant,
        model=dict(attention_pattern=pattern, sliding_window=size("sliding_window")))
  runs.dense_continued = train_run(
      overrides=common("M", steps=size("continue_steps"), init_from="{baseline.workdir}"),
      group="continued training", variant="dense (M)")
  for variant, pattern in variants.items():
    if variant == "dsa":
      continue
    runs[f"trained_{variant}"] = train_run(
        overrides=common(pattern, steps=size("continue_steps"),
                         init_from="{baseline.workdir}"),
        group="continued training", variant=variant)
  runs.dsa_warmup = train_run(
      config="configs.dsa_adaptation:stage=warmup",
      overrides=common("D", steps=size("dsa_warmup_steps"), init_from="{baseline.workdir}"),
      evaluate=False)
  runs.trained_dsa = train_run(
      config="configs.dsa_adaptation:stage=sparse",
      overrides=common("D", steps=size("continue_steps"), init_from="{dsa_warmup.workdir}"),
      group="continued training", variant="dsa")
  c.runs = runs

  # Retrieval orderings need a model that retrieves: the tiny baseline scores 0 on the suite
  # after 600 steps and 8-39% at the training length after 900 (docs/ablations.md).
  retrieves = 900
  c.checks = (
      check("free_swa_interleave", "<", "baseline", metric="longest", min_steps=retrieves,
            note="SWA interleave collapses past its window (training-free)"),
      check("free_swa_searched", ">", "free_swa_interleave", metric="longest",
            min_steps=retrieves, note="searched SWA much better than interleaved "
            "(training-free)"),
      check("trained_swa_searched", ">", "trained_swa_interleave", metric="longest",
            min_steps=retrieves, note="searched SWA better than interleaved after continued "
            "training"),
      check("trained_dsa", "~", "dense_continued", metric="score", min_steps=retrieves,
            note="DSA within noise of dense (same continued-training budget)"),
  )
  return c
