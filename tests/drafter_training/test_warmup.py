"""The offline warm-up: its training loop stops where the job asks it to (a signal), after
that step's callback (which checkpoints it); its cached responses serve only a like rerun; the
job resumes from its checkpoint on the two emulated devices."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import REPO
from tests.test_metric_writers import read_events
from tlt_jax.drafter_training.train_step import DrafterOptConfig
from tlt_jax.drafter_training.warmup import (_length_batches, cached_responses, collect_samples,
                                             train_drafter)
from tlt_jax.drafters.eagle.network import DrafterConfig, init_drafter_params


def test_training_stops_after_the_step_the_job_asked_to_stop_at(tiny_cfg, tiny_params):
  prompts = [[1, 2, 3], [4, 5]]
  completions = [[6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
  samples = collect_samples(tiny_params, tiny_cfg, prompts, completions)
  dcfg = DrafterConfig()
  dparams = init_drafter_params(tiny_cfg, dcfg, jax.random.key(1))
  steps = []
  _, history = train_drafter({"eagle": dparams}, tiny_params, samples, tiny_cfg, {"eagle": dcfg},
                             DrafterOptConfig(), steps=50, window=16, batch_rows=2, progress=False,
                             on_step=lambda step, state, metrics: steps.append(step),
                             should_stop=lambda: len(steps) >= 3)
  assert steps == [1, 2, 3] and len(history) == 3


def test_warm_up_samples_end_before_the_last_token_as_the_buffers_do(tiny_cfg, tiny_params):
  """The last token's feature predicts what follows the response (after its EOS), which is
  never drafted: the warm-up trains on the slots spot training trains on."""
  prompts, completions = [[1, 2, 3], [4, 5]], [[6, 7, 8, 2], [9, 2]]
  a, b = collect_samples(tiny_params, tiny_cfg, prompts, completions)
  assert a.tokens.tolist() == [1, 2, 3, 6, 7, 8] and b.tokens.tolist() == [4, 5, 9]
  assert a.features.shape == (6, tiny_cfg.feature_size) and (a.train_from, b.train_from) == (2, 1)


def test_samples_batched_by_length_keep_their_order_and_features(tiny_cfg, tiny_params):
  """Long-tailed lengths go in batches of similar lengths, each at its own width: every
  sample's features equal those of its sequence computed alone, in the order given."""
  rng = np.random.default_rng(0)
  lengths = [3, 40, 5, 2, 17, 9]
  prompts = [rng.integers(1, 60, 2).tolist() for _ in lengths]
  completions = [rng.integers(1, 60, n).tolist() for n in lengths]
  for batched in (collect_samples(tiny_params, tiny_cfg, prompts, completions, batch_size=2),
                  collect_samples(tiny_params, tiny_cfg, prompts, completions, batch_size=4,
                                  max_tokens=64)):
    for i, sample in enumerate(batched):
      alone, = collect_samples(tiny_params, tiny_cfg, [prompts[i]], [completions[i]],
                               batch_size=1)
      assert sample.tokens.tolist() == alone.tokens.tolist() == (prompts[i] + completions[i])[:-1]
      np.testing.assert_allclose(sample.features, alone.features, rtol=1e-5, atol=1e-5)


def test_the_longest_responses_go_in_fewer_rows():
  """A long tail's prefills hold at most max_tokens padded tokens (one row at least), in
  ascending order, each response once."""
  lengths = sorted([20] * 40 + [300] * 5 + [1100] * 3)
  batches = list(_length_batches(lengths, 32, 2048, 1104))
  assert [i for group, _, _ in batches for i in group] == list(range(len(lengths)))
  assert [(len(group), rows, width) for group, rows, width in batches] == [
      (32, 32, 32), (8, 8, 32), (4, 4, 512), (1, 1, 512), (1, 1, 1104), (1, 1, 1104),
      (1, 1, 1104)]


def test_the_warm_up_reuses_its_responses_only_for_the_same_prompts_and_settings(tmp_path):
  calls = []

  class Engine:
    def generate(self, prompts, samples, sampling, key, should_stop=None):
      calls.append(sampling.temperature)
      tokens = [[len(calls), i] for i in range(len(prompts) * samples)]
      return SimpleNamespace(tokens=tokens, lengths=np.full(len(tokens), 2), wall_s=0.0)
  job = SimpleNamespace(writer=True, say=lambda message: None)
  path = str(tmp_path / "generations.jsonl")

  def responses(prompts, temperature=1.0, made_by=None):
    return cached_responses(Engine(), prompts, 2, temperature, 0, path, job,
                            made_by or {"model.num_layers": 2})
  first = responses([[1, 2], [3]])
  assert responses([[1, 2], [3]]) == first and len(calls) == 1  # served by the cache
  assert responses([[1, 2], [4]]) != first and len(calls) == 2  # as many rows, other prompts
  responses([[1, 2], [4]], temperature=0.5)
  responses([[1, 2], [4]], temperature=0.5, made_by={"model.num_layers": 3})
  assert len(calls) == 4
  assert responses([[1, 2], [4]], temperature=0.5, made_by={"model.num_layers": 3}) and \
      len(calls) == 4


def test_responses_written_elsewhere_read_in_either_format(tmp_path):
  """A responses file of {prompt, completion} (the warm-up's own, tail_accept's) or a GPU
  lease's responses.jsonl.xz, whose default-precision baseline responses are taken once."""
  import lzma
  from tlt_jax.drafter_training.warmup import read_responses
  plain = tmp_path / "responses.jsonl"
  plain.write_text("\n".join(json.dumps({"prompt": [1, 2], "completion": [3, i]})
                              for i in range(3)))
  assert read_responses(str(plain)) == ([[1, 2]] * 3, [[3, 0], [3, 1], [3, 2]])
  lease = tmp_path / "responses.jsonl.xz"
  with lzma.open(lease, "wt") as f:
    for precision in ("default", "highest"):
      for variant in ("tlt", "baseline"):
        f.write(json.dumps({"precision": precision, "variant": variant, "step": 1,
                            "prompt_ids": [5], "token_ids": [6, len(variant)]}) + "\n")
  assert read_responses(str(lease)) == ([[5]], [[6, len("baseline")]])
  (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "hi"}))
  with pytest.raises(ValueError, match="bad.jsonl: expected JSON lines with 'prompt'"):
    read_responses(str(tmp_path / "bad.jsonl"))


@pytest.mark.slow
def test_warm_up_runs_resume_exactly_from_a_time_limit_and_with_more_steps(tmp_path):
  """As train and SFT: the warm-up that its time limit ended (after step 1 of :runlocal's 6;
  it exports and exits 75) resumes with the same command to the rows and the drafter of a run
  that was never interrupted (a resumed run drew fresh rows): the same tokens at every step,
  the same losses and exported weights to float32 rounding. (Not to the bit: the replicated
  drafter state's copies on the two emulated devices differ in their last bits from the first
  step on, and a checkpoint keeps one copy.) A rerun of the finished run with more steps
  continues from its last checkpoint (step 6): the restored drafter state is placed with the
  two-device policy, which the step requires (it came back on one device and the rerun
  failed), and TensorBoard holds the numbers of both runs."""
  def warmup(workdir, *args, rc=0):
    r = subprocess.run([sys.executable, "-m", "tlt_jax.warmup_drafter", "--config",
                        "configs/default.py:runlocal", "--workdir", str(workdir), *args],
                       cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == rc, r.stderr[-3000:]
    return r.stdout + r.stderr

  whole, cut = tmp_path / "whole", tmp_path / "cut"
  warmup(whole, "--config.logging.tensorboard=True")
  out = warmup(cut, "--config.drafter.warmup.max_minutes=0.001", rc=75)
  assert "drafter.warmup.max_minutes=0.001 ended the job after step 1 of 6" in out
  assert "resumed the drafter from step 1" in warmup(cut)

  def metrics(workdir):
    return [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert [m["step"] for m in metrics(cut)] == list(range(1, 7))
  assert [m["tokens"] for m in metrics(cut)] == [m["tokens"] for m in metrics(whole)]
  for key in ("loss", "ce_loss", "feature_loss", "grad_norm", "top1"):
    np.testing.assert_allclose([m[key] for m in metrics(cut)], [m[key] for m in metrics(whole)],
                               rtol=1e-5)
  exported = [load_file(str(run / "export" / "eagle" / "model.safetensors"))
              for run in (whole, cut)]
  assert exported[0].keys() == exported[1].keys()
  for name in exported[0]:
    np.testing.assert_allclose(exported[1][name], exported[0][name], rtol=1e-5, atol=1e-6)

  # The same responses read from a file instead of generated: the same tokens at every step.
  given = tmp_path / "given"
  out = warmup(given, f"--config.drafter.warmup.responses={whole / 'generations.jsonl'}")
  assert "read 8 responses" in out and not (given / "generations.jsonl").exists()
  assert [m["tokens"] for m in metrics(given)] == [m["tokens"] for m in metrics(whole)]

  assert "resumed the drafter from step 6" in warmup(whole, "--config.drafter.warmup.steps=8",
                                                     "--config.logging.tensorboard=True")
  rows = metrics(whole)
  assert [row["step"] for row in rows] == list(range(1, 9))
  summary = json.loads((whole / "summary.json").read_text())
  assert summary["steps"] == 8
  # eval.jsonl: each run's held-out accept length at its last step; TensorBoard holds the
  # same numbers (the rerun's steps 7 and 8 after the first run's 1-6).
  evals = [json.loads(line) for line in open(whole / "eval.jsonl")]
  assert [e["step"] for e in evals] == [6, 8]
  assert evals[-1]["accept_len_warmed"] == summary["accept_len_warmed"]
  scalars, _ = read_events(whole)
  assert scalars["metrics/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in rows]
  assert scalars["eval/accept_len_warmed"] == [
      (e["step"], pytest.approx(e["accept_len_warmed"])) for e in evals]
