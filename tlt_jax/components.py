"""A run's components built from its config: tokenizer, policy, drafter, rollout engine,
prompts. Shared by the command-line jobs (train, warmup_drafter) and the experiments."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from tlt_jax.config import (ConfigError, drafter_config, engine_config, make_tuner_from_config,
                            model_config, task_from_config)
from tlt_jax.mesh import logical_shardings
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decoder import init_params, param_logical_axes
from tlt_jax.models.drafter import DrafterConfig, init_drafter_params
from tlt_jax.rl.data import load_examples
from tlt_jax.rl.tasks import Example, TaskSlice


def load_tokenizer_for(config: ml_collections.ConfigDict):
  """tokenizer.path, else the tokenizer saved with model.path. RL and drafter jobs need a
  fixed tokenizer (the policy's); training one is the SFT job's business."""
  from tlt_jax.models.hf import load_tokenizer
  path = config.tokenizer.path or config.model.path
  if not path:
    raise ConfigError("no tokenizer: set tokenizer.path or model.path to a folder with "
                      "tokenizer files (e.g. assets/tiny-policy)")
  key = "tokenizer.path" if config.tokenizer.path else "model.path"
  try:
    return load_tokenizer(path)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{key}={path!r}: no usable tokenizer ({_first_line(e)})") from None


def load_policy(config: ml_collections.ConfigDict, mesh: Mesh) -> tuple[ModelConfig, dict]:
  """(ModelConfig, params placed on `mesh` by their logical axes): model.path's weights, or
  random ones of the configured shape (seeded by config.seed)."""
  cfg = model_config(config)
  rules = tuple(config.mesh.rules)
  if config.model.path:
    from tlt_jax.models.hf import load_hf_params
    try:
      return cfg, load_hf_params(config.model.path, cfg, mesh, rules)
    except (OSError, ValueError) as e:
      raise ConfigError(f"model.path={config.model.path!r}: {_first_line(e)}") from None
  shapes = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))
  shardings = logical_shardings(param_logical_axes(cfg), mesh, rules, shapes)
  params = jax.jit(functools.partial(init_params, cfg), out_shardings=shardings)(
      jax.random.key(config.seed))
  return cfg, params


def load_drafter_for(config: ml_collections.ConfigDict, cfg: ModelConfig,
                     fresh: bool = False) -> tuple[DrafterConfig, dict]:
  """drafter.path's drafter (its architecture must match the config's drafter section), or
  random weights (fresh=True ignores drafter.path)."""
  dcfg = drafter_config(config)
  if config.drafter.path and not fresh:
    from tlt_jax.models.drafter_io import load_drafter
    try:
      saved_cfg, params = load_drafter(config.drafter.path, cfg)
    except (OSError, ValueError, TypeError) as e:
      raise ConfigError(f"drafter.path={config.drafter.path!r}: {_first_line(e)}") from None
    if saved_cfg != dcfg:
      raise ConfigError(f"drafter.path={config.drafter.path!r} holds a drafter {saved_cfg} but "
                        f"the config's drafter section describes {dcfg}; make them agree or "
                        f"set drafter.path=''")
    return dcfg, params
  try:
    return dcfg, init_drafter_params(cfg, dcfg, jax.random.key(config.seed + 1))
  except ValueError as e:  # e.g. a draft vocabulary larger than the policy's
    raise ConfigError(str(e)) from None


def _first_line(e: Exception) -> str:
  text = str(e).strip()
  return text.splitlines()[0] if text else type(e).__name__


def make_engine(config: ml_collections.ConfigDict, cfg: ModelConfig, params: dict, mesh: Mesh,
                eos_id: int, pad_id: int, drafter: tuple[DrafterConfig, dict] | None = None,
                log_features: bool = False, speculative: bool | None = None,
                tuner=None, **engine_overrides):
  """The rollout engine of config.rollout; SD when a drafter is given and
  rollout.speculative.enable (or `speculative`) says so. engine_overrides replace
  EngineConfig fields (e.g. max_new_tokens); tuner replaces the configured one."""
  from tlt_jax.rollout.engine import RolloutEngine
  ec = dataclasses.replace(engine_config(config), eos_id=eos_id, pad_id=pad_id,
                           **engine_overrides)
  use_sd = config.rollout.speculative.enable if speculative is None else speculative
  if not use_sd or drafter is None:
    ec = dataclasses.replace(ec, sd_threshold=0)
  if drafter is not None and tuner is None:
    tuner = make_tuner_from_config(config)
  return RolloutEngine(cfg, params, mesh, ec, drafter=drafter, tuner=tuner,
                       rules=tuple(config.mesh.rules), log_features=log_features)


def _data_file(config: ml_collections.ConfigDict, eval_split: bool) -> list[Example]:
  key = "eval_data_path" if eval_split else "data_path"
  path = config.task[key]
  if not path:
    raise ConfigError(f"task.data_path is set but task.{key} is not: held-out problems need "
                      f"their own file")
  try:
    return load_examples(path)
  except (OSError, ValueError) as e:
    raise ConfigError(f"task.{key}: {_first_line(e)}") from None


def training_set(config: ml_collections.ConfigDict, size: int) -> Sequence[Example]:
  """The training problems: task.data_path's records, else the first `size` problems of
  the built-in task (generated on demand)."""
  if config.task.data_path:
    return _data_file(config, eval_split=False)
  return TaskSlice(task_from_config(config.task), size)


def task_examples(config: ml_collections.ConfigDict, count: int, start: int = 0,
                  eval_split: bool = False) -> list[Example]:
  """Problems start .. start+count of the training or held-out set (a file's records, or
  the built-in task's); a file may hold fewer."""
  if config.task.data_path:
    return _data_file(config, eval_split)[start:start + count]
  return task_from_config(config.task, eval_split).examples(count, start=start)


def task_prompts(config: ml_collections.ConfigDict, tokenizer, count: int, start: int = 0,
                 eval_split: bool = False) -> tuple[list, list[list[int]]]:
  """(examples, prompt token ids) of problems start .. start+count (see task_examples)."""
  from tlt_jax.rl.tokenizer import prompt_ids
  examples = task_examples(config, count, start, eval_split)
  prompts = [prompt_ids(tokenizer, ex.prompt) for ex in examples]
  longest = max(len(p) for p in prompts)
  if longest > config.rollout.max_prompt_len:
    raise ConfigError(f"a task prompt has {longest} tokens, more than rollout.max_prompt_len="
                      f"{config.rollout.max_prompt_len}; raise it")
  return examples, prompts


def accept_length(result) -> float | None:
  """Mean tokens per running row per SD iteration of a RolloutResult (None without SD)."""
  sd = [r for r in result.timeline if r.mode == "sd" and r.row_steps]
  if not sd:
    return None
  weights = np.asarray([r.row_steps for r in sd], np.float64)
  return float(np.average([r.accept_mean for r in sd], weights=weights))
