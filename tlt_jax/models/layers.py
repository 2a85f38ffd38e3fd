"""A Llama/Qwen2/Qwen3-family decoder layer as pure functions over its weights.

One layer's weights are a plain dict, the same in the policy (stacked on a leading `layers`
axis) and in the drafter (one dict per layer):

  input_layernorm/weight [E]           (absent in an EAGLE drafter's first layer)
  self_attn/{q,k,v}_proj/kernel [E, heads, D], bias [heads, D] (with qkv_bias)
  self_attn/{q,k}_norm/weight [D]      (with qk_norm: Qwen3's per-head norms before RoPE)
  self_attn/o_proj/kernel [H, D, E]
  post_attention_layernorm/weight [E]
  mlp/{gate,up}_proj/kernel [E, F], mlp/down_proj/kernel [F, E]

Matmuls take their operands in the compute dtype (`cfg.dtype`); norms and RoPE run in float32.
Under `cfg.numerics == "invariant"` the matmuls, norms and attention compute each token's
result in one order whatever the program's shape (`tlt_jax.kernels.numerics`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tlt_jax.kernels import prefix_tree_attention
from tlt_jax.kernels.invariant_attention import invariant_prefix_tree_attention
from tlt_jax.models.attention_inputs import AttentionInputs
from tlt_jax.models.config import ModelConfig, RopeConfig
from tlt_jax.models.kv_cache import write_layer_kv
from tlt_jax.kernels.numerics import fixed_path, invariant_matmul, mean_square
from tlt_jax.models.params import ParamSpec


class LayerCache(NamedTuple):
  """One layer's cached prefix: k, v [B, KVH, S, D], valid where slot < lengths[b] ([B])."""
  k: jax.Array
  v: jax.Array
  lengths: jax.Array


def layer_param_specs(cfg: ModelConfig, input_norm: bool = True) -> dict:
  """The ParamSpec tree of one decoder layer (see the module docstring)."""
  e, h, kv, d, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                    cfg.intermediate_size)

  def proj(heads, head_axis):
    p = {"kernel": ParamSpec((e, heads, d), ("embed", head_axis, "head_dim"))}
    if cfg.qkv_bias:
      p["bias"] = ParamSpec((heads, d), (head_axis, "head_dim"), "zeros")
    return p
  norm = {"weight": ParamSpec((e,), ("embed",), "ones")}
  attn = {"q_proj": proj(h, "heads"), "k_proj": proj(kv, "kv_heads"),
          "v_proj": proj(kv, "kv_heads"),
          "o_proj": {"kernel": ParamSpec((h, d, e), ("heads", "head_dim", "embed"))}}
  if cfg.qk_norm:
    attn["q_norm"] = {"weight": ParamSpec((d,), ("head_dim",), "ones")}
    attn["k_norm"] = {"weight": ParamSpec((d,), ("head_dim",), "ones")}
  specs = {
      "self_attn": attn,
      "post_attention_layernorm": dict(norm),
      "mlp": {"gate_proj": {"kernel": ParamSpec((e, f), ("embed", "mlp"))},
              "up_proj": {"kernel": ParamSpec((e, f), ("embed", "mlp"))},
              "down_proj": {"kernel": ParamSpec((f, e), ("mlp", "embed"))}},
  }
  if input_norm:
    specs["input_layernorm"] = dict(norm)
  return specs


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, numerics: str = "fast") -> jax.Array:
  """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  ms = mean_square(x32, numerics) + eps
  x32 = x32 * (fixed_path(jax.lax.rsqrt, ms) if numerics == "invariant" else jax.lax.rsqrt(ms))
  return weight.astype(x.dtype) * x32.astype(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> jax.Array:
  """[head_dim // 2] float32 inverse frequencies, with Llama-3 scaling when configured."""
  inv_freq = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if rope.rope_type == "llama3":
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = ((rope.original_max_position_embeddings / wavelen - rope.low_freq_factor)
              / (rope.high_freq_factor - rope.low_freq_factor))
    interpolated = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    inv_freq = jnp.where(wavelen > low_wavelen, inv_freq / rope.factor,
                         jnp.where(wavelen < high_wavelen, inv_freq, interpolated))
  return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
               numerics: str = "fast") -> jax.Array:
  """Rotates x [B, T, heads, D] at integer positions [B, T] (half-split layout, as in HF)."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  if numerics == "invariant":
    cos, sin = fixed_path(jnp.cos, angles), fixed_path(jnp.sin, angles)
  else:
    cos, sin = jnp.cos(angles), jnp.sin(angles)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  products = (x1 * cos, x2 * sin, x2 * cos, x1 * sin)
  if numerics == "invariant":
    # XLA:CPU contracts a product and the sum it feeds into one FMA wherever both land in one
    # fusion, which differs between programs: the products are rounded on their own.
    products = jax.lax.optimization_barrier(products)
  a, b, c, d = products
  out = jnp.concatenate([a - b, c + d], axis=-1)
  return out.astype(x.dtype)


def _project(x: jax.Array, w: dict, dtype, numerics: str) -> jax.Array:
  """x [B, T, E] through a q/k/v projection -> [B, T, heads, D]."""
  if numerics == "invariant":
    out = invariant_matmul(x, w["kernel"], dtype).astype(dtype)
  else:
    out = jnp.einsum("bte,ehd->bthd", x.astype(dtype), w["kernel"].astype(dtype))
  return out + w["bias"].astype(dtype) if "bias" in w else out


def qkv(x: jax.Array, w: dict, positions: jax.Array, cfg: ModelConfig
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x [B, T, E] normed inputs at positions [B, T] through the layer's `self_attn` q/k/v
  projections -> q [B, T, H, D], k, v [B, T, KVH, D] (q and k after RoPE; with cfg.qk_norm
  each head's q and k are RMS-normed over D first, as Qwen3 does)."""
  dt = cfg.jnp_dtype
  inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope)
  nm = cfg.numerics
  q, k = _project(x, w["q_proj"], dt, nm), _project(x, w["k_proj"], dt, nm)
  if cfg.qk_norm:
    q = rms_norm(q, w["q_norm"]["weight"], cfg.rms_norm_eps, nm)
    k = rms_norm(k, w["k_norm"]["weight"], cfg.rms_norm_eps, nm)
  return (apply_rope(q, positions, inv_freq, nm), apply_rope(k, positions, inv_freq, nm),
          _project(x, w["v_proj"], dt, nm))


def attend(q: jax.Array, k: jax.Array, v: jax.Array, w: dict, attn: AttentionInputs,
           prefix: LayerCache, cfg: ModelConfig) -> jax.Array:
  """Queries q [B, T, H, D] over the valid prefix and the uncached keys k, v [B, N, KVH, D]
  (under attn.mask [B, T, N]), through the output projection -> [B, T, E]."""
  dt = cfg.jnp_dtype
  if cfg.numerics == "invariant":
    out = invariant_prefix_tree_attention(q, prefix.k, prefix.v, prefix.lengths, k.astype(dt),
                                          v.astype(dt), attn.mask, attn.positions, attn.tree)
    b, t = out.shape[:2]
    return invariant_matmul(out.astype(dt).reshape(b, t, -1),
                            w["o_proj"]["kernel"].reshape(-1, w["o_proj"]["kernel"].shape[-1]),
                            dt).astype(dt)
  out = prefix_tree_attention(q, prefix.k, prefix.v, prefix.lengths, k.astype(dt),
                              v.astype(dt), attn.mask, impl=cfg.attention_impl,
                              query_chunk=cfg.attention_query_chunk)
  return jnp.einsum("bthd,hde->bte", out.astype(dt), w["o_proj"]["kernel"].astype(dt))


def attention(x: jax.Array, w: dict, attn: AttentionInputs, prefix: LayerCache,
              cfg: ModelConfig, earlier_kv: tuple[jax.Array, jax.Array] | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """GQA self-attention of T new tokens over a cached prefix plus the block itself.

  Args:
    x: [B, T, E] normed inputs; w: the layer's `self_attn` weights.
    prefix: the layer's cache (its valid slots are attended by every new token).
    earlier_kv: optional (k, v) [B, N0, KVH, D] of uncached keys that precede this block
      (the drafter's earlier draft nodes); attn.mask is then [B, T, N0 + T].
  Returns:
    (out [B, T, E], k, v [B, T, KVH, D] of this block, after RoPE).
  """
  q, k, v = qkv(x, w, attn.positions, cfg)
  k_all, v_all = k, v
  if earlier_kv is not None:
    k_all = jnp.concatenate([earlier_kv[0].astype(k.dtype), k], axis=1)
    v_all = jnp.concatenate([earlier_kv[1].astype(v.dtype), v], axis=1)
  return attend(q, k_all, v_all, w, attn, prefix, cfg), k, v


def mlp(x: jax.Array, w: dict, cfg: ModelConfig) -> jax.Array:
  """SwiGLU: down(silu(gate(x)) * up(x)), [B, T, E] -> [B, T, E]."""
  dt = cfg.jnp_dtype
  if cfg.numerics == "invariant":
    gate = invariant_matmul(x, w["gate_proj"]["kernel"], dt).astype(dt)
    up = invariant_matmul(x, w["up_proj"]["kernel"], dt).astype(dt)
    silu = gate * fixed_path(jax.nn.sigmoid, gate)
    return invariant_matmul(silu * up, w["down_proj"]["kernel"], dt).astype(dt)
  x = x.astype(dt)
  gate = x @ w["gate_proj"]["kernel"].astype(dt)
  up = x @ w["up_proj"]["kernel"].astype(dt)
  return (jax.nn.silu(gate) * up) @ w["down_proj"]["kernel"].astype(dt)


def layer_forward(x: jax.Array, w: dict, attn: AttentionInputs, prefix: LayerCache,
                  cfg: ModelConfig, earlier_kv: tuple[jax.Array, jax.Array] | None = None):
  """One pre-norm decoder layer: x + attention(norm(x)), then + mlp(norm(x)), under
  `jax.checkpoint` with cfg.remat's policy when that is not "none" (training memory).

  Args:
    x: [B, T, E] in the compute dtype; w: one layer's weights (without `input_layernorm`,
      the first norm is the identity, as in an EAGLE drafter's first layer).
    attn, prefix, earlier_kv: see `attention`.
  Returns:
    (x [B, T, E], k, v [B, T, KVH, D] of the block, for the cache).
  """
  def layer(x, w, attn, prefix, earlier_kv):
    a, k, v = attention(_input_norm(x, w, cfg), w["self_attn"], attn, prefix, cfg, earlier_kv)
    return _residual_mlp(x + a, w, cfg), k, v
  if cfg.remat != "none":
    layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[cfg.remat])
  return layer(x, w, attn, prefix, earlier_kv)


# jax.checkpoint policies of ModelConfig.remat (None: save only the layer's inputs).
_REMAT_POLICIES = {"full": None,
                   "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def cached_layer_forward(x: jax.Array, w: dict, attn: AttentionInputs, layer,
                         cache_k: jax.Array, cache_v: jax.Array, lengths: jax.Array,
                         num_new: jax.Array, cfg: ModelConfig):
  """`layer_forward` of one new token per row that first writes its key/value into the
  stacked cache and then attends to the cache alone: the cache is read after its write, so
  XLA updates it in place instead of copying it around the layer (decode).

  Args:
    x: [B, 1, E]; attn: `cached_decode_inputs`; layer: this layer's index into the cache
      (an int, or a traced int32 inside a layer scan).
    cache_k, cache_v: [L, B, KVH, S, D] the whole stacked cache; lengths [B] its lengths.
    num_new: [B] int32, 1 where the row's token is written, 0 where not (that row then
      attends to its prefix alone; the caller ignores its output).
  Returns:
    (x [B, 1, E], cache_k, cache_v with this layer's entries written).
  """
  q, k, v = qkv(_input_norm(x, w, cfg), w["self_attn"], attn.positions, cfg)
  cache_k = write_layer_kv(cache_k, layer, k, lengths, num_new)
  cache_v = write_layer_kv(cache_v, layer, v, lengths, num_new)
  prefix = LayerCache(cache_k[layer], cache_v[layer], lengths + num_new)
  a = attend(q, k, v, w["self_attn"], attn, prefix, cfg)
  return _residual_mlp(x + a, w, cfg), cache_k, cache_v


def _input_norm(x: jax.Array, w: dict, cfg: ModelConfig) -> jax.Array:
  return rms_norm(x, w["input_layernorm"]["weight"], cfg.rms_norm_eps, cfg.numerics) \
      if "input_layernorm" in w else x


def _residual_mlp(x: jax.Array, w: dict, cfg: ModelConfig) -> jax.Array:
  return x + mlp(rms_norm(x, w["post_attention_layernorm"]["weight"], cfg.rms_norm_eps,
                          cfg.numerics),
                 w["mlp"], cfg)
