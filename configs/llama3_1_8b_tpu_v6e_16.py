"""Llama 3.1 8B on a TPU v6e-16 trainer slice (16 chips, 32 GiB of HBM each), one-step
off-policy: the common small slice. Inference workers on v6e-4 (4 chips, one host).

  rlax-tpu compile configs/llama3_1_8b_tpu_v6e_16.py     # does it fit? (any Linux host)
  rlax-tpu run configs/llama3_1_8b_tpu_v6e_16.py \
      --set model.hf_checkpoint=gs://BUCKET/Llama-3.1-8B-Instruct \
      --set storage.run_dir=gs://BUCKET/runs/llama3_8b_v6e
"""

from pathlib import Path

from rlax_tpu.config import (
    AlgorithmConfig,
    ControllerConfig,
    DatasetConfig,
    DeployConfig,
    InferenceConfig,
    MeshConfig,
    ParamServerConfig,
    RunConfig,
    StalenessConfig,
    StorageConfig,
    TpuSliceConfig,
    TrainerConfig,
    VerifierConfig,
    load_config,
)

# The model section (Llama 3.1 8B: dims, RoPE scaling, float32 masters, bf16 compute and
# published weights) is the v5p-64 config's, named once.
LLAMA3_1_8B = load_config(str(Path(__file__).with_name("llama3_1_8b_tpu_v5p_64.py"))).model


def get_config() -> RunConfig:
    return RunConfig(
        name="llama3_1_8b_tpu_v6e_16",
        # float32 master weights and Adam state: 8.0e9 × 12 B = 96 GB, 6 GB a chip over 16.
        model=LLAMA3_1_8B,
        staleness=StalenessConfig.PRESETS["one_step_off_policy"](),
        trainer=TrainerConfig(
            # 16 chips (v6e-16, 4x4): fsdp 4 × tensor 4.
            mesh=MeshConfig(data=1, fsdp=-1, tensor=4, topology="v6e:4x4"),
            algorithm=AlgorithmConfig(name="grpo"),
            behaviour_logprobs="cached",
            mini_batch_size=64,
            micro_batch_size=8,
            max_seq_len=8192,
            # A v6e chip has a third of a v5p's HBM: full remat, scanned layers and a
            # chunked log-prob head (docs/trainer.md, "Memory"; the figures of
            # `rlax-tpu compile` on this config are in its table).
            remat_policy="full",
            scan_layers=True,
            logprob_chunk_size=4096,
            learning_rate=1e-6,
            warmup_steps=10,
            weight_decay=0.1,
        ),
        inference=InferenceConfig(
            # One host's 4 chips: 8 of 32 heads, 2 of 8 kv heads each.
            mesh=MeshConfig(data=1, fsdp=1, tensor=4, topology="v6e:2x2"),
            num_workers=4,
            max_decode_slots=128,
            page_size=64,
            # 4 GiB of pages a chip, next to 4 GB of bf16 weights.
            kv_cache_bytes=16 * 2**30,
            prefill_buckets=(512, 1024, 2048),
            max_prompt_len=2048,
            max_new_tokens=6144,
            temperature=1.0,
            stop_token_ids=(128001, 128008, 128009),
        ),
        # K = N + η + 1 = 3 bf16 versions of 16 GB: one replica.
        param_server=ParamServerConfig(num_replicas=1),
        verifiers=VerifierConfig(num_workers=8),
        controller=ControllerConfig(
            num_steps=500,
            prompts_per_batch=32,
            samples_per_prompt=8,
            datasets=(DatasetConfig(path="gs://rlax-tpu-data/math/train.jsonl", verifier="math"),),
        ),
        storage=StorageConfig(run_dir="gs://rlax-tpu-runs/llama3_1_8b_v6e"),
        deploy=DeployConfig(
            image="us-docker.pkg.dev/rlax-tpu/images/rlax-tpu:0.1.0",
            service_account="rlax-tpu",
            trainer_tpu=TpuSliceConfig(accelerator="tpu-v6e-slice", topology="4x4"),
            inference_tpu=TpuSliceConfig(accelerator="tpu-v6e-slice", topology="2x2"),
            cpu_node_pool="cpu-highmem",
            verifier_node_pool="verifier-sandbox",
            verifier_replicas=2,
            controller_cpu="8",
            controller_memory="32Gi",
            param_server_cpu="16",
            # 3 versions × 16.06 GB + the 4 GiB pull cache, about a third of headroom.
            param_server_memory="72Gi",
            verifier_cpu="16",
            verifier_memory="32Gi",
            termination_grace_period_s=600,
        ),
    )
