"""The parameter server's byte-carrying messages on the wire, for both ends.

Publish and Pull move a version's bytes. Encoded by protobuf, each chunk's bytes are copied
twice more than needed on each side (into the message, then out of it); here a chunk is
serialized around a view of the array's bytes (one copy: the join into the message) and
parsed into its header and a view of its data (no copy). Small pieces travel many to a
message (PieceChunks, PullChunks), so a version of many small arrays costs few messages.
The encodings are plain protobuf: the generated classes parse them, and these parse what
the generated classes write.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

from rlax_tpu.rpc.protos import param_server_pb2 as pb

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
