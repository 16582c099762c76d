"""The run directory: where a run keeps its config dump, checkpoints, snapshots and logs.

A run directory belongs to one config: `prepare_run_dir` writes config.json,
config.txt and config.sha256 on first use and refuses a directory that holds a
different config, so two runs never write into each other's state.
"""

from __future__ import annotations

from rlax_tpu import storage
from rlax_tpu.config import ConfigError, RunConfig


def prepare_run_dir(config: RunConfig) -> str:
    """Create `config.storage.run_dir` and dump the config there; returns the run dir URL."""
    run_dir = config.storage.run_dir
    digest_url = storage.join(run_dir, "config.sha256")
    digest = config.digest()
    if storage.exists(digest_url):
        existing = storage.read_text(digest_url).strip()
        if existing != digest:
            raise ConfigError(
                f"run directory {run_dir} holds a run with config digest {existing[:12]}…, "
                f"but this config's digest is {digest[:12]}…; pick a new directory with "
                "--set storage.run_dir=… or resume that run with `rlax-tpu resume`",
                field="storage.run_dir",
            )
        return run_dir
    storage.makedirs(run_dir)
    import json

    storage.write_text(storage.join(run_dir, "config.json"), json.dumps(config.to_dict(), indent=2))
    storage.write_text(storage.join(run_dir, "config.txt"), config.to_text())
    # Written last: its presence means the dump is complete.
    storage.write_text(digest_url, digest + "\n")
    return run_dir
