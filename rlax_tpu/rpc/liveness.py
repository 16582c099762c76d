"""Liveness, not only reachability: a long call to a component is watched while it runs.

A component that died fails its calls with UNAVAILABLE at once, and every caller already
treats that as a lost component (its work moves, or the caller waits for it to come back).
A frozen one (SIGSTOP, a hung host, a wedged process that still holds its socket) answers
nothing and fails nothing: without a watch, a call to it waits out the gRPC deadline, an hour.

`Watch` runs beside one such call: it asks the component's health service for its status
every few seconds, and when the component has not answered for `liveness_s`, or the call is
past `deadline_s` (derived by the caller from the work the call carries: tokens to generate,
requests to judge), it marks the call lost and cancels it. The call then raises
`ComponentLostError`, whose code is UNAVAILABLE, so the callers' existing elastic paths
take over unchanged: the generation pool requeues the unfinished requests and waits for the
worker to answer again, the verifier client tries the next service or waits for one.

Fencing: nothing from a call marked lost is used after the mark (`Watch.accepts()`), so a
frozen worker that wakes up cannot hand in late answers; its requests were requeued, and a
request's result does not depend on who computes it (request ids fix the PRNG keys; verdicts
are functions of the request), so the run's results do not depend on when it woke.

A worker's compile time does not count against the deadline: its status reports the
seconds it has spent compiling (`compile_s`), and the deadline moves by what it compiled
during the call.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from rlax_tpu.rpc.client import RpcCallError

LIVENESS_KNOB = "controller.liveness_timeout_s"


class ComponentLostError(RpcCallError):
    """A watched call was given up: its component stopped answering health checks, or the
    call ran past its deadline. UNAVAILABLE, as a component that died: its work moves."""

    def __init__(self, message: str) -> None:
        super().__init__(message, grpc.StatusCode.UNAVAILABLE)


class Watch:
    """Health checks of one component while one call to it runs.

    `status(timeout_s)` asks the component for its status details (a mapping; raising when it
    does not answer). `what` names the component in messages ("inference worker 1
    (127.0.0.1:5001)"); `deadline_why` says where `deadline_s` came from. `liveness_s` = 0
    turns the health checks off (the deadline still holds; math.inf: none)."""

    def __init__(
        self,
        what: str,
        status: Callable[[float], Mapping[str, str]],
        *,
        liveness_s: float,
        deadline_s: float = math.inf,
        deadline_why: str = "",
    ) -> None:
        self.what, self.status = what, status
        self.liveness_s, self.deadline_s, self.deadline_why = liveness_s, deadline_s, deadline_why
        self.lost: str | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._cancel: Callable[[], Any] | None = None

    # -- the caller's side -----------------------------------------------------------------
    def start(self, cancel: Callable[[], Any]) -> Watch:
        """Watch from now on; `cancel()` ends the call when it is given up."""
        self._cancel = cancel
        if self.liveness_s > 0 or math.isfinite(self.deadline_s):
            threading.Thread(target=self._loop, daemon=True, name=f"watch {self.what}").start()
        return self

    def stop(self) -> None:
        """The call ended (its thread exits within one health check)."""
        self._done.set()

    def accepts(self) -> bool:
        """Whether an answer of the call that arrives now may be used: not once it is lost."""
        with self._lock:
            return self.lost is None

    def error(self) -> ComponentLostError:
        return ComponentLostError(self.lost or f"{self.what}: the call was given up")

    # -- the watching thread -----------------------------------------------------------------
    def _loop(self) -> None:
        t0 = last_answer = time.monotonic()
        every = min(5.0, max(0.05, self.liveness_s / 4)) if self.liveness_s > 0 else 1.0
        compiled_at_start: float | None = None
        compiled = 0.0  # seconds the component spent compiling since the watch began
        while not self._done.wait(every):
            if self.liveness_s > 0:
                details = self._ask()
                now = time.monotonic()
                if details is not None:
                    last_answer = now
                    seconds = _number(details.get("compile_s"))
                    if seconds is not None:
                        if compiled_at_start is None:
                            compiled_at_start = seconds
                        compiled = seconds - compiled_at_start
                elif now - last_answer >= self.liveness_s:
                    self._give_up(
                        f"{self.what} has not answered a health check for "
                        f"{_seconds(now - last_answer)} ({LIVENESS_KNOB} = {self.liveness_s:g}s)"
                    )
                    return
            if self._done.is_set():
                return
            elapsed = time.monotonic() - t0
            if elapsed >= self.deadline_s + compiled:
                why = f": {self.deadline_why}" if self.deadline_why else ""
                extra = f", plus {compiled:.0f}s it spent compiling" if compiled >= 1 else ""
                self._give_up(
                    f"{self.what} answers its health checks but the call is past its deadline "
                    f"of {_seconds(self.deadline_s)}{extra}{why}"
                )
                return

    def _ask(self) -> Mapping[str, str] | None:
        try:
            return self.status(self.liveness_s)
        except Exception:  # noqa: BLE001 - no answer, whatever the reason
            return None

    def _give_up(self, reason: str) -> None:
        with self._lock:
            if self._done.is_set():
                return  # the call ended meanwhile: nothing to give up
            self.lost = reason
        if self._cancel is not None:
            self._cancel()


def _seconds(x: float) -> str:
    return f"{x:.0f}s" if x >= 10 else f"{x:.1f}s"


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
