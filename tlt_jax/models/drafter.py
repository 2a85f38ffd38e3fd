"""EAGLE-style drafter: a small decoder that reads (next token, policy feature) pairs.

Slot s of the drafter's sequence holds the pair (x_s, f_{s-1}): the embedding of token x_s and
the policy's final-norm hidden state of the previous token (zeros for s = 0), and predicts f_s,
whose logits through the policy's LM head draft x_{s+1}. Slot s has RoPE position s, like the
policy's cache slot s, so the drafter's KVCache has the same length as the policy's.

The embedding and LM head are the policy's: `drafter_forward` takes the policy params and reads
them, and the drafter's own params never contain them, so training the drafter or syncing its
weights can never touch the policy.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decoder import Decoder
from tlt_jax.models.kv_cache import KVCache, init_cache
from tlt_jax.models.layers import DecoderLayer, RMSNorm, _kernel


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
  fused_features: how many extra policy layers the features carry (the policy's
    `feature_layers`, EAGLE-3 style); > 0 adds a `fuse` projection (1 + n) * E -> E for
    features that come from the policy. Features the drafter predicted itself are E wide
    and go in as they are.
  """
  num_layers: int = 1
  use_features: bool = True
  intermediate_size: int = 0
  norm_input: bool = False
  norm_output: bool = False
  fused_features: int = 0

  def __post_init__(self):
    if self.num_layers < 1:
      raise ValueError(f"drafter.num_layers must be >= 1, got {self.num_layers}")
    if self.fused_features < 0:
      raise ValueError(f"drafter.fused_features must be >= 0, got {self.fused_features}")
    if self.intermediate_size < 0:
      raise ValueError(f"drafter.intermediate_size must be >= 0, got {self.intermediate_size}")


def drafter_model_config(cfg: ModelConfig, dcfg: DrafterConfig) -> ModelConfig:
  """The policy config reshaped to the drafter's layers (used for its layers and its cache).
  The policy's fused feature layers index the policy's layers, not the drafter's: dropped."""
  return cfg.replace(num_layers=dcfg.num_layers, feature_layers=(),
                     intermediate_size=dcfg.intermediate_size or cfg.intermediate_size)


class Drafter(nn.Module):
  """fc(concat(embed(x_s), f_{s-1})) -> decoder layers (first without input norm) -> f_s.

  The output is compared with the policy's final-norm features directly (no final norm
  unless `norm_output`)."""
  cfg: ModelConfig
  dcfg: DrafterConfig

  @nn.compact
  def __call__(self, token_embeds, features, positions, cache: KVCache, extra_k, extra_v,
               new_mask):
    lcfg = drafter_model_config(self.cfg, self.dcfg)
    x = token_embeds
    e = lcfg.hidden_size
    policy_width = (1 + self.dcfg.fused_features) * e
    if features.shape[-1] not in (e, policy_width):
      raise ValueError(f"drafter got {features.shape[-1]}-wide features; expected {e} (its "
                       f"own predictions) or {policy_width} (policy features with "
                       f"drafter.fused_features={self.dcfg.fused_features}); the policy's "
                       f"feature_layers and the drafter's fused_features must agree")
    if features.shape[-1] != e:  # policy features: project the fused layers to E
      features = nn.Dense(e, use_bias=False, dtype=lcfg.jnp_dtype,
                          param_dtype=lcfg.jnp_param_dtype,
                          kernel_init=_kernel(("embed_in", "embed")), name="fuse")(
                              features.astype(x.dtype))
    if self.dcfg.use_features:
      x = jnp.concatenate([x, features.astype(x.dtype)], axis=-1)
    x = nn.Dense(lcfg.hidden_size, use_bias=True, dtype=lcfg.jnp_dtype,
                 param_dtype=lcfg.jnp_param_dtype, kernel_init=_kernel(("embed_in", "embed")),
                 bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                 name="fc")(x)
    ks, vs = [], []
    for i in range(self.dcfg.num_layers):
      layer_kv = (cache.k[i], cache.v[i], extra_k[i], extra_v[i])
      x, (k, v) = DecoderLayer(lcfg, input_norm=i > 0 or self.dcfg.norm_input,
                               name=f"layer_{i}")(x, layer_kv, positions, cache.lengths,
                                                  new_mask)
      ks.append(k)
      vs.append(v)
    if self.dcfg.norm_output:
      x = RMSNorm(lcfg.rms_norm_eps, lcfg.jnp_dtype, lcfg.jnp_param_dtype, name="norm")(x)
    return x, jnp.stack(ks), jnp.stack(vs)


def init_drafter_params(cfg: ModelConfig, dcfg: DrafterConfig, rng: jax.Array) -> dict:
  """Random drafter params (plain dict): fc/{kernel [2E or E, E], bias}; layer_i/..."""
  return nn.unbox(_init_boxed(cfg, dcfg, rng))["params"]


def drafter_logical_axes(cfg: ModelConfig, dcfg: DrafterConfig) -> dict:
  """Logical axis names of the drafter params (PartitionSpec pytree)."""
  boxed = jax.eval_shape(lambda: _init_boxed(cfg, dcfg, jax.random.key(0)))
  return nn.get_partition_spec(boxed)["params"]


def _init_boxed(cfg, dcfg, rng):
  lcfg = drafter_model_config(cfg, dcfg)
  cache = init_cache(lcfg, 1, 1)
  no_extra = jnp.zeros((dcfg.num_layers, 1, 0, cfg.num_kv_heads, cfg.head_dim), cfg.jnp_dtype)
  x = jnp.zeros((1, 1, cfg.hidden_size), cfg.jnp_dtype)
  feats = jnp.zeros((1, 1, (1 + dcfg.fused_features) * cfg.hidden_size), cfg.jnp_dtype)
  pos = jnp.zeros((1, 1), jnp.int32)
  return Drafter(cfg, dcfg).init(rng, x, feats, pos, cache, no_extra, no_extra,
                                 jnp.ones((1, 1, 1), bool))


def init_drafter_cache(cfg: ModelConfig, dcfg: DrafterConfig, batch_size: int,
                       capacity: int) -> KVCache:
  """An empty drafter KV cache ([Ld, B, KVH, S, D])."""
  return init_cache(drafter_model_config(cfg, dcfg), batch_size, capacity)


def embed_with_policy(policy_params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
  """The policy's token embeddings [..., E] for tokens [...] (shared with the drafter)."""
  return Decoder(cfg).apply({"params": policy_params}, tokens, method=Decoder.embed_tokens)


def logits_with_policy(policy_params: dict, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
  """float32 logits [..., V] of hidden states [..., E] through the policy's LM head."""
  return Decoder(cfg).apply({"params": policy_params}, hidden, method=Decoder.logits)


def drafter_forward(drafter_params: dict, policy_params: dict, tokens: jax.Array,
                    features: jax.Array, positions: jax.Array, cache: KVCache,
                    new_mask: jax.Array, cfg: ModelConfig, dcfg: DrafterConfig,
                    extra_kv: tuple[jax.Array, jax.Array] | None = None):
  """Runs T drafter slots.

  Args:
    tokens: [B, T] int32 tokens x_s; features: [B, T, F] the features paired with them:
      the policy's (F = cfg.feature_size) or the drafter's own predictions (F = E).
    positions: [B, T] int32 slots/positions s.
    cache: the drafter's KVCache (prefix, attended where slot < lengths).
    new_mask: [B, T, N0 + T] bool over (extra keys, this block).
    extra_kv: optional (k, v) [Ld, B, N0, KVH, D] of earlier uncached draft nodes.
  Returns:
    (features_pred [B, T, E], logits [B, T, V] float32, k_new, v_new [Ld, B, T, KVH, D]).
  """
  if extra_kv is None:
    shape = (dcfg.num_layers, tokens.shape[0], 0, cfg.num_kv_heads, cfg.head_dim)
    extra_kv = (jnp.zeros(shape, cache.k.dtype), jnp.zeros(shape, cache.k.dtype))
  embeds = embed_with_policy(policy_params, tokens, cfg)
  pred, k_new, v_new = Drafter(cfg, dcfg).apply({"params": drafter_params}, embeds, features,
                                                positions, cache, *extra_kv, new_mask)
  return pred, logits_with_policy(policy_params, pred, cfg), k_new, v_new


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
