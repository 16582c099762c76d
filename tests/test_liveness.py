"""rpc/liveness.py's Watch on its own (health checks from a function): a component that
answers is never given up, one that stops answering is given up after the liveness timeout,
a call past its deadline is given up although the component answers, compile time moves the
deadline, and nothing of a given-up call is accepted after the mark. The real processes
(SIGSTOP of workers and a verifier) are in tests/test_controller_e2e.py."""

from __future__ import annotations

import threading
import time

import grpc

from rlax_tpu.rpc.client import is_unreachable
from rlax_tpu.rpc.liveness import ComponentLostError, Watch


class Component:
    """A status function whose answers can be switched off, with a compile clock."""

    def __init__(self) -> None:
        self.answering = True
        self.compile_s = 0.0
        self.asked = 0

    def status(self, timeout_s: float) -> dict[str, str]:
        self.asked += 1
        if not self.answering:
            time.sleep(min(timeout_s, 0.05))
            raise TimeoutError("no answer")
        return {"compile_s": str(self.compile_s)}


def watched(component: Component, **kwargs) -> tuple[Watch, threading.Event]:
    cancelled = threading.Event()
    watch = Watch("worker 7 (127.0.0.1:1)", component.status, **kwargs)
    return watch.start(cancelled.set), cancelled


def test_a_component_that_answers_is_never_given_up():
    component = Component()
    watch, cancelled = watched(component, liveness_s=0.2)
    time.sleep(1.0)
    watch.stop()
    assert component.asked >= 5  # asked every liveness_s / 4
    assert watch.accepts() and not cancelled.is_set()


def test_a_silent_component_is_given_up_after_the_liveness_timeout_and_fenced():
    component = Component()
    watch, cancelled = watched(component, liveness_s=0.2)
    time.sleep(0.3)
    assert watch.accepts()
    component.answering = False
    t0 = time.monotonic()
    assert cancelled.wait(5)
    assert 0.15 <= time.monotonic() - t0 < 2
    assert not watch.accepts()  # nothing of the call is used from here on
    error = watch.error()
    assert isinstance(error, ComponentLostError) and is_unreachable(error)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "worker 7 (127.0.0.1:1) has not answered a health check for" in str(error)
    assert "(controller.liveness_timeout_s = 0.2s)" in str(error)
    component.answering = True  # it wakes up: still given up
    time.sleep(0.2)
    assert not watch.accepts()


def test_a_call_past_its_deadline_is_given_up_although_the_component_answers():
    component = Component()
    watch, cancelled = watched(
        component, liveness_s=0.1, deadline_s=0.5, deadline_why="4 requests, 8 decode steps"
    )
    assert cancelled.wait(5)
    assert "answers its health checks but the call is past its deadline of 0.5s" in watch.lost
    assert watch.lost.endswith(": 4 requests, 8 decode steps")


def test_compile_time_during_the_call_moves_the_deadline():
    component = Component()
    component.compile_s = 100.0  # compiled before the call: not counted
    watch, cancelled = watched(component, liveness_s=0.1, deadline_s=0.6)
    time.sleep(0.2)
    component.compile_s = 101.0  # one second of compiling during the call
    assert not cancelled.wait(1.2)  # 0.6 s + 1 s of compile, not yet over
    assert cancelled.wait(5)
    assert "plus 1s it spent compiling" in watch.lost


def test_a_call_that_ends_first_is_not_given_up():
    component = Component()
    watch, cancelled = watched(component, liveness_s=0.1, deadline_s=0.3)
    watch.stop()
    component.answering = False
    time.sleep(0.8)
    assert watch.accepts() and not cancelled.is_set()


def test_liveness_off_with_no_deadline_starts_no_thread():
    before = threading.active_count()
    watch, _ = watched(Component(), liveness_s=0.0)
    assert threading.active_count() == before
    watch.stop()
