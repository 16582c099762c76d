"""A pool of worker processes that run one task at a time each, with a time limit per task.

Verifiers run untrusted or hang-prone work (sympy on a model's answer, task scorers) here:
a task past its time limit gets its worker SIGKILLed and replaced, a worker that dies is
replaced, and every worker is recycled after `max_tasks_per_worker` tasks. Workers are
fresh interpreters ("spawn"), never forks of the multithreaded JAX parent. With
`memory_bytes`, each worker's address space is capped (RLIMIT_AS): a task that runs out of
it raises TaskOutOfMemory and its worker is replaced.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import resource
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeVar

T = TypeVar("T")

# How long a new worker may take to start (interpreter + `preload` imports) before the
# task that waits for it is failed with WorkerCrashed.
_START_TIMEOUT_S = 60.0
# How long a recycled worker gets to exit on its own before it is killed.
_RETIRE_TIMEOUT_S = 2.0
# The worker checks this often whether its parent is still alive (a worker busy in a
# long computation does not notice its pipe closing).
_PARENT_CHECK_S = 0.5
# How many workers in a row may turn out dead when handed a task before run() gives up.
_SEND_ATTEMPTS = 3


class TaskTimeout(Exception):
    """The task ran past `timeout_s`; its worker was killed and replaced."""


class WorkerCrashed(Exception):
    """The worker died (segfault, OOM kill, os._exit) running the task; it was replaced."""


class TaskOutOfMemory(Exception):
    """The task ran out of the worker's memory limit; the worker was replaced."""


class PoolClosed(RuntimeError):
    """`run` was called on (or was running when) the pool was closed."""


class _NotStarted(Exception):
    """The worker died before it took the task (so the task can go to another worker)."""


class RemoteTraceback(Exception):
    """Carries the worker's formatted traceback as the `__cause__` of a re-raised error."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n--- traceback in the worker process ---\n{self.tb}"


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(_PARENT_CHECK_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(
    conn: Connection,
    parent_pid: int,
    preload: Sequence[str],
    memory_bytes: int | None,
    initializer: tuple[Callable[..., Any], tuple[Any, ...]] | None = None,
) -> None:
    """Runs in the worker: a pickled (fn, args) in, ("started",) and then ("ok", value),
    ("error", exc, tb) or ("memory", tb) out; exits on an empty message, on EOF of the pipe,
    when the parent process is gone, or after a MemoryError (its heap may be unusable)."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        if memory_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        for module in preload:
            importlib.import_module(module)
        if initializer is not None:
            initializer[0](*initializer[1])
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not message:
            return
        # Tells the parent the task reached a live worker: EOF before this means the worker
        # was already dead (killed while idle) and the task can safely go to another one.
        conn.send(("started",))
        try:
            fn, args = pickle.loads(message)
            reply: tuple[Any, ...] = ("ok", fn(*args))
        except MemoryError:
            reply = ("memory", traceback.format_exc(limit=-8))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            reply = ("error", _portable(exc), traceback.format_exc())
        try:
            conn.send(reply)
        except Exception as exc:  # the return value would not pickle
            conn.send(("error", _portable(exc), traceback.format_exc()))
        if reply[0] == "memory":
            return


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle round trip, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__qualname__}: {exc}")


class _Worker:
    def __init__(
        self,
        context: Any,
        name: str,
        preload: Sequence[str],
        memory_bytes: int | None,
        initializer: tuple[Callable[..., Any], tuple[Any, ...]] | None = None,
    ) -> None:
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_worker_main,
            args=(child_conn, os.getpid(), tuple(preload), memory_bytes, initializer),
            name=name,
            daemon=True,
        )
        self.process.start()
        child_conn.close()  # the parent keeps only its end, so EOF is seen when the worker dies
        self.ready = False
        self.tasks_done = 0

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self, timeout_s: float) -> None:
        """Blocks until the worker has imported its preload modules; WorkerCrashed if not."""
        if self.ready:
            return
        detail = f"did not start within {timeout_s:.0f}s"
        try:
            if self.conn.poll(timeout_s):
                message = self.conn.recv()
                if message[0] == "ready":
                    self.ready = True
                    return
                detail = f"failed to start:\n{message[1]}"
        except (EOFError, OSError):
            detail = f"died while starting (exit code {self._exit_code()})"
        raise WorkerCrashed(f"worker {self.process.name} {detail}")

    def _exit_code(self) -> int | None:
        self.process.join(1.0)
        return self.process.exitcode

    def kill(self) -> int | None:
        """SIGKILL, reap, and close the pipe; returns the exit code."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)
        self.conn.close()
        return self.process.exitcode

    def retire(self) -> None:
        """Asks the worker to exit; kills it if it does not."""
        try:
            self.conn.send_bytes(b"")
        except OSError:
            pass
        self.process.join(_RETIRE_TIMEOUT_S)
        self.kill()


def _task_name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", fn))


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}"


class WorkerPool:
    """`num_workers` processes; `run(fn, *args, timeout_s=...)` runs fn in an idle one.

    Workers start eagerly in the constructor (without waiting for them: a task that finds a
    worker still starting waits for it, which counts as queue time, not task time) and a
    replacement starts as soon as a worker is killed, crashes or is recycled. `preload`
    names modules each worker imports before it takes tasks (e.g. sympy's users), so a
    task's time limit is not spent importing; then `initializer(*initargs)` runs (a
    picklable top-level function; if it raises, the worker fails to start). `memory_bytes`
    caps each worker's address space (None: no cap). Thread-safe; a context manager.
    """

    def __init__(
        self,
        num_workers: int,
        *,
        max_tasks_per_worker: int = 100,
        name: str = "verifier",
        preload: Sequence[str] = (),
        memory_bytes: int | None = None,
        initializer: Callable[..., Any] | None = None,
        initargs: tuple[Any, ...] = (),
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if max_tasks_per_worker < 1:
            raise ValueError(f"max_tasks_per_worker must be >= 1, got {max_tasks_per_worker}")
        self.num_workers = num_workers
        self.max_tasks_per_worker = max_tasks_per_worker
        self.name = name
        if memory_bytes is not None and memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be > 0 or None, got {memory_bytes}")
        self._preload = tuple(preload)
        self._initializer = None if initializer is None else (initializer, tuple(initargs))
        self.memory_bytes = memory_bytes
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Condition()
        self._closed = False
        self._serial = 0
        self._idle: list[_Worker] = []
        self._workers: set[_Worker] = set()
        self._counts = {
            "tasks_done": 0,
            "timeouts": 0,
            "crashes": 0,
            "out_of_memory": 0,
            "recycled": 0,
        }
        with self._lock:
            for _ in range(num_workers):
                self._idle.append(self._start_worker_locked())

    def _start_worker_locked(self) -> _Worker:
        self._serial += 1
        worker = _Worker(
            self._context,
            f"{self.name}-worker-{self._serial}",
            self._preload,
            self.memory_bytes,
            self._initializer,
        )
        self._workers.add(worker)
        return worker

    def _acquire(self) -> _Worker:
        with self._lock:
            while not self._idle and not self._closed:
                self._lock.wait()
            if self._closed:
                raise PoolClosed(f"worker pool {self.name!r} is closed")
            return self._idle.pop()

    def _release(self, worker: _Worker) -> None:
        with self._lock:
            if self._closed:
                worker.kill()
                self._workers.discard(worker)
            else:
                self._idle.append(worker)
            self._lock.notify()

    def _replace(self, worker: _Worker, *, counter: str | None) -> int | None:
        """Kills (or retires) `worker` and puts a fresh one in its place; returns its exit code."""
        code = worker.retire() if counter == "recycled" else worker.kill()
        with self._lock:
            self._workers.discard(worker)
            if counter is not None:
                self._counts[counter] += 1
            if not self._closed:
                self._idle.append(self._start_worker_locked())
            self._lock.notify()
        return code

    def run(self, fn: Callable[..., T], *args: Any, timeout_s: float) -> T:
        """Runs `fn(*args)` in a worker and returns its value; blocks until done.

        `fn` must be a picklable top-level function. Raises TaskTimeout when the task runs
        past `timeout_s` (counted from when a worker takes it), TaskOutOfMemory when it runs
        out of `memory_bytes`, WorkerCrashed when the worker dies, PoolClosed after
        `close()`, and re-raises what `fn` raised (the same type when it pickles, else
        RuntimeError), with the worker's traceback as its `__cause__`.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        for attempt in range(1, _SEND_ATTEMPTS + 1):
            worker = self._acquire()
            try:
                worker.wait_ready(_START_TIMEOUT_S)
            except WorkerCrashed:
                if self._closed:
                    self._replace(worker, counter=None)
                    raise PoolClosed(f"worker pool {self.name!r} is closed") from None
                self._replace(worker, counter="crashes")
                raise
            try:
                payload = ForkingPickler.dumps((fn, args))
            except BaseException:
                self._release(worker)  # fn or args do not pickle; nothing was sent
                raise
            try:
                try:
                    worker.conn.send_bytes(payload)
                except OSError as exc:  # BrokenPipeError, ConnectionResetError
                    raise _NotStarted() from exc
                deadline = time.monotonic() + timeout_s
                started = self._receive(worker, fn, deadline, timeout_s, started=False)
            except _NotStarted:
                # The worker had died while idle (e.g. OOM-killed): the task never ran.
                self._replace(worker, counter="crashes")
                if attempt == _SEND_ATTEMPTS:
                    raise WorkerCrashed(
                        f"{_task_name(fn)}: {attempt} workers in a row died before taking it"
                    ) from None
                continue
            assert started == ("started",), started
            reply = self._receive(worker, fn, deadline, timeout_s, started=True)
            return self._finish(worker, reply)
        raise AssertionError("unreachable")

    def _receive(
        self,
        worker: _Worker,
        fn: Callable[..., Any],
        deadline: float,
        timeout_s: float,
        *,
        started: bool,
    ) -> tuple[Any, ...]:
        """The worker's next message; TaskTimeout / WorkerCrashed / PoolClosed (worker
        replaced) when it does not come by `deadline`, or _NotStarted before "started"."""
        what = f"{_task_name(fn)} in {worker.process.name} (pid {worker.pid})"
        try:
            if worker.conn.poll(max(deadline - time.monotonic(), 0.0)):
                return worker.conn.recv()
        except (EOFError, OSError):
            if self._closed:
                self._replace(worker, counter=None)
                raise PoolClosed(f"worker pool {self.name!r} closed while running {what}") from None
            if not started:
                raise _NotStarted() from None
            code = self._replace(worker, counter="crashes")
            raise WorkerCrashed(f"{what} died: {_describe_exit(code)}") from None
        self._replace(worker, counter="timeouts")
        raise TaskTimeout(f"{what} ran past {timeout_s:g}s; the worker was killed")

    def _finish(self, worker: _Worker, reply: tuple[Any, ...]) -> Any:
        worker.tasks_done += 1
        with self._lock:
            self._counts["tasks_done"] += 1
        if reply[0] == "memory":  # the worker exits after sending this
            self._replace(worker, counter="out_of_memory")
            raise TaskOutOfMemory(
                f"{worker.process.name} ran out of its {self.memory_bytes} bytes of memory"
            ) from RemoteTraceback(reply[1])
        if worker.tasks_done >= self.max_tasks_per_worker:
            self._replace(worker, counter="recycled")
        else:
            self._release(worker)
        if reply[0] == "ok":
            return reply[1]
        _, exc, tb = reply
        raise exc from RemoteTraceback(tb)

    def stats(self) -> dict[str, int]:
        """workers (alive or starting), busy, tasks_done, timeouts, crashes, out_of_memory,
        recycled."""
        with self._lock:
            return {
                "workers": len(self._workers),
                "busy": len(self._workers) - len(self._idle),
                **self._counts,
            }

    def pids(self) -> list[int]:
        """The process ids of the current workers (for tests and diagnostics)."""
        with self._lock:
            return sorted(w.pid for w in self._workers if w.pid is not None)

    def close(self) -> None:
        """Kills every worker (busy ones too: their callers get PoolClosed). Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = [w for w in self._workers if w not in idle]
            self._lock.notify_all()
        for worker in idle:
            worker.kill()
            with self._lock:
                self._workers.discard(worker)
        for worker in busy:
            # Their callers reap them and close their pipes (closing a pipe another thread
            # is polling is not safe); killing is enough to end the task now.
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join(5.0)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
