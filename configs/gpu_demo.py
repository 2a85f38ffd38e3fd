"""The one-GPU end-to-end demonstration of docs/results/gpu_h100_2026-11-27: a policy made from
nothing by SFT on the built-in task with long chains, a drafter warmed on its generations, then
GRPO with TLT and the baseline (each the project's own job on this config; the memory budget
of its programs is tests/test_gpu_programs.py's).

Variants:
  (none)  one GPU: an ~80M-parameter Qwen2-style policy (12 layers, hidden 768, bf16), chains
          of up to 64 steps so responses run from tens to over a thousand tokens, one rollout
          slice of 128 rows.
  quick   a toy policy, a few steps of each stage (smoke tests), on one device (one rollout
          slice) like the one-GPU run, on CPU or GPU.
On one H100 an SFT step of this shape took 1.07 s (docs/results/gpu_h100_2026-11-27); the
decode step's busy share (metrics) is not yet measured past the first, compile-bound RL step.
"""

import os

from tlt_jax.config import base_config
from tlt_jax.plugins import import_file

presets = import_file(os.path.join(os.path.dirname(__file__), "presets.py"))


def get_config(arg: str | None = None):
  c = base_config()
  c.mesh.axes.replica = 1
  c.mesh.axes.fsdp = -1
  c.tokenizer.vocab_size = 320
  c.task.max_value = 99
  c.task.max_operand = 19
  c.task.max_multiplier = 9
  c.task.body_p = 0.1       # a long body ...
  c.task.tail_prob = 0.2    # ... and a heavy tail of the step count
  c.drafter.spot_training = True
  c.rollout.temperature = 1.0
  c.rollout.speculative.tuner = "beg_mab"
  c.rl.reward = "answer+format"
  if not arg:
    c.model.vocab_size = 320
    c.model.hidden_size = 768
    c.model.intermediate_size = 2048
    c.model.num_layers = 12
    c.model.num_heads = 12
    c.model.num_kv_heads = 4
    c.model.head_dim = 64
    c.model.max_position_embeddings = 2048
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.scan_layers = "train"
    # Without these the SFT step (32 x 1536) needs ~224 GiB, by XLA's memory analysis
    # (tlt_jax.budget); with them ~7 GiB, and the RL job's largest program ~10 GiB.
    c.model.remat = "full"
    c.model.attention_query_chunk = 256
    c.task.max_ops = 64
    c.sft.steps = 600
    c.sft.rows = 32
    c.sft.seq_len = 1536
    c.sft.learning_rate = 1e-3
    c.sft.eval_every = 0
    c.sft.num_eval_examples = 128
    c.sft.eval_max_new_tokens = 1536
    c.sft.export_dtype = "bfloat16"
    c.rollout.max_batch = 128
    c.rollout.max_prompt_len = 384  # prompts of up to 64 steps reach ~340 tokens
    c.rollout.max_new_tokens = 1536
    c.rollout.sd_threshold = 8
    c.drafter.warmup.num_prompts = 256
    c.drafter.warmup.steps = 600
    c.drafter.warmup.max_new_tokens = 1536
    c.drafter.warmup.window = 1024
    c.drafter.spot.window = 1024
    c.rl.steps = 8
    c.rl.prompts_per_step = 16
    c.rl.num_samples = 8
    c.rl.learning_rate = 2e-5
    c.rl.micro_batch_rows = 32
    c.rl.num_eval_examples = 64
  elif arg == "quick":
    c.mesh.num_cpu_devices = 1
    presets.toy_settings(c)
    c.model.vocab_size = 320
    c.model.max_position_embeddings = 512
    c.model.attention_impl = "reference"
    c.model.scan_layers = "all"
    c.sft.checkpoint_every = 6
    c.rollout.max_batch = 16
    c.rollout.max_prompt_len = 64
    c.rollout.max_new_tokens = 48
    c.rollout.sd_threshold = 2
    # The fewest programs that show each mechanism (as the runlocal settings): plain decoding
    # at the full batch, the tail at 2 (SD), one update program. (The full batch is always a
    # size: naming it here would refuse the SFT evaluation's smaller batch.)
    c.rollout.batch_sizes = (2,)
    c.rl.update_widths = (64,)
    c.drafter.warmup.num_prompts = 8
    c.drafter.warmup.steps = 8
    c.drafter.warmup.max_new_tokens = 48
    c.drafter.warmup.window = 64
    c.drafter.warmup.batch_rows = 2
    c.drafter.warmup.num_eval_prompts = 2
    c.drafter.warmup.checkpoint_every = 4
    c.drafter.spot.window = 64
    c.drafter.spot.windows = 4
    c.drafter.spot.batch_rows = 2
    c.drafter.spot.max_steps = 8
    c.rl.steps = 2
    c.rl.prompts_per_step = 4
    c.rl.num_samples = 4
    c.rl.micro_batch_rows = 16
    c.rl.num_eval_examples = 0
  else:
    raise ValueError(f"configs/gpu_demo.py: unknown variant {arg!r}; allowed: '' (one GPU), "
                     f"'quick'")
  c.lock()
  return c
