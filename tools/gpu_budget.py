"""Memory and compile budget of a config's GPU programs, checked on any machine.

  python -m tools.gpu_budget --out docs/results/gpu_budget.json   # configs/gpu_demo.py
  python -m tools.gpu_budget --config configs/gpu_demo.py --set model.remat=none \\
      --jobs sft --out /tmp/no_remat.json
  python -m tools.gpu_budget --quick --out /tmp/budget.json        # toy shapes, seconds
  python -m tools.gpu_budget --config configs/qwen2_5_gpu.py:8gpu --devices 8 \
      --model-shape qwen2.5-7b --jobs train --out docs/results/gpu_budget_8gpu.json
  python -m tools.gpu_budget --config configs/qwen3_gpu.py:1gpu --model-shape qwen3-1.7b \
      --jobs train warmup --out docs/results/gpu_budget_qwen3_1.7b_1gpu.json

With --devices N the config's mesh spans N devices (emulated on CPU): training programs run
over all of them in the training layout, rollout programs on the first replica slice in the
rollout layout, and every figure is one device's share (`tlt_jax.budget`).

Every program of each job (`tlt_jax.budget.job_programs`: the SFT step; the RL job's rollout
prefill, plain and SD decode calls, log-probs, policy update and drafter update; the warm-up's
rollout and drafter update) is built at the config's shapes with abstract weights, compiled for
this machine's backend to read XLA's memory analysis, and (with --cuda, the default) lowered
for CUDA under an abstract H100 with the attention kernel forced, counting its Triton calls.

Writes OUT (JSON: per job the resident bytes, every program's argument / output / alias /
temporary bytes, its peak and the host's compile seconds; the device that compiled them) and
OUT with .png (each program's peak as stacked bars against the limit). Exits 1 when a job's
peak passes --limit-gib, naming the program.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

import matplotlib

matplotlib.use("Agg")
import jax
import matplotlib.pyplot as plt

from tlt_jax.budget import (GiB, H100, JOBS, job_budget, job_programs,
                            lower_for_cuda, triton_calls)
from tlt_jax.cli import config_from_file
from tlt_jax.config import ConfigError
from tlt_jax.models.shapes import MODEL_SHAPES, with_model_shape
from tlt_jax.run_log import write_json


def cuda_lowering(config, job: str, num_devices: int) -> dict:
  """{program: {triton_calls, lower_s}} of `job`, lowered for CUDA with the kernel forced."""
  forced = config.copy_and_resolve_references()
  forced.model.attention_impl = "pallas"  # "auto" lowers the reference off GPU
  out = {}
  for p in job_programs(forced, job, num_devices)[1]:
    t0 = time.perf_counter()
    calls = triton_calls(lower_for_cuda(p))
    out[p.name] = {"triton_calls": calls, "lower_s": time.perf_counter() - t0}
  return out


def plot(result: dict, path: pathlib.Path) -> None:
  rows = [(job, name, m) for job, b in result["jobs"].items()
          for name, m in b["programs"].items()]
  fig, ax = plt.subplots(figsize=(9, 0.4 * len(rows) + 1.5))
  labels = [f"{job}: {name}" for job, name, _ in rows]
  parts = (("resident", "#34495e",
            lambda job, m: sum(result["jobs"][job]["resident_bytes"].values())),
           ("other arguments", "#7f8c8d", lambda job, m: m["nonresident_argument_bytes"]),
           ("temporaries", "#c0392b", lambda job, m: m["temp_bytes"]),
           ("new outputs", "#e67e22", lambda job, m: m["output_bytes"] - m["alias_bytes"]))
  left = [0.0] * len(rows)
  for label, color, size in parts:
    widths = [size(job, m) / GiB for job, _, m in rows]
    ax.barh(labels, widths, left=left, color=color, label=label)
    left = [a + b for a, b in zip(left, widths)]
  ax.axvline(result["limit_gib"], color="k", ls="--", lw=1, label=f"{result['limit_gib']} GiB")
  ax.invert_yaxis()
  ax.set_xlabel("GiB on one device (XLA memory analysis)")
  ax.set_title(f"{result['config']} on {result.get('devices', 1)} device(s) "
               f"({result['compiled_on']})", fontsize=9)
  ax.legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, type=pathlib.Path, help="JSON path (PNG beside it)")
  p.add_argument("--config", default=str(REPO / "configs" / "gpu_demo.py"),
                 help="config file[:variant] (default: the one-GPU demo)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="config override, e.g. --set model.remat=none (repeatable)")
  p.add_argument("--jobs", nargs="+", default=list(JOBS), choices=JOBS)
  p.add_argument("--limit-gib", type=float, default=70.0,
                 help="a job whose peak passes this fails the run (default 70 of 80 GB)")
  p.add_argument("--no-cuda", dest="cuda", action="store_false",
                 help="skip the CUDA lowering of every program")
  p.add_argument("--quick", action="store_true", help="configs/gpu_demo.py:quick (toy shapes)")
  p.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default=None,
                 help="a named model shape with random weights instead of model.path's")
  p.add_argument("--devices", type=int, default=1,
                 help="devices the config's mesh spans (emulated on CPU; default 1)")
  args = p.parse_args(argv)
  if args.devices > 1 and jax.config.jax_platforms in (None, "", "cpu"):
    jax.config.update("jax_num_cpu_devices", args.devices)
  spec = str(REPO / "configs" / "gpu_demo.py") + ":quick" if args.quick else args.config
  try:
    config = config_from_file(spec, args.set)
  except ConfigError as e:
    sys.exit(f"config error: {e}")
  if args.model_shape:
    config = with_model_shape(config, args.model_shape)
  device = jax.devices()[0]
  path, colon, variant = spec.partition(":")
  shown = os.path.relpath(path, REPO) + colon + variant
  result = {"config": shown, "overrides": args.set, "limit_gib": args.limit_gib,
            "devices": args.devices, "model_shape": args.model_shape,
            "compiled_on": f"{device.platform}: {device.device_kind}",
            "cuda_lowering_device": H100 if args.cuda else None,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "jobs": {}}
  args.out.parent.mkdir(parents=True, exist_ok=True)
  over = []
  for job in args.jobs:
    print(f"{job}:", flush=True)
    budget = job_budget(config, job, progress=lambda line: print(line, flush=True),
                        num_devices=args.devices)
    if args.cuda:
      for name, low in cuda_lowering(config, job, args.devices).items():
        budget["programs"][name].update(low)
    result["jobs"][job] = budget
    write_json(str(args.out), result)  # after every job
    for name, m in budget["programs"].items():
      print(f"  {name:<34} peak {m['peak_bytes'] / GiB:7.2f} GiB  temporaries "
            f"{m['temp_bytes'] / GiB:7.2f} GiB  compile {m['compile_s']:5.1f} s"
            + (f"  triton calls {m['triton_calls']}" if "triton_calls" in m else ""))
      if m["peak_bytes"] > args.limit_gib * GiB:
        over.append(f"{job}/{name} ({m['peak_bytes'] / GiB:.1f} GiB)")
  plot(result, args.out.with_suffix(".png"))
  print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
  if over:
    sys.exit(f"over the {args.limit_gib:g} GiB limit: {', '.join(over)}")


if __name__ == "__main__":
  main()
