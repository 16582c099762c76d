"""The tool-use demo: multi-turn RL with a calculator on the CPU, everything on this machine.

Three-digit by two-digit products ("What is 417 * 38?", tasks.multiplication_problems), which
the tiny model cannot work out in its head. The SFT warm start shows a calculator call in one
row of eight (the demonstration: the call, the tool's result, the answer) and the bare answer
in the rest; RL (GRPO, on-policy) then raises held-out accuracy by calling the calculator
more and copying the numbers right. The model, trainer mesh and objective are the Quickstart
demo's (configs/tiny_cpu.py); the lengths, the task and the episodes are this demo's. Each
episode: the policy writes
<tool_call>{"name": "calculator", "arguments": {"expression": "417 * 38"}}</tool_call>, the
controller runs it and appends "\\n=15846\\n" as given tokens (loss mask 0), and the policy
answers on the same KV pages (docs/agents.md). configs/tiny_cpu_no_tools.py is the same run
without the tool, for tools/learning_curves.py's comparison.

Run: rlax-tpu run configs/tiny_cpu_tools.py
"""

import dataclasses
from pathlib import Path

from rlax_tpu.config import (
    ControllerConfig,
    DatasetConfig,
    EnvironmentConfig,
    OptimizerConfig,
    RunConfig,
    StorageConfig,
    WarmStartConfig,
    load_config,
)


def get_config() -> RunConfig:
    demo = load_config(str(Path(__file__).with_name("tiny_cpu.py")))
    return dataclasses.replace(
        demo,
        name="tiny_cpu_tools",
        # the tool tokenizer's 106 ids fit the demo's vocabulary of 128
        model=dataclasses.replace(demo.model, tokenizer="builtin:char_tools"),
        trainer=dataclasses.replace(
            demo.trainer,
            # prompt (36) + call turn (66) + result (8) + answer (6): 116 tokens at most
            max_seq_len=128,
            optimizer=OptimizerConfig(learning_rate=1e-4),
            warm_start=WarmStartConfig(steps=600, learning_rate=1e-3),
        ),
        inference=dataclasses.replace(
            demo.inference,
            max_prompt_len=40,
            max_new_tokens=88,
            # Episodes park their pages in host memory while the tool runs, up to the pool's
            # bytes: 128 MiB holds the 512 held-out episodes (3 layers x 2 KV heads x 32 x
            # 2 x 4 bytes = 1.5 KiB a token, 128 tokens each); an evicted one is replayed,
            # one decode call a token (docs/agents.md).
            kv_cache_bytes=128 * 2**20,
        ),
        controller=ControllerConfig(
            num_steps=80,
            prompts_per_batch=8,
            samples_per_prompt=8,
            datasets=(
                DatasetConfig(
                    path="builtin:multiplication",
                    verifier="arithmetic",
                    sft_field="demonstration",
                ),
            ),
            environment=EnvironmentConfig(name="tools", tools=("calculator",), max_turns=3),
            eval_dataset="builtin:multiplication",
            eval_size=512,
            eval_every=10,
        ),
        storage=StorageConfig(run_dir="runs/tiny_cpu_tools"),
    )
