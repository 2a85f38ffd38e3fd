"""Named model shapes (ModelConfig keyword arguments) for budgets and benchmarks that need a
real model's dimensions without its weights."""

from __future__ import annotations

import ml_collections

MODEL_SHAPES: dict[str, dict] = {
    # A model small enough for a 2-core CPU, with a 32k vocabulary.
    "small": dict(vocab_size=32768, hidden_size=256, intermediate_size=768, num_layers=6,
                  num_heads=8, num_kv_heads=2, head_dim=32, qkv_bias=True,
                  max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                         qkv_bias=True, tie_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                       qkv_bias=True, max_position_embeddings=32768),
}


def with_model_shape(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """A copy of `config` whose model has the dimensions of MODEL_SHAPES[name] and random
  weights (model.path cleared), for budgets and benchmarks."""
  if name not in MODEL_SHAPES:
    raise ValueError(f"unknown model shape {name!r}; known: {sorted(MODEL_SHAPES)}")
  shape = dict(MODEL_SHAPES[name])
  out = config.copy_and_resolve_references()
  with out.unlocked():
    out.model.path = ""
    out.model.model_type = "qwen2" if shape.pop("qkv_bias", False) else "llama"
    out.model.update(shape)
  return out
