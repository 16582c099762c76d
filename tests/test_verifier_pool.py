"""WorkerPool: real processes, time limits, crashes, recycling, threads, and cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rlax_tpu.verifiers.pool import (
    PoolClosed,
    RemoteTraceback,
    TaskOutOfMemory,
    TaskTimeout,
    WorkerCrashed,
    WorkerPool,
)

# --- tasks (top-level so they pickle by reference) ---------------------------------------


def getpid() -> int:
    return os.getpid()


def add(a: int, b: int) -> int:
    return a + b


def sleep_then_pid(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def raise_value_error(message: str) -> None:
    raise ValueError(message)


class _Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickle rebuilds with args=(message,): fails
        super().__init__(f"{a}/{b}")


def raise_unpicklable() -> None:
    raise _Unpicklable(1, 2)


def exit_abruptly() -> None:
    os._exit(3)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# --- helpers ------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    """The process no longer exists, or is a zombie nobody has reaped yet (it is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def pool():
    with WorkerPool(2, name="test") as p:
        yield p


# --- tests --------------------------------------------------------------------------------


def test_run_returns_the_value_computed_in_a_worker_process(pool):
    assert pool.run(add, 2, 3, timeout_s=10) == 5
    assert pool.run(getpid, timeout_s=10) in pool.pids()
    assert os.getpid() not in pool.pids()


def test_exception_from_task_is_reraised_with_its_type_and_remote_traceback(pool):
    with pytest.raises(ValueError, match="bad input") as info:
        pool.run(raise_value_error, "bad input", timeout_s=10)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "raise_value_error" in str(info.value.__cause__)
    assert pool.run(add, 1, 1, timeout_s=10) == 2


def test_unpicklable_exception_comes_back_as_runtime_error(pool):
    with pytest.raises(RuntimeError, match="_Unpicklable: 1/2"):
        pool.run(raise_unpicklable, timeout_s=10)


def test_unpicklable_task_raises_in_caller_and_worker_stays(pool):
    pids = pool.pids()
    with pytest.raises(Exception, match="pickle|lambda"):
        pool.run(lambda: 1, timeout_s=10)
    assert pool.run(add, 1, 2, timeout_s=10) == 3
    assert pool.pids() == pids
    assert pool.stats()["busy"] == 0


def test_timeout_kills_the_worker_and_a_fresh_one_serves_next():
    with WorkerPool(1, name="test") as pool:
        old_pid = pool.run(getpid, timeout_s=10)
        start = time.monotonic()
        with pytest.raises(TaskTimeout, match="ran past 0.5s"):
            pool.run(sleep_then_pid, 60.0, timeout_s=0.5)
        assert time.monotonic() - start < 2.5
        assert _gone(old_pid)
        new_pid = pool.run(getpid, timeout_s=10)
        assert new_pid != old_pid
        stats = pool.stats()
        assert stats["timeouts"] == 1 and stats["workers"] == 1 and stats["tasks_done"] == 2


@pytest.mark.parametrize("task, detail", [(exit_abruptly, "exit code 3"), (kill_self, "signal 9")])
def test_worker_death_raises_worker_crashed_and_is_replaced(task, detail):
    with WorkerPool(1, name="test") as pool:
        old_pid = pool.run(getpid, timeout_s=10)
        with pytest.raises(WorkerCrashed, match=detail):
            pool.run(task, timeout_s=10)
        assert pool.run(getpid, timeout_s=10) != old_pid
        assert pool.stats()["crashes"] == 1


def test_worker_that_died_while_idle_is_replaced_without_failing_the_task():
    with WorkerPool(1, name="test") as pool:
        (old_pid,) = pool.pids()
        pool.run(getpid, timeout_s=10)
        os.kill(old_pid, signal.SIGKILL)
        assert _wait_gone([old_pid])
        assert pool.run(add, 2, 2, timeout_s=10) == 4
        assert pool.pids() != [old_pid]


def test_a_task_past_the_memory_limit_fails_alone_and_its_worker_is_replaced():
    with WorkerPool(1, name="test", memory_bytes=512 * 2**20) as pool:
        old_pid = pool.run(getpid, timeout_s=10)
        assert len(pool.run(bytearray, 64 * 2**20, timeout_s=10)) == 64 * 2**20
        with pytest.raises(TaskOutOfMemory, match="536870912 bytes"):
            pool.run(bytearray, 2 * 2**30, timeout_s=10)
        assert pool.run(getpid, timeout_s=10) != old_pid
        assert pool.stats()["out_of_memory"] == 1 and pool.stats()["crashes"] == 0
        with pytest.raises(ValueError, match="memory_bytes"):
            WorkerPool(1, memory_bytes=0)


def test_worker_is_recycled_after_max_tasks():
    with WorkerPool(1, max_tasks_per_worker=2, name="test") as pool:
        pids = [pool.run(getpid, timeout_s=10) for _ in range(5)]
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
        assert pool.stats()["recycled"] == 2
        assert _wait_gone([pids[0], pids[2]])


def test_threads_share_the_workers_and_run_in_parallel():
    with WorkerPool(3, name="test") as pool:
        pool.run(getpid, timeout_s=10)  # wait for one start before timing
        results: list[int] = []
        lock = threading.Lock()

        def call() -> None:
            pid = pool.run(sleep_then_pid, 0.4, timeout_s=10)
            with lock:
                results.append(pid)

        start = time.monotonic()
        threads = [threading.Thread(target=call) for _ in range(9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
        assert len(results) == 9
        assert len(set(results)) == 3  # every worker took tasks, no other process did
        assert 1.2 <= elapsed < 3.2  # three rounds of 0.4 s, not nine
        assert pool.stats()["tasks_done"] == 10


def test_timeout_counts_from_handoff_not_from_queue_wait():
    with WorkerPool(1, name="test") as pool:
        pool.run(getpid, timeout_s=10)
        errors: list[BaseException] = []

        def call() -> None:
            try:
                pool.run(sleep_then_pid, 0.6, timeout_s=1.0)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=call) for _ in range(3)]  # 1.8 s in all
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []


def test_close_kills_every_worker_and_is_idempotent():
    pool = WorkerPool(3, name="test")
    pool.run(getpid, timeout_s=10)
    pids = pool.pids()
    assert len(pids) == 3
    pool.close()
    assert _wait_gone(pids, timeout_s=1.0)
    pool.close()
    assert pool.stats()["workers"] == 0
    with pytest.raises(PoolClosed):
        pool.run(getpid, timeout_s=10)


def test_close_ends_a_running_task_with_pool_closed():
    pool = WorkerPool(1, name="test")
    (pid,) = pool.pids()
    pool.run(getpid, timeout_s=10)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            pool.run(sleep_then_pid, 60.0, timeout_s=60)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    pool.close()
    thread.join(5.0)
    assert not thread.is_alive() and time.monotonic() - start < 5.0
    assert len(errors) == 1 and isinstance(errors[0], PoolClosed)
    assert _gone(pid)
    assert pool.stats()["workers"] == 0


_ORPHAN_PARENT = """
import os, sys, threading
from rlax_tpu.verifiers.pool import WorkerPool
sys.path.insert(0, sys.argv[1])
from test_verifier_pool import getpid, sleep_then_pid
pool = WorkerPool(2, name="orphan")
pool.run(getpid, timeout_s=30)
threading.Thread(target=pool.run, args=(sleep_then_pid, 60.0), kwargs={"timeout_s": 60}).start()
print(" ".join(map(str, pool.pids())), flush=True)
threading.Event().wait()
"""


def test_workers_exit_when_the_parent_dies_even_mid_task():
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_PARENT, os.path.dirname(__file__)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(0.3)  # one worker is now inside the 60 s task
        assert not any(_gone(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    assert _wait_gone(pids, timeout_s=5.0)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="num_workers"):
        WorkerPool(0)
    with WorkerPool(1, name="test") as pool, pytest.raises(ValueError, match="timeout_s"):
        pool.run(getpid, timeout_s=0)
