"""The ParamServer gRPC service (protos/rlax_tpu/v1/param_server.proto) over a VersionStore.

A thin layer: it turns streams into store calls and store errors into status codes
(see STATUS_CODES). Publish and Pull carry the bytes: their messages are parsed and
serialized by hand (api.param_server) to skip protobuf's extra copies, and hold about
`chunk_bytes` of data each, many small arrays to a message. A pull of a version in memory
sends views of its arrays; one only on storage is read ahead on a thread pool.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np

from rlax_tpu.api import tensors as layout
from rlax_tpu.api.param_server import (
    InvalidPublishError,
    InvalidReadError,
    ParamServerError,
    PublishInProgressError,
    StorageFailedError,
    VersionConflictError,
    VersionNotFoundError,
    decode_publish_request,
    encode_pull_chunk,
    join_pull_chunks,
    pack,
)
from rlax_tpu.api.tensors import Box, Piece
from rlax_tpu.failpoints import failpoint
from rlax_tpu.param_server.store import VersionStore
from rlax_tpu.rpc.client import status_code_for
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


def _decoded(raw: bytes) -> pb.PublishRequest | list:
    try:
        return decode_publish_request(raw)
    except ValueError as e:  # protobuf's DecodeError is a ValueError too
        raise InvalidPublishError(f"a malformed PublishRequest: {e}") from None


def status_code(error: BaseException) -> grpc.StatusCode:
    return status_code_for(error, STATUS_CODES)


def _abort(context: grpc.ServicerContext, error: Exception) -> None:
    """End the call with `error`'s status; unexpected errors say what they were (INTERNAL)."""
    if isinstance(error, ParamServerError):
        context.abort(status_code(error), str(error))
    context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")


class ParamServerServicer:
    """Serves one VersionStore (one replica) over gRPC; `add_to_server` registers it."""

    def __init__(
        self,
        store: VersionStore,
        *,
        chunk_bytes: int,
        read_threads: int = 4,
        max_waiting_pulls: int = 16,
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.store, self.chunk_bytes = store, chunk_bytes
        # Pulls waiting for a version to commit each hold a server thread: at most this many
        # wait, so that publishes and the other calls always find a thread.
        self._waiting = threading.BoundedSemaphore(max(1, max_waiting_pulls))
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
                request_deserializer=None,  # Publish decodes them (views of the bytes)
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
    def Publish(self, raw: Iterator[bytes], context: grpc.ServicerContext) -> pb.PublishReply:
        """`raw`: the serialized PublishRequests, decoded here (decode_publish_request) so a
        malformed one fails the call with INVALID_ARGUMENT saying what is wrong."""
        txn = None
        try:
            requests = map(_decoded, raw)
            first = next(requests, None)
            if not isinstance(first, pb.PublishRequest) or first.WhichOneof("kind") != "begin":
                raise InvalidPublishError("a publish stream must start with a begin message")
            begin = first.begin
            pieces = [layout.piece_from_proto(p) for p in begin.pieces]
            txn = self.store.begin_publish(begin.version, pieces, begin.version_digest)
            for request in requests:
                if isinstance(request, list):  # the bytes of one or more chunks
                    for version, path, offset, data in request:
                        if version != begin.version:
                            raise InvalidPublishError(
                                f"a chunk of version {version} in the publish of version "
                                f"{begin.version}; one stream publishes one version"
                            )
                        txn.write(path, offset, data)
                    failpoint("param_server.receive", begin.version)  # chaos test
                    continue
                kind = request.WhichOneof("kind")
                if kind == "commit":
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
            if request.wait_s > 0:
                self._wait_for(version, request.wait_s)
            plan = self._plan(request)  # bad requests fail before the first chunk
            items = ((key, layout.to_bytes(data)) for key, data in self._box_data(version, plan))
            for batch in pack(items, self.chunk_bytes):
                entries = []
                for (piece, index, box, digest, base), pos, data in batch:
                    offset = base + pos
                    header = pb.PullChunk(
                        version=version, path=piece.path, box=index, offset=offset
                    )
                    if offset == 0:  # a box's first chunk says what the box is
                        info = dataclasses.replace(piece, domain=box, digest=digest)
                        layout.piece_to_proto(info, header.info)
                    entries.append(encode_pull_chunk(header, data))
                yield join_pull_chunks(entries)
        except Exception as e:  # e.g. the version was garbage-collected while we read it
            _abort(context, e)

    def _wait_for(self, version: int, timeout_s: float) -> None:
        """Wait until `version` is committed or `timeout_s` passed (then the pull fails as
        for any missing version). When too many pulls wait already, this one does not."""
        if not self._waiting.acquire(blocking=False):
            return
        try:
            self.store.wait_committed(version, timeout_s)
        finally:
            self._waiting.release()

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

    def _box_data(
        self, version: int, plan: list[tuple[Piece, int, Box]]
    ) -> Iterator[tuple[tuple[Piece, int, Box, str, int], np.ndarray]]:
        """((piece, box index, box, digest, byte offset in the box), data) of every box to
        send, in order: a version in memory as views of its arrays; one on storage in slabs
        read ahead on the reader threads, a few ahead of the wire."""
        reads: collections.deque = collections.deque()
        for piece, index, box in plan:
            data = self.store.view(version, piece.path, box)
            if data is not None or box != piece.domain:  # the digest of a box needs its data
                if data is None:
                    data = self.store.read(version, piece.path, box)
                digest = (
                    piece.digest
                    if box == piece.domain
                    else self._box_digest(version, piece, box, data)
                )
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(data)
                reads.append(((piece, index, box, digest, 0), done))
            else:
                itemsize = layout.parse_dtype(piece.dtype).itemsize
                for offset, slab in _slabs(box, itemsize):
                    future = self._readers.submit(self.store.read, version, piece.path, slab)
                    reads.append(((piece, index, box, piece.digest, offset), future))
            while len(reads) > _READ_AHEAD:
                key, future = reads.popleft()
                yield key, future.result()
        while reads:
            key, future = reads.popleft()
            yield key, future.result()

    def _box_digest(self, version: int, piece: Piece, box: Box, data: np.ndarray) -> str:
        """sha256 of a box that is not a whole piece, remembered: every worker of a
        tensor-parallel group asks for the same boxes."""
        key = (version, piece.digest, piece.path, box)
        with self._digest_lock:
            digest = self._box_digests.get(key)
        if digest is None:
            digest = layout.digest_bytes(layout.to_bytes(data))
            with self._digest_lock:
                self._box_digests[key] = digest
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
