"""The main job: GRPO with TLT rollouts (adaptive SD) and spot training of the drafter.

  python -m tlt_jax.train --config configs/default.py --workdir runs/default
  python -m tlt_jax.train --config configs/default.py:baseline --workdir runs/baseline

Each step: take prompts; roll out `rl.num_samples` responses per prompt on every replica
slice (plain decoding, then SD with the drafter once few sequences run); meanwhile slices that
are done train the drafter on the policy's features; score the responses; GRPO-update the
policy on the whole mesh; reshard the new policy and drafter onto the rollout slices.

WORKDIR gets metrics.jsonl (one object per step), checkpoints/ (every rl.checkpoint_every steps
and on SIGINT/SIGTERM; a rerun resumes from the latest), summary.json, summary.png and, at the
end, export/policy and export/drafter in Hugging Face layout.

Multi-host (mesh.distributed, see tlt_jax.mesh): every process runs this same program on the
global mesh; each drives the rollout of its own slices, the update runs on the whole mesh, and
process 0 alone writes the files (orbax coordinates the checkpoints).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import flags, logging
from jax.sharding import NamedSharding, PartitionSpec as P
from ml_collections import config_flags
from tqdm import tqdm

from tlt_jax import cli
from tlt_jax.checkpoint import Checkpointer
from tlt_jax.compile_cache import COMPILES
from tlt_jax.components import (accept_length, load_drafter_for, load_policy,
                                load_tokenizer_for, make_engine, task_examples, training_set)
from tlt_jax.config import (ConfigError, drafter_opt_config, grpo_config, sampling_params,
                            spot_config, training_model_config)
from tlt_jax.mesh import host_copy, logical_to_mesh_spec, make_mesh
from tlt_jax.optim import init_optimizer
from tlt_jax.rl.data import PromptIterator
from tlt_jax.rl.grpo import group_advantages
from tlt_jax.rl.policy_update import (build_rows, make_log_probs, make_policy_update,
                                      split_minibatches)
from tlt_jax.rl.rewards import answer_reward, combine_rewards, make_format_reward
from tlt_jax.rl.tokenizer import prompt_ids
from tlt_jax.run_log import append_jsonl, read_jsonl, response_key, resume_jsonl
from tlt_jax.train_report import write_summary
from tlt_jax.workdir import lock_workdir, make_workdir

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/train", "Output folder (resumes from it).")
_START_OVER = flags.DEFINE_bool(
    "start_over", False, "When no checkpoint in --workdir loads but an earlier run left "
    "results there, move them to WORKDIR/previous-<time>/ and start from step 0.")

def make_reward(config: ml_collections.ConfigDict):
  """The configured reward: `fn(prompts, completions, **columns) -> list[float]`."""
  if config.rl.reward == "answer":
    return answer_reward
  return combine_rewards(answer_reward, make_format_reward(config.rl.format_bonus))


def make_policy_optimizer(r: ml_collections.ConfigDict) -> optax.GradientTransformation:
  schedule = optax.linear_schedule(0.0, r.learning_rate, r.lr_warmup_steps) \
      if r.lr_warmup_steps else r.learning_rate
  return optax.chain(
      optax.clip_by_global_norm(r.grad_clip) if r.grad_clip > 0 else optax.identity(),
      optax.adamw(schedule, b1=r.b1, b2=r.b2, weight_decay=r.weight_decay))


class _StopFlag:
  """SIGINT/SIGTERM ask for a clean stop after the current step (a second SIGINT aborts)."""

  def __init__(self):
    self.requested = False
    self._old = {}

  def __enter__(self):
    for sig in (signal.SIGINT, signal.SIGTERM):
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. run from a notebook's worker)
        pass
    return self

  def _handle(self, signum, frame):
    if self.requested and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.requested = True
    tqdm.write(f"received {signal.Signals(signum).name}: stopping after this step")

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def train(config: ml_collections.ConfigDict, workdir: str, reward_fn=None,
          progress: bool = True, start_over: bool = False) -> dict:
  """Runs (or resumes) the job in `workdir`; returns the summary (also in summary.json).

  reward_fn: replaces the configured reward, `fn(prompts, completions, **columns)`; columns
  are `answer` (the reference answers) and `metadata`. SIGINT/SIGTERM stop the run cleanly
  after the current step, with a checkpoint.
  start_over: when the workdir holds an earlier run's results but no checkpoint loads, move
  those files to WORKDIR/previous-<time>/ and start from step 0 (else: stop and say so).
  """
  main = jax.process_index() == 0  # the process that writes files and prints
  lock = lock_workdir(workdir) if main else None
  try:
    with _StopFlag() as stop:
      return _train(config, workdir, reward_fn, progress, stop, start_over)
  finally:
    if lock is not None:
      lock.release()


def _train(config, workdir, reward_fn, progress, stop, start_over) -> dict:
  make_workdir(workdir)
  main = jax.process_index() == 0
  say = tqdm.write if main else (lambda *_: None)
  r = config.rl
  g = r.num_samples
  started = time.perf_counter()
  compiles_before = COMPILES.report()

  # ---------------------------------------------------------------- mesh
  mesh = make_mesh(dict(config.mesh.axes))
  rules = tuple(config.mesh.rules)

  # ---------------------------------------------------------------- data
  tokenizer = load_tokenizer_for(config)
  iterator = PromptIterator(training_set(config, r.num_train_examples), seed=config.seed)
  eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
  reward_fn = reward_fn or make_reward(config)

  # ---------------------------------------------------------------- models
  cfg, params = load_policy(config, mesh)
  if len(tokenizer) > cfg.vocab_size:
    raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the policy's vocab is "
                      f"{cfg.vocab_size}")
  ref_params = jax.tree.map(jnp.copy, params) if r.kl_coef > 0 else None
  use_sd = config.rollout.speculative.enable
  use_drafter = use_sd or config.drafter.spot_training
  dcfg, dparams = load_drafter_for(config, cfg) if use_drafter else (None, None)

  # ---------------------------------------------------------------- rollout
  engine = make_engine(config, cfg, params, mesh, eos, pad,
                       drafter=(dcfg, dparams) if use_sd else None,
                       log_features=config.drafter.spot_training)
  sampling = sampling_params(config)

  # ---------------------------------------------------------------- update
  gc = grpo_config(config)
  tx = make_policy_optimizer(r)
  opt_state, opt_sharding = init_optimizer(tx, params, mesh)
  param_sharding = jax.tree.map(lambda x: x.sharding, params)
  train_cfg = training_model_config(config, cfg)
  update = make_policy_update(train_cfg, gc, tx, param_sharding, opt_sharding)
  log_probs = make_log_probs(train_cfg)
  data_ways = int(np.prod([mesh.shape[a] for a in ("replica", "fsdp") if a in mesh.shape]))
  if r.micro_batch_rows % data_ways:
    raise ConfigError(f"rl.micro_batch_rows={r.micro_batch_rows} must be a multiple of the "
                      f"data-parallel devices (replica x fsdp = {data_ways})")
  rows_unit = r.mini_batches * r.micro_batch_rows
  total_rows = -(-r.prompts_per_step * g // rows_unit) * rows_unit
  need_old = r.ppo_epochs * r.mini_batches > 1

  def place(batch):
    def one(x):
      names = (None, None, "batch") + (None,) * (x.ndim - 3)
      return jax.device_put(x, NamedSharding(mesh, logical_to_mesh_spec(
          P(*names), x.shape, mesh, rules)))
    return {k: one(v) for k, v in batch.items()}

  # ---------------------------------------------------------------- drafter
  spot = None
  if config.drafter.spot_training:
    from tlt_jax.drafter_training.buffer import FeatureBuffer
    from tlt_jax.drafter_training.spot import SpotTrainer
    spot = SpotTrainer(cfg, dcfg, drafter_opt_config(config), dparams, mesh,
                       spot_config(config), FeatureBuffer(config.drafter.buffer.keep_steps),
                       rules=rules, seed=config.seed)

  # ---------------------------------------------------------------- checkpoint
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=r.keep_checkpoints)

  def state_tree():
    tree = {"policy": params, "opt_state": opt_state}
    if spot is not None:
      tree["drafter"] = {"params": spot.state.params, "opt_state": spot.state.opt_state,
                         "step": spot.state.step}
    return tree

  def save(step):
    meta = {"step": step, "iterator": iterator.state_dict()}
    if engine.tuner is not None:
      meta["tuner"] = engine.tuner.state_dict()
    ckpt.save(step, state_tree(), meta)

  step = 0
  restored = ckpt.restore_latest(state_tree())
  if restored is not None:
    step, tree, meta = restored
    params, opt_state = tree["policy"], tree["opt_state"]
    iterator.load_state_dict(meta["iterator"])
    if engine.tuner is not None and "tuner" in meta:
      engine.tuner.load_state_dict(meta["tuner"])
    if spot is not None:
      d = tree["drafter"]
      spot.state = spot.state.replace(params=d["params"], opt_state=d["opt_state"],
                                      step=d["step"])
    engine.update_params(policy_params=params,
                         drafter_params=spot.params if spot is not None and use_sd else None)
    say(f"resumed from the checkpoint of step {step}")
  elif main:
    _start_fresh(workdir, ckpt.failures, start_over, say)
  # Rows past the checkpoint (a crash after them) are dropped: those steps run again. Partial
  # lines and duplicates go too, so the files hold one row per step.
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  history = resume_jsonl(metrics_path, up_to=step) if main else []
  if main:
    resume_jsonl(os.path.join(workdir, "rollouts.jsonl"), up_to=step, key=response_key)

  if spot is not None:  # compile the drafter update for every slice before the first rollout
    spot.precompile(engine.slices, engine.policy_on)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  say(f"mesh {dict(mesh.shape)} over {jax.process_count()} process(es): "
      f"{len(engine.slices)} rollout slices; policy "
             f"{n_params / 1e6:.2f}M params; SD {'on' if engine.speculative else 'off'}, spot "
             f"training {'on' if spot is not None else 'off'}; steps {step} -> {r.steps}")

  # ---------------------------------------------------------------- evaluation
  eval_examples = task_examples(config, r.num_eval_examples, eval_split=True) \
      if r.num_eval_examples else []
  eval_path = os.path.join(workdir, "eval.jsonl")
  evals = resume_jsonl(eval_path, up_to=step) if main else []

  def evaluate(at_step):
    """Held-out accuracy with the rollout engine: greedy (SD is exact, so it is unchanged),
    and with rl.eval_samples samples per problem at the rollout temperature (what the reward
    measures, without the noise of each step's prompt mix)."""
    ids = [prompt_ids(tokenizer, ex.prompt) for ex in eval_examples]
    row = {"step": at_step}
    for name, sp, n in (("greedy", dataclasses.replace(sampling, temperature=0.0), 1),
                        ("sampled", sampling, r.eval_samples)):
      if not n:
        continue
      res = engine.generate(ids, n, sp, jax.random.key(1), log_requests=())
      texts = [tokenizer.decode(t, skip_special_tokens=True) for t in res.tokens]
      row[f"{name}_accuracy"] = float(np.mean(answer_reward(
          [ex.prompt for ex in eval_examples for _ in range(n)], texts,
          answer=[ex.answer for ex in eval_examples for _ in range(n)])))
      row[f"{name}_response_len_mean"] = float(res.lengths.mean())
    row["accuracy"] = row["greedy_accuracy"]
    evals.append(row)
    with open(eval_path if main else os.devnull, "a") as f:
      append_jsonl(f, [row])
    sampled = (f", sampled {row['sampled_accuracy']:.3f} ({r.eval_samples} per problem)"
               if r.eval_samples else "")
    say(f"step {at_step}: held-out accuracy on {len(eval_examples)} problems: greedy "
               f"{row['greedy_accuracy']:.3f}{sampled}")

  if eval_examples and step == 0 and not any(e["step"] == 0 for e in evals):
    evaluate(0)

  # ---------------------------------------------------------------- loop
  base_key = jax.random.key(config.seed)
  update_exes: dict = {}
  bar = tqdm(total=r.steps, initial=step, desc="rl", unit="step",
             disable=not (progress and main))
  rollouts_file = open(os.path.join(workdir, "rollouts.jsonl"), "a") \
      if r.save_rollouts and main else None
  with open(metrics_path if main else os.devnull, "a") as metrics_file:
    while step < r.steps and not stop.requested:
      t_step = time.perf_counter()
      compile_before = engine.pool.compile_seconds + (spot.compile_s if spot else 0.0)
      update_compile_s = 0.0
      examples = iterator.take(r.prompts_per_step)
      prompts = [prompt_ids(tokenizer, ex.prompt) for ex in examples]
      longest = max(len(p) for p in prompts)
      if longest > config.rollout.max_prompt_len:
        raise ConfigError(f"a training problem ({config.task.data_path or 'the built-in task'})"
                          f" has {longest} prompt tokens, more than rollout.max_prompt_len="
                          f"{config.rollout.max_prompt_len}; raise it")
      key = jax.random.fold_in(base_key, step)

      # Rollout, with spot training on the slices that finish first.
      t0 = time.perf_counter()
      spot_metrics = {}
      if spot is not None:
        spot.begin(step, engine.policy_on)
      logged = None
      if spot is not None and config.drafter.buffer.sequences_per_step:
        n = len(prompts) * g
        logged = np.random.default_rng([config.seed, step]).choice(
            n, min(n, config.drafter.buffer.sequences_per_step), replace=False).tolist()
      result = engine.generate(prompts, g, sampling, jax.random.fold_in(key, 0),
                               on_slice_idle=spot.on_slice_idle if spot else None,
                               log_requests=logged)
      if spot is not None:
        spot_metrics = spot.finish()
        if use_sd:
          engine.update_params(drafter_params=spot.params)
      rollout_s = time.perf_counter() - t0

      # Rewards and advantages.
      completions = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
      prompt_text = [ex.prompt for ex in examples for _ in range(g)]
      answers = [ex.answer for ex in examples for _ in range(g)]
      metadata = [ex.metadata for ex in examples for _ in range(g)]
      rewards = np.asarray(reward_fn(prompt_text, completions, answer=answers,
                                     metadata=metadata), np.float32)
      correct = np.asarray(answer_reward(prompt_text, completions, answer=answers))
      adv = group_advantages(rewards, g, gc.scale_by_std)

      # Policy update on the whole mesh.
      t0 = time.perf_counter()
      rows = build_rows([p for p in prompts for _ in range(g)], result.tokens, adv,
                        total_rows, pad, max_width=engine.econf.capacity)
      batch = split_minibatches(rows, r.mini_batches, r.micro_batch_rows, gc.loss_agg)
      batch = place(batch)
      if need_old:  # with one update per step the ratio is 1 and old_logp is not needed
        batch["old_logp"] = _log_probs(log_probs, params, batch)
      if ref_params is not None:
        batch["ref_logp"] = _log_probs(log_probs, ref_params, batch)
      update_metrics = []
      for _ in range(r.ppo_epochs):
        for m in range(r.mini_batches):
          mini = {k: v[m] for k, v in batch.items()}
          exe_key = tuple(sorted((k, v.shape) for k, v in mini.items()))
          if exe_key not in update_exes:
            tc = time.perf_counter()
            update_exes[exe_key] = update.lower(params, opt_state, mini).compile()
            update_compile_s += time.perf_counter() - tc
          params, opt_state, um = update_exes[exe_key](params, opt_state, mini)
          update_metrics.append(um)
      update_metrics = jax.device_get(update_metrics)
      engine.update_params(policy_params=params)  # a reshard onto the rollout slices
      update_s = time.perf_counter() - t0
      step += 1

      # Metrics, checkpoint, progress.
      lengths = result.lengths
      compile_s = engine.pool.compile_seconds + (spot.compile_s if spot else 0.0) - \
          compile_before + update_compile_s
      metrics = {
          "step": step, "reward_mean": float(rewards.mean()), "accuracy": float(correct.mean()),
          "response_len_mean": float(lengths.mean()), "response_len_max": int(lengths.max()),
          "rollout_s": rollout_s, "update_s": update_s, "step_s": time.perf_counter() - t_step,
          "rollout_tokens": int(lengths.sum()), "sd_enabled": engine.speculative,
          "sd_accept_len_mean": accept_length(result),
          "drafter_steps": spot_metrics.get("drafter_steps", 0),
          "drafter_loss": spot_metrics.get("drafter_loss"),
          "drafter_tokens": spot_metrics.get("drafter_tokens", 0.0),
          "idle_slice_s": spot_metrics.get("idle_slice_s", _idle_slice_s(result)),
          "reclaimed_slice_s": spot_metrics.get("reclaimed_slice_s", 0.0),
          "compile_s": compile_s,
          "policy_loss": float(np.mean([u["loss"] for u in update_metrics])),
          "grad_norm": float(np.mean([u["grad_norm"] for u in update_metrics])),
          "clip_frac": float(np.mean([u["clip_frac"] for u in update_metrics])),
          "finished_eos": float(np.mean([f == "eos" for f in result.finish_reasons])),
      }
      if r.kl_coef > 0:
        metrics["kl"] = float(np.mean([u["kl"] for u in update_metrics]))
      if rollouts_file is not None:
        append_jsonl(rollouts_file, [{
            "step": step, "prompt": i // g, "sample": i % g, "completion": completions[i],
            "tokens": len(toks), "finish_reason": result.finish_reasons[i],
            "reward": float(rewards[i]), "correct": bool(correct[i])}
            for i, toks in enumerate(result.tokens)])
      append_jsonl(metrics_file, [metrics])
      history.append(metrics)
      if eval_examples and (step == r.steps or (r.eval_every and step % r.eval_every == 0)):
        evaluate(step)
      if step == r.steps or stop.requested or (r.checkpoint_every and
                                                step % r.checkpoint_every == 0):
        save(step)
      bar.update(1)
      bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{metrics['accuracy']:.2f}",
                      len=f"{metrics['response_len_mean']:.0f}",
                      step_s=f"{metrics['step_s']:.1f}",
                      accept=f"{metrics['sd_accept_len_mean'] or 0:.2f}")
  bar.close()
  if rollouts_file is not None:
    rollouts_file.close()
  ckpt.close()

  # ---------------------------------------------------------------- export and summary
  if step >= r.steps and r.export:
    from tlt_jax.models.drafter_io import save_drafter
    from tlt_jax.models.hf import save_hf_checkpoint
    export = os.path.join(workdir, "export")
    policy = host_copy(params)  # every process takes part in the gather; process 0 writes
    drafter = host_copy(spot.params if spot is not None else dparams) if use_drafter else None
    if main:
      save_hf_checkpoint(os.path.join(export, "policy"), policy, cfg, tokenizer)
      if drafter is not None:
        save_drafter(os.path.join(export, "drafter"), drafter, cfg, dcfg)
  compiles = {k: v - compiles_before[k] for k, v in COMPILES.report().items()}
  summary = write_summary(workdir, history, config, wall_s=time.perf_counter() - started,
                          stopped_early=step < r.steps, evals=evals, write=main,
                          extra=compiles)
  return summary


RUN_FILES = ("metrics.jsonl", "eval.jsonl", "rollouts.jsonl", "summary.json", "summary.png",
             "export")


def _start_fresh(workdir: str, failures: list, start_over: bool, say) -> None:
  """No checkpoint loaded. If the folder holds an earlier run's results, refuse to overwrite
  them (ConfigError saying what failed), or with start_over move them aside first."""
  rows, _ = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  done = sorted({r["step"] for r in rows if r["step"] >= 1})
  if not done and not failures:
    return  # a new run (or one stopped before its first step)
  failed = "; ".join(f"step {s}: {why}" for s, why in failures) or "there are none"
  results = f"metrics of steps {done[0]}-{done[-1]}" if done else "checkpoints"
  if not start_over:
    raise ConfigError(
        f"--workdir {workdir!r} holds an earlier run ({results}) but no checkpoint could be "
        f"loaded ({failed}); rerun with --start_over to move its files to "
        f"{workdir}/previous-<time>/ and start from step 0, or choose another --workdir")
  previous = os.path.join(workdir, time.strftime("previous-%Y%m%d-%H%M%S"))
  os.makedirs(previous)
  for name in RUN_FILES:
    if os.path.exists(os.path.join(workdir, name)):
      shutil.move(os.path.join(workdir, name), os.path.join(previous, name))
  say(f"--start_over: no checkpoint could be loaded ({failed}); the earlier run's files are "
      f"in {previous}; starting from step 0")


def _log_probs(log_probs, params, batch: dict) -> jax.Array:
  """log_probs over [mini_batches, micro_batches, rows, T] batches -> [.., T]."""
  lead = batch["tokens"].shape[:2]
  flat = {k: batch[k].reshape(-1, *batch[k].shape[2:])
          for k in ("tokens", "targets", "loss_mask")}
  return log_probs(params, flat).reshape(*lead, *batch["tokens"].shape[2:])


def _idle_slice_s(result) -> float:
  """Slice-seconds between each slice running out of work and the end of the rollout."""
  return float(sum(result.wall_s - t for t in result.slice_done_s))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = cli.load_config(_CONFIG)
  cli.setup_devices(config)
  train(config, _WORKDIR.value, start_over=_START_OVER.value)


def run():
  """Console-script entry point (`tlt-train`)."""
  cli.run_main(main)


if __name__ == "__main__":
  run()
