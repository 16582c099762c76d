"""Checkpoints of arrays: orbax `CheckpointManager` with async saves and keep-N, on a local
directory, file:// or gs://, restorable onto any mesh. The trainer's state (params,
optimizer state, reference params) is kept here, and the frozen base of a LoRA run
(rlax_tpu.models.lora_base), which the inference workers read.

A checkpoint holds the state and a small JSON item (step, the recorded step results, exact
checksums of every array). Restoring walks from the newest step down: one that is
incomplete (orbax only lists finalized saves), unreadable, or whose arrays do not match
their checksums is skipped with the reason logged, and the previous one is used.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from rlax_tpu import storage
from rlax_tpu.failpoints import failpoint

_log = logging.getLogger(__name__)

# Written by orbax into a step directory once every item of the save is finalized.
COMMIT_MARKER = "commit_success.txt"
# The meta item's key for the arrays' checksums (see `checksums`).
CHECKSUMS_KEY = "checksums"


class NoValidCheckpointError(RuntimeError):
    """No checkpoint under the directory could be restored; lists why each was skipped."""


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    meta: dict[str, Any]


def _orbax_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def _words(x: jax.Array) -> jax.Array:
    """The bits of x as uint32 words, one per element (two per element of 8 bytes: a
    trailing axis of 2). bf16/f16 bits are widened from uint16, 1-byte types from uint8."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4 or size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    narrow = {2: jnp.uint16, 1: jnp.uint8}[size]
    return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """uint32[shape]: each element's row-major flat index (mod 2³²), from iotas, so it is
    computed where each shard lives."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        index = index + iota * np.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


@jax.jit
def _checksum_arrays(leaves: list[jax.Array]) -> jax.Array:
    """uint32[n, 2]: (Σ w, Σ w·(i + 1)) of each leaf's words w at flat index i.

    uint32 addition wraps, so both sums are exact and associative: any mesh, sharding or
    reduction order gives the same bits. Σ w changes with any single changed word; the
    index-weighted sum also catches words moved to other positions.
    """
    rows = []
    for x in leaves:
        w = _words(x)
        rows.append(jnp.stack([jnp.sum(w), jnp.sum(w * (_flat_index(w.shape) + np.uint32(1)))]))
    return jnp.stack(rows)


def checksums(state: Any) -> list[list[int]]:
    """Exact per-array checksums of `state` (two uint32 per array, computed on device):
    equal for bitwise-equal arrays whatever their sharding."""
    leaves = jax.tree.leaves(state)
    if not leaves:
        return []
    return np.asarray(_checksum_arrays(leaves)).astype(int).tolist()


def _checksum_mismatch(expected: Any, state: Any) -> str | None:
    if not isinstance(expected, list):
        return (
            f"the checkpoint records no {CHECKSUMS_KEY!r} (written by an older rlax_tpu "
            "whose fingerprint was not exact), so its data cannot be verified"
        )
    got = checksums(state)
    if len(got) != len(expected):
        return f"{len(got)} arrays restored, the checkpoint recorded {len(expected)} checksums"
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    for path, g, e in zip(paths, got, expected, strict=True):
        if list(g) != list(e):
            return f"array {path} does not match its checksums ({g} restored, {e} recorded)"
    return None


class CheckpointStore:
    """Saves and restores the trainer state under `directory` (local, file:// or gs://).

    `steps()` is orbax's in-memory list, which also holds a save still in flight: reading
    storage then would drop that step from orbax's list and make keep-N prune one
    checkpoint too few. Storage is re-read only by `steps(reload=True)` and `restore`,
    after waiting for pending saves.
    """

    def __init__(self, directory: str, *, max_to_keep: int, async_saves: bool = True) -> None:
        self.directory = directory
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_saves,
            create=True,
        )
        # Plain zarr (one directory per array) rather than ocdbt: ocdbt's conditional
        # manifest writes need object generations that GCS emulators do not provide.
        self._manager = ocp.CheckpointManager(
            _orbax_path(directory),
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(use_ocdbt=False),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )
        # Steps newer than the one `restore` loaded (skipped as not loadable, or passed
        # over for an explicit step): the run goes on from the restored step, so they are
        # not offered by `steps()` and are replaced when that step is saved again.
        self._superseded: set[int] = set()

    def steps(self, *, reload: bool = False) -> list[int]:
        """Checkpoint steps, oldest first: finalized or being saved by this store (no I/O).

        reload: wait for pending saves and re-read the list from storage (steps written
        by another process, e.g. before a restart).
        """
        if reload:
            self.wait()
            self._manager.reload()
        return sorted(s for s in self._manager.all_steps() if s not in self._superseded)

    def saving(self) -> bool:
        """Whether an async save is still being written."""
        return self._manager.is_saving_in_progress()

    def save(self, step: int, state: Any, meta: Mapping[str, Any], *, wait: bool = False) -> None:
        """Start saving `state` as `step` (returns once arrays are copied off the device
        unless `wait`). The arrays' checksums are added to `meta`."""
        meta = {**meta, CHECKSUMS_KEY: checksums(state)}
        if step in self._superseded:
            self.wait()
            if step in self._manager.all_steps():
                _log.warning("replacing checkpoint %d under %s", step, self.directory)
                self._manager.delete(step)
            self._superseded.discard(step)
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))
            ),
            force=True,
        )
        failpoint("trainer.checkpoint", step)  # the save started, not finished (chaos test)
        if wait:
            self.wait()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None) -> Restored:
        """The newest valid checkpoint (or exactly `step`), placed as `abstract_state`'s
        leaves (jax.ShapeDtypeStruct with shardings) say: any mesh shape works."""
        self._superseded.clear()
        candidates = every = self.steps(reload=True)
        if step is not None:
            if step not in candidates:
                raise NoValidCheckpointError(
                    f"no finalized checkpoint of step {step} under {self.directory}; "
                    f"found steps {candidates}"
                )
            candidates = [step]
        reasons = []
        for candidate in reversed(candidates):
            marker = storage.join(self.directory, str(candidate), COMMIT_MARKER)
            if not storage.exists(marker):
                problem = f"incomplete: {COMMIT_MARKER} is missing (the save did not finish)"
            else:
                try:
                    restored = self._manager.restore(
                        candidate,
                        args=ocp.args.Composite(
                            state=ocp.args.StandardRestore(abstract_state),
                            meta=ocp.args.JsonRestore(),
                        ),
                    )
                    state, meta = restored["state"], dict(restored["meta"])
                    problem = _checksum_mismatch(meta.get(CHECKSUMS_KEY), state)
                except Exception as e:  # noqa: BLE001 - any failure means: not loadable
                    problem = f"{type(e).__name__}: {str(e)[:500]}"
                if problem is None:
                    self._superseded.update(c for c in every if c > candidate)
                    return Restored(step=candidate, state=state, meta=meta)
            _log.warning(
                "checkpoint %d under %s is not loadable, trying the previous one: %s",
                candidate,
                self.directory,
                problem,
            )
            reasons.append(f"step {candidate}: {problem}")
        raise NoValidCheckpointError(
            f"no loadable checkpoint under {self.directory}"
            + (": " + "; ".join(reasons) if reasons else " (none finalized)")
        )

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
