"""Llama 3.1 8B on a TPU v5p-64 trainer slice, RLAX-style off-policy (η=16, N=32).

  rlax-tpu run configs/llama3_1_8b_tpu_v5p_64.py \
      --set model.hf_checkpoint=gs://BUCKET/Llama-3.1-8B-Instruct \
      --set storage.run_dir=gs://BUCKET/runs/llama3_8b

On GKE (docs/deploy.md): `rlax-tpu deploy gke configs/llama3_1_8b_tpu_v5p_64.py --set ...`
renders the JobSet; deploy/gke/llama3_1_8b_tpu_v5p_64.yaml is this config as shipped.
"""

import dataclasses
from pathlib import Path

from rlax_tpu.config import (
    AlgorithmConfig,
    ControllerConfig,
    DatasetConfig,
    DeployConfig,
    Distribution,
    InferenceConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    ParamServerConfig,
    RunConfig,
    StalenessConfig,
    StorageConfig,
    TpuSliceConfig,
    TrainerConfig,
    VerifierConfig,
    load_fragment,
)

MODELS = Path(__file__).with_name("models")


def get_config() -> RunConfig:
    return RunConfig(
        name="llama3_1_8b_tpu_v5p_64",
        model=dataclasses.replace(
            load_fragment(MODELS / "llama3_1_8b.py", ModelConfig),
            hf_checkpoint="gs://rlax-tpu-models/Llama-3.1-8B-Instruct",
        ),
        staleness=StalenessConfig.PRESETS["off_policy"](),
        trainer=TrainerConfig(
            # 32 chips (v5p-64 = 32 chips): fsdp over 8, tensor 4.
            mesh=MeshConfig(data=1, fsdp=-1, tensor=4, topology="v5p:2x4x4"),
            algorithm=AlgorithmConfig(name="aipo"),
            # N > 0: ρ against the generating version's log-probs; recomputed π_old hides staleness.
            behaviour_logprobs="cached",
            mini_batch_size=256,
            micro_batch_size=32,
            max_seq_len=16384,
            # Packed rows of one max-length sequence: a padded micro-batch's shapes (so the
            # same memory), and only the packed micro-batches a mini-batch fills run.
            tokens_per_row=16384,
            # Memory (docs/trainer.md): without these one decoder layer's temporaries at
            # 32 × 16384 tokens exceed a chip. `rlax-tpu compile` on this config: rl_step
            # needs 35.9 GiB of a v5p chip's 95; save_dot_except_mlp: 58.2 GiB for 2.7%
            # fewer FLOPs.
            remat_policy="full",
            scan_layers=True,
            logprob_chunk_size=8192,
            optimizer=OptimizerConfig(
                learning_rate=1e-6, lr_schedule="constant", warmup_steps=20, weight_decay=0.1
            ),
        ),
        inference=InferenceConfig(
            mesh=MeshConfig(data=1, fsdp=1, tensor=4, topology="v5p:2x2x1"),
            num_workers=16,
            max_decode_slots=256,
            page_size=64,
            kv_cache_bytes=48 * 2**30,
            prefill_buckets=(512, 1024, 2048),
            max_prompt_len=2048,
            max_new_tokens=14336,
            # Expected lengths: assumptions, not measurements, for math RL with
            # Llama-3.1-8B-Instruct (prompts a few hundred tokens; responses ~1k with a heavy
            # tail of long reasoning up to the 14336-token budget). They size `rlax-tpu
            # compile`'s KV capacity (rlax_tpu/inference/capacity.py): with on-demand pages
            # the 48 GiB pool holds ~170 live sequences, 23 if each reserved 2048 + 14336
            # tokens. The v6e-16 config inherits them.
            prompt_tokens=Distribution(kind="lognormal", median=256.0, sigma=0.5),
            response_tokens=Distribution(kind="lognormal", median=1024.0, sigma=1.0),
            temperature=1.0,
            stop_token_ids=(128001, 128008, 128009),
        ),
        # K = N + η + 1 = 49 bfloat16 versions of 16.1 GB (8.03e9 params × 2 B): 787 GB,
        # 8 replicas of 91.6 GiB each (sized below).
        param_server=ParamServerConfig(num_replicas=8),
        verifiers=VerifierConfig(num_workers=16),
        controller=ControllerConfig(
            num_steps=2000,
            prompts_per_batch=128,
            samples_per_prompt=16,
            datasets=(DatasetConfig(path="gs://rlax-tpu-data/math/train.jsonl", verifier="math"),),
        ),
        storage=StorageConfig(run_dir="gs://rlax-tpu-runs/llama3_1_8b"),
        deploy=DeployConfig(
            image="us-docker.pkg.dev/rlax-tpu/images/rlax-tpu:0.1.0",
            service_account="rlax-tpu",
            # v5p-64: 32 chips on 8 hosts of 4; the trainer mesh (fsdp 8 × tensor 4) fills it.
            trainer_tpu=TpuSliceConfig(accelerator="tpu-v5p-slice", topology="2x4x4"),
            # One v5p-8 (4 chips, one host) per inference worker: tensor 4.
            inference_tpu=TpuSliceConfig(accelerator="tpu-v5p-slice", topology="2x2x1"),
            cpu_node_pool="cpu-highmem",
            verifier_node_pool="verifier-sandbox",
            verifier_replicas=4,
            controller_cpu="8",
            controller_memory="32Gi",
            param_server_cpu="16",
            # Per replica: 49 versions × 14.96 GiB / 8 = 91.6 GiB,
            # plus a third for versions waiting for their persistent copy and gRPC buffers.
            param_server_memory="128Gi",
            verifier_cpu="16",
            verifier_memory="32Gi",
            termination_grace_period_s=600,
        ),
    )
