"""The RL-step figures (the long tail, adaptive vs frozen drafter, TLT vs baseline end to end),
and what the RL update does to a policy per setting and seed.

  python -m experiments.rl_runs --out results/rl_runs [--variants V ...] [--quick]
  python -m experiments.rl_runs --out results/gs --seeds 0 1 2 \
      --settings "kl=rl.kl_coef=0.1,rl.lr_warmup_steps=4" "lr3e-5=rl.learning_rate=3e-5"

The main job (tlt_jax.train) runs once per variant of VARIANTS, back to back, with the same
prompts and seed, each in OUT/runs/<variant>; with --settings, the baseline variant once per
setting and seed with the paired control on. What each writes: docs/reproducing.md.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import shutil
import sys
import time

import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from .common import (REPO, add_config_flags, check_own_folder, config_or_exit, own_folder,
                     pyplot, run_metadata, save_figure, write_json)
from tlt_jax.cli import set_config_value, setup_devices
from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.config import ConfigError
from tlt_jax.rollout.pool import wait_for_compiles_ahead
from tlt_jax.run_log import read_jsonl
from tlt_jax.train import train

plt = pyplot()
VARIANTS = {
    "baseline": {"rollout.speculative.enable": False, "drafter.spot_training": False},
    "tlt": {},
    "frozen": {"drafter.spot_training": False},
    "no_warmup": {"drafter.eagle.path": ""},
    "tlt_ahead": {"rollout.compile_ahead": True},
    "tlt_on_demand": {"rollout.compile_ahead": False},
    # Every SD batch bucket (any size at or above the SD threshold's) shares its programs.
    "tlt_shared": {"rollout.speculative.shared_max_batch": 1024},
    "tlt_own_programs": {"rollout.speculative.shared_max_batch": 0},
    # SD at any number of running rows (the tuner's top bucket from 5 rows on), not only in
    # the tail: where the drafter accepts enough that SD pays even on a full batch.
    "tlt_sd_whole_batch": {"rollout.sd_threshold": 1024},
}
DEFAULT_VARIANTS = ["baseline", "tlt", "frozen", "no_warmup"]
# What was tried on the tiny default (README: "What GRPO does to the tiny policy").
# Each costs what the default costs (128 responses per step), so any of them fits the quick
# start's time; 32 x 4 trades samples per prompt for prompts.
DEFAULT_SETTINGS = {
    "lr3e-5": "rl.learning_rate=3e-5",
    "kl0.1+warmup": "rl.kl_coef=0.1,rl.lr_warmup_steps=4",
    "32x4": "rl.prompts_per_step=32,rl.num_samples=4",
    "32x4, lr3e-5": "rl.prompts_per_step=32,rl.num_samples=4,rl.learning_rate=3e-5",
}


def parse_setting(text: str) -> tuple[str, list[str]]:
  """'NAME=KEY=VALUE,KEY=VALUE' -> (NAME, ['KEY=VALUE', ...])."""
  name, sep, rest = text.partition("=")
  overrides = [o.strip() for o in rest.split(",") if o.strip()]
  if not sep or not name or not overrides or any("=" not in o for o in overrides):
    raise ValueError(f"--settings {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE...], e.g. "
                     f"kl=rl.kl_coef=0.1,rl.lr_warmup_steps=4")
  return name.strip(), overrides


def run_variants(base, variants, out: pathlib.Path, fresh_cache: bool = False) -> dict:
  """Runs the job once per variant (names of VARIANTS, or {name: {key: value}} of config
  overrides) in a fresh OUT/runs/<name>; returns each run's wall time, summary, metrics,
  rollouts and held-out evaluations. fresh_cache: each run gets an empty persistent
  compilation cache of its own, as on a new machine: its slices share programs through it,
  and no run loads another's. A run's folder is replaced only when an earlier run of this
  script made it: ConfigError (before any run) for one that holds anything else, or for an
  unknown config key."""
  if not isinstance(variants, dict):
    variants = {name: VARIANTS[name] for name in variants}
  configs = {}
  for name, overrides in variants.items():  # every folder and override checked before any run
    check_own_folder(out / "runs" / name, "rl_runs")
    configs[name] = config = base.copy_and_resolve_references()
    with config.unlocked():
      for key, value in {**overrides, "rl.save_rollouts": True}.items():
        set_config_value(config, key, value)
  runs = {}
  for name, config in configs.items():
    workdir = own_folder(out / "runs" / name, "rl_runs")
    print(f"=== {name}", flush=True)
    with _own_cache(out / "xla-cache" / name, fresh_cache):
      t0 = time.perf_counter()
      summary = train(config, str(workdir))
      wall_s = time.perf_counter() - t0  # the run alone, not the cache folder's removal
    if summary.get("stopped_early"):  # a signal: what ran compares nothing
      sys.exit(f"run {name!r} stopped early")
    runs[name] = {"wall_s": wall_s, "summary": summary,
                  **{k: read_jsonl(str(workdir / f"{k}.jsonl"))[0]
                     for k in ("metrics", "rollouts", "eval")},
                  "slices": int(config.mesh.axes.get("replica", 1))}
  return runs


@contextlib.contextmanager
def _own_cache(path: pathlib.Path, fresh: bool):
  """With `fresh`, an empty compilation cache at `path` (a folder of this script's own) while
  the block runs, removed after."""
  if not fresh:
    yield
    return
  own_folder(path, "rl_runs")
  enable_compilation_cache(str(path))
  compilation_cache.reset_cache()  # the next compile opens the new folder
  try:
    yield
  finally:
    wait_for_compiles_ahead()  # a compile the run left running writes to the folder
    shutil.rmtree(path, ignore_errors=True)


def length_percentiles(rollouts: list[dict]) -> list[dict]:
  """Per RL step: p50 / p90 / max response length and the count (from rollouts.jsonl rows)."""
  rows = []
  for s in sorted({r["step"] for r in rollouts}):
    lengths = np.asarray([r["tokens"] for r in rollouts if r["step"] == s], np.float64)
    rows.append({"step": s, "count": int(lengths.size), "p50": float(np.median(lengths)),
                 "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max()),
                 "mean": float(lengths.mean())})
  return rows


def time_breakdown(metrics: list[dict], slices: int) -> list[dict]:
  """Per step: rollout seconds split into busy and idle slice time (idle_slice_s / slices),
  update seconds, and the idle share of the rollout's slice time."""
  out = []
  for m in metrics:
    idle = m["idle_slice_s"] / max(slices, 1)
    out.append({"step": m["step"], "rollout_busy_s": m["rollout_s"] - idle, "rollout_idle_s": idle,
                "update_s": m["update_s"], "other_s": m["step_s"] - m["rollout_s"] - m["update_s"],
                "idle_share": m["idle_slice_s"] / max(m["rollout_s"] * slices, 1e-9)})
  return out


def end_to_end(tlt: list[dict], base: list[dict]) -> dict:
  """Ratios of the baseline's time to TLT's over the steps both ran (speedup > 1: TLT faster),
  with and without the first step (which compiles most programs) and without compile time."""
  n = min(len(tlt), len(base))
  tlt, base = tlt[:n], base[:n]

  def total(ms, skip=0, key="step_s"):
    return float(sum(m[key] for m in ms[skip:]))
  out = {"steps": n, "speedup_step_time": total(base) / total(tlt),
         "speedup_rollout": total(base, key="rollout_s") / total(tlt, key="rollout_s")}
  if n > 1:
    out["speedup_step_time_after_first"] = total(base, 1) / total(tlt, 1)
    out["speedup_without_compiles_after_first"] = ((total(base, 1) - total(base, 1, "compile_s"))
                                                   / (total(tlt, 1) - total(tlt, 1, "compile_s")))
  out["reward_mean_tlt"] = float(np.mean([m["reward_mean"] for m in tlt]))
  out["reward_mean_baseline"] = float(np.mean([m["reward_mean"] for m in base]))
  return out


def plot_long_tail(lengths: list[dict], breakdown: list[dict], path: pathlib.Path) -> None:
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
  steps = [r["step"] for r in lengths]
  a.fill_between(steps, [r["p50"] for r in lengths], [r["max"] for r in lengths],
                 color="#3b6ea5", alpha=0.15, label="p50 to max")
  for key, style in (("p50", "-"), ("p90", "--"), ("max", ":")):
    a.plot(steps, [r[key] for r in lengths], style, color="#3b6ea5", label=key)
  a.set(xlabel="RL step", ylabel="response length (tokens)")
  a.set_title("response lengths per step (baseline)", fontsize=9)
  steps = np.asarray([r["step"] for r in breakdown])
  bottom = np.zeros(len(steps))
  for key, color, label in (("rollout_busy_s", "#3b6ea5", "rollout, slices busy"),
                            ("rollout_idle_s", "#e67e22", "rollout, mean slice idle"),
                            ("update_s", "#27ae60", "policy update"),
                            ("other_s", "#95a5a6", "other")):
    values = np.asarray([max(r[key], 0.0) for r in breakdown])
    b.bar(steps, values, bottom=bottom, color=color, label=label)
    bottom += values
  b.set(xlabel="RL step", ylabel="seconds")
  b.set_title("baseline step time", fontsize=9)
  a.legend(fontsize=8)
  b.legend(fontsize=8)
  save_figure(fig, path, step_axes=(a, b))


def plot_per_step(ax, runs: dict, labels: dict, series, title: str, ylabel: str = "") -> None:
  """One line per run of `labels` ({name: label}) that ran: series(its metrics) by RL step."""
  for name, label in labels.items():
    if name in runs:
      ms = runs[name]["metrics"]
      ax.plot([m["step"] for m in ms], series(ms), "o-", ms=4, label=label)
  ax.set(xlabel="RL step", ylabel=ylabel)
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)


def cumulative_step_s(ms: list[dict]):
  return np.cumsum([m["step_s"] for m in ms])


def plot_adaptation(runs: dict, path: pathlib.Path) -> None:
  fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
  plot_per_step(ax, runs, {"no_warmup": "no warm-up, spot-trained", "frozen": "warmed, frozen",
                           "tlt": "warmed, spot-trained"},
                lambda ms: [m["sd_accept_len_mean"] or np.nan for m in ms],
                "drafter: adaptive vs frozen", "SD accept length (tokens / iteration)")
  save_figure(fig, path, step_axes=(ax,))


def plot_compiles(runs: dict, path: pathlib.Path) -> None:
  """Per variant: compile seconds on the critical path (inside the steps, and outside them:
  start-up and evaluations) and in the background, and cumulative step time."""
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=100)
  names = list(runs)
  in_steps = np.asarray([sum(m["compile_s"] for m in runs[n]["metrics"]) for n in names])
  bills = [runs[n]["summary"].get("compile_bill", {}) for n in names]
  waited = np.asarray([sum(v["seconds"] for v in bill.values()) for bill in bills])
  ahead = np.asarray([sum(v.get("ahead_seconds", 0) for v in bill.values()) for bill in bills])
  x = np.arange(len(names))
  a.bar(x, in_steps, color="#c0392b", label="host waited, inside the steps")
  a.bar(x, np.maximum(waited - in_steps, 0), bottom=in_steps, color="#e6a09a",
        label="host waited, outside the steps")
  a.bar(x, ahead, bottom=np.maximum(waited, in_steps), color="#3b6ea5",
        label="in the background")
  a.set_xticks(x, names, fontsize=8)
  a.set_ylabel("compile seconds")
  a.set_title("what each run compiled", fontsize=9)
  a.legend(fontsize=8, loc="upper left")
  plot_per_step(b, runs, {n: n for n in names}, cumulative_step_s,
                "cumulative step time (s), compiles included")
  save_figure(fig, path, step_axes=(b,))


def plot_end_to_end(runs: dict, path: pathlib.Path) -> None:
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=100)
  for ax, series, title in ((axes[0], lambda ms: [m["step_s"] for m in ms], "step time (s)"),
                            (axes[1], cumulative_step_s, "cumulative wall time (s)"),
                            (axes[2], lambda ms: [m["reward_mean"] for m in ms],
                             "reward (mean over responses)")):
    plot_per_step(ax, runs, {"baseline": "baseline", "tlt": "tlt"}, series, title)
  save_figure(fig, path, step_axes=axes)


def setting_run(base, overrides: list[str], seed: int, out: pathlib.Path, name: str) -> dict:
  """One run of the baseline variant from scratch in OUT/runs/<name>, with the setting's
  overrides; its held-out evaluations and reward per step."""
  settings = {**VARIANTS["baseline"], **dict(o.split("=", 1) for o in overrides), "seed": seed,
              "rl.export": False, "rl.paired_control": True}
  run = run_variants(base, {name: settings}, out)[name]
  first, last, metrics = run["eval"][0], run["eval"][-1], run["metrics"]
  return {"seed": seed, "wall_s": run["wall_s"],
          "greedy": [first["greedy_accuracy"], last["greedy_accuracy"]],
          "sampled": [first.get("sampled_accuracy"), last.get("sampled_accuracy")],
          "reward": [m["reward_mean"] for m in metrics],
          # The paired control: this run's reward minus the initial policy's on the same
          # prompts and sampling keys, per step (0 at step 1), and its mean over steps 2..N.
          "reward_vs_initial": [m["reward_vs_initial"] for m in metrics],
          "paired": float(np.mean([m["reward_vs_initial"] for m in metrics[1:]]))}


def changes(runs: list[dict], kind: str) -> list[float]:
  """Per run, the paired reward gain, or the change (last - first) of an accuracy."""
  if kind == "paired":
    return [r["paired"] for r in runs]
  return [r[kind][1] - r[kind][0] for r in runs if r[kind][0] is not None]


def summarize(runs: list[dict]) -> dict:
  """Mean and spread over seeds of the paired reward gain and of each accuracy's change."""
  out = {}
  for kind, prefix in (("paired", "paired"), ("greedy", "greedy_change"),
                       ("sampled", "sampled_change")):
    if values := changes(runs, kind):
      out.update({f"{prefix}_{stat}": float(fn(values))
                  for stat, fn in (("mean", np.mean), ("min", np.min), ("max", np.max))})
  return out


def plot_settings(result: dict, path: pathlib.Path) -> None:
  names = list(result["settings"])
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=110, sharey=True)
  labels = {"greedy": "held-out greedy accuracy: after - before",
            "sampled": "held-out sampled accuracy: after - before",
            "paired": "reward vs the initial policy (paired, steps 2-N)"}
  for ax, kind in zip(axes, ("paired", "greedy", "sampled")):
    for i, name in enumerate(names):
      deltas = changes(result["settings"][name]["runs"], kind)
      ax.plot(deltas, [i] * len(deltas), "o", color="#3b6ea5", alpha=0.8)
      if deltas:
        ax.plot([np.mean(deltas)], [i], "|", color="#c0392b", markersize=14)
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel(labels[kind], fontsize=8)
  axes[0].invert_yaxis()
  fig.suptitle(result["title"], fontsize=9)
  save_figure(fig, path)


def settings_sweep(config, settings: dict[str, list[str]], seeds, args) -> None:
  """--settings: each setting's runs per seed, summarised, into OUT/grpo_settings.{json,png}."""
  result = {"config": args.config, "seeds": seeds, **run_metadata(),
            "title": f"{args.config.split('/')[-1]}: {config.rl.steps} RL steps, held-out "
                     f"{config.rl.num_eval_examples} problems, seeds {seeds}", "settings": {}}
  for name, overrides in settings.items():
    runs = []
    for seed in seeds:
      print(f"=== {name} (seed {seed}): {' '.join(overrides) or 'no overrides'}", flush=True)
      runs.append(setting_run(config, overrides, seed, args.out, f"{name}-seed{seed}"))
    result["settings"][name] = {"overrides": overrides, "runs": runs, **summarize(runs)}
    write_json(args.out / "grpo_settings.json", result)  # a killed sweep keeps what ran
  plot_settings(result, args.out / "grpo_settings.png")
  for name, s in result["settings"].items():
    print(f"{name:>18}: paired reward {s['paired_mean']:+.3f}, greedy "
          + ", sampled ".join(f"{s.get(f'{k}_change_mean', float('nan')):+.3f}"
                              for k in ("greedy", "sampled")))
  print(f"wrote {args.out}/grpo_settings.json and grpo_settings.png")


def figures(config, args) -> None:
  """The variants' runs, their figures and OUT/rl_runs.json."""
  # The runs are compared with their compile times, so each starts from an empty compilation
  # cache of its own. A quick run is a smoke test of the pipeline, not a comparison: it takes
  # what the user's cache holds.
  runs = run_variants(config, args.variants, args.out, fresh_cache=not args.quick)
  base = runs["baseline"]
  lengths = length_percentiles(base["rollouts"])
  breakdown = time_breakdown(base["metrics"], base["slices"])
  result = {
      "config": args.config, "overrides": args.set, "variants": args.variants,
      "long_tail": {"lengths": lengths, "time_breakdown": breakdown,
                    "idle_share_mean": float(np.mean([r["idle_share"] for r in breakdown]))},
      "drafter_adaptation": {name: [m["sd_accept_len_mean"] for m in runs[name]["metrics"]]
                             for name in ("tlt", "frozen", "no_warmup") if name in runs},
      "end_to_end": end_to_end(runs["tlt"]["metrics"], base["metrics"]),
      **{f"end_to_end_{name}": end_to_end(runs[name]["metrics"], base["metrics"])
         for name in runs if name.startswith("tlt_")},
      # What each variant compiled, per program kind (programs and seconds), side by side.
      "compile_bill": {name: r["summary"].get("compile_bill", {}) for name, r in runs.items()},
      "runs": {name: {"wall_s": r["wall_s"],
                      "summary": {k: v for k, v in r["summary"].items() if k != "config"},
                      "metrics": r["metrics"]} for name, r in runs.items()},
  }
  write_json(args.out / "rl_runs.json", result)
  plot_long_tail(lengths, breakdown, args.out / "long_tail.png")
  plot_adaptation(runs, args.out / "drafter_adaptation.png")
  plot_end_to_end(runs, args.out / "end_to_end.png")
  plot_compiles(runs, args.out / "compiles.png")
  e2e = result["end_to_end"]
  print(f"TLT vs baseline over {e2e['steps']} steps: step-time speedup "
        f"{e2e['speedup_step_time']:.2f}x, rollout speedup {e2e['speedup_rollout']:.2f}x; "
        f"mean reward {e2e['reward_mean_tlt']:.3f} vs {e2e['reward_mean_baseline']:.3f}")
  print(f"wrote {args.out}/rl_runs.json, long_tail.png, drafter_adaptation.png, end_to_end.png, "
        f"compiles.png")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path, help="output folder")
  add_config_flags(parser)
  parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
  parser.add_argument("--settings", nargs="*", metavar="NAME=KEY=VALUE[,KEY=VALUE...]",
                      help="the baseline variant per setting and seed (none named: the "
                           "settings the README reports)")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="with --settings")
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: configs/default.py:runlocal, the persistent compilation "
                           "cache on; with --settings one setting and one seed")
  args = parser.parse_args()
  sweep = args.settings is not None
  try:
    settings = {"default": [], **dict(map(parse_setting, args.settings or [
        f"{name}={text}" for name, text in DEFAULT_SETTINGS.items()]))}
  except ValueError as e:
    sys.exit(f"error: {e}")
  if not {"baseline", "tlt"} <= set(args.variants):
    sys.exit("--variants must include 'baseline' and 'tlt' (the figures compare them)")
  seeds, sets = args.seeds, args.set
  if args.quick:
    # At most 16 drafter steps per idle slice per rollout, so that spot threads do not take a
    # smoke run's 2 CPU cores from the rollout for long; no held-out evaluation (the settings'
    # sweep measures it).
    args.config = str(REPO / "configs" / "default.py") + ":runlocal"
    seeds, settings = seeds[:1], dict(list(settings.items())[:2])
    sets = ["drafter.spot.max_steps=16", *([] if sweep else ["rl.num_eval_examples=0"]), *sets]
  config = config_or_exit(args.config, sets)
  setup_devices(config, compilation_cache=args.quick or sweep)
  args.out.mkdir(parents=True, exist_ok=True)
  try:
    settings_sweep(config, settings, seeds, args) if sweep else figures(config, args)
  except ConfigError as e:  # a run folder this script did not make, an unknown key
    sys.exit(f"rl_runs: {e}")


if __name__ == "__main__":
  main()
