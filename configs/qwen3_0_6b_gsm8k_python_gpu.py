"""Qwen3-0.6B on GSM8K with a Python interpreter: multi-turn RL with tools on one GPU of
80 GB (docs/agents.md, "The GSM8K-with-Python recipe").

Each prompt is an episode: Qwen3 reasons, may call the `python` tool (Hermes-style
<tool_call> JSON, as its chat template writes it), reads what the program printed, and gives
its answer in \\boxed{}; the math verifier judges the final turn. The programs run in the
verifiers' sandbox (bubblewrap, never root, CPU/memory/output limits), through the verifier
service, so tool calls scale with `verifiers.num_workers` and survive a lost verifier.

  python tools/fetch_real_data.py   # not needed for a real run: the checkpoint has its tokenizer
  rlax-tpu compile configs/qwen3_0_6b_gsm8k_python_gpu.py
  rlax-tpu run configs/qwen3_0_6b_gsm8k_python_gpu.py \\
      --set model.hf_checkpoint=/data/Qwen3-0.6B --set data.path=gsm8k/train.jsonl \\
      --set controller.eval_dataset=gsm8k/test.jsonl
  rlax-tpu run configs/qwen3_0_6b_gsm8k_python_gpu.py --trial ...   # the same, on a CPU

Thinking stays on (enable_thinking unset): Qwen3's template is prefix-preserving only then,
so the episode's tokens equal the template's rendering of the conversation (the run checks
it at start, controller.environment.require_prefix_preserving). No SFT warm start: Qwen3
already writes tool calls in its format.
"""

import dataclasses
import os
from pathlib import Path

from rlax_tpu.config import (
    DatasetConfig,
    EnvironmentConfig,
    ModelConfig,
    RunConfig,
    StalenessConfig,
    StorageConfig,
    VerifierConfig,
    load_config,
)

# config.json of Qwen/Qwen3-0.6B, kept in the repo so that the recipe compiles and simulates
# before the weights are downloaded; a run names the real checkpoint directory
# (--set model.hf_checkpoint=DIR), whose config.json then gives the architecture.
ARCHITECTURE_ONLY = os.path.relpath(Path(__file__).parent / "models" / "Qwen3-0.6B")

SYSTEM_PROMPT = (
    "Solve the math problem. You can run Python programs with the python tool (print the "
    "values you need). Put your final answer within \\boxed{}."
)


def get_config() -> RunConfig:
    base = load_config(str(Path(__file__).with_name("qwen3_0_6b_gpu.py")), resolve=False)
    controller = dataclasses.replace(
        base.controller,
        # GSM8K's 7,473 training problems: 32 a step, one epoch in 233 steps.
        num_steps=233,
        datasets=(),
        # Episodes of at most 4 policy turns within the response's 3072 tokens (the
        # observations included): a program, its output, maybe another, the answer.
        environment=EnvironmentConfig(name="tools", tools=("python",), max_turns=4),
        # GSM8K's own test split (1,319 problems), greedy episodes with the same tool.
        eval_dataset="gsm8k/test.jsonl",
        eval_size=1319,
    )
    return dataclasses.replace(
        base,
        name="qwen3_0_6b_gsm8k_python_gpu",
        # float32 master weights; bf16 matmuls; bf16 weights published and served.
        model=ModelConfig(
            param_dtype="float32",
            dtype="bfloat16",
            publish_dtype="bfloat16",
            hf_checkpoint=ARCHITECTURE_ONLY,
            # Qwen3's context (its config.json says it too): the episode's 4096 tokens fit.
            max_position_embeddings=40960,
        ),
        # On-policy: an episode's turns are generated with its batch's version (episodes
        # need inference.in_flight_update "off", the default).
        staleness=StalenessConfig.PRESETS["on_policy"](),
        controller=controller,
        data=DatasetConfig(
            path="gsm8k/train.jsonl",
            verifier="math",
            prompt_field="question",
            answer_field="answer",
            system_prompt=SYSTEM_PROMPT,
        ),
        # The programs the policy writes run here, besides the final answers' checks.
        verifiers=VerifierConfig(num_workers=8),
        storage=StorageConfig(run_dir="runs/qwen3_0_6b_gsm8k_python_gpu"),
    )
