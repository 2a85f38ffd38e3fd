"""Held-out accuracy before and after GRPO, per setting and seed: what the RL update does to a
policy, measured.

Runs the main job (experiments.rl_runs's run_variants) on the baseline variant of a config (no
SD, no spot training: the update is the same with TLT, whose outputs are identical) once per
setting and seed, each from the same policy, with the paired control on (rl.paired_control),
and records the reward gained over the initial policy on each step's own prompts and sampling
keys (`paired`: the mean over steps 2..N), held-out greedy and sampled accuracy at the first and
the last step, the reward per step, and the run-to-run spread over seeds.

  python -m experiments.grpo_settings --out results/grpo_settings
  python -m experiments.grpo_settings --out /tmp/gs --quick    # configs/default.py:runlocal
  python -m experiments.grpo_settings --out results/gs --seeds 0 1 2 \
      --setting "kl=rl.kl_coef=0.1,rl.lr_warmup_steps=4" --setting "lr3e-5=rl.learning_rate=3e-5"

A setting is NAME=KEY=VALUE[,KEY=VALUE...] (config overrides); `default` (no overrides) is
always run first. Writes OUT/runs/<setting>-seed<k>/ (each run's workdir),
OUT/grpo_settings.json and OUT/grpo_settings.png (the paired reward gain and the change of
held-out greedy and sampled accuracy per setting, one point per seed).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

from .common import REPO, config_or_exit, pyplot, run_metadata, save_figure, write_json
from .rl_runs import run_variants
from tlt_jax.cli import setup_devices
from tlt_jax.config import ConfigError

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
    raise ValueError(f"--setting {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE...], e.g. "
                     f"kl=rl.kl_coef=0.1,rl.lr_warmup_steps=4")
  return name.strip(), overrides


def run_one(base, overrides: list[str], seed: int, out: pathlib.Path, name: str) -> dict:
  """One run of the job from scratch in OUT/runs/<name>; its held-out evaluations and reward
  per step."""
  settings = {**dict(o.split("=", 1) for o in overrides), "seed": seed, "rl.export": False,
              "rl.paired_control": True}
  run = run_variants(base, {name: settings}, out, script="grpo_settings")[name]
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


def plot(result: dict, path: pathlib.Path) -> None:
  plt = pyplot()
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
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.set_xlabel(labels[kind], fontsize=8)
  axes[0].invert_yaxis()
  fig.suptitle(result["title"], fontsize=9)
  save_figure(fig, path)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, type=pathlib.Path, help="output folder")
  parser.add_argument("--config", default=str(REPO / "configs" / "default.py") + ":baseline",
                      help="config file[:variant] (default: the tiny default's baseline)")
  parser.add_argument("--setting", action="append", default=None,
                      help="NAME=KEY=VALUE[,KEY=VALUE...] (repeatable; default: the settings "
                           "the README reports)")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  parser.add_argument("--quick", action="store_true",
                      help="configs/default.py:runlocal, one setting, one seed (smoke test)")
  args = parser.parse_args()
  spec = str(REPO / "configs" / "default.py") + ":runlocal" if args.quick else args.config
  try:
    settings = dict(parse_setting(s) for s in args.setting) if args.setting else {
        name: parse_setting(f"{name}={text}")[1] for name, text in DEFAULT_SETTINGS.items()}
  except ValueError as e:
    sys.exit(f"error: {e}")
  # Quick: the runlocal settings without SD and spot training, as the baseline variant.
  config = config_or_exit(spec, ["rollout.speculative.enable=False",
                                 "drafter.spot_training=False"] if args.quick else [])
  settings, seeds = {"default": [], **settings}, args.seeds
  if args.quick:
    settings, seeds = dict(list(settings.items())[:2]), seeds[:1]
  setup_devices(config)
  args.out.mkdir(parents=True, exist_ok=True)
  result = {"config": spec, "seeds": seeds, **run_metadata(),
            "title": f"{spec.split('/')[-1]}: {config.rl.steps} RL steps, held-out "
                     f"{config.rl.num_eval_examples} problems, seeds {seeds}",
            "settings": {}}
  for name, overrides in settings.items():
    runs = []
    for seed in seeds:
      print(f"=== {name} (seed {seed}): {' '.join(overrides) or 'no overrides'}", flush=True)
      try:
        runs.append(run_one(config, overrides, seed, args.out, f"{name}-seed{seed}"))
      except ConfigError as e:  # a run folder this script did not make, an unknown key
        sys.exit(f"error: {e}")
    result["settings"][name] = {"overrides": overrides, "runs": runs, **summarize(runs)}
    write_json(args.out / "grpo_settings.json", result)  # a killed sweep keeps what ran
  plot(result, args.out / "grpo_settings.png")
  for name, s in result["settings"].items():
    print(f"{name:>18}: paired reward {s['paired_mean']:+.3f}, "
          f"greedy {s.get('greedy_change_mean', float('nan')):+.3f} "
          f"[{s.get('greedy_change_min', float('nan')):+.3f}, "
          f"{s.get('greedy_change_max', float('nan')):+.3f}], sampled "
          f"{s.get('sampled_change_mean', float('nan')):+.3f}")
  print(f"wrote {args.out}/grpo_settings.json and grpo_settings.png")


if __name__ == "__main__":
  main()
