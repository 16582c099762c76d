"""Model family (Llama 3 / Qwen2 / Qwen3) and its KV-cache seam."""

from rlax_tpu.models.kv_cache import DenseKVCache, KVCache, grouped_attention
from rlax_tpu.models.transformer import (
    Transformer,
    TrainOutput,
    apply_rope,
    rope_inv_freq,
    token_logprobs,
)

__all__ = [
    "DenseKVCache",
    "KVCache",
    "TrainOutput",
    "Transformer",
    "apply_rope",
    "grouped_attention",
    "rope_inv_freq",
    "token_logprobs",
]
