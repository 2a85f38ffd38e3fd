"""Every GPU figure the project owes, in commands that fit one GPU lease each.

  python -m experiments.gpu_campaign 1 --out runs/campaign   # kernel grid, 7B decode and SD
  python -m experiments.gpu_campaign 2 --out runs/campaign   # gpu_e2e: sft, warmup
  python -m experiments.gpu_campaign 3 --out runs/campaign   # gpu_e2e: rl (TLT vs baseline)
  python -m experiments.gpu_campaign 4 --out runs/campaign   # gpu_e2e: rollout cost table
  python -m experiments.gpu_campaign all --quick --out /tmp/campaign   # toy shapes, any device

Command 1 (at most 9 minutes; 494 s on an H100 on 2026-11-26, before its first step and this
grid): tools/check_gpu_numerics.py (is the attention computed right on this device, with
and without the package's XLA flags; -> OUT/1/gpu_numerics.json), experiments/
bench_tree_attention.py on a 3 x 3 x 3 grid that holds every target's points (the kernel
against the reference and the device's copy bandwidth; -> OUT/1/tree_attention.json, .png),
then experiments/bench_decode.py at the Qwen2.5-7B shape, batches 1 and 8 (the decode step
against the plain-JAX floor, SD iterations with the full and a 32k draft vocabulary;
-> OUT/1/decode_7b.json, .png).
Commands 2-4: experiments/gpu_e2e.py with configs/gpu_demo.py in parts (-> OUT/e2e/...).
Command 3 needs the files command 2 left in OUT, and 4 those of both, so they run on one
machine, back to back, with the same OUT (a folder that outlives each command). 2 (at most
6.7 minutes) and 3 (at most 6.7) fit a 15-minute lease with the machine's start: each job's
time limit (E2E_PLAN: sft.max_minutes, drafter.warmup.max_minutes, rl.max_minutes per
variant) ends its training early, then it evaluates and exports as at its last step, and the
summaries say how many steps ran. The limits follow what each stage cost beyond its limit on
one H100 (H100_OVERHEAD_S, measured 2026-11-27). After 3, gpu_e2e.json holds the end-to-end
figures, with the cluster projection on illustrative costs; 4 (at most 5 minutes) measures
the cost table and makes the projection again on it. The RL runs of command 3 skip the
held-out evaluation: on the first H100 run it compiled a second (greedy) ladder of decode
programs, about 50 s per run (greedy decoding now runs the sampled programs, but its decoding
still takes time), and at the few steps a lease allows the accuracy does not move; the step
time is what command 3 measures.

Each step runs under its own deadline (SIGTERM, then SIGKILL 30 s later), inside its
command's; every step writes its JSON as it goes and is safe to rerun (gpu_e2e skips finished
stages and resumes cut-off ones). OUT/campaign.json records every step's command, exit
status, seconds and files. The imports are checked first: a missing package is named in one
line, before anything compiles.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from .common import REPO, module_command
# Each command's deadline. 2 and 3 run on one machine, back to back, within one lease: about
# 14 minutes with command 2's start; 4 only where device time is left after them.
COMMAND_SECONDS = {"1": 540, "2": 400, "3": 400, "4": 300}
# gpu_e2e's stages per command, and the settings that bound their time. A job's limit counts
# from its start (loading, compiles, the warm-up's generation, the first evaluation); it then
# finishes the step in flight, evaluates and exports. rl.max_minutes holds for each variant.
E2E_PLAN = {
    # SFT's steps 3 and 4 traced (the last H100 run put its step at 2-3% of peak; the trace
    # and its summary come inside sft.max_minutes): OUT/e2e/sft/profile/summary.json, .png.
    "2": (["sft", "warmup"], ["sft:sft.max_minutes=1", "sft:profile.first_step=3",
                              "sft:profile.num_steps=2",
                              "warmup:drafter.warmup.max_minutes=2",
                              "warmup:drafter.warmup.num_prompts=128"]),
    "3": (["rl"], ["rl:rl.max_minutes=1.75", "rl:rl.eval_samples=0",
                   "rl:rl.num_eval_examples=0"]),
    "4": (["rollout"], []),
}
# Seconds a stage took on one H100 beyond its job's time limit (2026-11-27, configs/gpu_demo.py,
# docs/results/gpu_h100_2026-11-27): SFT 218 s at a 90 s limit (loading, the tokenizer, the
# held-out evaluation of 128 problems, the export); the warm-up ~170 s whatever its limit
# above 2 minutes (generating 128 responses 59 s, 600 steps 19 s, the accept-length check, the
# export); an RL run 56 s (baseline) and 80 s (TLT) beyond its 75 s limit, with two held-out
# evaluations that command 3 no longer runs. The warm-up's limit is a cap it does not reach.
H100_OVERHEAD_S = {"sft": 128, "warmup": 170, "rl": 80}


def estimated_seconds(command: str) -> float:
  """What command 2 or 3 should take on one H100: each stage's limit plus its measured
  overhead (the RL stage runs two variants)."""
  limit = {kv.split(":", 1)[1].split("=")[0]: float(kv.split("=")[1]) * 60
           for kv in E2E_PLAN[command][1] if "max_minutes" in kv}
  if command == "2":
    return limit["sft.max_minutes"] + H100_OVERHEAD_S["sft"] + H100_OVERHEAD_S["warmup"]
  return 2 * (limit["rl.max_minutes"] + H100_OVERHEAD_S["rl"])


# import name -> how to get it (the GPU machine lacks ml_collections: carry its wheel)
REQUIRED = {"jax": "jax[cuda12]", "flax": "flax", "optax": "optax",
            "orbax.checkpoint": "orbax-checkpoint", "transformers": "transformers",
            "tokenizers": "tokenizers", "safetensors": "safetensors",
            "ml_collections": "ml-collections", "absl": "absl-py", "tqdm": "tqdm",
            "matplotlib": "matplotlib", "jinja2": "jinja2"}


def missing_packages() -> list[str]:
  """The pip names of REQUIRED packages that do not import here."""
  return [pip for name, pip in REQUIRED.items() if importlib.util.find_spec(name) is None]


def steps(command: str, out: pathlib.Path, quick: bool) -> list[tuple[str, list[str], int]]:
  """(name, argv, seconds allowed) of each step of one command."""
  py = sys.executable
  one, e2e = out / "1", out / "e2e"
  q = ["--quick"] if quick else []
  if command == "1":
    return [
        ("gpu_numerics", [*module_command("tools.check_gpu_numerics"), *q,
                          "--out", str(one / "gpu_numerics.json")], 90),
        # A grid that reaches every target's points within the budget (the default one,
        # batch by batch, had not reached batch 16 at 16k after 200 s on an H100).
        ("tree_attention", [*module_command("bench_tree_attention"),
                            *(q or ["--batches", "1", "16", "32", "--prefix-lens", "2048",
                                    "16384", "32768", "--tree-sizes", "1", "16", "48"]),
                            "--out", str(one / "tree_attention.json"),
                            "--time-budget", "160"], 190),
        ("decode_7b", [*module_command("bench_decode"),
                       *(q or ["--shape", "qwen2.5-7b", "--batches", "1", "8",
                               "--strategies", "8,4,48", "--draft-vocab-sizes", "32768"]),
                       "--out", str(one / "decode_7b.json"), "--time-budget", "180"], 310)]
  stages, sets = E2E_PLAN[command]
  if quick:  # the toy run keeps its sizes and the profile; its warm-up checks that a time
    # limit ends a job
    sets = [kv for kv in sets if "profile." in kv] + (
        ["warmup:drafter.warmup.max_minutes=0.001"] if command == "2" else [])
  return [(f"gpu_e2e_{'_'.join(stages)}", [*module_command("gpu_e2e"), *q,
                                             "--out", str(e2e), "--stages", *stages,
                                             *[a for kv in sets for a in ("--set", kv)]],
           COMMAND_SECONDS[command] - 20)]


def run_step(name: str, argv: list[str], seconds: int, log: pathlib.Path) -> dict:
  """Runs one step under its deadline, its output to the console and to `log`."""
  log.parent.mkdir(parents=True, exist_ok=True)
  print(f"=== {name} (at most {seconds} s): {' '.join(argv)}", flush=True)
  t0 = time.monotonic()
  with open(log, "w") as f:
    proc = subprocess.Popen(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
      rc = proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGTERM)  # the jobs checkpoint and stop on SIGTERM
      try:
        rc = proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
      print(f"    {name}: deadline reached, stopped (rerun to resume)", flush=True)
  tail = log.read_text(errors="replace").splitlines()[-6:]
  print("\n".join(f"    | {line}" for line in tail), flush=True)
  return {"command": argv, "returncode": rc, "seconds": round(time.monotonic() - t0, 1),
          "log": str(log)}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("command", choices=(*COMMAND_SECONDS, "all"),
                 help="which command (all: every one in a row, for --quick)")
  p.add_argument("--out", required=True, type=pathlib.Path, help="output folder (kept)")
  p.add_argument("--quick", action="store_true", help="toy shapes on any device (CI)")
  args = p.parse_args(argv)
  missing = missing_packages()
  if missing:
    sys.exit(f"missing packages: {', '.join(missing)} (pip install {' '.join(missing)}; "
             f"without a network, carry their wheels)")
  import jax
  device = jax.devices()[0]
  if not args.quick and device.platform != "gpu":
    sys.exit(f"no GPU here (jax sees {device.platform}: {device.device_kind}); the campaign "
             f"measures GPUs: run it with --quick to check it on this machine")
  out = args.out.resolve()
  record_path = out / "campaign.json"
  record = json.loads(record_path.read_text()) if record_path.is_file() else {}
  record.update(device=f"{device.platform}: {device.device_kind}", jax=jax.__version__,
                quick=args.quick)
  commands = tuple(COMMAND_SECONDS) if args.command == "all" else (args.command,)
  # The deadlines are the GPU's; a CPU smoke run (CI, beside other work) gets three times.
  stretch = 3 if args.quick else 1
  failed = []
  for command in commands:
    t0 = time.monotonic()
    for name, step_argv, seconds in steps(command, out, args.quick):
      seconds *= stretch
      left = COMMAND_SECONDS[command] * stretch - (time.monotonic() - t0)
      result = run_step(name, step_argv, int(min(seconds, max(left, 1))),
                        out / "logs" / f"{name}.log")
      result["date"] = time.strftime("%Y-%m-%d %H:%M")
      record.setdefault("steps", {})[name] = result
      out.mkdir(parents=True, exist_ok=True)
      record_path.write_text(json.dumps(record, indent=2))
      if result["returncode"] != 0:
        failed.append(f"{name} (exit {result['returncode']}, log {result['log']})")
  print(f"{'step':<32}{'exit':>6}{'seconds':>10}")
  for name, r in record.get("steps", {}).items():
    print(f"{name:<32}{r['returncode']:>6}{r['seconds']:>10.1f}")
  print(f"wrote {record_path}")
  if failed:
    sys.exit(f"failed: {'; '.join(failed)}")


if __name__ == "__main__":
  main()
