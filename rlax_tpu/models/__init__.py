"""Model family (Llama 3 / Qwen2 / Qwen3), its KV-cache seam, Hugging Face checkpoints and
tokenizers."""

from rlax_tpu._lazy import lazy_exports

# Public name -> the submodule defining it; imported on first use (rlax_tpu._lazy).
_EXPORTS = {
    "CheckpointError": "hf",
    "CheckpointMismatchError": "hf",
    "UnsupportedCheckpointError": "hf",
    "load_hf_config": "hf",
    "load_hf_model": "hf",
    "load_hf_params": "hf",
    "load_hf_sharded": "hf",
    "save_hf": "hf",
    "export_hf": "export",
    "DenseKVCache": "kv_cache",
    "KVCache": "kv_cache",
    "grouped_attention": "kv_cache",
    "ForwardOptions": "options",
    "logprob_head": "logprobs",
    "stack_layers": "transformer",
    "train_attention": "attention",
    "unstack_layers": "transformer",
    "Tokenizer": "tokenizer",
    "TrainOutput": "transformer",
    "Transformer": "transformer",
    "apply_rope": "transformer",
    "rope_inv_freq": "transformer",
    "token_logprobs": "transformer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
