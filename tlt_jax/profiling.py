"""Where a job's steps spend device time, read from a `jax.profiler` trace without TensorBoard.

`profile.first_step` and `profile.num_steps` make train and sft trace those steps of their loop
(`Job.traced`) into WORKDIR/profile; the job then writes what the trace says,
profile/summary.json (`op_times`: device seconds per program and per op) and
profile/top_ops.png. A GPU session is short: this is the profile it can read on the spot.

Ops are the trace's events that name an XLA op (the `hlo_op` stat). Device planes
('/device:GPU:0', ...) hold the kernels; on CPU, where XLA runs ops on host threads, the host
plane does. Ops on several streams or threads can overlap, so shares are of summed op time.
"""

from __future__ import annotations

import collections
import glob
import os
import re

from jax.profiler import ProfileData

from tlt_jax.run_log import write_json


def latest_trace(folder: str) -> str:
  """The newest .xplane.pb under `folder` (jax.profiler writes one per trace and host)."""
  found = sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True),
                 key=os.path.getmtime)
  if not found:
    raise FileNotFoundError(f"no jax.profiler trace (*.xplane.pb) under {folder}")
  return found[-1]


def op_times(trace: str, top: int = 30) -> dict:
  """Device time per XLA program and op in one trace file (.xplane.pb):
  {'source': 'device' or 'host' (the planes the ops came from), 'planes', 'op_s' (summed op
  seconds), 'programs': [{'program', 'seconds', 'share'}], 'kinds' (ops by name less their
  number, e.g. 'all-gather': [{'kind', 'seconds', 'share'}]), 'ops': [{'program', 'op',
  'seconds', 'calls', 'share'}]}, each list longest first, ops cut at `top`."""
  data = ProfileData.from_file(trace)
  found = {"device": {}, "host": {}}  # {(program, op): [seconds, calls]} per kind of plane
  planes = {"device": set(), "host": set()}
  for plane in data.planes:
    kind = "device" if plane.name.startswith("/device:") else "host"
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if "hlo_op" not in stats:
          continue
        entry = found[kind].setdefault(
            (str(stats.get("hlo_module", "?")), str(stats["hlo_op"])), [0.0, 0])
        entry[0] += event.duration_ns * 1e-9
        entry[1] += 1
        planes[kind].add(plane.name)
  source = "device" if found["device"] else "host"
  ops = found[source]
  total = sum(seconds for seconds, _ in ops.values())
  programs, kinds = collections.Counter(), collections.Counter()
  for (program, op), (seconds, _) in ops.items():
    programs[program] += seconds
    kinds[re.sub(r"\.\d+$", "", op)] += seconds  # 'all-gather.18' -> 'all-gather'
  share = (lambda s: s / total) if total else (lambda s: 0.0)
  return {"source": source, "planes": sorted(planes[source]), "op_s": total,
          "programs": [{"program": p, "seconds": s, "share": share(s)}
                       for p, s in programs.most_common()],
          "kinds": [{"kind": k, "seconds": s, "share": share(s)} for k, s in kinds.most_common()],
          "ops": [{"program": p, "op": o, "seconds": s, "calls": n, "share": share(s)}
                  for (p, o), (s, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]]}


def write_profile_summary(folder: str, steps: list[int]) -> dict:
  """`op_times` of the newest trace under `folder`, with the traced `steps`, as
  folder/summary.json, and its longest ops as folder/top_ops.png. Returns the summary."""
  trace = latest_trace(folder)
  summary = {"steps": steps, "trace": os.path.relpath(trace, folder), **op_times(trace)}
  write_json(os.path.join(folder, "summary.json"), summary)
  _plot(summary, os.path.join(folder, "top_ops.png"))
  return summary


def _plot(summary: dict, path: str, top: int = 15) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ops = summary["ops"][:top][::-1]  # longest on top
  fig, ax = plt.subplots(figsize=(8, 0.35 * len(ops) + 1.2))
  ax.barh([f"{o['program'][:28]}: {o['op'][:36]}" for o in ops],
          [1e3 * o["seconds"] for o in ops])
  ax.set_xlabel(f"{summary['source']} ms over steps {summary['steps']} "
                f"(summed op time {summary['op_s']:.3f} s)")
  ax.tick_params(axis="y", labelsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
