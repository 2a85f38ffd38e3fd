"""Static description of a Llama/Qwen2/Qwen3-family decoder (hashable, so it can be a jit
static arg)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

NUMERICS = ("fast", "invariant")  # see tlt_jax.kernels.numerics
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ROPE_TYPES = ("default", "llama3")
MODEL_TYPES = ("qwen2", "llama", "qwen3")  # the Hugging Face architectures this decoder loads
# What sets the dense architectures apart, as ModelConfig fields: Qwen2 adds biases to the
# q/k/v projections, Qwen3 an RMSNorm over each head's queries and keys before RoPE.
ARCHITECTURE_FLAGS = {"qwen2": dict(qkv_bias=True, qk_norm=False),
                      "llama": dict(qkv_bias=False, qk_norm=False),
                      "qwen3": dict(qkv_bias=False, qk_norm=True)}
# Per-layer rematerialisation under differentiation: "none" saves every activation, "full"
# only each layer's input (the backward pass recomputes the layer), "dots" also the matmul
# outputs without a batch dimension (less recompute, more memory).
REMAT_POLICIES = ("none", "full", "dots")


def dtype_from_name(name: str, what: str = "dtype"):
  """Maps a dtype name ('float32', 'bfloat16', 'float16') to a jnp dtype, with a readable error."""
  if name not in DTYPES:
    raise ValueError(f"{what}={name!r} is not a supported dtype; allowed: {sorted(DTYPES)}")
  return DTYPES[name]


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding parameters; `rope_type='llama3'` uses the Llama-3 frequency scaling."""
  theta: float = 10000.0
  rope_type: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"rope_type={self.rope_type!r} is not supported; allowed: {ROPE_TYPES}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of the policy decoder.

  `dtype` is the activation/compute dtype, `param_dtype` the storage dtype of the weights;
  attention softmax, norms and logits are always computed in float32.
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope: RopeConfig = RopeConfig()
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  # RMSNorm over each head's queries and keys (weights [D], shared by the heads) before RoPE.
  qk_norm: bool = False
  tie_embeddings: bool = False
  max_position_embeddings: int = 32768
  dtype: str = "float32"
  param_dtype: str = "float32"
  attention_impl: str = "auto"
  model_type: str = "qwen2"
  # Layers (0-based) whose outputs the entry points append to the returned features, for an
  # EAGLE-3-style drafter that fuses low/mid/high layers; () = final-norm hidden state only.
  feature_layers: tuple[int, ...] = ()
  # Run the layers as a lax.scan over the stacked weights instead of a Python loop: compiles
  # faster for deep models, but on GPU the scan copies each layer's weights before use.
  scan_layers: bool = False
  # Training memory (no effect on a forward pass that is not differentiated, except
  # attention_query_chunk's chunking): see REMAT_POLICIES, and `query_chunk` of
  # tlt_jax.kernels.prefix_tree_attention (0 = the whole block at once).
  remat: str = "none"
  attention_query_chunk: int = 0
  # "fast" or "invariant": a token's logits bit for bit the same in every program shape
  # (decode, tree verify, prefill, training forward), at some cost (tlt_jax.kernels.numerics).
  numerics: str = "fast"

  def __post_init__(self):
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat={self.remat!r} is not allowed; allowed values: "
                       f"{REMAT_POLICIES}")
    if self.numerics not in NUMERICS:
      raise ValueError(f"model.numerics={self.numerics!r} is not allowed; allowed values: "
                       f"{NUMERICS}")
    if self.numerics == "invariant" and self.dtype == "float32":
      raise ValueError("model.numerics='invariant' needs model.dtype bfloat16 or float16 (its "
                       "products of two such numbers are exact in float32, which keeps XLA's "
                       "fused multiply-adds from changing any bit); float32 runs are "
                       "token-exact with model.numerics='fast'")
    if self.attention_query_chunk < 0:
      raise ValueError(f"model.attention_query_chunk must be >= 0 (0 = off), got "
                       f"{self.attention_query_chunk}")
    dtype_from_name(self.dtype, "model.dtype")
    dtype_from_name(self.param_dtype, "model.param_dtype")
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f"model.model_type={self.model_type!r} is not allowed; allowed values: "
                       f"{MODEL_TYPES}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
    bad = [i for i in self.feature_layers if not 0 <= i < self.num_layers]
    if bad:
      raise ValueError(f"feature_layers {bad} out of range for {self.num_layers} layers")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")

  @property
  def feature_size(self) -> int:
    """Width of the features the entry points return: (1 + len(feature_layers)) * hidden."""
    return (1 + len(self.feature_layers)) * self.hidden_size

  @property
  def jnp_dtype(self):
    return DTYPES[self.dtype]

  @property
  def jnp_param_dtype(self):
    return DTYPES[self.param_dtype]

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)
