"""The tiny CPU demo with the off-policy staleness preset (see StalenessConfig.PRESETS)."""

import dataclasses
from pathlib import Path

from rlax_tpu.config import RunConfig, StalenessConfig, load_config


def get_config() -> RunConfig:
    base = load_config(str(Path(__file__).with_name("tiny_cpu.py")))
    return dataclasses.replace(
        base,
        name="tiny_cpu_off_policy",
        staleness=StalenessConfig.PRESETS["off_policy"](),
        storage=dataclasses.replace(base.storage, run_dir="runs/tiny_cpu_off_policy"),
    )
