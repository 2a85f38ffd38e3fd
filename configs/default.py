"""The tiny CPU default: a small random Qwen2-style decoder on 2 emulated CPU devices.

Run: python -m tlt_jax.generate --config configs/default.py --workdir runs/default
Override any knob: --config.generate.max_new_tokens=128 --config.mesh.axes.fsdp=1
"""

from tlt_jax.config import base_config


def get_config(arg: str | None = None):
  c = base_config()
  c.mesh.num_cpu_devices = 2
  c.mesh.axes.fsdp = -1
  if arg == "runlocal":  # smallest settings, for smoke tests
    c.model.num_layers = 2
    c.generate.num_prompts = 4
    c.generate.max_new_tokens = 8
  elif arg:
    raise ValueError(f"configs/default.py: unknown variant {arg!r}; allowed: 'runlocal'")
  c.lock()
  return c
