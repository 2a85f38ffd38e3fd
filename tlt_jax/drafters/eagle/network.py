"""EAGLE-style drafter: a small decoder that reads (next token, policy feature) pairs.

Slot s of the drafter's sequence holds the pair (x_s, f_{s-1}): the embedding of token x_s and
the policy's final-norm hidden state of the previous token (zeros for s = 0), and predicts f_s,
whose logits through the policy's LM head draft x_{s+1}. Slot s has RoPE position s, like the
policy's cache slot s, so the drafter's KVCache has the same length as the policy's.

The embedding and LM head are the policy's: `drafter_forward` takes the policy params and reads
them, and the drafter's own params never contain them, so training the drafter or syncing its
weights can never touch the policy. Its layers are the policy's `layer_forward`, one weights
dict per layer (`layer_0`, `layer_1`, ...).

With a reduced draft vocabulary (`draft_vocab_size` r > 0, EAGLE-3) the drafter has its own
head `lm_head` [E, r] over r policy tokens and the fixed map `d2t` [r] int32 from draft ids to
policy ids (`tlt_jax.drafters.eagle.draft_vocab`); its logits are over draft ids, and
`policy_token_ids` maps what it drafts back. `d2t` is the one integer leaf of the params and
is never trained (`tlt_jax.drafters.base.trainable_part`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tlt_jax.models.attention_inputs import AttentionInputs
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decoder import embed, lm_logits
from tlt_jax.models.kv_cache import KVCache, empty_prefix, init_cache
from tlt_jax.models.layers import LayerCache, layer_forward, layer_param_specs, rms_norm
from tlt_jax.models.params import ParamSpec, init_from_specs, logical_axes_from_specs


# The params key of the reduced vocabulary's draft-id -> policy-id map (int32, never trained).
DRAFT_TO_POLICY = "d2t"


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  """Drafter architecture knobs (the rest follows the policy's ModelConfig).

  num_layers: decoder layers (EAGLE uses 1).
  use_features: feed the policy's hidden state (EAGLE); False drafts from tokens alone, an
    ablation baseline.
  intermediate_size: MLP width; 0 = the policy's.
  norm_input: RMSNorm at the first layer's input (EAGLE-1 has none).
  norm_output: RMSNorm on the output (EAGLE-1 has none; with it and the policy's own layers,
    the drafter can be an exact copy of the policy, which tests use as an oracle).
  feature_layers: the policy layers whose outputs the features carry besides the final
    hidden state (EAGLE-3 style; the policy's ModelConfig.feature_layers, which must be the
    same); n > 0 of them add a `fuse` projection (1 + n) * E -> E for features that come from
    the policy. Features the drafter predicted itself are E wide and go in as they are.
  draft_vocab_size: r > 0 drafts over r policy tokens with its own [E, r] head (EAGLE-3's
    reduced vocabulary); 0 drafts over the policy's whole vocabulary with the policy's head.
  """
  num_layers: int = 1
  use_features: bool = True
  intermediate_size: int = 0
  norm_input: bool = False
  norm_output: bool = False
  feature_layers: tuple[int, ...] = ()
  draft_vocab_size: int = 0

  def __post_init__(self):
    if self.num_layers < 1:
      raise ValueError(f"drafter.eagle.num_layers must be >= 1, got {self.num_layers}")
    object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
    if any(i < 0 for i in self.feature_layers):
      raise ValueError(f"drafter.eagle.feature_layers must be policy layer indices >= 0, got "
                       f"{self.feature_layers}")
    if self.intermediate_size < 0:
      raise ValueError(f"drafter.eagle.intermediate_size must be >= 0, got "
                       f"{self.intermediate_size}")
    if self.draft_vocab_size < 0:
      raise ValueError(f"drafter.eagle.draft_vocab_size must be >= 0 (0 = the policy's "
                       f"vocabulary), got {self.draft_vocab_size}")


def drafter_model_config(cfg: ModelConfig, dcfg: DrafterConfig) -> ModelConfig:
  """The policy config reshaped to the drafter's layers (used for its layers and its cache).
  The policy's fused feature layers index the policy's layers, not the drafter's: dropped.
  The drafter's few layers always run as a loop, with the fast numerics: its drafts decide
  how many tokens are accepted, never which (the policy's verify decides those)."""
  return cfg.replace(num_layers=dcfg.num_layers, feature_layers=(), scan_layers=False,
                     intermediate_size=dcfg.intermediate_size or cfg.intermediate_size,
                     numerics="fast")


def drafter_param_specs(cfg: ModelConfig, dcfg: DrafterConfig) -> dict:
  """The ParamSpec tree of the drafter: fc/{kernel [2E or E, E], bias [E]}; fuse/kernel
  [(1 + n) E, E] with fused features; layer_i/...; norm/weight with norm_output; lm_head/kernel
  [E, r] and d2t [r] int32 with a reduced draft vocabulary."""
  lcfg = drafter_model_config(cfg, dcfg)
  e = cfg.hidden_size
  fc_in = 2 * e if dcfg.use_features else e
  specs = {"fc": {"kernel": ParamSpec((fc_in, e), ("embed_in", "embed")),
                  "bias": ParamSpec((e,), ("embed",), "zeros")}}
  if dcfg.feature_layers:
    specs["fuse"] = {"kernel": ParamSpec(((1 + len(dcfg.feature_layers)) * e, e),
                                         ("embed_in", "embed"))}
  for i in range(dcfg.num_layers):
    specs[f"layer_{i}"] = layer_param_specs(lcfg, input_norm=i > 0 or dcfg.norm_input)
  if dcfg.norm_output:
    specs["norm"] = {"weight": ParamSpec((e,), ("embed",), "ones")}
  if dcfg.draft_vocab_size:
    if dcfg.draft_vocab_size > cfg.vocab_size:
      raise ValueError(f"drafter.eagle.draft_vocab_size={dcfg.draft_vocab_size} exceeds the "
                       f"policy's vocabulary ({cfg.vocab_size}); use at most {cfg.vocab_size} or 0")
    specs["lm_head"] = {"kernel": ParamSpec((e, dcfg.draft_vocab_size), ("embed", "vocab"))}
    specs[DRAFT_TO_POLICY] = ParamSpec((dcfg.draft_vocab_size,), (None,), "index")
  return specs


def init_drafter_params(cfg: ModelConfig, dcfg: DrafterConfig, rng: jax.Array) -> dict:
  """Random drafter params (plain dict, see `drafter_param_specs`)."""
  return init_from_specs(drafter_param_specs(cfg, dcfg), rng, cfg.jnp_param_dtype)


def drafter_logical_axes(cfg: ModelConfig, dcfg: DrafterConfig) -> dict:
  """Logical axis names of the drafter params (PartitionSpec pytree)."""
  return logical_axes_from_specs(drafter_param_specs(cfg, dcfg))


def init_drafter_cache(cfg: ModelConfig, dcfg: DrafterConfig, batch_size: int,
                       capacity: int) -> KVCache:
  """An empty drafter KV cache ([Ld, B, KVH, S, D])."""
  return init_cache(drafter_model_config(cfg, dcfg), batch_size, capacity)


def drafter_forward(drafter_params: dict, policy_params: dict, tokens: jax.Array,
                    features: jax.Array, attn: AttentionInputs, cfg: ModelConfig,
                    dcfg: DrafterConfig, cache: KVCache | None = None,
                    earlier_kv: tuple[jax.Array, jax.Array] | None = None):
  """Runs T drafter slots: fc(concat(embed(x_s), f_{s-1})) -> layers -> f_s.

  Args:
    tokens: [B, T] int32 tokens x_s; features: [B, T, F] the features paired with them:
      the policy's (F = cfg.feature_size) or the drafter's own predictions (F = E).
    attn: positions (the slots s) and masks of the block; cache: the drafter's KVCache
      (None: no prefix, e.g. training windows).
    earlier_kv: optional (k, v) [Ld, B, N0, KVH, D] of earlier uncached draft nodes, which
      attn.mask covers before the block's own keys.
  Returns:
    (features_pred [B, T, E], logits [B, T, V or r] float32 over policy or draft ids, k_new,
    v_new [Ld, B, T, KVH, D]).
  """
  lcfg = drafter_model_config(cfg, dcfg)
  e = cfg.hidden_size
  x = embed(policy_params, tokens, cfg)
  dt = lcfg.jnp_dtype
  policy_width = (1 + len(dcfg.feature_layers)) * e
  if features.shape[-1] not in (e, policy_width):
    raise ValueError(f"drafter got {features.shape[-1]}-wide features; expected {e} (its "
                     f"own predictions) or {policy_width} (policy features with "
                     f"drafter.eagle.feature_layers={dcfg.feature_layers}); the policy's and the "
                     f"drafter's feature_layers must agree")
  if features.shape[-1] != e:  # policy features: project the fused layers to E
    features = features.astype(dt) @ drafter_params["fuse"]["kernel"].astype(dt)
  if dcfg.use_features:
    x = jnp.concatenate([x, features.astype(dt)], axis=-1)
  fc = drafter_params["fc"]
  x = x.astype(dt) @ fc["kernel"].astype(dt) + fc["bias"].astype(dt)
  if cache is None:
    cache = empty_prefix(lcfg, tokens.shape[0])
  ks, vs = [], []
  for i in range(dcfg.num_layers):
    earlier = None if earlier_kv is None else (earlier_kv[0][i], earlier_kv[1][i])
    x, k, v = layer_forward(x, drafter_params[f"layer_{i}"], attn,
                            LayerCache(cache.k[i], cache.v[i], cache.lengths), lcfg,
                            earlier_kv=earlier)
    ks.append(k)
    vs.append(v)
  if dcfg.norm_output:
    x = rms_norm(x, drafter_params["norm"]["weight"], lcfg.rms_norm_eps)
  if dcfg.draft_vocab_size:  # its own untied [E, r] head
    logits = lm_logits(drafter_params, x, lcfg.replace(tie_embeddings=False))
  else:
    logits = lm_logits(policy_params, x, lcfg)
  return x, logits, jnp.stack(ks), jnp.stack(vs)


def policy_token_ids(drafter_params: dict, ids: jax.Array) -> jax.Array:
  """Draft ids -> policy ids (int32, same shape); the identity without a reduced vocabulary."""
  if DRAFT_TO_POLICY not in drafter_params:
    return ids
  return jnp.take(drafter_params[DRAFT_TO_POLICY], ids, axis=0)


def with_draft_vocab(drafter_params: dict, policy_params: dict, d2t, cfg: ModelConfig) -> dict:
  """The drafter params with the draft vocabulary `d2t` ([r] policy ids, increasing) and its
  head started from the policy's LM head at those ids (as EAGLE-3 starts it): the params of
  the same drafter with draft_vocab_size = r."""
  d2t = jnp.asarray(d2t, jnp.int32)
  if cfg.tie_embeddings:
    head = jnp.take(policy_params["embed"]["embedding"], d2t, axis=0).T
  else:
    head = jnp.take(policy_params["lm_head"]["kernel"], d2t, axis=1)
  dtype = drafter_params["fc"]["kernel"].dtype
  return {**drafter_params, DRAFT_TO_POLICY: d2t, "lm_head": {"kernel": head.astype(dtype)}}


def drafter_from_policy(cfg: ModelConfig, policy_params: dict) -> tuple[DrafterConfig, dict]:
  """A drafter that computes exactly the policy's final-norm hidden state (no feature input,
  identity fc, the policy's own layers and final norm): the accept-length upper bound under
  greedy decoding, at the policy's full cost. For tests and benchmarks."""
  dcfg = DrafterConfig(num_layers=cfg.num_layers, use_features=False, norm_input=True,
                       norm_output=True)
  params = {"fc": {"kernel": jnp.eye(cfg.hidden_size, dtype=cfg.jnp_param_dtype),
                   "bias": jnp.zeros((cfg.hidden_size,), cfg.jnp_param_dtype)},
            "norm": policy_params["norm"]}
  for i in range(cfg.num_layers):
    params[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], policy_params["layers"])
  return dcfg, params
