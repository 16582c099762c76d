"""Qwen2.5-32B on a TPU v5p-256 trainer slice (128 chips), one-step off-policy.

rlax-tpu run configs/qwen2_5_32b_tpu_v5p_256.py --set storage.run_dir=gs://BUCKET/runs/q32b
"""

from rlax_tpu.config import (
    AlgorithmConfig,
    ControllerConfig,
    InferenceConfig,
    MeshConfig,
    ModelConfig,
    RunConfig,
    StalenessConfig,
    StorageConfig,
    TrainerConfig,
)


def get_config() -> RunConfig:
    return RunConfig(
        name="qwen2_5_32b_tpu_v5p_256",
        model=ModelConfig(
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
            param_dtype="float32",
            dtype="bfloat16",
            hf_checkpoint="gs://rlax-tpu-models/Qwen2.5-32B-Instruct",
        ),
        staleness=StalenessConfig.PRESETS["one_step_off_policy"](),
        trainer=TrainerConfig(
            mesh=MeshConfig(data=1, fsdp=-1, tensor=8),
            algorithm=AlgorithmConfig(name="dapo"),
            mini_batch_size=512,
            micro_batch_size=32,
            max_seq_len=20480,
            learning_rate=1e-6,
            warmup_steps=20,
            weight_decay=0.1,
        ),
        inference=InferenceConfig(
            mesh=MeshConfig(data=1, fsdp=1, tensor=8),
            num_workers=16,
            max_decode_slots=256,
            page_size=64,
            kv_cache_bytes=64 * 2**30,
            prefill_buckets=(512, 1024, 2048, 4096),
            max_prompt_len=4096,
            max_new_tokens=16384,
            stop_token_ids=(151643, 151645),
        ),
        controller=ControllerConfig(num_steps=1000, prompts_per_batch=64, samples_per_prompt=16),
        storage=StorageConfig(run_dir="gs://rlax-tpu-runs/qwen2_5_32b"),
    )
