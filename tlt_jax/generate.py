"""Generate from a policy with plain batched decoding on the configured mesh.

  python -m tlt_jax.generate --config configs/default.py --workdir runs/gen

Loads `config.model.path` (a local Hugging Face folder) onto the mesh, or initialises random
weights of the configured shape, prefills ragged random prompts, decodes
`generate.max_new_tokens` tokens per prompt (greedy at temperature 0), and writes
`WORKDIR/generations.jsonl` (token ids) and `WORKDIR/summary.json` (timings, tokens/s).
"""

from __future__ import annotations

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from ml_collections import config_flags

from tlt_jax.components import load_policy
from tlt_jax.job import Job, SetupStopped, run_job
from tlt_jax.mesh import host_copy, logical_shardings, make_mesh, to_mesh
from tlt_jax.models import init_cache, param_logical_axes
from tlt_jax.models.policy import Policy
from tlt_jax.run_log import write_jsonl
from tlt_jax.speculative.decoding import plain_step, start
from tlt_jax.speculative.sampling import SamplingParams

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/generate", "Output folder.")


def _generate(config, job: Job) -> None:
  # ---------------------------------------------------------------- mesh and model
  mesh = make_mesh(dict(config.mesh.axes))
  rules = tuple(config.mesh.rollout_rules)  # decoding: whole weights per device
  job.phase(f"mesh {dict(mesh.shape)} on {jax.device_count()} devices; loading the policy")
  cfg, params = load_policy(config, mesh)
  params = to_mesh(params, logical_shardings(param_logical_axes(cfg), mesh, rules, params))
  job.say(f"model {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")

  # ---------------------------------------------------------------- prompts
  g = config.generate
  rng = np.random.default_rng(config.seed)
  lengths = rng.integers(1, g.prompt_len + 1, g.num_prompts).astype(np.int32)
  tokens = rng.integers(0, cfg.vocab_size, (g.num_prompts, g.prompt_len)).astype(np.int32)
  new_cache = functools.partial(init_cache, cfg, g.num_prompts, g.prompt_len + g.max_new_tokens)
  cache_shapes = jax.eval_shape(new_cache)
  cache = jax.jit(new_cache, out_shardings=logical_shardings(
      cache_shapes.logical_axes(), mesh, rules, cache_shapes))()

  # ---------------------------------------------------------------- compiled steps
  # The rollout's pure steps, one jitted call per token so that decode time is measured per step
  # (what this job reports); no EOS (random prompts), every row decodes the whole budget.
  sp = SamplingParams(g.temperature)
  begin = jax.jit(functools.partial(start, sp=sp, max_new_tokens=g.max_new_tokens, eos_id=-1),
                  donate_argnums=(3,))
  step = jax.jit(functools.partial(plain_step, sp=sp, eos_id=-1), donate_argnums=(1,))

  key = jax.random.key(config.seed)
  job.phase(f"prefilling {g.num_prompts} prompts (compiling the prefill first)")
  t0 = time.perf_counter()
  policy = Policy(params, cfg)
  state = begin(policy, jnp.asarray(tokens), jnp.asarray(lengths), cache, key)
  state.root.block_until_ready()
  prefill_s = time.perf_counter() - t0

  # ---------------------------------------------------------------- decode loop
  job.phase(f"decoding {g.max_new_tokens} tokens per prompt (compiling the step first)")
  t1 = time.perf_counter()
  for _ in job.progress(iterable=range(g.max_new_tokens - 1), desc="decode", unit="step"):
    if job.stop.requested:  # nothing to keep: the rerun decodes again
      raise SetupStopped("while decoding")
    state, _ = step(policy, state, key)
  generated = host_copy(state.out)  # every process takes part in the gather
  decode_s = time.perf_counter() - t1

  if job.writer:
    write_jsonl(job.path("generations.jsonl"), ({"prompt": tokens[b, :lengths[b]].tolist(),
                                                 "completion": generated[b].tolist()}
                                                for b in range(g.num_prompts)))
  summary = {"num_prompts": int(g.num_prompts), "max_new_tokens": int(g.max_new_tokens),
             "devices": jax.device_count(), "mesh": dict(mesh.shape),
             "prefill_s_incl_compile": prefill_s, "decode_s_incl_compile": decode_s,
             "decode_tokens_per_s": g.num_prompts * (g.max_new_tokens - 1) / decode_s,
             **job.compiles()}
  job.write_json("summary.json", summary)
  job.say(json.dumps(summary, indent=2))


def run():
  """Console-script entry point (`tlt-generate`)."""
  run_job(_CONFIG, _WORKDIR, _generate, "generate", quiet_logs=False, writes_metrics=False)


if __name__ == "__main__":
  run()
