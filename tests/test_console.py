"""The entry points' console helpers (glm5_jax.train.console): library INFO hidden (jax's TPU
probe, orbax), the slow-compile notices (lines when a compile runs long, none for fast ones),
both set up by every entry point, and the run summary's lines."""

import json
import logging
import os
import pathlib
import threading

import jax
import jax.numpy as jnp
import pytest

from glm5_jax.train import console, stopping

EXPERIMENTS = pathlib.Path(__file__).resolve().parent.parent / "experiments"


def _record(path: str, level: int) -> logging.LogRecord:
  return logging.LogRecord("absl", level, path, 1, "message", None, None)


def test_library_info_is_dropped_and_warnings_kept():
  keep = console._DropLibraryInfo().filter  # pylint: disable=protected-access
  probe = os.path.join("site-packages", "jax", "_src", "xla_bridge.py")
  orbax = os.path.join("site-packages", "orbax", "checkpoint", "saver.py")
  assert not keep(_record(probe, logging.INFO))  # "Unable to initialize backend 'tpu'"
  assert not keep(_record(orbax, logging.INFO))
  assert keep(_record(probe, logging.WARNING)) and keep(_record(orbax, logging.ERROR))
  assert keep(_record(os.path.join("glm5_jax", "train", "loop.py"), logging.INFO))


def test_every_entry_point_hides_library_info_and_announces_compiles():
  # Entry points are the scripts that run (`app.run`); model_flags.py is the flags they share.
  # Those running a training loop do both through `console.run_training_job`.
  scripts = sorted(p for p in EXPERIMENTS.glob("*.py")
                   if 'if __name__ == "__main__":' in p.read_text(encoding="utf-8"))
  assert len(scripts) >= 8
  for script in scripts:
    text = script.read_text(encoding="utf-8")
    if "console.run_training_job(" in text:
      continue
    assert "console.quiet_library_info()" in text, script.name
    assert "console.announce_slow_compiles()" in text, script.name


def test_run_training_job_prints_the_summary_last_and_exits_75_when_stopped(monkeypatch, capsys):
  """The summary for people, then the JSON line scripts read (without `last_metrics`), last;
  a loop stopped early exits with `EXIT_STOPPED_EARLY`."""
  monkeypatch.setattr(console, "announce_slow_compiles", lambda: None)  # no listener thread
  summary = dict(steps=40, total_steps=40, stopped_early=False, stop_reason=None,
                 first_loss=5.9, last_loss=1.2, tokens_per_sec=None, eval=None,
                 checkpoints="/w/checkpoints", metrics_file="/w/metrics.jsonl",
                 last_metrics={"loss": 1.2})
  console.run_training_job(lambda: summary, "SFT")
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[:2] == ["== SFT summary ==", "steps: 40 of 40"]
  assert json.loads(lines[-1]) == {k: v for k, v in summary.items() if k != "last_metrics"}
  with pytest.raises(SystemExit) as stopped:
    console.run_training_job(lambda: dict(summary, steps=7, stopped_early=True,
                                          stop_reason="SIGTERM"))
  assert stopped.value.code == stopping.EXIT_STOPPED_EARLY
  assert "== training summary ==" in capsys.readouterr().out


def _notices(after_s=5.0):
  lines = []
  return console.CompileNotices(after_s, log=lines.append), lines


HINT = " (XLA compiles each program on its first call: minutes on CPU)"


def test_a_slow_compile_gets_a_start_and_an_end_line():
  notices, lines = _notices()
  notices.started("jit(train_step)", start=100.0)
  notices.announce_due(now=104.0)  # not yet slow: nothing
  assert lines == []
  notices.announce_due(now=105.5)
  notices.announce_due(now=130.0)  # announced once, not every poll
  notices.finished("jit(train_step)", 93.6)
  assert lines == ["compiling jit(train_step) ..." + HINT, "compiled jit(train_step) (94 s)"]


def test_fast_compiles_stay_quiet_and_only_the_first_line_explains():
  notices, lines = _notices()
  notices.started("jit(convert_element_type)", start=0.0)
  notices.finished("jit(convert_element_type)", 0.01)  # done before any poll saw it
  notices.announce_due(now=60.0)
  for start in (100.0, 200.0):  # the dense phase's train step, then the top-k one: same name
    notices.started("jit(train_step)", start=start)
    notices.announce_due(now=start + 10)
    notices.finished("jit(train_step)", 30.0)
  assert lines == ["compiling jit(train_step) ..." + HINT, "compiled jit(train_step) (30 s)",
                   "compiling jit(train_step) ...", "compiled jit(train_step) (30 s)"]


def test_compiles_on_two_threads_are_told_apart():
  notices, lines = _notices()
  notices.started("jit(a)", start=0.0)
  other = threading.Thread(target=notices.started, args=("jit(b)", 0.0))
  other.start()
  other.join()
  notices.finished("jit(b)", 9.0)  # this thread never compiled jit(b): not its end
  notices.announce_due(now=6.0)
  notices.finished("jit(a)", 7.0)
  assert lines == ["compiling jit(a) ..." + HINT, "compiling jit(b) ...", "compiled jit(a) (7 s)"]


def test_jax_reports_compiles_to_the_notices():
  """jax's monitoring events reach the notices (the event name is jax's internal one: a rename
  in a newer jax would silence every notice without this test)."""
  notices, lines = _notices(after_s=0.0)

  def some_named_program(x):
    return jnp.sin(x) * 3

  real_started = notices.started

  def started_then_announce(name, start):
    real_started(name, start)
    notices.announce_due(now=start)  # as the watcher would, once the compile has begun

  notices.started = started_then_announce
  notices.listen()
  try:
    jax.jit(some_named_program)(jnp.arange(5.0)).block_until_ready()
  finally:
    notices.stop_listening()
  assert any(line.startswith("compiling jit(some_named_program) ...") for line in lines)
  assert any(line.startswith("compiled jit(some_named_program) (") for line in lines)


def test_summary_lines_read_like_the_training_summary():
  summary = dict(steps=40, total_steps=40, stopped_early=False, stop_reason=None,
                 first_loss=5.91234, last_loss=1.23456, tokens_per_sec=12345.6,
                 eval={"lm_loss": 1.5, "copy/accuracy": 0.25}, checkpoints="/w/checkpoints",
                 metrics_file="/w/metrics.jsonl")
  lines = console.summary_lines(summary, "SFT")
  assert lines == ["== SFT summary ==", "steps: 40 of 40", "loss: first 5.9123 -> last 1.2346",
                   "throughput: 12,346 tokens/s", "eval copy/accuracy: 0.2500",
                   "eval lm_loss: 1.5000", "checkpoints: /w/checkpoints",
                   "metrics: /w/metrics.jsonl (and TensorBoard in the same workdir)"]
  stopped = console.summary_lines(dict(summary, steps=7, stopped_early=True,
                                       stop_reason="SIGTERM", eval=None, tokens_per_sec=None))
  assert stopped[:3] == ["== training summary ==", "steps: 7 of 40", "stopped early (SIGTERM); "
                         "rerun with the same --workdir to resume"]
