"""The `rlax-tpu compile` tests' config: a tiny model compiled for one v5p host (4 chips).

head_dim 128 and bfloat16 so that the TPU kernels take it (the paged-attention decode
kernel, splash attention in training): the compile checks the programs the TPU would run.
"""

from rlax_tpu.config import (
    ControllerConfig,
    InferenceConfig,
    MeshConfig,
    ModelConfig,
    RunConfig,
    TrainerConfig,
)


def get_config() -> RunConfig:
    return RunConfig(
        name="compile_tiny",
        model=ModelConfig(head_dim=128, dtype="bfloat16", num_layers=1),
        trainer=TrainerConfig(
            mesh=MeshConfig(data=1, fsdp=2, tensor=2, topology="v5p:2x2x1"),
            mini_batch_size=8,
            micro_batch_size=4,
            max_seq_len=128,
        ),
        inference=InferenceConfig(
            mesh=MeshConfig(data=1, fsdp=1, tensor=-1, topology="v5p:2x2x1"),
            max_decode_slots=8,
            prefill_buckets=(32,),
            max_prompt_len=32,
            max_new_tokens=32,
        ),
        controller=ControllerConfig(prompts_per_batch=4, samples_per_prompt=2),
    )
