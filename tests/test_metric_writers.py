"""Metric writers (tlt_jax.metric_writers): RunLog mirrors its metrics and eval rows to
TensorBoard event files that TensorBoard's own reader reads back (a resumed run's replace the
steps it redoes), and to W&B; a knob whose package is missing fails in one line."""

import glob
import importlib.util
import json
import os
import sys
import time
import types

import pytest

from tlt_jax.components import validate_config
from tlt_jax.config import ConfigError, base_config, flat_settings
from tlt_jax.metric_writers import TENSORBOARD_DIR, writers_from_config
from tlt_jax.run_log import RunLog


def read_events(workdir) -> tuple[dict, dict]:
  """({tag: [(step, value)]}, {tag: [(step, count)]}): the scalars and histograms that
  TensorBoard reads from WORKDIR/tensorboard, in step order."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(os.path.join(workdir, TENSORBOARD_DIR),
                            size_guidance={"scalars": 0, "histograms": 0})
  events.Reload()
  tags = events.Tags()
  scalars = {t: [(e.step, e.value) for e in events.Scalars(t)] for t in tags["scalars"]}
  histograms = {t: [(e.step, e.histogram_value.num) for e in events.Histograms(t)]
                for t in tags["histograms"]}
  return scalars, histograms


def _logging(tensorboard=False, wandb=False):
  config = base_config()
  config.logging.update(tensorboard=tensorboard, wandb=wandb)
  return config


def _run_log(workdir, resume_step, config):
  return RunLog(str(workdir), resume_step, mirrors=writers_from_config(
      config.logging, str(workdir), resume_step, flat_settings(config)))


def test_tensorboard_mirrors_the_jsonl_rows_and_a_resumed_run_replaces_what_it_redoes(tmp_path):
  pytest.importorskip("tensorboardX")
  config = _logging(tensorboard=True)
  rows = [{"step": s, "loss": 1.0 / s, "sd_enabled": True, "drafter_loss": None,
           "note": "text", "by": {"1": [1, 2]}} for s in (1, 2, 3)]
  with _run_log(tmp_path, 0, config) as log:
    log.write("eval", [{"step": 0, "accuracy": 0.25}])
    log.write("metrics", rows)
    log.histogram("rollout/response_len", 3, [4, 4, 9, 16])
  scalars, histograms = read_events(tmp_path)
  assert scalars == {"metrics/loss": [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))],
                     "metrics/sd_enabled": [(1, 1.0), (2, 1.0), (3, 1.0)],
                     "eval/accuracy": [(0, 0.25)]}
  assert histograms == {"rollout/response_len": [(3, 4.0)]}
  # The JSONL file is the record, as written.
  assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == rows

  # Resumed from step 1: steps 2 and 3 are written again, differently.
  with _run_log(tmp_path, 1, config) as log:
    log.write("metrics", [{"step": 2, "loss": 7.0}])
  scalars, histograms = read_events(tmp_path)
  assert scalars["metrics/loss"] == [(1, 1.0), (2, 7.0)]
  assert scalars["eval/accuracy"] == [(0, 0.25)] and not any(histograms.values())
  assert [json.loads(line)["loss"] for line in open(tmp_path / "metrics.jsonl")] == [1.0, 7.0]


def test_wandb_gets_the_rows_histograms_and_the_settings(tmp_path, monkeypatch):
  """W&B's API as the writer uses it (a stand-in module records the calls)."""
  calls = []

  class Run:
    def log(self, data, step):
      calls.append(("log", step, data))

    def finish(self):
      calls.append(("finish",))

  def init(**kwargs):
    calls.append(("init", kwargs))
    return Run()
  monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
      init=init, Histogram=lambda values: ("histogram", list(values))))
  config = _logging(wandb=True)
  (tmp_path / "run-7").mkdir()
  with _run_log(tmp_path / "run-7", 0, config) as log:
    log.write("metrics", [{"step": 1, "reward_mean": 0.5, "drafter_loss": None}])
    log.write("rollouts", [{"step": 1, "prompt": 0, "sample": 0, "tokens": 3}])  # not mirrored
    log.histogram("rollout/response_len", 1, [3, 5])
  (_, init_args), *rest = calls
  assert init_args["project"] == "tlt_jax" and init_args["name"] == "run-7"
  assert init_args["dir"] == str(tmp_path / "run-7")
  assert init_args["config"]["logging.wandb"] is True
  assert rest == [("log", 1, {"metrics/reward_mean": 0.5}),
                  ("log", 1, {"rollout/response_len": ("histogram", [3, 5])}), ("finish",)]


def test_wandb_offline_run_records_the_metrics(tmp_path, monkeypatch):
  """The real package, offline: its run file holds the mirrored keys."""
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  with _run_log(tmp_path, 0, _logging(wandb=True)) as log:
    log.write("metrics", [{"step": 1, "reward_mean": 0.5}, {"step": 2, "reward_mean": 0.75}])
  [run_file] = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
  # W&B's own process may still be writing the file when finish() returns.
  deadline = time.time() + 30
  while b"metrics/reward_mean" not in open(run_file, "rb").read() and time.time() < deadline:
    time.sleep(0.2)
  assert b"metrics/reward_mean" in open(run_file, "rb").read()


@pytest.mark.parametrize("knob,package,pip", [
    ("tensorboard", "tensorboardX", "pip install tensorboardX"),
    ("wandb", "wandb", "pip install wandb")])
def test_a_logging_knob_without_its_package_fails_in_one_line(monkeypatch, knob, package, pip):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == package else find_spec(name, *a))
  config = base_config()
  config.logging[knob] = True
  with pytest.raises(ConfigError) as e:
    validate_config(config)
  message = str(e.value)
  assert message.startswith(f"logging.{knob}=True needs the {package} package, which is not "
                            f"installed: {pip}") and "\n" not in message
  config.logging[knob] = False
  validate_config(config)
