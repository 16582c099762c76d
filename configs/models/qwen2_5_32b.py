"""Qwen2.5 32B (Qwen/Qwen2.5-32B-Instruct): the architecture, as its
config.json says, and the dtypes every recipe training it uses. Recipes compose it
(`rlax_tpu.config.load_fragment`) and name their checkpoint."""

from rlax_tpu.config import ModelConfig


def get_config() -> ModelConfig:
    return ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        qkv_bias=True,
        # float32 master weights and Adam state; bf16 matmuls; bf16 weights published,
        # stored by the parameter server and served by the workers (half the bytes).
        param_dtype="float32",
        dtype="bfloat16",
        publish_dtype="bfloat16",
    )
