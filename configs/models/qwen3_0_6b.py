"""Qwen3 0.6B (Qwen/Qwen3-0.6B): the architecture, as its
config.json says, and the dtypes every recipe training it uses. Recipes compose it
(`rlax_tpu.config.load_fragment`) and name their checkpoint."""

from rlax_tpu.config import ModelConfig


def get_config() -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        qk_norm=True,
        # float32 master weights; bf16 matmuls; bf16 weights published and served.
        param_dtype="float32",
        dtype="bfloat16",
        publish_dtype="bfloat16",
    )
