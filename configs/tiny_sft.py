"""SFT of the shipped tiny policy (assets/tiny-policy) on the built-in arithmetic task.

Run: python -m tlt_jax.sft --config configs/tiny_sft.py --workdir runs/tiny_sft
Smoke test: --config configs/tiny_sft.py:runlocal (a 2-layer model, a few steps).
"""

import os

from tlt_jax.config import base_config
from tlt_jax.plugins import import_file

presets = import_file(os.path.join(os.path.dirname(__file__), "presets.py"))


def get_config(arg: str | None = None):
  c = base_config()
  c.mesh.num_cpu_devices = 2
  c.mesh.axes.fsdp = -1
  # 6 layers, hidden 128: a decode step is cheap on a CPU, and a 1-layer drafter of the same
  # width costs about a sixth of it.
  presets.tiny_task_settings(c)
  c.model.scan_layers = "all"  # CPU: compiles dominate (see configs/default.py)
  c.sft.steps = 900
  c.sft.rows = 8
  c.sft.seq_len = 320
  c.sft.eval_every = 450
  c.sft.num_eval_examples = 512
  if arg == "runlocal":  # smallest settings, for smoke tests
    presets.toy_settings(c)
    c.sft.log_every = 1
    c.sft.checkpoint_every = 4
  elif arg:
    raise ValueError(f"configs/tiny_sft.py: unknown variant {arg!r}; allowed: 'runlocal'")
  c.lock()
  return c
