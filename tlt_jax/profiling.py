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


# ---------------------------------------------------------------- one call, kernel by kernel

# Ops that only contain others on XLA:CPU's thunk timeline (their events span their bodies'):
# not launches, and their time is their children's.
CONTAINERS = ("while", "conditional", "call")


def _kind(op: str) -> str:
  """'fusion.12' -> 'fusion', 'loop_add_fusion.3' -> 'loop_add_fusion'."""
  return re.sub(r"(\.\d+)+$", "", op)


def call_events(trace: str) -> dict:
  """The ops one traced call ran, from its trace file (.xplane.pb): {'source': 'device' (GPU
  kernels on the device planes' streams) or 'host' (XLA:CPU ops on the host threads),
  'events': [(line id, start ns, duration ns, op name)] sorted by start, containers left out,
  'containers': how many container events (while/conditional/call) there were}. On a device
  plane every event of a stream is a kernel or a copy, named by its `hlo_op` where the trace
  has one and by itself otherwise; on the host only events with an `hlo_op` are XLA's."""
  data = ProfileData.from_file(trace)
  found = {"device": [], "host": []}
  containers = {"device": 0, "host": 0}
  for p, plane in enumerate(data.planes):
    kind = "device" if plane.name.startswith("/device:") else "host"
    for line in plane.lines:
      if kind == "device" and not re.search(r"stream", line.name, re.I):
        continue  # derived lines (XLA Modules, XLA Ops, Steps) repeat the streams' events
      for event in line.events:
        stats = dict(event.stats)
        op = str(stats.get("hlo_op", "")) or (event.name if kind == "device" else "")
        if not op:
          continue
        if _kind(op) in CONTAINERS:
          containers[kind] += 1
          continue
        found[kind].append(((p, line.name), int(event.start_ns), int(event.duration_ns), op))
  source = "device" if found["device"] else "host"
  return {"source": source, "events": sorted(found[source], key=lambda e: e[1]),
          "containers": containers[source]}


def call_table(events: dict, iterations: int, top: int = 12, gap_ns: int = 5_000) -> dict:
  """What one call of `iterations` loop iterations spent its time on, from `call_events`:
  span_ms (first op start to last op end), busy_ms (the union of op intervals), idle_ms (the
  rest: nothing ran: launch latency, host syncs, the loop's condition round trip), op_ms
  (summed op time; above busy_ms where ops overlap), launches (op events) and launches,
  idle_ms and op_ms per iteration, gaps longer than `gap_ns` (count, per iteration, the five
  longest in µs), and the `top` op kinds by time: [{'op', 'ms', 'calls', 'per_iteration',
  'share'}]."""
  evs = events["events"]
  n = max(int(iterations), 1)
  if not evs:
    return {"source": events["source"], "launches": 0, "iterations": iterations,
            "span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "op_ms": 0.0, "top": []}
  busy, gaps = 0, []
  cur_start, cur_end = evs[0][1], evs[0][1] + evs[0][2]
  for _, start, dur, _ in evs[1:]:
    if start > cur_end:
      busy += cur_end - cur_start
      gaps.append(start - cur_end)
      cur_start = start
    cur_end = max(cur_end, start + dur)
  busy += cur_end - cur_start
  span = cur_end - evs[0][1]
  op_ns = sum(e[2] for e in evs)
  kinds = collections.defaultdict(lambda: [0, 0])
  for _, _, dur, op in evs:
    kinds[_kind(op)][0] += dur
    kinds[_kind(op)][1] += 1
  long_gaps = sorted((g for g in gaps if g > gap_ns), reverse=True)
  return {"source": events["source"], "iterations": iterations, "launches": len(evs),
          "launches_per_iteration": len(evs) / n, "span_ms": span * 1e-6,
          "busy_ms": busy * 1e-6, "idle_ms": (span - busy) * 1e-6,
          "idle_share": (span - busy) / span if span else 0.0,
          "idle_ms_per_iteration": (span - busy) * 1e-6 / n, "op_ms": op_ns * 1e-6,
          "op_ms_per_iteration": op_ns * 1e-6 / n, "containers": events["containers"],
          "gaps_over_us": gap_ns / 1e3, "long_gaps": len(long_gaps),
          "long_gaps_per_iteration": len(long_gaps) / n,
          "longest_gaps_us": [g / 1e3 for g in long_gaps[:5]],
          "top": [{"op": k, "ms": ns * 1e-6, "calls": c, "per_iteration": c / n,
                   "share": ns / op_ns if op_ns else 0.0}
                  for k, (ns, c) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:top]]}
