"""The hand-built Publish and Pull messages (rlax_tpu.api.param_server) against protobuf's
own classes, and how bytes are packed into messages."""

from __future__ import annotations

import numpy as np
import pytest

from rlax_tpu.api import param_server as wire
from rlax_tpu.rpc.protos import param_server_pb2 as pb


def _bytes(n: int, seed: int = 0) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def test_piece_chunks_are_what_protobuf_parses():
    chunks = [("layers/0/wq", 0, _bytes(300)), ("embed", 4096, _bytes(5, 1)), ("e", 7, _bytes(0))]
    parsed = pb.PublishRequest.FromString(wire.encode_piece_chunks(42, chunks))
    assert parsed.WhichOneof("kind") == "chunks"
    got = [(c.version, c.path, c.offset, c.data) for c in parsed.chunks.chunks]
    assert got == [(42, p, o, bytes(d)) for p, o, d in chunks]


@pytest.mark.parametrize("kind", ["chunk", "chunks"])
def test_publish_requests_from_protobuf_decode_to_views(kind):
    data = bytes(_bytes(1000))
    chunk = pb.PieceChunk(version=3, path="w", offset=2**40, data=data)
    if kind == "chunk":
        request = pb.PublishRequest(chunk=chunk)
    else:
        request = pb.PublishRequest(chunks=pb.PieceChunks(chunks=[chunk, chunk]))
    decoded = wire.decode_publish_request(request.SerializeToString())
    assert all(isinstance(d, memoryview) for *_, d in decoded)
    expected = [(3, "w", 2**40, data)] * (1 if kind == "chunk" else 2)
    assert [(v, p, o, bytes(d)) for v, p, o, d in decoded] == expected


def test_begin_and_commit_decode_to_messages():
    begin = pb.PublishRequest(begin=pb.PublishBegin(version=5, version_digest="ab"))
    commit = pb.PublishRequest(commit=pb.PublishCommit(version=5))
    assert wire.decode_publish_request(begin.SerializeToString()) == begin
    assert wire.decode_publish_request(commit.SerializeToString()) == commit


def test_pull_chunks_round_trip_both_ways():
    first = pb.PullChunk(version=1, path="a", box=0, offset=0)
    first.info.path, first.info.dtype = "a", "float32"
    later = pb.PullChunk(version=1, path="a", box=2, offset=123)
    data = [_bytes(64), _bytes(0, 1)]
    raw = wire.join_pull_chunks(
        [wire.encode_pull_chunk(h, d) for h, d in zip((first, later), data, strict=True)]
    )
    parsed = pb.PullChunks.FromString(raw)  # protobuf reads ours
    assert [bytes(c.data) for c in parsed.chunks] == [bytes(d) for d in data]
    assert parsed.chunks[0].info.dtype == "float32" and parsed.chunks[1].offset == 123
    decoded = wire.decode_pull_chunks(parsed.SerializeToString())  # we read protobuf's
    assert [(h.path, h.box, h.offset, bytes(d)) for h, d in decoded] == [
        ("a", 0, 0, bytes(data[0])),
        ("a", 2, 123, b""),
    ]
    assert decoded[0][0].info.dtype == "float32" and not decoded[1][0].HasField("info")


def test_truncated_or_mistyped_messages_are_refused():
    raw = wire.encode_piece_chunks(1, [("w", 0, _bytes(100))])
    with pytest.raises(ValueError, match="truncated"):
        wire.decode_publish_request(raw[:-10])
    # A path sent as a number (wire type varint): refused, not read as that many bytes.
    chunk = wire._tag(2, 0) + wire._varint(2**40)
    request = wire._tag(2, 2) + wire._varint(len(chunk)) + chunk
    with pytest.raises(ValueError, match="'path' has the wrong wire type"):
        wire.decode_publish_request(request)


def test_pack_cuts_large_items_and_groups_small_ones_in_order():
    budget = 4096
    items = [("big", _bytes(10_000)), ("s1", _bytes(10)), ("s2", _bytes(20)), ("empty", _bytes(0))]
    messages = list(wire.pack(items, budget))
    # Every byte once, in order, each entry at its offset in its item.
    rebuilt: dict[str, bytearray] = {}
    for message in messages:
        assert sum(len(d) + wire.ENTRY_BYTES for _, _, d in message) <= budget
        for key, offset, data in message:
            assert offset == len(rebuilt.setdefault(key, bytearray()))
            rebuilt[key] += data
    assert {k: bytes(v) for k, v in rebuilt.items()} == {k: bytes(d) for k, d in items}
    assert list(rebuilt) == ["big", "s1", "s2", "empty"]
    # The small items and the tail of the large one share the last message.
    assert [key for key, _, _ in messages[-1]] == ["big", "s1", "s2", "empty"]
    assert len(messages) == -(-10_000 // (budget - wire.ENTRY_BYTES))


def test_pack_makes_progress_with_a_budget_below_the_entry_cost():
    messages = list(wire.pack([("w", _bytes(5))], budget=10))
    assert b"".join(bytes(d) for m in messages for _, _, d in m) == bytes(_bytes(5))
