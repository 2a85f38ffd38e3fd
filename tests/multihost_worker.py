"""One process of the multi-host test (tests/test_multihost.py); not collected by pytest.

  python -m tests.multihost_worker --config=configs/default.py:runlocal --out=OUT.json \
      --workdir=WORKDIR [--config.key=value ...]        (from the repo root)

Runs the main job with the given config and overrides (the mesh and mesh.distributed ones make
it one process of several) and writes what this process saw: the summary it returned, and
every (completion, reward) its reward function was given.
"""

import json

from absl import flags, logging

from tlt_jax import cli
from tlt_jax import train as train_job  # defines --config and --workdir, as the CLI does

_OUT = flags.DEFINE_string("out", None, "Where this process writes what it saw (JSON).")


def main(argv) -> None:
  logging.set_verbosity(logging.WARNING)  # orbax logs every save step of every process
  del argv
  out, workdir = _OUT.value, train_job._WORKDIR.value
  config = cli.load_config(train_job._CONFIG)
  cli.setup_devices(config)

  import jax

  from tlt_jax.rl.rewards import answer_reward

  seen = []

  def reward_fn(prompts, completions, **columns):
    rewards = answer_reward(prompts, completions, **columns)
    seen.append({"completions": list(completions), "rewards": [float(x) for x in rewards]})
    return rewards

  summary = train_job.train(config, workdir, reward_fn=reward_fn, progress=False)
  with open(out, "w") as f:
    json.dump({"process_index": jax.process_index(), "process_count": jax.process_count(),
               "devices": jax.device_count(), "local_devices": jax.local_device_count(),
               "summary": {k: v for k, v in summary.items() if k != "config"},
               "steps": seen}, f)


if __name__ == "__main__":
  cli.run_main(main)
