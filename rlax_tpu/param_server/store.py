"""The parameter server's storage: immutable, versioned weight trees on TensorStore (DESIGN §3).

Each committed version is kept hot in memory (the newest K: the arrays the publish was
received into, read-only, served as views) and persisted with TensorStore as zarr3 arrays
with a MANIFEST.json written last (its presence is the commit on storage; persistent.py).
A publish is acknowledged once the hot copy is complete; the persistent copy is finished in
the background ("written continuously", DESIGN §3), and `VersionInfo.persisted` says when it
is on storage: a caller that needs a version to survive a restart waits for that
(`wait_persisted`; the controller does so before a snapshot may rely on it). A failed
persistent write is kept as `persist_error` and refuses later publishes until a restart.
The gRPC servicer (service.py) is a thin layer over `VersionStore`, which ties together the
index of versions (index.py), publishes (publish.py) and the persistent copy (persistent.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence

import numpy as np
import tensorstore as ts

from rlax_tpu import storage
from rlax_tpu.api import tensors
from rlax_tpu.api.param_server import (
    InvalidPublishError,
    InvalidReadError,
    PublishInProgressError,
    StorageFailedError,
)
from rlax_tpu.api.tensors import Box, Piece
from rlax_tpu.failpoints import failpoint
from rlax_tpu.param_server.index import VersionIndex
from rlax_tpu.param_server.persistent import PersistentCopy, array_keys, read_array
from rlax_tpu.param_server.publish import BACKGROUND, PublishTransaction
from rlax_tpu.param_server.records import (
    VersionInfo,
    VersionRecord,
    check_pieces,
    conflict,
    summary,
)

_log = logging.getLogger(__name__)

# Committing versions on storage once their arrays are written, in publish order.
_PERSISTING = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="param-server-persist")


class VersionStore:
    """Committed versions of one replica: hot in memory (the newest K, plus any older one
    whose persistent copy is still being written) and persisted.

    `storage_url` is a local directory, file:// or gs:// URL; None keeps everything in memory
    only (tests, benchmarks): then a version pushed out of the newest K is gone at once
    (whatever consumers confirmed), and a restart starts empty. On existing storage every
    committed version is served again and uncommitted leftovers (a version directory without
    MANIFEST.json) are deleted.
    """

    def __init__(
        self,
        storage_url: str | None,
        *,
        hot_versions: int,
        replica: int = 0,
        num_replicas: int = 1,
    ) -> None:
        if hot_versions < 1:
            raise ValueError(f"hot_versions (K) must be >= 1, got {hot_versions}")
        if not 0 <= replica < num_replicas:
            raise ValueError(f"replica must be in [0, num_replicas={num_replicas}), got {replica}")
        self.hot_versions, self.replica, self.num_replicas = hot_versions, replica, num_replicas
        self.storage_url = storage_url
        if storage_url is not None and num_replicas > 1:
            storage_url = storage.join(storage_url, f"replica-{replica}-of-{num_replicas}")
        self._disk = PersistentCopy(storage_url) if storage_url is not None else None
        if self._disk is not None:
            found = self._disk.recover()
            self._index = VersionIndex(
                hot_versions, replica, found.versions, found.layout, found.consumers
            )
        else:
            self._index = VersionIndex(hot_versions, replica)
        self._commit_lock = threading.Lock()  # serialises commits, GC and metadata writes
        self.persist_error: str | None = None  # the first failed persistent copy, if any

    # -- publish ---------------------------------------------------------------------------
    def begin_publish(
        self, version: int, pieces: Sequence[Piece], version_digest: str = ""
    ) -> PublishTransaction:
        """Start publishing `version` made of `pieces` (digests may be "": then computed).

        A version that exists with the same digest gives a transaction that ignores its
        bytes and commits as `already_present`; with a different digest, VersionConflictError.
        """
        by_path = check_pieces(version, pieces)
        if self.persist_error is not None:
            raise StorageFailedError(
                f"version {version} refused: {self.persist_error}; this server cannot keep "
                "versions on storage, so a restart could lose them; fix the storage and "
                "restart the parameter server (the run resumes from its snapshot)"
            )
        if version_digest and all(p.digest for p in by_path.values()):
            expected = tensors.version_digest(by_path.values())
            if version_digest != expected:
                raise InvalidPublishError(
                    f"version {version}: version_digest {version_digest[:16]}… does not match "
                    f"its pieces ({expected[:16]}…); compute it with "
                    "rlax_tpu.api.tensors.version_digest over the declared pieces"
                )
        with self._commit_lock:  # not while a GC deletes this version's files
            mode = self._index.begin(version, by_path, version_digest)
        # Nothing to clean on storage: a publish writes there only once committed, and what
        # a crash leaves half-written is deleted at restart (PersistentCopy.recover).
        return PublishTransaction(self, version, by_path, version_digest, mode)

    def _commit(self, txn: PublishTransaction, pieces: dict[str, Piece], digest: str) -> bool:
        """Make `txn` a committed version, served from memory at once; its persistent copy
        (its arrays, then the manifest) is written in the background, after the publish: a
        publish never waits for storage, nor shares the CPU with its writes. True if the
        same content was there already."""
        v = txn.version
        with self._commit_lock:
            existing = self._index.get(v)
            if existing is not None:
                if existing.digest != digest:
                    raise conflict(v, existing.digest, digest)
                return True
            if txn.mode != "new":
                raise PublishInProgressError(
                    f"version {v} was garbage-collected while it was being republished; "
                    "publish it again"
                )
            # Two first versions may have raced; only the first committed defines the tensors.
            self._index.check_layout(v, pieces)
            keys = array_keys(pieces)
            record = VersionRecord(v, digest, pieces, keys, False, txn.hot)
            if self._disk is not None:
                # On threads: creating an array is a synchronous round trip to storage.
                record.persisting = [
                    BACKGROUND.submit(self._write_persistent, v, keys[p], piece, txn.hot[p])
                    for p, piece in pieces.items()
                ]
            self._index.add(record)
        if self._disk is not None:
            _PERSISTING.submit(self._finish_persisting, record)
        return False

    def _write_persistent(self, version: int, key: str, piece: Piece, data: np.ndarray) -> None:
        """One array of a committed version to storage (on a BACKGROUND thread)."""
        self._disk.write_array(version, key, piece, data)

    def _finish_persisting(self, record: VersionRecord) -> None:
        """Wait for `record`'s array writes, then commit it on storage (its manifest) unless
        it was garbage-collected meanwhile (the collection waited for the writes and
        deleted them)."""
        v = record.version
        try:
            for future in record.persisting or ():
                future.result()
            with self._commit_lock:
                if not self._index.holds(record):
                    return
                failpoint("param_server.persist", v)  # committed, not on storage (chaos test)
                # The manifest is the commit: written only after every array is on storage.
                self._disk.write_manifest(record)
                if not self._disk.layout_written:  # recover() rebuilds it if we die before
                    self._disk.write_layout(v, self._index.layout() or record.pieces)
                self._index.persisted(record)
        except Exception as e:  # noqa: BLE001 - kept and reported: publishes are refused
            error = f"persisting version {v} under {self._version_url(v)} failed: {e}"
            _log.error("%s", error)
            if self.persist_error is None:  # only this thread (_PERSISTING) sets it
                self.persist_error = error
            self._index.persist_failed(record)
        finally:
            record.persisted_event.set()

    def wait_committed(self, version: int, timeout_s: float) -> bool:
        """Wait until `version` is committed here (at most `timeout_s`); True if it is."""
        return self._index.wait_committed(version, timeout_s)

    def stop_waiting(self) -> None:
        """End every wait for a version to commit, now and later (the server is stopping)."""
        self._index.stop_waiting()

    def wait_persisted(self, version: int, timeout_s: float | None = None) -> bool:
        """Wait until `version`'s persistent copy is committed (or failed, or the version
        is gone); True if it is on storage. Without storage: False at once."""
        record = self._index.get(version)
        if record is None or self._disk is None:
            return False
        record.persisted_event.wait(timeout_s)
        return record.persisted

    def _release(self, version: int) -> None:
        self._index.release(version)

    # -- reads -----------------------------------------------------------------------------
    def versions(self) -> list[VersionInfo]:
        """Every committed version, ascending."""
        return self._index.infos()

    def pieces(self, version: int) -> list[Piece]:
        """The pieces (with digests) this replica holds of `version`, in path order."""
        return list(self._index.require(version).pieces.values())

    def layout(self) -> list[Piece]:
        """The first version's pieces without digests ([] before the first publish)."""
        return list((self._index.layout() or {}).values())

    def consumers(self) -> dict[str, int]:
        return self._index.consumers()

    def read(self, version: int, path: str, box: Box | None = None) -> np.ndarray:
        """The `box` (default: all) of array `path` at `version`: dtype[box shape], read-only
        (a view of the memory copy when the version is in memory).

        `box` is in global coordinates and must lie inside the piece this replica holds.
        """
        for attempt in range(2):
            record = self._index.require(version)
            piece, box = self._piece_box(record, path, box)
            try:
                source = self._source(record, path)
                where = tensors.relative(box, piece.domain)
                if isinstance(source, np.ndarray):
                    return source[where]
                out = read_array(source[where], piece.dtype)
                out.flags.writeable = False
                return out
            except ValueError as e:  # TensorStore: a chunk is missing
                if attempt == 0:
                    continue  # deleted or moved out of memory meanwhile: look it up again
                raise RuntimeError(
                    f"reading array {path!r} of version {version} failed: {e}; its persistent "
                    f"copy under {self._version_url(version)} is damaged"
                ) from e
        raise AssertionError("unreachable")

    def view(self, version: int, path: str, box: Box | None = None) -> np.ndarray | None:
        """`read` if the version is in memory (a view, at once), else None."""
        record = self._index.require(version)
        hot = record.hot
        if hot is None:
            return None
        piece, box = self._piece_box(record, path, box)
        return hot[path][tensors.relative(box, piece.domain)]

    def _piece_box(self, record: VersionRecord, path: str, box: Box | None) -> tuple[Piece, Box]:
        """The piece of `path` and `box` (default: all of it), checked to lie inside it."""
        piece = record.pieces.get(path)
        if piece is None:
            raise InvalidReadError(
                f"version {record.version} has no array {path!r} on replica {self.replica}; "
                f"it holds {summary(record.pieces)}"
            )
        box = piece.domain if box is None else tuple((int(a), int(b)) for a, b in box)
        if len(box) != len(piece.domain) or not tensors.contains(piece.domain, box):
            raise InvalidReadError(
                f"array {path!r} of version {record.version}: box {list(box)} is not inside "
                f"the box {list(piece.domain)} that replica {self.replica} of "
                f"{self.num_replicas} holds; ask the replica that holds it"
            )
        return piece, box

    def _source(self, record: VersionRecord, path: str) -> np.ndarray | ts.TensorStore:
        """The array to read: in memory if it is there (loading it if it belongs there)."""
        hot = record.hot
        if hot is None and record.persisted and self._index.belongs_in_memory(record.version):
            hot = self._load_hot(record)  # e.g. the newest versions after a restart
        if hot is not None:
            return hot[path]
        return self._disk.open_array(record, path)

    def _load_hot(self, record: VersionRecord) -> dict[str, np.ndarray] | None:
        with record.load_lock:
            if record.hot is not None:
                return record.hot
            hot = {}
            for path, piece in record.pieces.items():
                data = read_array(self._disk.open_array(record, path), piece.dtype)
                if tensors.digest_bytes(tensors.to_bytes(data)) != piece.digest:
                    raise RuntimeError(
                        f"array {path!r} of version {record.version} in storage does not match "
                        f"its manifest digest: the copy under {self._version_url(record.version)} "
                        "is damaged"
                    )
                data.flags.writeable = False
                hot[path] = data
            return hot if self._index.loaded(record, hot) else None  # None: deleted meanwhile

    def _version_url(self, version: int) -> str:
        return self._disk.version_url(version) if self._disk is not None else "(memory)"

    # -- retention -------------------------------------------------------------------------
    def confirm(self, consumer: str, oldest_needed: int) -> None:
        """Register or update `consumer`: it still needs versions >= `oldest_needed`.

        Confirmations are persisted (CONSUMERS.json), so a restarted server keeps honouring
        them. Registered consumers hold back garbage collection.
        """
        if not consumer:
            raise ValueError("consumer must name the worker or trainer confirming, got ''")
        with self._commit_lock:
            consumers = self._index.confirm(consumer, oldest_needed)
            if self._disk is not None:
                self._disk.write_consumers(consumers)

    def garbage_collect(self, oldest_needed: int) -> list[int]:
        """Delete versions below `oldest_needed` and below every consumer's confirmation,
        except the newest version: from memory, then from storage (manifest first, then
        the version's directory). Returns the deleted versions, ascending."""
        with self._commit_lock:
            records = self._index.collect(oldest_needed)
            deleted = [r.version for r in records]
            if self._disk is None:
                return deleted
            self._disk.forget(deleted)
            for record in records:
                # Array writes still running would land after the delete: let them finish.
                for future in record.persisting or ():
                    concurrent.futures.wait([future])
                self._disk.delete(record.version)
        return deleted
