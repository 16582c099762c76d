"""The parameter server's face (protos/rlax_tpu/v1/param_server.proto): its errors (shared
by the store, the service that maps them to gRPC status codes, and the client), the
byte-carrying messages on the wire for both ends, the replica plan, and the client of the
host side: publish host boxes, pull boxes as numpy, list, confirm, garbage-collect, wait for
persistence. No JAX: the controller uses this client; the trainer and the inference workers
publish and pull pytrees of (sharded) JAX arrays with its subclass
`rlax_tpu.param_server.trees.TreeClient`.

The wire encoding: Publish and Pull move a version's bytes. Encoded by protobuf, each chunk's
bytes are copied twice more than needed on each side (into the message, then out of it);
here a chunk is serialized around a view of the array's bytes (one copy: the join into the
message) and parsed into its header and a view of its data (no copy). Small pieces travel
many to a message (PieceChunks, PullChunks), so a version of many small arrays costs few
messages. The encodings are plain protobuf: the generated classes parse them, and these
parse what the generated classes write.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from rlax_tpu.api import tensors
from rlax_tpu.api.tensors import Box, Piece
from rlax_tpu.failpoints import failpoint
from rlax_tpu.rpc import make_channel
from rlax_tpu.rpc.client import RpcCallError, retry_unreachable
from rlax_tpu.rpc.protos import param_server_pb2 as pb
from rlax_tpu.rpc.protos import param_server_pb2_grpc as pb_grpc


# -- errors ------------------------------------------------------------------------------------
class ParamServerError(Exception):
    """Base of the parameter server's errors; each message says what to do about it."""


class InvalidPublishError(ParamServerError):
    """A publish that cannot be accepted as sent: bytes, digests or metadata are wrong."""


class LayoutMismatchError(InvalidPublishError):
    """A version whose tree (paths, dtypes, shapes, boxes) differs from the first version's."""


class VersionConflictError(ParamServerError):
    """The version exists already with different content: the run is no longer deterministic."""


class VersionNotFoundError(ParamServerError):
    """The version was never published here, was garbage-collected or is not committed yet."""


class PublishInProgressError(ParamServerError):
    """Another publish of the same version is under way; retry when it has finished."""


class StorageFailedError(ParamServerError):
    """Persisting a version failed earlier; publishes are refused until a restart."""


class PullMismatchError(ParamServerError):
    """A pull into a tree whose arrays differ (shape, dtype) from those the server holds: pulls
    never convert, so a worker must build its model in the published dtype."""


class InvalidReadError(ParamServerError):
    """A read of an array or box that this replica does not hold."""


# -- the wire encoding of the byte-carrying messages -----------------------------------
_LEN, _VARINT = 2, 0
T = TypeVar("T")


def _tag(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


# PublishRequest: oneof chunk (a PieceChunk) or chunks (PieceChunks: repeated PieceChunk).
_REQUEST_CHUNK = pb.PublishRequest.DESCRIPTOR.fields_by_name["chunk"].number
_REQUEST_CHUNKS = pb.PublishRequest.DESCRIPTOR.fields_by_name["chunks"].number
_CHUNKS_ENTRY = pb.PieceChunks.DESCRIPTOR.fields_by_name["chunks"].number
_PIECE = {f.name: f.number for f in pb.PieceChunk.DESCRIPTOR.fields}
_PIECE_NAMES = {number: name for name, number in _PIECE.items()}
# PullChunks: repeated PullChunk, whose `data` is the only bulk field.
_PULL_ENTRY = pb.PullChunks.DESCRIPTOR.fields_by_name["chunks"].number
_PULL_DATA = pb.PullChunk.DESCRIPTOR.fields_by_name["data"].number


# -- Publish ----------------------------------------------------------------------------------
def encode_piece_chunks(version: int, chunks: Sequence[tuple[str, int, memoryview]]) -> bytes:
    """A serialized PublishRequest carrying `chunks`, (path, byte offset, data) each, as one
    PieceChunks message. One copy of the data."""
    head = _tag(_PIECE["version"], _VARINT) + _varint(version)
    parts: list[bytes | memoryview] = []
    for path, offset, data in chunks:
        name = path.encode()
        fields = [
            head,
            _tag(_PIECE["path"], _LEN) + _varint(len(name)) + name,
            _tag(_PIECE["offset"], _VARINT) + _varint(offset),
            _tag(_PIECE["data"], _LEN) + _varint(len(data)),
        ]
        size = sum(len(f) for f in fields) + len(data)
        parts += [_tag(_CHUNKS_ENTRY, _LEN) + _varint(size), *fields, data]
    size = sum(len(p) for p in parts)
    return b"".join([_tag(_REQUEST_CHUNKS, _LEN) + _varint(size), *parts])


Chunk = tuple[int, str, int, memoryview]  # (version, path, byte offset, data)


def decode_publish_request(raw: bytes) -> pb.PublishRequest | list[Chunk]:
    """A serialized PublishRequest: its chunks as [(version, path, offset, data view)] when it
    carries bytes (chunk or chunks), else the parsed message (begin, commit).

    For the server: use it as the Publish request_deserializer to skip the copies of each
    chunk's bytes that PublishRequest.FromString and `.data` make.
    """
    view = memoryview(raw)
    fields = list(_fields(view))
    if len(fields) == 1 and fields[0][0] == _REQUEST_CHUNK:
        return [_piece_chunk(fields[0][1])]
    if len(fields) == 1 and fields[0][0] == _REQUEST_CHUNKS:
        return [
            _piece_chunk(entry)
            for number, entry in _fields(fields[0][1])
            if number == _CHUNKS_ENTRY
        ]
    return pb.PublishRequest.FromString(raw)


def _piece_chunk(view: memoryview) -> Chunk:
    out: dict[str, Any] = {"version": 0, "path": "", "offset": 0, "data": memoryview(b"")}
    for number, value in _fields(view):
        name = _PIECE_NAMES.get(number)
        if name is None:
            continue  # a field this version does not know: protobuf's rule is to skip it
        if isinstance(value, int) != (name in ("version", "offset")):
            raise ValueError(f"PieceChunk field {name!r} has the wrong wire type")
        if name == "path":
            out[name] = bytes(value).decode()
        elif name == "data":
            out[name] = value
        else:
            out[name] = value - (1 << 64) if value >= 1 << 63 else value  # int64
    return out["version"], out["path"], out["offset"], out["data"]


# -- Pull -------------------------------------------------------------------------------------
def encode_pull_chunk(header: pb.PullChunk, data: memoryview) -> list[bytes | memoryview]:
    """The parts of one PullChunks entry: `header`'s fields (every field but data), then
    field `data`, still a view into the array. `join_pull_chunks` makes the message."""
    head = header.SerializeToString()
    body = [head, _tag(_PULL_DATA, _LEN) + _varint(len(data)), data] if len(data) else [head]
    size = sum(len(p) for p in body)
    return [_tag(_PULL_ENTRY, _LEN) + _varint(size), *body]


def join_pull_chunks(entries: Sequence[Sequence[bytes | memoryview]]) -> bytes:
    """A serialized PullChunks of entries from `encode_pull_chunk`: one copy of the data,
    where PullChunk(data=bytes(view)).SerializeToString() makes two and runs at half speed."""
    return b"".join(part for entry in entries for part in entry)


def decode_pull_chunks(raw: bytes) -> list[tuple[pb.PullChunk, memoryview]]:
    """A serialized PullChunks as [(PullChunk with every field but data, data as a view into
    `raw`)].

    For clients: use it as the Pull response_deserializer to skip the two copies of each
    chunk's bytes that PullChunks.FromString and `.data` make.
    """
    out = []
    for number, entry in _fields(memoryview(raw)):
        if number != _PULL_ENTRY:
            continue
        head, data = bytearray(), memoryview(b"")
        for field, value, start, end in _spans(entry):
            if field == _PULL_DATA:
                data = value
            else:
                head += entry[start:end]
        out.append((pb.PullChunk.FromString(bytes(head)), data))
    return out


# -- protobuf's wire format -------------------------------------------------------------------
def _fields(view: memoryview) -> Iterator[tuple[int, memoryview | int]]:
    """(field number, value) of each field of a serialized message: a varint's value, or a
    view of a length-delimited field's bytes."""
    for number, value, _, _ in _spans(view):
        yield number, value


def _spans(view: memoryview) -> Iterator[tuple[int, memoryview | int, int, int]]:
    """(field number, value, start, end of the whole field in `view`) of each field."""
    pos = 0
    while pos < len(view):
        tag, end = _read_varint(view, pos)
        wire = tag & 7
        if wire == _VARINT:
            value, end = _read_varint(view, end)
        elif wire == _LEN:
            length, start = _read_varint(view, end)
            end = start + length
            if end > len(view):
                raise ValueError("truncated protobuf message")
            value = view[start:end]
        elif wire in (1, 5):  # fixed64, fixed32: not bulk, not read here
            end += 8 if wire == 1 else 4
            value = view[end - (8 if wire == 1 else 4) : end]
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield tag >> 3, value, pos, end
        pos = end


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # protobuf's encoding of a negative int64
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at `pos`."""
    value = shift = 0
    while True:
        if pos >= len(view):
            raise ValueError("truncated protobuf varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


# -- packing bytes into messages ----------------------------------------------------------------
# Counted against a message's budget for each entry's header (path, offsets, a box's info),
# so a message of many tiny arrays stays near the budget too.
ENTRY_BYTES = 256


def pack(
    items: Iterable[tuple[T, memoryview]], budget: int
) -> Iterator[list[tuple[T, int, memoryview]]]:
    """Cut the bytes of `items`, (key, bytes) each in order, into messages of about `budget`
    bytes: per message [(key, offset in the item's bytes, slice)]. Small items share a
    message; a large one is split across several. An empty item still gets an entry."""
    batch: list[tuple[T, int, memoryview]] = []
    room = budget
    for key, data in items:
        pos, size = 0, len(data)
        while True:
            if batch and room < ENTRY_BYTES + (1 if pos < size else 0):
                yield batch
                batch, room = [], budget
            take = min(size - pos, max(1, room - ENTRY_BYTES))
            batch.append((key, pos, data[pos : pos + take]))
            room -= ENTRY_BYTES + take
            pos += take
            if pos >= size:
                break
    if batch:
        yield batch


# -- the client --------------------------------------------------------------------------------
DEFAULT_CHUNK_BYTES = 2 * 2**20


# -- replica partitioning -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    """Which box of each array each parameter-server replica holds.

    Arrays with a split dimension (usually the tensor-parallel one) are cut into
    `num_replicas` equal slabs along it, so a tensor-parallel worker pulls each of its
    shards from the replica that holds it; other arrays (and those that do not divide)
    go whole to one replica, assigned round-robin in path order.
    """

    num_replicas: int = 1
    split_dims: Mapping[str, int | None] = dataclasses.field(default_factory=dict)

    def boxes(self, shapes: Mapping[str, Sequence[int]]) -> list[dict[str, Box]]:
        """For each replica, {path: box} of what it holds."""
        per_replica: list[dict[str, Box]] = [{} for _ in range(self.num_replicas)]
        turn = 0
        for path in sorted(shapes):
            shape = tuple(shapes[path])
            full = tensors.full_box(shape)
            dim = self.split_dims.get(path)
            r = self.num_replicas
            if r > 1 and dim is not None and shape and shape[dim] % r == 0:
                step = shape[dim] // r
                for i in range(r):
                    box = list(full)
                    box[dim] = (i * step, (i + 1) * step)
                    per_replica[i][path] = tuple(box)
            else:
                per_replica[turn % r][path] = full
                turn += 1
        return per_replica


def split_dims_from_logical(
    logical_axes: Mapping[str, Sequence[str | None]],
    rules: Sequence[tuple[str, Sequence[str]]],
    mesh_axis: str = "tensor",
) -> dict[str, int | None]:
    """The dimension of each array that the rules shard over `mesh_axis` (None if none)."""
    table = dict(rules)
    out: dict[str, int | None] = {}
    for path, names in logical_axes.items():
        out[path] = next(
            (d for d, n in enumerate(names) if n is not None and mesh_axis in table.get(n, ())),
            None,
        )
    return out


@dataclasses.dataclass(frozen=True)
class PublishReceipt:
    version: int
    already_present: bool  # every replica already had this content
    bytes_sent: int


class ParamServerCallError(RpcCallError, ParamServerError):
    """A parameter-server call failed; the message carries the server's explanation and
    `code` its gRPC status."""


class VersionsMissingError(ParamServerCallError):
    """`wait_persisted`: a replica does not hold `missing` (NOT_FOUND): a server that restarted
    lost what was not on storage yet."""

    def __init__(self, message: str, missing: Sequence[int]) -> None:
        super().__init__(message, code=grpc.StatusCode.NOT_FOUND)
        self.missing = list(missing)


def _raise_from(e: grpc.RpcError, what: str) -> ParamServerCallError:
    return ParamServerCallError.from_rpc(e, what)


def _serialized(message: bytes) -> bytes:
    return message


class ParamServerClient:
    """Talks to the replicas of one parameter server (addresses in replica order)."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        auth_token: str,
        plan: ReplicaPlan | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 600.0,
        reconnect_s: float = 0.0,
        on_retry: Callable[[str], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """`reconnect_s`: how long each call waits for a replica that does not answer (down
        or restarting: it recovers its committed versions from storage) before it fails;
        every call is idempotent, so it is simply made again. 0: fail at once. `stop` set
        (the caller is stopping) ends such a wait at once."""
        if not addresses:
            raise ValueError("ParamServerClient needs at least one replica address")
        self.plan = plan or ReplicaPlan(num_replicas=len(addresses))
        if self.plan.num_replicas != len(addresses):
            raise ValueError(
                f"the replica plan has {self.plan.num_replicas} replicas but "
                f"{len(addresses)} addresses were given"
            )
        self.addresses = list(addresses)
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.reconnect_s, self._on_retry, self._stop = reconnect_s, on_retry, stop
        self._channels = [make_channel(a, auth_token=auth_token) for a in addresses]
        self._stubs = [pb_grpc.ParamServerStub(c) for c in self._channels]
        # The messages carrying bytes are serialized and parsed by hand, without copying
        # the bytes more than once (its wire encoding above).
        self._publishes = [
            c.stream_unary(
                "/rlax_tpu.v1.ParamServer/Publish",
                request_serializer=_serialized,
                response_deserializer=pb.PublishReply.FromString,
            )
            for c in self._channels
        ]
        self._pulls = [
            c.unary_stream(
                "/rlax_tpu.v1.ParamServer/Pull",
                request_serializer=pb.PullRequest.SerializeToString,
                response_deserializer=decode_pull_chunks,
            )
            for c in self._channels
        ]
        self._held: list[dict[str, Piece]] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, len(addresses)))
        self.bytes_pulled = 0  # payload bytes received by pulls (for benchmarks and metrics)
        self._count_lock = threading.Lock()

    @property
    def num_replicas(self) -> int:
        return len(self.addresses)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> ParamServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- publish --------------------------------------------------------------------------
    def publish_boxes(
        self,
        version: int,
        replicas: Iterable[int],
        shapes: Mapping[str, tuple[int, ...]],
        held: Sequence[Mapping[str, Box]],
        data_of: Callable[[int, str], np.ndarray],
    ) -> PublishReceipt:
        """Send the streams of `replicas`, in parallel; `data_of(replica, path)` is the host
        data of that replica's box of `path`."""

        def one(replica: int) -> tuple[bool, int]:
            pieces, payload = [], {}
            for path, box in sorted(held[replica].items()):
                data = data_of(replica, path)
                payload[path] = tensors.to_bytes(data)
                # No digest: the server hashes the bytes as they arrive, so the sender's
                # critical path does not (a version's digest is the server's).
                dtype = tensors.dtype_name(data.dtype)
                pieces.append(Piece(path=path, dtype=dtype, shape=shapes[path], domain=box))
            what = f"publish of version {version} to {self.addresses[replica]}"

            def send() -> pb.PublishReply:  # the whole stream again after a reconnect
                requests = self._publish_requests(version, pieces, payload)
                try:
                    return self._publishes[replica](requests, timeout=self.timeout_s)
                except grpc.RpcError as e:
                    raise _raise_from(e, what) from None

            reply = self._retrying(send, what)
            return reply.already_present, reply.bytes_received

        results = list(self._pool.map(one, list(replicas)))
        return PublishReceipt(
            version=version,
            already_present=all(present for present, _ in results),
            bytes_sent=sum(n for _, n in results),
        )

    def _publish_requests(
        self, version: int, pieces: list[Piece], payload: Mapping[str, memoryview]
    ) -> Iterator[bytes]:
        """The serialized stream: begin, the pieces' bytes in messages of about chunk_bytes
        (small pieces share one), commit."""
        begin = pb.PublishBegin(version=version)
        for piece in pieces:
            tensors.piece_to_proto(piece, begin.pieces.add())
        yield pb.PublishRequest(begin=begin).SerializeToString()
        items = ((piece.path, payload[piece.path]) for piece in pieces)
        for batch in pack(items, self.chunk_bytes):
            yield encode_piece_chunks(version, batch)
            failpoint("trainer.publish", version)  # the sender dies mid-stream (chaos test)
        yield pb.PublishRequest(commit=pb.PublishCommit(version=version)).SerializeToString()

    # -- pull -----------------------------------------------------------------------------
    def held_pieces(self, refresh: bool = False) -> list[dict[str, Piece]]:
        """For each replica, {path: piece} it holds (from its layout)."""
        if self._held is None or refresh:
            self._held = []
            for replica in range(len(self._stubs)):
                reply = self._call(replica, "ListVersions", pb.ListVersionsRequest())
                pieces = [tensors.piece_from_proto(p) for p in reply.layout]
                self._held.append({p.path: p for p in pieces})
        return self._held

    def _layout(self) -> list[dict[str, Piece]]:
        """`held_pieces()`, read again if a replica had no layout yet."""
        held = self.held_pieces()
        return self.held_pieces(refresh=True) if any(not h for h in held) else held

    def pull_boxes(
        self, version: int, wanted: Mapping[str, Sequence[Box]], wait_s: float = 0.0
    ) -> dict[tuple[str, Box], np.ndarray]:
        """Fetch the given boxes of the given arrays: {(path, box): array of the box}.

        Each box is assembled from the replicas that hold parts of it. With `wait_s` > 0, a
        version not yet committed is waited for (that long at most) and sent as it commits.
        """
        held = self._layout()
        requests: list[dict[str, list[Box]]] = [{} for _ in self._stubs]
        out: dict[tuple[str, Box], np.ndarray] = {}
        for path, boxes in wanted.items():
            owners = [(r, h[path]) for r, h in enumerate(held) if path in h]
            if not owners:
                raise ParamServerCallError(f"no replica holds an array named {path!r}")
            for box in boxes:
                out[(path, box)] = np.empty(
                    tensors.box_shape(box), dtype=tensors.parse_dtype(owners[0][1].dtype)
                )
                for replica, piece in owners:
                    common = tensors.intersect(piece.domain, box)
                    if common is not None:
                        requests[replica].setdefault(path, []).append(common)

        targets_of: dict[str, list[tuple[Box, np.ndarray]]] = {}
        for (path, box), target in out.items():
            targets_of.setdefault(path, []).append((box, target))

        def target_for(path: str, sub_box: Box) -> tuple[np.ndarray, tuple[slice, ...]]:
            for want_box, target in targets_of[path]:
                if tensors.contains(want_box, sub_box):
                    return target, tensors.relative(sub_box, want_box)
            raise ParamServerCallError(f"the server sent an unrequested box of {path!r}")

        replicas = [r for r in range(len(self._stubs)) if requests[r]]
        # A pull that may wait gets threads of its own: it must not hold the shared pool's
        # threads, which other pulls need meanwhile.
        pool = self._pool if wait_s <= 0 else concurrent.futures.ThreadPoolExecutor(len(replicas))
        try:
            futures = [
                # The replica's whole stream again after a reconnect.
                pool.submit(
                    self._retrying,
                    functools.partial(self._pull_from, r, version, requests[r], target_for, wait_s),
                    f"pull of version {version} from {self.addresses[r]}",
                )
                for r in replicas
            ]
            for future in futures:
                future.result()
        finally:
            if pool is not self._pool:
                pool.shutdown(wait=False)
        return out

    def _pull_from(
        self,
        replica: int,
        version: int,
        select: Mapping[str, list[Box]],
        target_for: Callable[[str, Box], tuple[np.ndarray, tuple[slice, ...]]],
        wait_s: float = 0.0,
    ) -> None:
        """Stream the selected boxes from one replica into their targets.

        A box that fills its whole target is written straight into the target's bytes;
        a part of a target goes through a temporary array of the box.
        """
        request = pb.PullRequest(version=version, wait_s=wait_s)
        for path, boxes in select.items():
            selection = request.select.add(path=path)
            for box in boxes:
                tensors.box_to_proto(box, selection.domains.add())
        received = 0
        flat = None
        pending: tuple[np.ndarray, tuple[slice, ...], np.ndarray] | None = None
        try:
            for message in self._pulls[replica](request, timeout=self.timeout_s + wait_s):
                for header, data in message:
                    if header.HasField("info"):
                        if pending is not None:
                            pending[0][pending[1]] = pending[2]
                            pending = None
                        info = tensors.piece_from_proto(header.info)
                        target, where = target_for(info.path, info.domain)
                        if target[where].shape == target.shape:
                            flat = target.reshape(-1).view(np.uint8)
                        else:
                            box = np.empty(tensors.box_shape(info.domain), dtype=target.dtype)
                            pending = (target, where, box)
                            flat = box.reshape(-1).view(np.uint8)
                    assert flat is not None, "a pull stream starts with a box's info"
                    end = header.offset + len(data)
                    flat[header.offset : end] = np.frombuffer(data, np.uint8)
                    received += len(data)
        except grpc.RpcError as e:
            raise _raise_from(
                e, f"pull of version {version} from {self.addresses[replica]}"
            ) from None
        if pending is not None:
            pending[0][pending[1]] = pending[2]
        with self._count_lock:
            self.bytes_pulled += received

    def pull_arrays(
        self, version: int, paths: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Whole arrays as numpy, {path: array} (all of them by default)."""
        held = self.held_pieces()
        shapes = {p: piece.shape for h in held for p, piece in h.items()}
        if not shapes:
            held = self.held_pieces(refresh=True)
            shapes = {p: piece.shape for h in held for p, piece in h.items()}
        wanted = {p: [tensors.full_box(shapes[p])] for p in (paths or sorted(shapes))}
        return {path: array for (path, _), array in self.pull_boxes(version, wanted).items()}

    def _check_like(self, targets: Mapping[str, Any]) -> None:
        stored = {path: piece for h in self._layout() for path, piece in h.items()}
        problems = []
        for path, leaf in targets.items():
            piece = stored.get(path)  # an unknown path: pull_boxes names it
            here = (tensors.dtype_name(leaf.dtype), tuple(leaf.shape))
            if piece is not None and here != (piece.dtype, piece.shape):
                problems.append(
                    f"{path!r} is {piece.dtype}{list(piece.shape)} there, "
                    f"{here[0]}{list(here[1])} here"
                )
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise PullMismatchError(
                f"the tree to pull into does not match the published arrays: "
                f"{'; '.join(problems[:5])}{more}. A pull does not convert: build the model "
                "to pull into from the run's config with ModelConfig.served() (param_dtype = "
                "model.publish_dtype)"
            )

    # -- bookkeeping ----------------------------------------------------------------------
    def list_versions(self, replica: int = 0) -> pb.ListVersionsReply:
        return self._call(replica, "ListVersions", pb.ListVersionsRequest())

    def versions(self) -> list[int]:
        """Versions that every replica has (committed)."""
        common: set[int] | None = None
        for replica in range(len(self._stubs)):
            have = {v.version for v in self.list_versions(replica).versions}
            common = have if common is None else common & have
        return sorted(common or ())

    def confirm(self, consumer: str, oldest_needed: int) -> None:
        """Tell every replica that `consumer` no longer needs versions below `oldest_needed`."""
        request = pb.ConfirmRequest(consumer=consumer, oldest_needed=oldest_needed)
        for replica in range(len(self._stubs)):
            self._call(replica, "Confirm", request)

    def garbage_collect(self, oldest_needed: int) -> list[int]:
        """Ask every replica, in order, to delete each version `v` with `v < oldest_needed`,
        `v` below the `oldest_needed` confirmed by every registered consumer, and `v` not
        the replica's newest version: from memory and from persistent storage.

        Returns the versions deleted on every replica, ascending. A replica whose call
        fails raises ParamServerCallError (those before it have collected; calling again
        is safe)."""
        deleted: set[int] | None = None
        for replica in range(len(self._stubs)):
            reply = self._call(
                replica, "GarbageCollect", pb.GarbageCollectRequest(oldest_needed=oldest_needed)
            )
            deleted = set(reply.deleted) if deleted is None else deleted & set(reply.deleted)
        return sorted(deleted or ())

    def wait_persisted(self, versions: Iterable[int], timeout_s: float = 600.0) -> None:
        """Return once every replica has `versions` on storage (a publish returns when the
        memory copy is complete; the persistent copy follows). Servers without storage
        have nothing to wait for. Raises ParamServerCallError naming the versions that a
        replica does not hold (VersionsMissingError, with `.missing`) or did not persist
        within `timeout_s`, and why."""
        versions = sorted(set(int(v) for v in versions))
        if not versions:
            return
        request = pb.WaitPersistedRequest(versions=versions, timeout_s=timeout_s)
        for replica in range(len(self._stubs)):
            reply = self._call(replica, "WaitPersisted", request, timeout_s=timeout_s)
            if not reply.persistent:
                continue
            missing = list(reply.missing)
            late = sorted(set(versions) - set(reply.persisted) - set(missing))
            if missing or late or reply.persist_error:
                problems = []
                if missing:
                    problems.append(f"versions {missing} are not held there")
                if late:
                    problems.append(f"versions {late} are not on storage after {timeout_s:g} s")
                if reply.persist_error:
                    problems.append(reply.persist_error)
                message = f"parameter server {self.addresses[replica]}: " + "; ".join(problems)
                if missing:
                    raise VersionsMissingError(message, missing)
                raise ParamServerCallError(message, code=grpc.StatusCode.UNAVAILABLE)

    def _call(self, replica: int, method: str, request: Any, timeout_s: float = 0.0) -> Any:
        """`method` on `replica`; `timeout_s` is time the server may take beyond the usual
        deadline (a call that waits server-side)."""
        call: Callable[..., Any] = getattr(self._stubs[replica], method)
        what = f"{method} on {self.addresses[replica]}"

        def once() -> Any:
            try:
                return call(request, timeout=self.timeout_s + timeout_s)
            except grpc.RpcError as e:
                raise _raise_from(e, what) from None

        return self._retrying(once, what)

    def _retrying(self, call: Callable[[], Any], what: str) -> Any:
        return retry_unreachable(
            call,
            wait_s=self.reconnect_s,
            what=f"the parameter server ({what})",
            on_retry=self._on_retry,
            stop=self._stop,
        )
