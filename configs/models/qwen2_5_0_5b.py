"""Qwen2.5-0.5B-Instruct: the architecture comes from the checkpoint's config.json
(model.hf_checkpoint); float32 master weights, bf16 matmuls, bf16 weights published and
served. Recipes compose it (`rlax_tpu.config.load_fragment`)."""

import os
from pathlib import Path

from rlax_tpu.config import ModelConfig

# config.json of Qwen/Qwen2.5-0.5B-Instruct, kept in the repo so that a recipe can be
# compiled and simulated before the weights are downloaded; a run needs the real checkpoint
# directory (--set model.hf_checkpoint=DIR): its config.json then names the architecture.
ARCHITECTURE_ONLY = os.path.relpath(Path(__file__).parent / "Qwen2.5-0.5B-Instruct")


def get_config() -> ModelConfig:
    return ModelConfig(
        param_dtype="float32",
        dtype="bfloat16",
        publish_dtype="bfloat16",
        hf_checkpoint=ARCHITECTURE_ONLY,  # --set model.hf_checkpoint=DIR
    )
