"""The run directory: where a run keeps its config dump, checkpoints, snapshots and logs.

A run directory belongs to one run: `prepare_run_dir` writes config.json, config.txt and
config.sha256 (the digest of the config's identity, `RunConfig.digest`) on first use and
refuses a config of another identity once the run has made progress, so two runs never
write into each other's state. A config that differs only in resumable fields (more
num_steps, another evaluation cadence, ...) continues the run, and its dump is updated; a
directory with no progress yet (a start that failed) takes the corrected config.
"""

from __future__ import annotations

import json

from rlax_tpu import storage
from rlax_tpu.config import ConfigError, RunConfig

# The layout of a run directory, named once: every component and command reads these.
CONFIG_FILE = "config.json"
DIGEST_FILE = "config.sha256"
CHECKPOINTS = "checkpoints"  # the trainer's RL checkpoints, one directory per step
WARM_START_CHECKPOINTS = "checkpoints_warm_start"  # the SFT warm start's
SNAPSHOTS = "snapshots"  # the controller's
ROLLOUTS = "rollouts"  # the rollout log
PARAMS = "params"  # the parameter server's persistent versions
TOKENIZER = "tokenizer"  # where a built-in tokenizer (model.tokenizer=builtin:char) is written
EFFECTIVE_CONFIG = "effective_config.json"  # the config the components run (resolved, per role)
SUMMARY_FILE = "summary.json"  # the controller's summary, written when a run stops or ends
# What a run writes once it has made progress; anything else there is a config dump or logs.
PROGRESS_DIRS = (CHECKPOINTS, WARM_START_CHECKPOINTS, SNAPSHOTS, ROLLOUTS, PARAMS)


def has_progress(run_dir: str) -> bool:
    """Whether `run_dir` holds any state of a run: checkpoints, snapshots, rollouts, params."""
    for name in PROGRESS_DIRS:
        url = storage.join(run_dir, name)
        if storage.exists(url) and storage.listdir(url):
            return True
    return False


def finished_summary(config: RunConfig) -> dict | None:
    """The summary of the run in `config`'s run directory when that run, of `config`'s
    identity, already reached `controller.num_steps` (None otherwise): running it again has
    nothing to do. Its evaluations are keyed by step, as the controller returns them."""
    run_dir = config.storage.run_dir
    digest_url = storage.join(run_dir, DIGEST_FILE)
    summary_url = storage.join(run_dir, SUMMARY_FILE)
    if not (storage.exists(digest_url) and storage.exists(summary_url)):
        return None
    if storage.read_text(digest_url).strip() != config.digest():
        return None
    try:
        summary = json.loads(storage.read_text(summary_url))
    except json.JSONDecodeError:
        return None
    if summary.get("end_step", 0) < config.controller.num_steps:
        return None
    for key in ("evals", "eval_versions", "eval_elapsed_s"):
        summary[key] = {int(step): v for step, v in summary.get(key, {}).items()}
    return summary


def prepare_run_dir(config: RunConfig, *, report=print) -> str:
    """Create `config.storage.run_dir` and dump the config there; returns the run dir URL."""
    run_dir = config.storage.run_dir
    digest_url = storage.join(run_dir, DIGEST_FILE)
    digest = config.digest()
    if storage.exists(digest_url):
        existing = storage.read_text(digest_url).strip()
        if existing != digest and has_progress(run_dir):
            raise ConfigError(
                f"run directory {run_dir} holds a run with config digest {existing[:12]}…, "
                f"but this config's digest is {digest[:12]}…; pick a new directory with "
                "--set storage.run_dir=… or resume that run with `rlax-tpu resume` (a run may "
                f"change only {', '.join(config.resumable_fields())} when it continues)",
                field="storage.run_dir",
            )
        if existing != digest:
            report(f"run directory {run_dir} held no progress yet: its config is replaced")
        elif _dumped(run_dir) == config.to_dict():
            return run_dir
        else:
            report(f"run directory {run_dir}: resumable fields changed; its config.json updated")
    storage.makedirs(run_dir)
    storage.write_text(storage.join(run_dir, CONFIG_FILE), json.dumps(config.to_dict(), indent=2))
    storage.write_text(storage.join(run_dir, "config.txt"), config.to_text())
    # Written last: its presence means the dump is complete.
    storage.write_text(digest_url, digest + "\n")
    return run_dir


def _dumped(run_dir: str) -> dict | None:
    url = storage.join(run_dir, CONFIG_FILE)
    if not storage.exists(url):
        return None
    try:
        return json.loads(storage.read_text(url))
    except json.JSONDecodeError:
        return None
