"""Qwen2.5-0.5B-Instruct, GRPO on GSM8K, on small TPU slices: the trainer on a v5e-4 (2x2,
4 chips of 16 GiB, one host) and one inference worker on another v5e-4, one-step
off-policy so generation overlaps training (docs/gpu_tpu_recipes.md).

  rlax-tpu compile configs/qwen2_5_0_5b_gsm8k_tpu.py        # does it fit? (any Linux host)
  rlax-tpu deploy gke configs/qwen2_5_0_5b_gsm8k_tpu.py \
      --set model.hf_checkpoint=gs://BUCKET/Qwen2.5-0.5B-Instruct \
      --set data.path=gs://BUCKET/gsm8k/train.jsonl \
      --set controller.eval_dataset=gs://BUCKET/gsm8k/test.jsonl \
      --set storage.run_dir=gs://BUCKET/runs/qwen2_5_0_5b_gsm8k \
      --set deploy.image=REGISTRY/rlax-tpu:TAG --out manifests/

The one-GPU recipe (configs/qwen2_5_0_5b_gsm8k_gpu.py) with what the slices change: the
model, the data, the lengths, the batch and the optimizer are its.
"""

import dataclasses
from pathlib import Path

from rlax_tpu.config import (
    DeployConfig,
    MeshConfig,
    ParamServerConfig,
    RunConfig,
    StalenessConfig,
    StorageConfig,
    TpuSliceConfig,
    load_config,
)

GPU_RECIPE = Path(__file__).with_name("qwen2_5_0_5b_gsm8k_gpu.py")
# GKE's node label of v5e slices (cloud.google.com/gke-tpu-accelerator); a 2x2 slice is
# one ct5lp-hightpu-4t host.
V5E_2X2 = TpuSliceConfig(accelerator="tpu-v5-lite-podslice", topology="2x2", chips_per_host=4)


def get_config() -> RunConfig:
    base = load_config(str(GPU_RECIPE))
    replace = dataclasses.replace
    return replace(
        base,
        name="qwen2_5_0_5b_gsm8k_tpu",
        # base.model already holds the architecture, filled in from the GPU recipe's
        # configs/models/Qwen2.5-0.5B-Instruct/config.json: this config compiles without
        # reading gs://; a run checks it against the checkpoint's config.json.
        model=replace(base.model, hf_checkpoint="gs://rlax-tpu-models/Qwen2.5-0.5B-Instruct"),
        # Trainer and worker on separate slices: generation of batch b+1 overlaps training
        # on batch b.
        staleness=StalenessConfig.PRESETS["one_step_off_policy"](),
        trainer=replace(
            base.trainer,
            gpu="",
            # fsdp over the 4 chips: 14 heads and 2 kv heads leave no room for tensor 4.
            mesh=MeshConfig(data=1, fsdp=-1, tensor=1, topology="v5e:2x2"),
            # N = 1: ρ against the log-probs of the version that generated the rollout.
            behaviour_logprobs="cached",
        ),
        inference=replace(
            base.inference,
            gpu="",
            # 2 kv heads: tensor 2 (7 query heads, 1 kv head a chip) × data 2 (the slots).
            mesh=MeshConfig(data=2, fsdp=1, tensor=2, topology="v5e:2x2"),
        ),
        # K = N + η + 1 = 3 bf16 versions of 1 GB: one small replica.
        param_server=ParamServerConfig(num_replicas=1),
        data=replace(base.data, path="gs://rlax-tpu-data/gsm8k/train.jsonl"),
        controller=replace(base.controller, eval_dataset="gs://rlax-tpu-data/gsm8k/test.jsonl"),
        storage=StorageConfig(run_dir="gs://rlax-tpu-runs/qwen2_5_0_5b_gsm8k"),
        deploy=DeployConfig(
            image="us-docker.pkg.dev/rlax-tpu/images/rlax-tpu:0.1.0",
            service_account="rlax-tpu",
            trainer_tpu=V5E_2X2,
            inference_tpu=V5E_2X2,
            # The node pools of docs/deploy.md ("Launch"): CPU pods, and GKE Sandbox for the
            # verifier pool.
            cpu_node_pool="cpu-highmem",
            verifier_node_pool="verifier-sandbox",
            verifier_replicas=1,
            # 3 versions × 0.92 GiB, with room for versions waiting for their persistent copy
            # and gRPC buffers.
            param_server_memory="16Gi",
        ),
    )
