"""Optional Weights & Biases logging of the controller's metrics (`logging.wandb_project`).

`MetricsWriter` hands every metrics row to a `WandbSink` as well as to metrics.jsonl and
TensorBoard. The W&B run's id is kept in the run directory (wandb.json), so a resumed run
logs into the same W&B run; the steps a resumed run trains again from its checkpoint, whose
rows W&B already has, are not sent twice. The package is optional: a config that enables it
without the package installed is refused before anything starts.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Mapping
from typing import Any

from rlax_tpu import storage
from rlax_tpu.config import LoggingConfig, RunConfig
from rlax_tpu.controller.errors import ControllerError
from rlax_tpu.launch.metrics import read_metrics

_log = logging.getLogger(__name__)

WANDB_FILE = "wandb.json"  # {"id": ...}: the W&B run of this run directory


class WandbUnavailableError(ControllerError):
    """W&B logging is configured but the wandb package cannot be imported."""


def require_wandb(config: LoggingConfig) -> Any:
    """The wandb module when `config` enables W&B (None when it does not); raises
    WandbUnavailableError naming the fix when the package is missing."""
    if not config.wandb_enabled:
        return None
    try:
        import wandb
    except ImportError as e:
        raise WandbUnavailableError(
            f"logging.wandb_project is {config.wandb_project!r}, but the wandb package cannot "
            f"be imported ({e}): pip install wandb, or unset logging.wandb_project "
            "(--set logging.wandb_project=)"
        ) from None
    return wandb


class WandbSink:
    """Logs metrics rows to one W&B run: `log(step, values)`, then `close()`."""

    def __init__(self, run: Any, *, logged_through: int = -1) -> None:
        self.run = run
        self.logged_through = logged_through  # rows up to this step reached W&B before
        self._failed = False

    @classmethod
    def open(cls, config: RunConfig) -> WandbSink | None:
        """The sink of `config`'s run (None unless `logging.wandb_project` is set): a new W&B
        run whose id is stored in the run directory, or the stored one, resumed."""
        wandb = require_wandb(config.logging)
        if wandb is None:
            return None
        run_dir = config.storage.run_dir
        url = storage.join(run_dir, WANDB_FILE)
        stored = json.loads(storage.read_text(url)) if storage.exists(url) else {}
        run_id = stored.get("id") or secrets.token_hex(4)
        if not stored:  # before init: a run that dies in init resumes the same id
            storage.write_text(url, json.dumps({"id": run_id}))
        settings = config.logging
        local = run_dir.removeprefix("file://") if not storage.is_remote(run_dir) else None
        run = wandb.init(
            project=settings.wandb_project,
            entity=settings.wandb_entity or None,
            name=settings.wandb_run_name or config.name,
            id=run_id,
            resume="allow",
            mode=settings.wandb_mode or None,
            config=config.to_dict(),
            dir=local,
        )
        logged = [row["step"] for row in read_metrics(run_dir)]
        print(
            f"W&B: logging to {settings.wandb_project} as run {run_id}"
            + (" (resumed)" if stored else ""),
            flush=True,
        )
        return cls(run, logged_through=max(logged, default=-1))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        if step <= self.logged_through:  # a resumed run's retrained step: W&B has its row
            return
        try:
            self.run.log(dict(values), step=step)
        except Exception as e:  # noqa: BLE001 - W&B trouble must not stop training
            if not self._failed:
                _log.warning("W&B logging failed (metrics.jsonl still has every row): %s", e)
            self._failed = True

    def close(self) -> None:
        try:
            self.run.finish()
        except Exception as e:  # noqa: BLE001
            _log.warning("W&B: finishing the run failed: %s", e)
