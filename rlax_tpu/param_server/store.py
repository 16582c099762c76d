"""The parameter server's storage: immutable, versioned weight trees on TensorStore (DESIGN §3).

Each committed version is kept hot in memory (the newest K: the arrays the publish was
received into, read-only, served as views) and persisted with TensorStore as zarr3 arrays
with a MANIFEST.json written last (its presence is the commit on storage).
A publish is acknowledged once the hot copy is complete; the persistent copy is finished in
the background ("written continuously", DESIGN §3), and `VersionInfo.persisted` says when it
is on storage: a caller that needs a version to survive a restart waits for that
(`wait_persisted`; the controller does so before a snapshot may rely on it). A failed
persistent write is kept as `persist_error` and refuses later publishes until a restart.
The gRPC servicer (service.py) is a thin layer over `VersionStore`.

Storage layout under `storage_url` (under `replica-I-of-R/` when there are R > 1 replicas):

    LAYOUT.json                       the first version's pieces: every version must match them
    CONSUMERS.json                    consumer -> oldest version it still needs (survives restarts)
    versions/0000000042/MANIFEST.json pieces, their sha256 digests, the version digest
    versions/0000000042/00003-layers.0.wq/zarr.json, c/0/0, ...   one zarr3 array per piece

zarr3 rather than ocdbt: one self-contained directory per version makes garbage collection and
crash cleanup a plain recursive delete, whereas ocdbt shares data files between versions and
needs its own compaction to give deleted bytes back.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from rlax_tpu import storage
from rlax_tpu.api import tensors as layout
from rlax_tpu.api.param_server import (
    InvalidPublishError,
    InvalidReadError,
    LayoutMismatchError,
    PublishInProgressError,
    StorageFailedError,
    VersionConflictError,
    VersionNotFoundError,
)
from rlax_tpu.api.tensors import Box, Piece
from rlax_tpu.failpoints import failpoint

_log = logging.getLogger(__name__)

FORMAT = "rlax_tpu.param_server/1"
# zarr chunks of at most this size: TensorStore writes them in parallel and a box read touches
# only the chunks it overlaps. Dimensions are split from the first, so chunks are row blocks.
CHUNK_TARGET_BYTES = 8 * 2**20
_COLD_HANDLES = 256  # opened persistent arrays kept for reads of versions not in memory
_DIGEST = re.compile(r"[0-9a-f]{64}")
# Hashing complete pieces while more bytes arrive, and writing committed versions to storage.
_BACKGROUND = concurrent.futures.ThreadPoolExecutor(
    max(4, min(16, 2 * (os.cpu_count() or 2))), thread_name_prefix="param-server-publish"
)
# Committing versions on storage once their arrays are written, in publish order.
_PERSISTING = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="param-server-persist")


@dataclasses.dataclass(frozen=True)
class PublishResult:
    version: int
    version_digest: str
    already_present: bool  # the same content was committed before; nothing changed
    bytes_received: int


@dataclasses.dataclass(frozen=True)
class VersionInfo:
    version: int
    digest: str
    in_memory: bool
    persisted: bool
    num_bytes: int


@dataclasses.dataclass(eq=False)
class _Version:
    """A committed version. `hot` holds its memory arrays, None when it is not in memory."""

    version: int
    digest: str
    pieces: dict[str, Piece]  # by path, in path order
    keys: dict[str, str]  # path -> array directory name
    persisted: bool
    hot: dict[str, np.ndarray] | None = None  # read-only, each the shape of its piece's box
    load_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # The persistent array writes still running (futures), until the manifest is written.
    persisting: list[concurrent.futures.Future] | None = None
    persisted_event: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def num_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces.values())


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
        self._root = storage_url
        self._kvstore = _kvstore(storage_url) if storage_url is not None else None
        # Shared by every persistent array (connection pools, I/O concurrency limits).
        self._context = ts.Context()
        self._lock = threading.Lock()  # the index below; held briefly
        self._committed = threading.Condition(self._lock)  # notified when a version commits
        self._commit_lock = threading.Lock()  # serialises commits, GC and metadata writes
        self._versions: dict[int, _Version] = {}
        self._in_flight: set[int] = set()
        self._layout: dict[str, Piece] | None = None
        self._consumers: dict[str, int] = {}
        self._cold: collections.OrderedDict[tuple[int, str], ts.TensorStore] = (
            collections.OrderedDict()
        )
        self._layout_written = False  # LAYOUT.json is on storage
        self.persist_error: str | None = None  # the first failed persistent copy, if any
        if self._root is not None:
            self._recover()

    # -- publish ---------------------------------------------------------------------------
    def begin_publish(
        self, version: int, pieces: Sequence[Piece], version_digest: str = ""
    ) -> PublishTransaction:
        """Start publishing `version` made of `pieces` (digests may be "": then computed).

        A version that exists with the same digest gives a transaction that ignores its
        bytes and commits as `already_present`; with a different digest, VersionConflictError.
        """
        by_path = _check_pieces(version, pieces)
        if self.persist_error is not None:
            raise StorageFailedError(
                f"version {version} refused: {self.persist_error}; this server cannot keep "
                "versions on storage, so a restart could lose them; fix the storage and "
                "restart the parameter server (the run resumes from its snapshot)"
            )
        if version_digest and all(p.digest for p in by_path.values()):
            expected = layout.version_digest(by_path.values())
            if version_digest != expected:
                raise InvalidPublishError(
                    f"version {version}: version_digest {version_digest[:16]}… does not match "
                    f"its pieces ({expected[:16]}…); compute it with "
                    "rlax_tpu.api.tensors.version_digest over the declared pieces"
                )
        with self._commit_lock, self._lock:  # not while a GC deletes this version's files
            existing = self._versions.get(version)
            if existing is not None and version_digest:
                if version_digest != existing.digest:
                    raise _conflict(version, existing.digest, version_digest)
                mode = "noop"
            else:
                mode = "new" if existing is None else "compare"
                if self._layout is not None:
                    _check_layout(version, self._layout, by_path)
            if version in self._in_flight:
                raise PublishInProgressError(
                    f"version {version} is being published by another stream; retry when it "
                    "has committed or aborted"
                )
            self._in_flight.add(version)
        # Nothing to clean on storage: a publish writes there only once committed, and what
        # a crash leaves half-written is deleted at restart (_recover).
        return PublishTransaction(self, version, by_path, version_digest, mode)

    def _commit(self, txn: PublishTransaction, pieces: dict[str, Piece], digest: str) -> bool:
        """Make `txn` a committed version, served from memory at once; its persistent copy
        (its arrays, then the manifest) is written in the background, after the publish: a
        publish never waits for storage, nor shares the CPU with its writes. True if the
        same content was there already."""
        v = txn.version
        with self._commit_lock:
            with self._lock:
                existing = self._versions.get(v)
            if existing is not None:
                if existing.digest != digest:
                    raise _conflict(v, existing.digest, digest)
                return True
            if txn.mode != "new":
                raise PublishInProgressError(
                    f"version {v} was garbage-collected while it was being republished; "
                    "publish it again"
                )
            first = self._layout is None
            if not first:  # two first versions may have raced; only one defines the layout
                _check_layout(v, self._layout, pieces)
            keys = _array_keys(pieces)
            record = _Version(v, digest, pieces, keys, False, txn.hot)
            if self._root is not None:
                # On threads: creating an array is a synchronous round trip to storage.
                record.persisting = [
                    _BACKGROUND.submit(self._write_persistent, v, keys[p], piece, txn.hot[p])
                    for p, piece in pieces.items()
                ]
            with self._lock:
                self._versions[v] = record
                self._committed.notify_all()
                if first:
                    self._layout = {p: dataclasses.replace(x, digest="") for p, x in pieces.items()}
                self._enforce_hot_bound()
        if self._root is not None:
            _PERSISTING.submit(self._finish_persisting, record)
        return False

    def _finish_persisting(self, record: _Version) -> None:
        """Wait for `record`'s array writes, then commit it on storage (its manifest) unless
        it was garbage-collected meanwhile (the collection waited for the writes and
        deleted them)."""
        v = record.version
        try:
            for future in record.persisting or ():
                future.result()
            with self._commit_lock:
                with self._lock:
                    if self._versions.get(v) is not record:
                        return
                failpoint("param_server.persist", v)  # committed, not on storage (chaos test)
                # The manifest is the commit: written only after every array is on storage.
                storage.write_text(self._manifest_url(v), _manifest_json(record))
                if not self._layout_written:  # _recover() rebuilds it if we die before
                    with self._lock:
                        layout_pieces = dict(self._layout or record.pieces)
                    storage.write_text(self._url("LAYOUT.json"), _layout_json(v, layout_pieces))
                    self._layout_written = True
                with self._lock:
                    record.persisted, record.persisting = True, None
                    self._enforce_hot_bound()
        except Exception as e:  # noqa: BLE001 - kept and reported: publishes are refused
            error = f"persisting version {v} under {self._version_url(v)} failed: {e}"
            _log.error("%s", error)
            with self._lock:
                if self.persist_error is None:
                    self.persist_error = error
                record.persisting = None
        finally:
            record.persisted_event.set()

    def wait_committed(self, version: int, timeout_s: float) -> bool:
        """Wait until `version` is committed here (at most `timeout_s`); True if it is."""
        deadline = time.monotonic() + timeout_s
        with self._committed:
            while version not in self._versions:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._committed.wait(left)
            return True

    def wait_persisted(self, version: int, timeout_s: float | None = None) -> bool:
        """Wait until `version`'s persistent copy is committed (or failed, or the version
        is gone); True if it is on storage. Without storage: False at once."""
        with self._lock:
            record = self._versions.get(version)
        if record is None or self._root is None:
            return False
        record.persisted_event.wait(timeout_s)
        return record.persisted

    def _release(self, version: int) -> None:
        with self._lock:
            self._in_flight.discard(version)

    def _enforce_hot_bound(self) -> None:
        """Keep only the newest K versions in memory (caller holds self._lock). A version
        whose persistent copy is still being written stays until it is on storage."""
        newest = set(sorted(self._versions)[-self.hot_versions :])
        for v in [v for v in self._versions if v not in newest]:
            record = self._versions[v]
            if record.persisted:
                record.hot = None  # still served, from storage
            elif record.persisting is None:  # memory only: nowhere else to serve it from
                del self._versions[v]

    # -- reads -----------------------------------------------------------------------------
    def versions(self) -> list[VersionInfo]:
        """Every committed version, ascending."""
        with self._lock:  # one consistent snapshot: persisting may evict a copy meanwhile
            return [
                VersionInfo(r.version, r.digest, r.hot is not None, r.persisted, r.num_bytes)
                for r in (self._versions[v] for v in sorted(self._versions))
            ]

    def pieces(self, version: int) -> list[Piece]:
        """The pieces (with digests) this replica holds of `version`, in path order."""
        return list(self._record(version).pieces.values())

    def layout(self) -> list[Piece]:
        """The first version's pieces without digests ([] before the first publish)."""
        with self._lock:
            return list((self._layout or {}).values())

    def consumers(self) -> dict[str, int]:
        with self._lock:
            return dict(self._consumers)

    def read(self, version: int, path: str, box: Box | None = None) -> np.ndarray:
        """The `box` (default: all) of array `path` at `version`: dtype[box shape], read-only
        (a view of the memory copy when the version is in memory).

        `box` is in global coordinates and must lie inside the piece this replica holds.
        """
        for attempt in range(2):
            record = self._record(version)
            piece, box = self._piece_box(record, path, box)
            try:
                source = self._source(record, path)
                where = layout.relative(box, piece.domain)
                if isinstance(source, np.ndarray):
                    return source[where]
                out = _read_array(source[where], piece.dtype)
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
        record = self._record(version)
        hot = record.hot
        if hot is None:
            return None
        piece, box = self._piece_box(record, path, box)
        return hot[path][layout.relative(box, piece.domain)]

    def _piece_box(self, record: _Version, path: str, box: Box | None) -> tuple[Piece, Box]:
        """The piece of `path` and `box` (default: all of it), checked to lie inside it."""
        piece = record.pieces.get(path)
        if piece is None:
            raise InvalidReadError(
                f"version {record.version} has no array {path!r} on replica {self.replica}; "
                f"it holds {_summary(record.pieces)}"
            )
        box = piece.domain if box is None else tuple((int(a), int(b)) for a, b in box)
        if len(box) != len(piece.domain) or not layout.contains(piece.domain, box):
            raise InvalidReadError(
                f"array {path!r} of version {record.version}: box {list(box)} is not inside "
                f"the box {list(piece.domain)} that replica {self.replica} of "
                f"{self.num_replicas} holds; ask the replica that holds it"
            )
        return piece, box

    def _record(self, version: int) -> _Version:
        with self._lock:
            record = self._versions.get(version)
            if record is not None:
                return record
            known = sorted(self._versions)
        if not known:
            where = "no versions are available (none committed, or all deleted)"
        else:
            where = f"available versions run from oldest {known[0]} to newest {known[-1]}"
        raise VersionNotFoundError(
            f"version {version} is not available on replica {self.replica}: it was never "
            f"published here or was garbage-collected; {where}"
        )

    def _source(self, record: _Version, path: str) -> np.ndarray | ts.TensorStore:
        """The array to read: in memory if it is there (loading it if it belongs there)."""
        hot = record.hot
        if hot is None and record.persisted and self._belongs_in_memory(record.version):
            hot = self._load_hot(record)  # e.g. the newest versions after a restart
        if hot is not None:
            return hot[path]
        return self._cold_array(record, path)

    def _belongs_in_memory(self, version: int) -> bool:
        with self._lock:
            return version in sorted(self._versions)[-self.hot_versions :]

    def _load_hot(self, record: _Version) -> dict[str, np.ndarray] | None:
        with record.load_lock:
            if record.hot is not None:
                return record.hot
            hot = {}
            for path, piece in record.pieces.items():
                data = _read_array(self._cold_array(record, path), piece.dtype)
                if layout.digest_bytes(layout.to_bytes(data)) != piece.digest:
                    raise RuntimeError(
                        f"array {path!r} of version {record.version} in storage does not match "
                        f"its manifest digest: the copy under {self._version_url(record.version)} "
                        "is damaged"
                    )
                data.flags.writeable = False
                hot[path] = data
            with self._lock:
                if self._versions.get(record.version) is not record:
                    return None  # deleted meanwhile
                record.hot = hot
                self._enforce_hot_bound()
            return hot

    def _cold_array(self, record: _Version, path: str) -> ts.TensorStore:
        key = (record.version, path)
        with self._lock:
            array = self._cold.get(key)
            if array is not None:
                self._cold.move_to_end(key)
                return array
        spec = {
            "driver": "zarr3",
            "kvstore": self._array_kvstore(record.version, record.keys[path]),
            "fill_missing_data_reads": False,
        }
        array = ts.open(spec, open=True, context=self._context).result()
        with self._lock:
            self._cold[key] = array
            while len(self._cold) > _COLD_HANDLES:
                self._cold.popitem(last=False)
        return array

    # -- retention -------------------------------------------------------------------------
    def confirm(self, consumer: str, oldest_needed: int) -> None:
        """Register or update `consumer`: it still needs versions >= `oldest_needed`.

        Confirmations are persisted (CONSUMERS.json), so a restarted server keeps honouring
        them. Registered consumers hold back garbage collection.
        """
        if not consumer:
            raise ValueError("consumer must name the worker or trainer confirming, got ''")
        with self._commit_lock:
            with self._lock:
                self._consumers[consumer] = int(oldest_needed)
                consumers = dict(self._consumers)
            if self._root is not None:
                text = json.dumps({"format": FORMAT, "consumers": consumers}, sort_keys=True)
                storage.write_text(self._url("CONSUMERS.json"), text)

    def garbage_collect(self, oldest_needed: int) -> list[int]:
        """Delete versions below `oldest_needed` and below every consumer's confirmation,
        except the newest version: from memory, then from storage (manifest first, then
        the version's directory). Returns the deleted versions, ascending."""
        with self._commit_lock:
            with self._lock:
                bound = min([int(oldest_needed), *self._consumers.values()])
                newest = max(self._versions, default=None)
                deleted = sorted(v for v in self._versions if v < bound and v != newest)
                records = [self._versions.pop(v) for v in deleted]
                for key in [k for k in self._cold if k[0] in deleted]:
                    del self._cold[key]
            for record in records:
                # Array writes still running would land after the delete: let them finish.
                for future in record.persisting or ():
                    concurrent.futures.wait([future])
                self._delete_persisted(record.version)
        return deleted

    # -- persistent storage ----------------------------------------------------------------
    def _url(self, *parts: str) -> str:
        return storage.join(self._root, *parts)

    def _version_url(self, version: int) -> str:
        return self._url("versions", f"{version:010d}") if self._root else "(memory)"

    def _manifest_url(self, version: int) -> str:
        return storage.join(self._version_url(version), "MANIFEST.json")

    def _array_kvstore(self, version: int, key: str) -> dict[str, Any]:
        prefix = f"versions/{version:010d}/{key}/"
        return {**self._kvstore, "path": self._kvstore["path"] + prefix}

    def _write_persistent(self, version: int, key: str, piece: Piece, data: np.ndarray) -> None:
        spec = _array_spec(self._array_kvstore(version, key), piece)
        # Not delete_existing: its ranged delete wipes a whole bucket on the GCS emulator.
        array = ts.open(spec, create=True, context=self._context).result()
        array.write(data).result()

    def _delete_persisted(self, version: int) -> None:
        """Manifest first: a crash half-way leaves an uncommitted directory, removed on restart."""
        if self._root is None:
            return
        for url, recursive in (
            (self._manifest_url(version), False),
            (self._version_url(version), True),
        ):
            try:
                storage.remove(url, recursive=recursive)
            except FileNotFoundError:
                pass

    def _recover(self) -> None:
        """Index the committed versions on storage; delete uncommitted leftovers."""
        try:
            names = storage.listdir(self._url("versions"))
        except FileNotFoundError:
            names = []
        for name in names:
            if not name.isdigit():
                continue
            version = int(name)
            try:
                manifest = json.loads(storage.read_text(self._manifest_url(version)))
            except FileNotFoundError:  # a publish that never committed, or a half-done GC
                self._delete_persisted(version)
                continue
            self._versions[version] = _record_from_manifest(manifest)
            self._versions[version].persisted_event.set()
        if storage.exists(self._url("LAYOUT.json")):
            self._layout = _pieces_from_json(
                json.loads(storage.read_text(self._url("LAYOUT.json")))
            )
        elif self._versions:  # the commit of the first version died before LAYOUT.json
            first = self._versions[min(self._versions)]
            storage.write_text(self._url("LAYOUT.json"), _layout_json(first.version, first.pieces))
            self._layout = {p: dataclasses.replace(x, digest="") for p, x in first.pieces.items()}
        self._layout_written = self._layout is not None
        if storage.exists(self._url("CONSUMERS.json")):
            self._consumers = json.loads(storage.read_text(self._url("CONSUMERS.json")))[
                "consumers"
            ]


class PublishTransaction:
    """One publish in progress: bytes arrive with `write`, the version appears at `commit`.

    Any failure aborts it; an aborted transaction leaves nothing in memory or storage.
    """

    def __init__(
        self,
        store: VersionStore,
        version: int,
        pieces: dict[str, Piece],
        version_digest: str,
        mode: str,
    ) -> None:
        self.version = version
        # "new"; "noop": the same digest is committed, bytes are ignored; "compare": the
        # version exists and the declared digest is unknown, compare at commit, store nothing.
        self.mode = mode
        self._store, self._pieces, self._declared = store, pieces, version_digest
        self._lock = threading.Lock()
        self._state = "open"
        self._bytes_received = 0
        self._staged = {} if mode == "noop" else {p: _Staged(x.nbytes) for p, x in pieces.items()}
        self._digests: dict[str, str] = {}
        self._hashing: dict[str, concurrent.futures.Future] = {}
        self.hot: dict[str, np.ndarray] = {}
        # Writes to storage (concurrent futures): they outlive the commit (VersionStore).

    def write(self, path: str, offset: int, data: bytes | memoryview) -> None:
        """Bytes [offset, offset + len(data)) of the C-order little-endian bytes of `path`."""
        with self._lock:
            self._check_open()
            try:
                self._write(path, int(offset), memoryview(data).cast("B"))
            except BaseException:
                self._abort()
                raise

    def commit(self) -> PublishResult:
        with self._lock:
            self._check_open()
            try:
                result = self._commit()
            except BaseException:
                self._abort()
                raise
            self._state = "committed"
            self._store._release(self.version)
            return result

    def abort(self) -> None:
        """Drop everything this publish wrote (no-op once committed or aborted)."""
        with self._lock:
            self._abort()

    # -- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._state != "open":
            raise InvalidPublishError(
                f"the publish of version {self.version} is {self._state}; begin a new one"
            )

    def _write(self, path: str, offset: int, data: memoryview) -> None:
        self._bytes_received += len(data)
        if self.mode == "noop" or not len(data):
            return
        piece = self._pieces.get(path)
        if piece is None:
            raise InvalidPublishError(
                f"version {self.version}: bytes for array {path!r}, which the begin message "
                f"did not declare; declare every piece in begin ({_summary(self._pieces)})"
            )
        staged = self._staged.get(path)
        if staged is None or offset < 0 or offset + len(data) > piece.nbytes:
            where = "after the piece was complete" if staged is None else "outside the piece"
            raise InvalidPublishError(
                f"version {self.version}, array {path!r}: bytes [{offset}, {offset + len(data)}) "
                f"arrived {where} ({piece.nbytes} bytes: {piece.describe()}); send each byte "
                "of a piece's C-order little-endian bytes exactly once"
            )
        if staged.add(offset, data, path, self.version):
            self._finish_piece(path)
        self._check_digests(wait=False)

    def _finish_piece(self, path: str) -> None:
        """All bytes of `path` are here: they become its memory copy; hash them."""
        data = self._staged.pop(path).take()
        piece = self._pieces[path]
        if self.mode == "new":
            array = data.view(layout.parse_dtype(piece.dtype))
            array = array.reshape(layout.box_shape(piece.domain))
            array.flags.writeable = False
            self.hot[path] = array
        # Hashed on another thread (hashlib releases the GIL) while more bytes arrive.
        self._hashing[path] = _BACKGROUND.submit(layout.digest_bytes, data)

    def _check_digests(self, wait: bool) -> None:
        """Check the finished hashes (all of them, waiting, if `wait`) against begin's."""
        for path, future in list(self._hashing.items()):
            if not (wait or future.done()):
                continue
            digest, piece = future.result(), self._pieces[path]
            del self._hashing[path]
            if piece.digest and digest != piece.digest:
                raise InvalidPublishError(
                    f"version {self.version}, array {path!r}: the bytes received have sha256 "
                    f"{digest[:16]}… but begin declared {piece.digest[:16]}…; declare the "
                    "digest of the C-order little-endian bytes actually sent"
                )
            self._digests[path] = digest

    def _commit(self) -> PublishResult:
        store, v = self._store, self.version
        if self.mode == "noop":  # begin checked that the declared digest is the committed one
            return PublishResult(v, self._declared, True, self._bytes_received)
        for path in self._pieces:  # zero-byte pieces never see a write
            if path in self._staged and self._staged[path].received == self._pieces[path].nbytes:
                self._finish_piece(path)
        if self._staged:
            missing = [
                f"{p!r} has {s.received} of {s.nbytes} bytes" for p, s in self._staged.items()
            ]
            more = f" (and {len(missing) - 3} more arrays)" if len(missing) > 3 else ""
            raise InvalidPublishError(
                f"commit of version {v} before all bytes arrived: {'; '.join(missing[:3])}{more}; "
                "send every byte of every declared piece before commit"
            )
        self._check_digests(wait=True)
        pieces = {
            p: dataclasses.replace(x, digest=self._digests[p]) for p, x in self._pieces.items()
        }
        digest = layout.version_digest(pieces.values())
        if self._declared and digest != self._declared:
            raise InvalidPublishError(
                f"version {v}: version_digest {self._declared[:16]}… does not match the pieces "
                f"received ({digest[:16]}…); compute it with layout.version_digest"
            )
        already = store._commit(self, pieces, digest)
        return PublishResult(v, digest, already, self._bytes_received)

    def _abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        self.hot, self._staged = {}, {}  # nothing is on storage before the commit
        self._store._release(self.version)


class _Staged:
    """The bytes of one piece as they arrive, in any order, each exactly once."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.received = nbytes, 0
        self._buffer: np.ndarray | None = None
        self._starts: list[int] = []  # disjoint received ranges [start, end), sorted
        self._ends: list[int] = []

    def add(self, offset: int, data: memoryview, path: str, version: int) -> bool:
        """Store `data` at `offset`; True once every byte is here."""
        end = offset + len(data)
        i = bisect.bisect_right(self._starts, offset)
        if (i > 0 and self._ends[i - 1] > offset) or (
            i < len(self._starts) and self._starts[i] < end
        ):
            raise InvalidPublishError(
                f"version {version}, array {path!r}: bytes [{offset}, {end}) overlap bytes "
                "sent before; send each byte exactly once"
            )
        if self._buffer is None:
            self._buffer = np.empty(self.nbytes, np.uint8)
        self._buffer[offset:end] = np.frombuffer(data, np.uint8)
        self._starts.insert(i, offset)
        self._ends.insert(i, end)
        self.received += len(data)
        return self.received == self.nbytes

    def take(self) -> np.ndarray:
        buffer = self._buffer if self._buffer is not None else np.empty(self.nbytes, np.uint8)
        self._buffer = None
        return buffer


# -- helpers -------------------------------------------------------------------------------
def _check_pieces(version: int, pieces: Sequence[Piece]) -> dict[str, Piece]:
    if version < 0:
        raise InvalidPublishError(f"version must be >= 0 (the trainer's step), got {version}")
    if not pieces:
        raise InvalidPublishError(f"version {version} has no arrays; publish at least one")
    out: dict[str, Piece] = {}
    for p in pieces:
        name = f"version {version}, array {p.path!r}"
        if not p.path or p.path in out:
            raise InvalidPublishError(f"{name}: paths must be non-empty and unique")
        try:
            layout.parse_dtype(p.dtype)
            ts.dtype(p.dtype)
        except (TypeError, ValueError):
            raise InvalidPublishError(
                f"{name}: dtype {p.dtype!r} is not supported; use a numpy or ml_dtypes name "
                "such as float32, bfloat16 or int32"
            ) from None
        if len(p.domain) != len(p.shape) or any(
            not 0 <= lo <= hi <= n for (lo, hi), n in zip(p.domain, p.shape, strict=False)
        ):
            raise InvalidPublishError(
                f"{name}: box {list(p.domain)} does not lie inside its shape {list(p.shape)}"
            )
        if p.digest and not _DIGEST.fullmatch(p.digest):
            raise InvalidPublishError(f"{name}: digest must be 64 lower-case hex digits or ''")
        out[p.path] = p
    return dict(sorted(out.items()))


def _check_layout(version: int, first: dict[str, Piece], pieces: dict[str, Piece]) -> None:
    problems = [
        f"array {p!r} is missing (the first version has {first[p].describe()})"
        for p in sorted(first.keys() - pieces.keys())
    ]
    problems += [
        f"array {p!r} is not in the first version's tree"
        for p in sorted(pieces.keys() - first.keys())
    ]
    problems += [
        f"array {p!r} is {pieces[p].describe()} but the first version has {first[p].describe()}"
        for p in sorted(pieces.keys() & first.keys())
        if not pieces[p].same_layout(first[p])
    ]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        changed = sorted(
            {
                f"{pieces[p].dtype} instead of {first[p].dtype}"
                for p in pieces.keys() & first.keys()
                if pieces[p].dtype != first[p].dtype
            }
        )
        hint = (
            f" Dtypes differ ({', '.join(changed)}): the trainer publishes in "
            'model.publish_dtype ("" = param_dtype), which must stay what this storage was '
            "first published with."
            if changed
            else ""
        )
        raise LayoutMismatchError(
            f"version {version} does not match the layout of the first version published here: "
            f"{'; '.join(problems[:5])}{more}. Every version must have the same tree (paths, "
            "dtypes, shapes, shard boxes); publish the same model, or use new storage for "
            f"another one.{hint}"
        )


def _conflict(version: int, existing: str, new: str) -> VersionConflictError:
    return VersionConflictError(
        f"version {version} exists with digest {existing[:16]}… but this publish has "
        f"{new[:16]}…: versions are immutable, so the run is no longer deterministic; find why "
        "the trainer produced different weights for the same step"
    )


def _summary(pieces: dict[str, Piece]) -> str:
    names = list(pieces)
    more = f", … ({len(names)} arrays)" if len(names) > 5 else ""
    return ", ".join(repr(n) for n in names[:5]) + more


def _array_keys(pieces: dict[str, Piece]) -> dict[str, str]:
    """A directory name per piece: its rank in path order (unique) and a readable path."""
    return {
        p: f"{i:05d}-{re.sub(r'[^A-Za-z0-9_.-]+', '.', p)[:80]}"
        for i, p in enumerate(sorted(pieces))
    }


def _kvstore(url: str) -> dict[str, Any]:
    """The TensorStore kvstore spec of a storage URL (its "path" ends in "/" or is "")."""
    if url.startswith("gs://"):
        bucket, _, path = url[len("gs://") :].partition("/")
        path = path.strip("/")
        return {"driver": "gcs", "bucket": bucket, "path": path + "/" if path else ""}
    if url.startswith("file://"):
        url = url[len("file://") :]
    return {"driver": "file", "path": os.path.abspath(url) + "/"}


def _array_spec(kvstore: dict[str, Any], piece: Piece) -> dict[str, Any]:
    shape = layout.box_shape(piece.domain)
    chunk = [max(1, n) for n in shape]
    itemsize = layout.parse_dtype(piece.dtype).itemsize
    for d in range(len(chunk)):
        while chunk[d] > 1 and math.prod(chunk) * itemsize > CHUNK_TARGET_BYTES:
            chunk[d] = -(-chunk[d] // 2)
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "metadata": {
            "shape": list(shape),
            "data_type": piece.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        },
        # A missing chunk is an error, never zeros: a version deleted under a reader, or a
        # damaged copy, must not be served as zeros. So all-zero chunks must be stored too.
        "fill_missing_data_reads": False,
        "store_data_equal_to_fill_value": True,
    }


def _read_array(source: ts.TensorStore, dtype: str) -> np.ndarray:
    """`source` read into a new numpy array: dtype[source shape].

    Not `source.read()`: numpy backs large arrays with transparent huge pages (where the
    kernel offers them, `madvise` mode included) and TensorStore's own result buffer does
    not. Reading 100 MB from a memory kvstore this way takes about a quarter of the page
    faults and half the CPU time, which is most of a cold pull's store read.
    """
    out = np.empty(source.shape, layout.parse_dtype(dtype))
    ts.array(out, copy=False, write=True).write(source).result()
    return out


def _piece_json(p: Piece) -> dict[str, Any]:
    return {
        "path": p.path,
        "dtype": p.dtype,
        "shape": list(p.shape),
        "domain": [list(b) for b in p.domain],
    }


def _piece_from_json(d: dict[str, Any]) -> Piece:
    domain = tuple((int(lo), int(hi)) for lo, hi in d["domain"])
    return Piece(d["path"], d["dtype"], tuple(d["shape"]), domain, d.get("digest", ""))


def _pieces_from_json(d: dict[str, Any]) -> dict[str, Piece]:
    return {p["path"]: _piece_from_json(p) for p in sorted(d["pieces"], key=lambda p: p["path"])}


def _layout_json(version: int, pieces: dict[str, Piece]) -> str:
    body = {
        "format": FORMAT,
        "first_version": version,
        "pieces": [_piece_json(p) for p in pieces.values()],
    }
    return json.dumps(body, indent=1)


def _manifest_json(r: _Version) -> str:
    pieces = [
        {**_piece_json(p), "digest": p.digest, "key": r.keys[p.path]} for p in r.pieces.values()
    ]
    body = {
        "format": FORMAT,
        "version": r.version,
        "version_digest": r.digest,
        "num_bytes": r.num_bytes,
        "pieces": pieces,
    }
    return json.dumps(body, indent=1)


def _record_from_manifest(m: dict[str, Any]) -> _Version:
    if m.get("format") != FORMAT:
        raise ValueError(
            f"MANIFEST.json of version {m.get('version')} has format {m.get('format')!r}, "
            f"expected {FORMAT!r}: it was written by another version of rlax_tpu"
        )
    pieces = _pieces_from_json(m)
    keys = {p["path"]: p["key"] for p in m["pieces"]}
    return _Version(int(m["version"]), m["version_digest"], pieces, keys, persisted=True)
