"""Qwen3-0.6B on one GPU of 80 GB, one-step off-policy (η=1, N=1): a small real-model recipe.
The trainer and the inference worker share the GPU (trainer.gpu_memory_fraction,
inference.gpu_memory_fraction; docs/gpu_tpu_recipes.md).

Point model.hf_checkpoint at a local or gs:// copy of the Hugging Face checkpoint:
  rlax-tpu compile configs/qwen3_0_6b_gpu.py     # does it fit its share of an 80 GB GPU?
  rlax-tpu run configs/qwen3_0_6b_gpu.py --set model.hf_checkpoint=gs://BUCKET/Qwen3-0.6B
"""

import dataclasses
from pathlib import Path

from rlax_tpu.config import (
    AlgorithmConfig,
    ClipConfig,
    ControllerConfig,
    InferenceConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    StalenessConfig,
    StorageConfig,
    TrainerConfig,
    load_fragment,
)

MODELS = Path(__file__).with_name("models")


def get_config() -> RunConfig:
    return RunConfig(
        name="qwen3_0_6b_gpu",
        model=dataclasses.replace(
            load_fragment(MODELS / "qwen3_0_6b.py", ModelConfig),
            hf_checkpoint="/data/models/Qwen3-0.6B",
        ),
        staleness=StalenessConfig.PRESETS["one_step_off_policy"](),
        trainer=TrainerConfig(
            mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
            gpu="h100",
            algorithm=AlgorithmConfig(name="grpo", clip=ClipConfig(eps_high=0.28)),
            # N > 0: ρ against the generating version's log-probs; recomputed π_old hides staleness.
            behaviour_logprobs="cached",
            mini_batch_size=64,
            # Memory: 827 GiB a step without remat at micro-batch 8 (XLA:CPU's estimate);
            # each layer keeping only its input, one compiled layer and the log-prob head
            # 4096 tokens at a time, 4 sequences of 4096 a pass fit the trainer's 55%
            # (figures in docs/gpu_tpu_recipes.md).
            micro_batch_size=4,
            remat_policy="full",
            scan_layers=True,
            logprob_chunk_size=4096,
            max_seq_len=4096,
            optimizer=OptimizerConfig(learning_rate=1e-6, warmup_steps=10, weight_decay=0.01),
        ),
        inference=InferenceConfig(
            mesh=MeshConfig(data=1, fsdp=1, tensor=-1),
            gpu="h100",
            max_decode_slots=128,
            page_size=32,
            # 112 KiB a token: 6 GiB hold 56k tokens. Prefill and decode of the JAX paged
            # attention (what `auto` runs on a GPU) hold two more copies of the pool, so
            # 3 × 6 GiB + weights fit the worker's 35% (16 GiB, as before, would not).
            kv_cache_bytes=6 * 2**30,
            prefill_buckets=(256, 512, 1024),
            max_prompt_len=1024,
            max_new_tokens=3072,
        ),
        controller=ControllerConfig(num_steps=500, prompts_per_batch=32, samples_per_prompt=8),
        storage=StorageConfig(run_dir="runs/qwen3_0_6b_gpu"),
    )
