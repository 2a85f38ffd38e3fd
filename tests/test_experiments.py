"""Experiment scripts run end to end in their quick modes and write their outputs."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tests.experiment_modules import load_experiment, parse_error
from tlt_jax.kernels.reference import prefix_tree_attention_reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jsonl(path):
  return [json.loads(line) for line in open(path)]


def _module(name):
  """argv that runs experiments.<name> (or tools.<name> for 'tools.<name>'), from the root."""
  return [sys.executable, "-m", name if "." in name else f"experiments.{name}"]


def _run_script(name, *args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([*_module(name), *args], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=timeout)
  assert r.returncode == 0, r.stderr[-3000:]
  return r


def _check_run_metadata(data, script):
  assert data["device"]["platform"] == "cpu" and data["device"]["device_kind"]
  assert data["jax_version"] and data["date"] and script in data["command"]
  assert "git_commit" in data and "uncommitted" in data  # None outside a git checkout


def _check_bench_tree_attention_quick(out):
  """bench_tree_attention.py --quick's outputs."""
  data = json.loads(out.read_text())
  assert out.with_suffix(".png").exists()
  _check_run_metadata(data, "bench_tree_attention.py")
  assert data["device"]["measured_copy_bytes_per_s"] > 0
  assert {t["name"] for t in data["targets"]} == set(data["target_summary"])
  assert data["stopped_early"] is False and data["skipped_points"] == []
  assert len(data["results"]) == 8  # quick grid: 2 batches x 2 prefixes x 2 tree sizes
  for row in data["results"]:
    assert row["reference_status"] == "ok" and row["reference_ms"] > 0
    assert row["reference_bytes_per_s"] > 0
    assert row["kernel_status"] == "skipped: cpu: reference only"
    assert row["targets"] == {"never_slower": None}  # the kernel did not run: no verdict


def test_bench_tree_attention_checks_outputs_against_a_host_reference():
  """check_point measures an output against the float32 reference computed on the CPU, so a
  wrong output is caught whatever the device computes (on an H100 XLA once miscompiled the
  reference itself, and a check on the device then failed the right kernel)."""
  bench = load_experiment("bench_tree_attention")
  base = bench.make_inputs(jax.random.key(0), 2, 64, 4, 4, 2, 16, jnp.bfloat16)
  inputs = bench.slice_inputs(base, 2, 64, 4)
  right = jax.jit(prefix_tree_attention_reference)(*inputs)
  good = bench.check_point(inputs, right, (0, 1))
  assert good["finite"] and good["rel_err"] < bench.TOLERANCE
  wrong = right.at[1, 2].multiply(-1)  # one query of the last sequence
  assert bench.check_point(inputs, wrong, (0, 1))["rel_err"] > 0.5
  assert bench.check_point(inputs, wrong, (0,))["rel_err"] < bench.TOLERANCE
  assert bench.check_point(inputs, right.at[0, 0, 0, 0].set(jnp.nan), (1,))["finite"] is False


def test_bench_tree_attention_times_calls_chained_in_one_program():
  """`repeated` returns fn's output, and each call depends on the previous one's output (a
  NaN there shifts the next call's first argument by 1), so XLA cannot hoist or drop calls."""
  bench = load_experiment("bench_tree_attention")
  q, k = jnp.array([-1.0, 3.0]), jnp.array([2.0, 2.0])
  assert jnp.array_equal(bench.repeated(lambda a, b: a * b, 3)(q, k), q * k)
  # log(-1) is NaN, so the second call sees q + 1 = [0, 4]: -inf, not NaN, so the third q.
  log = lambda a, b: jnp.log(a) + b  # noqa: E731
  assert jnp.isnan(bench.repeated(log, 1)(q, k)[0])
  assert jnp.array_equal(bench.repeated(log, 2)(q, k), jnp.log(q + 1) + k)
  assert jnp.isnan(bench.repeated(log, 3)(q, k)[0])


def test_bench_tree_attention_targets():
  """Which points a target covers, and the kernel's verdict there."""
  bench = load_experiment("bench_tree_attention")
  targets = {t["name"]: t for t in bench.TARGETS}

  def row(batch, prefix_len, tree_size, **kw):
    r = dict(batch=batch, prefix_len=prefix_len, tree_size=tree_size, kernel_status="ok",
             kernel_correct=True, reference_status="ok", kernel_bw_fraction_of_copy=0.6,
             speedup_vs_reference=3.5)
    return {**r, **kw}
  bandwidth, speedup = (targets["bandwidth_batch1_long_prefix"],
                        targets["speedup_large_batch_tree_long_prefix"])
  assert bench.applies(bandwidth, row(1, 16384, 1)) and not bench.applies(bandwidth,
                                                                           row(2, 32768, 1))
  assert not bench.applies(bandwidth, row(1, 8192, 48))
  assert bench.applies(speedup, row(32, 32768, 48)) and not bench.applies(speedup,
                                                                         row(32, 32768, 8))
  assert all(bench.applies(targets["never_slower"], row(b, 2048, 1)) for b in (1, 32))
  assert bench.target_met(bandwidth, row(1, 16384, 1)) is True
  assert bench.target_met(bandwidth, row(1, 16384, 1, kernel_bw_fraction_of_copy=0.4)) is False
  assert bench.target_met(speedup, row(16, 16384, 16, kernel_correct=False)) is False
  assert bench.target_met(speedup, row(16, 16384, 16, kernel_status="error: OOM")) is False
  assert bench.target_met(speedup, row(32, 32768, 48, reference_status="error: OOM",
                                       speedup_vs_reference=None)) is True
  assert bench.target_met(speedup, row(16, 16384, 16, kernel_status=bench.CPU_SKIP)) is None
  rows = [dict(row(1, 16384, 1), targets={"never_slower": True}),
          dict(row(1, 2048, 1), targets={"never_slower": False})]
  summary = bench.summarize_targets(rows)
  assert summary["never_slower"] == dict(points=2, measured=2, met=1, all_met=False)
  assert summary["bandwidth_batch1_long_prefix"]["all_met"] is None


@pytest.mark.slow
def test_bench_tree_attention_stops_at_time_budget(tmp_path):
  """A budget spent before the second grid point keeps the first one and says what was
  skipped."""
  out = tmp_path / "out.json"
  _run_script("bench_tree_attention", "--quick", "--time-budget", "0.001", "--out", str(out))
  data = json.loads(out.read_text())
  assert data["stopped_early"] is True and len(data["results"]) == 1
  assert len(data["skipped_points"]) == 7


def _check_bench_rollout(out, modes):
  """bench_rollout.py --quick's outputs, with plain decoding and the SD `modes` (fixed
  strategies and tuners)."""
  data = json.loads(out.read_text())
  assert (out.parent / f"{out.stem}_by_batch.png").exists()
  assert set(data["modes"]) == {"plain", *modes}
  assert data["identical_to_plain"] and all(m["identical_to_plain"]
                                            for m in data["modes"].values())
  for mode in data["modes"].values():
    assert mode["executables"] > 0 and mode["tokens"] > 0
    # Every generated token is counted once across the active-batch buckets (prefill apart).
    assert sum(b["tokens"] for b in mode["by_active"].values()) <= mode["tokens"]
    assert all(int(k) & (int(k) - 1) == 0 for k in mode["by_active"])
  if "sd-beg_mab" in modes:
    comparison = data["tuner_comparison"]
    assert {comparison["best_fixed"], comparison["worst_fixed"]} <= set(modes)
    assert comparison["beg_mab_vs_best_fixed"] > 0
    assert ("beg_mab_vs_table" in comparison) == ("sd-table" in modes)
  assert data["speedup_wall"] > 0
  # The best SD mode ran SD in the tail (a tuner that decoded it plainly is not one).
  assert data["modes"][data["best_sd_mode"]]["sd_calls"] > 0
  return data


@pytest.mark.slow
def test_bench_rollout_quick(tmp_path):
  """GRPO-shaped rollouts of the tiny default (on one slice, SD for its last 8 rows) with its
  trained EAGLE drafter alone and in the hybrid, fixed and under the table and BEG-MAB: every
  mode's tokens are plain decoding's, the warmed drafter's trees are accepted, the hybrid is
  compared with EAGLE, the tuners with the fixed strategies."""
  out = tmp_path / "rollout.json"
  _run_script("bench_rollout", "--quick", "--set", "mesh.num_cpu_devices=1", "--set",
              "mesh.axes.replica=1", "--set", "rollout.sd_threshold=8", "--strategies",
              "4,2,8", "4,2,8,eagle+suffix", "--tuners", "table", "beg_mab", "--out", str(out))
  data = _check_bench_rollout(out, {"sd(4,2,8)", "sd(4,2,8,eagle+suffix)", "sd-table",
                                    "sd-beg_mab"})
  _check_run_metadata(data, "bench_rollout.py")
  assert (data["prompts"], data["samples"], data["slices"]) == (2, 8, 1)
  assert len(data["response_lengths"]) == 16
  for mode in ("sd(4,2,8)", "sd(4,2,8,eagle+suffix)"):
    assert data["modes"][mode]["accept_len"] > 1.5
  ratio = data["hybrid_vs_eagle"]["4,2,8,eagle+suffix"]
  assert ratio["accept_len"] > 0 and ratio["tail_s"] > 0


def test_tuner_comparison_ranks_by_tail_time():
  """Strategies are ranked by their tail time, not by whole-rollout wall time (which before the
  tail is the same plain decoding in every mode, so its differences are noise)."""
  comparison = load_experiment("bench_rollout").tuner_comparison

  def row(wall_s, tail_s):
    return {"wall_s": wall_s, "tail_s": tail_s, "accept_len": 3.0}
  rows = {"plain": row(4.0, 0.20), "sd(4, 2, 8)": row(3.0, 0.15),
          "sd(3, 2, 6)": row(4.5, 0.05), "sd(6, 2, 12)": row(3.9, 0.10),
          "sd-beg_mab": row(4.4, 0.10), "sd-table": row(3.2, 0.08)}
  out = comparison(rows)
  assert out["best_fixed"] == "sd(3, 2, 6)" and out["worst_fixed"] == "sd(4, 2, 8)"
  assert out["beg_mab_vs_best_fixed"] == pytest.approx(0.5)
  assert out["beg_mab_vs_worst_fixed"] == pytest.approx(1.5)
  assert out["beg_mab_vs_table"] == pytest.approx(0.8)


@pytest.mark.slow
def test_bench_vs_revision_quick(tmp_path):
  """The committed tree against itself, extracted by git archive: the same greedy tokens."""
  out = tmp_path / "vs_rev.json"
  _run_script("bench_vs", "--quick", "--against", "HEAD", "--out", str(out))
  data = json.loads(out.read_text())
  assert out.with_suffix(".png").exists()
  assert data["outputs_identical"] is True
  assert data["revision"]["tokens"] == data["current"]["tokens"] > 0
  assert len(data["revision"]["wall_s"]) == len(data["current"]["wall_s"]) == 1
  assert data["speedup"] > 0
  r = subprocess.run([*_module("bench_vs"),
                      "--against", "no-such-revision", "--out", str(out)], cwd=REPO,
                     capture_output=True, text=True)
  assert r.returncode != 0 and "not a revision" in r.stderr
  r = subprocess.run([*_module("bench_vs"), "--against", "hf", "--out", str(out)], cwd=REPO,
                     capture_output=True, text=True)
  assert r.returncode != 0 and "profile_decode --peer" in r.stderr


def _check_rl_runs(out, responses_per_step, compile_ahead):
  """rl_runs.py's outputs for a baseline and a TLT run of 2 steps."""
  data = json.loads((out / "rl_runs.json").read_text())
  for name in ("long_tail.png", "drafter_adaptation.png", "end_to_end.png", "compiles.png"):
    assert (out / name).exists(), name
  assert set(data["runs"]) == {"baseline", "tlt"}
  for run in data["runs"].values():
    assert [m["step"] for m in run["metrics"]] == [1, 2]
  # The baseline's per-step lengths and time split come from its own rollouts and metrics.
  lengths = data["long_tail"]["lengths"]
  assert [r["step"] for r in lengths] == [1, 2]
  assert all(r["count"] == responses_per_step and r["p50"] <= r["p90"] <= r["max"]
             for r in lengths)
  for row in data["long_tail"]["time_breakdown"]:
    assert 0.0 <= row["idle_share"] <= 1.0 and row["rollout_busy_s"] > 0
  # SD runs report an accept length for the steps that ran SD (the tuner may decode plainly
  # in a step where no strategy pays); the baseline has none.
  accepts = [a for a in data["drafter_adaptation"]["tlt"] if a is not None]
  assert accepts and all(a >= 1.0 for a in accepts)
  assert data["runs"]["baseline"]["summary"]["drafter_steps_total"] == 0
  # Compiling ahead: no SD program is compiled where the host waits (an arm is chosen only
  # once its program is ready), the responses are the same (checked below), and the job ends
  # without waiting for the compiles still queued. Without it, every SD program is compiled
  # where the host waits.
  sd_bill = data["compile_bill"]["tlt"]["rollout_decode_sd"]
  if compile_ahead:
    assert sd_bill["programs"] == 0 and sd_bill["ahead_programs"] > 0
  else:
    assert sd_bill["programs"] > 0 and sd_bill["ahead_programs"] == 0
  e2e = data["end_to_end"]
  assert e2e["steps"] == 2 and e2e["speedup_step_time"] > 0
  assert "speedup_without_compiles_after_first" in e2e
  # Every token's randomness comes from (seed, step, request, position): with SD or without,
  # any drafter, spot-trained or not, the job samples the same responses at temperature 1
  # (tests/rollout/test_engine.py checks top-p), so it scores the same rewards and takes the
  # same updates.
  completions = {name: [r["completion"] for r in _jsonl(out / "runs" / name /
                                                         "rollouts.jsonl")]
                 for name in data["runs"]}
  assert len(set(completions["baseline"])) > len(completions["baseline"]) // 2  # sampled
  same = ("reward_mean", "accuracy", "response_len_mean", "response_len_max", "rollout_tokens")
  for name, run in data["runs"].items():
    assert completions[name] == completions["baseline"], name
    assert [{k: m[k] for k in same} for m in run["metrics"]] == \
        [{k: m[k] for k in same} for m in data["runs"]["baseline"]["metrics"]], name


def test_a_record_names_the_tracked_files_changed_since_its_commit(tmp_path):
  """uncommitted_files: tracked files edited or staged since HEAD, not untracked ones; None
  outside a checkout. run_stamp and run_metadata carry it beside the commit."""
  common = load_experiment("common")
  repo = tmp_path / "repo"
  repo.mkdir()
  git = lambda *a: subprocess.run(["git", "-C", str(repo), "-c", "user.name=t",
                                   "-c", "user.email=t@t", *a], check=True, capture_output=True)
  git("init", "-q")
  for name in ("a.py", "b.py", "c.py"):
    (repo / name).write_text(name)
  git("add", ".")
  git("commit", "-q", "-m", "c")
  assert common.uncommitted_files(repo) == []
  (repo / "b.py").write_text("edited")
  (repo / "c.py").write_text("staged")
  git("add", "c.py")
  (repo / "new.py").write_text("untracked")
  assert common.uncommitted_files(repo) == ["b.py", "c.py"]
  assert common.uncommitted_files(tmp_path / "not-a-checkout") is None
  stamp = common.run_stamp()
  assert list(stamp) == ["date", "commit", "uncommitted", "command"]
  assert stamp["uncommitted"] == common.uncommitted_files()


def test_a_script_replaces_only_folders_it_made(tmp_path):
  """own_folder: a new or empty folder is made the script's own (marked), and replaced on
  its next run; a file, or a folder holding what the script did not write, is refused whole."""
  from tlt_jax.config import ConfigError
  own_folder = load_experiment("common").own_folder
  run = own_folder(tmp_path / "runs" / "tlt", "rl_runs")
  (run / "metrics.jsonl").write_text("{}\n")
  assert own_folder(run, "rl_runs", replace=False) == run and (run / "metrics.jsonl").exists()
  own_folder(run, "rl_runs")
  assert [p.name for p in run.iterdir()] == [".made_by_rl_runs"]
  theirs = tmp_path / "theirs"
  theirs.mkdir()
  (theirs / "notes.txt").write_text("mine")
  (tmp_path / "a-file").write_text("mine")
  for path, what in ((theirs, "holds files that rl_runs did not write"), (tmp_path / "a-file",
                                                                         "is a file")):
    with pytest.raises(ConfigError) as e:
      own_folder(path, "rl_runs")
    assert str(e.value) == (f"{path} {what}; nothing was changed: move it away, or give "
                            f"rl_runs another output folder")
  assert (theirs / "notes.txt").read_text() == (tmp_path / "a-file").read_text() == "mine"


def test_rl_runs_refuses_a_run_folder_it_did_not_make_before_any_run(tmp_path):
  """It deleted OUT/runs/<variant> whoever wrote it (the quick start's runs, given the
  repository root as --out)."""
  theirs = tmp_path / "runs" / "tlt"
  theirs.mkdir(parents=True)
  (theirs / "metrics.jsonl").write_text("{}\n")
  r = subprocess.run([*_module("rl_runs"), "--quick", "--out", str(tmp_path)], cwd=REPO,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 1 and r.stderr.strip().splitlines() == [
      f"rl_runs: {theirs} holds files that rl_runs did not write; nothing was changed: move it "
      f"away, or give rl_runs another output folder"], r.stderr[-2000:]
  assert (theirs / "metrics.jsonl").read_text() == "{}\n"
  assert [p.name for p in (tmp_path / "runs").iterdir()] == ["tlt"]  # nothing ran


@pytest.mark.slow
def test_grpo_settings_quick(tmp_path):
  _run_script("rl_runs", "--settings", "--quick", "--out", str(tmp_path))
  data = json.loads((tmp_path / "grpo_settings.json").read_text())
  assert (tmp_path / "grpo_settings.png").stat().st_size > 1000
  assert list(data["settings"]) == ["default", "lr3e-5"]
  assert data["settings"]["lr3e-5"]["overrides"] == ["rl.learning_rate=3e-5"]
  for setting in data["settings"].values():
    (run,) = setting["runs"]
    assert run["seed"] == 0 and len(run["reward"]) == 2  # runlocal: 2 RL steps
    assert all(0.0 <= a <= 1.0 for a in run["greedy"] + run["sampled"])
    assert setting["greedy_change_mean"] == run["greedy"][1] - run["greedy"][0]
    # The paired control: 0 before any update; the mean is over steps 2..N.
    assert run["reward_vs_initial"][0] == 0 and run["paired"] == run["reward_vs_initial"][1]
    assert setting["paired_mean"] == run["paired"]


def test_grpo_settings_names_a_bad_setting(tmp_path):
  # In a process of its own: the script imports the main job, whose flags a test process
  # that imported another job already holds.
  for bad in ("kl", "kl=", "kl=rl.kl_coef"):
    r = subprocess.run([*_module("rl_runs"),
                        "--out", str(tmp_path), "--settings", bad], cwd=REPO,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "expected NAME=KEY=VALUE" in r.stderr, r.stderr[-500:]
  assert not (tmp_path / "grpo_settings.json").exists()


def test_reproduce_lists_every_experiment_and_rejects_unknown_names(tmp_path):
  r = _run_script("reproduce", "--all", "--dry-run", "--out", str(tmp_path))
  names = [line.split("]")[1].split(":")[0].strip() for line in r.stdout.splitlines()
           if line.startswith("[")]
  assert names == ["length_histogram", "rl_runs", "grpo_settings", "rollout",
                   "simulate_cluster", "simulate_vs_run", "drafter_ttt"]
  for name in names:  # every module it would run (`-m experiments.<module>`) exists
    module = next(line for line in r.stdout.splitlines() if f"] {name}:" in line).split()[3]
    assert os.path.isfile(os.path.join(REPO, *module.split(".")) + ".py"), module
  bad = subprocess.run([*_module("reproduce"),
                        "--only", "figure9", "--out", str(tmp_path)],
                       capture_output=True, text=True)
  assert bad.returncode != 0 and "unknown experiment" in bad.stderr


@pytest.mark.parametrize("quick", [False, True])
def test_every_campaign_stage_s_command_parses(quick, tmp_path, monkeypatch):
  """Each experiment a campaign runs (reproduce's, smollm2_cpu's stages) accepts the flags
  the campaign passes it: a flag one of them retires fails here, not hours into a campaign."""
  import argparse
  smollm2 = load_experiment("smollm2_cpu")
  args = argparse.Namespace(quick=quick, set=[], iterations=8, rollout_prompts=4,
                            batches=[1, 2])
  campaigns = {"reproduce": load_experiment("reproduce").experiments(tmp_path, quick).values(),
               "smollm2_cpu": [c[2:] for c in smollm2.stage_commands(tmp_path, args).values()]}
  checked, failures = 0, []
  for campaign, commands in campaigns.items():
    for module, *argv in commands:
      module = module if "." in module else f"experiments.{module}"
      if module.startswith("experiments."):
        checked += 1
        if error := parse_error(module, argv, monkeypatch):
          failures.append(f"{campaign}: {module} {' '.join(argv)}: {error}")
  assert checked >= 9 and not failures, failures


def test_reproduce_runs_a_subset_and_records_it(tmp_path):
  _run_script("reproduce", "--only", "simulate_cluster", "--quick", "--out", str(tmp_path))
  report = json.loads((tmp_path / "reproduce.json").read_text())
  run = report["stages"]["simulate_cluster"]
  assert run["returncode"] == 0 and report["quick"] is True
  assert {"simulate_cluster/simulation.json", "simulate_cluster/simulation.png"} <= \
      set(run["files"])
  assert (tmp_path / "logs" / "simulate_cluster.log").exists()


@pytest.mark.slow
def test_drafter_ttt_quick(tmp_path):
  out = tmp_path / "ttt.json"
  _run_script("drafter_ttt", "--quick", "--draft-vocab-sizes", "0", "40", "--out", str(out))
  data = json.loads(out.read_text())
  assert out.with_suffix(".png").exists()
  variants = {(r["features"], r["draft_vocab_size"], r["train_depth"]) for r in data["rows"]}
  assert variants == {(f, r, k) for f in ("unfused", "fused") for r in (0, 40) for k in (1, 2)}
  for r in data["rows"]:
    (accept,) = r["accept_len"].values()
    assert 1.0 <= accept <= 5.0  # (4, 2, 8): at most 4 drafted tokens + the bonus token
    assert r["top1_ahead_last"] >= 0
  assert set(data["gain_deepest"]) == {"unfused", "fused"}
  assert set(data["vocab_ratio_deepest"]) == {f"{f} r=40 K={k}" for f in ("unfused", "fused")
                                              for k in (1, 2)}


@pytest.mark.slow
def test_bench_tree_attention_quick(tmp_path):
  """The kernel grid at toy shapes, as a GPU lease runs it at full ones (the decode benchmark's
  quick run: tests/test_profile_decode.py)."""
  _run_script("bench_tree_attention", "--quick", "--out", str(tmp_path / "tree_attention.json"),
              "--time-budget", "160")
  _check_bench_tree_attention_quick(tmp_path / "tree_attention.json")


@pytest.mark.slow
def test_smollm2_cpu_decode_stage_and_resume(tmp_path):
  """smollm2_cpu's decode stage: the decode benchmark's plain iterations on SmolLM2 (no SD
  arm), read back into the campaign's summary and figure; a rerun skips the finished stage."""
  from tlt_jax.import_model import DownloadError, smollm2_folder
  try:
    smollm2_folder()
  except DownloadError as e:
    pytest.skip(f"SmolLM2 is not in the cache and cannot be downloaded: {e}")
  out = tmp_path / "sm"
  args = ("--quick", "--stages", "decode", "--batches", "1", "2", "--iterations", "2",
          "--out", str(out))
  _run_script("smollm2_cpu", *args)
  bench = json.loads((out / "decode" / "profile_decode.json").read_text())
  assert bench["arms"] == [] and all(r["sd"] == {} for r in bench["rows"])
  summary = json.loads((out / "smollm2_cpu.json").read_text())
  assert [(r["batch"], r["step_ms"]) for r in summary["decode"]] == \
      [(r["batch"], r["plain"]["timing"]["iteration_ms"]) for r in bench["rows"]]
  assert [r["batch"] for r in summary["decode"]] == [1, 2]
  assert summary["stages"]["decode"]["returncode"] == 0 and (out / "smollm2_cpu.png").is_file()
  assert "=== decode: done in an earlier run" in _run_script("smollm2_cpu", *args).stdout


@pytest.mark.slow
def test_rl_runs_quick(tmp_path):
  """A baseline and a TLT run of the quick config (which does not compile ahead), back to back:
  their figures, and the same responses from both."""
  from tlt_jax.cli import config_from_file
  config = config_from_file(os.path.join(REPO, "configs", "default.py:runlocal"), [])
  _run_script("rl_runs", "--quick", "--variants", "baseline", "tlt", "--set", "rl.steps=2",
              "--out", str(tmp_path / "rl"), timeout=900)
  assert not config.rollout.compile_ahead
  _check_rl_runs(tmp_path / "rl", config.rl.prompts_per_step * config.rl.num_samples,
                 compile_ahead=False)


@pytest.mark.slow
def test_bench_tree_attention_numerics_quick(tmp_path):
  """--numerics: the attention against the host's float32 reference at toy shapes, with the
  package's XLA flags and, in a second process, with each of them turned off."""
  out = tmp_path / "gpu_numerics.json"
  _run_script("bench_tree_attention", "--numerics", "--quick", "--out", str(out))
  numerics = json.loads(out.read_text())
  _check_run_metadata(numerics, "bench_tree_attention")
  assert "--numerics" in numerics["command"]
  assert numerics["right_with_flags"] is True and numerics["right_without_flags"] is True
  legs = numerics["legs"]
  assert "--xla_gpu_exclude_nondeterministic_ops=true" in legs["flags"]["xla_flags"]
  assert "--xla_gpu_exclude_nondeterministic_ops=false" in legs["flags_off"]["xla_flags"]
  assert [r["reference"]["rel_err"] < 0.02 for r in legs["flags_off"]["rows"]] == [True, True]


def _stage(line, status):
  """A stage's command: prints `line`, exits with `status`."""
  return [sys.executable, "-c", f"import sys; print({line!r}); sys.exit({status})"]


def test_a_stage_its_time_limit_ended_counts_as_done(tmp_path):
  """A job that its time limit ended exits 75 (its rerun would resume it); as a campaign's
  stage it is done, its results exported. A stage a signal stopped (also 75) is not."""
  stages = load_experiment("stages")
  rc, _ = stages.run_stage("sft", _stage("sft.max_minutes=1.5 ended the job after step 3 of "
                                         "900 with a checkpoint; rerun the same command to "
                                         "resume (exit status 75)", 75), tmp_path / "sft.log")
  assert rc == 0
  rc, _ = stages.run_stage("sft", _stage("stopped before the last step with a checkpoint; "
                                         "rerun the same command to resume (exit status 75)",
                                         75), tmp_path / "s.log")
  assert rc == 75 and "stopped before" in (tmp_path / "s.log").read_text()


def test_the_campaign_runner_records_resumes_and_keeps_going(tmp_path, capsys):
  stages = load_experiment("stages")
  write = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('{}'); sys.exit(%d)"
  commands = {"a": [sys.executable, "-c", write % 0, str(tmp_path / "a.json")],
              "b": [sys.executable, "-c", write % 3, str(tmp_path / "b.json")],
              "c": _stage("c ran", 0), "d": _stage("d ran", 0)}
  kept = stages.run_stages(tmp_path, commands, ["a", "b", "c", "d"], quick=True,
                           keep_going=True)
  assert [kept[n]["returncode"] for n in "abcd"] == [0, 3, 0, 0]
  assert kept["a"]["files"] == ["a.json"] and kept["b"]["files"] == ["b.json"]
  assert json.loads((tmp_path / "stages.json").read_text())["stages"] == kept
  # A rerun skips what is done and runs again what failed; without keep_going a failure ends
  # the campaign, naming the stage's log.
  with pytest.raises(SystemExit, match="stage 'b' failed \\(exit 3\\).*logs/b.log"):
    stages.run_stages(tmp_path, commands, ["a", "b", "c"], quick=True)
  assert "=== a: done in an earlier run" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="holds a quick run"):
    stages.run_stages(tmp_path, commands, ["a"], quick=False)


def test_tail_accept_quick(tmp_path):
  """tail_accept.py --quick: the tiny policy answers held-out problems once (cached), and each
  arm's accept length per running-row bucket is measured on them, between 1 and depth + 1."""
  out = tmp_path / "tail"
  _run_script("tail_accept", "--quick", "--out", str(out))
  data = json.loads((out / "tail_accept.json").read_text())
  assert (out / "tail_accept.png").is_file() and (out / "responses.jsonl").is_file()
  assert data["responses"]["count"] == 8 * 4 and data["responses"]["in_tail"] > 0
  for strategy, row in data["variants"]["config"].items():
    depth = int(strategy.split(",")[0])
    assert 1.0 <= row["tail"] <= depth + 1 and row["iterations"] > 0
    assert sum(b["iterations"] for b in row["buckets"].values()) == row["iterations"]
  again = _run_script("tail_accept", "--quick", "--out", str(out))  # reuses the responses
  assert "reusing 32 responses" in again.stdout


def test_tail_accept_credits_iterations_to_the_rows_then_running():
  tail = load_experiment("tail_accept")
  lengths = __import__("numpy").asarray([2, 5, 9, 9])
  running = tail.running_rows(lengths)
  # Position j decodes token j + 1: a response of 2 tokens runs at position 0 only.
  assert running.tolist() == [4, 3, 3, 3, 2, 2, 2, 2, 0]
  assert tail.tail_starts(lengths, 2).tolist() == [2, 4, 4, 4]  # a response ends before
  assert tail.credit([(0, 2), (3, 2), (5, 3)], running, (1, 2, 9)) == {1: [2, 2, 3]}
  assert tail.credit([(8, 1)], running, (1, 2, 9)) == {0: [1]}
  summary = tail.summarise({0: [1, 1], 1: [4]}, (1, 2))
  assert summary["tail"] == 2.0 and summary["buckets"] == {
      "1": {"accept": 1.0, "iterations": 2}, ">=2": {"accept": 4.0, "iterations": 1}}


@pytest.mark.slow
def test_numerics_cost_quick(tmp_path):
  """Both numerics timed side by side on the small shape: every call's ratio, the decode
  targets checked per row count, the PNG."""
  _run_script("numerics_cost", "--quick", "--out", str(tmp_path))
  data = json.loads((tmp_path / "numerics_cost.json").read_text())
  _check_run_metadata(data, "numerics_cost")
  assert (tmp_path / "numerics_cost.png").exists()
  calls = {"decode_1", "decode_8", "verify_8x16", "update_4x64"}
  assert set(data["seconds"]["fast"]) == set(data["seconds"]["invariant"]) == calls
  assert all(r > 0 for r in data["ratio"].values())
  assert [t["name"] for t in data["decode_targets"]] == ["decode_1", "decode_8"]
  assert all(t["pass"] == (t["measured"] <= 1.5) for t in data["decode_targets"])
