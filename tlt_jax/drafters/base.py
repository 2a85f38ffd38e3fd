"""What every drafter is: the interface the speculative step drives, what it proposes, and
the defaults a new family inherits.

A drafter is a pytree (a `flax.struct.dataclass` subclassing `Drafter`, or `TrainedDrafter`
when it has weights): its settings are a static field `settings` (an instance of its
`Settings` dataclass, whose fields are its config section `drafter.<name>`), a trained
drafter's weights the field `params`. Its methods are pure and jittable; `policy` is a
`tlt_jax.models.policy.Policy`:

  init_state(cfg, batch, capacity) -> state or None   (cfg: the policy's ModelConfig)
      Its per-row state for `batch` rows of up to `capacity` tokens (row-first arrays with
      `row_axes()` / `logical_axes()`, like a KVCache); None (the default) for a stateless
      drafter, which then gets no prefill or catch-up calls.
  prefill(policy, state, prompts [B, P], lengths [B], hidden [B, P, F]) -> state
      Reads the prompts and the policy's features of them.
  catch_up(policy, state, tokens [B, A], prev_features [B, A, F], count [B]) -> state
      Appends the first count[b] pairs (x_s, f_{s-1}) of committed tokens (a plain step's one
      token, or an SD iteration's accepted path). After a `propose` of its own the drafter
      already holds the root pair, and the pairs start after it.
  propose(policy, state, ctx: DraftContext, strategy, limits) -> (Candidates, state)
      Candidates for the next tokens after ctx.root, at most `candidate_count(depth, topk)`
      of them. limits: None, or int32 [2] (depth, verify_tokens) of a smaller strategy run in
      `strategy`'s shapes: candidates deeper than limits[0] must score -inf.
  candidate_count(depth, topk) -> int  (a staticmethod)
  reads_corpus / reads_prompt: bool  (class attributes) whether it reads DraftContext.corpus
      (other responses, which the engine then builds for its programs) / DraftContext.prompt
      (the row's prompt, which the generation state then keeps)
  check_strategies(settings, strategies, section, where) -> warnings  (a classmethod,
      optional) its own checks of its settings against the run's strategies that draft with
      it, run where the config is checked
  example(cfg, seed, settings) -> drafter  (a classmethod, optional) an untrained drafter of the family
      whose drafts are sometimes right and sometimes wrong: what the shared exactness tests
      and the benchmarks draft with, so a new family is covered by them as it registers

A trained drafter (`TrainedDrafter`) also has:
  param_specs(settings, cfg) -> ParamSpec tree  (a classmethod): shapes, logical axes and
      initialisers of its weights; random weights, shardings, optimizer state, checkpoints and
      the HF-style export follow from it.
  loss(policy, batch: Windows, **options) -> (scalar, metrics with 'loss', 'top1', 'tokens')
      on packed windows of the policy's features (`Windows`, below);
      options: the shared loss knobs of the config's drafter section that it names in
      `loss_reads`.
  and may override `init_params`, `warm_start` (adapt fresh weights to the policy's responses
  before the warm-up), `untrained_problem`, and the export hooks (`hf_tensors`,
  `extra_tensors`, `extra_tensor_names`, `check_loaded`, `export_config`,
  `settings_from_saved`).

The registry in `tlt_jax.drafters` names them; a strategy's `drafts` says which propose.
Candidates of several drafters are merged into one tree (`tlt_jax.speculative.tree`), and
verification never reads a drafter's scores or probabilities: whatever is drafted, the
emitted tokens are those of plain decoding.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.knobs import NoSettings
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.params import ParamSpec, init_from_specs, logical_axes_from_specs
from tlt_jax.registry import register


# name -> drafter class, in registration order: the package registers its own families in the
# order eagle, suffix, mtp, prompt_lookup (tlt_jax.drafters imports them so), and a family's
# place seeds its fresh weights (`components.load_drafters_for`).
DRAFTERS: dict[str, type] = {}


def register_drafter(name: str):
  """Class decorator: registers a `Drafter` subclass as drafter `name` (strategies name it,
  its knobs are the section drafter.<name>); ValueError for a name already registered."""
  return register(DRAFTERS, name, "drafter")


@flax.struct.dataclass
class Candidates:
  """Draft candidates below one root, in topological order (a parent before its children).

  tokens [B, C] int32 policy token ids; parents [B, C] int32: the parent's index among these
  candidates, -1 for a child of the root; scores [B, C] float32: a parent never scores below
  its children (the tree keeps the best-scored candidates), -inf for no candidate.
  """
  tokens: jax.Array
  parents: jax.Array
  scores: jax.Array


@flax.struct.dataclass
class DraftContext:
  """What a drafter may read at one SD iteration.

  root [B] int32: the newest token (sampled, in no cache yet); features [B, F]: the policy's
  features of the token before it; active [B] bool: running rows; out [B, N] int32 and
  num_out [B] int32: each row's generated tokens so far (root included, 0 past num_out);
  corpus [B, S, L] int32 or None: other responses a row may copy from (its group's finished
  siblings, earlier responses to its prompt), -1 past their ends; prompt [B, W] int32 or
  None: each row's prompt, -1 past its end (kept when a drafter `reads_prompt`).
  """
  root: jax.Array
  features: jax.Array
  active: jax.Array
  out: jax.Array
  num_out: jax.Array
  corpus: jax.Array | None = None
  prompt: jax.Array | None = None


@flax.struct.dataclass
class Windows:
  """A batch of packed windows, all [B, W] except features [B, W, F].

  segment_ids: 1, 2, ... per sample within a row, 0 for padding.
  positions: position of each token within its sample (restarts at 0).
  loss_mask: slots whose prediction is trained (those predicting response tokens).
  """
  tokens: jax.Array
  features: jax.Array
  segment_ids: jax.Array
  positions: jax.Array
  loss_mask: jax.Array


def previous_features(features: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """f_{s-1} for every slot, zeros where slot s starts a segment: [B, W, F]."""
  prev = jnp.concatenate([jnp.zeros_like(features[:, :1]), features[:, :-1]], axis=1)
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return jnp.where(starts[..., None], 0.0, prev)



class Drafter:
  """The defaults of the interface (see the module docstring): no settings, no weights, no
  state, reads neither a corpus nor the prompt."""
  Settings: type = NoSettings
  trained = False
  reads_corpus = False
  reads_prompt = False

  def init_state(self, cfg: ModelConfig, batch: int, capacity: int) -> None:
    del cfg, batch, capacity
    return None

  @classmethod
  def example(cls, cfg: ModelConfig, seed: int = 0, settings=None) -> Drafter:
    """A drafter of this family for a policy of shape `cfg` with `settings` (None: the
    defaults) and, for a trained family, random weights from `seed`: what the shared
    exactness tests draft with."""
    del cfg, seed
    fields = getattr(cls, "__dataclass_fields__", {})
    if "settings" not in fields:  # a family without knobs may have no field
      return cls()
    return cls(settings=cls.Settings() if settings is None else settings)

  @classmethod
  def check_strategies(cls, settings, strategies: list, section: str, where: str) -> list[str]:
    """The family's own checks of `settings` (its config section `section`, e.g.
    'drafter.eagle') against the run's strategies that draft with it (`where`: the config keys
    they come from). ValueError (one line, naming the knob and the fix) for settings that
    cannot work with them; returns warning lines for settings that work but are unwise.
    Default: no checks."""
    del settings, strategies, section, where
    return []


def chain_count(depth: int, topk: int) -> int:
  """Candidates of a drafter that proposes one chain: `depth` tokens (topk unused)."""
  del topk
  return depth


def beam_tree_count(depth: int, topk: int) -> int:
  """Candidates of a beam search over `depth` levels: topk children of the root, then topk
  children of each of the topk best beams per further level."""
  return topk + (depth - 1) * topk * topk


def _flat_specs(specs: dict, prefix: tuple = ()) -> list[tuple[tuple[str, ...], ParamSpec]]:
  """(path, ParamSpec) of every weight of a spec tree, in insertion order."""
  out = []
  for key, value in specs.items():
    if isinstance(value, ParamSpec):
      out.append(((*prefix, key), value))
    else:
      out += _flat_specs(value, (*prefix, key))
  return out


class TrainedDrafter(Drafter):
  """A drafter with weights (`params`): random weights, logical axes and the export follow
  from its `param_specs`. `loss_reads`: the shared loss knobs (drafter.ce_weight,
  drafter.train_depth, drafter.train_step_decay) its `loss` takes as options."""
  trained = True
  loss_reads: tuple[str, ...] = ()
  # The architecture named in its exported config.json (`architectures`).
  hf_architecture = ""

  @classmethod
  def param_specs(cls, settings, cfg: ModelConfig) -> dict:
    raise NotImplementedError(f"{cls.__name__} must define param_specs(settings, cfg)")

  @classmethod
  def init_params(cls, settings, cfg: ModelConfig, rng: jax.Array) -> dict:
    """Random weights (a plain dict in cfg.param_dtype; see `param_specs`)."""
    return init_from_specs(cls.param_specs(settings, cfg), rng, cfg.jnp_param_dtype)

  @classmethod
  def logical_axes(cls, settings, cfg: ModelConfig) -> dict:
    """The logical axis names of its weights (a PartitionSpec pytree)."""
    return logical_axes_from_specs(cls.param_specs(settings, cfg))

  @classmethod
  def example(cls, cfg: ModelConfig, seed: int = 0, settings=None) -> TrainedDrafter:
    """Random weights (`init_params` from `seed`) for `settings` (None: the defaults)."""
    settings = cls.Settings() if settings is None else settings
    return cls(params=cls.init_params(settings, cfg, jax.random.key(seed)), settings=settings)

  @classmethod
  def untrained_problem(cls, settings) -> str | None:
    """Why fresh random weights cannot draft for these settings (None: they can), e.g. a
    reduced vocabulary that only the warm-up chooses."""
    del settings
    return None

  @classmethod
  def warm_start(cls, settings, params: dict, policy_params: dict, cfg: ModelConfig,
                 responses: list[list[int]], say=print) -> dict:
    """Fresh weights adapted to the policy's responses before the warm-up trains them
    (default: as they are)."""
    del settings, policy_params, cfg, responses, say
    return params

  # ---------------------------------------------------------------- export (HF-style)

  @classmethod
  def hf_tensors(cls, settings, cfg: ModelConfig) -> list[tuple]:
    """(safetensors name, params path, to_ours, to_hf) of every weight: by default its
    params path joined by '.', stored as it is."""
    return [(".".join(path), path, None, None)
            for path, _ in _flat_specs(cls.param_specs(settings, cfg))]

  @classmethod
  def extra_tensors(cls, settings, params: dict, cfg: ModelConfig) -> dict:
    """Tensors exported besides the weights (name -> numpy array; default none)."""
    del settings, params, cfg
    return {}

  @classmethod
  def extra_tensor_names(cls, settings) -> set[str]:
    """The names `extra_tensors` exports for these settings."""
    del settings
    return set()

  @classmethod
  def check_loaded(cls, settings, params: dict, extras: dict, cfg: ModelConfig) -> None:
    """Raises ValueError (one line) when loaded weights and `extra_tensors` disagree."""
    del settings, params, extras, cfg

  @classmethod
  def export_config(cls, settings) -> dict:
    """Top-level entries of the exported config.json besides the family and settings."""
    del settings
    return {}

  @classmethod
  def settings_from_saved(cls, saved: dict):
    """Its Settings from an exported config.json's 'drafter' section (lists as tuples);
    ValueError naming a field the Settings do not have."""
    fields = {f.name for f in dataclasses.fields(cls.Settings)}
    unknown = sorted(set(saved) - fields)
    if unknown:
      raise ValueError(f"its settings name fields that {cls.Settings.__name__} does not have: "
                       f"{unknown}")
    return cls.Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


def _is_fixed(x) -> bool:
  """An integer array: a fixed index map (a reduced vocabulary's), never trained."""
  return hasattr(x, "dtype") and not isinstance(x, dict) and jnp.issubdtype(x.dtype, jnp.integer)


def trainable_part(params: dict) -> dict:
  """The weights an optimizer updates: all but the top-level integer arrays (fixed maps)."""
  return {k: v for k, v in params.items() if not _is_fixed(v)}


def fixed_part(params: dict) -> dict:
  """What training never changes: the top-level integer arrays (empty without any)."""
  return {k: v for k, v in params.items() if _is_fixed(v)}


def param_count(params: dict) -> int:
  """Weights of a drafter (its fixed index maps left out)."""
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(trainable_part(params))))
