"""Shared-token authentication for every rlax_tpu gRPC service (DESIGN.md §3).

Clients send `authorization: Bearer <token>` metadata on each call; servers reject calls
without the right token as UNAUTHENTICATED. The token comes from an environment variable
named by the config (`param_server.auth_token_env`).
"""

from __future__ import annotations

import collections
import hmac
import os
from collections.abc import Callable
from typing import Any

import grpc

DEFAULT_AUTH_TOKEN_ENV = "RLAX_TPU_AUTH_TOKEN"
_METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
_SCHEME = "Bearer "


class AuthTokenError(RuntimeError):
    """No usable auth token is configured; the message names the variable to set."""


def auth_token_from_env(env_var: str = DEFAULT_AUTH_TOKEN_ENV) -> str:
    """The shared token from `env_var` (config: `param_server.auth_token_env`)."""
    token = os.environ.get(env_var, "")
    if not token:
        raise AuthTokenError(
            f"environment variable {env_var} (param_server.auth_token_env) is unset or empty; "
            f"set it to the same secret for every component, e.g. "
            f"`export {env_var}=$(python -c 'import secrets; print(secrets.token_hex(16))')`"
        )
    return token


def check_token(token: str, *, env_var: str = DEFAULT_AUTH_TOKEN_ENV) -> str:
    """`token` if it is usable, else an AuthTokenError that names `env_var`."""
    if not isinstance(token, str) or not token or token != token.strip():
        raise AuthTokenError(
            f"the auth token must be a non-empty string without surrounding whitespace; "
            f"check environment variable {env_var} (param_server.auth_token_env)"
        )
    return token


class ServerAuthInterceptor(grpc.ServerInterceptor):
    """Rejects every call whose bearer token is missing or wrong with UNAUTHENTICATED."""

    def __init__(self, token: str, *, env_var: str = DEFAULT_AUTH_TOKEN_ENV) -> None:
        self._expected = (_SCHEME + check_token(token, env_var=env_var)).encode()
        self._env_var = env_var

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get(_METADATA_KEY)
        if sent is not None and hmac.compare_digest(str(sent).encode(), self._expected):
            return handler
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None
        reason = "no auth token was sent" if sent is None else "the auth token is wrong"
        return _deny(handler, f"{reason}: clients must send the shared token from {self._env_var}")


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED."""

    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort, **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort, **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort, **serializers)
    return grpc.stream_stream_rpc_method_handler(abort, **serializers)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class ClientAuthInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every outgoing call."""

    def __init__(self, token: str, *, env_var: str = DEFAULT_AUTH_TOKEN_ENV) -> None:
        self._header = (_METADATA_KEY, _SCHEME + check_token(token, env_var=env_var))

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [(k, v) for k, v in (details.metadata or ()) if k != _METADATA_KEY]
        return _CallDetails(
            details.method,
            details.timeout,
            [*metadata, self._header],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)
