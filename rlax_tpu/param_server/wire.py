"""The parameter server's Pull stream on the wire, for both ends: a PullChunk serialized
around a view of the array's bytes (the server), and parsed into its header and a view of
its data (the client), each with one copy of the bytes fewer than protobuf's own."""

from __future__ import annotations

from rlax_tpu.rpc.protos import param_server_pb2 as pb

_DATA_FIELD = pb.PullChunk.DESCRIPTOR.fields_by_name["data"].number
_DATA_TAG = bytes([_DATA_FIELD << 3 | 2])


def encode_pull_chunk(header: pb.PullChunk, data: memoryview) -> bytes:
    """A serialized PullChunk: `header`'s fields (every field but data), then field `data`,
    still a view into the array read from the store. One copy of the bytes, where
    PullChunk(data=bytes(view)).SerializeToString() makes two and runs at half speed."""
    n = len(data)
    head = header.SerializeToString()
    if not n:
        return head
    return b"".join((head, _DATA_TAG, _varint(n), data))


def decode_pull_chunk(raw: bytes) -> tuple[pb.PullChunk, memoryview]:
    """A serialized PullChunk as (every field but data, data as a view into `raw`).

    For clients: use it as the Pull response_deserializer (with identity) to skip the two
    copies of each chunk's bytes that PullChunk.FromString and `.data` make.
    """
    view, pos = memoryview(raw), 0
    while pos < len(view):
        tag, end = _read_varint(view, pos)
        wire = tag & 7
        if wire == 0:
            _, end = _read_varint(view, end)
        elif wire == 2:
            length, start = _read_varint(view, end)
            end = start + length
            if tag >> 3 == _DATA_FIELD:
                header = pb.PullChunk.FromString(bytes(view[:pos]) + bytes(view[end:]))
                return header, view[start:end]
        elif wire in (1, 5):
            end += 8 if wire == 1 else 4
        else:
            raise ValueError(f"PullChunk: unsupported wire type {wire}")
        pos = end
    return pb.PullChunk.FromString(raw), memoryview(b"")


def _varint(n: int) -> bytes:
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
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
