"""Building blocks of a Llama/Qwen2-family decoder layer (flax.linen, used purely).

Every parameter carries logical axis names; `tlt_jax.mesh` maps them to mesh axes.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from tlt_jax.kernels import prefix_tree_attention
from tlt_jax.models.config import ModelConfig, RopeConfig

_INIT = nn.initializers.normal(stddev=0.02)


def _kernel(names):
  return nn.with_logical_partitioning(_INIT, names)


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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotates x [B, T, heads, D] at integer positions [B, T] (half-split layout, as in HF)."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class RMSNorm(nn.Module):
  eps: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    w = self.param("weight", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                   (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return w.astype(self.dtype) * x32.astype(self.dtype)


class Attention(nn.Module):
  """GQA self-attention over a cached prefix plus a block of new tokens."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, layer_kv, cache_lengths, new_mask):
    """layer_kv = (k_cache, v_cache [B, KVH, S, D], extra_k, extra_v [B, N0, KVH, D]): the
    cached prefix and N0 uncached keys that precede this block (N0 = 0 except in the drafter's
    tree expansion); new_mask [B, T, N0 + T]. Returns (out, k, v) with this block's k, v."""
    cfg = self.cfg
    k_cache, v_cache, extra_k, extra_v = layer_kv
    dense = lambda feats, names, bias_names, name: nn.DenseGeneral(  # noqa: E731
        feats, use_bias=cfg.qkv_bias, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
        kernel_init=_kernel(names), bias_init=nn.with_logical_partitioning(
            nn.initializers.zeros, bias_names), name=name)
    q = dense((cfg.num_heads, cfg.head_dim), ("embed", "heads", "head_dim"),
              ("heads", "head_dim"), "q_proj")(x)
    k = dense((cfg.num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim"),
              ("kv_heads", "head_dim"), "k_proj")(x)
    v = dense((cfg.num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim"),
              ("kv_heads", "head_dim"), "v_proj")(x)
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    k_all = jnp.concatenate([extra_k.astype(k.dtype), k], axis=1)
    v_all = jnp.concatenate([extra_v.astype(v.dtype), v], axis=1)
    out = prefix_tree_attention(q, k_cache, v_cache, cache_lengths, k_all, v_all, new_mask,
                                impl=cfg.attention_impl)
    out = nn.DenseGeneral(cfg.hidden_size, axis=(-2, -1), use_bias=False, dtype=cfg.jnp_dtype,
                          param_dtype=cfg.jnp_param_dtype,
                          kernel_init=_kernel(("heads", "head_dim", "embed")),
                          name="o_proj")(out)
    return out, k, v


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    dense = lambda feats, names, name: nn.Dense(  # noqa: E731
        feats, use_bias=False, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
        kernel_init=_kernel(names), name=name)
    gate = dense(cfg.intermediate_size, ("embed", "mlp"), "gate_proj")(x)
    up = dense(cfg.intermediate_size, ("embed", "mlp"), "up_proj")(x)
    return dense(cfg.hidden_size, ("mlp", "embed"), "down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
  """Pre-norm attention + SwiGLU block. Scan-friendly: (x, per-layer KV) -> (x, new K/V).

  `input_norm=False` makes the first norm the identity (the EAGLE drafter's first layer).
  `emit_hidden=True` also returns the layer's output as a scan output (for fused features).
  """
  cfg: ModelConfig
  input_norm: bool = True
  emit_hidden: bool = False

  @nn.compact
  def __call__(self, x, layer_kv, positions, cache_lengths, new_mask):
    cfg = self.cfg
    norm = lambda name: RMSNorm(cfg.rms_norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype,  # noqa
                                name=name)
    h = norm("input_layernorm")(x) if self.input_norm else x
    attn, k, v = Attention(cfg, name="self_attn")(h, positions, layer_kv, cache_lengths,
                                                  new_mask)
    x = x + attn
    x = x + MLP(cfg, name="mlp")(norm("post_attention_layernorm")(x))
    return x, ((k, v, x) if self.emit_hidden else (k, v))
