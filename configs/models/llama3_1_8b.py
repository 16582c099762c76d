"""Llama 3.1 8B (meta-llama/Llama-3.1-8B-Instruct): the architecture, as its
config.json says, and the dtypes every recipe training it uses. Recipes compose it
(`rlax_tpu.config.load_fragment`) and name their checkpoint."""

from rlax_tpu.config import ModelConfig, RopeScalingConfig


def get_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500_000.0,
        rope_scaling=RopeScalingConfig(
            type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        # float32 master weights and Adam state; bf16 matmuls; bf16 weights published,
        # stored by the parameter server and served by the workers (half the bytes).
        param_dtype="float32",
        dtype="bfloat16",
        publish_dtype="bfloat16",
    )
