"""What every component's client shares: one authenticated channel, errors that carry
the gRPC status so callers can branch on it (e.g. NOT_FOUND vs UNAVAILABLE), and waiting
out a component that is down or restarting (`retry_unreachable`).

A component that died, or is starting again, answers nothing: its calls fail with
UNAVAILABLE (connection refused, or the connection broke mid-call). Every other status is
an answer (the component ran and said no), and is never retried here. Calls are idempotent
(DESIGN §2), so calling again once the component is back is always safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Self, TypeVar

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


class ComponentUnreachableError(RpcCallError):
    """A component did not answer (UNAVAILABLE) for as long as its callers wait for it."""


def status_code_for(
    error: BaseException, codes: Mapping[type[BaseException], grpc.StatusCode]
) -> grpc.StatusCode:
    """The status a servicer ends a call with for `error`: that of its nearest class in
    `codes` (a component's table of its errors), else INTERNAL."""
    for cls in type(error).__mro__:
        if cls in codes:
            return codes[cls]
    return grpc.StatusCode.INTERNAL


def is_unreachable(error: BaseException) -> bool:
    """Whether `error` says the component did not answer at all (down, restarting, or its
    connection broke mid-call), as opposed to answering with a refusal."""
    if isinstance(error, RpcCallError):
        code = error.code
    elif isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        code = error.code()
    else:
        return False
    return code == grpc.StatusCode.UNAVAILABLE


T = TypeVar("T")


def retry_unreachable(
    call: Callable[[], T],
    *,
    wait_s: float,
    what: str,
    on_retry: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
) -> T:
    """`call()`, called again while it fails as unreachable, for up to `wait_s` seconds in
    all (backoff 0.2 s doubling to 5 s); then ComponentUnreachableError naming `what` and
    the last error. `on_retry(message)` hears of the first failure (once per outage). Any
    other error is raised at once. `wait_s` = 0: one attempt, its error as it is. Once
    `stop` is set (the run is stopping: nobody will bring the component back), the wait
    ends at once with ComponentUnreachableError."""
    start = time.monotonic()
    delay, told = 0.2, False
    stop = stop or threading.Event()
    while True:
        try:
            return call()
        except (RpcCallError, grpc.RpcError) as e:
            if not is_unreachable(e) or wait_s <= 0:
                raise
            waited = time.monotonic() - start
            if stop.is_set():
                raise ComponentUnreachableError(
                    f"{what} does not answer and the run is stopping; last error: {e}",
                    grpc.StatusCode.UNAVAILABLE,
                ) from None
            if waited >= wait_s:
                raise ComponentUnreachableError(
                    f"{what} has not answered for {waited:.0f}s (the wait for a restarted "
                    f"component, controller.component_wait_s, is {wait_s:g}s); last error: {e}",
                    grpc.StatusCode.UNAVAILABLE,
                ) from None
            if on_retry is not None and not told:
                on_retry(f"{what} does not answer ({e}); waiting up to {wait_s:g}s for it")
                told = True
            stop.wait(min(delay, max(wait_s - waited, 0.0)))
            delay = min(delay * 2, 5.0)


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
