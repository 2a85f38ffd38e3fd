"""The policy decoder as pure functions over a weights dict, and its three entry points:
prefill, decode and tree verify.

Weights (a plain nested dict; `param_specs` is the table of shapes and logical axes):
  embed/embedding [V, E]; layers/<one layer's weights with a leading L axis> (see
  `tlt_jax.models.layers`); norm/weight [E]; lm_head/kernel [E, V] (absent when tied).

Prefill and verify run `forward`: T new tokens per row at explicit positions attend to the
cached prefix and to each other under a mask (`tlt_jax.models.attention_inputs`); they differ
only in the attention inputs and in what is written back to the cache. Decode runs the same
layers on one token per row but writes its key/value into the cache before attending, so the
cache is updated in place rather than copied on every step. The layers run as a
Python loop over static slices of the stacked weights (on GPU a `lax.scan` copies each layer's
slice before its matmuls); `cfg.scan_layers` selects the scan, which compiles faster for deep
models.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.mesh import constrain_rows
from tlt_jax.models.attention_inputs import (AttentionInputs, cached_decode_inputs,
                                             prefill_inputs, tree_inputs)
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.kv_cache import KVCache, append_kv, empty_prefix, gather_tree_kv
from tlt_jax.models.layers import (LayerCache, cached_layer_forward, layer_forward,
                                   layer_param_specs, rms_norm)
from tlt_jax.kernels.numerics import invariant_matmul
from tlt_jax.models.params import ParamSpec, init_from_specs, logical_axes_from_specs


def param_specs(cfg: ModelConfig) -> dict:
  """The ParamSpec tree of the policy (see the module docstring)."""
  e, v = cfg.hidden_size, cfg.vocab_size
  layer = jax.tree.map(lambda s: s.stacked(cfg.num_layers), layer_param_specs(cfg),
                       is_leaf=lambda x: isinstance(x, ParamSpec))
  specs = {"embed": {"embedding": ParamSpec((v, e), ("vocab", "embed"))},
           "layers": layer,
           "norm": {"weight": ParamSpec((e,), ("embed",), "ones")}}
  if not cfg.tie_embeddings:
    specs["lm_head"] = {"kernel": ParamSpec((e, v), ("embed", "vocab"))}
  return specs


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict:
  """Random parameters (normal(0.02) kernels, unit norms, zero biases) in cfg.param_dtype."""
  return init_from_specs(param_specs(cfg), rng, cfg.jnp_param_dtype)


def param_logical_axes(cfg: ModelConfig) -> dict:
  """The logical axis names of every parameter, as a pytree of PartitionSpec like the params."""
  return logical_axes_from_specs(param_specs(cfg))


def embed(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
  """[...] int32 token ids -> [..., E] embeddings in the compute dtype."""
  return jnp.take(params["embed"]["embedding"], tokens, axis=0).astype(cfg.jnp_dtype)


def lm_logits(params: dict, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Final-norm hidden states [..., E] -> float32 logits [..., V] through the LM head.

  The operands stay in the compute dtype and the products accumulate in float32: the head is
  the largest matrix of a decode step, read once, never converted."""
  dt = cfg.jnp_dtype
  if cfg.numerics == "invariant":
    head = params["embed"]["embedding"].T if cfg.tie_embeddings else params["lm_head"]["kernel"]
    return invariant_matmul(hidden, head, dt)
  if cfg.tie_embeddings:
    return jnp.einsum("...e,ve->...v", hidden.astype(dt), params["embed"]["embedding"].astype(dt),
                      preferred_element_type=jnp.float32)
  return jnp.einsum("...e,ev->...v", hidden.astype(dt), params["lm_head"]["kernel"].astype(dt),
                    preferred_element_type=jnp.float32)


def _layer(tree: dict, i: int) -> dict:
  return jax.tree.map(lambda x: x[i], tree)


def over_layers(fn, carry, xs, cfg: ModelConfig):
  """Runs fn(carry, i, xs_i) -> (carry, y) for each layer i: a Python loop over static
  slices of xs (a pytree with a leading L axis) and a static i, or a `lax.scan` with a traced
  i under cfg.scan_layers. Returns (carry, the ys stacked on a leading L axis)."""
  if cfg.scan_layers:
    return jax.lax.scan(lambda c, a: fn(c, a[0], a[1]), carry,
                        (jnp.arange(cfg.num_layers), xs))
  ys = []
  for i in range(cfg.num_layers):
    carry, y = fn(carry, i, _layer(xs, i))
    ys.append(y)
  return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)


def run_layers(layers: dict, x: jax.Array, attn: AttentionInputs, cache: KVCache | None,
               cfg: ModelConfig):
  """The decoder stack over x [B, T, E] (see `over_layers`).

  Returns:
    (x [B, T, E], k_new, v_new [L, B, T, KVH, D], outputs of cfg.feature_layers (a list of
    [B, T, E])).
  """
  if cache is None:
    cache = empty_prefix(cfg, x.shape[0])

  def layer(x, i, w_k_v):
    w, k_cache, v_cache = w_k_v
    x, k, v = layer_forward(x, w, attn, LayerCache(k_cache, v_cache, cache.lengths), cfg)
    x = constrain_rows(x)
    return x, (k, v, x if cfg.feature_layers else None)
  x, (k_new, v_new, outs) = over_layers(layer, x, (layers, cache.k, cache.v), cfg)
  return x, k_new, v_new, [outs[i] for i in cfg.feature_layers]


def _outputs(params: dict, x: jax.Array, taken: list, cfg: ModelConfig,
             logits_at: jax.Array | None = None):
  """The stack's output x [B, T, E] and the feature layers' outputs -> (logits [B, T, V]
  float32, or [B, V] at positions logits_at [B]; features [B, T, F]: the final-norm hidden
  state, then the taken outputs)."""
  hidden = rms_norm(x, params["norm"]["weight"], cfg.rms_norm_eps, cfg.numerics)
  features = jnp.concatenate([hidden] + [t.astype(hidden.dtype) for t in taken], -1) \
      if taken else hidden
  if logits_at is not None:
    hidden = jnp.take_along_axis(hidden, logits_at[:, None, None], axis=1)[:, 0]
  return constrain_rows(lm_logits(params, hidden, cfg)), features


def forward(params: dict, tokens: jax.Array, attn: AttentionInputs, cfg: ModelConfig,
            cache: KVCache | None = None, logits_at: jax.Array | None = None):
  """The shared forward of T new tokens per row.

  Args:
    tokens: [B, T] int32; attn: their positions and masks (`tlt_jax.models.attention_inputs`).
    cache: the prefix they attend to (None: no prefix, e.g. training rows).
    logits_at: optional [B] int32: the logits of that position of each row only (the head is
      a large matrix: a prefill that samples from its last position needs no other).
  Returns:
    (logits [B, T, V] float32 ([B, V] with logits_at), features [B, T, F], k_new, v_new
    [L, B, T, KVH, D]). features[..., :E] is the final-norm hidden state; with
    cfg.feature_layers the outputs of those layers follow (F = cfg.feature_size), for a fusing
    drafter.
  """
  x = constrain_rows(embed(params, tokens, cfg))  # rows split, as on the mesh's data axes
  x, k_new, v_new, taken = run_layers(params["layers"], x, attn, cache, cfg)
  logits, features = _outputs(params, x, taken, cfg, logits_at)
  return logits, features, k_new, v_new


def prefill(params: dict, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
            cfg: ModelConfig, fresh: bool = False, last_logits: bool = False,
            rows: jax.Array | None = None):
  """Runs right-padded prompts and appends them to the cache.

  Args:
    tokens: [U, T] int32, row u's prompt in tokens[u, :lengths[u]], padding after.
    lengths: [U] int32 prompt lengths (0 allowed: the row is left untouched).
    cache: appended to at slots cache.lengths[b] + j (usually an empty cache; a non-empty one
      makes this a chunked prefill).
    fresh: the caller guarantees the cache is empty, so the prompts attend to themselves only
      and not to the cache's S empty slots (the prefill's cost then does not grow with S).
    last_logits: the logits of each prompt's last token only.
    rows: for a fresh cache of B rows, optional [B] int32: cache row b holds prompt rows[b]
      (the samples of one prompt share its prefill). Without it B = U.
  Returns:
    logits [B, T, V] float32 ([B, V] with last_logits), features [B, T, F] (final-norm hidden
    states first; see `forward`), the new cache. Entries at padding positions are
    meaningless.
  """
  if rows is not None and not fresh:
    raise ValueError("prefill: rows (shared prompts) needs a fresh cache (fresh=True)")
  attn = prefill_inputs(jnp.zeros_like(lengths) if fresh else cache.lengths, tokens.shape[1],
                        lengths)
  logits, features, k_new, v_new = forward(params, tokens, attn, cfg, None if fresh else cache,
                                           jnp.maximum(lengths - 1, 0) if last_logits else None)
  if rows is not None:
    logits, features, lengths = logits[rows], features[rows], lengths[rows]
    k_new, v_new = k_new[:, rows], v_new[:, rows]
  return logits, features, append_kv(cache, k_new, v_new, lengths)


def decode(params: dict, tokens: jax.Array, cache: KVCache, cfg: ModelConfig,
           active: jax.Array | None = None):
  """One new token per sequence at position cache.lengths[b].

  Each layer writes the token's key/value into the cache before attending to it
  (`cached_layer_forward`), so the cache is updated in place: the same attention as
  `forward` over the prefix plus the token, without copies of the cache per step.

  Args:
    tokens: [B] int32.
    active: optional [B] bool; inactive rows are computed but not written to the cache.
  Returns:
    logits [B, V] float32, features [B, F], the new cache.
  """
  b = tokens.shape[0]
  num_new = jnp.ones((b,), jnp.int32) if active is None else active.astype(jnp.int32)
  attn = cached_decode_inputs(cache.lengths)

  def layer(carry, i, w):
    x, k, v = carry
    x, k, v = cached_layer_forward(x, w, attn, i, k, v, cache.lengths, num_new, cfg)
    return (x, k, v), x if cfg.feature_layers else None
  (x, k, v), outs = over_layers(layer, (embed(params, tokens[:, None], cfg), cache.k, cache.v),
                                params["layers"], cfg)
  logits, features = _outputs(params, x, [outs[i] for i in cfg.feature_layers], cfg)
  lengths = jnp.minimum(cache.lengths + num_new, cache.capacity)
  return logits[:, 0], features[:, 0], KVCache(k=k, v=v, lengths=lengths)


@flax.struct.dataclass
class TreeKV:
  """Keys/values of T verified tree tokens, [L, B, T, KVH, D] each, not yet in the cache."""
  k: jax.Array
  v: jax.Array


def verify(params: dict, tree_tokens: jax.Array, tree_depths: jax.Array, tree_mask: jax.Array,
           cache: KVCache, cfg: ModelConfig):
  """Scores a draft tree of T tokens per sequence in one forward; the cache is not modified.

  Args:
    tree_tokens: [B, T] int32; node 0 is the root (the newest token, not yet in the cache).
    tree_depths: [B, T] int32 depth of each node (root 0); node i sits at position
      cache.lengths[b] + tree_depths[b, i], the slot it will occupy if accepted.
    tree_mask: [B, T, T] bool ancestor-or-self mask (all False rows for padding nodes);
      see `tlt_jax.models.attention_inputs.ancestor_mask`.
  Returns:
    logits [B, T, V] float32, features [B, T, F], TreeKV of the T nodes for `commit`.
  """
  attn = tree_inputs(cache.lengths, tree_depths, tree_mask)
  logits, features, k_new, v_new = forward(params, tree_tokens, attn, cfg, cache)
  return logits, features, TreeKV(k=k_new, v=v_new)


def commit(cache: KVCache, tree_kv: TreeKV, path: jax.Array, num_accepted: jax.Array) -> KVCache:
  """Appends the accepted root-to-node path of each row to the cache.

  Args:
    path: [B, P] int32 node indices from the root down, in order.
    num_accepted: [B] int32 how many path entries to append (the root counts).
  """
  return append_kv(cache, gather_tree_kv(tree_kv.k, path), gather_tree_kv(tree_kv.v, path),
                   num_accepted)
