"""gRPC servers and channels configured the same way for every rlax_tpu component.

Both ends raise gRPC's 4 MiB message limit to MAX_MESSAGE_BYTES (weight chunks and rollout
batches are large) and authenticate every call with the shared token (rlax_tpu.rpc.auth).
"""

from __future__ import annotations

from concurrent import futures

import grpc

from rlax_tpu.rpc.auth import DEFAULT_AUTH_TOKEN_ENV, AuthChannel, ServerAuthInterceptor

MAX_MESSAGE_BYTES = 256 * 2**20
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A component that restarts is found again within seconds: gRPC's reconnect backoff
    # otherwise grows to 120 s between attempts while it is down.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def format_address(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals in brackets (`[::1]:50051`)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def make_server(
    host: str,
    port: int,
    *,
    auth_token: str,
    auth_token_env: str = DEFAULT_AUTH_TOKEN_ENV,
    max_workers: int = 16,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
) -> tuple[grpc.Server, int]:
    """A gRPC server listening on host:port (0 = any free port) and the port it bound.

    The server is not started: add servicers, then call `server.start()`. Calls without
    `auth_token` are rejected; `auth_token_env` only names the variable in error messages.
    A message sent to it over `max_receive_bytes` fails its call with RESOURCE_EXHAUSTED.
    """
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", min(max_receive_bytes, MAX_MESSAGE_BYTES)),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rlax-rpc"),
        interceptors=[ServerAuthInterceptor(auth_token, env_var=auth_token_env)],
        options=[*options, ("grpc.so_reuseport", 0)],
    )
    address = format_address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"cannot listen on {address}: {e}; pick another port or 0 for any") from e
    if bound == 0:
        raise OSError(f"cannot listen on {address}; pick another port or 0 for any")
    return server, bound


def make_channel(
    address: str, *, auth_token: str, auth_token_env: str = DEFAULT_AUTH_TOKEN_ENV
) -> grpc.Channel:
    """A channel to `address` ("host:port") that sends `auth_token` on every call."""
    channel = grpc.insecure_channel(address, options=_OPTIONS)
    return AuthChannel(channel, auth_token, env_var=auth_token_env)
