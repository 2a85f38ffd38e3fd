"""The policy decoder and its three pure entry points: prefill, decode and tree verify.

All three run the same forward: T new tokens per sequence at explicit positions attend to the
cached prefix and to each other under a [B, T, T] mask (causal, single token, or tree ancestry).
They differ only in the mask, the positions, and what is written back to the cache.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import KVCache, append_kv, gather_tree_kv
from tlt_jax.models.layers import DecoderLayer, RMSNorm, _kernel


class Decoder(nn.Module):
  """Llama/Qwen2 decoder. Parameters (unboxed) form a plain dict:

  embed/embedding [V, E]; layers/<layer params with a leading L axis>; norm/weight [E];
  lm_head/kernel [E, V] (absent when embeddings are tied).
  """
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype,
                          param_dtype=cfg.jnp_param_dtype,
                          embedding_init=_kernel(("vocab", "embed")))
    self.layers = nn.scan(
        DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"})(
            cfg, emit_hidden=bool(cfg.feature_layers))
    self.norm = RMSNorm(cfg.rms_norm_eps, cfg.jnp_dtype, cfg.jnp_param_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.jnp_dtype,
                              param_dtype=cfg.jnp_param_dtype,
                              kernel_init=_kernel(("embed", "vocab")))

  def __call__(self, tokens, positions, cache: KVCache, new_mask):
    x = self.embed_tokens(tokens)
    no_extra = jnp.zeros((*cache.k.shape[:2], 0, *cache.k.shape[2:3], cache.k.shape[4]),
                         cache.k.dtype)
    x, per_layer = self.layers(x, (cache.k, cache.v, no_extra, no_extra), positions,
                               cache.lengths, new_mask)
    hidden = self.norm(x)
    features = hidden
    if self.cfg.feature_layers:
      k_new, v_new, layer_out = per_layer  # layer_out [L, B, T, E]
      features = jnp.concatenate(
          [hidden] + [layer_out[i].astype(hidden.dtype) for i in self.cfg.feature_layers], -1)
    else:
      k_new, v_new = per_layer
    return self.logits(hidden), features, k_new, v_new

  def embed_tokens(self, tokens):
    """[B, T] int32 -> [B, T, E] in the compute dtype."""
    return self.embed(tokens)

  def logits(self, hidden):
    """Final-norm hidden states [..., E] -> float32 logits [..., V] through the LM head."""
    if self.cfg.tie_embeddings:
      return self.embed.attend(hidden).astype(jnp.float32)
    return self.lm_head(hidden).astype(jnp.float32)


@flax.struct.dataclass
class TreeKV:
  """Keys/values of T verified tree tokens, [L, B, T, KVH, D] each, not yet in the cache."""
  k: jax.Array
  v: jax.Array


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict:
  """Random parameters (normal(0.02) kernels, unit norms) as a plain nested dict."""
  return nn.unbox(_init_boxed(cfg, rng))["params"]


def param_logical_axes(cfg: ModelConfig) -> dict:
  """The logical axis names of every parameter, as a pytree of PartitionSpec like the params."""
  boxed = jax.eval_shape(lambda: _init_boxed(cfg, jax.random.key(0)))
  return nn.get_partition_spec(boxed)["params"]


def _init_boxed(cfg: ModelConfig, rng):
  cache = KVCache(k=jnp.zeros((cfg.num_layers, 1, cfg.num_kv_heads, 1, cfg.head_dim),
                              cfg.jnp_dtype),
                  v=jnp.zeros((cfg.num_layers, 1, cfg.num_kv_heads, 1, cfg.head_dim),
                              cfg.jnp_dtype),
                  lengths=jnp.zeros((1,), jnp.int32))
  tokens = jnp.zeros((1, 1), jnp.int32)
  return Decoder(cfg).init(rng, tokens, tokens, cache, jnp.ones((1, 1, 1), bool))


def forward(params: dict, tokens: jax.Array, positions: jax.Array, cache: KVCache,
            new_mask: jax.Array, cfg: ModelConfig):
  """The shared forward: (logits [B,T,V] f32, features [B,T,F], k_new, v_new [L,B,T,KVH,D]).

  features[..., :E] is the final-norm hidden state; with cfg.feature_layers the outputs of
  those layers follow (F = cfg.feature_size), for a fusing drafter.
  """
  return Decoder(cfg).apply({"params": params}, tokens, positions, cache, new_mask)


def prefill(params: dict, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
            cfg: ModelConfig):
  """Runs right-padded prompts and appends them to the cache.

  Args:
    tokens: [B, T] int32, row b's prompt in tokens[b, :lengths[b]], padding after.
    lengths: [B] int32 prompt lengths (0 allowed: the row is left untouched).
    cache: appended to at slots cache.lengths[b] + j (usually an empty cache; a non-empty one
      makes this a chunked prefill).
  Returns:
    logits [B, T, V] float32, features [B, T, F] (final-norm hidden states first; see
    `forward`), the new cache. Entries at padding positions are meaningless.
  """
  t = tokens.shape[1]
  positions = cache.lengths[:, None] + jnp.arange(t)[None, :]
  causal = jnp.tril(jnp.ones((t, t), bool))
  key_valid = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
  new_mask = causal[None] & key_valid[:, None, :]
  logits, hidden, k_new, v_new = forward(params, tokens, positions, cache, new_mask, cfg)
  return logits, hidden, append_kv(cache, k_new, v_new, lengths)


def decode(params: dict, tokens: jax.Array, cache: KVCache, cfg: ModelConfig,
           active: jax.Array | None = None):
  """One new token per sequence at position cache.lengths[b].

  Args:
    tokens: [B] int32.
    active: optional [B] bool; inactive rows are computed but not written to the cache.
  Returns:
    logits [B, V] float32, features [B, F], the new cache.
  """
  b = tokens.shape[0]
  num_new = jnp.ones((b,), jnp.int32) if active is None else active.astype(jnp.int32)
  logits, hidden, k_new, v_new = forward(params, tokens[:, None], cache.lengths[:, None], cache,
                                         jnp.ones((b, 1, 1), bool), cfg)
  return logits[:, 0], hidden[:, 0], append_kv(cache, k_new, v_new, num_new)


def verify(params: dict, tree_tokens: jax.Array, tree_depths: jax.Array, tree_mask: jax.Array,
           cache: KVCache, cfg: ModelConfig):
  """Scores a draft tree of T tokens per sequence in one forward; the cache is not modified.

  Args:
    tree_tokens: [B, T] int32; node 0 is the root (the newest token, not yet in the cache).
    tree_depths: [B, T] int32 depth of each node (root 0); node i sits at position
      cache.lengths[b] + tree_depths[b, i], the slot it will occupy if accepted.
    tree_mask: [B, T, T] bool ancestor-or-self mask (all False rows for padding nodes);
      see `tlt_jax.speculative.tree.ancestor_mask`.
  Returns:
    logits [B, T, V] float32, features [B, T, F], TreeKV of the T nodes for `commit`.
  """
  positions = cache.lengths[:, None] + tree_depths
  logits, hidden, k_new, v_new = forward(params, tree_tokens, positions, cache, tree_mask, cfg)
  return logits, hidden, TreeKV(k=k_new, v=v_new)


def commit(cache: KVCache, tree_kv: TreeKV, path: jax.Array, num_accepted: jax.Array) -> KVCache:
  """Appends the accepted root-to-node path of each row to the cache.

  Args:
    path: [B, P] int32 node indices from the root down, in order.
    num_accepted: [B] int32 how many path entries to append (the root counts).
  """
  return append_kv(cache, gather_tree_kv(tree_kv.k, path), gather_tree_kv(tree_kv.v, path),
                   num_accepted)
