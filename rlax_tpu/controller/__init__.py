"""The controller: the one active process of a run. It draws prompts from the dataset mixture,
drives the inference workers, verifiers and trainer, writes metrics and snapshots, and recovers
a preempted run from its newest snapshot. `rlax-tpu run` and `resume` are `job.main` and
`job.resume`. Nothing in it imports JAX."""

from rlax_tpu.controller.controller import Components, Controller
from rlax_tpu.controller.errors import ControllerError, UnjudgedError
from rlax_tpu.controller.snapshots import RolloutLog, Snapshot, SnapshotError, SnapshotStore

__all__ = [
    "Components",
    "Controller",
    "ControllerError",
    "RolloutLog",
    "Snapshot",
    "SnapshotError",
    "SnapshotStore",
    "UnjudgedError",
]
