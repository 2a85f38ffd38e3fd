"""Policy decoder, drafter, KV cache, attention inputs, and Hugging Face interop."""

from tlt_jax.models.attention_inputs import AttentionInputs
from tlt_jax.models.config import ModelConfig, RopeConfig
from tlt_jax.models.decoder import (TreeKV, commit, decode, forward, init_params,
                                    param_logical_axes, prefill, verify)
from tlt_jax.models.kv_cache import KVCache, append_kv, init_cache
from tlt_jax.models.policy import Policy

__all__ = ["ModelConfig", "RopeConfig", "AttentionInputs", "TreeKV", "KVCache", "init_params",
           "param_logical_axes", "forward", "prefill", "decode", "verify", "commit",
           "init_cache", "append_kv", "Policy"]
