"""GRPO with TLT for a Qwen3 (dense) model from a local Hugging Face folder, on GPUs.

  python -m tlt_jax.warmup_drafter --config configs/qwen3_gpu.py:8gpu \\
      --config.model.path=/models/Qwen3-8B --workdir runs/qwen3_8b_warmup
  python -m tlt_jax.train --config configs/qwen3_gpu.py:8gpu \\
      --config.model.path=/models/Qwen3-8B \\
      --config.drafter.eagle.path=runs/qwen3_8b_warmup/export/eagle --workdir runs/qwen3_8b
  python -m tlt_jax.train --config configs/qwen3_gpu.py:1gpu \\
      --config.model.path=/models/Qwen3-1.7B --workdir runs/qwen3_1.7b

Variants:
  8gpu  Qwen3-8B: 8 rollout slices of one GPU, each with the whole policy (the rollout
        layout: no weight gathers while decoding), training sharded over all 8 (FSDP over
        replica x fsdp); slices that finish first train the drafter. Qwen3-8B's KV cache is
        2.6x Qwen2.5-7B's per token (36 layers of 8 KV heads against 28 of 4), so a slice
        holds 16 rows of 8.7k slots (~19 GiB) beside its 15 GiB of bf16 weights.
  1gpu  Qwen3-1.7B on one GPU: weights, AdamW state, the KL reference and the rollout cache
        of 32 rows x 8.7k slots on one device.
Settings follow the paper's 7B runs where the hardware allows (`gpu_grpo_settings`
in configs/presets.py); the built-in task stands in for a math data set. Both variants' programs
fit 70 GiB per device by XLA's memory analysis at the named shapes (`tlt_jax.models.shapes`:
qwen3-8b, qwen3-1.7b; docs/results/gpu_budget_qwen3_*.json, tests/test_gpu_programs.py).
model.path is required: the config fails early without it (its placeholder names no folder).
"""

import os

from tlt_jax.config import base_config
from tlt_jax.plugins import import_file

presets = import_file(os.path.join(os.path.dirname(__file__), "presets.py"))


def get_config(arg: str | None = None):
  c = base_config()
  presets.gpu_grpo_settings(c)
  if arg == "8gpu":
    # A placeholder that fails validation ("does not exist") until --config.model.path is given.
    c.model.path = "/path/to/Qwen3-8B"
    c.mesh.axes.replica = 8
    c.mesh.axes.fsdp = 1
    c.rollout.max_batch = 16
  elif arg == "1gpu":
    c.model.path = "/path/to/Qwen3-1.7B"
    c.mesh.axes.replica = 1
    c.mesh.axes.fsdp = 1
    # 32 rows x 8.7k slots of cache (~30 GiB) beside 13 GiB of weights, AdamW state and KL
    # reference; the update takes one 8.7k-token row at a time (its float32 logits over
    # 152k tokens and their gradient are most of its ~31 GiB of temporaries).
    c.rollout.max_batch = 32
    c.rl.micro_batch_rows = 1
  else:
    raise ValueError(f"configs/qwen3_gpu.py: give the variant '8gpu' (Qwen3-8B) or '1gpu' "
                     f"(Qwen3-1.7B), got {arg!r}")
  c.lock()
  return c
