"""Tiny random Hugging Face checkpoints built with torch, for parity tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 97


def qwen2_config() -> Qwen2Config:
  """QKV bias, GQA (4 query heads over 2 KV heads), untied embeddings."""
  return Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     tie_word_embeddings=False, rms_norm_eps=1e-6)


def llama_config() -> LlamaConfig:
  """Tied embeddings, Llama-3 rope scaling, GQA 4 -> 1, head_dim 16."""
  return LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                     max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                      "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64})


def save_random_model(hf_config, path: str, seed: int = 0):
  """Builds the torch model with random weights (biases and norms included) and saves it."""
  torch.manual_seed(seed)
  cls = Qwen2ForCausalLM if hf_config.model_type == "qwen2" else LlamaForCausalLM
  model = cls(hf_config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))  # non-trivial norms catch a missed weight
      elif name.endswith(".bias"):
        p.copy_(0.1 * torch.randn_like(p))
  model.save_pretrained(path)
  return model
