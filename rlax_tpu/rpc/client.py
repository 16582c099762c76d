"""What every component's client shares: one authenticated channel, and errors that
carry the gRPC status so callers can branch on it (e.g. NOT_FOUND vs UNAVAILABLE)."""

from __future__ import annotations

from typing import Self

import grpc

from rlax_tpu.rpc.auth import DEFAULT_AUTH_TOKEN_ENV
from rlax_tpu.rpc.channels import make_channel


class RpcCallError(RuntimeError):
    """A call to a component failed; `code` is its gRPC status (None when unknown)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, what: str) -> Self:
        """`what: CODE: the server's message`, keeping the code."""
        code = error.code() if hasattr(error, "code") else None
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(f"{what}: {code.name if code is not None else 'ERROR'}: {details}", code)


class ComponentClient:
    """An authenticated channel to one component process; close it (or use `with`)."""

    def __init__(
        self,
        address: str,
        *,
        auth_token: str,
        auth_token_env: str = DEFAULT_AUTH_TOKEN_ENV,
        timeout_s: float = 3600.0,
    ) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._channel = make_channel(address, auth_token=auth_token, auth_token_env=auth_token_env)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
