"""Supervised fine-tuning of a policy on the built-in task's worked solutions.

  python -m tlt_jax.sft --config configs/tiny_sft.py --workdir runs/tiny_sft

Trains (or loads) a tokenizer, packs chat-formatted (prompt, solution) pairs into fixed
[rows, seq_len] batches, and trains with the loss on response tokens only. Checkpoints go to
WORKDIR/checkpoints (params, optimizer state, step, data position); a rerun with the same workdir
resumes from the latest one. Losses go to WORKDIR/metrics.jsonl; held-out greedy accuracy, every
`sft.eval_every` steps and at the end, is printed and goes to WORKDIR/eval.jsonl; the final
policy and tokenizer are exported in Hugging Face layout to WORKDIR/export.
"""

from __future__ import annotations

import contextlib
import json

import jax
import numpy as np
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import config_flags

from tlt_jax.components import (check_prompt_lengths, load_policy, make_engine,
                                sft_tokenizer, task_from_config, training_model_config)
from tlt_jax.config import ConfigError
from tlt_jax.job import Job, check_profile_window, run_job
from tlt_jax.mesh import data_parallel_size, logical_to_mesh_spec, make_mesh, on_mesh
from tlt_jax.models.hf import save_hf_checkpoint
from tlt_jax.optim import init_optimizer
from tlt_jax.rl.data import PromptIterator
from tlt_jax.rl.evaluate import evaluate
from tlt_jax.rl.packing import next_packed_batch
from tlt_jax.rl.tasks import TaskSlice
from tlt_jax.rl.tokenizer import prompt_ids, response_ids
from tlt_jax.sft_update import make_optimizer, make_train_step
from tlt_jax.speculative.sampling import SamplingParams

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_sft.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/sft", "Output folder (resumes from it).")


def _eval_line(step: int, result: dict) -> str:
  def accuracy(over_3_ops: bool) -> float:
    cells = [cell for n, cell in result["accuracy_by"].items() if (n > 3) == over_3_ops]
    return sum(c for c, _ in cells) / max(sum(t for _, t in cells), 1)
  return (f"step {step}: held-out greedy accuracy {result['accuracy']:.3f} on "
          f"{result['num_examples']} problems (<= 3 operations {accuracy(False):.3f}, > 3 "
          f"operations {accuracy(True):.3f}); mean completion "
          f"{np.mean(result['lengths']):.1f} tokens")


def _sft(config, job: Job) -> bool:
  """The job; True when a signal stopped it (after a checkpoint) before sft.steps."""
  s, num_devices = config.sft, jax.device_count()
  check_profile_window(config, s.steps, "sft.steps")
  task = task_from_config(config)
  if task.example(0).solution is None:
    raise ConfigError(f"SFT trains on worked solutions, which task.name={config.task.name!r} "
                      f"does not have; fine-tune on the arithmetic task, or train with RL "
                      f"(python -m tlt_jax.train)")

  # ---------------------------------------------------------------- mesh and data
  mesh = make_mesh(dict(config.mesh.axes))
  rules = tuple(config.mesh.rules)
  data_ways = data_parallel_size(mesh)
  if s.rows % data_ways:
    raise ConfigError(f"sft.rows={s.rows} must be a multiple of the data-parallel devices "
                      f"(replica x fsdp = {data_ways})")
  batch_sharding = NamedSharding(mesh, logical_to_mesh_spec(P("batch", None),
                                                            (s.rows, s.seq_len), mesh, rules))
  job.phase(f"mesh {dict(mesh.shape)} on {num_devices} devices; the tokenizer (trained on the "
            f"task unless tokenizer.path is set) and the policy")
  tokenizer = sft_tokenizer(config, job.workdir, write=job.writer)
  check_prompt_lengths(config, tokenizer, data_files=False)  # the held-out evaluation decodes
  iterator = PromptIterator(TaskSlice(task, s.num_train_examples), seed=config.seed)
  eval_set = task_from_config(config, eval_split=True).examples(s.num_eval_examples)

  def encode(example):
    return prompt_ids(tokenizer, example.prompt), response_ids(tokenizer, example.solution)

  # ---------------------------------------------------------------- model and optimizer
  cfg, params = load_policy(config, mesh)
  if len(tokenizer) > cfg.vocab_size:
    raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but model.vocab_size="
                      f"{cfg.vocab_size}; set model.vocab_size >= {len(tokenizer)}")
  tx = make_optimizer(config)
  opt_state, opt_sharding = init_optimizer(tx, params, mesh)
  train_step = make_train_step(training_model_config(config, cfg), tx,
                               jax.tree.map(lambda x: x.sharding, params), opt_sharding)
  # Held-out accuracy with the rollout engine (one slice: the whole mesh), greedy.
  engine = make_engine(config, cfg, params, mesh, tokenizer.eos_token_id,
                       tokenizer.pad_token_id or 0, max_batch=s.eval_batch_size,
                       max_new_tokens=s.eval_max_new_tokens)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  job.say(f"mesh {dict(mesh.shape)} on {num_devices} devices; policy {cfg.num_layers} layers, "
          f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size} ({len(tokenizer)} used), "
          f"{num_params / 1e6:.2f}M params")

  # ---------------------------------------------------------------- checkpoint and log
  ckpt = job.checkpointer(config, s.keep_checkpoints)
  step = 0
  restored = ckpt.restore_latest({"params": params, "opt_state": opt_state})
  if restored is not None:
    step, tree, meta = restored
    params, opt_state = tree["params"], tree["opt_state"]
    iterator.load_state_dict(meta["iterator"])
    job.say(f"resumed from step {step} (data position {iterator.state_dict()})")
  log = job.run_log(resume_step=step, config=config)

  def save(step):
    ckpt.save(step, {"params": params, "opt_state": opt_state},
              {"step": step, "iterator": iterator.state_dict()})

  def run_eval(step):
    engine.update_params(policy_params=params)  # the update donates the previous params
    result = evaluate(engine, tokenizer, eval_set, SamplingParams(0.0), breakdown=task.breakdown)
    job.say(_eval_line(step, result))
    if not any(row["step"] == step for row in log.rows["eval"]):  # a rerun of a finished job
      log.write("eval", [{"step": step, "greedy_accuracy": result["accuracy"],
                          "greedy_accuracy_by": {str(k): v for k, v in
                                                 result["accuracy_by"].items()},
                          "greedy_response_len_mean": result["response_len_mean"],
                          "accuracy": result["accuracy"]}])
    return result

  # ---------------------------------------------------------------- loop
  job.phase(f"SFT steps {step + 1} to {s.steps} (the first compiles the update)"
            if step < s.steps else f"the evaluation and export after the {s.steps} steps done")
  bar = job.progress(total=s.steps, initial=step, desc="sft", unit="step")
  last, end = None, s.steps  # end: the last step, earlier when sft.max_minutes runs out
  with log, contextlib.closing(ckpt):  # a save in flight is finished, also on an error
    while step < end and not job.stop.requested:
      batch, _ = next_packed_batch(iterator, encode, s.rows, s.seq_len,
                                   pad_id=tokenizer.pad_token_id)
      # The attention kernel, where a short row takes it, per shard; profile.* traces steps.
      with on_mesh(mesh), job.traced(step + 1, lambda: metrics):
        params, opt_state, metrics = train_step(params, opt_state,
                                                jax.device_put(batch, batch_sharding))
      step += 1
      bar.update(1)
      end = job.last_step(step, end, "sft.max_minutes")
      if step % s.log_every == 0 or step == end:
        last = {k: float(v) for k, v in metrics.items()}
        bar.set_postfix(loss=f"{last['loss']:.4f}")
        log.write("metrics", [{"step": step, **last}])
      if s.checkpoint_every and step % s.checkpoint_every == 0 and step < end:
        save(step)
      if s.eval_every and step % s.eval_every == 0 and step < end:
        run_eval(step)
    bar.close()
    if ckpt.latest_step != step:  # a rerun of a finished job has nothing new to save
      save(step)
    if step < end:  # stopped by a signal, after its checkpoint
      return True
    train_s = job.wall_s

    # -------------------------------------------------------------- final eval and export
    result = run_eval(step)
  export_dir = job.path("export")
  export_cfg = cfg.replace(param_dtype=s.export_dtype)
  job.export(save_hf_checkpoint, export_dir, jax.tree.map(
      lambda x: x.astype(export_cfg.jnp_param_dtype), params), export_cfg, tokenizer)
  summary = {"step": step, "time_limited": step < s.steps,
             "final_loss": last["loss"] if last else None,
             "heldout_greedy_accuracy": result["accuracy"],
             "heldout_examples": result["num_examples"],
             "heldout_accuracy_by_ops": {str(k): v for k, v in result["accuracy_by"].items()},
             "heldout_mean_completion_tokens": result["response_len_mean"],
             "wall_s": job.wall_s, "train_s_incl_compile": train_s,
             "num_params": int(num_params), "devices": num_devices, **job.compiles(),
             "config": json.loads(config.to_json())}
  job.write_json("summary.json", summary)
  job.write_json("sft_summary.json", summary, folder=export_dir)
  job.say(f"exported to {export_dir}; held-out greedy accuracy {result['accuracy']:.3f}; "
          f"{summary['wall_s']:.0f} s")
  return False


def run():
  """Console-script entry point (`tlt-sft`)."""
  run_job(_CONFIG, _WORKDIR, _sft, "sft", max_minutes=lambda config: config.sft.max_minutes)


if __name__ == "__main__":
  run()
