"""SFT of the shipped tiny policy (assets/tiny-policy) on the built-in arithmetic task.

Run: python -m tlt_jax.sft --config configs/tiny_sft.py --workdir runs/tiny_sft
Smoke test: --config configs/tiny_sft.py:runlocal (a 2-layer model, a few steps).
"""

from tlt_jax.config import base_config, tiny_task_settings


def get_config(arg: str | None = None):
  c = base_config()
  c.mesh.num_cpu_devices = 2
  c.mesh.axes.fsdp = -1
  # 6 layers, hidden 128: a decode step is cheap on a CPU, and a 1-layer drafter of the same
  # width costs about a sixth of it.
  tiny_task_settings(c)
  c.model.scan_layers = "all"  # CPU: compiles dominate (see configs/default.py)
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
