"""SFT of the shipped tiny policy (assets/tiny-policy) on the built-in arithmetic task.

Run: python -m tlt_jax.sft --config configs/tiny_sft.py --workdir runs/tiny_sft
Smoke test: --config configs/tiny_sft.py:runlocal (a 2-layer model, a few steps).
"""

from tlt_jax.config import base_config


def get_config(arg: str | None = None):
  c = base_config()
  c.mesh.num_cpu_devices = 2
  c.mesh.axes.fsdp = -1
  # 6 layers, hidden 128: a decode step is cheap on a CPU, and a 1-layer drafter of the same
  # width costs about a sixth of it.
  c.model.vocab_size = 320
  c.model.hidden_size = 128
  c.model.intermediate_size = 256
  c.model.num_layers = 6
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 32
  c.model.max_position_embeddings = 1024
  c.model.attention_impl = "reference"
  # Two-digit values and operands up to 19 (multipliers up to 9): the policy slips on some
  # steps, so accuracy falls with the number of steps and GRPO has signal (three-digit values
  # are out of reach for this size in a CPU-minutes budget). Up to 20 steps keeps every problem
  # within one 320-token row (prompt + solution).
  c.task.max_steps = 20
  c.task.max_value = 99
  c.task.max_operand = 19
  c.task.max_multiplier = 9
  c.task.body_p = 0.3
  c.task.tail_prob = 0.15
  c.sft.steps = 900
  c.sft.rows = 8
  c.sft.seq_len = 320
  c.sft.eval_every = 450
  c.sft.num_eval_examples = 512
  if arg == "runlocal":  # smallest settings, for smoke tests
    c.model.num_layers = 2
    c.model.hidden_size = 32
    c.model.intermediate_size = 64
    c.model.num_heads = 2
    c.model.num_kv_heads = 1
    c.model.head_dim = 16
    c.task.max_steps = 6
    c.tokenizer.num_train_examples = 300
    c.sft.steps = 12
    c.sft.rows = 8
    c.sft.seq_len = 128
    c.sft.warmup_steps = 2
    c.sft.learning_rate = 1e-2
    c.sft.log_every = 1
    c.sft.eval_every = 0
    c.sft.checkpoint_every = 4
    c.sft.num_eval_examples = 8
    c.sft.eval_batch_size = 8
    c.sft.eval_max_new_tokens = 48
  elif arg:
    raise ValueError(f"configs/tiny_sft.py: unknown variant {arg!r}; allowed: 'runlocal'")
  c.lock()
  return c
