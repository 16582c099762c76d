"""The tiny job that process-level tests run end to end (`rlax-tpu run`, `--connect`,
`rlax-tpu prefilter`): a one-layer character-tokenizer model on 2 CPU devices, GRPO without
KL, one prefill bucket; each test sets its own controller (data, steps, batch), seed and
the few trainer or inference fields it cares about."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rlax_tpu.config import (
    AlgorithmConfig,
    ControllerConfig,
    InferenceConfig,
    KLConfig,
    MeshConfig,
    ModelConfig,
    RunConfig,
    StalenessConfig,
    StorageConfig,
    TrainerConfig,
)

MODEL = ModelConfig(
    vocab_size=112,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    max_position_embeddings=128,
    tokenizer="builtin:char",
)
TRAINER = TrainerConfig(
    mesh=MeshConfig(data=2, fsdp=1, tensor=1),
    algorithm=AlgorithmConfig(name="grpo", kl=KLConfig(beta=0.0)),
    mini_batch_size=8,
    micro_batch_size=8,
    max_seq_len=64,
)
INFERENCE = InferenceConfig(
    mesh=MeshConfig(data=1, fsdp=1, tensor=-1),
    max_decode_slots=8,
    prefill_buckets=(64,),
    max_prompt_len=60,
    max_new_tokens=3,
    kv_cache_bytes=2 * 2**20,
)


def tiny_job_config(
    name: str,
    run_dir: Path,
    *,
    seed: int,
    controller: ControllerConfig,
    staleness: StalenessConfig | None = None,
    trainer: dict[str, Any] | None = None,
    inference: dict[str, Any] | None = None,
) -> RunConfig:
    """The tiny job's config; `trainer` and `inference` override fields of those sections."""
    return RunConfig(
        name=name,
        seed=seed,
        cpu_devices=2,
        model=MODEL,
        staleness=staleness or StalenessConfig(),
        trainer=dataclasses.replace(TRAINER, **(trainer or {})),
        inference=dataclasses.replace(INFERENCE, **(inference or {})),
        controller=controller,
        storage=StorageConfig(run_dir=str(run_dir)),
    )


def write_config(config: RunConfig, where: Path) -> Path:
    """`config` as a JSON file `rlax-tpu run` takes."""
    where.write_text(json.dumps(config.to_dict()))
    return where
