"""Sweeps: the shipped sweep configs build valid runs; dependencies order runs and feed them
(checkpoint -> search -> pattern); the quick attention-conversion sweep (the part with every
run kind) runs end to end, writes its report, resumes without redoing finished runs
(in-process, from the command line, and with worker processes), and refuses a changed spec."""

import importlib
import json
import os
import subprocess
import sys

import ml_collections
import pytest

from configs import tiny
from configs.sweeps import attention_conversion
from glm5_jax.config import ModelConfig
from glm5_jax.config_validation import validate_config
from glm5_jax.eval import checkpoints
from glm5_jax.sweeps import jobs as sweep_jobs, runner as sweep_runner, spec as sweep_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEPS = ("attention_conversion", "muon_split")


@pytest.mark.parametrize("arg", [None, "quick"])
@pytest.mark.parametrize("name", SWEEPS)
def test_shipped_sweep_configs_build_valid_runs(name, arg):
  sweep = importlib.import_module(f"configs.sweeps.{name}").get_config(arg)
  runs = sweep_spec.parse_runs(sweep)
  assert sweep.name == name and runs
  placeholders = {r.name: dict(workdir=r.name, pattern="M") for r in runs}
  seen, models = set(), {}
  for run in runs:
    assert set(run.depends_on) <= seen  # dependencies come first
    seen.add(run.name)
    spec = sweep_spec.substitute(run.spec, placeholders, run.name)
    if spec["kind"] == "train":
      config = sweep_spec.load_config(spec["config"])
      sweep_spec.apply_overrides(config, spec["overrides"], run.name)
      validate_config(config)
      assert config.optim.warmup_steps < config.train.steps
      models[run.name] = checkpoints.complete_model_config(config.model)
    else:  # the converted model of the checkpoint's run (workdir placeholders = run names)
      ModelConfig.from_config(checkpoints.apply_model_overrides(
          models[spec["checkpoint"]], spec["model"]))
  if name == "attention_conversion":
    deps = {r.name: r.depends_on for r in runs}
    assert deps["trained_dsa"] == ("dsa_warmup",) and deps["dsa_warmup"] == ("baseline",)
    assert deps["trained_swa_searched"] == ("baseline", "swa_search")
  for c in sweep.checks:
    assert c["left"] in seen and c["right"] in seen


def test_spec_errors_name_the_run():
  def sweep_with(**runs):
    sweep = ml_collections.ConfigDict(dict(name="t", base_config="configs/tiny.py",
                                           size={}, suite={}))
    sweep.runs = ml_collections.ConfigDict(runs)
    return sweep
  ok = sweep_spec.train_run()
  with pytest.raises(ValueError, match=r"sweep.runs.b: depends on unknown runs \['zz'\]"):
    sweep_spec.parse_runs(sweep_with(a=ok, b=sweep_spec.eval_run(checkpoint="{zz.workdir}")))
  with pytest.raises(ValueError, match="dependency cycle"):
    sweep_spec.parse_runs(sweep_with(a=sweep_spec.train_run(after=("b",)),
                                     b=sweep_spec.train_run(after=("a",))))
  with pytest.raises(ValueError, match="sweep.runs.a.kind"):
    sweep_spec.parse_runs(sweep_with(a=dict(ok, kind="dance")))
  config = tiny.get_config()
  with pytest.raises(ValueError, match=r"run\.model\.n_layers: the experiment config has no"):
    sweep_spec.apply_overrides(config, {"model": {"n_layers": 2}}, "run")
  results = {"a": {"workdir": "/w", "pattern": "SM"}}
  assert sweep_spec.substitute({"x": "{a.pattern}", "y": ["at {a.workdir}/c"]}, results, "r") \
      == {"x": "SM", "y": ["at /w/c"]}
  with pytest.raises(KeyError, match="no result field 'score'"):
    sweep_spec.substitute("{a.score}", results, "r")



def test_config_references_resolve_by_module_or_path(tmp_path, monkeypatch):
  resolve, load = sweep_spec.resolve_config_ref, sweep_spec.load_config
  assert resolve("configs.tiny:attention=G") == "configs.tiny:attention=G"
  assert load("configs.tiny:attention=G").model.attention_pattern == "G"
  tiny_py = os.path.join(ROOT, "configs", "tiny.py")
  monkeypatch.chdir(ROOT)  # a path relative to the working directory
  assert resolve("configs/tiny.py:attention=G") == tiny_py + ":attention=G"
  assert load(resolve("configs/tiny.py:G")).model.attention_pattern == "G"
  monkeypatch.chdir(tmp_path)  # elsewhere: relative to the sweep config's directory
  sweeps_dir = os.path.join(ROOT, "configs", "sweeps")
  assert resolve("../tiny.py", sweeps_dir) == tiny_py
  with pytest.raises(FileNotFoundError, match=r"sweep.runs.a.config: config file "
                     r"'configs/tiny.py' not found \(looked for .* and .*configs/sweeps/"):
    resolve("configs/tiny.py", sweeps_dir, "sweep.runs.a.config")
  with pytest.raises(ModuleNotFoundError, match=r"sweep.runs.a.config: config module "
                     r"'configs.tinny' not found"):
    load("configs.tinny", "sweep.runs.a.config")

CONVERSION = os.path.join(ROOT, "configs", "sweeps", "attention_conversion.py")
# Every run kind and dependency: baseline -> swa_search -> {free, trained}_swa_searched.
ONLY = "free_swa_searched,trained_swa_searched"
RUNS = ["baseline", "swa_search", "free_swa_searched", "trained_swa_searched"]


def run_cli(sweep_dir, *extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "sweep.py"),
                         f"--sweep={CONVERSION}:quick", f"--only={ONLY}",
                         f"--sweep_dir={sweep_dir}", *extra],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc.stdout + proc.stderr


def mtimes(sweep_dir):
  runs = os.path.join(sweep_dir, "runs")
  return {n: os.path.getmtime(os.path.join(runs, n, "result.json")) for n in os.listdir(runs)
          if os.path.exists(os.path.join(runs, n, "result.json"))}


@pytest.mark.slow  # the sweep CLI in subprocesses, training and evaluating four runs
def test_quick_sweep_end_to_end_then_resume(tmp_path, monkeypatch):
  sweep_dir = str(tmp_path / "sweep")
  run_cli(sweep_dir)
  with open(os.path.join(sweep_dir, "results.json")) as f:
    report = json.load(f)
  assert report["status"] == dict.fromkeys(RUNS, "done")
  results = report["runs"]
  pattern = results["swa_search"]["pattern"]
  assert len(pattern) == 2 and pattern.count("S") == 1 and set(pattern) == {"M", "S"}
  assert results["swa_search"]["evaluations"] == 2
  assert results["free_swa_searched"]["attention_pattern"] == pattern
  assert results["free_swa_searched"]["suite"]["meta"]["converted"]
  trained = results["trained_swa_searched"]
  assert trained["init_from"] == results["baseline"]["workdir"]
  assert trained["attention_pattern"] == pattern and trained["steps"] == 2
  assert results["baseline"]["steps"] == 3 and results["baseline"]["loss_curve"]
  assert results["baseline"]["text_loss"] is not None  # held-out eval at the last step
  for name in ("baseline", "free_swa_searched", "trained_swa_searched"):
    for ext in ("json", "md"):
      assert os.path.exists(os.path.join(sweep_dir, "runs", name, f"eval.{ext}"))
  with open(os.path.join(sweep_dir, "results.md")) as f:
    text = f.read()
  assert "| free_swa_searched | swa_searched | training-free |" in text
  assert f"**`{pattern}`**" in text and "## Expected orderings" in text

  # Resume in-process: a finished run is never redone; only the missing one runs.
  sweep = attention_conversion.get_config("quick")
  os.remove(os.path.join(sweep_dir, "runs", "free_swa_searched", "result.json"))
  before = mtimes(sweep_dir)
  monkeypatch.setattr(sweep_jobs, "train_job", lambda *a: pytest.fail("train redone"))
  monkeypatch.setattr(sweep_jobs, "search_job", lambda *a: pytest.fail("search redone"))
  again = sweep_runner.run_sweep(sweep, sweep_dir, only=ONLY.split(","))
  assert not again.failed and set(again.results) == set(RUNS)
  assert again.results["free_swa_searched"]["score"] == results["free_swa_searched"]["score"]
  after = mtimes(sweep_dir)
  assert {n for n in after if after.get(n) != before.get(n)} == {"free_swa_searched"}

  # From the command line with worker processes for the one unfinished run, then once more
  # with nothing left to do.
  os.remove(os.path.join(sweep_dir, "runs", "free_swa_searched", "result.json"))
  before = mtimes(sweep_dir)
  run_cli(sweep_dir, "--parallel=2")
  after = mtimes(sweep_dir)
  assert set(after) == set(RUNS) and all(after[n] == before[n] for n in before)
  assert os.path.exists(os.path.join(sweep_dir, "runs", "free_swa_searched", "log.txt"))
  output = run_cli(sweep_dir)
  assert "4/4 runs already finished" in output and mtimes(sweep_dir) == after

  # A changed spec is refused, naming the run.
  sweep.size.pretrain_steps = 5
  with pytest.raises(sweep_runner.SweepError, match="run 'baseline' finished with a different"):
    sweep_runner.run_sweep(sweep, sweep_dir, only=ONLY.split(","))


def test_failed_run_blocks_only_its_dependents(tmp_path):
  sweep = ml_collections.ConfigDict(dict(name="t", base_config="configs/tiny.py", size={},
                                         suite={}))
  sweep.suite = ml_collections.ConfigDict(dict(tasks=("niah_single",)))
  sweep.runs = ml_collections.ConfigDict(dict(
      broken=sweep_spec.eval_run(checkpoint=str(tmp_path / "no_such_run")),
      after_broken=sweep_spec.eval_run(checkpoint="{broken.workdir}"),
      other=sweep_spec.search_run(checkpoint=str(tmp_path / "also_missing"))))
  outcome = sweep_runner.run_sweep(sweep, str(tmp_path / "sweep"))
  assert set(outcome.failed) == {"broken", "after_broken", "other"}
  assert "FileNotFoundError" in outcome.failed["broken"]
  assert outcome.failed["after_broken"] == "blocked by ['broken']"
  with open(tmp_path / "sweep" / "runs" / "broken" / "error.txt") as f:
    assert "no_such_run" in f.read()
  with pytest.raises(sweep_runner.SweepError, match="broken: FileNotFoundError"):
    outcome.raise_if_failed()
