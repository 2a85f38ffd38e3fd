"""Supervised fine-tuning of a policy on the built-in task's worked solutions.

  python -m tlt_jax.sft --config configs/tiny_sft.py --workdir runs/tiny_sft

Trains (or loads) a tokenizer, packs chat-formatted (prompt, solution) pairs into fixed
[rows, seq_len] batches, and trains with the loss on response tokens only. Checkpoints go to
WORKDIR/checkpoints (params, optimizer state, step, data position); a rerun with the same workdir
resumes from the latest one. Held-out greedy accuracy is printed every `sft.eval_every` steps and
at the end; the final policy and tokenizer are exported in Hugging Face layout to WORKDIR/export.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import app, flags, logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import config_flags
from tqdm import tqdm

from tlt_jax import cli
from tlt_jax.config import model_config, task_from_config, training_model_config
from tlt_jax.mesh import logical_to_mesh_spec, make_mesh, shard_pytree
from tlt_jax.optim import init_optimizer
from tlt_jax.models import ModelConfig, forward, init_params, param_logical_axes
from tlt_jax.models.attention_inputs import packed_inputs
from tlt_jax.rl.data import PromptIterator
from tlt_jax.rl.evaluate import evaluate
from tlt_jax.rl.packing import next_packed_batch
from tlt_jax.rl.tasks import ArithmeticTask, TaskSlice
from tlt_jax.rl.tokenizer import prompt_ids, response_ids, train_tokenizer

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_sft.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/sft", "Output folder (resumes from it).")


# ---------------------------------------------------------------- pieces used by tests too


def make_task(config: ml_collections.ConfigDict, eval_split: bool = False) -> ArithmeticTask:
  """The task of `config.task`: training problems, or held-out ones (task.eval_seed)."""
  return task_from_config(config.task, eval_split)


def get_tokenizer(config: ml_collections.ConfigDict, workdir: str):
  """tokenizer.path if set; else the tokenizer saved in WORKDIR/tokenizer by an earlier run
  (so a resumed run keeps its token ids); else a new BPE trained on training problems."""
  from tlt_jax.models.hf import load_tokenizer
  if config.tokenizer.path:
    return load_tokenizer(config.tokenizer.path)
  saved = os.path.join(workdir, "tokenizer")
  if os.path.isdir(saved):
    return load_tokenizer(saved)
  examples = make_task(config).examples(config.tokenizer.num_train_examples)
  tok = train_tokenizer([e.prompt for e in examples] + [e.solution for e in examples],
                        config.tokenizer.vocab_size)
  tok.save_pretrained(saved)
  return tok


def make_optimizer(s: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW with linear warm-up and cosine decay, after global-norm gradient clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=s.learning_rate, warmup_steps=s.warmup_steps,
      decay_steps=s.steps, end_value=s.learning_rate * s.end_lr_fraction)
  return optax.chain(
      optax.clip_by_global_norm(s.grad_clip) if s.grad_clip > 0 else optax.identity(),
      optax.adamw(schedule, b1=s.b1, b2=s.b2, weight_decay=s.weight_decay,
                  mask=_decay_mask))


def _decay_mask(params: dict) -> dict:
  """Weight decay on matrices (embeddings, kernels), not on norm weights or biases."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  treedef = jax.tree.structure(params)
  keep = [not any(getattr(k, "key", None) in ("bias", "weight") for k in path)
          for path, _ in flat]
  return jax.tree.unflatten(treedef, keep)


def sft_loss(params: dict, batch: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """Mean next-token cross-entropy over response targets of a packed batch.

  Args:
    batch: arrays [R, S] from `tlt_jax.rl.packing` (tokens, targets, loss_mask, positions,
      segment_ids).
  Returns:
    (loss, number of target tokens), float32 scalars.
  """
  # No cache: packed rows attend only within themselves through the segment mask.
  attn = packed_inputs(batch["segment_ids"], batch["positions"])
  logits, _, _, _ = forward(params, batch["tokens"], attn, cfg)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  weight = batch["loss_mask"]
  count = jnp.sum(weight)
  return jnp.sum(ce * weight) / jnp.maximum(count, 1.0), count


def make_train_step(cfg: ModelConfig, tx: optax.GradientTransformation, param_sharding,
                    opt_sharding):
  """The jitted update: (params, opt_state, batch) -> (params, opt_state, metrics); the old
  params and optimizer state are donated."""

  @functools.partial(jax.jit, donate_argnums=(0, 1),
                     out_shardings=(param_sharding, opt_sharding, None))
  def train_step(params, opt_state, batch):
    (loss, count), grads = jax.value_and_grad(sft_loss, has_aux=True)(params, batch, cfg)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    return params, opt_state, {"loss": loss, "grad_norm": grad_norm, "target_tokens": count}

  return train_step


def _encoder(tokenizer):
  def encode(example):
    return prompt_ids(tokenizer, example.prompt), response_ids(tokenizer, example.solution)
  return encode


def _print_eval(step: int, result: dict) -> None:
  by = result["accuracy_by_steps"]
  short = sum(c for n, (c, _) in by.items() if n <= 3) / max(
      sum(t for n, (_, t) in by.items() if n <= 3), 1)
  long_ = sum(c for n, (c, _) in by.items() if n > 3) / max(
      sum(t for n, (_, t) in by.items() if n > 3), 1)
  tqdm.write(f"step {step}: held-out greedy accuracy {result['accuracy']:.3f} on "
             f"{result['num_examples']} problems (<= 3 steps {short:.3f}, > 3 steps "
             f"{long_:.3f}); mean completion {np.mean(result['lengths']):.1f} tokens")


# ---------------------------------------------------------------- main


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  config = cli.load_config(_CONFIG)
  num_devices = cli.setup_devices(config)
  workdir = _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  s = config.sft
  started = time.perf_counter()

  # ---------------------------------------------------------------- mesh
  mesh = make_mesh(dict(config.mesh.axes))
  rules = tuple(config.mesh.rules)
  batch_spec = logical_to_mesh_spec(P("batch", None), (s.rows, s.seq_len), mesh, rules)
  data_ways = int(np.prod([mesh.shape[a] for a in ("replica", "fsdp") if a in mesh.shape]))
  if s.rows % data_ways:
    raise SystemExit(f"config error: sft.rows={s.rows} must be a multiple of the data-parallel "
                     f"devices (replica x fsdp = {data_ways})")
  batch_sharding = NamedSharding(mesh, batch_spec)

  # ---------------------------------------------------------------- data
  tokenizer = get_tokenizer(config, workdir)
  cfg = model_config(config)
  if len(tokenizer) > cfg.vocab_size:
    raise SystemExit(f"config error: the tokenizer has {len(tokenizer)} tokens but "
                     f"model.vocab_size={cfg.vocab_size}; set model.vocab_size >= "
                     f"{len(tokenizer)}")
  train_set = TaskSlice(make_task(config), s.num_train_examples)
  eval_set = make_task(config, eval_split=True).examples(s.num_eval_examples)
  iterator = PromptIterator(train_set, seed=config.seed)
  encode = _encoder(tokenizer)

  # ---------------------------------------------------------------- model and optimizer
  logical = param_logical_axes(cfg)
  if config.model.path:
    from tlt_jax.models.hf import load_hf_params
    params = load_hf_params(config.model.path, cfg, mesh, rules)
  else:
    params = shard_pytree(init_params(cfg, jax.random.key(config.seed)), logical, mesh, rules)
  param_sharding = jax.tree.map(lambda x: x.sharding, params)
  tx = make_optimizer(s)
  opt_state, opt_sharding = init_optimizer(tx, params, mesh)
  train_step = make_train_step(training_model_config(config, cfg), tx, param_sharding,
                               opt_sharding)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"mesh {dict(mesh.shape)} on {num_devices} devices; policy {cfg.num_layers} layers, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size} ({len(tokenizer)} used), "
        f"{num_params / 1e6:.2f}M params")

  # ---------------------------------------------------------------- checkpoint
  manager = ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, "checkpoints")),
      options=ocp.CheckpointManagerOptions(max_to_keep=s.keep_checkpoints, create=True))
  step = 0
  if manager.latest_step() is not None:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            {"params": params, "opt_state": opt_state})
    restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
    params, opt_state = restored.state["params"], restored.state["opt_state"]
    step = int(restored.data["step"])
    iterator.load_state_dict(restored.data["iterator"])
    print(f"resumed from step {step} (data position {iterator.state_dict()})")

  def save(step):
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        data=ocp.args.JsonSave({"step": step, "iterator": iterator.state_dict()})))

  def run_eval(step):
    result = evaluate(params, cfg, tokenizer, eval_set, s.eval_max_new_tokens,
                      s.eval_batch_size)
    _print_eval(step, result)
    return result

  # ---------------------------------------------------------------- loop
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  bar = tqdm(total=s.steps, initial=step, desc="sft", unit="step")
  pending = None
  with open(metrics_path, "a") as metrics_file:
    while step < s.steps:
      batch, _ = next_packed_batch(iterator, encode, s.rows, s.seq_len,
                                   pad_id=tokenizer.pad_token_id)
      batch = jax.device_put(batch, batch_sharding)
      params, opt_state, metrics = train_step(params, opt_state, batch)
      step += 1
      bar.update(1)
      if step % s.log_every == 0 or step == s.steps:
        pending = {k: float(v) for k, v in metrics.items()}
        bar.set_postfix(loss=f"{pending['loss']:.4f}")
        metrics_file.write(json.dumps({"step": step, **pending}) + "\n")
        metrics_file.flush()
      if s.checkpoint_every and step % s.checkpoint_every == 0 and step < s.steps:
        save(step)
      if s.eval_every and step % s.eval_every == 0 and step < s.steps:
        run_eval(step)
  bar.close()
  if manager.latest_step() != step:  # a rerun of a finished job has nothing new to save
    save(step)
  manager.wait_until_finished()
  train_s = time.perf_counter() - started

  # ---------------------------------------------------------------- final eval and export
  result = run_eval(step)
  export_dir = os.path.join(workdir, "export")
  from tlt_jax.models.hf import save_hf_checkpoint
  export_cfg = cfg.replace(param_dtype=s.export_dtype)
  export_params = jax.tree.map(lambda x: x.astype(export_cfg.jnp_param_dtype), params)
  save_hf_checkpoint(export_dir, export_params, export_cfg, tokenizer)
  summary = {"step": step, "final_loss": pending["loss"] if pending else None,
             "heldout_greedy_accuracy": result["accuracy"],
             "heldout_examples": result["num_examples"],
             "heldout_accuracy_by_steps": {str(k): v for k, v in
                                           result["accuracy_by_steps"].items()},
             "heldout_mean_completion_tokens": float(np.mean(result["lengths"])),
             "wall_s": time.perf_counter() - started, "train_s_incl_compile": train_s,
             "num_params": int(num_params), "devices": num_devices,
             "config": json.loads(config.to_json())}
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  with open(os.path.join(export_dir, "sft_summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(f"exported to {export_dir}; held-out greedy accuracy {result['accuracy']:.3f}; "
        f"{summary['wall_s']:.0f} s")


def run():
  """Console-script entry point (`tlt-sft`)."""
  app.run(main, flags_parser=cli.parse_flags)


if __name__ == "__main__":
  run()
