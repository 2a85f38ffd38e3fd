"""The offline warm-up's training loop: it stops where the job asks it to (a signal), after
that step's callback (which checkpoints it)."""

import jax

from tlt_jax.drafter_training.train_step import DrafterOptConfig
from tlt_jax.drafter_training.warmup import collect_samples, train_drafter
from tlt_jax.models.drafter import DrafterConfig, init_drafter_params


def test_training_stops_after_the_step_the_job_asked_to_stop_at(tiny_cfg, tiny_params):
  prompts = [[1, 2, 3], [4, 5]]
  completions = [[6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
  samples = collect_samples(tiny_params, tiny_cfg, prompts, completions)
  dcfg = DrafterConfig()
  dparams = init_drafter_params(tiny_cfg, dcfg, jax.random.key(1))
  steps = []
  _, history = train_drafter(dparams, tiny_params, samples, tiny_cfg, dcfg, DrafterOptConfig(),
                             steps=50, window=16, batch_rows=2, progress=False,
                             on_step=lambda step, state, metrics: steps.append(step),
                             should_stop=lambda: len(steps) >= 3)
  assert steps == [1, 2, 3] and len(history) == 3
