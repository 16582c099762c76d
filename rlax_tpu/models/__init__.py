"""Model family (Llama 3 / Qwen2 / Qwen3), its KV-cache seam, Hugging Face checkpoints and
tokenizers."""

from rlax_tpu.models.attention import train_attention
from rlax_tpu.models.export import export_hf, export_merged, export_peft
from rlax_tpu.models.hf import (
    CheckpointError,
    CheckpointMismatchError,
    UnsupportedCheckpointError,
    load_hf_config,
    load_hf_model,
    load_hf_params,
    load_hf_sharded,
    save_hf,
    save_peft_adapter,
)
from rlax_tpu.models.kv_cache import DenseKVCache, KVCache, grouped_attention
from rlax_tpu.models.logprobs import logprob_head
from rlax_tpu.models.options import ForwardOptions
from rlax_tpu.models.transformer import (
    TrainOutput,
    Transformer,
    apply_rope,
    rope_inv_freq,
    stack_layers,
    token_logprobs,
    unstack_layers,
)

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "DenseKVCache",
    "ForwardOptions",
    "KVCache",
    "TrainOutput",
    "Transformer",
    "UnsupportedCheckpointError",
    "apply_rope",
    "export_hf",
    "export_merged",
    "export_peft",
    "grouped_attention",
    "load_hf_config",
    "load_hf_model",
    "load_hf_params",
    "load_hf_sharded",
    "logprob_head",
    "rope_inv_freq",
    "save_hf",
    "save_peft_adapter",
    "stack_layers",
    "token_logprobs",
    "train_attention",
    "unstack_layers",
]
