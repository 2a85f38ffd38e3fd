"""The end-of-run report of the main job: summary.json, summary.png and a printed table."""

from __future__ import annotations

import json
import os

import ml_collections
import numpy as np

from tlt_jax.run_log import write_json

# The keys every line of WORKDIR/metrics.jsonl has (more may follow).
METRIC_KEYS = ("step", "reward_mean", "accuracy", "response_len_mean", "response_len_max",
               "rollout_s", "update_s", "step_s", "rollout_tokens", "sd_enabled",
               "sd_accept_len_mean", "drafter_steps", "drafter_loss", "idle_slice_s",
               "reclaimed_slice_s", "compile_s")


def write_summary(workdir: str, history: list[dict], config: ml_collections.ConfigDict,
                  wall_s: float, stopped_early: bool = False,
                  evals: list[dict] | None = None, write: bool = True,
                  extra: dict | None = None) -> dict:
  """Writes WORKDIR/summary.json and summary.png (reward and step time over steps) from the
  per-step metrics and held-out evaluations, prints a short table, returns the summary.
  extra: more entries for the summary (e.g. the compile counts of this run).
  write=False only returns it (processes other than process 0 of a multi-host run)."""
  evals = evals or []
  summary = {"steps_done": len(history), "stopped_early": stopped_early, "wall_s": wall_s,
             **(extra or {}), "config": json.loads(config.to_json())}
  if evals:
    summary.update(eval_accuracy_first=evals[0]["accuracy"], eval_step_first=evals[0]["step"],
                   eval_accuracy_last=evals[-1]["accuracy"], eval_step_last=evals[-1]["step"])
    if "sampled_accuracy" in evals[0]:
      summary.update(eval_sampled_accuracy_first=evals[0]["sampled_accuracy"],
                     eval_sampled_accuracy_last=evals[-1]["sampled_accuracy"])
  if history:
    first, last = history[0], history[-1]
    step_s = np.asarray([m["step_s"] for m in history])
    rollout_s = np.asarray([m["rollout_s"] for m in history])
    compile_s = np.asarray([m["compile_s"] for m in history])
    summary.update(
        reward_first=first["reward_mean"], reward_last=last["reward_mean"],
        accuracy_first=first["accuracy"], accuracy_last=last["accuracy"],
        step_s_mean=float(step_s.mean()),
        # Steps after the first compile nothing new (shape buckets aside): their time is the
        # run's steady state.
        step_s_mean_after_first=float(step_s[1:].mean()) if len(step_s) > 1 else None,
        rollout_share=float(rollout_s.sum() / step_s.sum()),
        compile_s_total=float(compile_s.sum()),
        drafter_steps_total=int(sum(m["drafter_steps"] for m in history)),
        sd_accept_len_mean=_mean([m["sd_accept_len_mean"] for m in history]),
        reclaimed_slice_s_total=float(sum(m["reclaimed_slice_s"] for m in history)),
        idle_slice_s_total=float(sum(m["idle_slice_s"] for m in history)))
    # Steps that asked for SD but never reached it, and why (the last one's reason).
    missed = [m["sd_not_reached"] for m in history if "sd_not_reached" in m]
    if missed:
      summary.update(sd_not_reached_steps=len(missed), sd_not_reached=missed[-1])
    # rl.paired_control (step 1 is 0 by construction; a resumed run may have switched it on)
    paired = [m for m in history[1:] if "reward_vs_initial" in m]
    if paired:
      summary.update(
          reward_vs_initial_mean=float(np.mean([m["reward_vs_initial"] for m in paired])),
          accuracy_vs_initial_mean=float(np.mean([m["accuracy_vs_initial"] for m in paired])))
    if write:
      _plot(history, evals, os.path.join(workdir, "summary.png"))
      _print_table(summary)
  if write:
    write_json(os.path.join(workdir, "summary.json"), summary)
  return summary


def _mean(values):
  values = [v for v in values if v is not None]
  return float(np.mean(values)) if values else None


def _print_table(s: dict) -> None:
  rows = [("steps", f"{s['steps_done']}"),
          ("held-out greedy accuracy", (f"{s['eval_accuracy_first']:.3f} (step "
                                        f"{s['eval_step_first']}) -> {s['eval_accuracy_last']:.3f}"
                                        f" (step {s['eval_step_last']})")
           if "eval_accuracy_first" in s else "not evaluated"),
          ("held-out sampled accuracy", (f"{s['eval_sampled_accuracy_first']:.3f} -> "
                                         f"{s['eval_sampled_accuracy_last']:.3f}")
           if "eval_sampled_accuracy_first" in s else "not evaluated"),
          ("reward (first -> last)", f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}"),
          ("accuracy (first -> last)", f"{s['accuracy_first']:.3f} -> {s['accuracy_last']:.3f}"),
          *([("reward vs initial policy (paired)",
              f"{s['reward_vs_initial_mean']:+.3f} (accuracy {s['accuracy_vs_initial_mean']:+.3f}),"
              f" mean of steps 2-{s['steps_done']}")] if "reward_vs_initial_mean" in s else []),
          ("step time, mean (after step 1)",
           f"{s['step_s_mean']:.1f} s ({s['step_s_mean_after_first'] or 0:.1f} s)"),
          ("rollout share of step time", f"{s['rollout_share']:.0%}"),
          ("compile time (steps, host waiting)", f"{s['compile_s_total']:.1f} s"),
          ("compiled, by program kind", ", ".join(
              f"{kind} {line['programs']} ({line['seconds']:.1f} s)" + (
                  f" + {line['ahead_programs']} ahead ({line['ahead_seconds']:.1f} s)"
                  if line.get("ahead_programs") else "")
              for kind, line in s.get("compile_bill", {}).items()) or "-"),
          ("XLA programs compiled / from the cache",
           f"{s['xla_compiles']} / {s['xla_cache_hits']}" if "xla_compiles" in s else "-"),
          ("SD accept length, mean", _accept_line(s)),
          ("drafter steps (spot)", f"{s['drafter_steps_total']}"),
          ("slice time reclaimed / idle",
           f"{s['reclaimed_slice_s_total']:.1f} s / {s['idle_slice_s_total']:.1f} s"),
          ("wall time", f"{s['wall_s']:.0f} s")]
  width = max(len(k) for k, _ in rows)
  print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


def _accept_line(s: dict) -> str:
  accept = (f"{s['sd_accept_len_mean']:.2f}" if s["sd_accept_len_mean"] is not None
            else "- (no SD call)")
  if s.get("sd_not_reached_steps"):
    accept += (f"; SD not reached in {s['sd_not_reached_steps']} of {s['steps_done']} steps: "
               f"{s['sd_not_reached']}")
  return accept


def _plot(history: list[dict], evals: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [m["step"] for m in history]
  fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
  ax1.plot(steps, [m["reward_mean"] for m in history], "o-", label="reward")
  ax1.plot(steps, [m["accuracy"] for m in history], "s--", label="accuracy")
  if evals:
    ax1.plot([e["step"] for e in evals], [e["accuracy"] for e in evals], "k^-",
             label="held-out greedy accuracy")
    if "sampled_accuracy" in evals[0]:
      ax1.plot([e["step"] for e in evals], [e["sampled_accuracy"] for e in evals], "kv:",
               label="held-out sampled accuracy")
  ax1.set_ylabel("mean over responses")
  ax1.legend(fontsize=8)
  ax2.bar(steps, [m["rollout_s"] for m in history], label="rollout")
  ax2.bar(steps, [m["update_s"] for m in history],
          bottom=[m["rollout_s"] for m in history], label="update")
  ax2.plot(steps, [m["step_s"] for m in history], "k.", label="step")
  ax2.set_ylabel("seconds")
  ax2.set_xlabel("RL step")
  ax2.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def accept_shown(metrics: dict) -> str:
  """The progress line's SD accept length: 'not reached' when SD was on but never ran."""
  if metrics["sd_accept_len_mean"] is not None:
    return f"{metrics['sd_accept_len_mean']:.2f}"
  return "not reached" if "sd_not_reached" in metrics else "off"
