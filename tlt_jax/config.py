"""The configuration schema shared by every `configs/*.py` file, and the checks of its keys
and of the values that no component's own dataclass checks.

Config files start from `base_config()`, change values, and return it locked, so a typo in a
key fails where it is written ("Did you mean ...?"). `tlt_jax.components.validate_config`
runs `check_config` and then builds every component, whose dataclasses check their own
ranges, before anything is compiled.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import sys

import ml_collections

from tlt_jax.drafter_training.spot import SpotConfig
from tlt_jax.drafter_training.train_step import DrafterOptConfig
from tlt_jax.drafters import DRAFTERS
from tlt_jax.drafters.io import check_family, read_drafter_config
from tlt_jax.kernels import ATTENTION_IMPLS
from tlt_jax.knobs import ConfigError, defaults_of
from tlt_jax.mesh import DEFAULT_RULES, ROLLOUT_RULES, resolve_axis_sizes
from tlt_jax.metric_writers import PACKAGES, missing_package
from tlt_jax.models.config import DTYPES, MODEL_TYPES, NUMERICS
from tlt_jax.models.hf import check_model_folder, check_safetensors
from tlt_jax.rl.algorithms import ALGORITHMS
from tlt_jax.rl.loss import LossConfig
from tlt_jax.rl.policy_update import check_micro_batch_rows
from tlt_jax.rl.tasks import TASKS, ArithmeticTask
from tlt_jax.speculative.sampling import SamplingParams

# Which forward passes run the layers as a lax.scan (see model.scan_layers below).
SCAN_LAYERS = ("none", "train", "all")


# Keys renamed so that each concept has one name (old -> new). A command line or an override
# that uses an old key still works, with a warning; a config file is told the new name.
RENAMED_KEYS = {
    "drafter.fused_layers": "drafter.eagle.feature_layers",
    # EAGLE's knobs moved into its own section when drafters became families.
    **{f"drafter.{k}": f"drafter.eagle.{k}" for k in (
        "num_layers", "use_features", "intermediate_size", "norm_input", "norm_output",
        "feature_layers", "draft_vocab_size", "path")},
    "drafter.clip_norm": "drafter.grad_clip",
    "drafter.train_steps_ahead": "drafter.train_depth",
    "sft.warmup_steps": "sft.lr_warmup_steps",
    "rollout.steps_per_call": "rollout.iterations_per_call",
    "task.min_steps": "task.min_ops",
    "task.max_steps": "task.max_ops",
}


def current_key(dotted: str) -> str:
  """A config key's current name: a renamed key's new one (saying so on stderr)."""
  new = RENAMED_KEYS.get(dotted)
  if new:
    print(f"warning: config key {dotted} is now {new}", file=sys.stderr)
  return new or dotted


def with_current_keys(section: str, values: dict) -> dict:
  """A config section as an older run saved it (its summary.json's), with the keys renamed
  since under their current names."""
  return {RENAMED_KEYS.get(f"{section}.{k}", k).rpartition(".")[2]: v for k, v in values.items()}


def renamed_hint(message: str) -> str:
  """'; X is now Y' for each renamed key whose last part an error message names in quotes
  ('' for none): appended to the errors of config files that set an old key."""
  return "".join(f"; {old} is now {new}" for old, new in RENAMED_KEYS.items()
                 if any(f"{q}{old.rpartition('.')[2]}{q}" in message for q in "'\""))


# Settings a rerun of a job in the same workdir may change alone: they extend the run, limit
# or watch it, and never decide an array's shape (a checkpoint's refusal does not name them).
RERUN_SETTINGS = ("rl.steps", "rl.max_minutes", "sft.steps", "sft.max_minutes",
                  "drafter.warmup.steps", "drafter.warmup.max_minutes", "profile.first_step",
                  "profile.num_steps", "logging.tensorboard", "logging.wandb",
                  "logging.wandb_project")


class RunStopped(RuntimeError):
  """The run cannot go on (e.g. a non-finite update); the message says why, at which step,
  and what on disk is intact."""


def base_config() -> ml_collections.ConfigDict:
  """Every knob with its default. Sections grow as subsystems land."""
  c = ml_collections.ConfigDict()
  # The run's randomness: random weights, prompt order, every sampled token (with the RL step),
  # drafter batches and the tuner's exploration. Problems are task.seed's.
  c.seed = 0
  # Plug-ins: modules of your own that register drafters, algorithms or tasks
  # (@register_drafter / @register_algorithm / @register_task), comma-separated importable
  # module names or .py paths, imported before the config file is read and validated
  # (tlt_jax.plugins; docs/extending.md), e.g. --config.plugins=my_plugins.py.
  c.plugins = ""

  c.mesh = ml_collections.ConfigDict()
  # Axis order matters: replica slices are the outermost groups of devices.
  c.mesh.axes = ml_collections.ConfigDict({"replica": 1, "fsdp": -1, "tensor": 1})
  # On CPU, emulate this many devices (0 = leave JAX's default). Ignored on GPU.
  c.mesh.num_cpu_devices = 0
  # The training layout (FSDP over every data axis) and the rollout layout on each replica
  # slice (whole weights, or tensor-parallel); tlt_jax.mesh explains both.
  c.mesh.rules = DEFAULT_RULES
  # The rollout layout: the training rules less the split of `embed`, so every device of a
  # replica slice holds whole weights, or their tensor-parallel part on a slice with a
  # `tensor` axis (no decode step gathers weights). No rule may split weights over `replica`.
  c.mesh.rollout_rules = ROLLOUT_RULES
  # Multi-host (jax.distributed): empty/0/-1 fall back to JAX_COORDINATOR_ADDRESS,
  # JAX_NUM_PROCESSES and JAX_PROCESS_ID; none set = one process. auto_detect lets JAX read
  # them from the cluster (SLURM, Open MPI). CPU processes use gloo collectives.
  c.mesh.distributed = ml_collections.ConfigDict({
      "coordinator_address": "", "num_processes": 0, "process_id": -1,
      "auto_detect": False, "cpu_collectives": "gloo"})

  # model.path: a local Hugging Face folder; empty = random weights of the shape below. With a
  # path, the folder's config.json gives the shape (model_type to max_position_embeddings)
  # instead of these keys; dtype, param_dtype, attention_impl and the keys after them apply.
  c.model = ml_collections.ConfigDict(dict(path=""))
  c.model.model_type = "qwen2"          # "qwen2" (q/k/v biases), "llama" or "qwen3" (q/k norms)
  c.model.vocab_size = 512              # token ids; at least the tokenizer's size
  c.model.hidden_size = 64              # the residual stream's width (E)
  c.model.intermediate_size = 128       # the MLP's hidden width
  c.model.num_layers = 4                # decoder layers
  c.model.num_heads = 4                 # query heads; a multiple of num_kv_heads
  c.model.num_kv_heads = 2              # key/value heads (grouped-query attention)
  c.model.head_dim = 16                 # width of each attention head
  c.model.rope_theta = 10000.0          # RoPE base frequency
  c.model.rms_norm_eps = 1e-6           # epsilon of every RMSNorm
  c.model.tie_embeddings = False        # the LM head reuses the token embedding matrix
  # The position limit: rollout.max_prompt_len + rollout.max_new_tokens must not exceed it.
  c.model.max_position_embeddings = 4096
  # Activation/compute dtype ("float32", "bfloat16", "float16"); softmax, norms and logits
  # are float32 whatever it is. The GPU configs set bfloat16; CPU runs keep float32.
  c.model.dtype = "float32"
  # Storage dtype of the weights (random or loaded ones are cast to it; checkpoints and
  # AdamW's moments take it too); bfloat16 halves their memory.
  c.model.param_dtype = "float32"
  # Prefix + tree attention: "auto" (on GPU the Pallas kernel where the block fits it, the
  # jnp reference elsewhere), "reference", "pallas" (GPU only) or "pallas_interpret" (CPU
  # tests, slow). The same function either way; only speed differs.
  c.model.attention_impl = "auto"
  # Which forward passes run the layers as a lax.scan over the stacked weights instead of a
  # Python loop: "none", "train" (log-probs, policy and SFT updates; prefill/decode/verify
  # loop) or "all". The scan compiles faster and keeps training memory down; on GPU it copies
  # every layer's weights before use, so decoding loops.
  c.model.scan_layers = "train"
  # Training memory (log-probs, policy/SFT/drafter updates): per-layer rematerialisation
  # ("none", "full": save each layer's input only, "dots": also its matmul outputs) and
  # attention over at most this many queries at a time, each chunk rematerialised (0 = all
  # at once). Exact either way; both trade compute for memory (see the README's GPU notes).
  c.model.update(remat="none", attention_query_chunk=0)
  # "fast": XLA's kernels as it picks them. "invariant": a token's logits are the same bits in
  # a decode step of any batch, a tree verify, a prefill and the training forward, so that in
  # bfloat16 SD emits plain decoding's tokens and the update's log-probs equal the rollout's
  # (tlt_jax/kernels/numerics.py; its cost: docs/results/numerics/).
  c.model.numerics = "fast"

  # python -m tlt_jax.generate: plain batched decoding of random prompts, timed (a smoke test
  # of a model and mesh, not an evaluation).
  c.generate = ml_collections.ConfigDict()
  c.generate.num_prompts = 16     # prompts, all decoded as one batch
  c.generate.prompt_len = 16      # tokens per prompt at most (each prompt's length is random)
  c.generate.max_new_tokens = 64  # tokens decoded per prompt (no EOS: every row decodes them all)
  c.generate.temperature = 0.0    # 0 = greedy; > 0 samples at this temperature
  # Trace num_steps steps of train's or sft's loop from first_step on (1-based, as in
  # metrics.jsonl) with jax.profiler into WORKDIR/profile, and summarize where the device time
  # went (profile/summary.json, top_ops.png; tlt_jax.profiling). 0 steps: no trace.
  c.profile = ml_collections.ConfigDict(dict(first_step=1, num_steps=0))
  # Every job's metrics.jsonl and eval.jsonl rows (and the rollout's response lengths, as a
  # histogram) also go to TensorBoard event files in WORKDIR/tensorboard (pip install
  # tensorboardX) and/or to a W&B run of project wandb_project (pip install wandb; W&B's
  # environment applies, e.g. WANDB_MODE=offline). The JSONL files stay the record. A project
  # without wandb, or either on python -m tlt_jax.generate (no metrics), is an error.
  c.logging = ml_collections.ConfigDict(dict(tensorboard=False, wandb=False,
                                             wandb_project="tlt_jax"))

  # The task (tlt_jax.rl.tasks): "arithmetic" (built in; its knobs are the keys below) or
  # "reasoning_gym" (pip install -e ".[reasoning]"; its knobs are task.reasoning_gym). Problem
  # i depends only on (seed, i).
  c.task = ml_collections.ConfigDict(dict(name="arithmetic"))
  for name, task in TASKS.items():
    if defaults_of(task.Settings):
      c.task[name] = ml_collections.ConfigDict(defaults_of(task.Settings))
  c.task.seed = 0           # training problems
  c.task.eval_seed = 1      # held-out problems (a different stream)
  # The arithmetic task's knobs: ArithmeticTask's fields (the reasoning_gym task reads
  # `instruction` too).
  c.task.update(defaults_of(ArithmeticTask, exclude=("seed",)))
  # Your own problems instead of the built-in task: JSON lines of GSM8K / MATH / verl-style
  # records (tlt_jax.rl.data.load_jsonl); eval_data_path holds the held-out problems.
  c.task.update(data_path="", eval_data_path="")

  # A local Hugging Face tokenizer folder, or '' to train a byte-level BPE on the task's text.
  c.tokenizer = ml_collections.ConfigDict(dict(path="", vocab_size=320, num_train_examples=4000))

  # Supervised fine-tuning on the task's worked solutions (python -m tlt_jax.sft).
  c.sft = ml_collections.ConfigDict(dict(num_train_examples=1_000_000, steps=1000))
  c.sft.rows = 16           # batch rows, split over the ('replica', 'fsdp') mesh axes
  c.sft.seq_len = 384       # tokens per row; several examples are packed into a row
  # AdamW (tlt_jax.optim.AdamWConfig): the peak learning rate, reached after lr_warmup_steps
  # updates, then a cosine decay to end_lr_fraction of it at sft.steps.
  c.sft.learning_rate = 3e-3
  c.sft.lr_warmup_steps = 50            # updates of linear warm-up to the peak
  c.sft.end_lr_fraction = 0.05          # the learning rate at sft.steps, as a fraction of the peak
  c.sft.weight_decay = 0.1              # AdamW's decay, on matrices only (not norms or biases)
  c.sft.b1 = 0.9                        # AdamW's first-moment decay
  c.sft.b2 = 0.98                       # AdamW's second-moment decay
  c.sft.grad_clip = 1.0                 # the global gradient norm is clipped to this (0 = no clip)
  c.sft.log_every = 10                  # a metrics.jsonl row (loss) every N steps, and the last
  c.sft.eval_every = 250    # held-out greedy accuracy every N steps (0 = only at the end)
  c.sft.num_eval_examples = 256         # held-out problems (task.eval_seed) per evaluation
  c.sft.eval_batch_size = 64            # rows the evaluation decodes at once (a power of two)
  c.sft.eval_max_new_tokens = 256       # tokens per held-out answer, at most
  c.sft.checkpoint_every = 250          # a checkpoint every N steps (0 = only at the end or a stop)
  c.sft.keep_checkpoints = 2            # the newest N checkpoints are kept
  c.sft.export_dtype = "float32"        # dtype of the exported weights (export/model.safetensors)
  # Train for at most this many minutes of the job's run (0 = no limit), then evaluate and
  # export as after sft.steps (summary.json: time_limited, step): for a lease of fixed length.
  c.sft.max_minutes = 0.0

  # The rollout engine (tlt_jax.rollout.engine): rows per replica slice, cache sizes, sampling.
  c.rollout = ml_collections.ConfigDict(dict(max_batch=64))  # power of two, bounded by cache memory
  # Prompt tokens (chat template included) per request, at most: a longer prompt of the task
  # or data file stops the job at its start. With max_new_tokens it sizes each row's KV cache.
  c.rollout.max_prompt_len = 128
  # Response tokens, at most: a response that reaches it ends there (not at EOS). Raise it for
  # long reasoning; cache memory grows with prompt + response length.
  c.rollout.max_new_tokens = 256
  c.rollout.sd_threshold = 4        # SD once this few sequences are still running
  # Decode iterations per compiled call, at most: a call also returns as soon as the host has
  # something to decide, so this only bounds how long the host goes unheard.
  c.rollout.iterations_per_call = 32
  # Compile the tail's SD programs in a background thread while the batch decodes plainly;
  # the tuner uses a strategy once its program is ready (see EngineConfig.compile_ahead).
  c.rollout.compile_ahead = True
  # The program batch sizes of a slice (rows; max_batch is always one) and the prefill widths
  # (tokens; max_prompt_len is always one, and larger ones count as it); () = every power of
  # two up to the maximum. A batch compacts to the smallest size that holds its running rows:
  # fewer sizes, fewer programs to compile, more padded rows per step (what a GPU's flat
  # decode step allows).
  c.rollout.update(batch_sizes=(), prompt_widths=())
  # Queue every program of the rollout (prefill, each batch size's plain and SD programs,
  # compactions) and the policy update when the job starts, compiled ahead on compile_threads
  # threads; the first step starts once they are ready (a GPU host's cores compile in parallel).
  c.rollout.update(compile_plan=False, compile_threads=1)
  c.rollout.update(defaults_of(SamplingParams))  # temperature, top_k, top_p
  # SD in the rollout's tail; enable=False decodes plainly throughout (the baseline; spot
  # training is drafter.spot_training's own switch). Tokens are the same either way.
  c.rollout.speculative = ml_collections.ConfigDict(dict(enable=True))
  # "beg_mab", "cheapest" (per bucket the arm, plain included, whose token costs the fewest
  # seconds as measured), "table" (one arm per bucket) or "fixed"; a knob only other tuners
  # read (epsilon, window, explore_iterations, plain_arm below) set away from its default is
  # an error.
  c.rollout.speculative.tuner = "beg_mab"
  # The "fixed" tuner's (depth, topk, verify[, drafts]), and the warm-up's accept-length check's
  # whatever the tuner.
  c.rollout.speculative.strategy = "4,2,8"
  # Batch-size buckets (first batch size of each) and the arms every bucket explores
  # ("table": one arm per bucket, in bucket order).
  c.rollout.speculative.bucket_thresholds = (1, 2, 5)
  c.rollout.speculative.arms = ("4,2,8", "3,2,6", "6,2,12")  # "depth,topk,verify_tokens[,drafters]"
  # BEG-MAB and cheapest: the chance that a choice explores a random ready arm instead of the
  # best one.
  c.rollout.speculative.epsilon = 0.1
  # BEG-MAB: goodput samples kept per arm and bucket, the best arm has the highest median;
  # cheapest: calls kept per arm and bucket.
  c.rollout.speculative.window = 300
  # cheapest: decode iterations of a call that explores an arm (the others run
  # rollout.iterations_per_call), so that a losing arm costs a few iterations.
  c.rollout.speculative.explore_iterations = 4
  # BEG-MAB also tries plain decoding in every bucket, so adaptive SD never runs slower than
  # plain decoding where no strategy pays (it learns that from the same goodput).
  c.rollout.speculative.plain_arm = True
  # Program batch sizes up to this (0: none) run the arms of one top-k in one SD program: a
  # third of the SD compiles for the default arms (EngineConfig.shared_sd_max_batch).
  c.rollout.speculative.shared_max_batch = 0
  # Arms may name their drafters: "6,2,12" is EAGLE's tree, "6,1,7,suffix" a chain copied from
  # the group's finished responses (no training), "6,2,12,eagle+suffix" both merged in one tree
  # (tlt_jax.drafters). A row copies from up to corpus_rows of its group's finished responses.
  c.rollout.speculative.corpus_rows = 8

  # RL (python -m tlt_jax.train; tlt_jax.rl). Each step: prompts_per_step prompts,
  # num_samples responses each, advantages normalised within each prompt's group.
  # The algorithm (tlt_jax.rl.algorithms): "grpo", "dapo" (dynamic sampling and overlong
  # shaping on top of GRPO's loss), "dr_grpo" (no std scaling, a constant normaliser) or
  # "gspo" (a sequence-level ratio); its own knobs are the section rl.<name> (e.g. rl.dapo),
  # made from its Settings dataclass. Each reads some of the shared loss knobs below; setting
  # one it does not read is an error.
  c.rl = ml_collections.ConfigDict(dict(algorithm="grpo"))
  for name, algorithm in ALGORITHMS.items():
    if defaults_of(algorithm.Settings):
      c.rl[name] = ml_collections.ConfigDict(defaults_of(algorithm.Settings))
  c.rl.steps = 20                       # RL steps: the run's length (raise it and rerun to extend)
  c.rl.prompts_per_step = 16            # prompts per step, each a group of num_samples responses
  c.rl.num_samples = 8                  # responses per prompt (the group size G; GRPO: >= 2)
  c.rl.num_train_examples = 1_000_000   # the prompt pool (training split of the task)
  c.rl.reward = "answer+format"         # or "answer"
  # Added to the reward of a response ending in a '#### <number>' line (rl.reward="answer+format").
  c.rl.format_bonus = 0.1
  # Judge a response that states no '#### x' or \boxed{x} by its last number (reward, accuracy
  # and evaluation alike): for a model that was never taught the answer format.
  c.rl.answer_fallback = False
  # The policy's AdamW (tlt_jax.optim.AdamWConfig): constant learning rate after the warm-up;
  # RL fine-tuning wants a small one (the paper's 7B runs: 1e-6).
  c.rl.learning_rate = 1e-6
  c.rl.lr_warmup_steps = 0              # optimizer updates of linear warm-up (0 = none)
  c.rl.weight_decay = 0.0               # AdamW's decay, on every weight
  c.rl.b1 = 0.9                         # AdamW's first-moment decay
  c.rl.b2 = 0.999                       # AdamW's second-moment decay
  c.rl.grad_clip = 1.0                  # the global gradient norm is clipped to this (0 = no clip)
  # The loss's knobs (clip_eps, clip_eps_high, ...): LossConfig's fields (tlt_jax.rl.loss).
  c.rl.update(defaults_of(LossConfig, exclude=("sampling",)))
  c.rl.ppo_epochs = 1                   # passes over each step's responses (PPO epochs)
  c.rl.mini_batches = 1                  # optimizer steps per epoch
  c.rl.micro_batch_rows = 32             # rows per gradient-accumulation micro-batch
  # Widths (tokens) a micro-batch of the update may be computed at: each at the narrowest that
  # holds its rows, the rows of a step sorted longest first, all in one program whatever the
  # step's longest response (tlt_jax.rl.policy_update). () = each step at its longest row.
  c.rl.update_widths = ()
  # Held-out greedy accuracy (task.eval_seed problems) before the first step, every
  # eval_every steps (0 = only then and at the end); 0 examples = no evaluation.
  c.rl.num_eval_examples = 0
  c.rl.eval_samples = 4                  # also sampled at the rollout temperature (0 = no)
  c.rl.eval_every = 0                   # held-out evaluation every N steps (0 = first and last)
  # The paired control: each step the initial policy also answers the step's prompts with the
  # same rollout key (plain decoding, outside step_s), so `reward_vs_initial` is the reward
  # the updates gained on exactly these prompts and samples' randomness (0 at step 1), free of
  # the prompt mix's noise. Costs one more rollout per step and a copy of the weights.
  c.rl.paired_control = False
  c.rl.checkpoint_every = 5             # a checkpoint every N steps (0 = only at the end or a stop)
  c.rl.keep_checkpoints = 2             # the newest N checkpoints are kept
  c.rl.export = True                     # export policy and drafter (HF layout) at the end
  c.rl.save_rollouts = False             # every response with its reward, in rollouts.jsonl
  # Every compiled call of each step's rollout (mode, running rows, batch, strategy, tokens,
  # accept length, seconds, when it ended), in timeline.jsonl: where a step's time went.
  c.rl.save_timeline = False
  # An update with a non-finite loss, gradient norm or parameter is never applied; "stop" ends
  # the run there (before any checkpoint or export), "skip" goes on without it (counted in
  # the metrics as nonfinite_updates).
  c.rl.on_nonfinite = "stop"
  # End the run after the step during which it reached this many minutes (0 = no limit), as
  # if that step were rl.steps: evaluation, checkpoint, export (summary: time_limited).
  c.rl.max_minutes = 0.0

  # The drafters (tlt_jax.drafters), by name: those a run uses are drafter.names, or (when
  # it is empty) those its strategies name (rollout.speculative.arms, or .strategy with the
  # fixed tuner). Each has a section drafter.<name> made from its Settings dataclass: eagle
  # (DrafterConfig, tlt_jax.drafters.eagle.network: feature_layers and draft_vocab_size are EAGLE-3's
  # fused features and reduced vocabulary, whose tokens the warm-up picks), mtp (Medusa/MTP
  # heads), suffix and prompt_lookup (weightless); a trained one's also holds `path`, a
  # folder python -m tlt_jax.warmup_drafter exports ('' = random weights). Setting a section
  # of a drafter the run does not use is an error.
  c.drafter = ml_collections.ConfigDict(dict(names=()))
  for name, cls in DRAFTERS.items():
    section = {**defaults_of(cls.Settings), **({"path": ""} if cls.trained else {})}
    if section:
      c.drafter[name] = ml_collections.ConfigDict(section)
  # AdamW and the shared loss knobs of every trained drafter, DrafterOptConfig's
  # (tlt_jax.drafter_training.train_step; train_depth is EAGLE-3's training-time test), for
  # spot training (drafter.warmup has its own learning rate and warm-up).
  c.drafter.update(defaults_of(DrafterOptConfig, exclude=("section",)))
  # Train the run's trained drafters on idle slices during each rollout
  # (tlt_jax.drafter_training.spot).
  c.drafter.spot_training = True
  # The hidden-state buffer: features of the last `keep_steps` RL steps, for a sample of
  # `sequences_per_step` responses per step (0 = all).
  c.drafter.buffer = ml_collections.ConfigDict(dict(keep_steps=2, sequences_per_step=0))
  # Spot updates: SpotConfig's fields (tlt_jax.drafter_training.spot).
  c.drafter.spot = ml_collections.ConfigDict(defaults_of(SpotConfig))
  # Offline warm-up before RL (python -m tlt_jax.warmup_drafter): the policy generates
  # responses to `num_prompts` training prompts, the run's trained drafters train on its
  # features.
  c.drafter.warmup = ml_collections.ConfigDict(dict(
      num_prompts=256, samples_per_prompt=1, temperature=1.0, max_new_tokens=256, steps=400,
      batch_rows=8, window=256, learning_rate=3e-3, lr_warmup_steps=20, checkpoint_every=100))
  c.drafter.warmup.num_eval_prompts = 32  # held-out prompts for the accept-length check
  c.drafter.warmup.max_minutes = 0.0      # stop training after this long, then export (0 = no)
  # Train on these responses instead of generating (num_prompts, samples_per_prompt and
  # temperature then unread): a JSON-lines file of {"prompt", "completion"} token ids, or a GPU
  # lease's responses.jsonl.xz (experiments/gpu_headline.py run; its default-precision
  # baseline responses).
  c.drafter.warmup.responses = ""
  return c


def flat_settings(config: ml_collections.ConfigDict) -> dict:
  """{dotted key: JSON value} of every setting (what a checkpoint records of its run)."""
  def walk(node, prefix):
    for key, value in node.items():
      if isinstance(value, dict):
        yield from walk(value, f"{prefix}{key}.")
      else:
        yield f"{prefix}{key}", value
  return dict(walk(json.loads(config.to_json()), ""))


def _check_keys(config, schema, prefix: str = "") -> None:
  for key in config.keys():
    name = f"{prefix}{key}"
    if name in RENAMED_KEYS:
      raise ConfigError(f"config key {name!r} is now {RENAMED_KEYS[name]!r}: set that instead")
    if key not in schema:
      close = difflib.get_close_matches(key, list(schema.keys()), n=1)
      hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
      raise ConfigError(f"unknown config key {name!r}.{hint} Allowed under "
                        f"{prefix.rstrip('.') or 'the top level'}: {sorted(schema.keys())}")
    if isinstance(schema[key], ml_collections.ConfigDict) and key != "axes":
      if not isinstance(config[key], ml_collections.ConfigDict):
        raise ConfigError(f"config key {name!r} must be a section, got {config[key]!r}")
      _check_keys(config[key], schema[key], name + ".")


def _one_of(value, allowed, key: str) -> None:
  if value not in allowed:
    raise ConfigError(f"{key}={value!r} is not allowed; allowed values: {tuple(allowed)}")


def _positive(section: ml_collections.ConfigDict, prefix: str, keys) -> None:
  for key in keys:
    if section[key] <= 0:
      raise ConfigError(f"{prefix}.{key}={section[key]} must be positive")


def _non_negative(section: ml_collections.ConfigDict, prefix: str, keys) -> None:
  for key in keys:
    if section[key] < 0:
      raise ConfigError(f"{prefix}.{key}={section[key]} must be >= 0")


def _check_finite(section: ml_collections.ConfigDict, prefix: str) -> None:
  """Every float knob (and float in a tuple knob) is a number: NaN passes every `x <= 0`
  range check, and would only show up as a loss of NaN (or no change at all) steps later."""
  for key, value in section.items():
    name = f"{prefix}{key}"
    if isinstance(value, ml_collections.ConfigDict):
      _check_finite(value, name + ".")
    elif any(isinstance(v, float) and not math.isfinite(v)
             for v in (value if isinstance(value, (tuple, list)) else (value,))):
      raise ConfigError(f"{name}={value} must be a finite number"
                        f"{'' if isinstance(value, float) else ' in each entry'}")


def check_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
  """Checks the keys, the mesh (it must fit `num_devices` devices, when given) and the values
  that no dataclass checks (paths, counts); raises ConfigError naming the key and the fix."""
  _check_keys(config, base_config())
  _check_finite(config, "")
  if config.seed < 0:  # numpy's generators refuse negative seeds, and only once they run
    raise ConfigError(f"seed={config.seed} must be >= 0")
  _check_model(config.model)
  sizes = _check_mesh(config.mesh, num_devices)
  if sizes is not None:
    check_micro_batch_rows(config.rl.micro_batch_rows,
                           sizes.get("replica", 1) * sizes.get("fsdp", 1))
  _positive(config.generate, "generate", ("num_prompts", "prompt_len", "max_new_tokens"))
  _non_negative(config.generate, "generate", ("temperature",))
  _positive(config.profile, "profile", ("first_step",))
  _positive(config.rollout, "rollout", ("compile_threads",))
  _non_negative(config.profile, "profile", ("num_steps",))
  _check_logging(config.logging)
  _check_task(config.task)
  if config.task.data_path and not config.task.eval_data_path and config.rl.num_eval_examples:
    raise ConfigError("task.data_path is set but task.eval_data_path is not: held-out "
                      "evaluation needs its own problems; set task.eval_data_path or "
                      "rl.num_eval_examples=0")
  _check_tokenizer(config.tokenizer)
  _check_sft(config.sft)
  _check_rl(config.rl)
  _check_drafter(config.drafter)


def _check_model(m: ml_collections.ConfigDict) -> None:
  for key, allowed in (("dtype", DTYPES), ("param_dtype", DTYPES), ("model_type", MODEL_TYPES),
                       ("attention_impl", ATTENTION_IMPLS), ("scan_layers", SCAN_LAYERS),
                       ("numerics", NUMERICS)):
    _one_of(m[key], allowed, f"model.{key}")
  if m.path:
    if not os.path.isdir(m.path):
      raise ConfigError(f"model.path={m.path!r} does not exist; give a local Hugging Face "
                        f"folder, or '' for random weights")
    try:
      check_model_folder(m.path)
    except (FileNotFoundError, ValueError) as e:
      raise ConfigError(f"model.path={m.path!r}: {e}") from None


def _check_mesh(mesh: ml_collections.ConfigDict, num_devices: int | None) -> dict | None:
  """The mesh's axis sizes on `num_devices` devices (None when not given)."""
  axes = dict(mesh.axes)
  if not axes:
    raise ConfigError("mesh.axes must name at least one axis, e.g. {'replica': 1, 'fsdp': -1}")
  _non_negative(mesh, "mesh", ("num_cpu_devices",))
  dist = mesh.distributed
  _non_negative(dist, "mesh.distributed", ("num_processes",))
  if dist.num_processes and dist.process_id >= dist.num_processes:
    raise ConfigError(f"mesh.distributed.process_id={dist.process_id} must be below "
                      f"num_processes={dist.num_processes}")
  _one_of(dist.cpu_collectives, ("gloo", "mpi"), "mesh.distributed.cpu_collectives")
  try:
    return None if num_devices is None else resolve_axis_sizes(axes, num_devices)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _check_logging(g: ml_collections.ConfigDict) -> None:
  for knob in PACKAGES:
    missing = g[knob] and missing_package(knob)
    if missing:
      raise ConfigError(missing)
  if g.wandb and not g.wandb_project:
    raise ConfigError("logging.wandb_project is empty; name the W&B project, e.g. 'tlt_jax'")


def _check_task(t: ml_collections.ConfigDict) -> None:
  for key in ("data_path", "eval_data_path"):
    if t[key] and not os.path.isfile(t[key]):
      raise ConfigError(f"task.{key}={t[key]!r} does not exist; give a JSON-lines file of "
                        f"problems, or '' for the built-in task")
  if t.eval_data_path and not t.data_path:
    raise ConfigError("task.eval_data_path is set but task.data_path is not; held-out "
                      "problems from a file go with training problems from a file")
  _non_negative(t, "task", ("seed", "eval_seed"))
  if t.seed == t.eval_seed:
    raise ConfigError(f"task.eval_seed={t.eval_seed} equals task.seed: held-out problems must "
                      f"come from a different seed")


def _check_tokenizer(t: ml_collections.ConfigDict) -> None:
  if t.path:
    if not os.path.isdir(t.path):
      raise ConfigError(f"tokenizer.path={t.path!r} does not exist; give a local Hugging Face "
                        f"tokenizer folder, or '' to train one on the task")
    return
  if t.vocab_size < 259:
    raise ConfigError(f"tokenizer.vocab_size={t.vocab_size} must be >= 259 (256 bytes + 3 "
                      f"special tokens)")
  _positive(t, "tokenizer", ("num_train_examples",))


def _check_sft(s: ml_collections.ConfigDict) -> None:
  _positive(s, "sft", ("num_train_examples", "steps", "rows", "seq_len", "log_every",
                       "num_eval_examples", "eval_batch_size", "eval_max_new_tokens",
                       "keep_checkpoints"))
  _non_negative(s, "sft", ("eval_every", "checkpoint_every", "max_minutes"))
  if s.eval_batch_size & (s.eval_batch_size - 1):
    raise ConfigError(f"sft.eval_batch_size={s.eval_batch_size} must be a power of two (the "
                      f"rollout engine's batch evaluates the held-out problems)")
  _one_of(s.export_dtype, DTYPES, "sft.export_dtype")


def _check_rl(r: ml_collections.ConfigDict) -> None:
  _positive(r, "rl", ("steps", "prompts_per_step", "num_samples", "num_train_examples",
                      "ppo_epochs", "mini_batches", "micro_batch_rows", "keep_checkpoints"))
  _non_negative(r, "rl", ("checkpoint_every", "num_eval_examples", "eval_every",
                          "eval_samples", "max_minutes"))
  if any(not isinstance(w, int) or w < 1 for w in r.update_widths):
    raise ConfigError(f"rl.update_widths={tuple(r.update_widths)} must be positive token "
                      f"counts, e.g. (256, 512)")
  _one_of(r.on_nonfinite, ("stop", "skip"), "rl.on_nonfinite")


def _check_drafter(d: ml_collections.ConfigDict) -> None:
  for name in d.names:
    if name not in DRAFTERS:
      raise ConfigError(f"drafter.names={tuple(d.names)!r}: unknown drafter {name!r}; the "
                        f"registered drafters are {sorted(DRAFTERS)}")
  for name, cls in DRAFTERS.items():
    if cls.trained and name in d and d[name].path:
      _check_drafter_folder(d[name].path, name)
  _positive(d.buffer, "drafter.buffer", ("keep_steps",))
  _non_negative(d.buffer, "drafter.buffer", ("sequences_per_step",))
  _positive(d.warmup, "drafter.warmup", ("num_prompts", "samples_per_prompt", "max_new_tokens",
                                         "steps", "batch_rows", "window", "num_eval_prompts"))
  _non_negative(d.warmup, "drafter.warmup", ("temperature", "checkpoint_every", "max_minutes"))


def _check_drafter_folder(path: str, name: str) -> None:
  """drafter.<name>.path: an export of drafter `name` (ConfigError naming the key)."""
  key = f"drafter.{name}.path={path!r}"
  if not os.path.isdir(path):
    raise ConfigError(f"{key} does not exist; give a folder exported by python -m "
                      f"tlt_jax.warmup_drafter, or '' for random drafter weights")
  for fn in ("config.json", "model.safetensors"):
    if not os.path.isfile(os.path.join(path, fn)):
      raise ConfigError(f"{key} has no {fn}; export a drafter with python -m "
                        f"tlt_jax.warmup_drafter")
  try:
    check_family(path, read_drafter_config(path), name)
    check_safetensors(os.path.join(path, "model.safetensors"))
  except json.JSONDecodeError as e:
    raise ConfigError(f"{key}: config.json is not valid JSON ({e.msg} at line {e.lineno})"
                      ) from None
  except ValueError as e:
    raise ConfigError(f"{key}: {e}") from None
