"""Llama 3.1 8B on a TPU v6e-16 trainer slice (16 chips, 32 GiB of HBM each), one-step
off-policy: the common small slice. Inference workers on v6e-4 (4 chips, one host).

  rlax-tpu compile configs/llama3_1_8b_tpu_v6e_16.py     # does it fit? (any Linux host)
  rlax-tpu run configs/llama3_1_8b_tpu_v6e_16.py \
      --set model.hf_checkpoint=gs://BUCKET/Llama-3.1-8B-Instruct \
      --set storage.run_dir=gs://BUCKET/runs/llama3_8b_v6e

The v5p-64 config with what the smaller slice changes: everything not named here (the
model, the memory knobs, sampling, the deployment's images and node pools) is its.
"""

import dataclasses
from pathlib import Path

from rlax_tpu.config import (
    AlgorithmConfig,
    MeshConfig,
    ParamServerConfig,
    RunConfig,
    StalenessConfig,
    StorageConfig,
    TpuSliceConfig,
    VerifierConfig,
    load_config,
)

V5P_64 = Path(__file__).with_name("llama3_1_8b_tpu_v5p_64.py")


def get_config() -> RunConfig:
    base = load_config(str(V5P_64))
    replace = dataclasses.replace
    return replace(
        base,
        name="llama3_1_8b_tpu_v6e_16",
        staleness=StalenessConfig.PRESETS["one_step_off_policy"](),
        trainer=replace(
            base.trainer,
            # 16 chips (v6e-16, 4x4): fsdp 4 × tensor 4. float32 master weights and Adam
            # state: 8.0e9 × 12 B = 96 GB, 6 GB a chip.
            mesh=MeshConfig(data=1, fsdp=-1, tensor=4, topology="v6e:4x4"),
            algorithm=AlgorithmConfig(name="grpo"),
            mini_batch_size=64,
            micro_batch_size=8,
            max_seq_len=8192,
            # Packed rows of one max-length sequence: a padded micro-batch's shapes (so the
            # same memory), and only the packed micro-batches a mini-batch fills run.
            tokens_per_row=8192,
            # A v6e chip has a third of a v5p's HBM: full remat and scanned layers as the
            # v5p config, a smaller log-prob chunk (docs/trainer.md, "Memory"; the figures
            # of `rlax-tpu compile` on this config are in its table).
            logprob_chunk_size=4096,
            optimizer=replace(base.trainer.optimizer, warmup_steps=10),
        ),
        inference=replace(
            base.inference,
            # One host's 4 chips: 8 of 32 heads, 2 of 8 kv heads each.
            mesh=MeshConfig(data=1, fsdp=1, tensor=4, topology="v6e:2x2"),
            num_workers=4,
            max_decode_slots=128,
            # 4 GiB of pages a chip, next to 4 GB of bf16 weights.
            kv_cache_bytes=16 * 2**30,
            # The v5p config's expected lengths (assumptions), responses clipped to 6144:
            # with on-demand pages the pool holds ~72 live sequences, 15 if each reserved
            # 2048 + 6144 tokens (`rlax-tpu compile`'s KV capacity).
            max_new_tokens=6144,
        ),
        # K = N + η + 1 = 3 bf16 versions of 16 GB: one replica.
        param_server=ParamServerConfig(num_replicas=1),
        verifiers=VerifierConfig(num_workers=8),
        controller=replace(
            base.controller, num_steps=500, prompts_per_batch=32, samples_per_prompt=8
        ),
        storage=StorageConfig(run_dir="gs://rlax-tpu-runs/llama3_1_8b_v6e"),
        deploy=replace(
            base.deploy,
            trainer_tpu=TpuSliceConfig(accelerator="tpu-v6e-slice", topology="4x4"),
            inference_tpu=TpuSliceConfig(accelerator="tpu-v6e-slice", topology="2x2"),
            verifier_replicas=2,
            # 3 versions × 16.06 GB, with room for versions waiting for their persistent copy.
            param_server_memory="72Gi",
        ),
    )
