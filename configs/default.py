"""The tiny CPU default: the shipped tiny policy and drafter on 2 emulated CPU devices.

  python -m tlt_jax.train --config configs/default.py --workdir runs/default
  python -m tlt_jax.train --config configs/default.py:baseline --workdir runs/baseline

The policy (assets/tiny-policy, 0.97M parameters) was fine-tuned on the built-in arithmetic
task, whose response lengths are long-tailed; the drafter (assets/tiny-drafter) was warmed on
its generations. The two devices are two replica slices, so that a slice that finishes its
share of the rollout trains the drafter while the other decodes.

Variants:
  baseline   the same run without SD and without spot training (what TLT is compared with)
  runlocal   the smallest settings, for smoke tests
Override any knob: --config.rl.steps=20 --config.rollout.sd_threshold=8
"""

import os

from tlt_jax.config import base_config
from tlt_jax.plugins import import_file

presets = import_file(os.path.join(os.path.dirname(__file__), "presets.py"))

ASSETS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                       "assets"))


def get_config(arg: str | None = None):
  c = base_config()
  c.mesh.num_cpu_devices = 2
  c.mesh.axes.replica = 2
  c.mesh.axes.fsdp = -1
  presets.tiny_task_settings(c)
  c.model.path = os.path.join(ASSETS, "tiny-policy")
  c.drafter.eagle.path = os.path.join(ASSETS, "tiny-drafter")

  # On CPU compiles dominate and decode is compute-bound: scanned layers everywhere (the
  # runlocal job measured 39 s of compiles and 77 s in all, against 55 s and 106 s looped).
  c.model.scan_layers = "all"

  c.rollout.max_batch = 32
  c.rollout.max_prompt_len = 128
  c.rollout.max_new_tokens = 256
  c.rollout.sd_threshold = 4
  c.rollout.temperature = 1.0

  c.drafter.warmup.num_prompts = 256
  c.drafter.warmup.steps = 400
  c.drafter.spot.window = 256
  c.drafter.spot.windows = 16
  c.drafter.spot.batch_rows = 4

  # GRPO on the tiny policy: 16 prompts x 8 samples per step, held-out accuracy on 128
  # problems (greedy, and 4 samples each at the rollout temperature) before and after. lr 1e-4
  # is the largest that stayed stable here (3e-4 and 1e-3 collapsed within 8 steps); Qwen2.5-7B
  # runs use ~1e-6. 16 steps do not raise held-out accuracy on this policy (README: "What GRPO
  # does to the tiny policy"); the run measures time, with accuracy equal between TLT and
  # the baseline.
  c.rl.steps = 16
  c.rl.prompts_per_step = 16
  c.rl.num_samples = 8
  c.rl.learning_rate = 1e-4
  c.rl.micro_batch_rows = 32
  c.rl.checkpoint_every = 4
  c.rl.num_eval_examples = 128

  variants = ("baseline", "runlocal")
  if arg == "baseline":
    c.rollout.speculative.enable = False
    c.drafter.spot_training = False
  elif arg == "runlocal":
    presets.smoke_run_settings(c)
  elif arg:
    raise ValueError(f"configs/default.py: unknown variant {arg!r}; allowed: {variants}")
  c.lock()
  return c
