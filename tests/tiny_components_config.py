"""The component tests' config: a tiny random Llama-style model, on-policy, on 8 virtual
CPU devices (trainer mesh 2 x 2 x 2). Kept apart from the shipped demo (configs/tiny_cpu.py)
so tuning the demo never changes what the component tests exercise."""

from rlax_tpu.config import (
    ControllerConfig,
    InferenceConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    StalenessConfig,
    StorageConfig,
    TrainerConfig,
)


def get_config() -> RunConfig:
    return RunConfig(
        name="tiny_components",
        seed=0,
        cpu_devices=8,
        model=ModelConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=512,
        ),
        staleness=StalenessConfig.PRESETS["on_policy"](),
        trainer=TrainerConfig(
            mesh=MeshConfig(data=2, fsdp=2, tensor=2),
            mini_batch_size=8,
            micro_batch_size=4,
            max_seq_len=128,
            optimizer=OptimizerConfig(learning_rate=1e-4),
        ),
        inference=InferenceConfig(
            mesh=MeshConfig(data=1, fsdp=1, tensor=-1),
            max_decode_slots=8,
            prefill_buckets=(16, 32, 64),
            max_prompt_len=64,
            max_new_tokens=32,
        ),
        controller=ControllerConfig(num_steps=4, prompts_per_batch=4, samples_per_prompt=2),
        storage=StorageConfig(run_dir="runs/tiny_components"),
    )
