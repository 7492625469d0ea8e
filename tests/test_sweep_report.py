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
