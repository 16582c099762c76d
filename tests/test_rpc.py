"""rlax_tpu.rpc over real gRPC on loopback: Health round trip, token auth, large messages,
and waiting out a component that is down or restarting."""

import threading
import time

import grpc
import pytest

from rlax_tpu.rpc import (
    MAX_MESSAGE_BYTES,
    AuthTokenError,
    ComponentUnreachableError,
    HealthServicer,
    auth_token_from_env,
    common_pb2,
    format_address,
    get_status,
    is_unreachable,
    make_channel,
    make_server,
    retry_unreachable,
)

TOKEN = "s3cret-token"
STATUS = {
    "component": "trainer",
    "instance_id": "trainer-0",
    "version": 7,
    "config_digest": "ab" * 32,
    "details": {"step": "12"},
}


@pytest.fixture
def serve():
    """Starts a Health server on 127.0.0.1:<free port> serving `status_fn`; returns its address."""
    servers = []

    def start(status_fn=lambda: STATUS, token=TOKEN):
        server, port = make_server(
            "127.0.0.1", 0, auth_token=token, auth_token_env="MY_TOKEN_ENV", max_workers=2
        )
        HealthServicer(status_fn).add_to_server(server)
        server.start()
        servers.append(server)
        return format_address("127.0.0.1", port)

    start.servers = servers
    yield start
    for server in servers:
        server.stop(grace=None).wait()


def _servers_of(serve):
    """The servers the `serve` fixture started so far (to stop one on purpose)."""
    return serve.servers


def call(address, token):
    with make_channel(address, auth_token=token) as channel:
        return get_status(channel, timeout_s=5)


def test_status_round_trip(serve):
    status = call(serve(), TOKEN)
    assert status == common_pb2.ComponentStatus(**STATUS)


def test_make_server_picks_a_free_port_for_port_zero():
    server, port = make_server("127.0.0.1", 0, auth_token=TOKEN)
    try:
        assert port > 0
    finally:
        server.stop(grace=None)


def test_wrong_token_is_rejected_as_unauthenticated(serve):
    with pytest.raises(grpc.RpcError) as e:
        call(serve(), "not-the-token")
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "wrong" in e.value.details() and "MY_TOKEN_ENV" in e.value.details()


def test_missing_token_is_rejected_as_unauthenticated(serve):
    from rlax_tpu.rpc.protos import common_pb2_grpc

    with grpc.insecure_channel(serve()) as channel:
        with pytest.raises(grpc.RpcError) as e:
            common_pb2_grpc.HealthStub(channel).GetStatus(common_pb2.StatusRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no auth token" in e.value.details() and "MY_TOKEN_ENV" in e.value.details()


def test_message_larger_than_grpc_default_4mib_passes(serve):
    big = "x" * (6 * 2**20)
    status = call(serve(lambda: {**STATUS, "details": {"blob": big}}), TOKEN)
    assert status.details["blob"] == big
    assert MAX_MESSAGE_BYTES >= 256 * 2**20


def test_failing_status_callback_reports_the_error(serve):
    def broken():
        raise KeyError("version")

    with pytest.raises(grpc.RpcError) as e:
        call(serve(broken), TOKEN)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "KeyError" in e.value.details()


def test_empty_token_is_refused_when_building_a_server():
    with pytest.raises(AuthTokenError, match="RLAX_TPU_AUTH_TOKEN"):
        make_server("127.0.0.1", 0, auth_token="")


def test_token_from_env_names_the_variable_when_unset(monkeypatch):
    monkeypatch.delenv("RLAX_TPU_AUTH_TOKEN", raising=False)
    with pytest.raises(AuthTokenError, match="RLAX_TPU_AUTH_TOKEN"):
        auth_token_from_env()
    monkeypatch.setenv("RLAX_TPU_AUTH_TOKEN", TOKEN)
    assert auth_token_from_env() == TOKEN


def echo_handlers():
    """Raw-bytes methods of all four gRPC kinds, to check auth on streaming calls too."""
    return grpc.method_handlers_generic_handler(
        "test.Echo",
        {
            "UnaryUnary": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req),
            "UnaryStream": grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter([req, req])),
            "StreamUnary": grpc.stream_unary_rpc_method_handler(lambda it, ctx: b"".join(it)),
            "StreamStream": grpc.stream_stream_rpc_method_handler(lambda it, ctx: iter(list(it))),
        },
    )


def echo(channel, kind):
    attr = {"UnaryUnary": "unary_unary", "UnaryStream": "unary_stream"}
    attr |= {"StreamUnary": "stream_unary", "StreamStream": "stream_stream"}
    call = getattr(channel, attr[kind])(f"/test.Echo/{kind}")
    result = call(iter([b"a", b"b"]) if kind.startswith("Stream") else b"ab", timeout=5)
    return result if isinstance(result, bytes) else b"".join(result)


@pytest.mark.parametrize("kind", ["UnaryUnary", "UnaryStream", "StreamUnary", "StreamStream"])
def test_every_call_kind_needs_the_token(kind):
    server, port = make_server("127.0.0.1", 0, auth_token=TOKEN, max_workers=2)
    server.add_generic_rpc_handlers((echo_handlers(),))
    server.start()
    try:
        address = format_address("127.0.0.1", port)
        with make_channel(address, auth_token=TOKEN) as channel:
            assert echo(channel, kind) in (b"ab", b"abab")
        with make_channel(address, auth_token="wrong") as channel:
            with pytest.raises(grpc.RpcError) as e:
                echo(channel, kind)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(grace=None).wait()


def test_a_serve_command_on_a_taken_port_says_so_and_binds_nothing(capsys):
    from rlax_tpu.config import RunConfig
    from rlax_tpu.rpc.process import bind_server

    config = RunConfig()
    first = bind_server("trainer", config, "127.0.0.1", 0, auth_token="t", max_workers=2)
    assert first is not None
    server, port = first
    try:
        again = bind_server("verifier", config, "127.0.0.1", port, auth_token="t", max_workers=2)
        assert again is None
        assert (
            f"rlax-tpu serve verifier: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
        )
    finally:
        server.stop(0)


# -- waiting out a component that is down or restarting ----------------------------------------
def test_a_call_waits_for_a_restarted_component_on_its_address_and_then_answers(serve):
    address = serve()
    port = int(address.rsplit(":", 1)[1])
    channel = make_channel(address, auth_token=TOKEN)  # made while it is up, kept across
    assert get_status(channel, timeout_s=5).version == 7
    servers = []

    def restart():
        server, bound = make_server("127.0.0.1", port, auth_token=TOKEN, max_workers=2)
        assert bound == port
        HealthServicer(lambda: {**STATUS, "version": 8}).add_to_server(server)
        server.start()
        servers.append(server)

    # Down: the first server is gone; a replacement binds the same port 1.5 s later.
    stopped = []
    for server in list(_servers_of(serve)):
        server.stop(grace=None).wait()
        stopped.append(server)
    timer = threading.Timer(1.5, restart)
    timer.start()
    heard = []
    try:
        t0 = time.monotonic()
        status = retry_unreachable(
            lambda: get_status(channel, timeout_s=5),
            wait_s=30,
            what="the test server",
            on_retry=heard.append,
        )
        assert status.version == 8 and time.monotonic() - t0 >= 1.0
        assert len(heard) == 1 and "the test server does not answer" in heard[0]
    finally:
        timer.join()
        channel.close()
        for server in servers:
            server.stop(grace=None).wait()


def test_a_component_that_stays_down_is_named_after_the_wait_and_a_refusal_is_not_retried(serve):
    address = serve()
    for server in list(_servers_of(serve)):
        server.stop(grace=None).wait()
    with make_channel(address, auth_token=TOKEN) as channel:
        with pytest.raises(ComponentUnreachableError) as info:
            retry_unreachable(lambda: get_status(channel, timeout_s=2), wait_s=1.0, what="x-42")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and is_unreachable(info.value)
    assert "x-42 has not answered for 1s" in str(info.value)
    assert "controller.component_wait_s" in str(info.value)

    # A run that is stopping does not wait for it at all.
    stop = threading.Event()
    stop.set()
    t0 = time.monotonic()
    with make_channel(address, auth_token=TOKEN) as channel:
        with pytest.raises(ComponentUnreachableError, match="the run is stopping"):
            retry_unreachable(
                lambda: get_status(channel, timeout_s=2), wait_s=60, what="z", stop=stop
            )
    assert time.monotonic() - t0 < 5

    calls = []
    up = serve()

    def refused():
        calls.append(1)
        return call(up, "wrong-token")

    with pytest.raises(grpc.RpcError) as info:
        retry_unreachable(refused, wait_s=30, what="y")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and calls == [1]


def test_the_channel_adds_the_token_once_beside_the_callers_metadata_on_every_call_form():
    """make_channel adds the token to each call without gRPC interceptors: a caller's own
    metadata arrives with it, a token the caller put there is replaced (sent once), and
    `with_call` and `future` carry it too."""
    seen = []

    def record(request, context):
        seen.append([(k, v) for k, v in context.invocation_metadata() if not k.startswith(":")])
        return request

    handler = grpc.method_handlers_generic_handler(
        "test.Md", {"Call": grpc.unary_unary_rpc_method_handler(record)}
    )
    server, port = make_server("127.0.0.1", 0, auth_token=TOKEN, max_workers=2)
    server.add_generic_rpc_handlers((handler,))
    server.start()
    try:
        with make_channel(format_address("127.0.0.1", port), auth_token=TOKEN) as channel:
            call = channel.unary_unary("/test.Md/Call")
            mine = [("x-mine", "1"), ("authorization", "Bearer stale")]
            assert call(b"a", timeout=5, metadata=mine) == b"a"
            assert call.with_call(b"b", timeout=5)[0] == b"b"
            assert call.future(b"c", timeout=5).result() == b"c"
        bearer = ("authorization", f"Bearer {TOKEN}")
        assert [md.count(bearer) for md in seen] == [1, 1, 1]
        assert ("x-mine", "1") in seen[0] and ("authorization", "Bearer stale") not in seen[0]
    finally:
        server.stop(grace=None).wait()
