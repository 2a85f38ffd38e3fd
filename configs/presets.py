"""Settings that several config files share: the tiny task and model of the shipped policy,
the `:runlocal` smoke sizes, GRPO on a Hugging Face model on GPUs, and the toy SFT model.
Each sets some keys of a config made by `tlt_jax.config.base_config()`, in place.

A config file imports this file by its path, so a run reads it from any directory:
  presets = import_file(os.path.join(os.path.dirname(__file__), "presets.py"))
(`tlt_jax.plugins.import_file`); a config of your own elsewhere can name this file the same way.
"""

from __future__ import annotations

import ml_collections


def tiny_task_settings(c: ml_collections.ConfigDict) -> None:
  """The model shape and task of the shipped tiny policy (assets/tiny-policy), which was
  fine-tuned on exactly this task: configs that train or load it share these values."""
  c.model.update(vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=6,
                 num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1024,
                 attention_impl="reference")
  # Two-digit values and operands up to 19 (multipliers up to 9): the policy slips on some
  # operations, so accuracy falls with their number and GRPO has signal. Up to 20 operations
  # keep every problem within one 320-token row (prompt + solution).
  c.task.update(max_ops=20, max_value=99, max_operand=19, max_multiplier=9, body_p=0.3,
                tail_prob=0.15)


def smoke_run_settings(c: ml_collections.ConfigDict) -> None:
  """The `:runlocal` sizes of a config's jobs, for smoke tests, programs compiled when first
  needed; the model and task stay the config's."""
  c.rollout.update(max_batch=8, max_new_tokens=48)
  c.generate.update(num_prompts=4, max_new_tokens=8)
  c.drafter.warmup.update(num_prompts=8, steps=6, max_new_tokens=48, checkpoint_every=3,
                          num_eval_prompts=2)
  c.drafter.spot.update(windows=4, window=64)
  c.rl.update(steps=2, prompts_per_step=2, num_samples=4, micro_batch_rows=4, checkpoint_every=1,
              num_eval_examples=4)
  # The fewest programs that still show each mechanism: two batch sizes (the tail compacts to
  # 4 rows), one prefill width (the config's longest prompt), one SD program that every arm
  # draws its tree in (the tuner still picks among the arms), one update program (one width
  # below the capacity, so the width switch runs). Tokens do not change with any of them
  # (tests/rollout/test_engine.py). A warm 3-step job of configs/default.py:runlocal took
  # 53 s, then 32 s with the batch sizes and update width, then 24 s with the prefill width
  # and the shared SD program, on 2 CPU cores, the metrics the same row for row.
  c.rollout.batch_sizes = (8, 4)
  c.rollout.prompt_widths = (c.rollout.max_prompt_len,)
  c.rollout.speculative.shared_max_batch = c.rollout.max_batch
  c.rl.update_widths = (64,)
  # Two short steps: programs compiled ahead would not be ready before the run ends, and a
  # smoke run should show SD working (compiling ahead is tested on its own).
  c.rollout.compile_ahead = False


def gpu_grpo_settings(c: ml_collections.ConfigDict) -> None:
  """GRPO with TLT on a Hugging Face model on GPUs, as the paper's 7B runs set it where the
  hardware allows (8 samples per prompt, clip 0.2, token-mean loss, KL 0.001, lr 1e-6,
  responses of up to 8192 tokens); bf16, the Pallas kernel, training memory kept down by
  remat and chunked attention. The configs for one model family set the mesh, the rollout
  rows and model.path (configs/qwen2_5_gpu.py, configs/qwen3_gpu.py)."""
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "bfloat16"
  c.model.attention_impl = "auto"  # the Pallas kernel on GPU
  # 8.7k-token training rows: keep each layer's input only, attend 512 queries at a time.
  c.model.remat = "full"
  c.model.attention_query_chunk = 512
  c.task.max_ops = 64
  c.task.max_value = 999
  c.rollout.max_batch = 64
  c.rollout.max_prompt_len = 512
  c.rollout.max_new_tokens = 8192
  c.rollout.sd_threshold = 32
  c.rollout.temperature = 1.0
  c.rollout.speculative.bucket_thresholds = (1, 2, 5, 21)
  c.rollout.speculative.arms = ("8,4,48", "8,4,32", "8,4,16", "8,4,8")
  c.drafter.learning_rate = 1e-5
  c.drafter.spot.window = 512
  c.drafter.spot.windows = 64
  c.drafter.spot.batch_rows = 8
  c.drafter.buffer.sequences_per_step = 128
  c.drafter.warmup.num_prompts = 2048
  c.drafter.warmup.max_new_tokens = 4096
  c.drafter.warmup.steps = 4000
  c.drafter.warmup.window = 512
  c.drafter.warmup.learning_rate = 5e-5
  c.rl.steps = 200
  c.rl.prompts_per_step = 64
  c.rl.num_samples = 8
  c.rl.learning_rate = 1e-6
  c.rl.clip_eps_high = 0.2
  c.rl.kl_coef = 0.001
  c.rl.micro_batch_rows = 8
  c.rl.num_eval_examples = 256
  c.rl.eval_every = 20
  c.rl.checkpoint_every = 10


def toy_settings(c: ml_collections.ConfigDict) -> None:
  """The smallest model, task and SFT settings, for smoke runs."""
  c.model.update(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=2,
                 num_kv_heads=1, head_dim=16)
  c.task.max_ops = 6
  c.tokenizer.num_train_examples = 300
  c.sft.update(steps=12, rows=8, seq_len=128, lr_warmup_steps=2, learning_rate=1e-2,
               eval_every=0, num_eval_examples=8, eval_batch_size=8, eval_max_new_tokens=48)
