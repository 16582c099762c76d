"""The parameter server's index of committed versions: which exist, which are hot (in memory),
which publishes are in flight, the layout they must match and the consumers that hold back
garbage collection (DESIGN §3). `VersionStore` (store.py) moves bytes; this decides, under
one short lock, what the store holds.
"""

from __future__ import annotations

import threading
import time

from rlax_tpu.api.param_server import PublishInProgressError, VersionNotFoundError
from rlax_tpu.api.tensors import Piece
from rlax_tpu.param_server.records import (
    VersionInfo,
    VersionRecord,
    check_layout,
    conflict,
    without_digests,
)


class VersionIndex:
    """Committed versions of one replica, the newest `hot_versions` (K) of them in memory.

    Thread-safe: every method holds the lock briefly and does no I/O. A version pushed out
    of the newest K leaves memory once its persistent copy is on storage; one without a
    persistent copy (no storage) is dropped at once.
    """

    def __init__(
        self,
        hot_versions: int,
        replica: int,
        versions: dict[int, VersionRecord] | None = None,
        layout: dict[str, Piece] | None = None,
        consumers: dict[str, int] | None = None,
    ) -> None:
        self.hot_versions, self.replica = hot_versions, replica
        self._lock = threading.Lock()
        self._committed = threading.Condition(self._lock)  # notified when a version commits
        self._versions: dict[int, VersionRecord] = dict(versions or {})
        self._in_flight: set[int] = set()
        self._layout = layout  # the first version's pieces without digests
        self._consumers: dict[str, int] = dict(consumers or {})
        self._stopping = False  # stop_waiting: waits end at once, as if timed out

    # -- publish ---------------------------------------------------------------------------
    def begin(self, version: int, pieces: dict[str, Piece], version_digest: str) -> str:
        """Mark `version` in flight; its publish mode: "new", "noop" (the declared digest is
        the committed one) or "compare" (it exists; compare the digest at commit)."""
        with self._lock:
            existing = self._versions.get(version)
            if existing is not None and version_digest:
                if version_digest != existing.digest:
                    raise conflict(version, existing.digest, version_digest)
                mode = "noop"
            else:
                mode = "new" if existing is None else "compare"
                if self._layout is not None:
                    check_layout(version, self._layout, pieces)
            if version in self._in_flight:
                raise PublishInProgressError(
                    f"version {version} is being published by another stream; retry when it "
                    "has committed or aborted"
                )
            self._in_flight.add(version)
            return mode

    def release(self, version: int) -> None:
        with self._lock:
            self._in_flight.discard(version)

    def check_layout(self, version: int, pieces: dict[str, Piece]) -> None:
        """LayoutMismatchError unless `pieces` match the first version's (if there is one)."""
        with self._lock:
            first = self._layout
        if first is not None:
            check_layout(version, first, pieces)

    def add(self, record: VersionRecord) -> None:
        """Commit `record`; the first version committed defines the tensors."""
        with self._lock:
            self._versions[record.version] = record
            self._committed.notify_all()
            if self._layout is None:
                self._layout = without_digests(record.pieces)
            self._enforce_hot_bound()

    def wait_committed(self, version: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._committed:
            while version not in self._versions:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    return False
                self._committed.wait(left)
            return True

    def stop_waiting(self) -> None:
        """End every `wait_committed`, now and later, as if its time were up (the server is
        stopping: a pull waiting for a version must not hold its shutdown for the grace)."""
        with self._committed:
            self._stopping = True
            self._committed.notify_all()

    def persisted(self, record: VersionRecord) -> None:
        """`record`'s persistent copy is committed: it may leave memory now."""
        with self._lock:
            record.persisted, record.persisting = True, None
            self._enforce_hot_bound()

    def persist_failed(self, record: VersionRecord) -> None:
        with self._lock:
            record.persisting = None

    # -- lookups ---------------------------------------------------------------------------
    def get(self, version: int) -> VersionRecord | None:
        with self._lock:
            return self._versions.get(version)

    def holds(self, record: VersionRecord) -> bool:
        """Whether `record` is still committed (not garbage-collected meanwhile)."""
        with self._lock:
            return self._versions.get(record.version) is record

    def require(self, version: int) -> VersionRecord:
        """The record of `version`, or VersionNotFoundError naming the versions there are."""
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

    def infos(self) -> list[VersionInfo]:
        """Every committed version, ascending."""
        with self._lock:  # one consistent snapshot: persisting may evict a copy meanwhile
            return [self._versions[v].info() for v in sorted(self._versions)]

    def layout(self) -> dict[str, Piece] | None:
        with self._lock:
            return None if self._layout is None else dict(self._layout)

    def consumers(self) -> dict[str, int]:
        with self._lock:
            return dict(self._consumers)

    # -- memory and retention --------------------------------------------------------------
    def belongs_in_memory(self, version: int) -> bool:
        with self._lock:
            return version in sorted(self._versions)[-self.hot_versions :]

    def loaded(self, record: VersionRecord, hot: dict) -> bool:
        """Keep `hot`, read back from storage, as `record`'s memory copy; False if `record`
        was deleted meanwhile."""
        with self._lock:
            if self._versions.get(record.version) is not record:
                return False
            record.hot = hot
            self._enforce_hot_bound()
            return True

    def confirm(self, consumer: str, oldest_needed: int) -> dict[str, int]:
        """Record that `consumer` still needs versions >= `oldest_needed`; all consumers."""
        with self._lock:
            self._consumers[consumer] = int(oldest_needed)
            return dict(self._consumers)

    def collect(self, oldest_needed: int) -> list[VersionRecord]:
        """Remove and return the versions below `oldest_needed` and below every consumer's
        confirmation, except the newest version; ascending."""
        with self._lock:
            bound = min([int(oldest_needed), *self._consumers.values()])
            newest = max(self._versions, default=None)
            deleted = sorted(v for v in self._versions if v < bound and v != newest)
            return [self._versions.pop(v) for v in deleted]

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
