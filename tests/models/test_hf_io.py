"""HF export/load round trips and the error paths of the loader."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.conftest import REPO
from tests.models import hf_fixtures
from tlt_jax.models import init_params
from tlt_jax.models.hf import (hf_config_dict, load_hf_config, load_hf_params, load_tokenizer,
                               model_config_from_dict, model_config_from_hf, save_hf_checkpoint)


def _assert_trees_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
  assert jax.tree.structure(a) == jax.tree.structure(b)


@pytest.mark.parametrize("max_shard_bytes", [4 << 30, 20_000])
def test_export_then_load_is_bit_exact(tiny_cfg, tiny_params, tmp_path, max_shard_bytes):
  save_hf_checkpoint(str(tmp_path), tiny_params, tiny_cfg, max_shard_bytes=max_shard_bytes)
  sharded = os.path.exists(tmp_path / "model.safetensors.index.json")
  assert sharded == (max_shard_bytes < 1 << 20)
  umask = os.umask(0)
  os.umask(umask)
  for name in os.listdir(tmp_path):  # the weights as readable as the config (not 0600)
    assert os.stat(tmp_path / name).st_mode & 0o777 == 0o666 & ~umask, name
  cfg = load_hf_config(str(tmp_path), attention_impl=tiny_cfg.attention_impl)
  assert cfg == tiny_cfg
  _assert_trees_equal(load_hf_params(str(tmp_path), cfg), tiny_params)


def test_export_loads_in_transformers(tiny_cfg, tiny_params, tmp_path):
  from transformers import AutoModelForCausalLM
  save_hf_checkpoint(str(tmp_path), tiny_params, tiny_cfg)
  model = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
  assert model.config.model_type == "qwen2"
  got = model.model.layers[1].self_attn.k_proj.weight.detach().numpy()
  want = np.asarray(tiny_params["layers"]["self_attn"]["k_proj"]["kernel"][1])
  np.testing.assert_array_equal(got, want.reshape(tiny_cfg.hidden_size, -1).T)


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_an_export_states_its_tokenizers_special_ids(tiny_cfg, tiny_params, tmp_path,
                                                     model_type):
  """A Hugging Face model loaded from an export stops at the tokenizer's EOS: config.json and
  generation_config.json carry the tokenizer's ids, not LlamaConfig's BOS 1 / EOS 2, and an
  export without a tokenizer claims none."""
  from transformers import AutoConfig, GenerationConfig
  cfg = tiny_cfg if model_type == "qwen2" else tiny_cfg.replace(model_type="llama",
                                                                 qkv_bias=False)
  save_hf_checkpoint(str(tmp_path / "tok"), tiny_params, cfg, _word_tokenizer())
  save_hf_checkpoint(str(tmp_path / "none"), tiny_params, cfg)
  for folder, want in (("tok", (6, 1, 0)), ("none", (None, None, None))):
    for c in (AutoConfig.from_pretrained(str(tmp_path / folder), local_files_only=True),
              GenerationConfig.from_pretrained(str(tmp_path / folder), local_files_only=True)):
      assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == want, (folder, type(c))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("qwen_err")
  hf_fixtures.save_random_model(hf_fixtures.qwen2_config(), str(path))
  return path


def _copy_with(src, dst, edit):
  os.makedirs(dst, exist_ok=True)
  with open(src / "config.json") as f:
    cfg = json.load(f)
  with open(dst / "config.json", "w") as f:
    json.dump(cfg, f)
  tensors = load_file(str(src / "model.safetensors"))
  edit(tensors)
  save_file(tensors, str(dst / "model.safetensors"))
  return str(dst)


def test_folder_without_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    load_hf_config(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_hf_config(str(tmp_path / "nope"))


def _config_cases():
  """config.json dicts as exporters write them: transformers 5's (rope_parameters), older ones
  (top-level rope_theta, rope_scaling), and minimal ones that leave the sizes to the class's
  defaults (Qwen2's and Qwen3's 32 KV heads, Qwen3's head_dim 128, Llama's derived ones)."""
  full = {name: make().to_dict() for name, make in (
      ("qwen2", hf_fixtures.qwen2_config), ("llama3_scaled", hf_fixtures.llama_config),
      ("qwen3", hf_fixtures.qwen3_config), ("qwen3_tied", lambda: hf_fixtures.qwen3_config(True)))}
  old_style = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8,
               "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 50,
               "rope_theta": 500000.0, "tie_word_embeddings": True,
               "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}}
  minimal = {f"{mt}_minimal": {"model_type": mt, "hidden_size": 256, "num_attention_heads": 32}
             for mt in ("llama", "qwen2", "qwen3")}
  with open(os.path.join(REPO, "assets", "tiny-policy", "config.json")) as f:
    shipped = json.load(f)
  return {**full, "llama_old_style": old_style, **minimal, "tiny_policy": shipped}


@pytest.mark.parametrize("name", sorted(_config_cases()))
def test_config_json_reads_as_transformers_reads_it(tmp_path, name):
  """load_hf_config reads config.json without transformers (whose config classes import
  PyTorch): the same ModelConfig as through transformers' AutoConfig, omitted keys included."""
  from transformers import AutoConfig
  with open(tmp_path / "config.json", "w") as f:
    json.dump(_config_cases()[name], f)
  want = model_config_from_hf(AutoConfig.from_pretrained(str(tmp_path), local_files_only=True))
  assert load_hf_config(str(tmp_path)) == want


def test_reading_and_exporting_a_model_never_import_torch(tmp_path):
  """Every job reads a config and most export one: without PyTorch's import (seconds)."""
  code = ("import sys\n"
          "from tlt_jax.models.hf import load_hf_config, load_hf_params, save_hf_checkpoint\n"
          "cfg = load_hf_config('assets/tiny-policy')\n"
          "print(cfg.num_layers, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
          f"save_hf_checkpoint({str(tmp_path)!r}, load_hf_params('assets/tiny-policy', cfg), cfg)\n"
          "print('torch' in sys.modules)")
  r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == ["6", "[]", "False"]
  assert load_hf_config(str(tmp_path)) == load_hf_config(os.path.join(REPO, "assets",
                                                                      "tiny-policy"))


def test_unsupported_model_type():
  from transformers import GPT2Config
  with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*qwen2.*llama"):
    model_config_from_hf(GPT2Config())


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("qwen3_err")
  hf_fixtures.save_random_model(hf_fixtures.qwen3_config(), str(path))
  return path


def _qwen3_mixture_of_experts(config):
  from transformers import Qwen3MoeConfig
  moe = Qwen3MoeConfig(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                       num_hidden_layers=config["num_hidden_layers"], num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32).to_dict()
  config.clear()
  config.update(moe, architectures=["Qwen3MoeForCausalLM"])


def _yarn(config):  # as the Qwen3 model cards suggest for contexts past 32k
  config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 128}


def _sliding_window(config):  # as configs from before transformers 5 declare it
  del config["layer_types"]
  config.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)


@pytest.mark.parametrize("edit,message", [
    (_qwen3_mixture_of_experts, "unsupported model_type 'qwen3_moe' (a mixture of experts: "
                                "only dense models run here); supported: ('qwen2', 'llama', "
                                "'qwen3')"),
    (_yarn, "unsupported rope_type 'yarn' (RoPE scaling); supported: ('default', 'llama3')"),
    (_sliding_window, "sliding-window attention (sliding_window=16 on 1 of 2 layers, from "
                      "layer 1) is not supported; only full attention runs here"),
])
def test_a_qwen3_folder_the_decoder_cannot_run_fails_in_one_line(qwen3_dir, tmp_path, edit,
                                                                  message):
  """Read from config.json alone (no weights, no transformers) when a run's config is
  checked, and again when transformers reads the folder: the same line, naming what is
  missing."""
  from tests.conftest import repo_config
  from tlt_jax.config import ConfigError, check_config
  from tlt_jax.models.hf import check_model_folder
  path = _copy_with(qwen3_dir, tmp_path / "m", lambda t: None)
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  edit(config)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError) as e:
    check_model_folder(path)
  assert str(e.value) == f"{path}/config.json: {message}"
  with pytest.raises(ValueError) as e:
    load_hf_config(path)
  assert str(e.value) == message
  run = repo_config("default", "runlocal")
  with run.unlocked():
    run.model.path = path
  with pytest.raises(ConfigError) as e:
    check_config(run)
  assert str(e.value).endswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("key,message", [
    ("head_dim", r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \(64, 48\), "
                 r"expected \(512, 48\) for this config; .*/config.json has no head_dim, so "
                 r"transformers' default \(head_dim=128\) stood in: add the model's own values"),
    ("num_hidden_layers", r"is missing 330 tensors: .*config.json has no num_hidden_layers, so "
                          r"transformers' default \(num_hidden_layers=32\) stood in"),
])
def test_a_qwen3_config_without_a_key_its_weights_need_names_the_key(qwen3_dir, tmp_path, key,
                                                                      message):
  """transformers' default for the missing key reads as another model's size: the error on
  the weights names the key, not only the tensor."""
  path = _copy_with(qwen3_dir, tmp_path / "m", lambda t: None)
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  del config[key]
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match=message):
    load_hf_params(path, load_hf_config(path))


def test_missing_tensors_are_listed(qwen_dir, tmp_path):
  def drop(t):
    del t["model.layers.1.mlp.up_proj.weight"]
    del t["lm_head.weight"]
  path = _copy_with(qwen_dir, tmp_path / "m", drop)
  cfg = load_hf_config(path)
  with pytest.raises(ValueError, match=r"missing 2 tensors: lm_head.weight, "
                                       r"model.layers.1.mlp.up_proj.weight"):
    load_hf_params(path, cfg)


def test_unexpected_tensors_are_listed(qwen_dir, tmp_path):
  def add(t):
    t["model.layers.0.extra.weight"] = np.zeros((2,), np.float32)
  path = _copy_with(qwen_dir, tmp_path / "u", add)
  with pytest.raises(ValueError, match=r"1 unexpected tensors.*model.layers.0.extra.weight"):
    load_hf_params(path, load_hf_config(path))


def test_shape_mismatch_names_tensor(qwen_dir, tmp_path):
  def shrink(t):
    t["model.norm.weight"] = t["model.norm.weight"][:-1].copy()
  path = _copy_with(qwen_dir, tmp_path / "s", shrink)
  with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(31,\), expected \(32,\)"):
    load_hf_params(path, load_hf_config(path))


def test_missing_weights_file(qwen_dir, tmp_path):
  (tmp_path / "config.json").write_text((qwen_dir / "config.json").read_text())
  with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
    load_hf_params(str(tmp_path), load_hf_config(str(tmp_path)))


def _export_cases(tiny_cfg):
  return {"qwen2": tiny_cfg,
          "llama": tiny_cfg.replace(model_type="llama", qkv_bias=False, tie_embeddings=True),
          "qwen3": tiny_cfg.replace(model_type="qwen3", qkv_bias=False, qk_norm=True,
                                    head_dim=16)}


def test_config_round_trip(tiny_cfg):
  for cfg in _export_cases(tiny_cfg).values():
    back = model_config_from_dict(hf_config_dict(cfg), attention_impl=cfg.attention_impl)
    assert back == cfg
  qwen3 = _export_cases(tiny_cfg)["qwen3"]
  # An architecture's flags are its model type's: a Qwen3 has no qkv bias, a Qwen2 no q/k norm.
  with pytest.raises(ValueError, match=r"^a qwen3 export needs qkv_bias=False, qk_norm=True, "
                                       r"not qkv_bias=True$"):
    hf_config_dict(qwen3.replace(qkv_bias=True))
  with pytest.raises(ValueError, match=r"^a qwen2 export needs qkv_bias=True, qk_norm=False, "
                                       r"not qkv_bias=False, qk_norm=True; use "
                                       r"model_type='qwen3'$"):
    hf_config_dict(qwen3.replace(model_type="qwen2"))


def test_an_exported_config_is_what_transformers_own_class_holds(tiny_cfg, tiny_params,
                                                                  tmp_path):
  """transformers reads an export's config.json (written without its config classes) as the
  config object its own class builds from the same values, every default included."""
  from transformers import AutoConfig, LlamaConfig, Qwen2Config, Qwen3Config
  classes = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}
  for name, cfg in _export_cases(tiny_cfg).items():
    params = init_params(cfg, jax.random.key(0))
    save_hf_checkpoint(str(tmp_path / name), params, cfg)
    got = AutoConfig.from_pretrained(str(tmp_path / name), local_files_only=True).to_dict()
    got.pop("_name_or_path")
    d = hf_config_dict(cfg)
    d.pop("transformers_version"), d.pop("model_type")
    want = classes[name](**d).to_dict()
    want.pop("_name_or_path")
    assert got == want, name


def _word_tokenizer():
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  vocab = {"<pad>": 0, "<eos>": 1, "1": 2, "+": 3, "=": 4, "2": 5, "<s>": 6}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                 bos_token="<s>")


def test_tokenizer_round_trip(tmp_path):
  _word_tokenizer().save_pretrained(str(tmp_path))
  loaded = load_tokenizer(str(tmp_path))
  assert loaded("1 + 1 = 2")["input_ids"] == [2, 3, 2, 4, 5]
  assert loaded.eos_token_id == 1
  with pytest.raises(FileNotFoundError, match="no tokenizer files"):
    load_tokenizer(str(tmp_path / "empty"))


def test_a_saved_tokenizer_loads_as_trained_next_to_a_qwen2_config(tmp_path, tiny_cfg):
  """The package's tokenizer (digits split one by one) saved beside a Qwen2 config.json loads
  with its own pre-tokenizer, not Qwen2's, and ids and chat prompts unchanged."""
  from tlt_jax.rl.tokenizer import prompt_ids, train_tokenizer
  texts = ["12 + 345 = 357", "Add (3 and 40). #### 43", "it's 7\n\n#### 7"]
  trained = train_tokenizer(texts * 20, vocab_size=300)
  (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(tiny_cfg)))
  trained.save_pretrained(str(tmp_path))
  loaded = load_tokenizer(str(tmp_path))
  assert str(loaded.backend_tokenizer.pre_tokenizer) == str(trained.backend_tokenizer.pre_tokenizer)
  assert "Digits" in str(loaded.backend_tokenizer.pre_tokenizer)
  for text in texts + ["What is 2+2? (Answer: 4)"]:
    assert loaded.encode(text) == trained.encode(text)
    assert prompt_ids(loaded, text) == prompt_ids(trained, text)
  assert (loaded.eos_token_id, loaded.pad_token_id) == (trained.eos_token_id,
                                                        trained.pad_token_id)


def test_reading_a_config_without_torch_prints_nothing(tmp_path):
  """torch is not a runtime dependency: a job on a torch-less install reads config.json and
  the tokenizer through transformers, which would otherwise greet every run (and every
  one-line config error) with its advice that PyTorch is missing."""
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  script = (
      "import importlib.util, sys\n"
      "find_spec = importlib.util.find_spec\n"
      "importlib.util.find_spec = lambda name, *a, **k: (\n"
      "    None if name.split('.')[0] == 'torch' else find_spec(name, *a, **k))\n"
      "from tlt_jax.models.hf import load_hf_config, load_tokenizer\n"
      f"load_hf_config({os.path.join(repo, 'assets', 'tiny-policy')!r})\n"
      f"load_tokenizer({os.path.join(repo, 'assets', 'tiny-policy')!r})\n"
      "import transformers\n"
      "assert not transformers.is_torch_available()\n")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, PYTHONPATH=repo, CI="1"))
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr == ""
