"""The ParamServer gRPC service (protos/rlax_tpu/v1/param_server.proto) over a VersionStore.

A thin layer: it turns streams into store calls and store errors into status codes
(see STATUS_CODES). Pull is the hot path: boxes are read ahead on a thread pool and their
bytes go out in `chunk_bytes` slices, serialized by hand to skip protobuf's extra copies.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator

import grpc

from rlax_tpu.param_server import layout
from rlax_tpu.param_server.errors import (
    InvalidPublishError,
    InvalidReadError,
    ParamServerError,
    PublishInProgressError,
    StorageFailedError,
    VersionConflictError,
    VersionNotFoundError,
)
from rlax_tpu.param_server.layout import Box, Piece
from rlax_tpu.param_server.store import VersionStore
from rlax_tpu.param_server.wire import encode_pull_chunk
from rlax_tpu.rpc.protos import param_server_pb2 as pb

# Store errors -> gRPC status. A conflict is ALREADY_EXISTS: the version exists with other
# content; PublishInProgress is ABORTED: a concurrency clash the client may retry.
STATUS_CODES: dict[type[ParamServerError], grpc.StatusCode] = {
    InvalidPublishError: grpc.StatusCode.INVALID_ARGUMENT,  # LayoutMismatchError included
    StorageFailedError: grpc.StatusCode.FAILED_PRECONDITION,
    InvalidReadError: grpc.StatusCode.INVALID_ARGUMENT,
    VersionConflictError: grpc.StatusCode.ALREADY_EXISTS,
    VersionNotFoundError: grpc.StatusCode.NOT_FOUND,
    PublishInProgressError: grpc.StatusCode.ABORTED,
}
SERVICE_NAME = "rlax_tpu.v1.ParamServer"
# Boxes are read from the store in slabs of about this size, a few ahead of the wire.
_SLAB_BYTES = 8 * 2**20
_READ_AHEAD = 3


def status_code(error: BaseException) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL


def _abort(context: grpc.ServicerContext, error: Exception) -> None:
    """End the call with `error`'s status; unexpected errors say what they were (INTERNAL)."""
    if isinstance(error, ParamServerError):
        context.abort(status_code(error), str(error))
    context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")


class _PullCache:
    """Serialized PullChunk messages of the newest version pulled, up to `max_bytes`.

    Every inference worker pulls the same version after a reload; serializing it once and
    sending the same bytes to each (as a bare byte stream would) removes the read and
    message-assembly copies from all but the first pull. Versions are immutable and
    entries are keyed by content digest, so an entry is never stale; only the newest
    version is kept, which bounds the extra memory by one version.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._version = -1
        self._entries: dict[tuple, list[bytes]] = {}
        self._bytes = 0

    @staticmethod
    def _key(piece: Piece, index: int, box: Box) -> tuple:
        return (piece.path, piece.digest, index, box)

    def get(self, version: int, piece: Piece, index: int, box: Box) -> list[bytes] | None:
        with self._lock:
            if version != self._version:
                return None
            return self._entries.get(self._key(piece, index, box))

    def put(self, version: int, piece: Piece, index: int, box: Box, messages: list[bytes]) -> None:
        """Keep the complete messages of one box (if the version is the newest and they fit)."""
        size = sum(len(m) for m in messages)
        with self._lock:
            if version < self._version or size > self.max_bytes:
                return
            if version > self._version:  # a newer version: drop the older one's entries
                self._version, self._entries, self._bytes = version, {}, 0
            key = self._key(piece, index, box)
            if key not in self._entries and self._bytes + size <= self.max_bytes:
                self._entries[key] = messages
                self._bytes += size


class ParamServerServicer:
    """Serves one VersionStore (one replica) over gRPC; `add_to_server` registers it."""

    def __init__(
        self,
        store: VersionStore,
        *,
        chunk_bytes: int,
        read_threads: int = 4,
        pull_cache_bytes: int = 4 * 2**30,
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.store, self.chunk_bytes = store, chunk_bytes
        self._pull_cache = _PullCache(pull_cache_bytes)
        self._readers = concurrent.futures.ThreadPoolExecutor(
            read_threads, thread_name_prefix="param-server-read"
        )
        # sha256 of boxes that are not whole pieces, by (version, version digest, path, box):
        # every worker of a tensor-parallel group asks for the same boxes.
        self._box_digests: collections.OrderedDict[tuple, str] = collections.OrderedDict()
        self._digest_lock = threading.Lock()

    def add_to_server(self, server: grpc.Server) -> None:
        """Like the generated add_ParamServerServicer_to_server, with Pull's hand serializer."""
        handlers = {
            "Publish": grpc.stream_unary_rpc_method_handler(
                self.Publish,
                request_deserializer=pb.PublishRequest.FromString,
                response_serializer=pb.PublishReply.SerializeToString,
            ),
            "Pull": grpc.unary_stream_rpc_method_handler(
                self.Pull,
                request_deserializer=pb.PullRequest.FromString,
                response_serializer=None,  # Pull yields serialized PullChunks (bytes)
            ),
        }
        for name, request, reply in (
            ("ListVersions", pb.ListVersionsRequest, pb.ListVersionsReply),
            ("Confirm", pb.ConfirmRequest, pb.ConfirmReply),
            ("GarbageCollect", pb.GarbageCollectRequest, pb.GarbageCollectReply),
            ("WaitPersisted", pb.WaitPersistedRequest, pb.WaitPersistedReply),
        ):
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                getattr(self, name),
                request_deserializer=request.FromString,
                response_serializer=reply.SerializeToString,
            )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )
        server.add_registered_method_handlers(SERVICE_NAME, handlers)

    def close(self) -> None:
        self._readers.shutdown(wait=False, cancel_futures=True)

    # -- Publish -------------------------------------------------------------------------
    def Publish(
        self, requests: Iterator[pb.PublishRequest], context: grpc.ServicerContext
    ) -> pb.PublishReply:
        txn = None
        try:
            first = next(requests, None)
            if first is None or first.WhichOneof("kind") != "begin":
                raise InvalidPublishError("a publish stream must start with a begin message")
            begin = first.begin
            pieces = [layout.piece_from_proto(p) for p in begin.pieces]
            txn = self.store.begin_publish(begin.version, pieces, begin.version_digest)
            for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "chunk":
                    chunk = request.chunk
                    if chunk.version != begin.version:
                        raise InvalidPublishError(
                            f"a chunk of version {chunk.version} in the publish of version "
                            f"{begin.version}; one stream publishes one version"
                        )
                    txn.write(chunk.path, chunk.offset, chunk.data)
                elif kind == "commit":
                    result = txn.commit()
                    return pb.PublishReply(
                        version=result.version,
                        version_digest=result.version_digest,
                        already_present=result.already_present,
                        bytes_received=result.bytes_received,
                    )
                else:
                    raise InvalidPublishError(f"unexpected {kind!r} message after begin")
            raise InvalidPublishError(
                f"the publish stream of version {begin.version} ended without a commit message; "
                "nothing was stored"
            )
        except Exception as e:
            _abort(context, e)
        finally:
            # A broken stream (client cancelled or died) raises out of `requests`: the
            # version must not appear, so whatever was written goes.
            if txn is not None:
                txn.abort()

    # -- Pull ----------------------------------------------------------------------------
    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            version = request.version
            plan = self._plan(request)  # bad requests fail before the first chunk
            misses = []
            for piece, index, box in plan:
                messages = self._pull_cache.get(version, piece, index, box)
                if messages is None:
                    misses.append((piece, index, box))
                else:
                    yield from messages
            reads = collections.deque()
            building: dict[tuple, list[bytes]] = {}  # messages of boxes being sent, to cache
            for item in self._reads(version, misses):
                reads.append(item)
                if len(reads) > _READ_AHEAD:
                    yield from self._send(version, building, *reads.popleft())
            while reads:
                yield from self._send(version, building, *reads.popleft())
        except Exception as e:  # e.g. the version was garbage-collected while we sent it
            _abort(context, e)

    def _plan(self, request: pb.PullRequest) -> list[tuple[Piece, int, Box]]:
        """(piece, box index, box) for every box to send, checked against what we hold."""
        pieces = {p.path: p for p in self.store.pieces(request.version)}
        if not request.select:
            return [(p, 0, p.domain) for p in pieces.values()]
        plan = []
        paths = [selection.path for selection in request.select]
        if len(set(paths)) != len(paths):
            raise InvalidReadError("a pull lists an array twice; put all its boxes in one entry")
        for selection in request.select:
            piece = pieces.get(selection.path)
            if piece is None:
                raise InvalidReadError(
                    f"version {request.version} has no array {selection.path!r} on replica "
                    f"{self.store.replica} of {self.store.num_replicas}"
                )
            boxes = [layout.box_from_proto(d) for d in selection.domains] or [piece.domain]
            for i, box in enumerate(boxes):
                if len(box) != len(piece.domain) or not layout.contains(piece.domain, box):
                    raise InvalidReadError(
                        f"array {piece.path!r} of version {request.version}: box {list(box)} is "
                        f"not inside the box {list(piece.domain)} that replica "
                        f"{self.store.replica} of {self.store.num_replicas} holds; ask the "
                        "replica that holds it"
                    )
                plan.append((piece, i, box))
        return plan

    def _reads(
        self, version: int, plan: list[tuple[Piece, int, Box]]
    ) -> Iterable[tuple[Piece, int, Box, str, int, concurrent.futures.Future, bool]]:
        """(piece, box index, box, digest, byte offset, future array, last slab of the box)
        per slab, lazily, so that only a few slab reads run ahead of the wire."""
        for piece, index, box in plan:
            digest = (
                piece.digest if box == piece.domain else self._cached_digest(version, piece, box)
            )
            if digest is None:  # the digest goes in the first chunk: hash the whole box first
                data = self.store.read(version, piece.path, box)
                digest = self._remember_digest(version, piece, box, data)
                done = concurrent.futures.Future()
                done.set_result(data)
                yield piece, index, box, digest, 0, done, True
                continue
            slabs = list(_slabs(box, layout.parse_dtype(piece.dtype).itemsize))
            for i, (offset, slab) in enumerate(slabs):
                future = self._readers.submit(self.store.read, version, piece.path, slab)
                yield piece, index, box, digest, offset, future, i == len(slabs) - 1

    def _send(
        self,
        version: int,
        building: dict[tuple, list[bytes]],
        piece: Piece,
        index: int,
        box: Box,
        digest: str,
        offset: int,
        future: concurrent.futures.Future,
        last: bool,
    ) -> Iterator[bytes]:
        data = layout.to_bytes(future.result())
        messages = building.setdefault((piece.path, index, box), [])
        for start in range(0, max(len(data), 1), self.chunk_bytes):
            header = pb.PullChunk(
                version=version, path=piece.path, box=index, offset=offset + start
            )
            if offset + start == 0:
                info = dataclasses.replace(piece, domain=box, digest=digest)
                layout.piece_to_proto(info, header.info)
            message = encode_pull_chunk(header, data[start : start + self.chunk_bytes])
            messages.append(message)
            yield message
        if last:
            self._pull_cache.put(version, piece, index, box, building.pop((piece.path, index, box)))

    def _cached_digest(self, version: int, piece: Piece, box: Box) -> str | None:
        key = (version, piece.digest, piece.path, box)
        with self._digest_lock:
            return self._box_digests.get(key)

    def _remember_digest(self, version: int, piece: Piece, box: Box, data) -> str:
        digest = layout.digest_bytes(layout.to_bytes(data))
        with self._digest_lock:
            self._box_digests[(version, piece.digest, piece.path, box)] = digest
            while len(self._box_digests) > 4096:
                self._box_digests.popitem(last=False)
        return digest

    # -- the rest ------------------------------------------------------------------------
    def ListVersions(
        self, request: pb.ListVersionsRequest, context: grpc.ServicerContext
    ) -> pb.ListVersionsReply:
        reply = pb.ListVersionsReply(
            consumers=self.store.consumers(),
            hot_versions=self.store.hot_versions,
            replica=self.store.replica,
            num_replicas=self.store.num_replicas,
        )
        for v in self.store.versions():
            reply.versions.add(
                version=v.version,
                version_digest=v.digest,
                in_memory=v.in_memory,
                persisted=v.persisted,
                num_bytes=v.num_bytes,
            )
        for piece in self.store.layout():
            layout.piece_to_proto(piece, reply.layout.add())
        return reply

    def Confirm(self, request: pb.ConfirmRequest, context: grpc.ServicerContext) -> pb.ConfirmReply:
        if not request.consumer:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Confirm needs a consumer name")
        self.store.confirm(request.consumer, request.oldest_needed)
        return pb.ConfirmReply()

    def GarbageCollect(
        self, request: pb.GarbageCollectRequest, context: grpc.ServicerContext
    ) -> pb.GarbageCollectReply:
        return pb.GarbageCollectReply(deleted=self.store.garbage_collect(request.oldest_needed))

    def WaitPersisted(
        self, request: pb.WaitPersistedRequest, context: grpc.ServicerContext
    ) -> pb.WaitPersistedReply:
        reply = pb.WaitPersistedReply(persistent=self.store.storage_url is not None)
        if reply.persistent:
            held = {v.version for v in self.store.versions()}
            deadline = time.monotonic() + max(0.0, request.timeout_s)
            for v in request.versions:
                if v not in held:
                    reply.missing.append(v)
                elif self.store.wait_persisted(v, max(0.0, deadline - time.monotonic())):
                    reply.persisted.append(v)
        reply.persist_error = self.store.persist_error or ""
        return reply


def _slabs(box: Box, itemsize: int) -> Iterator[tuple[int, Box]]:
    """(byte offset in the box's C-order bytes, sub-box) along the first dimension: each slab's
    bytes are the next contiguous run of the box's bytes."""
    if not box or box[0][1] - box[0][0] <= 1 or layout.box_size(box) == 0:
        yield 0, box
        return
    (lo, hi), rest = box[0], box[1:]
    row_bytes = layout.box_size(rest) * itemsize
    rows = max(1, _SLAB_BYTES // max(row_bytes, 1))
    for start in range(lo, hi, rows):
        yield (start - lo) * row_bytes, ((start, min(start + rows, hi)), *rest)
