"""experiments/gpu_headline.py: the staged parts, their checks, the comparison of the two runs,
the projection, the program plan of configs/smollm2.py:gpu_headline, and the quick pipeline."""

import json
import os
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


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
  """The toy model's GGUF staged in two parts (no wheels)."""
  root = tmp_path_factory.mktemp("headline")
  gguf = headline.write_toy_gguf(root / "toy.gguf")
  manifest = headline.stage(root / "stage", gguf, root / "cache", wheels=False, split=True,
                            tree_bytes=1 << 20)
  return root, gguf, manifest


def test_stage_cuts_the_model_into_verified_parts_that_join_to_the_file(staged, tmp_path):
  root, gguf, manifest = staged
  assert [p["call"] for p in manifest["parts"]] == [1, 2]
  assert all(b <= headline.CALL_LIMIT for b in manifest["payload_bytes"])
  assert (root / "stage" / "call1" / "manifest.json").is_file()
  assert (root / "stage" / "call2" / "manifest.json").is_file()
  assert headline.verify(root / "stage", calls=(1,)) == headline.verify(root / "stage")
  joined = headline.join(root / "stage", manifest, tmp_path)
  assert joined.read_bytes() == gguf.read_bytes()


def test_a_missing_or_damaged_part_names_the_call_to_repeat(staged, tmp_path):
  root, _, manifest = staged
  copy = tmp_path / "stage"
  import shutil
  shutil.copytree(root / "stage", copy)
  part2 = copy / manifest["parts"][1]["file"]
  part2.unlink()
  headline.verify(copy, calls=(1,))  # call 1's parts are all there: check passes
  with pytest.raises(headline.HeadlineError, match="has not arrived: repeat device call 2"):
    headline.verify(copy)
  part1 = copy / manifest["parts"][0]["file"]
  part1.write_bytes(b"x" + part1.read_bytes()[1:])
  with pytest.raises(headline.HeadlineError, match="damaged.*repeat device call 1 \\(check\\)"):
    headline.verify(copy, calls=(1,))
  with pytest.raises(headline.HeadlineError, match="no call folder"):
    headline.verify(tmp_path / "nothing")


def test_stage_refuses_a_tree_that_leaves_no_room_for_the_model(staged, tmp_path):
  root, gguf, _ = staged
  with pytest.raises(headline.HeadlineError, match="does not fit two calls"):
    headline.stage(tmp_path / "stage", gguf, root / "cache", wheels=False,
                   tree_bytes=headline.CALL_LIMIT)


def test_a_wheel_pip_cannot_fetch_is_one_line(tmp_path):
  with pytest.raises(headline.HeadlineError, match="pip could not download the wheels"):
    headline.download_wheels(tmp_path, ("no-such-package-tlt-jax-headline==0.0.1",))


def _rows(step, tokens, reward=1.0):
  return [{"step": step, "prompt": 0, "sample": s, "token_ids": tokens, "reward": reward}
          for s in range(2)]


def test_responses_are_compared_token_for_token_with_their_rewards():
  base = _rows(1, [1, 2, 3]) + _rows(2, [4])
  assert headline.compare_responses(base, list(base))["identical"]
  other = _rows(1, [1, 2, 3]) + _rows(2, [5])
  diff = headline.compare_responses(base, other)
  assert not diff["identical"] and diff["mismatches"] == 2
  assert diff["first_mismatches"][0]["step"] == 2
  assert diff["first_mismatches"][0]["first_difference_at"] == 0
  longer = headline.compare_responses(_rows(1, [1, 2, 3]), _rows(1, [1, 2, 3, 4]))
  assert longer["first_mismatches"][0]["first_difference_at"] == 3  # one stopped earlier
  rewarded = _rows(1, [1, 2, 3], reward=0.0) + _rows(2, [4])
  assert headline.compare_responses(base, rewarded)["mismatches"] == 2
  assert not headline.compare_responses(base, base[:2])["identical"]  # a response missing


def test_run_exits_3_when_responses_differ_after_writing_its_figures(monkeypatch, tmp_path,
                                                                    capsys):
  """A difference between the variants is a finding (exit 3), not a failure (exit 1)."""
  monkeypatch.setattr(headline, "run", lambda *a: {"responses": {"identical": False,
                                                                  "mismatches": 2}})
  with pytest.raises(SystemExit) as e:
    headline.main(["run", "--out", str(tmp_path)])
  assert e.value.code == 3 and "2 responses differ" in capsys.readouterr().err
  monkeypatch.setattr(headline, "run", lambda *a: {"responses": {"identical": True}})
  headline.main(["run", "--out", str(tmp_path)])  # returns: exit 0


def test_agreement_counts_identical_responses_and_where_the_others_differ():
  a = [[1, 2, 3], [4, 5], [6]]
  assert headline.agreement(a, a) == {"identical": True, "identical_responses": 3,
                                      "responses": 3, "first_difference_at": []}
  b = [[1, 2, 9], [4, 5], [6, 7]]
  got = headline.agreement(a, b)
  assert not got["identical"] and got["identical_responses"] == 1
  assert got["first_difference_at"] == [2, 1]


def test_the_steady_state_leaves_the_first_step_out():
  def step(n, step_s, rollout_s, accept=None, sd=0):
    return {"step": n, "step_s": step_s, "rollout_s": rollout_s, "compile_s": 0.0,
            "accept_len": accept, "sd_iterations": sd}
  base = [step(1, 100.0, 90.0), step(2, 10.0, 8.0), step(3, 12.0, 10.0)]
  tlt = [step(1, 50.0, 40.0), step(2, 5.0, 3.0, 3.0, 10), step(3, 6.0, 4.0, 2.0, 30)]
  s = headline.steady_state(base, tlt)
  assert s["steps"] == "2..3" and s["count"] == 2
  assert s["step_ratio"] == pytest.approx(22.0 / 11.0)
  assert s["rollout_ratio"] == pytest.approx(18.0 / 7.0)
  assert s["baseline_rollout_share"] == pytest.approx(18.0 / 22.0)
  assert s["accept_len_tail"] == pytest.approx((3.0 * 10 + 2.0 * 30) / 40)


def test_the_projection_follows_the_tail():
  """A tail of one long response: SD shortens TLT's rollout by the accept length over the
  iteration's cost, and a longer tail makes the baseline's rollout a larger share."""
  lengths = [100] * 127 + [1000]
  sim = headline.step_iterations(lengths, rows=128, sd_threshold=32, accept=3.0, steps=4)
  assert all(s["baseline"] == 1000 for s in sim)
  assert all(s["tlt_plain"] == 100 and s["tlt_sd"] == pytest.approx(300.0) for s in sim)
  kinds = {"rollout_decode": (4, 10.0)}
  short = headline.projection([100] * 128, 64, 135e6, 30, 128, 32, 3.0, kinds, 10, 20.0, 20.0)
  long = headline.projection(lengths, 64, 135e6, 30, 128, 32, 3.0, kinds, 10, 20.0, 20.0)
  for case, row in long["cases"].items():
    assert row["step_ratio"] > short["cases"][case]["step_ratio"]
    assert row["baseline_rollout_share"] > short["cases"][case]["baseline_rollout_share"]
  assert long["worst_device_s"] > headline.MACHINE_START_S
  # The baseline compiles only its own programs: a slower SD program delays TLT alone.
  kinds = {"rollout_decode": (4, 10.0), "rollout_decode_sd(8, 2, 16)": (3, 30.0)}
  split = headline.projection(lengths, 64, 135e6, 30, 128, 32, 3.0, kinds, 10, 20.0, 20.0,
                              baseline_kinds={"rollout_decode"})
  for row in split["cases"].values():
    assert row["plan_compile_s"]["baseline"] < row["plan_compile_s"]["tlt"]
  # An update that also takes the reference policy's log-probs costs a third more.
  kl = headline.projection(lengths, 64, 135e6, 30, 128, 32, 3.0, kinds, 10, 20.0, 20.0,
                           passes=headline.update_passes(False, True, False))
  case = next(iter(kl["cases"]))
  assert kl["cases"][case]["update_s"] == pytest.approx(8 / 6 * split["cases"][case]["update_s"])


def test_lengths_at_a_longer_limit_continue_only_the_responses_cut_there():
  """A response the warm-up's limit cut (no EOS) goes on from where it stopped; one that
  ended with its EOS at that length, and every shorter one, keep their lengths."""
  eos, cap = 2, 4
  generations = [{"prompt": [9, 9], "completion": [5, 2]},
                 {"prompt": [9], "completion": [5, 6, 7, 8]},        # cut
                 {"prompt": [9], "completion": [5, 6, 7, eos]},      # ended at the limit
                 {"prompt": [8, 8], "completion": [7, 7, 7, 7]}]     # cut
  asked = []

  def continue_fn(prefixes):
    asked.extend(prefixes)
    return [[1] * 3, [1] * 6]
  lengths, continued = headline.lengths_at_limit(generations, cap, 10, eos, continue_fn)
  assert asked == [[9, 5, 6, 7, 8], [8, 8, 7, 7, 7, 7]]
  assert lengths == [2, 7, 4, 10] and continued == 2
  assert headline.lengths_at_limit(generations, cap, 3, eos, continue_fn) == ([2, 3, 3, 3], 0)


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
  """gpu_headline.py quick: the toy model staged in two parts, checked, joined, imported,
  and run for 2 steps as the baseline and as TLT with SD on every decode call: identical
  responses, at most 8 files to bring back, every step of both variants in headline.json.
  Offline, as on the GPU machine: an empty cache folder and no package index for pip."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", TLT_JAX_CACHE=str(tmp_path / "empty_cache"),
             PIP_NO_INDEX="1")
  r = subprocess.run([sys.executable, "-m", "experiments.gpu_headline",
                      "quick", "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=1500)
  assert r.returncode == 0, r.stderr[-3000:]
  result_dir = tmp_path / "result"
  files = sorted(p.name for p in result_dir.iterdir())
  assert files == ["compiles.png", "end_to_end.png", "headline.json", "runs.json",
                   "timeline.png"]
  result = json.loads((result_dir / "headline.json").read_text())
  assert result["responses"]["identical"] and result["responses"]["responses"] == 2 * 8
  for name in ("baseline", "tlt"):
    steps = result["variants"][name]["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["running"] and s["tokens"] > 0 for s in steps)
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
  from tlt_jax.models.drafter_io import load_drafter, save_drafter
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
  with pytest.raises(headline.HeadlineError, match="is not a drafter export"):
    headline.ship_drafter(warmup / "export" / "eagle", warmup, tmp_path / "mine", config_arg)
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
