"""The main job: RL (GRPO, or rl.algorithm) with TLT rollouts (adaptive SD) and spot training
of the drafter.

  python -m tlt_jax.train --config configs/default.py --workdir runs/default
  python -m tlt_jax.train --config configs/default.py:baseline --workdir runs/baseline

Each step: take prompts; roll out `rl.num_samples` responses per prompt on every replica
slice (plain decoding, then SD with the drafter once few sequences run); meanwhile slices that
are done train the drafter on the policy's features; score the responses (DAPO: more rounds
until enough groups have a spread); update the policy on the whole mesh; reshard the new
policy and drafter onto the rollout slices.

WORKDIR gets metrics.jsonl (one object per step), checkpoints/ (every rl.checkpoint_every steps
and on SIGINT/SIGTERM; a rerun resumes from the latest), summary.json, summary.png and, at the
end, export/policy and export/<drafter> (each trained drafter by name, e.g. export/eagle) in
Hugging Face layout; with logging.tensorboard /
logging.wandb, the same metrics and the response lengths' histogram in TensorBoard / W&B.

Multi-host (mesh.distributed, see tlt_jax.mesh): every process runs this same program on the
global mesh; each drives the rollout of its own slices, the update runs on the whole mesh, and
process 0 alone writes the files (orbax coordinates the checkpoints).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time

import jax
import jax.numpy as jnp
import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from tlt_jax import cli
from tlt_jax.checkpoint import CheckpointMismatch, Checkpointer
from tlt_jax.components import (algorithm_from_config, answer_check, check_prompt_lengths,
                                drafter_opt_config, load_drafters_for, load_policy,
                                load_tokenizer_for, make_engine, policy_adamw, reward_from_config,
                                sampling_params, scoring_task, spot_config, task_examples,
                                training_model_config, training_set)
from tlt_jax.config import ConfigError, RunStopped, flat_settings
from tlt_jax.drafter_training.buffer import FeatureBuffer
from tlt_jax.drafter_training.spot import SpotTrainer
from tlt_jax.job import Job, check_profile_window, exit_stopped, profile_window
from tlt_jax.mesh import make_mesh
from tlt_jax.metric_writers import TENSORBOARD_DIR
from tlt_jax.drafters.io import save_drafter
from tlt_jax.models.hf import save_hf_checkpoint
from tlt_jax.optim import make_adamw
from tlt_jax.rl.data import PromptIterator
from tlt_jax.rl.evaluate import heldout_accuracy
from tlt_jax.rl.phases import (paired_control, rollout_rows, sample_step, step_metrics,
                               timeline_rows, update_policy)
from tlt_jax.rl.policy_update import PolicyUpdater, nonfinite_update_message
from tlt_jax.rollout.pool import merge_bills, set_compile_threads, wait_for_compiles_ahead
from tlt_jax.run_log import steps_done
from tlt_jax.train_report import accept_shown, write_summary

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/train", "Output folder (resumes from it).")
_START_OVER = flags.DEFINE_bool(
    "start_over", False, "When no checkpoint in --workdir loads but an earlier run left "
    "results there, move them to WORKDIR/previous-<time>/ and start from step 0.")


def train(config: ml_collections.ConfigDict, workdir: str, reward_fn=None,
          progress: bool = True, start_over: bool = False) -> dict:
  """Runs (or resumes) the job in `workdir`; returns the summary (also in summary.json).

  reward_fn: replaces the configured reward, `fn(prompts, completions, **columns)`; columns
  are `answer` (the reference answers) and `metadata`. SIGINT/SIGTERM stop the run cleanly
  after the current step, with a checkpoint.
  start_over: when the workdir holds an earlier run's results but no checkpoint loads, move
  those files to WORKDIR/previous-<time>/ and start from step 0 (else: stop and say so).
  """
  with Job(workdir, show_progress=progress, max_minutes=config.rl.max_minutes,
           profile=profile_window(config), name="train",
           settings=flat_settings(config)) as job:
    return _train(config, job, reward_fn, start_over)


def _train(config, job: Job, reward_fn, start_over) -> dict:
  workdir, say, rl = job.workdir, job.say, config.rl
  check_profile_window(config, rl.steps, "rl.steps")

  # ---------------------------------------------------------------- mesh and data
  mesh = make_mesh(dict(config.mesh.axes))
  rules = tuple(config.mesh.rules)
  job.phase(f"mesh {dict(mesh.shape)} on {jax.device_count()} devices over "
            f"{jax.process_count()} process(es); loading the task, tokenizer and policy")
  tokenizer = load_tokenizer_for(config)
  check_prompt_lengths(config, tokenizer)
  prompts_iter = PromptIterator(training_set(config, rl.num_train_examples), seed=config.seed)
  eval_examples = task_examples(config, rl.num_eval_examples, eval_split=True) \
      if rl.num_eval_examples else []
  eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
  reward_fn = reward_fn or reward_from_config(config)
  answer_fn = answer_check(config)

  # ---------------------------------------------------------------- models
  cfg, params = load_policy(config, mesh)
  if len(tokenizer) > cfg.vocab_size:
    raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the policy's vocab is "
                      f"{cfg.vocab_size}")
  use_sd = config.rollout.speculative.enable
  # The drafters the run uses (components.run_drafters), the trained ones with their weights.
  drafters = load_drafters_for(config, cfg) if use_sd or config.drafter.spot_training else {}
  trained = {name: d for name, d in drafters.items() if d.trained}
  spot_on = config.drafter.spot_training and bool(trained)

  # ---------------------------------------------------------------- rollout, spot, update
  job.phase("building the rollout engine, spot trainer and policy update")
  engine = make_engine(config, cfg, params, mesh, eos, pad,
                       drafters=drafters if use_sd else None, log_features=spot_on)
  sampling = sampling_params(config)
  spot = (SpotTrainer(cfg, {n: d.settings for n, d in trained.items()},
                      drafter_opt_config(config), {n: d.params for n, d in trained.items()},
                      mesh, spot_config(config), FeatureBuffer(config.drafter.buffer.keep_steps),
                      rules=tuple(config.mesh.rollout_rules), seed=config.seed)
          if spot_on else None)
  algorithm = algorithm_from_config(config)
  updater = PolicyUpdater(training_model_config(config, cfg), algorithm,
                          make_adamw(policy_adamw(config)), params, mesh, rules,
                          rl.ppo_epochs, rl.mini_batches, rl.micro_batch_rows,
                          ref_params=jax.tree.map(jnp.copy, params) if algorithm.uses_reference
                          else None,
                          widths=tuple(rl.update_widths))
  # The initial policy, for rl.paired_control: a plain engine on its own copy of the weights
  # (the update donates the policy's buffers).
  control = (make_engine(config, cfg, jax.tree.map(jnp.copy, params), mesh, eos, pad)
             if rl.paired_control else None)
  # Every program the job compiles goes through one of these (the bill: `merge_bills`); the
  # control's are billed apart and left out of the step's compile_s, as it is out of step_s.
  pools = [engine.pool, updater.pool] + ([spot.pool] if spot is not None else [])

  # ---------------------------------------------------------------- checkpoint and logs
  ckpt = job.checkpointer(config, rl.keep_checkpoints)
  run = _RunState(params, updater, spot, engine, prompts_iter)
  try:
    step = run.restore(ckpt)
    failures, set_aside = ckpt.failures, ()
  except CheckpointMismatch:
    if not start_over:
      raise
    failures, set_aside = [(ckpt.latest_step, "written with other settings")], ("checkpoints",)
    ckpt.close()  # the earlier run's checkpoints go aside with its other files
    step = 0
  if step:
    engine.update_params(policy_params=run.params,
                         drafter_params=spot.params if spot is not None and use_sd else None)
    say(f"resumed from the checkpoint of step {step}")
  elif job.writer:
    _start_fresh(workdir, failures, start_over, say, also=set_aside)
  if set_aside:
    ckpt = job.checkpointer(config, rl.keep_checkpoints)
  log = job.run_log(resume_step=step, config=config)
  if spot is not None:  # the drafter update for every slice, before a slice goes idle
    job.phase("compiling the drafter update" + (" in the background"
                                                  if config.rollout.compile_ahead else ""))
    spot.precompile(engine.slices, engine.policy_on, ahead=config.rollout.compile_ahead)
  if config.rollout.compile_plan and step < rl.steps:
    job.phase(f"compiling every program of a step on {config.rollout.compile_threads} "
              f"thread(s)")
    _compile_plan(config, engine, updater, run.params, sampling, say)
  n_params = sum(x.size for x in jax.tree.leaves(run.params))
  say(f"mesh {dict(mesh.shape)} over {jax.process_count()} process(es): "
      f"{len(engine.slices)} rollout slices; policy {n_params / 1e6:.2f}M params; SD "
      f"{'on with ' + '+'.join(engine.drafters) if engine.speculative else 'off'}, spot "
      f"training {'on' if spot is not None else 'off'}; steps {step} -> {rl.steps}")

  def evaluate_and_log(at_step: int) -> None:
    row = heldout_accuracy(engine, tokenizer, eval_examples, sampling, rl.eval_samples,
                           answer_fn, breakdown=scoring_task(config).breakdown)
    log.write("eval", [{"step": at_step, **row}])
    sampled = (f", sampled {row['sampled_accuracy']:.3f} ({rl.eval_samples} per problem)"
               if rl.eval_samples else "")
    say(f"step {at_step}: held-out accuracy on {len(eval_examples)} problems: greedy "
        f"{row['greedy_accuracy']:.3f}{sampled}")

  if eval_examples and step == 0 and not log.rows["eval"]:
    job.phase(f"held-out evaluation on {len(eval_examples)} problems before the first step "
              f"(compiles the rollout's programs)")
    evaluate_and_log(0)
  job.phase(f"RL steps {step + 1} to {rl.steps} (the first compiles what it runs)"
            if step < rl.steps else f"the summary of the {rl.steps} steps done")

  # ---------------------------------------------------------------- loop
  base_key = jax.random.key(config.seed)
  bar = job.progress(total=rl.steps, initial=step, desc="rl", unit="step")
  end = rl.steps  # the last step, earlier when rl.max_minutes runs out
  with log, contextlib.ExitStack() as on_exit:
    # Last out, also when the loop raises: a save still in flight is finished, not dropped.
    on_exit.callback(ckpt.close)
    for pool in pools:  # compiles still queued ahead would only delay the end, or a crash
      on_exit.callback(pool.close)
    while step < end and not job.stop.requested:
      with job.traced(step + 1, lambda: run.params):  # profile.*: a jax.profiler trace
        t_step = time.perf_counter()
        compile_before = sum(pool.compile_seconds for pool in pools)
        key = jax.random.fold_in(base_key, step)
        samples = sample_step(engine, spot, prompts_iter, tokenizer, algorithm, reward_fn,
                              answer_fn, sampling, key, step, config)
        paired = {} if control is None else paired_control(
            control, samples, tokenizer, sampling, key, config, reward_fn, answer_fn)
        t_update = time.perf_counter()
        run.params, update_metrics = update_policy(updater, algorithm, run.params, samples, pad,
                                                   engine.capacity, config)
        if update_metrics["nonfinite"] and rl.on_nonfinite == "stop":
          raise RunStopped(nonfinite_update_message(step + 1, update_metrics, ckpt.latest_step))
        engine.update_params(policy_params=run.params)  # a reshard onto the rollout slices
      step += 1
      end = job.last_step(step, end, "rl.max_minutes")
      metrics = step_metrics(step, samples, update_metrics, algorithm, engine.speculative,
                             compile_s=sum(p.compile_seconds for p in pools) - compile_before,
                             update_s=time.perf_counter() - t_update,
                             step_s=time.perf_counter() - t_step - paired.get("control_s", 0))
      metrics.update(paired)
      log.write("metrics", [metrics])
      log.histogram("rollout/response_len", step, samples.rolled.result.lengths)
      if rl.save_rollouts:
        log.write("rollouts", rollout_rows(step, samples.scored, samples.rolled.result,
                                           rl.num_samples, samples.prompts))
      if rl.save_timeline:
        log.write("timeline", timeline_rows(step, samples.rolled.result))
      if eval_examples and (step == end or (rl.eval_every and step % rl.eval_every == 0)):
        evaluate_and_log(step)
      if step == end or job.stop.requested or (rl.checkpoint_every and
                                               step % rl.checkpoint_every == 0):
        run.save(ckpt, step)
      bar.update(1)
      bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{metrics['accuracy']:.2f}",
                      len=f"{metrics['response_len_mean']:.0f}", step_s=f"{metrics['step_s']:.1f}",
                      accept=accept_shown(metrics))
  bar.close()

  # ---------------------------------------------------------------- export and summary
  if step >= end and rl.export:  # Hugging Face layout
    job.export(save_hf_checkpoint, job.path("export", "policy"), run.params, cfg, tokenizer)
    for name, d in trained.items():
      job.export(save_drafter, job.path("export", name), name, d.settings,
                 spot.params[name] if spot is not None else d.params, cfg)
  return write_summary(workdir, log.rows["metrics"], config, wall_s=job.wall_s,
                       stopped_early=step < end, evals=log.rows["eval"], write=job.writer,
                       extra={"time_limited": end < rl.steps, **job.compiles(),
                              "compile_bill": merge_bills(pools),
                              **({"compile_bill_control": merge_bills([control.pool])}
                                 if control is not None else {})})


def _compile_plan(config, engine, updater, params, sampling, say) -> None:
  """rollout.compile_plan: every program of a step's rollout, and its update when
  rl.update_widths gives it one shape, compiled ahead on rollout.compile_threads threads
  before the first step (the step then waits for none)."""
  r, rl = config.rollout, config.rl
  set_compile_threads(r.compile_threads)
  t0 = time.perf_counter()
  engine.compile_plan(sampling, rl.prompts_per_step, rl.num_samples)
  if rl.update_widths:
    updater.compile_ahead(params, rl.prompts_per_step * rl.num_samples, engine.capacity,
                          rollout_logps=True)  # the steps pass the rollout's log-probs
  wait_for_compiles_ahead()
  pools = [engine.pool.report(), updater.pool.report()]
  say(f"compiled {sum(p['ahead_compiles'] for p in pools)} programs of a step in "
      f"{time.perf_counter() - t0:.1f} s on {r.compile_threads} thread(s) "
      f"({sum(p['ahead_s'] for p in pools):.1f} s of compiling)")


class _RunState:
  """What a checkpoint holds: the policy and its optimizer state, the drafter's train state,
  the prompt position and the tuner's state."""

  def __init__(self, params, updater: PolicyUpdater, spot, engine, prompts_iter):
    self.params, self.updater, self.spot = params, updater, spot
    self.engine, self.prompts_iter = engine, prompts_iter

  def tree(self) -> dict:
    tree = {"policy": self.params, "opt_state": self.updater.opt_state}
    if self.spot is not None:
      tree["drafter"] = {k: getattr(self.spot.state, k) for k in ("params", "opt_state", "step")}
    return tree

  def save(self, ckpt: Checkpointer, step: int) -> None:
    meta = {"step": step, "iterator": self.prompts_iter.state_dict()}
    if self.engine.tuner is not None:
      meta["tuner"] = self.engine.tuner.state_dict()
    ckpt.save(step, self.tree(), meta)

  def restore(self, ckpt: Checkpointer) -> int:
    """Loads the newest loadable checkpoint; returns its step (0: none)."""
    restored = ckpt.restore_latest(self.tree())
    if restored is None:
      return 0
    step, tree, meta = restored
    self.params, self.updater.opt_state = tree["policy"], tree["opt_state"]
    self.prompts_iter.load_state_dict(meta["iterator"])
    if self.engine.tuner is not None and "tuner" in meta:
      self.engine.tuner.load_state_dict(meta["tuner"])
    if self.spot is not None:
      self.spot.state = self.spot.state.replace(**tree["drafter"])
    return step


RUN_FILES = ("metrics.jsonl", "eval.jsonl", "rollouts.jsonl", "summary.json", "summary.png",
             "export", TENSORBOARD_DIR, "wandb")


def _start_fresh(workdir: str, failures: list, start_over: bool, say, also=()) -> None:
  """No checkpoint loaded. If the folder holds an earlier run's results, refuse to overwrite
  them (ConfigError saying what failed), or with start_over move them (and the files named
  in `also`) aside first."""
  done = steps_done(workdir)
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
  for name in (*RUN_FILES, *also):
    if os.path.exists(os.path.join(workdir, name)):
      shutil.move(os.path.join(workdir, name), os.path.join(previous, name))
  say(f"--start_over: no checkpoint could be loaded ({failed}); the earlier run's files are "
      f"in {previous}; starting from step 0")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = cli.load_config(_CONFIG)
  cli.setup_devices(config)
  summary = train(config, _WORKDIR.value, start_over=_START_OVER.value)
  if summary["stopped_early"]:
    exit_stopped(f"after step {summary['steps_done']} of {config.rl.steps}")
  if summary["time_limited"]:  # evaluated and exported; the rerun goes on to rl.steps
    exit_stopped(f"after step {summary['steps_done']} of {config.rl.steps}",
                 f"rl.max_minutes={config.rl.max_minutes} ended the job")


def run():
  """Console-script entry point (`tlt-train`)."""
  cli.run_main(main)


if __name__ == "__main__":
  run()
