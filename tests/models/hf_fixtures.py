"""Tiny random Hugging Face checkpoints built with torch, for parity tests."""

from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

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


def qwen3_config(tied: bool = False) -> Qwen3Config:
  """Per-head q/k norms, no qkv bias, head_dim 16 where hidden / heads is not (12 untied:
  GQA 4 -> 2, theta 1e6 as Qwen3's; 8 tied: GQA 4 -> 1, three layers)."""
  if tied:
    return Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
                       rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
  return Qwen3Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


MODEL_CLASSES = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}


def save_random_model(hf_config, path: str, seed: int = 0):
  """Builds the torch model with random weights (biases and norms, Qwen3's per-head q/k norms
  among them, included) and saves it."""
  torch.manual_seed(seed)
  cls = MODEL_CLASSES[hf_config.model_type]
  model = cls(hf_config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))  # non-trivial norms catch a missed weight
      elif name.endswith(".bias"):
        p.copy_(0.1 * torch.randn_like(p))
  model.save_pretrained(path)
  return model


def save_chat_tokenizer(path: str):
  """Saves a byte-level BPE tokenizer of Qwen's class (Qwen2Tokenizer, as Qwen3 folders name
  it) with ChatML specials and chat template (gguf_fixtures' 33 tokens) into `path`."""
  from transformers import Qwen2Tokenizer

  from tests.models import gguf_fixtures
  tokenizer = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(gguf_fixtures.TOKENS)},
                             merges=[tuple(m.split()) for m in gguf_fixtures.MERGES],
                             unk_token=None, bos_token=None, eos_token="<|im_end|>",
                             pad_token="<|endoftext|>")
  tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
  tokenizer.chat_template = gguf_fixtures.CHAT_TEMPLATE
  tokenizer.save_pretrained(path)
  return tokenizer
