"""TLT against the baseline end to end, from nothing: SFT makes a policy on the built-in task,
the offline warm-up trains its drafter, then GRPO runs with TLT and without, back to back.

  python -m experiments.gpu_e2e --out runs/gpu_e2e            # one GPU, configs/gpu_demo.py
  python -m experiments.gpu_e2e --out /tmp/e2e --quick        # toy size (CPU or one GPU)
  python -m experiments.gpu_e2e --out runs/gpu_e2e --stages sft warmup   # in parts
  python -m experiments.gpu_e2e --out runs/gpu_e2e --stages rl
  python -m experiments.gpu_e2e --out runs/gpu_e2e --set rl.steps=4 --set sft:sft.max_minutes=2

Stages, each the project's own command (its output streams to the console and to
OUT/logs/STAGE.log):
  sft       python -m tlt_jax.sft                  -> OUT/sft/export (policy + tokenizer)
  warmup    python -m tlt_jax.warmup_drafter       -> OUT/warmup/export/eagle (drafter)
  rl        experiments/rl_runs.py, baseline + tlt -> OUT/rl (rl_runs.json, figures)
  rollout   experiments/bench_rollout.py, one RL step's rollout with the warmed drafter
            -> OUT/rollout (plain vs SD cost table);
            optional: the summary does not wait for it
A stage that finished is recorded in OUT/stages.json and skipped when the command is run again,
so a killed run resumes at the stage it was in (which resumes from its own checkpoints; the RL
stage keeps the variant that finished and resumes the other). --stages runs a subset, in the
order above. Once sft, warmup and rl are done, every run also projects the step time to 8-1024
devices (experiments/simulate_cluster.py on the baseline's response lengths, with the rollout
stage's measured costs once it ran, else the simulator's illustrative ones; -> OUT/simulate)
and writes the summary. --set KEY=VALUE overrides the config of every config-driven stage
(sft, warmup, rl), --set STAGE:KEY=VALUE of one; sft.max_minutes, drafter.warmup.max_minutes
and rl.max_minutes (per variant) bound a stage's time (experiments/gpu_campaign.py sets them
to fit a GPU lease).

Measured on one H100 (2026-11-27, docs/results/gpu_h100_2026-11-27): SFT 1.07 s per step
(32 x 1536 tokens, 76M parameters, rematerialised), so the full 600 steps take ~11 minutes
and a lease allows about one; its loading, evaluation and export ~2 minutes more; warm-up
~3 minutes (128 responses generated in 59 s, 600 steps in 19 s); an RL run's first step
70-86 s, nearly all compiles. On one GPU there is one rollout slice and so no idle slice to
train the drafter on: the TLT run is SD with the warmed drafter and the adaptive tuner.

OUT/gpu_e2e.json: device, date, the commands and seconds per stage, the policy's held-out
accuracy after SFT, the warmed drafter's accept length, the RL runs' end-to-end ratios
(baseline / TLT step time over the steady-state steps and over all steps with compiles,
rollout-only), reward and held-out accuracy per run, the tail speedup, the projected cluster
speedups and where their costs came from. OUT/gpu_e2e.png: stage times, step time per RL step
of both runs split into rollout and update, and the projected speedup against device count.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from .common import REPO, module_command, read_json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


STAGES = ("sft", "warmup", "rl", "rollout")
REQUIRED = ("sft", "warmup", "rl")  # the summary needs these; the rollout stage is optional
CONFIG_STAGES = ("sft", "warmup", "rl")


def stage_overrides(sets: list[str]) -> dict[str, list[str]]:
  """--set values -> {stage: [KEY=VALUE, ...]}: plain ones go to every config-driven stage,
  STAGE:KEY=VALUE ones to that stage only."""
  out = {name: [] for name in CONFIG_STAGES}
  for item in sets:
    stage, colon, rest = item.partition(":")
    if colon and "=" not in stage:
      if stage not in CONFIG_STAGES:
        raise SystemExit(f"--set {item}: {stage!r} takes no config; config-driven stages: "
                         f"{', '.join(CONFIG_STAGES)}")
      out[stage].append(rest)
    else:
      for name in CONFIG_STAGES:
        out[name].append(item)
  for items in out.values():
    for item in items:
      if "=" not in item:
        raise SystemExit(f"--set {item}: expected KEY=VALUE or STAGE:KEY=VALUE")
  return out


def stage_commands(out: pathlib.Path, quick: bool, sets: dict[str, list[str]] | None = None
                   ) -> dict[str, list[str]]:
  """The command of every stage, in order; sets: `stage_overrides`."""
  sets = sets or {}
  py = sys.executable
  config = str(REPO / "configs" / "gpu_demo.py") + (":quick" if quick else "")
  policy, drafter = out / "sft" / "export", out / "warmup" / "export" / "eagle"
  spot = ["--set", "drafter.spot.max_steps=8"] if quick else []
  flags = {name: [f"--config.{kv}" for kv in sets.get(name, [])] for name in CONFIG_STAGES}
  return {
      "sft": [py, "-m", "tlt_jax.sft", f"--config={config}", f"--workdir={out / 'sft'}",
              *flags["sft"]],
      "warmup": [py, "-m", "tlt_jax.warmup_drafter", f"--config={config}",
                 f"--config.model.path={policy}", f"--workdir={out / 'warmup'}",
                 *flags["warmup"]],
      "rl": [*module_command("rl_runs"), "--out", str(out / "rl"),
             "--config", config, "--set", f"model.path={policy}", "--set",
             f"drafter.eagle.path={drafter}", "--variants", "baseline", "tlt", "--resume", *spot,
             *[a for kv in sets.get("rl", []) for a in ("--set", kv)]],
      # The cost table at the demo's shapes, in an RL step's rollout with the warmed drafter;
      # the toy policy's rows all end early, so in the quick run every call counts as the tail.
      "rollout": [*module_command("bench_rollout"), "--config", config, "--set",
                  f"model.path={policy}", "--set", f"drafter.eagle.path={drafter}",
                  "--tuners", "beg_mab", "--out", str(out / "rollout" / "rollout.json"),
                  *(["--quick", "--set", "rollout.sd_threshold=16"] if quick else [])],
  }


def simulate_command(out: pathlib.Path, quick: bool) -> list[str]:
  """simulate_cluster.py on the baseline's response lengths, with the rollout stage's
  measured costs once it ran (else the simulator's built-in, illustrative cost model)."""
  costs = out / "rollout" / "rollout.json"
  return [*module_command("simulate_cluster"),
          "--out", str(out / "simulate"),
          *(["--costs-from-bench", str(costs)] if costs.is_file() else []),
          "--lengths", str(out / "rl" / "runs" / "baseline" / "rollouts.jsonl"),
          *(["--quick"] if quick else [])]


# What a job prints when its time limit (sft.max_minutes, drafter.warmup.max_minutes) ended
# it, after its evaluation and export; it then exits 75, as a rerun would resume it. Here a
# stage's time limit bounds the stage: its results are the stage's (a signal's stop is not).
TIME_LIMITED = "ended the job after step"


def run_stage(name: str, cmd: list[str], log_path: pathlib.Path) -> float:
  """Runs one stage, echoing its output to the console and the log; seconds it took. A stage
  that its time limit ended counts as done."""
  log_path.parent.mkdir(parents=True, exist_ok=True)
  print(f"=== {name}: {' '.join(cmd)}", flush=True)
  t0 = time.perf_counter()
  time_limited = False
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    for line in proc.stdout:
      sys.stdout.write(line)
      log.write(line)
      time_limited = time_limited or TIME_LIMITED in line
    rc = proc.wait()
  if rc != 0 and not (rc == 75 and time_limited):
    sys.exit(f"stage {name!r} failed (exit {rc}); its output is in {log_path}. Run the same "
             f"command again to resume from this stage.")
  return time.perf_counter() - t0


def run_recorded_stages(out: pathlib.Path, quick: bool, commands: dict[str, list[str]],
                        selected) -> dict:
  """Runs the `selected` stages of `commands` ({name: command}, in order) that OUT/stages.json
  does not record as done, recording each as it finishes (a killed run resumes at the stage
  it was in); returns {name: {command, seconds}} of every stage done so far."""
  out.mkdir(parents=True, exist_ok=True)
  record_path = out / "stages.json"
  record = read_json(record_path)
  if record and record.get("quick") != quick:
    sys.exit(f"{out} holds a {'quick' if record.get('quick') else 'full'} run; give another "
             f"--out or delete it")
  record["quick"] = quick
  stages = record.setdefault("stages", {})
  for name, cmd in commands.items():
    if name not in selected:
      continue
    if name in stages:
      print(f"=== {name}: done in an earlier run ({stages[name]['seconds']:.0f} s), skipped")
      continue
    seconds = run_stage(name, cmd, out / "logs" / f"{name}.log")
    stages[name] = {"command": cmd, "seconds": seconds}
    record_path.write_text(json.dumps(record, indent=2))  # after every stage: resumable
  return stages


def collect(out: pathlib.Path, stages: dict) -> dict:
  """The headline numbers from every stage's own outputs."""
  sft, warm = read_json(out / "sft" / "summary.json"), read_json(out / "warmup" / "summary.json")
  rl, roll = read_json(out / "rl" / "rl_runs.json"), read_json(out / "rollout" / "rollout.json")
  sim = read_json(out / "simulate" / "simulation.json")
  profile = read_json(out / "sft" / "profile" / "summary.json")  # when the plan sets profile.*
  runs = rl.get("runs", {})
  per_run = {}
  for name, r in runs.items():
    s = r.get("summary", {})
    per_run[name] = {"wall_s": r.get("wall_s"),
                     "reward_by_step": [m["reward_mean"] for m in r.get("metrics", [])],
                     "heldout_accuracy": {k: v for k, v in s.items() if "accuracy" in k},
                     "steps_done": s.get("steps_done"), "time_limited": s.get("time_limited")}
  return {
      "device": _device(), "date": time.strftime("%Y-%m-%d"),
      "stages": stages,
      "policy": {"params": sft.get("num_params"), "sft_steps": sft.get("step"),
                 "sft_time_limited": sft.get("time_limited"),
                 "heldout_greedy_accuracy": sft.get("heldout_greedy_accuracy"),
                 "heldout_mean_completion_tokens": sft.get("heldout_mean_completion_tokens"),
                 "sft_profile": {k: profile[k] for k in ("steps", "source", "op_s", "programs",
                                                         "kinds") if k in profile}},
      "drafter": {"accept_len_untrained": warm.get("accept_len_untrained"),
                  "accept_len_warmed": warm.get("accept_len_warmed"),
                  "strategy": warm.get("strategy"), "steps": warm.get("steps"),
                  "time_limited": warm.get("time_limited")},
      "end_to_end": rl.get("end_to_end"), "runs": per_run,
      "rollout": {k: roll.get(k) for k in ("speedup_wall", "speedup_tail")},
      "projection_costs": ("measured by the rollout stage" if roll else
                           "illustrative: simulate_cluster.py's built-in cost model"),
      "projected": [{"devices": r.get("devices"), "speedup_step": r.get("speedup_step"),
                     "speedup_rollout": r.get("speedup_rollout")}
                    for r in sim.get("results", [])],
  }


def _device() -> str:
  import jax
  d = jax.devices()[0]
  return f"{d.platform}: {d.device_kind} x{jax.device_count()}"


def plot(out: pathlib.Path, summary: dict) -> None:
  rl = read_json(out / "rl" / "rl_runs.json")
  fig, (ax_stage, ax_step, ax_proj) = plt.subplots(1, 3, figsize=(14, 4))
  names = list(summary["stages"])
  ax_stage.barh(names, [summary["stages"][n]["seconds"] for n in names], color="#34495e")
  ax_stage.invert_yaxis()
  ax_stage.set_xlabel("seconds")
  ax_stage.set_title(f"stages ({summary['device']})", fontsize=9)
  for i, (name, color) in enumerate((("baseline", "#7f8c8d"), ("tlt", "#c0392b"))):
    metrics = rl.get("runs", {}).get(name, {}).get("metrics", [])
    steps = [m["step"] + (i - 0.5) * 0.4 for m in metrics]
    roll = [m["rollout_s"] for m in metrics]
    ax_step.bar(steps, roll, width=0.4, color=color, label=f"{name} rollout")
    ax_step.bar(steps, [m["update_s"] for m in metrics], width=0.4, bottom=roll, color=color,
                alpha=0.4, label=f"{name} update")
  e2e = summary.get("end_to_end") or {}
  ax_step.set_title("RL step time, baseline / TLT: "
                    f"{e2e.get('speedup_step_time', float('nan')):.2f}x", fontsize=9)
  ax_step.set_xlabel("RL step")
  ax_step.set_ylabel("seconds")
  ax_step.legend(fontsize=7)
  proj = summary["projected"]
  if proj:
    ax_proj.plot([p["devices"] for p in proj], [p["speedup_step"] for p in proj], "o-",
                 label="step")
    ax_proj.plot([p["devices"] for p in proj], [p["speedup_rollout"] for p in proj], "s--",
                 label="rollout")
    ax_proj.set_xscale("log", base=2)
    ax_proj.legend(fontsize=7)
  ax_proj.set_xlabel("devices")
  ax_proj.set_ylabel("projected TLT speedup (x)")
  ax_proj.set_title("cluster projection (measured costs and lengths)", fontsize=9)
  fig.tight_layout()
  fig.savefig(out / "gpu_e2e.png", dpi=120)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, type=pathlib.Path, help="output folder (resumes)")
  p.add_argument("--quick", action="store_true",
                 help="toy size (configs/gpu_demo.py:quick), on CPU or one GPU: smoke tests")
  p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES),
                 help="the stages to run (default: all; they run in the order above)")
  p.add_argument("--set", action="append", default=[], metavar="[STAGE:]KEY=VALUE",
                 help="config override for every config-driven stage, or for one (repeatable)")
  args = p.parse_args(argv)
  sets = stage_overrides(args.set)
  out = args.out.resolve()
  stages = run_recorded_stages(out, args.quick, stage_commands(out, args.quick, sets),
                               args.stages)
  missing = [name for name in REQUIRED if name not in stages]
  if missing:
    print(f"stages still to run: {' '.join(missing)} (the summary is written once "
          f"{', '.join(REQUIRED)} are done)")
    return
  # The projection is cheap: it is made again whenever the summary is, so it takes the
  # measured costs as soon as the rollout stage has run.
  simulate = simulate_command(out, args.quick)
  seconds = run_stage("simulate", simulate, out / "logs" / "simulate.log")
  summary = collect(out, {**stages, "simulate": {"command": simulate, "seconds": seconds}})
  summary["quick"] = args.quick
  (out / "gpu_e2e.json").write_text(json.dumps(summary, indent=2))
  plot(out, summary)
  e2e = summary.get("end_to_end") or {}
  print(f"baseline / TLT step time {e2e.get('speedup_step_time', float('nan')):.2f}x over "
        f"{e2e.get('steps')} steps; all stages {sum(s['seconds'] for s in stages.values()):.0f} s")
  print(f"wrote {out / 'gpu_e2e.json'} and {out / 'gpu_e2e.png'}")


if __name__ == "__main__":
  main()
