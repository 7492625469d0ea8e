"""A sweep report's expected orderings (glm5_jax.sweeps.report) on made-up results, no training:
runs shorter than a check's `min_steps` read "too short to show", never "does not hold", and
the report says which orderings those are; the steps behind a run follow its starting runs; a
published report is rewritten from its own results.json."""

import json
import types

import ml_collections
import pytest

from glm5_jax.sweeps import report
from glm5_jax.sweeps.spec import check


def _train(name, steps, loss, init_from=""):
  return dict(kind="train", workdir=f"/s/runs/{name}", steps=steps, init_from=init_from,
              text_loss=loss, seconds=1.0)


def _runs(pretrain_steps, continue_steps):
  """baseline -> continued (init_from), baseline -> converted (a training-free eval)."""
  return dict(
      baseline=_train("baseline", pretrain_steps, 2.30),
      continued=_train("continued", continue_steps, 2.25, init_from="/s/runs/baseline/"),
      converted=dict(kind="eval", checkpoint="/s/runs/baseline", text_loss=2.40, seconds=1.0),
      scratch=_train("scratch", pretrain_steps, 2.20))


def test_steps_behind_a_run_include_the_runs_it_started_from():
  runs = _runs(3, 2)
  assert report.steps_behind("baseline", runs) == 3
  assert report.steps_behind("continued", runs) == 5
  assert report.steps_behind("converted", runs) == 3
  outside = dict(runs, other=_train("other", 2, 2.0, init_from="/elsewhere/run"))
  assert report.steps_behind("other", outside) is None  # unknown history: never "too short"


def test_a_quick_run_says_which_orderings_it_cannot_show():
  checks = [check("continued", "<", "baseline", metric="text_loss", min_steps=600),
            check("converted", "<", "scratch", metric="text_loss", min_steps=600),
            check("scratch", "<", "converted", metric="text_loss")]  # no min_steps: a verdict
  quick = report.evaluate_checks(checks, _runs(3, 2))
  assert [c["holds"] for c in quick] == [None, None, True]
  assert quick[0]["too_short"] == ("the shorter run has 3 training steps behind it, the "
                                   "ordering needs >= 600")
  text = report.sweep_markdown("demo", _runs(3, 2), quick, {"baseline": "done"}, [])
  assert "does not hold" not in text and text.count("too short to show (") == 2
  assert ("These runs are too short to show 2 of the 3 orderings: `continued < baseline` "
          "(text_loss), `converted < scratch` (text_loss).") in text

  full = report.evaluate_checks(checks, _runs(600, 300))
  assert [c["holds"] for c in full] == [True, False, True]
  assert not any(c.get("too_short") for c in full)
  text = report.sweep_markdown("demo", _runs(600, 300), full, {"baseline": "done"}, [])
  assert "too short" not in text and "| does not hold |" in text


# ---- over seeds ---------------------------------------------------------------------------------


def test_a_sweep_over_seeds_copies_each_run_per_seed_with_its_own_references():
  import ml_collections  # pylint: disable=g-import-not-at-top
  from glm5_jax.sweeps import spec  # pylint: disable=g-import-not-at-top
  sweep = ml_collections.ConfigDict(dict(name="t", base_config="configs.tiny", size={},
                                         suite={}, seeds=(3, 1)))
  sweep.runs = ml_collections.ConfigDict(dict(
      base=spec.train_run(overrides=dict(train=dict(steps=2))),
      conv=spec.eval_run(checkpoint="{base.workdir}", model=dict(attention_pattern="S")),
      later=spec.train_run(overrides=dict(train=dict(init_from="{base.workdir}/x")),
                           after=("conv",))))
  runs = spec.parse_runs(sweep)
  assert [r.name for r in runs] == ["base_seed3", "conv_seed3", "later_seed3", "base_seed1",
                                    "conv_seed1", "later_seed1"]
  by = {r.name: r for r in runs}
  assert by["base_seed1"].spec["overrides"] == dict(train=dict(steps=2), seed=1)
  assert by["conv_seed1"].spec["checkpoint"] == "{base_seed1.workdir}"
  assert by["conv_seed1"].depends_on == ("base_seed1",) and by["conv_seed1"].base == "conv"
  assert by["later_seed3"].spec["overrides"]["train"]["init_from"] == "{base_seed3.workdir}/x"
  assert by["later_seed3"].depends_on == ("base_seed3", "conv_seed3")
  assert len({r.spec_hash for r in runs}) == 6
  sweep.runs.base.overrides.seed = 5
  with pytest.raises(ValueError, match=r"sweep.runs.base.overrides.seed: sweep.seeds sets"):
    spec.parse_runs(sweep)
  sweep.seeds = (1, 1)
  with pytest.raises(ValueError, match=r"sweep.seeds: must be distinct ints >= 0"):
    spec.parse_runs(sweep)


def _seeded(name, seed, loss):
  return dict(_train(f"{name}_seed{seed}", 600, loss), seed=seed, seed_of=name)


def test_checks_over_seeds_are_decided_by_the_interval_of_the_paired_differences():
  # a beats b on every seed (paired), though the seeds' spread is larger than the gap;
  # c and a are apart by noise only.
  losses = dict(a=(2.00, 2.30, 2.10), b=(2.05, 2.36, 2.14), c=(2.10, 2.20, 2.05))
  runs = {f"{n}_seed{s}": _seeded(n, s, v[s]) for n, v in losses.items() for s in range(3)}
  checks = report.evaluate_checks(
      [check("a", "<", "b", metric="text_loss"), check("b", "<", "a", metric="text_loss"),
       check("a", "<", "c", metric="text_loss"),
       check("a", "~", "c", metric="text_loss", tolerance=0.5),
       check("a", "~", "b", metric="text_loss", tolerance=0.01)], runs)
  assert [c["holds"] for c in checks] == [True, False, None, True, False]
  assert checks[0]["seeds"] == 3 and checks[0]["difference"]["n"] == 3
  assert "difference -0.050 ± 0.025 (95% t, n=3)" in checks[0]["detail"]
  assert checks[2]["not_shown"] == "the interval of the difference straddles 0"
  text = report.sweep_markdown("demo", runs, checks, {}, [])
  assert "## Over seeds" in text and "| a |  | 3 | - | - | 2.133 ± 0.379 | - |" in text
  assert "not shown (the interval of the difference straddles 0)" in text
  one = report.evaluate_checks([check("a", "<", "b", metric="text_loss")],
                               {k: v for k, v in runs.items() if k.endswith("seed0")})
  assert one[0]["holds"] is None and one[0]["not_shown"] == "one seed: no interval"


def test_a_published_report_is_rewritten_from_its_own_results(tmp_path):
  sweep = ml_collections.ConfigDict(dict(size=dict(train_steps=600)))
  runs_in_order = [types.SimpleNamespace(name=n) for n in ("baseline", "continued", "gone")]
  with pytest.raises(FileNotFoundError, match="neither runs/ nor results.json"):
    report.stored_results(sweep, str(tmp_path), runs_in_order)
  (tmp_path / "results.json").write_text(json.dumps(dict(size=dict(train_steps=600),
                                                         runs=_runs(600, 300))))
  stored = report.stored_results(sweep, str(tmp_path), runs_in_order)
  assert stored == {n: _runs(600, 300)[n] for n in ("baseline", "continued")}
  sweep.size.train_steps = 3
  with pytest.raises(ValueError, match=r"results.json: written at size .* pass the report's "
                     r"--sweep.size.\* \(train_steps\)"):
    report.stored_results(sweep, str(tmp_path), runs_in_order)
