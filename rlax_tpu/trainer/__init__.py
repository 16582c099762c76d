"""The trainer (DESIGN §5): a sharded, jitted RL / SFT step with log-prob recompute,
versions published to the parameter server, and orbax checkpoints.

    trainer = Trainer(config, param_server=client)
    step = trainer.initialize()             # restore or build version 0; publish it
    result = trainer.train_step(step, batch)  # trains batch `step`, publishes step + 1

`step` holds the pure jitted functions (batch levels, optimizer, recompute, updates),
`checkpoints` the orbax store. docs/trainer.md explains batch levels and recompute."""

from rlax_tpu._lazy import lazy_exports

# Public name -> the submodule defining it; imported on first use (rlax_tpu._lazy).
_EXPORTS = {
    "CheckpointStore": "checkpoints",
    "NoValidCheckpointError": "checkpoints",
    "BatchLevels": "step",
    "BatchSizeError": "step",
    "NotInitializedError": "trainer",
    "BatchMismatchError": "trainer",
    "OutOfOrderStepError": "trainer",
    "StaleRolloutError": "trainer",
    "WarmStartPendingError": "trainer",
    "StepResult": "wire",
    "Trainer": "trainer",
    "RolloutArrays": "wire",
    "TrainerCallError": "client",
    "TrainerClient": "client",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
