"""The trainer (DESIGN §5): a sharded, jitted RL / SFT step with log-prob recompute,
versions published to the parameter server, and orbax checkpoints.

    trainer = Trainer(config, param_server=client)
    step = trainer.initialize()             # restore or build version 0; publish it
    result = trainer.train_step(step, batch)  # trains batch `step`, publishes step + 1

`step` holds the pure jitted functions (batch levels, optimizer, recompute, updates),
`checkpoints` the orbax store. docs/trainer.md explains batch levels and recompute."""

from rlax_tpu.checkpoints import CheckpointStore, NoValidCheckpointError
from rlax_tpu.trainer.step import BatchLevels, BatchSizeError
from rlax_tpu.trainer.trainer import (
    BatchMismatchError,
    NotInitializedError,
    OutOfOrderStepError,
    StaleRolloutError,
    Trainer,
    WarmStartPendingError,
)

__all__ = [
    "BatchLevels",
    "BatchMismatchError",
    "BatchSizeError",
    "CheckpointStore",
    "NoValidCheckpointError",
    "NotInitializedError",
    "OutOfOrderStepError",
    "StaleRolloutError",
    "Trainer",
    "WarmStartPendingError",
]
