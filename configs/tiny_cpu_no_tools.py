"""configs/tiny_cpu_tools.py without the calculator: the same model, task, warm-start length
and RL, single-turn, the SFT warm start on the bare answers. The baseline of the tool-use
demo's comparison (tools/learning_curves.py configs/tiny_cpu_tools.py --compare ...).

Run: rlax-tpu run configs/tiny_cpu_no_tools.py
"""

import dataclasses
from pathlib import Path

from rlax_tpu.config import EnvironmentConfig, RunConfig, load_config


def get_config() -> RunConfig:
    tools = load_config(str(Path(__file__).with_name("tiny_cpu_tools.py")))
    controller = dataclasses.replace(
        tools.controller,
        datasets=tuple(dataclasses.replace(d, sft_field="") for d in tools.controller.datasets),
        environment=EnvironmentConfig(),
    )
    return dataclasses.replace(
        tools,
        name="tiny_cpu_no_tools",
        controller=controller,
        storage=dataclasses.replace(tools.storage, run_dir="runs/tiny_cpu_no_tools"),
    )
