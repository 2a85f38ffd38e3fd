"""The headline's device run, the lease's last call (`python -m experiments.gpu_headline run`,
docs/gpu_lease.md): the staged model joined and imported, TLT and the baseline for N steps
each at JAX's default precision and, for the identity check, at the highest, and what comes
back: headline.json (per step both variants' seconds, tokens, accept length, calls and running
rows; the steady-state ratios; the responses compared token for token), the responses
(xz-compressed token ids) and the figures."""

from __future__ import annotations

import json
import lzma
import os
import pathlib
import shutil
import sys
import time

from tlt_jax.config import ConfigError
from tlt_jax.run_log import read_jsonl

from . import gpu_lease
from .common import own_folder, pyplot, run_stamp, save_figure, write_json
from .gpu_lease import LeaseError

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = f"{REPO / 'configs' / 'smollm2.py'}:gpu_headline"

def versions() -> dict:
  """The device (with its memory for programs) and the versions that matter."""
  import importlib.metadata
  import jax
  out = {"python": sys.version.split()[0]}
  for name in ("jax", "jaxlib", "transformers", "torch", "triton", "gguf", "ml_collections",
               "flax", "optax", "orbax-checkpoint"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  d = jax.devices()[0]
  out["device"] = f"{d.platform}: {d.device_kind} x{jax.device_count()}"
  out["device_memory_bytes"] = (d.memory_stats() or {}).get("bytes_limit")
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
  tlt_by = {(r["step"], r["prompt"], r["sample"]): r for r in tlt}
  mismatches = [{"step": r["step"], "prompt": r["prompt"], "sample": r["sample"],
                 "missing": o is None, "first_difference_at": None if o is None else
                 first_difference(r["token_ids"], o["token_ids"])}
                for r in base if (o := tlt_by.get((r["step"], r["prompt"], r["sample"]))) is None
                or (o["token_ids"], o["reward"]) != (r["token_ids"], r["reward"])]
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
                              if sum(r["sd_iterations"] for r in sd_tlt) else None)}


def plot_timeline(rows: dict[str, list[dict]], path: pathlib.Path) -> None:
  """Running rows over the rollout's seconds in the last step, per variant, and each step's
  plain and SD decode seconds."""
  fig, (a, b) = pyplot().subplots(1, 2, figsize=(11, 3.6), dpi=100)
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
  a.set(xlabel="seconds since the rollout began", ylabel="rows running", yscale="log")
  a.set_title("the long tail of one step", fontsize=9)
  a.legend(fontsize=8)
  b.set(xlabel="RL step", ylabel="decode seconds")
  b.set_title("where each rollout's decode time went", fontsize=9)
  b.legend(fontsize=7)
  save_figure(fig, path)


# ---------------------------------------------------------------- run (the last device call)


def own_lease_folder(folder: pathlib.Path) -> None:
  """Makes `folder` this script's own (marked), or refuses one that holds files it did not
  write: it replaces its own runs there and nothing else."""
  try:
    own_folder(folder, "gpu_headline", replace=False)
  except ConfigError as e:
    raise LeaseError(str(e)) from None


def step_rows(metrics: list[dict], timeline: list[dict], rollouts: list[dict]) -> list[dict]:
  """Per RL step of one run: its seconds, tokens, accept length, critical-path compiles, its
  rollout's decode iterations and seconds, plain and SD, the running rows over time
  ([seconds since the rollout began, rows running before the call, mode] per call), every
  call (mode, rows before and after it, program batch, strategy, iterations, its wall seconds
  and the seconds until the next call began) and the step's response lengths."""
  out = []
  for m in metrics:
    calls = [c for c in timeline if c["step"] == m["step"]]
    decode = {mode: [c for c in calls if c["mode"] == mode] for mode in ("plain", "sd")}
    starts = [c["t_end_s"] - c["wall_s"] for c in calls] + [m["rollout_s"]]
    after = [c["active"] for c in calls[1:]] + [0]
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
        "running": [[round(s, 4), c["active"], c["mode"]] for s, c in zip(starts, calls)],
        "calls": [{"mode": c["mode"], "active": c["active"], "after": a, "bucket": c["bucket"],
                   "strategy": c["strategy"], "iterations": c["iterations"],
                   "accept": round(c["accept_mean"], 4), "wall_s": round(c["wall_s"], 5),
                   "seconds": round(end - start, 5)}
                  for c, a, start, end in zip(calls, after, starts, starts[1:])],
        "lengths": [r["tokens"] for r in rollouts if r["step"] == m["step"]]})
  return out


def _variants(config, workdir: pathlib.Path, steps: int) -> dict:
  """TLT, then the baseline, for `steps` steps each in workdir/runs (replaced): their runs,
  step rows, compared responses and steady state."""
  from tlt_jax.cli import set_config_value

  from .rl_runs import run_variants
  config = config.copy_and_resolve_references()
  with config.unlocked():
    set_config_value(config, "rl.steps", steps)
  shutil.rmtree(workdir / "runs", ignore_errors=True)  # its own, from an earlier `run`
  # TLT first: its plan holds every program of the baseline's (prefill, plain decode, the
  # update), which the baseline then loads from the compilation cache instead of compiling
  # them again; steps 2..N, which the ratio compares, compile nothing in either order.
  runs = run_variants(config, ["tlt", "baseline"], workdir)
  rows = {name: step_rows(r["metrics"],
                          read_jsonl(str(workdir / "runs" / name / "timeline.jsonl"))[0],
                          r["rollouts"]) for name, r in runs.items()}
  return {"runs": runs, "steady_state": steady_state(rows["baseline"], rows["tlt"]),
          "responses": compare_responses(runs["baseline"]["rollouts"], runs["tlt"]["rollouts"]),
          "variants": {name: {"wall_s": r["wall_s"], "steps": rows[name],
                              "startup_s": r["wall_s"] - sum(x["step_s"] for x in rows[name]),
                              "compile_bill": r["summary"].get("compile_bill", {}),
                              **{k: r["summary"].get(k) for k in ("xla_compiles",
                                                                  "xla_cache_hits")}}
                       for name, r in runs.items()}}


def write_responses(path: pathlib.Path, measured: dict) -> int:
  """Every response (step, prompt, sample, reward, prompt and response token ids) of each
  precision and variant, as xz-compressed JSON lines; returns the bytes written."""
  tmp = path.with_name(f".{path.name}.tmp")
  with lzma.open(tmp, "wt") as f:
    for precision, got in measured.items():
      for variant, r in got["runs"].items():
        for row in r["rollouts"]:
          f.write(json.dumps({"precision": precision, "variant": variant,
                              **{k: row.get(k) for k in ("step", "prompt", "sample", "reward",
                                                         "prompt_ids", "token_ids")}}) + "\n")
  os.replace(tmp, path)
  return path.stat().st_size


def run(parts: pathlib.Path, steps: int, out: pathlib.Path, workdir: pathlib.Path,
        config_spec: str = CONFIG, sets: list[str] = (), quick: bool = False,
        identity_steps: int = 0) -> dict:
  """The last device call: the staged model joined and imported in the config's
  param_dtype, `_variants` at JAX's default precision and, with identity_steps, at
  jax_default_matmul_precision=highest; OUT's files written. Returns headline.json's
  content."""
  t0 = time.perf_counter()
  if out.exists() and not out.is_dir():
    raise LeaseError(f"--out {out} is a file; give a folder (at most 8 files come back)")
  out.mkdir(parents=True, exist_ok=True)
  own_lease_folder(workdir)
  gguf = gpu_lease.join(parts, gpu_lease.verify(parts), workdir / "gguf")
  import jax
  from tlt_jax.cli import config_from_file, setup_devices
  from tlt_jax.components import engine_config
  from tlt_jax.import_model import import_gguf

  from .rl_runs import plot_compiles, plot_end_to_end
  model = workdir / "model"
  # Read before the import, which writes the weights in the config's param_dtype.
  config = config_from_file(config_spec, [*sets, f"model.path={model}"])
  t_import = time.perf_counter()
  import_gguf(str(gguf), str(model), dtype=config.model.param_dtype)
  import_s = time.perf_counter() - t_import
  setup_devices(config)
  info = versions()
  print(json.dumps(info), flush=True)
  measured = {"default": _variants(config, workdir, steps)}
  if identity_steps:
    print(f"=== identity check: every matmul in float32 (highest precision), "
          f"{identity_steps} steps", flush=True)
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
      measured["highest"] = _variants(config, workdir / "highest", identity_steps)
    finally:
      jax.config.update("jax_default_matmul_precision", None)
  reported = lambda m: {k: m[k] for k in ("steady_state", "responses", "variants")}  # noqa: E731
  ec = engine_config(config)
  result = {
      "what": "TLT against the baseline, end to end, on one device (experiments/gpu_headline.py)",
      "quick": quick, "device": info["device"], **run_stamp(), "versions": info,
      "config": config_spec, "overrides": list(sets), "steps": steps,
      "model": {"gguf": gguf.name, "import_s": import_s, "dtype": config.model.dtype,
                "param_dtype": config.model.param_dtype},
      "engine": {"max_batch": ec.max_batch, "batch_sizes": list(ec.batch_sizes),
                 "sd_threshold": ec.sd_threshold,
                 "iterations_per_call": ec.iterations_per_call,
                 "tuner": config.rollout.speculative.tuner,
                 "arms": list(config.rollout.speculative.arms)},
      "precision": "default (jax_default_matmul_precision unset)",
      **reported(measured["default"]),
      "identity": ({"precision": "highest", "steps": identity_steps,
                    **reported(measured["highest"])} if identity_steps else None),
      "seconds": time.perf_counter() - t0}
  result["responses_bytes"] = write_responses(out / "responses.jsonl.xz", measured)
  write_json(out / "headline.json", result)
  runs = measured["default"]["runs"]
  plot_end_to_end(runs, out / "end_to_end.png")
  plot_compiles(runs, out / "compiles.png")
  plot_timeline({n: v["steps"] for n, v in result["variants"].items()}, out / "timeline.png")
  report(result)
  return result


def report(result: dict) -> None:
  """The run's table: per step both variants' step and rollout seconds and TLT's accept
  length, the steady state, and each precision's responses compared."""
  rows = {n: v["steps"] for n, v in result["variants"].items()}
  print(f"{'step':>4} {'base step_s':>11} {'tlt step_s':>10} {'base roll':>9} {'tlt roll':>8} "
        f"{'accept':>6}")
  for b, t in zip(rows["baseline"], rows["tlt"]):
    print(f"{b['step']:>4} {b['step_s']:>11.2f} {t['step_s']:>10.2f} {b['rollout_s']:>9.2f} "
          f"{t['rollout_s']:>8.2f} {t['accept_len'] or 0:>6.2f}")
  for label, part in (("default precision", result),
                      ("highest precision", result.get("identity") or {})):
    s, same = part.get("steady_state", {}), part.get("responses")
    if s.get("count"):
      print(f"{label}, steady state (steps {s['steps']}): baseline / TLT step "
            f"{s['step_ratio']:.2f}x (median {s['step_ratio_median']:.2f}x), rollout "
            f"{s['rollout_ratio']:.2f}x; baseline rollout share "
            f"{s['baseline_rollout_share']:.0%}; tail accept length "
            f"{s['accept_len_tail'] or 0:.2f}")
    if same:
      print(f"{label}: {same['responses']} responses compared, {same['mismatches']} differ")
  print(f"{result['seconds']:.0f} s in all")
