"""Config schema validation and the command-line entry point's error handling."""

import json
import os
import pathlib
import re
import subprocess
import sys

import ml_collections
import pytest

from tests.conftest import repo_config
from tlt_jax.cli import config_from_file
from tlt_jax.components import engine_config, load_drafters_for, model_config, validate_config
from tlt_jax.config import ConfigError, base_config
from tlt_jax.drafters.eagle.network import DRAFT_TO_POLICY
from tlt_jax.rollout.engine import EngineConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_default_config_is_valid_and_locked():
  c = repo_config("default")
  validate_config(c, num_devices=2)
  with pytest.raises(AttributeError, match='Did you mean "dtype"'):
    c.model.dtyp = "float32"
  cfg = model_config(c)
  assert cfg.num_layers == c.model.num_layers and cfg.qkv_bias


@pytest.mark.parametrize("model_type,qkv_bias,qk_norm", [("qwen2", True, False),
                                                          ("llama", False, False),
                                                          ("qwen3", False, True)])
def test_model_type_sets_the_architecture_of_random_weights(model_type, qkv_bias, qk_norm):
  c = base_config()
  c.model.model_type = model_type
  cfg = model_config(c)
  assert (cfg.model_type, cfg.qkv_bias, cfg.qk_norm) == (model_type, qkv_bias, qk_norm)


def test_unknown_key_in_an_unlocked_config_is_named():
  c = base_config()
  c.model.num_layer = 3
  with pytest.raises(ConfigError, match=r"unknown config key 'model.num_layer'. Did you mean "
                                        r"'model.num_layers'\?"):
    validate_config(c)
  c = base_config()
  c.rolout = ml_collections.ConfigDict()
  with pytest.raises(ConfigError, match="unknown config key 'rolout'.*Allowed under the top"):
    validate_config(c)


@pytest.mark.parametrize("key,value,match", [
    ("eval_batch_size", 48, "sft.eval_batch_size=48 must be a power of two"),
    ("lr_warmup_steps", 2000, r"sft.lr_warmup_steps=2000 must be < sft.steps=1000"),
    ("learning_rate", 0.0, "sft.learning_rate=0.0 must be positive"),
])
def test_bad_sft_values(key, value, match):
  c = base_config()
  c.sft[key] = value
  with pytest.raises(ConfigError, match=match):
    validate_config(c)


@pytest.mark.parametrize("key,value,match", [
    ("dtype", "fp8", r"model.dtype='fp8' is not allowed; allowed values: \('float32'"),
    ("param_dtype", "int8", r"model.param_dtype='int8'"),
    ("attention_impl", "flash", r"model.attention_impl='flash'.*'reference'"),
    ("model_type", "gpt2", r"model.model_type='gpt2'.*'qwen2', 'llama'"),
    ("scan_layers", "decode", r"model.scan_layers='decode'.*'none', 'train', 'all'"),
    ("path", "/does/not/exist", r"model.path='/does/not/exist' does not exist"),
])
def test_bad_model_values(key, value, match):
  c = base_config()
  c.model[key] = value
  with pytest.raises(ConfigError, match=match):
    validate_config(c)


def test_mesh_larger_than_devices():
  c = base_config()
  c.mesh.axes.replica = 4
  c.mesh.axes.fsdp = 4
  with pytest.raises(ConfigError, match="needs 16 devices but 8 are available"):
    validate_config(c, num_devices=8)


@pytest.mark.parametrize("norm_input", [False, True])
def test_fused_features_without_an_input_norm_are_advised_against(capsys, norm_input):
  c = base_config()
  with c.unlocked():
    c.drafter.eagle.feature_layers = (0, 1)
    c.drafter.eagle.norm_input = norm_input
  validate_config(c)
  advised = "set drafter.eagle.norm_input=True" in capsys.readouterr().err
  assert advised == (not norm_input)


def test_micro_batches_that_do_not_split_over_the_data_parallel_devices_fail_early():
  c = base_config()
  c.mesh.axes.replica = 2  # fsdp = -1: the other 4 of 8 devices
  c.rl.micro_batch_rows = 12
  with pytest.raises(ConfigError, match=r"micro_batch_rows=12 must be a multiple of the "
                                        r"data-parallel devices \(replica x fsdp = 8\)"):
    validate_config(c, num_devices=8)
  c.rl.micro_batch_rows = 16
  validate_config(c, num_devices=8)


def test_bad_architecture_is_a_config_error():
  c = base_config()
  c.model.num_kv_heads = 3
  with pytest.raises(ConfigError, match="must be a multiple of num_kv_heads=3"):
    model_config(c)


def _cli(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "tlt_jax.generate", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["--config.model.dtyp=x"], 'config error: unknown config key \'dtyp\' Did you mean "dtype"'),
    (["--config.mesh.axes.replica=3"], "config error: mesh.axes="),
    (["--config.model.dtype=fp8"], "config error: model.dtype='fp8' is not allowed"),
    (["--config.model.path=/nope"], "config error: model.path='/nope' does not exist"),
    (["--config.generate.max_new_tokens=2000"], "config error: generate.prompt_len + "
                                                "generate.max_new_tokens = 2016 exceeds "
                                                "max_position_embeddings of "),
    (["--config.logging.tensorboard=True"], "config error: logging.tensorboard=True is set but "
                                            "this job writes no metrics"),
])
def test_cli_config_errors_are_one_line(args, message):
  r = _cli("--config", "configs/default.py", *args)
  assert r.returncode != 0
  assert message in r.stderr
  assert "Traceback" not in r.stderr


def test_renamed_keys_still_work_on_command_lines_and_config_files_name_the_new_key(tmp_path):
  from tlt_jax.cli import config_from_file, read_config_file
  # On a job's command line: read as the new key (the value arrives: min_ops=0 is refused).
  r = _cli("--config", "configs/default.py", "--config.task.min_steps=0")
  assert "warning: config key task.min_steps is now task.min_ops" in r.stderr
  assert r.returncode != 0 and "need 1 <= min_ops <= max_ops, got min_ops=0" in r.stderr
  # In an experiment's overrides.
  c = config_from_file(os.path.join(REPO, "configs/default.py"),
                       ["rollout.steps_per_call=4", "sft.warmup_steps=7"])
  assert (c.rollout.iterations_per_call, c.sft.lr_warmup_steps) == (4, 7)
  # A config file that sets an old key is told the new one, locked or not.
  (tmp_path / "old.py").write_text("from tlt_jax.config import base_config\n"
                                   "def get_config(arg=None):\n  c = base_config()\n"
                                   "  c.lock()\n  c.drafter.clip_norm = 2.0\n  return c\n")
  with pytest.raises(ConfigError, match="failed at line 5: .*; drafter.clip_norm is now "
                                        "drafter.grad_clip"):
    read_config_file(str(tmp_path / "old.py"))
  c = base_config()
  c.drafter.train_steps_ahead = 3
  with pytest.raises(ConfigError, match="config key 'drafter.train_steps_ahead' is now "
                                        "'drafter.train_depth': set that instead"):
    validate_config(c)


def test_cli_bad_variant(tmp_path):
  r = _cli("--config", "configs/default.py:nope")
  assert r.returncode != 0 and "unknown variant 'nope'" in r.stderr
  assert "Traceback" not in r.stderr


def _job(job, *args, cwd=REPO):
  env = dict(os.environ, JAX_PLATFORMS="cpu",  # the package from any cwd
             PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
  return subprocess.run([sys.executable, "-m", f"tlt_jax.{job}", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=120)


def _one_line_error(r, message):
  assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr
  assert len([line for line in r.stderr.splitlines() if "error" in line]) == 1, r.stderr


@pytest.mark.parametrize("job", ["train", "sft", "warmup_drafter", "generate"])
def test_stray_arguments_fail_in_one_line(job, tmp_path):
  """A boolean given after a space ('--flag False') leaves 'False' over; absl would ignore it."""
  r = _job(job, "--config", "configs/default.py:runlocal", "--workdir", str(tmp_path / "w"),
           "--config.rollout.speculative.enable", "False")
  _one_line_error(r, "command line error: unexpected argument 'False' after "
                     "--config.rollout.speculative.enable: write "
                     "--config.rollout.speculative.enable=False")
  assert not (tmp_path / "w").exists()


def test_stray_words_after_a_value_fail_in_one_line(tmp_path):
  r = _job("generate", "--config", "configs/default.py:runlocal", "--workdir", str(tmp_path),
           "extra", "words")
  _one_line_error(r, "unexpected argument 'extra', 'words': the jobs take only flags, each as "
                     "--flag=value")


def test_config_file_errors_are_one_line(tmp_path):
  """A relative path names the current directory; a failing file its line."""
  r = _job("generate", "--config", "configs/default.py:runlocal", cwd=tmp_path)
  _one_line_error(r, f"config error: config file 'configs/default.py' (in {tmp_path}) does "
                     f"not exist; relative paths are read from the current directory")
  (tmp_path / "raises.py").write_text("def get_config(arg=None):\n  return {}['rl']\n")
  r = _job("train", "--config", str(tmp_path / "raises.py"), "--config.rl.steps=3")
  _one_line_error(r, f"config error: config file '{tmp_path / 'raises.py'}' failed at line 2: "
                     f"KeyError: 'rl'")


def test_a_config_file_reads_the_presets_beside_it_from_any_directory(tmp_path, monkeypatch):
  """configs/presets.py is imported by its path, beside the config file: a copy of both
  elsewhere, run from a third directory, reads the copy's presets."""
  mine = tmp_path / "mine"
  mine.mkdir()
  configs = pathlib.Path(REPO) / "configs"
  (mine / "default.py").write_text((configs / "default.py").read_text())
  presets = (configs / "presets.py").read_text()
  assert "c.rollout.update(max_batch=8, " in presets
  (mine / "presets.py").write_text(presets.replace("c.rollout.update(max_batch=8, ",
                                                   "c.rollout.update(max_batch=6, "))
  monkeypatch.chdir(tmp_path)
  assert config_from_file(f"{configs}/default.py:runlocal").rollout.max_batch == 8
  assert config_from_file(str(mine / "default.py:runlocal")).rollout.max_batch == 6
  assert config_from_file(str(mine / "default.py")).rollout.max_batch == 32  # no preset


@pytest.mark.parametrize("text,message", [
    ("def get_config(arg=None)\n  return 1\n", "does not parse: expected ':' (line 1)"),
    ("x = 1\n", "has no get_config(arg) function"),
    ("import no_such_module\n", "failed at line 1: ModuleNotFoundError: No module named"),
    ("def get_config(arg=None):\n  raise ValueError(f'unknown variant {arg!r}')\n",
     "failed at line 2: unknown variant 'x'"),
])
def test_config_files_that_fail_are_named(tmp_path, text, message):
  from tlt_jax.cli import read_config_file
  (tmp_path / "c.py").write_text(text)
  with pytest.raises(ConfigError, match=re.escape(f"config file '{tmp_path / 'c.py'}' {message}")):
    read_config_file(f"{tmp_path / 'c.py'}:x")


@pytest.mark.parametrize("job", ["warmup_drafter", "generate"])
def test_a_workdir_that_cannot_be_made_is_one_line(job, tmp_path):
  (tmp_path / "a-file").write_text("")
  r = _job(job, "--config", "configs/default.py:runlocal", "--workdir",
           str(tmp_path / "a-file" / "run"))
  _one_line_error(r, "cannot be a folder: not a directory")


def test_a_policy_folder_is_not_a_drafter():
  c = base_config()
  c.drafter.eagle.path = os.path.join(REPO, "assets", "tiny-policy")
  with pytest.raises(ConfigError, match=r"drafter.eagle.path='.*tiny-policy': not a drafter "
                                        r"export \(it describes a 'qwen2' model: a policy "
                                        r"folder\?\); a drafter folder, .* holds a config.json "
                                        r"with 'family', 'drafter' and 'policy' sections"):
    validate_config(c)


def test_a_reduced_draft_vocabulary_needs_a_warmed_drafter(tiny_cfg):
  """A new drafter's draft vocabulary would be ids 0..r-1, not the tokens the policy generates
  most (which only the warm-up picks): an RL run refuses it; the warm-up (fresh) builds it."""
  c = base_config()
  c.drafter.eagle.path, c.drafter.eagle.draft_vocab_size = "", 16
  with pytest.raises(ConfigError, match=r"drafter.eagle.draft_vocab_size=16 needs a drafter "
                                        r"whose draft vocabulary .* set drafter.eagle.path to an "
                                        r"export of python -m tlt_jax.warmup_drafter"):
    load_drafters_for(c, tiny_cfg)
  eagle = load_drafters_for(c, tiny_cfg, fresh=True)["eagle"]
  assert eagle.settings.draft_vocab_size == 16 and eagle.params[DRAFT_TO_POLICY].shape == (16,)


@pytest.mark.slow
def test_cli_generates_and_writes_outputs(tmp_path):
  r = _cli("--config", "configs/default.py:runlocal", "--workdir", str(tmp_path))
  assert r.returncode == 0, r.stderr
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["devices"] == 2 and summary["decode_tokens_per_s"] > 0
  lines = (tmp_path / "generations.jsonl").read_text().splitlines()
  assert len(lines) == 4
  assert all(len(json.loads(line)["completion"]) == 8 for line in lines)


def test_rollout_sections_build_the_engine_pieces():
  from tlt_jax.components import (drafter_settings, engine_config, make_tuner_from_config,
                                  sampling_params)
  c = repo_config("default")
  assert engine_config(c).sd_threshold == c.rollout.sd_threshold
  assert sampling_params(c).temperature == c.rollout.temperature
  assert len(make_tuner_from_config(c).strategies()) == len(c.rollout.speculative.arms)
  c.rollout.speculative.enable = False  # the baseline: never switches to SD
  assert engine_config(c).sd_threshold == 0
  c.drafter.eagle.feature_layers = (0, 2)
  assert drafter_settings(c, "eagle").feature_layers == (0, 2)
  assert model_config(c).feature_layers == (0, 2)


@pytest.mark.parametrize("path,value,match", [
    ("rollout.max_batch", 48, "max_batch=48 must be a power of two"),
    ("rollout.speculative.tuner", "ucb", r"tuner='ucb' is not allowed.*'beg_mab'"),
    ("rollout.speculative.arms", ("2,2,8",), "exceeds the 6 draft candidates"),
    ("rollout.top_p", 0.0, "top_p must be in"),
    ("drafter.eagle.num_layers", 0, "drafter.eagle.num_layers must be >= 1"),
    ("drafter.eagle.draft_vocab_size", -1, r"draft_vocab_size must be >= 0 \(0 = the policy's"),
    ("drafter.eagle.draft_vocab_size", 1, r"draft_vocab_size=1 is below the widest strategy's"),
    ("rollout.max_new_tokens", 10_000, "exceeds model.max_position_embeddings"),
    ("rl.learning_rate", float("nan"), r"rl.learning_rate=nan must be a finite number"),
    ("rollout.temperature", float("inf"), r"rollout.temperature=inf must be a finite"),
    ("task.reasoning_gym.weights", (float("nan"), 1.0),
     r"task.reasoning_gym.weights=\(nan, 1.0\) must be a finite number in each entry"),
    ("task.seed", -1, r"task.seed=-1 must be >= 0"),
    ("task.eval_seed", -3, r"task.eval_seed=-3 must be >= 0"),
    ("rl.max_minutes", -1.0, r"rl.max_minutes=-1.0 must be >= 0"),
    ("sft.max_minutes", -0.5, r"sft.max_minutes=-0.5 must be >= 0"),
    ("drafter.warmup.max_minutes", -2.0, r"drafter.warmup.max_minutes=-2.0 must be >= 0"),
    ("profile.first_step", 0, r"profile.first_step=0 must be positive"),
    ("profile.num_steps", -1, r"profile.num_steps=-1 must be >= 0"),
    # Silent before: no arm means no SD, a strategy's error did not say where it was set,
    # another algorithm's knob was ignored, a huge corpus failed to allocate mid-run.
    ("rollout.speculative.arms", (), r"^rollout.speculative.arms=\(\) gives the beg_mab tuner "
                                     r"no strategy, so SD would never run; .* or set "
                                     r"rollout.speculative.enable=False$"),
    ("rollout.speculative.arms", ("6,2",), r"^rollout.speculative.arms=\('6,2',\): bucket 0 .*"
                                          r"a strategy is \(depth, topk, verify_tokens"),
    ("rollout.speculative.arms", ("6,2,12,eagle+sufix",),
     r"^rollout.speculative.arms=\('6,2,12,eagle\+sufix',\): .*unknown drafter 'sufix'"),
    ("rl.dapo.max_rounds", 5, r"^rl.dapo.max_rounds=5 is set but rl.algorithm='grpo' does not "
                              r"read it; set rl.algorithm='dapo', or leave rl.dapo.max_rounds "
                              r"at its default \(3\)$"),
    # Silent before: the strategy was read by the fixed tuner and the warm-up alone, a knob of
    # a tuner that is not the run's or the W&B project without W&B was ignored, generate
    # decoded past the model's positions.
    ("rollout.speculative.strategy", "4,2,8,medusa",
     r"^rollout.speculative.strategy='4,2,8,medusa': unknown drafter 'medusa' in a strategy"),
    ("rollout.speculative.strategy", "fast", r"^rollout.speculative.strategy='fast': a strategy "
                                             r"is \(depth, topk, verify_tokens\[, drafts\]\)"),
    ("rollout.speculative.explore_iterations", 8,
     r"^rollout.speculative.explore_iterations=8 is set but rollout.speculative.tuner='beg_mab' "
     r"does not read it; use the 'cheapest' tuner, or leave "
     r"rollout.speculative.explore_iterations at its default \(4\)$"),
    ("logging.wandb_project", "mine", r"^logging.wandb_project='mine' is set but logging.wandb="
                                      r"False \(no W&B run\); set logging.wandb=True, or leave "
                                      r"logging.wandb_project at its default \('tlt_jax'\)$"),
    ("generate.max_new_tokens", 5000, r"^generate.prompt_len \+ generate.max_new_tokens = 5016 "
                                      r"exceeds model.max_position_embeddings=4096; lower them$"),
])
def test_bad_rollout_values(path, value, match):
  c = base_config()
  section, key = path.rsplit(".", 1)
  node = c
  for part in section.split("."):
    node = node[part]
  node[key] = value
  with pytest.raises(ConfigError, match=match):
    validate_config(c)


@pytest.mark.parametrize("arms,knob,value,trains", [
    (("4,1,5,suffix",), "ce_weight", 0.5, "[]"),
    (("4,1,5,suffix",), "train_depth", 2, "[]"),
    (("4,2,8,mtp",), "ce_weight", 0.5, "['mtp']"),
])
def test_a_drafter_loss_knob_no_trained_drafter_reads_is_an_error(arms, knob, value, trains):
  """drafter.ce_weight and train_depth are EAGLE's loss knobs alone (MTP reads the decay): a
  run that trains no EAGLE drafter must not look as if it used them."""
  c = base_config()
  c.rollout.speculative.arms = arms
  validate_config(c)
  c.drafter[knob] = value
  with pytest.raises(ConfigError) as e:
    validate_config(c)
  default = getattr(base_config().drafter, knob)
  assert str(e.value) == (f"drafter.{knob}={value!r} is set but no drafter the run trains "
                          f"reads it (it trains {trains}); train a drafter whose loss reads it "
                          f"(eagle), or leave drafter.{knob} at its default ({default!r})")
  c.rollout.speculative.arms = ("4,2,8", "4,2,8,mtp")  # EAGLE trains too: read
  validate_config(c)


@pytest.mark.parametrize("tuner", ["cheapest", "table", "fixed"])
def test_the_strategy_is_checked_under_every_tuner(tuner):
  """The warm-up's accept-length check reads rollout.speculative.strategy whatever the tuner."""
  c = base_config()
  c.rollout.speculative.tuner = tuner
  validate_config(c)
  c.rollout.speculative.strategy = "4,2,8,eagle+medusa"
  with pytest.raises(ConfigError, match=r"^rollout.speculative.strategy='4,2,8,eagle\+medusa': "
                                        r"unknown drafter 'medusa'"):
    validate_config(c)


@pytest.mark.parametrize("tuner,knob,value,readers", [
    ("fixed", "epsilon", 0.3, "'beg_mab' or 'cheapest'"),
    ("table", "window", 10, "'beg_mab' or 'cheapest'"),
    ("cheapest", "plain_arm", False, "'beg_mab'"),
    ("fixed", "explore_iterations", 2, "'cheapest'"),
    ("fixed", "arms", ("8,4,32",), "'beg_mab' or 'cheapest' or 'table'"),
    ("fixed", "bucket_thresholds", (1, 2), "'beg_mab' or 'cheapest' or 'table'"),
])
def test_a_tuner_knob_the_tuner_does_not_read_is_refused(tuner, knob, value, readers):
  """Each tuner knob is read by the tuners whose constructors take it, and by no other."""
  c = base_config()
  c.rollout.speculative.tuner = tuner
  c.rollout.speculative[knob] = value
  default = base_config().rollout.speculative[knob]
  with pytest.raises(ConfigError) as e:
    validate_config(c)
  assert str(e.value) == (f"rollout.speculative.{knob}={value!r} is set but "
                          f"rollout.speculative.tuner={tuner!r} does not read it; use the "
                          f"{readers} tuner, or leave rollout.speculative.{knob} at its default "
                          f"({default!r})")
  c.rollout.speculative.tuner = readers.split("'")[1]
  validate_config(c)
  c.rollout.speculative.update(tuner=tuner, enable=False)  # no SD: no tuner reads any of them
  validate_config(c)


def test_logging_on_a_job_that_writes_no_metrics_is_refused():
  c = base_config()
  c.logging.tensorboard = True
  validate_config(c)
  with pytest.raises(ConfigError, match=r"^logging.tensorboard=True is set but this job writes "
                                        r"no metrics; log a job that does"):
    validate_config(c, writes_metrics=False)


def test_a_value_the_command_line_made_unread_goes_and_one_it_gives_stays():
  """configs/default.py's EAGLE drafter path, once the arms draft without EAGLE, is dropped
  with it (the user only switched to weightless drafters); the same path given with them is
  refused, and so is a config file's own value that its own run does not read."""
  weightless = "rollout.speculative.arms=('4,1,5,suffix',)"
  c = config_from_file(f"{REPO}/configs/default.py:runlocal", [weightless])
  validate_config(c)
  assert c.drafter.eagle.path == ""
  drafter = os.path.join(REPO, "assets", "tiny-drafter")
  c = config_from_file(f"{REPO}/configs/default.py:runlocal",
                       [weightless, f"drafter.eagle.path={drafter}"])
  with pytest.raises(ConfigError, match=r"^drafter.eagle.path='.*tiny-drafter' is set but the "
                                        r"run does not use drafter 'eagle'"):
    validate_config(c)
  c = config_from_file(f"{REPO}/configs/default.py:runlocal", ["drafter.mtp.num_heads=2"])
  with pytest.raises(ConfigError, match=r"^drafter.mtp.num_heads=2 is set but the run does not"):
    validate_config(c)
  # On a job's command line: the config passes (the job stops at its workdir, after it).
  r = _cli("--config", "configs/default.py:runlocal", "--workdir", "/dev/null/x",
           f"--config.{weightless}")
  assert "--workdir '/dev/null/x' cannot be a folder" in r.stderr, r.stderr[-2000:]


def test_gpu_configs_need_a_model_path_and_validate_with_one():
  with pytest.raises(ValueError, match="1gpu was removed: .* do not fit one 80 GB GPU"):
    repo_config("qwen2_5_gpu", "1gpu")
  c = repo_config("qwen2_5_gpu", "8gpu")
  with pytest.raises(ConfigError, match="model.path='/path/to/Qwen2.5-7B-Instruct' does not"):
    validate_config(c)
  c.unlock()
  c.model.path = os.path.join(REPO, "assets", "tiny-policy")  # any local HF folder
  with pytest.raises(ConfigError, match="max_position_embeddings of .*tiny-policy"):
    validate_config(c)  # 512 + 8192 tokens do not fit the tiny policy's 1024 positions
  c.rollout.max_prompt_len, c.rollout.max_new_tokens = 128, 512
  validate_config(c, num_devices=8)


@pytest.mark.parametrize("variant,placeholder,devices", [("8gpu", "Qwen3-8B", 8),
                                                          ("1gpu", "Qwen3-1.7B", 1)])
def test_the_qwen3_gpu_configs_need_a_model_path_and_validate_with_one(variant, placeholder,
                                                                      devices):
  c = repo_config("qwen3_gpu", variant)
  with pytest.raises(ConfigError, match=f"model.path='/path/to/{placeholder}' does not"):
    validate_config(c)
  c.unlock()
  c.model.path = os.path.join(REPO, "assets", "tiny-policy")  # any local HF folder
  c.rollout.max_prompt_len, c.rollout.max_new_tokens = 128, 512
  validate_config(c, num_devices=devices)
  with pytest.raises(ValueError, match=r"give the variant '8gpu' \(Qwen3-8B\) or '1gpu'"):
    repo_config("qwen3_gpu", "2gpu")


def test_scan_layers_picks_the_loop_or_the_scan_per_pass():
  from tlt_jax.components import model_config, training_model_config
  c = base_config()
  for value, decode_scans, train_scans in (("none", False, False), ("train", False, True),
                                           ("all", True, True)):
    c.model.scan_layers = value
    cfg = model_config(c)
    assert (cfg.scan_layers, training_model_config(c, cfg).scan_layers) == (
        decode_scans, train_scans)


def test_a_corpus_larger_than_any_group_is_one_line_naming_its_memory():
  """corpus_rows=100000000 with suffix arms failed at the first evaluation ('Unable to
  allocate 35.8 GiB'): a row copies only from its group's other responses."""
  c = base_config()
  c.rollout.speculative.arms = ("6,1,7,suffix", "6,2,12,eagle+suffix")
  c.rollout.speculative.corpus_rows = 8  # the default fits
  validate_config(c)
  c.rollout.speculative.corpus_rows = 100_000_000
  with pytest.raises(ConfigError, match=r"^rollout.speculative.corpus_rows=100000000 is more "
                     r"responses than any group holds \(rl.num_samples=8, rl.eval_samples=4, "
                     r"drafter.warmup.samples_per_prompt=1\): .*\[64, 100000000, 256\] int32 "
                     r"array \(6103.5 GiB\); set it to at most 8$"):
    validate_config(c)
  c.rollout.speculative.arms = ("4,2,8",)  # no arm reads the corpus: nothing allocates it
  validate_config(c)


def test_config_from_file_parses_a_tuple_override_as_the_command_line_does():
  """The command line reads --config.rollout.speculative.arms=6,2,12,eagle+suffix as one
  strategy; config_from_file split the same string into its characters."""
  c = config_from_file(os.path.join(REPO, "configs", "default.py"),
                       ["rollout.speculative.arms=6,2,12,eagle+suffix",
                        "rollout.speculative.bucket_thresholds=1,4"])
  assert c.rollout.speculative.arms == ("6,2,12,eagle+suffix",)
  assert c.rollout.speculative.bucket_thresholds == (1, 4)
  c = config_from_file(os.path.join(REPO, "configs", "default.py"),
                       ["rollout.speculative.arms='4,2,8', '6,1,7,suffix'"])
  assert c.rollout.speculative.arms == ("4,2,8", "6,1,7,suffix")


def test_the_engines_defaults_are_the_schemas():
  """One default per knob: the engine a library user builds with EngineConfig() is the one
  the config's defaults build."""
  assert engine_config(base_config()) == EngineConfig()
