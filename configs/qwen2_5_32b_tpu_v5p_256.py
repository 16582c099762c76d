"""Qwen2.5-32B on a TPU v5p-256 trainer slice (128 chips), one-step off-policy.

rlax-tpu run configs/qwen2_5_32b_tpu_v5p_256.py --set storage.run_dir=gs://BUCKET/runs/q32b

On GKE (docs/deploy.md): `rlax-tpu deploy gke configs/qwen2_5_32b_tpu_v5p_256.py --set ...`
renders the JobSet; deploy/gke/qwen2_5_32b_tpu_v5p_256.yaml is this config as shipped.
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
        name="qwen2_5_32b_tpu_v5p_256",
        model=dataclasses.replace(
            load_fragment(MODELS / "qwen2_5_32b.py", ModelConfig),
            hf_checkpoint="gs://rlax-tpu-models/Qwen2.5-32B-Instruct",
        ),
        staleness=StalenessConfig.PRESETS["one_step_off_policy"](),
        trainer=TrainerConfig(
            # 128 chips (v5p-256): fsdp over 16, tensor 8.
            mesh=MeshConfig(data=1, fsdp=-1, tensor=8, topology="v5p:4x4x8"),
            algorithm=AlgorithmConfig(name="dapo"),
            # N > 0: ρ against the generating version's log-probs; recomputed π_old hides staleness.
            behaviour_logprobs="cached",
            mini_batch_size=512,
            micro_batch_size=32,
            max_seq_len=20480,
            # Packed rows of one max-length sequence: a padded micro-batch's shapes (so the
            # same memory), and only the packed micro-batches a mini-batch fills run.
            tokens_per_row=20480,
            # Memory (docs/trainer.md): `rlax-tpu compile` on this config: rl_step needs
            # 41.2 GiB of a v5p chip's 95; save_dot_except_mlp: 70.0 GiB for 2.1% fewer FLOPs.
            remat_policy="full",
            scan_layers=True,
            logprob_chunk_size=8192,
            optimizer=OptimizerConfig(learning_rate=1e-6, warmup_steps=20, weight_decay=0.1),
        ),
        inference=InferenceConfig(
            # One host's 4 chips (an inference worker runs on one host): 10 of 40 heads each.
            mesh=MeshConfig(data=1, fsdp=1, tensor=4, topology="v5p:2x2x1"),
            num_workers=16,
            max_decode_slots=256,
            page_size=64,
            kv_cache_bytes=64 * 2**30,
            prefill_buckets=(512, 1024, 2048, 4096),
            max_prompt_len=4096,
            max_new_tokens=16384,
            # Expected lengths: assumptions, not measurements, those of the simulator's QwQ-32B
            # calibration (configs/simulator/rlax_qwq32b_v5p.yaml). They size `rlax-tpu
            # compile`'s KV capacity (rlax_tpu/inference/capacity.py): with on-demand pages
            # the 64 GiB pool holds ~132 live sequences, 12 if each reserved 4096 + 16384
            # tokens.
            prompt_tokens=Distribution(kind="fixed", median=1000.0),
            response_tokens=Distribution(kind="lognormal", median=1500.0, sigma=0.4),
            stop_token_ids=(151643, 151645),
        ),
        # K = N + η + 1 = 3 bfloat16 versions of 65.5 GB (32.76e9 params × 2 B): 197 GB,
        # 4 replicas of 45.8 GiB each (sized below).
        param_server=ParamServerConfig(num_replicas=4),
        verifiers=VerifierConfig(num_workers=16),
        controller=ControllerConfig(
            num_steps=1000,
            prompts_per_batch=64,
            samples_per_prompt=16,
            datasets=(DatasetConfig(path="gs://rlax-tpu-data/math/train.jsonl", verifier="math"),),
        ),
        storage=StorageConfig(run_dir="gs://rlax-tpu-runs/qwen2_5_32b"),
        deploy=DeployConfig(
            image="us-docker.pkg.dev/rlax-tpu/images/rlax-tpu:0.1.0",
            service_account="rlax-tpu",
            # v5p-256: 128 chips on 32 hosts of 4; the trainer mesh (fsdp 16 × tensor 8) fills it.
            trainer_tpu=TpuSliceConfig(accelerator="tpu-v5p-slice", topology="4x4x8"),
            # One v5p-8 (4 chips, one host) per inference worker: tensor 4.
            inference_tpu=TpuSliceConfig(accelerator="tpu-v5p-slice", topology="2x2x1"),
            cpu_node_pool="cpu-highmem",
            verifier_node_pool="verifier-sandbox",
            verifier_replicas=4,
            controller_cpu="8",
            controller_memory="32Gi",
            param_server_cpu="16",
            # Per replica: 3 versions × 61.03 GiB / 4 = 45.8 GiB,
            # plus a third for versions waiting for their persistent copy and gRPC buffers.
            param_server_memory="72Gi",
            verifier_cpu="16",
            verifier_memory="32Gi",
            termination_grace_period_s=900,
        ),
    )
