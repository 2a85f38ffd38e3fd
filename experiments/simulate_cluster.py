"""Cluster simulator: idle device-time in one synchronous RL step, and what TLT wins back.

One GRPO step on N devices split into N / devices_per_slice rollout replicas ("slices"), each
priced by the rollout cost model (`experiments.rollout_model`), for each N the baseline (plain
decode, no spot training) against TLT (SD in the tail + drafter training on idle slices):
OUT/simulation.json (inputs, cost table, per-N results with per-slice finish times),
OUT/simulation.csv (one row per N) and OUT/simulation.png. Commands: docs/reproducing.md.

A cost file (--costs) holds one slice's seconds per iteration at each batch size:
  {"batch": [1, 2, 4, ...], "plain_s": [...], "sd_s": [...], "accept_len": [...],
   "prefill_s": 0.0, "call_s": 0.0}
accept_len may be one number; prefill_s and call_s (per compiled decode call) are optional.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time

import numpy as np

from tlt_jax.rollout.scheduler import batch_ladder

from .common import pyplot, save_figure, write_json
from .rollout_model import (CostModel, length_summary, load_lengths, make_costs, read_json,
                            simulate_rollout)


def _ladder(max_batch: int) -> np.ndarray:
  return np.asarray(batch_ladder(int(max_batch)), np.float64)

# ---------------------------------------------------------------- where costs come from

def default_costs(max_batch: int = 1024) -> CostModel:
  """Illustrative (not measured) costs of a 7B policy on one H100-class device per slice: a
  plain step reads the weights (6 ms) and each row's cache (0.15 ms at a few thousand tokens);
  an SD iteration runs the drafter 8 steps and verifies v tokens per row (v = 48, 32, 16, 8 at
  batch 1, <= 4, <= 20, beyond): 11 ms + (0.15 + 0.04 v) ms per row, accepting 6.4, 5.5,
  4.5, 3.5 tokens."""
  b = _ladder(max_batch)
  verify = np.select([b <= 1, b <= 4, b <= 20], [48.0, 32.0, 16.0], 8.0)
  accept = np.interp(verify, [8, 16, 32, 48], [3.5, 4.5, 5.5, 6.4])
  return make_costs(b, 6e-3 + 1.5e-4 * b, 11e-3 + b * (1.5e-4 + 4e-5 * verify), accept,
                    source="built-in illustrative 7B/H100 model")


def load_costs(path: str) -> CostModel:
  """A measured cost table (the module docstring's format) from a JSON file."""
  data = read_json(path, "cost file")
  need = ("batch", "plain_s", "sd_s", "accept_len")
  missing = [k for k in need if not isinstance(data, dict) or k not in data]
  if missing:
    raise ValueError(f"cost file {path!r} lacks {missing}; it needs keys {list(need)} "
                     f"(seconds per iteration by batch size; see the module docstring)")
  return make_costs(*(data[k] for k in need), data.get("prefill_s", 0.0), source=path,
                    call_s=data.get("call_s", 0.0))


def costs_from_rollout_json(path: str, max_batch: int = 64) -> CostModel:
  """A cost table from experiments/bench_rollout.py's JSON (its `modes` summaries).

  max_batch: that run's --max-batch (not recorded; 64 its default). Plain: a line a + c * b
  through two points, the tail's seconds per call at its mean batch (tail_tokens /
  tail_calls) and the rest of the run taken as full batches (min(max_batch, requests); its
  prefills included, so c is an overestimate). SD: the best SD mode's tail seconds per call
  over that line at its tail batch, a ratio applied at every batch; its mean accept length.
  """
  data = read_json(path, "bench_rollout JSON")
  try:
    p, s = data["modes"]["plain"], data["modes"][data["best_sd_mode"]]
    full = float(min(max_batch, data["prompts"] * data["samples"]))
    tail, per_call = p["tail_tokens"] / p["tail_calls"], p["tail_s_per_call"]
    bulk_tokens, bulk_s = p["tokens"] - p["tail_tokens"], p["wall_s"] - p["tail_s"]
    b_sd = s["tail_tokens"] / (s["tail_calls"] * s["accept_len"])
  except (KeyError, TypeError, ZeroDivisionError) as e:
    raise ValueError(f"{path!r} is not a bench_rollout.py result with tail-phase calls "
                     f"({type(e).__name__}: {e}); make it with `python -m "
                     f"experiments.bench_rollout --out FILE.json`") from None
  slope = float(np.clip((bulk_s * full / bulk_tokens - per_call) / (full - tail), 0.0,
                        per_call / tail)) if bulk_tokens > 0 and full > tail else 0.0
  fixed = per_call - slope * tail
  b = _ladder(max_batch)
  return make_costs(b, fixed + slope * b,
                    s["tail_s_per_call"] / (fixed + slope * b_sd) * (fixed + slope * b),
                    s["accept_len"], source=f"{path} (fitted from bench_rollout modes)")


def costs_from_decode_json(path: str, max_batch: int = 64, sd_key: str | None = None,
                           accept_len: float = 6.4, kv_s_per_row: float = 1.5e-4
                           ) -> tuple[CostModel, int]:
  """A cost table from experiments/profile_decode.py's JSON (or bench_decode.py's, merged into
  it since d582ece), and the largest batch it measured SD at (SD beyond it is extrapolated:
  keep --sd-threshold at or below it).

  Plain step and SD iteration (sd_key: which strategy; default the fastest at the smallest
  batch) are each a least-squares line a + c * b (c >= 0) through the measured batches, plus
  kv_s_per_row * b: the benchmark's 1024-token prompts cannot show the cache read of long
  responses (the default is the built-in model's). accept_len is not measured there (random
  weights); 6.4 is the built-in model's for a 48-token tree.
  """
  data = read_json(path, "profile_decode JSON")

  def ms(entry):  # an iteration's ms: profile_decode.py's entry, or bench_decode.py's
    return entry.get("timing", entry).get("iteration_ms") if isinstance(entry, dict) else None
  rows = [{"batch": r["batch"], "tlt_plain_ms": ms(r.get("plain")) or r.get("tlt_plain_ms"),
           "sd": {k: {"iteration_ms": ms(v)} for k, v in r.get("sd", {}).items() if ms(v)}}
          for r in data.get("rows", []) if isinstance(r, dict) and r.get("complete", True)]
  rows = [r for r in rows if r["tlt_plain_ms"] and r["sd"]]  # the batches with SD
  if not rows:
    raise ValueError(f"{path!r} holds no rows with plain and SD timings; make it with "
                     f"`python -m experiments.profile_decode --out DIR` (DIR/profile_decode.json)")
  keys = sorted(rows[0]["sd"], key=lambda k: rows[0]["sd"][k]["iteration_ms"])
  key = sd_key or keys[0]
  if any(key not in r["sd"] for r in rows):
    raise ValueError(f"{path!r}: no SD strategy {key!r} at every batch; it has {keys}")
  batch, b = np.asarray([r["batch"] for r in rows], np.float64), _ladder(max_batch)

  def line(ms):  # read off at the ladder, plus the cache of long context
    y = np.asarray(ms, np.float64) * 1e-3
    slope = max(float(np.polyfit(batch, y, 1)[0]), 0.0) if len(set(batch)) > 1 else 0.0
    return float(np.mean(y - slope * batch)) + slope * b + kv_s_per_row * b

  device = data.get("device", "?")
  device = device.get("device_kind", "?") if isinstance(device, dict) else device
  source = (f"{path} ({device}, {data.get('shape') or data.get('model', '?')}, SD {key}, "
            f"measured at batch {sorted(set(batch.astype(int).tolist()))}; assumed: accept "
            f"length {accept_len}, {kv_s_per_row * 1e3:g} ms per row of long context)")
  return make_costs(b, line([r["tlt_plain_ms"] for r in rows]),
                    line([r["sd"][key]["iteration_ms"] for r in rows]), accept_len,
                    source=source), int(batch.max())


def sample_lengths(rng: np.random.Generator, n: int, dist: str, max_new_tokens: int,
                   median: float = 3000.0, sigma: float = 1.0,
                   pool: np.ndarray | None = None) -> np.ndarray:
  """n response lengths in tokens [n] int64, in [1, max_new_tokens]: "lognormal" (median,
  sigma of the log-length) or "measured" (drawn with replacement from `pool`)."""
  if dist == "lognormal":
    out = np.rint(median * np.exp(sigma * rng.standard_normal(n)))
  elif dist == "measured" and pool is not None and len(pool):
    out = rng.choice(np.asarray(pool, np.float64), n)
  else:
    raise ValueError(f"length distribution {dist!r} needs to be lognormal, or measured with a "
                     f"pool of lengths (--lengths FILE)")
  return np.clip(out, 1, max_new_tokens).astype(np.int64)


# ---------------------------------------------------------------- one RL step

@dataclasses.dataclass(frozen=True)
class StepConfig:
  """What one simulated step needs besides lengths and costs; each field is a flag."""
  devices_per_slice: int = 1  # devices of one rollout replica
  max_batch: int = 64  # rows per slice
  sd_threshold: int = 32  # TLT's SD switch: running rows per slice
  drafter_steps_per_s: float = 4.0  # drafter updates per second on one idle slice
  spot_startup_s: float = 5.0  # an idle slice's seconds before its first drafter step
  update_s: float = 0.0  # the policy update: update_s + update_s_per_token * tokens / devices
  update_s_per_token: float = 2e-4
  schedule: str = "parallel"  # or "interleaved": see simulate_rollout
  iterations_per_call: int = 1  # decode iterations per compiled call

  def check(self, costs: CostModel) -> None:
    if self.devices_per_slice < 1 or self.max_batch < 1:
      raise ValueError("devices_per_slice and max_batch must be >= 1")
    if not 0 <= self.sd_threshold <= self.max_batch:
      raise ValueError(f"sd_threshold={self.sd_threshold} must be in [0, max_batch="
                       f"{self.max_batch}]; above max_batch SD would run from the first "
                       f"iteration: lower --sd-threshold or raise --max-batch")
    if min(self.drafter_steps_per_s, self.spot_startup_s, self.update_s,
           self.update_s_per_token) < 0:
      raise ValueError("drafter, start-up and update times must be >= 0")
    costs.check_covers(self.max_batch)


def idle_summary(finish_s: np.ndarray, devices_per_slice: int, spot_startup_s: float = 0.0,
                 drafter_steps_per_s: float = 0.0) -> dict:
  """Idle device-time of one rollout from its slices' finish times [R] (seconds): idle_device_s
  (rollout end - slice finish, summed, times devices_per_slice), idle_share of the rollout's
  device-time, reclaimed_device_s (the idle time after each slice's spot_startup_s, all of it
  drafter training) and its share, drafter_steps (whole steps at drafter_steps_per_s)."""
  end = float(finish_s.max()) if finish_s.size else 0.0
  idle = end - finish_s
  usable = np.maximum(idle - spot_startup_s, 0.0)
  device_s = end * finish_s.size * devices_per_slice
  share = lambda x: x / device_s if device_s > 0 else 0.0  # noqa: E731
  idle_device_s = float(idle.sum() * devices_per_slice)
  reclaimed_device_s = float(usable.sum() * devices_per_slice)
  return {"rollout_s": end, "idle_slice_s": float(idle.sum()), "idle_device_s": idle_device_s,
          "idle_share": share(idle_device_s), "reclaimed_device_s": reclaimed_device_s,
          "reclaimed_share": share(reclaimed_device_s),
          "drafter_steps": int(np.floor(usable * drafter_steps_per_s + 1e-9).sum())}


def simulate_step(lengths, num_devices: int, cfg: StepConfig, costs: CostModel) -> dict:
  """Baseline (plain decode, idle slices wait) vs TLT (SD at <= sd_threshold running rows,
  idle slices train the drafter) for one step's responses on num_devices devices: {"baseline",
  "tlt"} (idle_summary plus update_s, step_s, sd_iterations, finish_s [R]) with
  speedup_rollout and speedup_step, baseline over TLT."""
  if num_devices % cfg.devices_per_slice:
    raise ValueError(f"{num_devices} devices do not split into slices of "
                     f"{cfg.devices_per_slice}; pick --devices multiples of "
                     f"--devices-per-slice")
  lengths = np.asarray(lengths)
  update_s = cfg.update_s + cfg.update_s_per_token * float(lengths.sum()) / num_devices
  out = {}
  for name, threshold in (("baseline", 0), ("tlt", cfg.sd_threshold)):
    sim = simulate_rollout(lengths, num_devices // cfg.devices_per_slice, cfg.max_batch, costs,
                           threshold, cfg.schedule, cfg.iterations_per_call)
    spot = name == "tlt"  # the baseline trains no drafter: nothing is reclaimed
    row = idle_summary(sim["finish_s"], cfg.devices_per_slice, cfg.spot_startup_s,
                       cfg.drafter_steps_per_s * spot)
    if not spot:
      row.update(reclaimed_device_s=0.0, reclaimed_share=0.0)
    out[name] = dict(row, update_s=update_s, step_s=row["rollout_s"] + update_s,
                     sd_iterations=float(sim["sd_iterations"].sum()), finish_s=sim["finish_s"])
  for k in ("rollout", "step"):
    tlt_s = out["tlt"][f"{k}_s"]
    out[f"speedup_{k}"] = out["baseline"][f"{k}_s"] / tlt_s if tlt_s else 1.0
  return out


# ---------------------------------------------------------------- the sweep

_SCALARS = ("rollout_s", "idle_device_s", "idle_share", "reclaimed_device_s",
            "reclaimed_share", "drafter_steps", "update_s", "step_s")
_MODES = ("baseline", "tlt")


def sweep(devices: list[int], cfg: StepConfig, costs: CostModel, prompts_per_step: int,
          samples: int, scaling: str, trials: int, seed: int, length_args: dict) -> list[dict]:
  """simulate_step at each device count, averaged over `trials` length draws (sample_lengths
  keywords `length_args`). scaling: "weak", prompts_per_step prompts per 8 devices (the
  paper's 7B setting: 64 prompts x 8 samples on 8 GPUs); "strong", that many in total.
  Returns per device count the trial means, the per-trial values and trial 0's finish times."""
  if scaling not in ("weak", "strong"):
    raise ValueError(f"scaling must be 'weak' or 'strong', got {scaling!r}")
  rows = []
  for n in devices:
    prompts = max(1, round(prompts_per_step * n / 8)) if scaling == "weak" else prompts_per_step
    per_trial = [simulate_step(sample_lengths(np.random.default_rng([seed, n, trial]),
                                              prompts * samples, **length_args), n, cfg, costs)
                 for trial in range(trials)]
    row = {"devices": n, "slices": n // cfg.devices_per_slice, "prompts": prompts,
           "responses": prompts * samples}
    for mode in _MODES:
      row[mode] = {k: float(np.mean([s[mode][k] for s in per_trial])) for k in _SCALARS}
      row[mode]["finish_s"] = per_trial[0][mode]["finish_s"].round(4).tolist()
    for k in ("speedup_rollout", "speedup_step"):
      row[k] = float(np.mean([s[k] for s in per_trial]))
    row["trials"] = [{m: {k: s[m][k] for k in _SCALARS} for m in _MODES} for s in per_trial]
    rows.append(row)
  return rows


def write_outputs(rows: list[dict], record: dict, out: str) -> None:
  """OUT/simulation.json (record + rows), simulation.csv and simulation.png."""
  write_json(os.path.join(out, "simulation.json"), {**record, "results": rows})
  tmp = os.path.join(out, ".simulation.csv.tmp")  # renamed whole: a killed run keeps the last
  with open(tmp, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["devices", "slices", "responses"] + [f"{m}_{k}" for m in _MODES
                                                     for k in _SCALARS] +
               ["speedup_rollout", "speedup_step"])
    for r in rows:
      w.writerow([r["devices"], r["slices"], r["responses"]] +
                 [f"{r[m][k]:.6g}" for m in _MODES for k in _SCALARS] +
                 [f"{r['speedup_rollout']:.4f}", f"{r['speedup_step']:.4f}"])
  os.replace(tmp, os.path.join(out, "simulation.csv"))
  n = [r["devices"] for r in rows]
  fig, axes = pyplot().subplots(1, 2, figsize=(10, 3.6), dpi=110)
  for ax, lines, label in (
      (axes[0], (("baseline", "idle_share", "o-", "idle, no TLT"),
                 ("tlt", "idle_share", "s--", "idle, TLT"),
                 ("tlt", "reclaimed_share", "^-", "reclaimed by spot training")),
       "% of rollout device-time"),
      (axes[1], ((None, "speedup_step", "o-", "step (rollout + update)"),
                 (None, "speedup_rollout", "s--", "rollout")), "projected TLT speedup (x)")):
    for mode, key, style, name in lines:
      ax.plot(n, [100 * r[mode][key] if mode else r[key] for r in rows], style, label=name)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="devices", ylabel=label)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  axes[1].axhline(1.0, color="k", lw=0.6)
  fig.suptitle(f"{record['title']}\ncosts: {os.path.basename(record['costs']['source'])}",
               fontsize=8)
  save_figure(fig, os.path.join(out, "simulation.png"))


# ---------------------------------------------------------------- command line

# flag, type, default, help; StepConfig's fields are flags too.
FLAGS = (
    ("--costs", str, None, "measured cost table (JSON); default: built-in model"),
    ("--costs-from-bench", str, None, "derive costs from bench_rollout.py's JSON"),
    ("--costs-from-decode", str, None, "iteration times from profile_decode.py's JSON"),
    ("--decode-sd", str, None, "with --costs-from-decode: its SD strategy key"),
    ("--accept-len", float, 6.4, "with --costs-from-decode: tokens per SD iteration"),
    ("--lengths", str, None, "measured lengths: lengths.json or rollouts.jsonl"),
    ("--median", float, 3000.0, "lognormal lengths (without --lengths): median tokens"),
    ("--sigma", float, 1.0, "lognormal lengths: sigma of the log-length"),
    ("--max-new-tokens", int, 32768, "length cap"),
    ("--prompts-per-step", int, 64, "prompts (per 8 devices with --scaling weak)"),
    ("--samples", int, 8, "responses per prompt"),
    ("--scaling", str, "weak", "weak: prompts per step per 8 devices; strong: in total"),
    ("--trials", int, 8, "length draws per device count"),
    ("--seed", int, 0, "of the length draws"),
)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="output folder")
  parser.add_argument("--quick", action="store_true", help="two small device counts, 1 trial")
  parser.add_argument("--devices", type=int, nargs="+",
                      default=[8, 16, 32, 64, 128, 256, 512, 1024])
  for flag, kind, default, text in FLAGS:
    parser.add_argument(flag, type=kind, default=default, help=text)
  for f in dataclasses.fields(StepConfig):
    parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                        default=f.default, help=f"default {f.default}")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  try:
    sweep_main(args)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"error: {e}") from None


def sweep_main(args) -> None:
  if args.quick:
    args.devices, args.trials, args.prompts_per_step = [8, 64], 1, 16
    args.max_new_tokens = min(args.max_new_tokens, 4096)
  sources = [a for a in ("costs", "costs_from_bench", "costs_from_decode") if getattr(args, a)]
  if len(sources) > 1:
    raise ValueError("give one cost source, not " + " and ".join(
        "--" + a.replace("_", "-") for a in sources))
  cfg = StepConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(StepConfig)})
  if args.costs_from_decode:
    costs, upto = costs_from_decode_json(args.costs_from_decode, cfg.max_batch, args.decode_sd,
                                         args.accept_len)
    if cfg.sd_threshold > upto:
      raise ValueError(f"--sd-threshold {cfg.sd_threshold}: {args.costs_from_decode} measured "
                       f"SD up to batch {upto}; use --sd-threshold {upto} or less")
  else:
    costs = (load_costs(args.costs) if args.costs else
             costs_from_rollout_json(args.costs_from_bench, cfg.max_batch)
             if args.costs_from_bench else default_costs(cfg.max_batch))
  cfg.check(costs)
  length_args = dict(dist="lognormal", max_new_tokens=args.max_new_tokens, median=args.median,
                     sigma=args.sigma)
  lengths_record = dict(length_args)
  if args.lengths:
    length_args.update(dist="measured", pool=load_lengths(args.lengths))
    lengths_record = dict(dist="measured", max_new_tokens=args.max_new_tokens,
                          **length_summary(length_args["pool"]))
  t0 = time.perf_counter()
  rows = sweep(args.devices, cfg, costs, args.prompts_per_step, args.samples, args.scaling,
               args.trials, args.seed, length_args)
  seconds = time.perf_counter() - t0
  source = f"{args.lengths} (drawn with replacement)" if args.lengths else "lognormal"
  title = (f"{source} lengths, cap {args.max_new_tokens}; {args.prompts_per_step}x{args.samples}"
           f" responses {'per 8 devices' if args.scaling == 'weak' else 'per step'}; "
           f"batch {cfg.max_batch}, SD at <= {cfg.sd_threshold} rows")
  write_outputs(rows, {"title": title, "command": " ".join(["python", *sys.argv]),
                       "date": time.strftime("%Y-%m-%d"), "device": "CPU (a simulation)",
                       "config": vars(args), "step": dataclasses.asdict(cfg),
                       "costs": costs.to_dict(), "lengths": lengths_record,
                       "simulation_s": seconds}, args.out)
  for r in rows:
    base, tlt = r["baseline"], r["tlt"]
    print(f"{r['devices']:5d} devices {r['slices']:5d} slices: idle {base['idle_share']:6.1%} "
          f"-> TLT idle {tlt['idle_share']:6.1%}, reclaimed {tlt['reclaimed_share']:6.1%}; "
          f"speedup rollout {r['speedup_rollout']:.2f}x, step {r['speedup_step']:.2f}x")
  print(f"simulated in {seconds:.1f}s; wrote {args.out}/simulation.{{json,csv,png}}")


if __name__ == "__main__":
  main()
