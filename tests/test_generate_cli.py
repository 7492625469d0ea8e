"""experiments/generate.py and what it stands on: the model sources (`infer.loading`), the
prompts file schema (`infer.prompts`), and the CLI end to end on a run's checkpoint."""

import json
import os
import re
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.data import make_tokenizer
from glm5_jax.infer.loading import load_model
from glm5_jax.infer.prompts import read_prompts_file
from glm5_jax.train import checkpoint as ckpt
from glm5_jax.train.state import TrainState
from tests.conftest import random_params
from tests.test_train import ROOT, small_config

TOK = make_tokenizer("byte")
SCRIPT = os.path.join(ROOT, "experiments", "generate.py")


def _write_checkpoint(workdir, config, params):
  """A training checkpoint as the trainer writes it (`ckpt.save`: params, a stand-in optimizer
  state, meta with the config and fingerprints, the data position), without training."""
  manager = ckpt.make_manager(workdir, every_steps=1, keep=1, async_save=False)
  data = iter(grain.MapDataset.range(10).to_iter_dataset())
  state = TrainState(step=jnp.int32(3), params=params, opt_state={"count": jnp.zeros(())},
                     rng=jax.random.key_data(jax.random.key(0)))
  ckpt.save(manager, state, data, config, force=True)
  manager.wait_until_finished()
  manager.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  config = small_config()
  from glm5_jax.config import ModelConfig
  params = random_params(ModelConfig.from_config(config.model), seed=1)
  workdir = str(tmp_path_factory.mktemp("run"))
  _write_checkpoint(workdir, config, params)
  return workdir, config, params


def test_workdir_source_serves_the_checkpointed_params(run_dir):
  workdir, config, params = run_dir
  served = load_model(workdir=workdir)
  assert served.model.num_hidden_layers == 2 and "step 3" in served.source
  assert repr(served.tokenizer) == repr(make_tokenizer(config.data.tokenizer))
  for got, want in zip(jax.tree.leaves(served.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(got, want)


def test_model_sources_are_checked(tmp_path, run_dir):
  with pytest.raises(ValueError, match="exactly one model source.*got none"):
    load_model()
  with pytest.raises(ValueError, match=r"exactly one.*\['workdir', 'hf_path'\]"):
    load_model(workdir=run_dir[0], hf_path=str(tmp_path))
  with pytest.raises(FileNotFoundError, match="--workdir .*does not exist"):
    load_model(workdir=str(tmp_path / "nowhere"))
  with pytest.raises(FileNotFoundError, match="no checkpoint under .*checkpoints"):
    load_model(workdir=str(tmp_path))  # exists, never trained
  with pytest.raises(FileNotFoundError, match="--hf_path .*not a directory"):
    load_model(hf_path=str(tmp_path / "nowhere"))


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def test_prompts_file_schema(tmp_path):
  path = _write(tmp_path / "p.jsonl", ['{"prompt": "hi"}', "", '{"tokens": [5, 6], "id": "x"}'])
  first, second = read_prompts_file(path, TOK, vocab_size=384, first_id=2)
  assert first.tokens == (TOK.bos_id,) + tuple(TOK.encode("hi")) and first.id == 2
  assert first.text == "hi"
  assert second.tokens == (5, 6) and second.id == "x" and second.text is None
  no_bos = read_prompts_file(path, TOK, vocab_size=384, add_bos=False)[0]
  assert no_bos.tokens == tuple(TOK.encode("hi"))


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "hi"', r"p.jsonl:2: not valid JSON"),
    ('["hi"]', r"p.jsonl:2: expected a JSON object"),
    ('{"promt": "hi"}', r"p.jsonl:2: unknown key\(s\) \['promt'\]"),
    ('{"prompt": "hi", "tokens": [3]}', r"p.jsonl:2: give exactly one of"),
    ('{"id": 3}', r"p.jsonl:2: give exactly one of"),
    ('{"prompt": ""}', r"p.jsonl:2: the prompt must be a non-empty string"),
    ('{"tokens": []}', r"p.jsonl:2: \"tokens\" must be a non-empty list"),
    ('{"tokens": [1, "2"]}', r"p.jsonl:2: tokens\[1\] = '2' is not an int"),
    ('{"tokens": [1, 384]}', r"p.jsonl:2: tokens\[1\] = 384 is outside \[0, 384\)"),
    ('{"tokens": [-1]}', r"p.jsonl:2: tokens\[0\] = -1 is outside"),
    ('{"tokens": [1], "id": [1]}', r"p.jsonl:2: \"id\" must be a string or an int"),
])
def test_malformed_prompt_lines_name_file_and_line(tmp_path, line, message):
  path = _write(tmp_path / "p.jsonl", ['{"prompt": "ok"}', line])
  with pytest.raises(ValueError, match=message):
    read_prompts_file(path, TOK, vocab_size=384)


def test_empty_prompts_file_and_text_without_tokenizer(tmp_path):
  with pytest.raises(ValueError, match="p.jsonl: no prompts"):
    read_prompts_file(_write(tmp_path / "p.jsonl", [""]), TOK, vocab_size=384)
  path = _write(tmp_path / "q.jsonl", ['{"tokens": [1]}', '{"prompt": "hi"}'])
  with pytest.raises(ValueError, match="q.jsonl:2: a text prompt needs a tokenizer"):
    read_prompts_file(path, None, vocab_size=384)


def _runs_below(ids, limit):
  runs = [[]]
  for i in ids:
    if i < limit:
      runs[-1].append(i)
    else:
      runs.append([])
  return runs


def _cli(*flags, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, SCRIPT, *flags], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # the CLI in subprocesses
def test_cli_generates_from_a_runs_checkpoint(tmp_path, run_dir):
  """The CLI on `run_dir`'s checkpoint (the trainer's `ckpt.save`). It trained a 2-step run
  first, and so proved again what `load_run` on real training output is proved by elsewhere:
  test_rl_loop.py's CLI test (RL from its SFT run) and test_sweep.py (evaluations of trained
  runs) load trained workdirs through it, as `load_model(workdir=...)` does."""
  workdir = run_dir[0]
  prompts = _write(tmp_path / "p.jsonl", ['{"id": "ids", "tokens": [1, 116, 117]}'])
  out = str(tmp_path / "out.jsonl")
  proc = _cli(f"--workdir={workdir}", "--prompt=def f(", f"--prompts_file={prompts}",
              "--max_new_tokens=5", "--temperature=0.7", "--top_k=20", "--seed=3",
              "--stop_at_eos=False", f"--output={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"workdir {workdir}, step 3" in proc.stdout
  assert "== [0]" in proc.stdout and "== [ids] 3 prompt tokens -> 5 generated" in proc.stdout
  assert "completion: " in proc.stdout
  for phase in ("overall", "prefill", "decode"):
    assert re.search(rf"{phase}: .* = [\d,.]+ tokens/s", proc.stdout), (phase, proc.stdout)
  records = [json.loads(line) for line in open(out)]
  assert [r["id"] for r in records] == [0, "ids"]
  assert records[0]["prompt_tokens"] == [TOK.bos_id] + TOK.encode("def f(")
  for r in records:
    assert len(r["tokens"]) == len(r["logprobs"]) == len(r["raw_logprobs"]) == 5
    # Ids past the byte tokenizer's 276 (the model's vocab is 384) show as <|unk:ID|>.
    pieces = re.split(r"<\|unk:(\d+)\|>", r["text"])
    unknown = [int(i) for i in pieces[1::2]]
    assert unknown == [t for t in r["tokens"] if t >= TOK.vocab_size], r
    assert "".join(pieces[::2]) == "".join(
        TOK.decode(run) for run in _runs_below(r["tokens"], TOK.vocab_size)), r

  # Bad input: the cause is the last line on stderr, exit status 1.
  bad = _write(tmp_path / "bad.jsonl", ['{"tokens": [1]}', '{"prompt": 5}'])
  for flags, message in [((), "exactly one model source"),
                         (("--random_init",), "--random_init needs --config"),
                         ((f"--workdir={tmp_path}",), "no checkpoint under"),
                         ((f"--workdir={workdir}",), "no prompts: give --prompt"),
                         ((f"--workdir={workdir}", f"--prompts_file={bad}"),
                          "bad.jsonl:2: the prompt must be a non-empty string"),
                         ((f"--workdir={workdir}", "--prompt=x", f"--output={tmp_path}/no/o.jsonl"),
                          f"--output={tmp_path}/no/o.jsonl: no directory {tmp_path}/no")]:
    proc = _cli(*flags, "--warmup=False")
    assert proc.returncode == 1, (flags, proc.stdout[-2000:])
    assert message in proc.stderr.strip().splitlines()[-1], (flags, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "== [" not in proc.stdout, flags
