"""Training-time test: greedy accept length per SD strategy for drafters trained with K unrolled
draft steps (`drafter.train_depth`), without and with fused policy features, and with the full
or a reduced draft vocabulary (`drafter.eagle.draft_vocab_size`: the tokens most frequent in
the training responses).

  python -m experiments.drafter_ttt --out results/drafter_ttt/drafter_ttt.json [--quick]
  python -m experiments.drafter_ttt --train-depth 1 --feature-layers '' \
      --draft-vocab-sizes 0 69 --out results/draft_vocab/accept.json

Every variant trains from the same initialisation on the same samples for the same number of
updates, then drafts greedily for held-out prompts (docs/reproducing.md). The protocol
(`policy_responses`, `train`, `decode`) is notebooks/drafter_ablation.ipynb's too.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import pathlib
import time

import jax
import numpy as np

from tlt_jax.components import (drafter_opt_config, load_drafters_for, load_policy,
                                load_tokenizer_for, make_engine, model_config, task_prompts)
from tlt_jax.drafter_training.train_step import init_train_state
from tlt_jax.drafter_training.warmup import collect_samples, train_drafter
from tlt_jax.drafters import EagleDrafter
from tlt_jax.mesh import make_mesh
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.rollout.engine import accept_length
from tlt_jax.speculative.tuner import FixedTuner

from .common import (config_or_exit, pyplot, run_metadata, save_figure, strategies_or_exit,
                     strategy_label, write_json, REPO)

# The training and evaluation sizes: flag -> (default, with --quick).
SIZES = {"train-prompts": (256, 8), "eval-prompts": (64, 2), "max-new-tokens": (256, 32),
         "train-steps": (200, 6), "batch-rows": (8, 2), "window": (256, 64), "seed": (0, 0)}


def policy_responses(config, cfg, params, mesh, eos: int, pad: int, prompts,
                     max_new_tokens: int, seed: int):
  """The policy's own responses to `prompts`, one each at temperature 1.0 as the warm-up job
  samples them (the engine's result: tokens, lengths)."""
  sampler = make_engine(config, cfg, params, mesh, eos, pad, max_new_tokens=max_new_tokens,
                        max_batch=min(64, 1 << (len(prompts) - 1).bit_length()))
  return sampler.generate(prompts, 1, SamplingParams(1.0), jax.random.key(seed))


def train(drafter_params, policy_params, samples, model_cfg, settings: dict, opt_config,
          steps: int, window: int, batch_rows: int, seed: int, state=None):
  """(trained drafter params, summary) after `steps` updates of the warm-up's `train_drafter`
  from `drafter_params` ({family: params}; or from `state`, an optimizer state to continue).
  The summary: training seconds (first-step compile included), steps, the first loss, and the
  loss, top-1 and top-1-ahead means over the last 10% of steps (batch-to-batch noise
  smoothed), where the family reports them."""
  t0 = time.perf_counter()
  trained, history = train_drafter(drafter_params, policy_params, samples, model_cfg, settings,
                                   opt_config, steps, window=window, batch_rows=batch_rows,
                                   seed=seed, progress=False, state=state)
  tail = history[-max(1, len(history) // 10):]
  summary = {"train_s": time.perf_counter() - t0, "steps": len(history),
             "loss_first": history[0]["loss"]}
  summary.update({f"{k}_last": float(np.mean([h[k] for h in tail]))
                  for k in ("loss", "top1", "top1_ahead") if k in history[-1]})
  return trained, summary


def decode(engine, prompts, samples: int, sampling: SamplingParams, seed: int):
  """The engine's result for `prompts` x `samples`, measured after an untimed call on the
  first prompt that compiles its programs."""
  engine.generate(prompts[:1], samples, sampling, jax.random.key(seed))
  return engine.generate(prompts, samples, sampling, jax.random.key(seed))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, type=pathlib.Path,
                 help="JSON path; the PNG goes next to it")
  p.add_argument("--config", default=str(REPO / "configs" / "default.py"))
  p.add_argument("--train-depth", "--steps-ahead", type=int, nargs="+", default=[1, 3, 5])
  p.add_argument("--feature-layers", "--fused-layers", default="1,3",
                 help="policy layers fused into the fused variants' features ('' = none)")
  p.add_argument("--draft-vocab-sizes", type=int, nargs="+", default=[0],
                 help="draft vocabulary sizes to compare (0 = the policy's whole vocabulary)")
  p.add_argument("--strategies", nargs="+", default=None,
                 help="'steps,topk,verify' each; default: the config's tuner arms")
  for flag, (full, _) in SIZES.items():
    p.add_argument(f"--{flag}", type=int, default=full)
  p.add_argument("--quick", action="store_true", help="smoke setting (about a minute)")
  args = p.parse_args(argv)
  if args.quick:
    args.train_depth = [1, 2]
    for flag, (_, quick) in SIZES.items():
      setattr(args, flag.replace("-", "_"), quick)
  if min(args.train_depth) < 1 or min(args.draft_vocab_sizes) < 0:
    p.error("every --train-depth K must be >= 1, every --draft-vocab-sizes size >= 0")
  return args


def main(argv=None):
  args = parse_args(argv)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  config = config_or_exit(args.config)
  feature_layers = tuple(int(x) for x in args.feature_layers.split(",") if x.strip())
  strategies = strategies_or_exit(args.strategies, config)[:1 if args.quick else None]
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  tokenizer = load_tokenizer_for(config)
  cfg, params = load_policy(config, mesh)
  eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
  _, train_prompts = task_prompts(config, tokenizer, args.train_prompts)
  _, eval_prompts = task_prompts(config, tokenizer, args.eval_prompts, eval_split=True)

  t0 = time.perf_counter()
  generated = policy_responses(config, cfg, params, mesh, eos, pad, train_prompts,
                               args.max_new_tokens, args.seed)
  feature_sets = {"unfused": ()} | ({"fused": feature_layers} if feature_layers else {})
  samples = {}
  for name, layers in feature_sets.items():
    c = copy.deepcopy(config)
    c.drafter.eagle.feature_layers = layers
    samples[name] = collect_samples(params, model_config(c), train_prompts, generated.tokens)
  samples_s = time.perf_counter() - t0
  print(f"{len(train_prompts)} samples, {int(generated.lengths.sum())} response tokens; "
        f"{samples_s:.0f} s", flush=True)

  rows = {}
  for feat_name, layers in feature_sets.items():
    for vocab in args.draft_vocab_sizes:
      vc = copy.deepcopy(config)
      vc.drafter.eagle.feature_layers = layers
      vc.drafter.eagle.draft_vocab_size = vocab
      vcfg = model_config(vc)
      eagle = load_drafters_for(vc, vcfg, fresh=True, names=("eagle",))["eagle"]
      # With a reduced vocabulary: the tokens most frequent in the policy's responses.
      init = jax.device_get(EagleDrafter.warm_start(eagle.settings, eagle.params, params, vcfg,
                                                    generated.tokens, say=lambda _: None))
      name = feat_name + (f" r={vocab}" if vocab else "")
      trained = {}
      for k in args.train_depth:
        oc = dataclasses.replace(drafter_opt_config(vc, warmup=True), train_depth=k)
        state = jax.device_put(init_train_state({"eagle": jax.device_put(init)}, oc),
                               jax.devices()[0])
        trained[k], summary = train(
            state.params, params, samples[feat_name], vcfg, {"eagle": eagle.settings}, oc,
            args.train_steps, args.window, args.batch_rows, args.seed, state=state)
        rows[f"{name} K={k}"] = {
            "variant": f"{name} K={k}", "features": feat_name, "feature_layers": list(layers),
            "draft_vocab_size": vocab, "train_depth": k, "accept_len": {}, "sd_tokens_per_s": {},
            **{key: summary[key] for key in ("train_s", "loss_last", "top1_last",
                                             "top1_ahead_last")}}
      # One engine per strategy and architecture; the K variants only swap weights.
      for strategy in strategies:
        engine = make_engine(vc, vcfg, params, mesh, eos, pad,
                             drafters={"eagle": EagleDrafter(trained[args.train_depth[0]]["eagle"],
                                                             eagle.settings)},
                             speculative=True, tuner=FixedTuner(strategy), sd_threshold=1,
                             max_batch=1, max_new_tokens=args.max_new_tokens,
                             compile_ahead=False)  # every call SD: what is measured
        arm = strategy_label(strategy)
        for k in args.train_depth:
          engine.update_params(drafter_params=trained[k])
          result = decode(engine, eval_prompts, 1, SamplingParams(0.0), args.seed)
          row = rows[f"{name} K={k}"]
          row["accept_len"][arm] = accept_length(result)
          row["sd_tokens_per_s"][arm] = float(result.lengths.sum() / result.wall_s)
          print(f"{row['variant']:16s} {arm}: accept {row['accept_len'][arm]:.2f}", flush=True)

  # The largest K over K = 1 (full vocabulary), and each reduced vocabulary over the full one
  # at the same K, at the deepest strategy.
  deepest = strategy_label(max(strategies, key=lambda s: (s.depth, s.verify_tokens)))
  gains, vocab_ratios = {}, {}
  for feat_name in feature_sets:
    full = {r["train_depth"]: r["accept_len"][deepest] for r in rows.values()
            if r["features"] == feat_name and not r["draft_vocab_size"]}
    if full:
      gains[feat_name] = full[max(full)] / full[min(full)]
      vocab_ratios.update({r["variant"]: r["accept_len"][deepest] / full[r["train_depth"]]
                           for r in rows.values()
                           if r["features"] == feat_name and r["draft_vocab_size"]})
  settings = {k: v for k, v in vars(args).items() if k != "out"}
  settings.update(strategies=[strategy_label(s) for s in strategies], deepest=deepest,
                  samples_s=samples_s, **run_metadata())
  write_json(args.out, {"settings": settings, "rows": list(rows.values()),
                        "gain_deepest": gains, "vocab_ratio_deepest": vocab_ratios})
  plot(list(rows.values()), strategies, args.out.with_suffix(".png"))
  print(f"accept length at {deepest}, largest K over K=1: "
        + ", ".join(f"{n} {g:.2f}x" for n, g in gains.items()))
  if vocab_ratios:
    print(f"accept length at {deepest}, reduced over full vocabulary: "
          + ", ".join(f"{n} {g:.3f}" for n, g in vocab_ratios.items()))
  print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(rows, strategies, path):
  """Accept length against K per strategy and drafter; with a single K, bars per strategy."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6.5, 4))
  labels = [strategy_label(s) for s in strategies]
  if len({r["train_depth"] for r in rows}) == 1:
    width = 0.8 / len(rows)
    x = np.arange(len(strategies))
    for j, r in enumerate(rows):
      ax.bar(x + j * width, [r["accept_len"][s] for s in labels], width, label=r["variant"])
    ax.set_xticks(x + 0.4 - width / 2, [f"({s})" for s in labels])
    ax.set(xlabel="strategy (depth, topk, verify tokens)",
           title="accept length per strategy and drafter")
  else:
    vocabs = sorted({r["draft_vocab_size"] for r in rows})
    for i, s in enumerate(labels):
      for feat, style in (("unfused", "-"), ("fused", "--")):
        for vocab, marker in zip(vocabs, "osd^v"):
          if pts := sorted((r["train_depth"], r["accept_len"][s]) for r in rows
                           if r["features"] == feat and r["draft_vocab_size"] == vocab):
            ax.plot(*zip(*pts), style, marker=marker, color=f"C{i}",
                    label=f"({s}) {feat}" + (f" r={vocab}" if vocab else ""))
    ax.set(xlabel="draft steps unrolled in training (K)",
           title="training-time test: accept length per strategy")
  ax.set_ylabel("greedy accept length")
  ax.legend(fontsize=7)
  save_figure(fig, path, dpi=120)


if __name__ == "__main__":
  main()
