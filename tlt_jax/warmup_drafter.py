"""Offline drafter warm-up before RL (the EAGLE warm-up stage), for every trained drafter the
run uses.

  python -m tlt_jax.warmup_drafter --config configs/default.py --workdir runs/warmup

The policy (model.path) answers `drafter.warmup.num_prompts` training prompts of the task at
drafter.warmup.temperature; the run's trained drafters (`components.run_drafters`: EAGLE for
the default arms; each from its section drafter.<name>, random init) train together on the
policy's own features of those responses. With drafter.eagle.draft_vocab_size > 0 EAGLE's
draft vocabulary is the tokens most frequent in those responses. The accept length is
measured with rollout.speculative.strategy, whose drafters must be the run's. Outputs in
WORKDIR:

  generations.jsonl   the policy's responses (reused by a rerun with the same prompts, model
                      and sampling settings, which generations.jsonl.json records)
  checkpoints/        orbax checkpoints of the drafter train state (a rerun resumes)
  metrics.jsonl       loss, top-1 agreement and grad norm per step
  eval.jsonl          the greedy SD accept length on held-out prompts (at the last step)
  export/<name>/      each trained drafter in HF layout (config.json naming its family +
                      model.safetensors; EAGLE's in EAGLE's layout); point
                      drafter.<name>.path at it
  summary.json        losses, and the greedy SD accept length on held-out prompts of the
                      untrained and the warmed drafter
"""

from __future__ import annotations

import contextlib
import json
import os

import jax
import numpy as np
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import config_flags

from tlt_jax.components import (check_prompt_lengths, configured_strategy, drafter_opt_config,
                                load_drafters_for, load_policy, load_tokenizer_for, make_engine,
                                run_drafters, task_prompts)
from tlt_jax.config import ConfigError, flat_settings
from tlt_jax.drafters import drafter_class, make_drafter, trained_drafters
from tlt_jax.job import Job, SetupStopped, run_job
from tlt_jax.drafter_training.train_step import init_train_state
from tlt_jax.drafter_training.warmup import (cached_responses, collect_samples, read_responses,
                                             train_drafter)
from tlt_jax.mesh import make_mesh, to_mesh
from tlt_jax.drafters.io import save_drafter
from tlt_jax.rollout.engine import GenerationStopped, accept_length
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.tuner import FixedTuner

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/warmup_drafter", "Output folder (resumes).")


def _warmup(config, job: Job) -> bool:
  """The job; True when a signal stopped it (after a checkpoint) before its last step."""
  w = config.drafter.warmup
  strategy = config.rollout.speculative.strategy
  used = run_drafters(config)
  if not any(drafter_class(n).trained for n in used):
    trainable = list(trained_drafters())
    raise ConfigError(f"the run uses no trained drafter (its drafters: {list(used)}), so there "
                      f"is nothing to warm; name one of {trainable} in "
                      f"rollout.speculative.arms or drafter.names")
  if missing := [n for n in configured_strategy(config).drafts if n not in used]:
    raise ConfigError(f"rollout.speculative.strategy={strategy!r} (the warm-up's accept-length "
                      f"check) drafts with {missing}, which the run does not use (its drafters: "
                      f"{list(used)}); set it to a strategy of the run's drafters")

  # ---------------------------------------------------------------- policy and prompts
  mesh = make_mesh(dict(config.mesh.axes))
  job.phase(f"mesh {dict(mesh.shape)} on {jax.device_count()} devices; loading the "
            f"tokenizer, policy and prompts")
  tokenizer = load_tokenizer_for(config)
  check_prompt_lengths(config, tokenizer)
  cfg, params = load_policy(config, mesh)
  _, prompts = task_prompts(config, tokenizer, w.num_prompts)
  _, eval_prompts = task_prompts(config, tokenizer, w.num_eval_prompts, eval_split=True)
  eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0

  # ---------------------------------------------------------------- the policy's responses
  if w.responses:
    job.phase(f"the policy's responses in {w.responses}")
    try:
      repeated, completions = read_responses(w.responses)
    except ValueError as e:
      raise ConfigError(f"drafter.warmup.responses: {e}") from None
    job.say(f"read {len(completions)} responses ({sum(map(len, completions))} tokens)")
  else:
    job.phase(f"the policy's responses to {len(prompts)} prompts x {w.samples_per_prompt}, "
              f"up to {w.max_new_tokens} tokens each (compiling the rollout's programs "
              f"first), or those a like run left in {job.path('generations.jsonl')}")
    engine = make_engine(config, cfg, params, mesh, eos, pad, max_new_tokens=w.max_new_tokens)
    try:
      completions = cached_responses(
          engine, prompts, w.samples_per_prompt, w.temperature, config.seed,
          job.path("generations.jsonl"), job,
          made_by={**{k: v for k, v in flat_settings(config).items()
                      if k.startswith("model.")}, "max_new_tokens": w.max_new_tokens},
          should_stop=lambda: job.stop.requested)
    except GenerationStopped as e:  # nothing is cached: a rerun generates them again
      raise SetupStopped(f"while generating the responses ({e})") from None
    repeated = [p for p in prompts for _ in range(w.samples_per_prompt)]
  job.phase(f"the policy's features of the {len(completions)} responses")
  samples = collect_samples(params, cfg, repeated, completions,
                            progress=job.writer and job.show_progress)

  # ---------------------------------------------------------------- train, with checkpoints
  job.phase(f"training {', '.join(n for n in used if drafter_class(n).trained)} for "
            f"{w.steps} steps (compiling the update first)")
  drafters = load_drafters_for(config, cfg, fresh=True)
  settings = {n: d.settings for n, d in drafters.items() if d.trained}
  # Fresh weights adapted to the responses (e.g. EAGLE-3's draft vocabulary).
  init_params = {n: type(d).warm_start(d.settings, d.params, params, cfg, completions, job.say)
                 for n, d in drafters.items() if d.trained}
  untrained = jax.device_get(init_params)  # host copy: training donates the device arrays
  oc = drafter_opt_config(config, warmup=True)
  # Replicated on the policy's mesh, where the step runs: a restore takes these shardings
  # (unplaced, it came back committed to one device, which the step refused beside the policy).
  state = init_train_state(init_params, oc)
  state = to_mesh(state, jax.tree.map(lambda _: NamedSharding(mesh, P()), state))
  ckpt = job.checkpointer(config)
  resumed, state, _ = ckpt.restore_latest(state) or (0, state, None)
  if resumed:  # checkpoints are saved after a step, never at step 0
    job.say(f"resumed the drafter from step {resumed}")
  log = job.run_log(resume_step=resumed, config=config)
  first = int(state.step)

  time_up = []  # the step at which drafter.warmup.max_minutes ran out, once it has

  def on_step(step, st, metrics):
    log.write("metrics", [{"step": step, **metrics}])
    if job.last_step(step, w.steps, "drafter.warmup.max_minutes") < w.steps:
      time_up.append(step)
    if step == w.steps or job.stop.requested or time_up or (w.checkpoint_every and
                                                            step % w.checkpoint_every == 0):
      ckpt.save(step, st, {"step": step})

  t0 = job.wall_s
  with log:
    with contextlib.closing(ckpt):  # a save in flight is finished, also on an error
      dparams, history = train_drafter(init_params, params, samples, cfg, settings, oc, w.steps,
                                       window=w.window, batch_rows=w.batch_rows,
                                       seed=config.seed, state=state, on_step=on_step,
                                       progress=job.writer and job.show_progress,
                                       should_stop=lambda: job.stop.requested or time_up)
    train_s = job.wall_s - t0
    steps = first + len(history)
    if steps < w.steps and not time_up:  # stopped by a signal, after its checkpoint
      return True

    # -------------------------------------------------------------- held-out accept length
    job.phase(f"the greedy SD accept length on {len(eval_prompts)} held-out prompts, strategy "
              f"{strategy} (compiling its programs first)")
    accept = {}
    for label, weights in (("untrained", untrained), ("warmed", dparams)):
      with_weights = {n: make_drafter(n, d.settings, weights[n]) if d.trained else d
                      for n, d in drafters.items()}
      sd_engine = make_engine(config, cfg, params, mesh, eos, pad, drafters=with_weights,
                              speculative=True, tuner=FixedTuner(strategy),
                              sd_threshold=config.rollout.max_batch,
                              max_new_tokens=w.max_new_tokens,
                              compile_ahead=False)  # every call SD: what is measured
      accept[label] = accept_length(sd_engine.generate(eval_prompts, 1, SamplingParams(0.0),
                                                      jax.random.key(0)))
    if not any(row["step"] == steps for row in log.rows["eval"]):  # a rerun of a finished job
      log.write("eval", [{"step": steps, "accept_len_untrained": accept["untrained"],
                          "accept_len_warmed": accept["warmed"]}])
  job.say(f"greedy SD accept length on {len(eval_prompts)} held-out prompts, strategy "
          f"{strategy}: untrained {accept['untrained']:.2f}, warmed {accept['warmed']:.2f}")

  # ---------------------------------------------------------------- export
  summary = {
      "steps": steps, "time_limited": steps < w.steps, "train_s": train_s, "wall_s": job.wall_s,
      "responses": len(completions), "response_tokens": int(sum(map(len, completions))),
      "loss_first": history[0]["loss"] if history else None,
      "loss_last": float(np.mean([h["loss"] for h in history[-20:]])) if history else None,
      "top1_last": float(np.mean([h["top1"] for h in history[-20:]])) if history else None,
      "accept_len_untrained": accept["untrained"], "accept_len_warmed": accept["warmed"],
      "strategy": strategy, **job.compiles(), "config": json.loads(config.to_json())}
  for name in settings:
    job.export(save_drafter, job.path("export", name), name, settings[name], dparams[name], cfg,
               metadata={"warmup": {k: summary[k] for k in (
                   "steps", "responses", "loss_last", "top1_last", "accept_len_untrained",
                   "accept_len_warmed", "strategy")}})
  job.write_json("summary.json", summary)
  passed = " ".join(f"--config.drafter.{name}.path={os.path.abspath(job.path('export', name))}"
                    for name in settings)
  job.say(f"exported {', '.join(settings)} in {summary['wall_s']:.0f} s; an RL run loads "
          f"{'it' if len(settings) == 1 else 'them'} with {passed}")
  return False


def run():
  """Console-script entry point (`tlt-warmup-drafter`)."""
  run_job(_CONFIG, _WORKDIR, _warmup, "warmup_drafter",
          max_minutes=lambda config: config.drafter.warmup.max_minutes)


if __name__ == "__main__":
  run()
