"""Tiny GGUF files written with the gguf package's writer, for import tests.

A byte-level BPE vocabulary of 33 tokens with ChatML specials and template, random float32
weights (or one tensor in a ggml type that transformers cannot dequantise), llama.cpp's tensor
names. Writing one takes milliseconds.
"""

from __future__ import annotations

import gguf
import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Byte-level BPE spells a space as "\u0120" and a newline as "\u010a".
TOKENS = SPECIALS + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
    "\u0120", "\u010a", "ab", "\u0120a"]
MERGES = ["a b", "\u0120 a"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def write_tiny_gguf(path: str, arch: str = "llama", untied: bool = False,
                    raw_ffn_down: gguf.GGMLQuantizationType | None = None, seed: int = 0,
                    rope_scaling: str | None = None, head_dim: int = HEAD_DIM) -> str:
  """Writes a 2-layer model of `arch` ('llama', 'qwen2' with QKV biases, 'qwen3' with per-head
  q/k norms, or any other name with llama's tensors) to `path`. untied: an output.weight of its
  own. raw_ffn_down: store each ffn_down.weight as zero bytes of that ggml type (a
  quantisation to fail on). rope_scaling: 'yarn' (factor 4, as llama.cpp writes its keys) or
  'rope_freqs' (Llama-3's scaled frequencies as llama.cpp stores them, a rope_freqs.weight
  tensor). head_dim: other than HIDDEN / HEADS, written as the attention key and value
  lengths, as llama.cpp writes Qwen3's."""
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(LAYERS)
  w.add_context_length(256)
  w.add_embedding_length(HIDDEN)
  w.add_feed_forward_length(FFN)
  w.add_head_count(HEADS)
  w.add_head_count_kv(KV_HEADS)
  if head_dim != HIDDEN // HEADS:
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model("gpt2")
  w.add_token_list(TOKENS)
  w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS)
                    + [gguf.TokenType.NORMAL] * (len(TOKENS) - len(SPECIALS)))
  w.add_token_merges(MERGES)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_chat_template(CHAT_TEMPLATE)
  if rope_scaling == "yarn":
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(64)
  elif rope_scaling == "rope_freqs":
    w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, head_dim // 2, dtype=np.float32))

  def tensor(name, *shape, scale=0.2):  # shapes as torch has them: [out, in]
    w.add_tensor(name, (scale * rng.standard_normal(shape)).astype(np.float32))

  vocab = len(TOKENS)
  tensor("token_embd.weight", vocab, HIDDEN, scale=1.0)
  tensor("output_norm.weight", HIDDEN)
  if untied:
    tensor("output.weight", vocab, HIDDEN)
  q, kv = HEADS * head_dim, KV_HEADS * head_dim
  for i in range(LAYERS):
    p = f"blk.{i}."
    tensor(p + "attn_norm.weight", HIDDEN)
    tensor(p + "ffn_norm.weight", HIDDEN)
    tensor(p + "attn_q.weight", q, HIDDEN)
    tensor(p + "attn_k.weight", kv, HIDDEN)
    tensor(p + "attn_v.weight", kv, HIDDEN)
    tensor(p + "attn_output.weight", HIDDEN, q)
    if arch == "qwen2":
      tensor(p + "attn_q.bias", q)
      tensor(p + "attn_k.bias", kv)
      tensor(p + "attn_v.bias", kv)
    if arch == "qwen3":
      w.add_tensor(p + "attn_q_norm.weight",
                   (1.0 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32))
      w.add_tensor(p + "attn_k_norm.weight",
                   (1.0 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32))
    tensor(p + "ffn_gate.weight", FFN, HIDDEN)
    tensor(p + "ffn_up.weight", FFN, HIDDEN)
    if raw_ffn_down is None:
      tensor(p + "ffn_down.weight", HIDDEN, FFN)
    else:
      block, size = gguf.GGML_QUANT_SIZES[raw_ffn_down]
      w.add_tensor(p + "ffn_down.weight", np.zeros((HIDDEN, FFN // block * size), np.uint8),
                   raw_dtype=raw_ffn_down)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
