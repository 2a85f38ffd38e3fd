"""Named model shapes (ModelConfig keyword arguments) for budgets and benchmarks that need a
real model's dimensions without its weights."""

from __future__ import annotations

import ml_collections

from tlt_jax.models.config import ARCHITECTURE_FLAGS


def _shape(model_type: str, **dims) -> dict:
  """ModelConfig keyword arguments of a `model_type` model (its architecture flags included)."""
  return dict(model_type=model_type, **ARCHITECTURE_FLAGS[model_type], **dims)


MODEL_SHAPES: dict[str, dict] = {
    # A model small enough for a 2-core CPU, with a 32k vocabulary.
    "small": _shape("qwen2", vocab_size=32768, hidden_size=256, intermediate_size=768,
                    num_layers=6, num_heads=8, num_kv_heads=2, head_dim=32,
                    max_position_embeddings=32768),
    # SmolLM2-135M-Instruct (configs/smollm2.py, the GPU headline's policy), for random weights of
    # its shape where the model is not at hand (a GPU lease that did not stage it).
    "smollm2-135m": _shape("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                           tie_embeddings=True, max_position_embeddings=8192),
    "qwen2.5-1.5b": _shape("qwen2", vocab_size=151936, hidden_size=1536,
                           intermediate_size=8960, num_layers=28, num_heads=12,
                           num_kv_heads=2, head_dim=128, tie_embeddings=True,
                           max_position_embeddings=32768),
    "qwen2.5-7b": _shape("qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                         num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                         max_position_embeddings=32768),
    # Qwen3 (dense): q/k norms, no qkv bias, head_dim 128 whatever hidden / heads.
    "qwen3-1.7b": _shape("qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                         num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                         tie_embeddings=True, max_position_embeddings=40960),
    "qwen3-4b": _shape("qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                       num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                       tie_embeddings=True, max_position_embeddings=40960),
    "qwen3-8b": _shape("qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                       max_position_embeddings=40960),
}


def with_model_shape(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """A copy of `config` whose model has the dimensions of MODEL_SHAPES[name] and random
  weights (model.path cleared), for budgets and benchmarks. (config.model names the
  architecture by model_type alone; its flags follow from it.)"""
  if name not in MODEL_SHAPES:
    raise ValueError(f"unknown model shape {name!r}; known: {sorted(MODEL_SHAPES)}")
  shape = {k: v for k, v in MODEL_SHAPES[name].items()
           if k not in ARCHITECTURE_FLAGS[MODEL_SHAPES[name]["model_type"]]}
  out = config.copy_and_resolve_references()
  with out.unlocked():
    out.model.path = ""
    out.model.update(shape)
  return out
