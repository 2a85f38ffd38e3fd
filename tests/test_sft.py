"""SFT: packed loss, a sharded update that learns, the CLI with resume, and the shipped policy."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.engines import engine_config
from tests.conftest import repo_config
from tests.test_metric_writers import read_events
from tlt_jax.config import with_current_keys
from tlt_jax.mesh import make_mesh, shard_pytree
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.models import init_params, param_logical_axes
from tlt_jax.models.hf import load_hf_config, load_hf_params, load_tokenizer
from tlt_jax.rl.data import PromptIterator
from tlt_jax.rl.evaluate import evaluate
from tlt_jax.rl.packing import next_packed_batch, pack_sequences
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.tokenizer import prompt_ids, response_ids, train_tokenizer
from tlt_jax.optim import init_optimizer
from tlt_jax.sft_update import make_optimizer, make_train_step, sft_loss

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSET = os.path.join(REPO, "assets", "tiny-policy")



def test_packed_loss_equals_the_sequences_alone(tiny_cfg, tiny_params):
  rng = np.random.default_rng(0)
  seqs = [(rng.integers(3, 61, n).tolist(), rng.integers(3, 61, m).tolist())
          for n, m in ((5, 4), (3, 7), (6, 2))]
  packed = pack_sequences(seqs, rows=1, seq_len=32)
  alone = pack_sequences(seqs, rows=3, seq_len=32)  # first-fit puts all three in row 0 ...
  assert packed["segment_ids"].max() == 3
  alone = [pack_sequences([s], rows=1, seq_len=32) for s in seqs]  # ... so pack each alone
  loss, count = sft_loss(tiny_params, packed, tiny_cfg)
  assert count == sum(len(r) for _, r in seqs)  # only response tokens are targets
  total = sum(float(l) * float(c) for l, c in (sft_loss(tiny_params, b, tiny_cfg) for b in alone))
  np.testing.assert_allclose(float(loss) * float(count), total, rtol=1e-5)


def test_packing_consumes_only_what_fits():
  it = PromptIterator([([1] * 3, [2] * 3), ([1] * 5, [2] * 5), ([1] * 3, [2] * 3),
                       ([1] * 1, [2] * 1)], seed=0, shuffle=False)
  batch, count = next_packed_batch(it, lambda x: x, rows=2, seq_len=10)
  assert count == 2 and it.state_dict() == {"epoch": 0, "index": 2}  # the third did not fit
  assert batch["loss_mask"].sum() == 3 + 5
  batch, count = next_packed_batch(it, lambda x: x, rows=2, seq_len=10)
  assert count == 3  # it starts the next batch, and the short fourth fits beside it
  assert list(batch["segment_ids"][0]) == [1] * 6 + [2] * 2 + [0] * 2
  with pytest.raises(ValueError, match="does not fit in sft.seq_len=4"):
    next_packed_batch(it, lambda x: x, rows=2, seq_len=4)


@pytest.fixture(scope="module")
def task_tokenizer():
  examples = ArithmeticTask(seed=0).examples(200)
  return train_tokenizer([e.prompt for e in examples] + [e.solution for e in examples], 300)


def test_sharded_train_step_lowers_the_loss(tiny_cfg, task_tokenizer):
  config = repo_config("tiny_sft", "runlocal")
  cfg = tiny_cfg.replace(vocab_size=len(task_tokenizer))
  mesh = make_mesh({"replica": 2, "fsdp": -1, "tensor": 1})
  params = shard_pytree(init_params(cfg, jax.random.key(0)), param_logical_axes(cfg), mesh)
  tx = make_optimizer(config)
  opt_state, opt_sharding = init_optimizer(tx, params, mesh)
  sharding = jax.tree.map(lambda x: x.sharding, params)
  step = make_train_step(cfg, tx, sharding, opt_sharding)
  it = PromptIterator(ArithmeticTask(seed=0, max_ops=4).examples(400), seed=0)
  encode = lambda e: (prompt_ids(task_tokenizer, e.prompt),  # noqa: E731
                      response_ids(task_tokenizer, e.solution))
  losses = []
  for _ in range(12):
    batch, _ = next_packed_batch(it, encode, rows=8, seq_len=96)
    params, opt_state, metrics = step(params, opt_state, batch)
    losses.append(float(metrics["loss"]))
  assert params["embed"]["embedding"].sharding == sharding["embed"]["embedding"]
  assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses


def _sft_cli(workdir, *overrides):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "tlt_jax.sft", "--config",
                         "configs/tiny_sft.py:runlocal", "--workdir", str(workdir), *overrides],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("sft")
  first = _sft_cli(workdir, "--config.profile.first_step=5", "--config.profile.num_steps=2",
                   "--config.logging.tensorboard=True")
  assert first.returncode == 0, first.stderr[-3000:]
  return workdir, first


@pytest.mark.slow
def test_sft_cli_learns_and_exports(sft_run):
  workdir, run = sft_run
  losses = [json.loads(line)["loss"] for line in open(workdir / "metrics.jsonl")]
  assert len(losses) == 12 and np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
  [final] = [json.loads(line) for line in open(workdir / "eval.jsonl")]  # sft.eval_every=0
  assert final["step"] == 12 and 0 <= final["greedy_accuracy"] <= 1
  scalars, _ = read_events(workdir)  # logging.tensorboard: the same numbers
  np.testing.assert_allclose([v for _, v in scalars["metrics/loss"]], losses, rtol=1e-6)
  assert [s for s, _ in scalars["metrics/loss"]] == list(range(1, 13))
  assert scalars["eval/greedy_accuracy"] == [(12, pytest.approx(final["greedy_accuracy"]))]
  assert "held-out greedy accuracy" in run.stdout
  export = str(workdir / "export")
  cfg = load_hf_config(export)
  assert cfg.num_layers == 2 and cfg.vocab_size == 320
  params = load_hf_params(export, cfg)
  tok = load_tokenizer(export)
  assert tok.chat_template and tok.eos_token == "<|im_end|>"
  assert params["embed"]["embedding"].shape == (320, 32)
  profile = json.loads((workdir / "profile" / "summary.json").read_text())  # profile.* traced
  assert profile["steps"] == [5, 6] and profile["programs"][0]["program"] == "jit_train_step"
  assert "profile of steps [5, 6]" in run.stdout


def test_config_errors_are_one_line():
  run = subprocess.run([sys.executable, "-m", "tlt_jax.sft", "--config",
                        "configs/tiny_sft.py:runlocal", "--config.sft.lr_warmup_steps=100"],
                       cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=120)
  assert run.returncode != 0
  assert "config error: sft.lr_warmup_steps=100 must be < sft.steps=12" in run.stderr


def test_a_saved_tokenizer_is_reused_only_for_the_settings_it_was_trained_from(tmp_path):
  from tlt_jax.config import ConfigError
  from tlt_jax.components import sft_tokenizer
  config = repo_config("tiny_sft", "runlocal")
  config.tokenizer.num_train_examples = 64
  first = sft_tokenizer(config, str(tmp_path))
  again = sft_tokenizer(config, str(tmp_path))
  assert again.get_vocab() == first.get_vocab()
  config.task.eval_seed += 1  # held-out problems do not train the tokenizer
  sft_tokenizer(config, str(tmp_path))
  config.tokenizer.vocab_size += 64
  with pytest.raises(ConfigError, match=r"tokenizer was trained with tokenizer.vocab_size="
                                        r"\d+, this config has \d+; use another --workdir"):
    sft_tokenizer(config, str(tmp_path))
  config.tokenizer.path = str(tmp_path / "empty")  # a folder without tokenizer files
  os.makedirs(config.tokenizer.path)
  with pytest.raises(ConfigError, match=r"tokenizer.path='.*empty': no usable tokenizer"):
    sft_tokenizer(config, str(tmp_path))


# ---------------------------------------------------------------- the shipped policy


@pytest.fixture(scope="module")
def shipped():
  cfg = load_hf_config(ASSET, attention_impl="reference")
  return cfg, load_hf_params(ASSET, cfg), load_tokenizer(ASSET)


def test_shipped_policy_is_small_and_described(shipped):
  cfg, params, tok = shipped
  size = sum(os.path.getsize(os.path.join(ASSET, f)) for f in os.listdir(ASSET))
  assert size < 5 << 20
  assert 6 <= cfg.num_layers <= 8 and cfg.hidden_size <= 128 and cfg.vocab_size <= 512
  assert len(tok) <= cfg.vocab_size
  readme = open(os.path.join(ASSET, "README.md")).read()
  assert "python -m tlt_jax.sft --config configs/tiny_sft.py" in readme
  summary = json.load(open(os.path.join(ASSET, "sft_summary.json")))
  assert 0.3 <= summary["heldout_greedy_accuracy"] <= 0.7


def test_shipped_policy_solves_heldout_problems(shipped):
  cfg, params, tok = shipped
  with open(os.path.join(ASSET, "sft_summary.json")) as f:  # its keys as the run named them
    task = with_current_keys("task", json.load(f)["config"]["task"])
  del task["name"], task["seed"]
  examples = ArithmeticTask(seed=task.pop("eval_seed"), **task).examples(32)
  engine = RolloutEngine(cfg, params, make_mesh({"fsdp": -1}, jax.devices()[:1]),
                         engine_config(max_batch=32, max_prompt_len=128, max_new_tokens=160,
                                      eos_id=tok.eos_token_id, pad_id=tok.pad_token_id or 0))
  result = evaluate(engine, tok, examples, SamplingParams(0.0))
  assert result["accuracy"] > 0.1
  # Valid text: every finished completion is a chain of 'a<op>b=c' lines and a '#### n' line.
  finished = [t for t, f in zip(result["texts"], result["finished"]) if f]
  assert len(finished) >= 24
  well_formed = [t for t in finished if t.split("\n")[-1].startswith("#### ")]
  assert len(well_formed) >= 0.9 * len(finished)


@pytest.mark.slow
def test_length_histogram_quick(tmp_path):
  run = subprocess.run([sys.executable, "-m", "experiments.length_histogram",
                        "--policy", ASSET, "--out", str(tmp_path), "--quick"], cwd=REPO,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  data = json.loads((tmp_path / "lengths.json").read_text())
  assert (tmp_path / "length_histogram.png").stat().st_size > 1000
  assert len(data["lengths"]) == len(data["num_ops"]) == 64
  stats = data["summary"]
  assert stats["min"] <= stats["median"] <= stats["p90"] <= stats["max"]
  assert stats["max"] > 2 * stats["median"]  # the long tail shows even in 64 samples


@pytest.mark.slow
def test_sft_stops_on_sigterm_with_a_checkpoint_and_resumes(tmp_path):
  """SIGTERM mid-run: the job saves a checkpoint at the step it reached, exports nothing and
  exits 75; the same command resumes from that step, one metrics row per step."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "tlt_jax.sft", "--config", "configs/tiny_sft.py:runlocal",
         "--workdir", str(tmp_path), "--config.sft.steps=100000", "--config.sft.log_every=1"]
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  metrics = tmp_path / "metrics.jsonl"
  while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and \
      time.time() < deadline:
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 75, err[-3000:]
  assert "rerun the same command to resume" in err
  saved = [int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
  steps = [json.loads(line)["step"] for line in open(metrics)]
  assert saved and max(saved) == steps[-1] >= 3
  assert not (tmp_path / "export").exists() and not (tmp_path / "summary.json").exists()
  # The rerun resumes, and its time limit (0.001 minutes: less than its start-up) makes its
  # first step the last: it evaluates and exports as at sft.steps, says so, and exits 75 like
  # a stopped run (the same command would go on to sft.steps).
  again = subprocess.run(cmd[:-2] + [f"--config.sft.steps={steps[-1] + 50}",
                                     "--config.sft.log_every=1",
                                     "--config.sft.max_minutes=0.001"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert again.returncode == 75, again.stderr[-3000:]
  assert f"resumed from step {steps[-1]}" in again.stdout
  assert f"sft.max_minutes=0.001 reached: step {steps[-1] + 1} is the last" in again.stdout
  assert (f"sft.max_minutes=0.001 ended the job after step {steps[-1] + 1} of "
          f"{steps[-1] + 50} with a checkpoint; rerun the same command to resume") in again.stderr
  # one metrics row per step: the rows past the checkpoint (if any) were dropped on resume
  resumed = [json.loads(line)["step"] for line in open(metrics)]
  assert resumed == list(range(1, steps[-1] + 2))
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["step"] == steps[-1] + 1 and summary["time_limited"] is True
  assert (tmp_path / "export" / "model.safetensors").exists()
