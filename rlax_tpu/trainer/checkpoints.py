"""Trainer checkpoints: orbax `CheckpointManager` with async saves and keep-N, on a local
directory, file:// or gs://, restorable onto any mesh.

A checkpoint holds the train state (params, optimizer state, reference params) and a
small JSON item (step, the recorded step results, a fingerprint of every array).
Restoring walks from the newest step down: one that is incomplete (orbax only lists
finalized saves), unreadable, or whose arrays do not match their fingerprint is
skipped with the reason logged, and the previous one is used.
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

_log = logging.getLogger(__name__)

# Relative tolerance of a fingerprint check: the restored arrays' sums are taken on
# another mesh (another reduction order), while corruption changes them wholesale.
FINGERPRINT_RTOL = 1e-3
# Written by orbax into a step directory once every item of the save is finalized.
COMMIT_MARKER = "commit_success.txt"


class NoValidCheckpointError(RuntimeError):
    """No checkpoint under the directory could be restored; lists why each was skipped."""


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    meta: dict[str, Any]


def _orbax_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


@jax.jit
def _fingerprint_arrays(leaves: list[jax.Array]) -> jax.Array:
    """float32[n, 2]: (Σx, Σ|x|) of each leaf."""
    return jnp.stack(
        [
            jnp.stack([jnp.sum(x.astype(jnp.float32)), jnp.sum(jnp.abs(x.astype(jnp.float32)))])
            for x in leaves
        ]
    )


def fingerprint(state: Any) -> list[list[float]]:
    """A cheap per-array checksum of `state` (computed on device; two floats per array)."""
    leaves = jax.tree.leaves(state)
    if not leaves:
        return []
    return np.asarray(_fingerprint_arrays(leaves)).astype(float).tolist()


def _fingerprint_mismatch(expected: list[list[float]], state: Any) -> str | None:
    got = fingerprint(state)
    if len(got) != len(expected):
        return f"{len(got)} arrays restored, the checkpoint recorded {len(expected)}"
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    for path, g, e in zip(paths, got, expected, strict=True):
        scale = max(abs(e[1]), 1e-6)
        if (
            not np.all(np.isfinite(g))
            or abs(g[0] - e[0]) > FINGERPRINT_RTOL * scale
            or (abs(g[1] - e[1]) > FINGERPRINT_RTOL * scale)
        ):
            return f"array {path} does not match its fingerprint (sums {g} vs recorded {e})"
    return None


class CheckpointStore:
    """Saves and restores the trainer state under `directory` (local, file:// or gs://)."""

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

    def steps(self) -> list[int]:
        """Finalized checkpoint steps, oldest first (re-read from storage)."""
        return sorted(self._manager.all_steps(read=True))

    def save(self, step: int, state: Any, meta: Mapping[str, Any], *, wait: bool = False) -> None:
        """Start saving `state` as `step` (returns once arrays are copied off the device
        unless `wait`). The fingerprint is added to `meta`."""
        meta = {**meta, "fingerprint": fingerprint(state)}
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))
            ),
            force=True,
        )
        if wait:
            self.wait()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None) -> Restored:
        """The newest valid checkpoint (or exactly `step`), placed as `abstract_state`'s
        leaves (jax.ShapeDtypeStruct with shardings) say: any mesh shape works."""
        self.wait()
        candidates = self.steps()
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
                _log.warning(
                    "checkpoint %d under %s skipped: %s", candidate, self.directory, problem
                )
                reasons.append(f"step {candidate}: {problem}")
                continue
            try:
                restored = self._manager.restore(
                    candidate,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state),
                        meta=ocp.args.JsonRestore(),
                    ),
                )
                state, meta = restored["state"], dict(restored["meta"])
                problem = _fingerprint_mismatch(meta.get("fingerprint", []), state)
            except Exception as e:  # noqa: BLE001 - any failure means: not loadable
                problem = f"{type(e).__name__}: {str(e)[:500]}"
            if problem is None:
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
