"""The parameter server as a real process on loopback: raw gRPC publish/pull, auth, bad input,
broken clients, sharded pulls and SIGKILL-and-restart on disk and on gs:// (emulator)."""

import threading
import time
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
from processes import ProcessGroup

from rlax_tpu import storage
from rlax_tpu.api import param_server as wire
from rlax_tpu.api import tensors as layout
from rlax_tpu.api.param_server import decode_pull_chunks
from rlax_tpu.cli import build_parser
from rlax_tpu.cli import main as cli_main
from rlax_tpu.config import ConfigError, load_config
from rlax_tpu.param_server.server import options_from_args
from rlax_tpu.rpc import get_status, make_channel
from rlax_tpu.rpc.protos import param_server_pb2 as pb
from rlax_tpu.rpc.protos import param_server_pb2_grpc as pb_grpc

TOKEN = "test-token-123"


def tree(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.integers(0, 2**16, (16, 40), dtype=np.uint16).view(ml_dtypes.bfloat16),
        "layers/0/wq": rng.standard_normal((8, 6)).astype(np.float32),
        "step": np.array(seed, np.int32),
    }


def publish_requests(version, arrays, *, chunk_bytes=500, stall=None):
    """The PublishRequest stream for `arrays` (whole pieces). With `stall=(sent, release)`, it
    stops after the first piece and one chunk of the second, sets `sent` and blocks."""
    pieces = [
        layout.Piece(
            path,
            layout.dtype_name(a.dtype),
            a.shape,
            layout.full_box(a.shape),
            layout.digest_bytes(layout.to_bytes(a)),
        )
        for path, a in arrays.items()
    ]
    begin = pb.PublishBegin(version=version, version_digest=layout.version_digest(pieces))
    for piece in pieces:
        layout.piece_to_proto(piece, begin.pieces.add())
    yield pb.PublishRequest(begin=begin)
    for i, (path, a) in enumerate(arrays.items()):
        data = layout.to_bytes(a)
        for offset in range(0, len(data), chunk_bytes):
            piece_bytes = bytes(data[offset : offset + chunk_bytes])
            chunk = pb.PieceChunk(version=version, path=path, offset=offset, data=piece_bytes)
            yield pb.PublishRequest(chunk=chunk)
            if stall and i == 1:
                sent, release = stall
                sent.set()
                release.wait(60)
                raise RuntimeError("the client dies")
    yield pb.PublishRequest(commit=pb.PublishCommit(version=version))


def pull(stub, version, select=()):
    """{(path, box index): (Piece info of the box, its bytes)}, checking offsets as they come."""
    request = pb.PullRequest(version=version)
    for path, boxes in select:
        selection = request.select.add(path=path)
        for box in boxes:
            layout.box_to_proto(box, selection.domains.add())
    out = {}
    chunks = (chunk for message in stub.Pull(request, timeout=30) for chunk in message.chunks)
    for chunk in chunks:
        key = (chunk.path, chunk.box)
        if chunk.HasField("info"):
            out[key] = (layout.piece_from_proto(chunk.info), bytearray())
        info, data = out[key]
        assert chunk.offset == len(data)
        data += chunk.data
    return out


def assert_pulled(stub, version, arrays):
    got = pull(stub, version)
    assert sorted(path for path, _ in got) == sorted(arrays)
    for (path, _), (info, data) in got.items():
        assert bytes(data) == bytes(layout.to_bytes(arrays[path])), path
        assert info.digest == layout.digest_bytes(data)
        assert info.domain == layout.full_box(arrays[path].shape)


def stub_for(address, token=TOKEN):
    return pb_grpc.ParamServerStub(make_channel(address, auth_token=token))


def listed(stub):
    return [v.version for v in stub.ListVersions(pb.ListVersionsRequest(), timeout=10).versions]


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def servers():
    group = ProcessGroup()
    yield group
    group.stop_all()


@pytest.fixture(scope="module")
def shared(servers, tmp_path_factory):
    """One server for the tests that leave it as they found it; version 0 published."""
    root = tmp_path_factory.mktemp("params")
    process = servers.start_param_server(str(root), token=TOKEN, args=["--chunk-bytes", "1024"])
    stub = stub_for(process.address)
    assert stub.Publish(publish_requests(0, tree(0)), timeout=30).version == 0
    stub.WaitPersisted(pb.WaitPersistedRequest(versions=[0], timeout_s=30), timeout=40)
    return process, stub, root


def test_publish_then_pull_round_trip_is_bit_exact(shared):
    process, stub, _ = shared
    assert_pulled(stub, 0, tree(0))  # embed is 1280 bytes: two 1024-byte chunks
    reply = stub.ListVersions(pb.ListVersionsRequest(), timeout=10)
    assert [(v.version, v.in_memory, v.persisted) for v in reply.versions] == [(0, True, True)]
    assert [p.path for p in reply.layout] == sorted(tree(0))
    with make_channel(process.address, auth_token=TOKEN) as channel:
        assert get_status(channel).version == 0


def test_pull_chunks_decode_without_protobuf_copies(shared):
    """The fast client path: data as a view into the received message (decode_pull_chunks)."""
    process, _, _ = shared
    with make_channel(process.address, auth_token=TOKEN) as channel:
        call = channel.unary_stream(
            "/rlax_tpu.v1.ParamServer/Pull",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=decode_pull_chunks,
        )
        got = {}
        for message in call(pb.PullRequest(version=0), timeout=30):
            for header, data in message:
                assert isinstance(data, memoryview)
                assert header.offset == len(got.setdefault(header.path, bytearray()))
                got[header.path] += data
    assert {p: bytes(d) for p, d in got.items()} == {
        p: bytes(layout.to_bytes(a)) for p, a in tree(0).items()
    }


def test_a_malformed_publish_message_is_invalid_argument_and_stores_nothing(shared):
    """A chunk whose path is sent as a number, after a good begin: refused naming the field,
    and the version does not appear."""
    process, stub, _ = shared
    begin = next(publish_requests(9, tree(9)))
    chunk = wire._tag(2, 0) + wire._varint(5)  # PieceChunk.path as a varint
    malformed = wire._tag(2, 2) + wire._varint(len(chunk)) + chunk
    with make_channel(process.address, auth_token=TOKEN) as channel:
        call = channel.stream_unary(
            "/rlax_tpu.v1.ParamServer/Publish",
            request_serializer=lambda b: b,
            response_deserializer=pb.PublishReply.FromString,
        )
        with pytest.raises(grpc.RpcError) as e:
            call(iter([begin.SerializeToString(), malformed]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed PublishRequest" in e.value.details() and "'path'" in e.value.details()
    assert 9 not in listed(stub)


def test_republish_is_a_noop_and_other_content_is_already_exists(shared):
    _, stub, _ = shared
    again = stub.Publish(publish_requests(0, tree(0)), timeout=30)
    assert again.already_present
    with pytest.raises(grpc.RpcError) as e:
        stub.Publish(publish_requests(0, tree(1)), timeout=30)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "version 0 exists" in e.value.details()
    assert_pulled(stub, 0, tree(0))


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_missing_or_wrong_token_is_unauthenticated_and_changes_nothing(servers, tmp_path, token):
    """Versions 0 and 1 with a consumer that no longer needs 0: a GC would delete version 0
    and a Confirm would move the consumer, so each refused call is one that could change
    something."""
    process = servers.start_param_server(str(tmp_path), token=TOKEN)
    stub = stub_for(process.address)
    for v in (0, 1):
        stub.Publish(publish_requests(v, tree(v)), timeout=30)
    stub.WaitPersisted(pb.WaitPersistedRequest(versions=[0, 1], timeout_s=30), timeout=40)
    stub.Confirm(pb.ConfirmRequest(consumer="worker-0", oldest_needed=1), timeout=10)

    def state():
        reply = stub.ListVersions(pb.ListVersionsRequest(), timeout=10)
        versions = [(v.version, v.version_digest) for v in reply.versions]
        on_disk = sorted(p.name for p in (tmp_path / "versions").iterdir())
        return versions, dict(reply.consumers), on_disk, (tmp_path / "CONSUMERS.json").read_text()

    before = state()
    assert [v for v, _ in before[0]] == [0, 1] and before[1] == {"worker-0": 1}
    if token is None:
        bare = pb_grpc.ParamServerStub(grpc.insecure_channel(process.address))
    else:
        bare = stub_for(process.address, token)
    for call in (
        lambda: bare.GarbageCollect(pb.GarbageCollectRequest(oldest_needed=2), timeout=10),
        lambda: bare.Confirm(pb.ConfirmRequest(consumer="worker-0", oldest_needed=0), timeout=10),
        lambda: bare.Confirm(pb.ConfirmRequest(consumer="intruder", oldest_needed=0), timeout=10),
        lambda: bare.Publish(publish_requests(2, tree(2)), timeout=10),
        lambda: list(bare.Pull(pb.PullRequest(version=0), timeout=10)),
        lambda: bare.ListVersions(pb.ListVersionsRequest(), timeout=10),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert state() == before
    assert_pulled(stub, 0, tree(0))
    # The same GC with the token does delete version 0: the refusal above is what kept it.
    reply = stub.GarbageCollect(pb.GarbageCollectRequest(oldest_needed=2), timeout=10)
    assert list(reply.deleted) == [0]
    assert listed(stub) == [1]
    assert not (tmp_path / "versions" / "0000000000").exists()
    assert process.stop() == 0


def test_layout_mismatch_is_invalid_argument_naming_the_array(shared):
    _, stub, root = shared
    bad = {**tree(51), "layers/0/wq": tree(51)["layers/0/wq"].astype(np.float16)}
    with pytest.raises(grpc.RpcError) as e:
        stub.Publish(publish_requests(51, bad), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'layers/0/wq'" in e.value.details() and "float16" in e.value.details()
    assert listed(stub) == [0]
    assert not (root / "versions" / "0000000051").exists()


def test_pull_of_half_a_tensor_sharded_array_returns_only_those_bytes(shared):
    _, stub, _ = shared
    wq = tree(0)["layers/0/wq"]
    half = ((0, 8), (3, 6))  # tensor parallelism 2: the second half of the columns
    [(key, (info, data))] = pull(stub, 0, [("layers/0/wq", [half])]).items()
    assert key == ("layers/0/wq", 0) and info.domain == half and info.shape == (8, 6)
    assert bytes(data) == wq[:, 3:].tobytes() and len(data) == wq.nbytes // 2
    assert info.digest == layout.digest_bytes(data)
    with pytest.raises(grpc.RpcError) as e:
        pull(stub, 0, [("layers/0/wq", [((0, 8), (3, 7))])])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "[(0, 8), (0, 6)]" in e.value.details()


def test_a_client_that_breaks_off_mid_publish_leaves_no_version(shared):
    _, stub, root = shared
    sent, release = threading.Event(), threading.Event()
    release.set()  # die right after the partial send
    with pytest.raises(grpc.RpcError):
        stub.Publish(publish_requests(52, tree(52), stall=(sent, release)), timeout=30)
    assert sent.is_set()
    wait_for(lambda: not (root / "versions" / "0000000052").exists())
    assert listed(stub) == [0]

    def republish():
        try:
            return stub.Publish(publish_requests(52, tree(52)), timeout=30)
        except grpc.RpcError as e:  # the server may still be aborting the broken stream
            if e.code() != grpc.StatusCode.ABORTED:
                raise
            return None

    deadline = time.monotonic() + 10
    while (reply := republish()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert reply is not None and not reply.already_present
    assert_pulled(stub, 52, tree(52))
    assert stub.GarbageCollect(pb.GarbageCollectRequest(oldest_needed=0)).deleted == []


def test_unknown_or_collected_version_is_not_found_naming_oldest_and_newest(servers):
    process = servers.start_param_server(None, token=TOKEN, args=["--hot-versions", "5"])
    stub = stub_for(process.address)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Pull(pb.PullRequest(version=0), timeout=10))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no versions are available" in e.value.details()
    for v in range(3):
        stub.Publish(publish_requests(v, tree(v)), timeout=30)
    stub.WaitPersisted(pb.WaitPersistedRequest(versions=[0, 1], timeout_s=30), timeout=40)
    stub.Confirm(pb.ConfirmRequest(consumer="worker-0", oldest_needed=1), timeout=10)
    assert list(stub.GarbageCollect(pb.GarbageCollectRequest(oldest_needed=2)).deleted) == [0]
    assert dict(stub.ListVersions(pb.ListVersionsRequest()).consumers) == {"worker-0": 1}
    for version in (0, 9):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Pull(pb.PullRequest(version=version), timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "oldest 1 to newest 2" in e.value.details()
    assert process.stop() == 0  # SIGTERM: graceful, exit status 0


def kill_and_restart(servers, storage_url, version_exists):
    """Publish 0-2, SIGKILL the server in the middle of publishing 3, restart on the same
    storage: 0-2 come back bit-exact, 3 is gone without a trace and can be published.
    (Storage is written only after a commit; a version killed half-way through its storage
    writes is tests/test_param_server_store.py's restart test.)"""
    first = servers.start_param_server(storage_url, token=TOKEN, args=["--hot-versions", "2"])
    stub = stub_for(first.address)
    for v in range(3):
        stub.Publish(publish_requests(v, tree(v)), timeout=30)
    # A publish returns with the memory copy; 0-2 must be on storage before the kill.
    waited = stub.WaitPersisted(pb.WaitPersistedRequest(versions=[0, 1, 2, 7], timeout_s=30))
    assert waited.persistent and list(waited.persisted) == [0, 1, 2]
    assert list(waited.missing) == [7] and not waited.persist_error
    sent, release = threading.Event(), threading.Event()
    broken = stub.Publish.future(publish_requests(3, tree(3), stall=(sent, release)), timeout=60)
    try:
        wait_for(sent.is_set)
        time.sleep(0.2)  # the server has the first piece whole
        assert not version_exists(3)  # nothing goes to storage before the commit
        first.kill()
    finally:
        release.set()
    with pytest.raises(grpc.RpcError):
        broken.result()

    second = servers.start_param_server(storage_url, token=TOKEN, args=["--hot-versions", "2"])
    stub = stub_for(second.address)
    assert listed(stub) == [0, 1, 2]
    assert not version_exists(3)
    for v in range(3):
        assert_pulled(stub, v, tree(v))
    stub.Publish(publish_requests(3, tree(3)), timeout=30)
    assert_pulled(stub, 3, tree(3))
    assert second.stop() == 0


def test_kill_and_restart_on_disk(servers, tmp_path):
    kill_and_restart(
        servers, str(tmp_path), lambda v: (tmp_path / "versions" / f"{v:010d}").exists()
    )


def test_kill_and_restart_on_a_file_url(servers, tmp_path):
    url = f"file://{tmp_path}/params"  # file:///tmp/...: the same files as the plain path
    kill_and_restart(
        servers, url, lambda v: (tmp_path / "params" / "versions" / f"{v:010d}").exists()
    )
    assert (tmp_path / "params" / "LAYOUT.json").exists()


def test_kill_and_restart_on_gcs(servers, gcs_bucket):
    url = f"{gcs_bucket}/run/params"  # the emulator's env vars reach the server via os.environ
    kill_and_restart(servers, url, lambda v: storage.exists(f"{url}/versions/{v:010d}"))


def test_server_refuses_to_start_without_a_token(monkeypatch, capsys):
    monkeypatch.delenv("RLAX_TPU_AUTH_TOKEN", raising=False)
    assert cli_main(["serve", "param-server", "--memory-only"]) == 2
    assert "RLAX_TPU_AUTH_TOKEN" in capsys.readouterr().err


def test_server_needs_storage_or_a_config(monkeypatch, capsys):
    monkeypatch.setenv("RLAX_TPU_AUTH_TOKEN", TOKEN)
    assert cli_main(["serve", "param-server"]) == 2
    assert "--storage" in capsys.readouterr().err


def test_flags_override_the_config_and_storage_defaults_to_the_run_dir():
    parse = build_parser().parse_args
    tiny = str(Path(__file__).resolve().parent / "tiny_components_config.py")
    args = parse(
        ["serve", "param-server", tiny, "--set", "storage.run_dir=/r", "--hot-versions", "7"]
    )
    options = options_from_args(args)
    assert (options.storage_url, options.hot_versions, options.host) == (
        "/r/params",
        7,
        "127.0.0.1",
    )
    assert options.config_digest == load_config(tiny, ["storage.run_dir=/r"]).digest()
    args = parse(["serve", "param-server", "--storage", "gs://b/p", "--num-replicas", "2"])
    options = options_from_args(args)
    assert (options.storage_url, options.num_replicas, options.replica) == ("gs://b/p", 2, 0)
    for bad, field in (
        (["--replica", "1"], "--replica"),
        (["--hot-versions", "0"], "hot_versions"),
    ):
        with pytest.raises(ConfigError, match=field):
            options_from_args(parse(["serve", "param-server", "--storage", "x", *bad]))


def test_a_stopped_server_exits_with_the_code_it_was_given():
    """`--stopped-exit-code`: what GKE's replaceable servers exit with after SIGTERM, so a
    stopped server is a failed pod (replaced), not a completed one."""
    group = ProcessGroup()
    try:
        stopped = group.start_param_server(None, token=TOKEN, args=["--stopped-exit-code=143"])
        assert stopped.stop(timeout_s=60) == 143
        default = group.start_param_server(None, token=TOKEN)
        assert default.stop(timeout_s=60) == 0
    finally:
        group.stop_all()
