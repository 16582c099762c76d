"""The tiny CPU demo off-policy: workers may reload every version (η=1) and the trainer
accepts rollouts up to 4 versions old (N=4), so generation runs up to 4 batches ahead
of training — the off-policy setting of tools/bench_e2e.py. (RLAX's pod-scale
setting, η=16 and N=32, is `--set staleness=off_policy`.)"""

import dataclasses
from pathlib import Path

from rlax_tpu.config import RunConfig, StalenessConfig, load_config


def get_config() -> RunConfig:
    base = load_config(str(Path(__file__).with_name("tiny_cpu.py")))
    return dataclasses.replace(
        base,
        name="tiny_cpu_off_policy",
        staleness=StalenessConfig(reload_every=1, max_staleness=4),
        storage=dataclasses.replace(base.storage, run_dir="runs/tiny_cpu_off_policy"),
    )
