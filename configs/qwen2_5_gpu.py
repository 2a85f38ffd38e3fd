"""GRPO with TLT for a Qwen2.5-style model from a local Hugging Face folder, on GPUs.

  python -m tlt_jax.warmup_drafter --config configs/qwen2_5_gpu.py:8gpu \\
      --config.model.path=/models/Qwen2.5-7B-Instruct --workdir runs/qwen7b_warmup
  python -m tlt_jax.train --config configs/qwen2_5_gpu.py:8gpu \\
      --config.model.path=/models/Qwen2.5-7B-Instruct \\
      --config.drafter.eagle.path=runs/qwen7b_warmup/export/eagle --workdir runs/qwen7b

Variant: `8gpu`: 8 rollout slices of one GPU, each with the whole policy (the rollout layout:
no weight gathers while decoding), training sharded over all 8 (FSDP over replica x fsdp);
slices that finish first train the drafter. There is no one-GPU variant: the 7B policy's bf16 weights and AdamW state
(~44 GiB) and the rollout cache of 64 rows x 8.7k slots (~30 GiB) already pass a 70 GiB
budget on one 80 GB GPU before any activation (tests/test_gpu_programs.py). Settings follow the paper's 7B runs where the hardware
allows (8 samples per prompt, clip 0.2, token-mean loss, KL 0.001, lr 1e-6; see
`gpu_grpo_settings` in configs/presets.py); the built-in task stands in for a math data set.
model.path is required: the config fails early without it (its placeholder names no folder).
"""

import os

from tlt_jax.config import base_config
from tlt_jax.plugins import import_file

presets = import_file(os.path.join(os.path.dirname(__file__), "presets.py"))


def get_config(arg: str | None = None):
  c = base_config()
  # A placeholder that fails validation ("does not exist") until --config.model.path is given.
  c.model.path = "/path/to/Qwen2.5-7B-Instruct"
  presets.gpu_grpo_settings(c)
  if arg == "8gpu":
    c.mesh.axes.replica = 8
    c.mesh.axes.fsdp = 1
    # Per slice: 15 GiB of bf16 weights and a 32-row x 8.7k-slot cache (~15 GiB), beside 1/8
    # of the training state.
    c.rollout.max_batch = 32
  elif arg == "1gpu":
    raise ValueError("configs/qwen2_5_gpu.py:1gpu was removed: a 7B policy's weights, AdamW "
                     "state and rollout cache do not fit one 80 GB GPU; use :8gpu, or "
                     "configs/qwen3_gpu.py:1gpu (Qwen3-1.7B), or configs/gpu_demo.py for one "
                     "GPU")
  else:
    raise ValueError(f"configs/qwen2_5_gpu.py: give the variant '8gpu' (got {arg!r})")
  c.lock()
  return c
