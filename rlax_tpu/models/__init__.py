"""Model family (Llama 3 / Qwen2 / Qwen3), its KV-cache seam, Hugging Face checkpoints and
tokenizers."""

from rlax_tpu.models.hf import (
    CheckpointError,
    CheckpointMismatchError,
    UnsupportedCheckpointError,
    load_hf_config,
    load_hf_model,
    load_hf_params,
    save_hf,
)
from rlax_tpu.models.kv_cache import DenseKVCache, KVCache, grouped_attention
from rlax_tpu.models.tokenizer import Tokenizer
from rlax_tpu.models.transformer import (
    TrainOutput,
    Transformer,
    apply_rope,
    rope_inv_freq,
    token_logprobs,
)

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "DenseKVCache",
    "KVCache",
    "Tokenizer",
    "TrainOutput",
    "Transformer",
    "UnsupportedCheckpointError",
    "apply_rope",
    "grouped_attention",
    "load_hf_config",
    "load_hf_model",
    "load_hf_params",
    "rope_inv_freq",
    "save_hf",
    "token_logprobs",
]
