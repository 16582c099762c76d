"""A publish in progress on the parameter server: bytes of declared pieces arrive in any order,
are hashed as each piece completes and become the version's memory copy at commit (DESIGN §3:
a staged copy, then an atomic publish). `VersionStore.begin_publish` (store.py) starts one.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import os
import threading
from typing import TYPE_CHECKING

import numpy as np

from rlax_tpu.api import tensors
from rlax_tpu.api.param_server import InvalidPublishError
from rlax_tpu.api.tensors import Piece
from rlax_tpu.param_server.records import PublishResult, summary

if TYPE_CHECKING:
    from rlax_tpu.param_server.store import VersionStore

# Hashing complete pieces while more bytes arrive, and writing committed versions to storage.
BACKGROUND = concurrent.futures.ThreadPoolExecutor(
    max(4, min(16, 2 * (os.cpu_count() or 2))), thread_name_prefix="param-server-publish"
)


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
                f"did not declare; declare every piece in begin ({summary(self._pieces)})"
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
            array = data.view(tensors.parse_dtype(piece.dtype))
            array = array.reshape(tensors.box_shape(piece.domain))
            array.flags.writeable = False
            self.hot[path] = array
        # Hashed on another thread (hashlib releases the GIL) while more bytes arrive.
        self._hashing[path] = BACKGROUND.submit(tensors.digest_bytes, data)

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
        digest = tensors.version_digest(pieces.values())
        if self._declared and digest != self._declared:
            raise InvalidPublishError(
                f"version {v}: version_digest {self._declared[:16]}… does not match the pieces "
                f"received ({digest[:16]}…); compute it with tensors.version_digest"
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
