"""The frozen base of a LoRA run, written once by the trainer and read once by each
inference worker, so that a published version holds only the adapters.

A version of a LoRA run is (base digest, adapter tensors): the trainer publishes the
adapters plus a leaf `DIGEST_KEY` (uint8[32], the base's digest) and, before its first
publish, the base itself to `<run_dir>/lora_base` (an orbax checkpoint with exact
checksums, rlax_tpu.checkpoints: a half-written base is never read). A worker whose held
base has another digest than the version it loads reads the base from there first, then
serves base + adapters (the adapters unmerged in the matmul: rlax_tpu.models.lora).

The digest is a SHA-256 over every base array's path, shape, dtype and exact checksums
(computed on device, the same on any mesh), so equal bases have equal digests wherever
they are held.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import jax
import numpy as np

from rlax_tpu import storage
from rlax_tpu.checkpoints import CheckpointStore, checksums
from rlax_tpu.tree import flatten

_log = logging.getLogger(__name__)

# The run directory's folder of the base (`LoraBaseStore`).
BASE_DIR = "lora_base"
# The top-level leaf of a published LoRA version naming its base: uint8[32].
DIGEST_KEY = "lora_base_digest"


class BaseMismatchError(RuntimeError):
    """The base store does not hold the base a version names."""


def base_digest(base: Any) -> bytes:
    """SHA-256 of a params tree: every array's path, shape, dtype and exact checksums."""
    paths = list(flatten(base))
    leaves = jax.tree.leaves(base)
    sums = checksums(base)
    entries = [
        [path, list(np.shape(x)), str(x.dtype), s]
        for path, x, s in zip(paths, leaves, sums, strict=True)
    ]
    return hashlib.sha256(json.dumps(entries).encode()).digest()


def digest_leaf(digest: bytes) -> np.ndarray:
    return np.frombuffer(digest, np.uint8).copy()


def digest_of_leaf(leaf: Any) -> bytes:
    return bytes(np.asarray(leaf, np.uint8).tolist())


class LoraBaseStore:
    """The base of a LoRA run under `<run_dir>/lora_base`: `write` (the trainer, every process
    of a multi-host job), `read` (a worker, into the shardings it serves with)."""

    def __init__(self, run_dir: str) -> None:
        self.directory = storage.join(run_dir, BASE_DIR)
        self._store = CheckpointStore(self.directory, max_to_keep=2, async_saves=False)

    def _newest(self) -> tuple[int, str] | None:
        """(step, hex digest) of the newest base written, or None."""
        steps = self._store.steps(reload=True)
        if not steps:
            return None
        meta = json.loads(
            storage.read_text(storage.join(self.directory, str(steps[-1]), "meta", "metadata"))
        )
        return steps[-1], meta.get("digest", "")

    def write(self, base: Any, digest: bytes) -> bool:
        """Save `base` (a params tree without adapters, in the served dtype) unless the newest
        base here already has `digest`; returns whether it wrote."""
        newest = self._newest()
        if newest is not None and newest[1] == digest.hex():
            return False
        step = 0 if newest is None else newest[0] + 1
        self._store.save(step, base, {"digest": digest.hex()}, wait=True)
        _log.info("wrote the LoRA base %s… to %s", digest.hex()[:16], self.directory)
        return True

    def read(self, digest: bytes, like: Any) -> Any:
        """The base with `digest`, placed as `like` (jax.ShapeDtypeStruct leaves with
        shardings) says; BaseMismatchError when the newest base here is another."""
        newest = self._newest()
        if newest is None or newest[1] != digest.hex():
            held = "none" if newest is None else f"base {newest[1][:16]}…"
            raise BaseMismatchError(
                f"the version names LoRA base {digest.hex()[:16]}… but {self.directory} holds "
                f"{held}: the trainer writes its base there before its first publish; check "
                "that this worker and the trainer share storage.run_dir"
            )
        restored = self._store.restore(like, newest[0])
        return restored.state

    def close(self) -> None:
        self._store.close()
