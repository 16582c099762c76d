"""The controller: the one active process of a run. It draws prompts from the dataset mixture,
drives the inference workers, verifiers and trainer, writes metrics and snapshots, and recovers
a preempted run from its newest snapshot. `rlax-tpu run` and `resume` are `job.main` and
`job.resume`. Nothing in it imports JAX."""

from rlax_tpu._lazy import lazy_exports

# Public name -> the submodule defining it; imported on first use (rlax_tpu._lazy).
_EXPORTS = {
    "Components": "controller",
    "Controller": "controller",
    "ControllerError": "errors",
    "UnjudgedError": "errors",
    "DatasetError": "datasets",
    "PromptMixture": "datasets",
    "PromptRecord": "datasets",
    "load_dataset": "datasets",
    "RolloutLog": "snapshots",
    "Snapshot": "snapshots",
    "SnapshotError": "snapshots",
    "SnapshotStore": "snapshots",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
