"""Persistent storage for everything a run keeps (checkpoints, snapshots, rollout log, weights).

One small API over local paths, file:// and gs:// URLs; writes are atomic on every backend.
Set STORAGE_EMULATOR_HOST to send gs:// traffic to a GCS emulator.
"""

from rlax_tpu.storage.api import (
    StorageUnreachableError,
    copy,
    copy_tree,
    exists,
    is_remote,
    join,
    listdir,
    makedirs,
    read_bytes,
    read_range,
    read_text,
    remove,
    size,
    write_bytes,
    write_text,
)

__all__ = [
    "StorageUnreachableError",
    "copy",
    "copy_tree",
    "exists",
    "is_remote",
    "join",
    "listdir",
    "makedirs",
    "read_bytes",
    "read_range",
    "read_text",
    "remove",
    "size",
    "write_bytes",
    "write_text",
]
