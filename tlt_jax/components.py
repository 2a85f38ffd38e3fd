"""A run's components built from its config: the dataclasses each subsystem runs on, and the
tokenizer, policy, drafter, rollout engine and prompts. Every job (train, warmup_drafter, sft,
generate) and every experiment builds through here; `validate_config` builds them all once,
before anything compiles, so a bad value fails early with the key named."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import sys
from collections.abc import Sequence
from typing import NamedTuple

import jax
import ml_collections
from jax.sharding import Mesh

from tlt_jax.config import ConfigError, base_config, check_config, flat_settings
from tlt_jax.drafter_training.spot import SpotConfig
from tlt_jax.drafter_training.train_step import LOSS_KNOBS, DrafterOptConfig
from tlt_jax.drafters import (DRAFTERS, Drafter, check_strategy, drafter_class, drafters_named,
                              make_drafter, reads_corpus)
from tlt_jax.knobs import build_from
from tlt_jax.mesh import logical_shardings
from tlt_jax.models.config import ARCHITECTURE_FLAGS, ModelConfig, RopeConfig, ROPE_TYPES
from tlt_jax.models.decoder import init_params, param_logical_axes
from tlt_jax.drafters.io import load_drafter
from tlt_jax.models.hf import load_hf_config, load_hf_params, load_tokenizer
from tlt_jax.optim import AdamWConfig
from tlt_jax.plugins import import_plugins
from tlt_jax.rl.algorithms import ALGORITHMS, Algorithm, make_algorithm
from tlt_jax.rl.data import load_numbered_examples
from tlt_jax.rl.loss import SHARED_KNOBS, LossConfig
from tlt_jax.rl.phases import rl_prompts
from tlt_jax.rl.rewards import RewardFn, make_reward
from tlt_jax.rl.tasks import Example, Task, TaskSlice, make_task
from tlt_jax.rl.tokenizer import prompt_ids, train_tokenizer
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.run_log import write_json
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.tuner import TUNERS, Tuner, make_tuner


# ---------------------------------------------------------------- validation


def validate_config(config: ml_collections.ConfigDict, num_devices: int | None = None,
                    writes_metrics: bool = True) -> None:
  """`check_config` (the mesh must fit `num_devices` devices, when given), then every component
  below is built once (their dataclasses check their own ranges), and no knob the run does not
  read is set (`unread_knobs`; writes_metrics=False: a job that writes no metrics, so
  logging.* is not read either). Raises ConfigError naming the key and the fix."""
  import_plugins(config.get("plugins", ""))  # what they register is named by the config
  check_config(config, num_devices)
  # The tuner first: its errors name the strategy key; the drafters' settings parse it too.
  builders = (model_config, engine_config, sampling_params, configured_strategy,
              make_tuner_from_config,
              run_drafter_settings, spot_config, algorithm_from_config, reward_from_config,
              policy_adamw, sft_adamw, drafter_opt_config,
              functools.partial(drafter_opt_config, warmup=True), task_from_config)
  for build in builders:
    try:
      build(config)
    except (ValueError, ImportError) as e:  # ImportError: a task's optional package
      raise ConfigError(str(e)) from None
  _check_drafters(config)
  warnings = _check_families(config)
  for knob in unread_knobs(config, writes_metrics):
    raise ConfigError(knob.message)
  for line in warnings:
    print(f"warning: {line}", file=sys.stderr)
  _check_corpus_rows(config)
  limit, source = config.model.max_position_embeddings, "model.max_position_embeddings"
  if config.model.path:  # the checkpoint's own limit
    with open(os.path.join(config.model.path, "config.json")) as f:
      limit = json.load(f).get("max_position_embeddings", limit)
    source = f"max_position_embeddings of {config.model.path}/config.json"
  # The rollout's requests (every RL job) and python -m tlt_jax.generate's: no position past
  # the model's limit, where its RoPE was never trained.
  for section, prompt in (("rollout", "max_prompt_len"), ("generate", "prompt_len")):
    longest = config[section][prompt] + config[section].max_new_tokens
    if longest > limit:
      raise ConfigError(f"{section}.{prompt} + {section}.max_new_tokens = {longest} exceeds "
                        f"{source}={limit}; lower them")


def _check_drafters(config: ml_collections.ConfigDict) -> None:
  """The drafters the strategies name are among drafter.names (when it is set)."""
  d, key = config.drafter, _strategies_key(config)
  named = drafters_named(_tuner_strategies(config))
  if d.names and (missing := [n for n in named if n not in d.names]):
    raise ConfigError(f"{key} drafts with {missing}, which drafter.names={tuple(d.names)!r} "
                      f"does not list; add them (or set drafter.names=() for the drafters the "
                      f"strategies name)")


def _check_families(config: ml_collections.ConfigDict) -> list[str]:
  """Each drafter the run uses checks its settings against the strategies that draft with it
  (the tuner's, and rollout.speculative.strategy, the warm-up's; its `check_strategies`):
  ConfigError for settings that cannot work; returns the warning lines of the rest."""
  where = f"{_strategies_key(config)} or rollout.speculative.strategy"
  strategies = (*_tuner_strategies(config), configured_strategy(config))
  warnings = []
  for name in run_drafters(config):
    drafting = [s for s in strategies if name in s.drafts]
    try:
      warnings += drafter_class(name).check_strategies(
          drafter_settings(config, name), drafting, f"drafter.{name}", where)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  return warnings


class UnreadKnob(NamedTuple):
  """A knob set away from its default that the run does not read: `reader` says why (what
  would read it), `fix` how to make the run read it."""
  key: str
  value: object
  default: object
  reader: str
  fix: str

  @property
  def message(self) -> str:
    return (f"{self.key}={self.value!r} is set but {self.reader}; {self.fix}, or leave "
            f"{self.key} at its default ({self.default!r})")


# The tuners' own knobs under rollout.speculative, with the constructor parameters that take
# them: each is read by the tuners whose constructors have one (`make_tuner_from_config`
# passes it to those alone).
TUNER_KNOBS = {"epsilon": ("epsilon",), "window": ("window",), "plain_arm": ("plain_arm",),
               "explore_iterations": ("explore_iterations",),
               "bucket_thresholds": ("thresholds",), "arms": ("arms", "strategies")}


def unread_knobs(config: ml_collections.ConfigDict,
                 writes_metrics: bool = True) -> list[UnreadKnob]:
  """Every knob set away from its default (base_config's) that the run does not read: another
  algorithm's section rl.<name>; a shared loss knob rl.<knob> the algorithm does not read (its
  `reads`); a drafter loss knob (drafter.ce_weight, ...) that no drafter the run trains reads
  (their `loss_reads`); the section drafter.<name> of a drafter the run does not use;
  a tuner knob the configured tuner does not take (with SD on); the W&B project without W&B;
  and with writes_metrics=False (a job that writes no metrics.jsonl) TensorBoard and W&B.
  A run must not look as if it used them: `validate_config` refuses the first."""
  defaults, out = base_config(), []

  def unread(section: str, knob: str, reader: str, fix: str) -> None:
    value, default = _get(config, section)[knob], _get(defaults, section)[knob]
    if value != default:
      out.append(UnreadKnob(f"{section}.{knob}", value, default, reader, fix))

  r = config.rl
  for name in ALGORITHMS:
    if name != r.algorithm and name in r:
      for knob in r[name]:
        unread(f"rl.{name}", knob, f"rl.algorithm={r.algorithm!r} does not read it",
               f"set rl.algorithm={name!r}")
  algorithm = ALGORITHMS.get(r.algorithm)
  if algorithm is not None:  # an unknown name is refused, naming the allowed ones, before this
    own = f" and its own rl.{r.algorithm}.*" if dataclasses.fields(algorithm.Settings) else ""
    reads = ", ".join(f"rl.{k}" for k in algorithm.reads) or "none of them"
    for knob in SHARED_KNOBS:
      if knob not in algorithm.reads:
        unread("rl", knob, f"rl.algorithm={r.algorithm!r} does not read it (of the shared loss "
               f"knobs it reads {reads}{own})", "choose another rl.algorithm")
  used, key = run_drafters(config), _strategies_key(config)
  trained = [name for name in used if drafter_class(name).trained]
  for knob in LOSS_KNOBS:
    if not any(knob in drafter_class(name).loss_reads for name in trained):
      takers = [name for name, cls in DRAFTERS.items()
                if cls.trained and knob in cls.loss_reads]
      unread("drafter", knob, f"no drafter the run trains reads it (it trains {trained})",
             f"train a drafter whose loss reads it ({', '.join(takers)})")
  for name, cls in DRAFTERS.items():
    if name not in used and name in config.drafter:
      for knob in config.drafter[name]:
        unread(f"drafter.{name}", knob, f"the run does not use drafter {name!r} (its drafters: "
               f"{list(used)}, from {key})", f"name it in a strategy (e.g. '4,2,8,{name}') or "
               f"drafter.names")
  sd = config.rollout.speculative
  if sd.enable:
    for knob, params in TUNER_KNOBS.items():
      readers = [t for t in TUNERS
                 if set(params) & set(inspect.signature(TUNERS[t]).parameters)]
      if sd.tuner not in readers:
        unread("rollout.speculative", knob, f"rollout.speculative.tuner={sd.tuner!r} does not "
               f"read it", f"use the {' or '.join(map(repr, readers))} tuner")
  w = config.drafter.warmup
  if w.responses:
    for knob in ("num_prompts", "samples_per_prompt", "temperature"):
      unread("drafter.warmup", knob, f"drafter.warmup.responses={w.responses!r} replaces the "
             f"responses it would generate", "leave it at its default")
  g = config.logging
  if not writes_metrics:
    for knob in ("tensorboard", "wandb"):
      unread("logging", knob, "this job writes no metrics", "log a job that does (train, sft, "
             "warmup_drafter)")
  elif not g.wandb:
    unread("logging", "wandb_project", "logging.wandb=False (no W&B run)",
           "set logging.wandb=True")
  return out


def _get(config: ml_collections.ConfigDict, dotted: str):
  for part in dotted.split("."):
    config = config[part]
  return config


def drop_values_made_unread(config: ml_collections.ConfigDict,
                            file_config: ml_collections.ConfigDict,
                            given) -> ml_collections.ConfigDict:
  """`config` (a config file's, `file_config`, with the command line's values for the keys in
  `given`) with each knob that only the command line made unread reset to its default: a value
  the file set for a part of the run the command line switched off (the default config's EAGLE
  drafter path, once the arms draft with weightless drafters alone) goes with that part. A
  knob given on the command line, or unread in the file's own config, stays (and is refused)."""
  try:
    kept = set(given) | {k.key for k in unread_knobs(file_config)}
    stale = [k for k in unread_knobs(config) if k.key not in kept]
  except ValueError:  # a value validate_config refuses in one line, naming it
    return config
  with config.unlocked():
    for knob in stale:
      section, _, leaf = knob.key.rpartition(".")
      _get(config, section)[leaf] = knob.default
  return config


def _tuner_strategies(config: ml_collections.ConfigDict) -> list[Strategy]:
  """The strategies the configured tuner chooses from (the fixed tuner's one, or the arms)."""
  sd = config.rollout.speculative
  values = (sd.strategy,) if sd.tuner == "fixed" else tuple(sd.arms)
  return [Strategy.parse(v) for v in values]


def _strategies_key(config: ml_collections.ConfigDict) -> str:
  sd = config.rollout.speculative
  return "rollout.speculative." + ("strategy" if sd.tuner == "fixed" else "arms")


def run_drafters(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The drafters a run uses: drafter.names, or those the tuner's strategies name
  (rollout.speculative.arms, or .strategy with the fixed tuner), whether SD is on or not.
  The RL job drafts with them (with SD), trains the trained ones (with spot training) and
  exports them; the warm-up trains their trained ones."""
  return tuple(config.drafter.names) or drafters_named(_tuner_strategies(config))


def _check_corpus_rows(config: ml_collections.ConfigDict) -> None:
  """rollout.speculative.corpus_rows no larger than the largest group a suffix-drafting row
  copies from (more rows are never filled, and each SD call holds them all)."""
  sd, r = config.rollout.speculative, config.rollout
  strategies = (sd.strategy,) if sd.tuner == "fixed" else tuple(sd.arms)
  if not sd.enable or not any(reads_corpus(Strategy.parse(s).drafts) for s in strategies):
    return
  groups = {"rl.num_samples": config.rl.num_samples, "rl.eval_samples": config.rl.eval_samples,
            "drafter.warmup.samples_per_prompt": config.drafter.warmup.samples_per_prompt}
  limit = max(EngineConfig.corpus_rows, *groups.values())
  if sd.corpus_rows > limit:
    gib = r.max_batch * sd.corpus_rows * r.max_new_tokens * 4 / 2 ** 30
    raise ConfigError(
        f"rollout.speculative.corpus_rows={sd.corpus_rows} is more responses than any group "
        f"holds ({', '.join(f'{k}={v}' for k, v in groups.items())}): a row copies only from "
        f"its group's other responses, and every SD call would hold a [{r.max_batch}, "
        f"{sd.corpus_rows}, {r.max_new_tokens}] int32 array ({gib:.1f} GiB); set it to at "
        f"most {limit}")


# ---------------------------------------------------------------- the subsystems' settings


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  """The ModelConfig described by `config.model` (read from model.path when it is set), as
  prefill/decode/verify run it (see `training_model_config` for training)."""
  m = config.model
  runtime = dict(dtype=m.dtype, param_dtype=m.param_dtype, attention_impl=m.attention_impl,
                 scan_layers=m.scan_layers == "all", remat=m.remat,
                 attention_query_chunk=m.attention_query_chunk,
                 numerics=m.numerics,
                 feature_layers=tuple(config.drafter.eagle.feature_layers))
  if m.path:
    return load_hf_config(m.path, **runtime)
  try:
    return build_from(ModelConfig, m, rope=RopeConfig(theta=m.rope_theta, rope_type=ROPE_TYPES[0]),
                      **ARCHITECTURE_FLAGS.get(m.model_type, {}), **runtime)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def training_model_config(config: ml_collections.ConfigDict, cfg: ModelConfig) -> ModelConfig:
  """The policy config for training forward passes (log-probs, updates): scanned layers
  unless model.scan_layers is 'none'."""
  return cfg.replace(scan_layers=config.model.scan_layers != "none")


def engine_config(config: ml_collections.ConfigDict) -> EngineConfig:
  """The rollout EngineConfig; SD is off (threshold 0) unless rollout.speculative.enable."""
  r = config.rollout
  return build_from(EngineConfig, r, sd_threshold=r.sd_threshold if r.speculative.enable else 0,
                    shared_sd_max_batch=r.speculative.shared_max_batch,
                    corpus_rows=r.speculative.corpus_rows)


def sampling_params(config: ml_collections.ConfigDict) -> SamplingParams:
  """Rollout sampling (temperature 0 = greedy)."""
  return build_from(SamplingParams, config.rollout)


def run_drafter_settings(config: ml_collections.ConfigDict) -> dict:
  """name -> Settings of every drafter the run uses (`run_drafters`)."""
  return {name: drafter_settings(config, name) for name in run_drafters(config)}


def drafter_settings(config: ml_collections.ConfigDict, name: str):
  """The Settings of drafter `name` from its section drafter.<name> (defaults without one)."""
  cls = DRAFTERS[name]
  section = config.drafter[name] if name in config.drafter else {}
  return build_from(cls.Settings, section)


def drafter_opt_config(config: ml_collections.ConfigDict, warmup: bool = False) -> DrafterOptConfig:
  """The drafter's AdamW settings and loss: online (spot training) or offline warm-up."""
  d = config.drafter
  if not warmup:
    return build_from(DrafterOptConfig, d, section="drafter")
  return build_from(DrafterOptConfig, d, learning_rate=d.warmup.learning_rate,
                    lr_warmup_steps=d.warmup.lr_warmup_steps, section="drafter.warmup")


def spot_config(config: ml_collections.ConfigDict) -> SpotConfig:
  """The SpotConfig of drafter.spot."""
  return build_from(SpotConfig, config.drafter.spot)


def configured_strategy(config: ml_collections.ConfigDict) -> Strategy:
  """rollout.speculative.strategy: the fixed tuner's, and always the warm-up's accept-length
  check's, so checked under every tuner (ConfigError naming the key)."""
  value = config.rollout.speculative.strategy
  try:
    strategy = Strategy.parse(value)
    check_strategy(strategy)
  except ValueError as e:
    raise ConfigError(f"rollout.speculative.strategy={value!r}: {e}") from None
  return strategy


def make_tuner_from_config(config: ml_collections.ConfigDict) -> Tuner:
  """The strategy tuner that rollout.speculative describes (seeded by config.seed); a bad
  strategy's ValueError names the key that holds it."""
  sd = config.rollout.speculative
  key, value = ("strategy", sd.strategy) if sd.tuner == "fixed" else ("arms", tuple(sd.arms))
  if sd.enable and not value:
    raise ValueError(f"rollout.speculative.arms=() gives the {sd.tuner} tuner no strategy, so "
                     f"SD would never run; give at least one arm (e.g. ('4,2,8',)) or set "
                     f"rollout.speculative.enable=False")
  thresholds = tuple(sd.bucket_thresholds)
  try:
    if sd.tuner == "fixed":
      return make_tuner("fixed", strategy=sd.strategy)
    if sd.tuner == "table":
      return make_tuner("table", thresholds=thresholds, strategies=tuple(sd.arms))
    if sd.tuner == "cheapest":
      return make_tuner("cheapest", thresholds=thresholds,
                        arms=[tuple(sd.arms)] * len(thresholds), epsilon=sd.epsilon,
                        window=sd.window, seed=config.seed,
                        explore_iterations=sd.explore_iterations,
                        iterations_per_call=config.rollout.iterations_per_call)
    return make_tuner(sd.tuner, thresholds=thresholds, arms=[tuple(sd.arms)] * len(thresholds),
                      epsilon=sd.epsilon, window=sd.window, seed=config.seed,
                      plain_arm=sd.plain_arm)
  except ValueError as e:
    raise ValueError(f"rollout.speculative.{key}={value!r}: {e}") from None


def loss_config(config: ml_collections.ConfigDict) -> LossConfig:
  """The LossConfig of config.rl."""
  return build_from(LossConfig, config.rl, sampling=sampling_params(config))


def algorithm_from_config(config: ml_collections.ConfigDict) -> Algorithm:
  """The RL algorithm rl.algorithm names, with the loss of config.rl, its knobs (rl.<name>)
  and its check of the group size rl.num_samples."""
  name = config.rl.algorithm
  return make_algorithm(name, loss_config(config), config.rollout.max_new_tokens,
                        config.rl.get(name), group_size=config.rl.num_samples)


def reward_from_config(config: ml_collections.ConfigDict) -> RewardFn:
  """The reward rl.reward names, with the task's answer check and format:
  `fn(prompts, completions, **columns) -> list[float]`."""
  return make_reward(config.rl.reward, format_bonus=config.rl.format_bonus,
                     answer_fallback=config.rl.answer_fallback, task=scoring_task(config))


def answer_check(config: ml_collections.ConfigDict) -> RewardFn:
  """What counts as a right answer (accuracy in the metrics and the held-out evaluation):
  the task's answer reward (with rl.answer_fallback) at its full score, 1.0."""
  reward = scoring_task(config).answer_reward(config.rl.answer_fallback)

  def right_answer(prompts, completions, **columns) -> list[float]:
    return [float(v >= 1.0) for v in reward(prompts, completions, **columns)]
  return right_answer


def scoring_task(config: ml_collections.ConfigDict) -> Task:
  """The task whose answer check, format and evaluation breakdown the job uses: the
  configured task, or for task.data_path's problems the '####' / '\\boxed' defaults."""
  return Task() if config.task.data_path else task_from_config(config)


def policy_adamw(config: ml_collections.ConfigDict) -> AdamWConfig:
  """The GRPO optimizer of config.rl: constant after an optional linear warm-up."""
  return build_from(AdamWConfig, config.rl, section="rl")


def sft_adamw(config: ml_collections.ConfigDict) -> AdamWConfig:
  """The SFT optimizer of config.sft: warm-up, then a cosine decay over sft.steps."""
  return build_from(AdamWConfig, config.sft, decay_steps=config.sft.steps, section="sft")


def task_from_config(config: ml_collections.ConfigDict, eval_split: bool = False) -> Task:
  """The task `config.task` names and describes (its held-out problems with eval_split)."""
  t = config.task
  return make_task(t, t.eval_seed if eval_split else t.seed)


# ---------------------------------------------------------------- loaded and built objects


def load_tokenizer_for(config: ml_collections.ConfigDict):
  """tokenizer.path, else the tokenizer saved with model.path. RL and drafter jobs need a
  fixed tokenizer (the policy's); training one is the SFT job's business."""
  path = config.tokenizer.path or config.model.path
  if not path:
    raise ConfigError("no tokenizer: set tokenizer.path or model.path to a folder with "
                      "tokenizer files (e.g. assets/tiny-policy)")
  key = "tokenizer.path" if config.tokenizer.path else "model.path"
  try:
    return load_tokenizer(path)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{key}={path!r}: no usable tokenizer ({first_line(e)})") from None


def load_policy(config: ml_collections.ConfigDict, mesh: Mesh) -> tuple[ModelConfig, dict]:
  """(ModelConfig, params placed on `mesh` by their logical axes): model.path's weights, or
  random ones of the configured shape (seeded by config.seed)."""
  cfg = model_config(config)
  rules = tuple(config.mesh.rules)
  if config.model.path:
    try:
      return cfg, load_hf_params(config.model.path, cfg, mesh, rules)
    except (OSError, ValueError) as e:
      raise ConfigError(f"model.path={config.model.path!r}: {first_line(e)}") from None
  init = functools.partial(init_params, cfg)
  shardings = logical_shardings(param_logical_axes(cfg), mesh, rules,
                                jax.eval_shape(init, jax.random.key(0)))
  return cfg, jax.jit(init, out_shardings=shardings)(jax.random.key(config.seed))


def load_drafters_for(config: ml_collections.ConfigDict, cfg: ModelConfig,
                      fresh: bool = False, names=None) -> dict[str, Drafter]:
  """name -> drafter, for each drafter the run uses (`run_drafters`; or those `names` lists),
  from its section drafter.<name>: a trained one with the weights of drafter.<name>.path (its
  settings must match the section's), or random ones (fresh=True ignores the paths; without
  it, a family whose fresh weights cannot draft, such as EAGLE with a reduced vocabulary,
  needs its path)."""
  out = {}
  for name in run_drafters(config) if names is None else names:
    cls, settings = DRAFTERS[name], drafter_settings(config, name)
    if not cls.trained:
      out[name] = make_drafter(name, settings)
      continue
    path = config.drafter[name].path
    if path and not fresh:
      try:
        _, saved, params = load_drafter(path, cfg, expect=name)
      except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"drafter.{name}.path={path!r}: {first_line(e)}") from None
      if saved != settings:
        raise ConfigError(f"drafter.{name}.path={path!r} holds a drafter {saved} but the "
                          f"config's drafter.{name} section describes {settings}; make them "
                          f"agree or set drafter.{name}.path=''")
    else:
      if not fresh and (problem := cls.untrained_problem(settings)):
        raise ConfigError(problem)
      # Each family its own stream, EAGLE's the one it always had (seed + 1).
      key = jax.random.key(config.seed + 1 + list(DRAFTERS).index(name))
      try:
        params = cls.init_params(settings, cfg, key)
      except ValueError as e:  # e.g. a draft vocabulary larger than the policy's
        raise ConfigError(str(e)) from None
    out[name] = make_drafter(name, settings, params)
  return out


def first_line(e: Exception) -> str:
  """An exception's message cut to its first line (its type's name when it has none)."""
  text = str(e).strip()
  return text.splitlines()[0] if text else type(e).__name__


def make_engine(config: ml_collections.ConfigDict, cfg: ModelConfig, params: dict, mesh: Mesh,
                eos_id: int, pad_id: int, drafters: dict[str, Drafter] | None = None,
                log_features: bool = False, speculative: bool | None = None,
                tuner=None, **engine_overrides):
  """The rollout engine of config.rollout; SD when drafters are given (name -> drafter,
  e.g. `load_drafters_for`; the engine builds those its tuner's strategies name, which must
  all be there) and rollout.speculative.enable (or `speculative`) says so. engine_overrides
  replace EngineConfig fields (e.g. max_new_tokens); tuner replaces the configured one."""
  ec = dataclasses.replace(engine_config(config), eos_id=eos_id, pad_id=pad_id, **engine_overrides)
  use_sd = config.rollout.speculative.enable if speculative is None else speculative
  if not use_sd or drafters is None:
    ec, drafters = dataclasses.replace(ec, sd_threshold=0), None
  if drafters is not None and tuner is None:
    tuner = make_tuner_from_config(config)
  return RolloutEngine(cfg, params, mesh, ec, drafters=drafters, tuner=tuner,
                       rules=tuple(config.mesh.rollout_rules), log_features=log_features)


def _data_file(config: ml_collections.ConfigDict, eval_split: bool) -> list[Example]:
  key = "eval_data_path" if eval_split else "data_path"
  if not config.task[key]:
    raise ConfigError(f"task.data_path is set but task.{key} is not: held-out problems need "
                      f"their own file")
  return [example for _, example in _data_records(config, key)]


def _data_records(config: ml_collections.ConfigDict, key: str) -> list[tuple[int, Example]]:
  """(line number, Example) of task.<key>'s file; ConfigError naming the key when it is bad."""
  try:
    return load_numbered_examples(config.task[key])
  except (OSError, ValueError) as e:
    raise ConfigError(f"task.{key}: {first_line(e)}") from None


# Beside a tokenizer trained by the SFT job: the settings it was trained from.
TRAINED_FROM = "trained_from.json"


def _tokenizer_settings(config: ml_collections.ConfigDict) -> dict:
  """The settings a trained tokenizer depends on: its own and the training problems'."""
  return {k: v for k, v in flat_settings(config).items()
          if k in ("tokenizer.vocab_size", "tokenizer.num_train_examples")
          or (k.startswith("task.") and not k.startswith("task.eval_"))}


def sft_tokenizer(config: ml_collections.ConfigDict, workdir: str, write: bool = True):
  """tokenizer.path if set; else the tokenizer saved in WORKDIR/tokenizer by an earlier run
  (so a resumed run keeps its token ids), if it was trained from the same settings (else a
  ConfigError names the first that differs); else a new BPE trained on training problems
  (the same on every process), saved there with its settings when `write`."""
  if config.tokenizer.path:
    return load_tokenizer_for(config)
  saved = os.path.join(workdir, "tokenizer")
  settings = _tokenizer_settings(config)
  if os.path.isdir(saved):
    recorded = os.path.join(saved, TRAINED_FROM)
    if os.path.isfile(recorded):  # older runs saved none: their tokenizer is taken as is
      with open(recorded) as f:
        before = json.load(f)
      for key in sorted(set(before) | set(settings)):
        if before.get(key) != settings.get(key):
          raise ConfigError(
              f"{saved} was trained with {key}={before.get(key)!r}, this config has "
              f"{settings.get(key)!r}; use another --workdir (or remove {saved} and the "
              f"checkpoints next to it to train a new tokenizer there)")
    return load_tokenizer(saved)
  examples = task_from_config(config).examples(config.tokenizer.num_train_examples)
  tok = train_tokenizer([e.prompt for e in examples] + [e.solution for e in examples],
                        config.tokenizer.vocab_size)
  if write:
    tok.save_pretrained(saved)
    write_json(os.path.join(saved, TRAINED_FROM), settings)
  return tok


def check_prompt_lengths(config: ml_collections.ConfigDict, tokenizer,
                         data_files: bool = True) -> None:
  """Once, at a job's start, before anything compiles: ConfigError when a problem the job may
  draw has more prompt tokens (chat template included) than rollout.max_prompt_len: every
  record of task.data_path and task.eval_data_path, else the task's `Task.longest_prompts`.
  data_files=False: the task only (SFT)."""
  limit = config.rollout.max_prompt_len
  if data_files and config.task.data_path:
    for key in ("data_path", "eval_data_path"):
      if not config.task[key]:
        continue
      for lineno, example in _data_records(config, key):
        n = len(prompt_ids(tokenizer, example.prompt))
        if n > limit:
          raise ConfigError(f"task.{key}: {config.task[key]}:{lineno}: the prompt has {n} "
                            f"tokens, more than rollout.max_prompt_len={limit}; raise "
                            f"rollout.max_prompt_len to at least {n} or shorten the prompt")
    return
  n = max(len(prompt_ids(tokenizer, p)) for p in task_from_config(config).longest_prompts())
  if n > limit:
    arithmetic = config.task.name == "arithmetic"
    raise ConfigError(f"rollout.max_prompt_len={limit} is below the {config.task.name} "
                      f"task's longest prompt, {n} tokens"
                      f"{f' (task.max_ops={config.task.max_ops})' if arithmetic else ''}; "
                      f"set rollout.max_prompt_len={n} or more"
                      f"{', or lower task.max_ops' if arithmetic else ''}")


def training_set(config: ml_collections.ConfigDict, size: int) -> Sequence[Example]:
  """The training problems: task.data_path's records, else the first `size` problems of
  the task (generated on demand)."""
  if config.task.data_path:
    return _data_file(config, eval_split=False)
  return TaskSlice(task_from_config(config), size)


def task_examples(config: ml_collections.ConfigDict, count: int, start: int = 0,
                  eval_split: bool = False) -> list[Example]:
  """Problems start .. start+count of the training or held-out set (a file's records, or
  the task's); a file may hold fewer."""
  if config.task.data_path:
    return _data_file(config, eval_split)[start:start + count]
  return task_from_config(config, eval_split).examples(count, start=start)


def task_prompts(config: ml_collections.ConfigDict, tokenizer, count: int, start: int = 0,
                 eval_split: bool = False) -> tuple[list, list[list[int]]]:
  """(examples, prompt token ids) of problems start .. start+count (see task_examples)."""
  examples = task_examples(config, count, start, eval_split)
  return examples, rl_prompts(tokenizer, examples, config)
