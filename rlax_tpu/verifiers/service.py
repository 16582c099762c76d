"""The verifier service (protos/rlax_tpu/v1/verifier.proto): batches of verification requests
judged on a worker pool, and batches of programs run for the policy's tools (Execute), behind
one bounded queue, idempotent by request id, with one deadline per batch (the client and the
codecs are in rlax_tpu.api.verifier).

`VerificationService` is the core (plain Python, tested directly): admission into a bounded
queue (a batch that does not fit is refused whole, so memory stays bounded), `concurrency`
dispatch threads that call a blocking `verify` (LocalVerifier.verify on a WorkerPool) or
`execute` (ProgramRunner.execute, in the code verifier's sandbox), an LRU of finished results
by request id, and metrics. `VerifierServicer` is a thin gRPC layer.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

from rlax_tpu.api.verifier import (
    ExecutionRequest,
    ExecutionResult,
    ExecutionUnavailableError,
    ExecutionVerdict,
    QueueFullError,
    RequestIdReusedError,
    ServiceClosedError,
    Verdict,
    VerificationRequest,
    VerificationResult,
    execution_request_from_proto,
    execution_result_to_proto,
    metrics_to_proto,
    request_from_proto,
    result_to_proto,
    status_code,
)
from rlax_tpu.rpc.protos import verifier_pb2 as pb
from rlax_tpu.rpc.protos import verifier_pb2_grpc as pb_grpc

DEFAULT_QUEUE_CAPACITY = 1024
DEFAULT_RESULTS_CACHE_SIZE = 10_000
# Programs' outputs kept in the results cache at most (their stdout and stderr; a
# verification's result is small and not counted).
RESULTS_CACHE_OUTPUT_BYTES = 64 * 2**20
DEFAULT_DEADLINE_S = 600.0
# The server answers this long before the caller's gRPC deadline, so partial results of a
# batch arrive instead of DEADLINE_EXCEEDED; the client adds the same margin the other way.
_REPLY_MARGIN_S = 0.5
_LATENCY_WINDOW = 4096


def _not_judged(reason: str) -> VerificationResult:
    return VerificationResult(reward=0.0, verdict=Verdict.VERIFIER_ERROR, reason=reason)


def _not_run(reason: str) -> ExecutionResult:
    return ExecutionResult(verdict=ExecutionVerdict.VERIFIER_ERROR, reason=reason)


def _digest(parts: Sequence[str], tail: bytes = b"") -> str:
    """sha256 of the length-prefixed parts, then `tail`."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode(errors="surrogatepass")
        h.update(len(data).to_bytes(8, "little") + data)
    h.update(tail)
    return h.hexdigest()


def _output_bytes(result: ExecutionResult) -> int:
    return len(result.stdout) + len(result.stderr)


def _program_fingerprint(request: ExecutionRequest) -> str:
    """What a program's request id stands for. Its first part, "execute", is no verification's
    kind: an id used for a verification and then a program is refused as reused."""
    parts = (
        "execute",
        request.language,
        request.code,
        request.stdin,
        repr(float(request.time_limit_s)),
        str(request.memory_limit_bytes),
        str(request.output_limit_bytes),
    )
    return _digest(parts)


def _fingerprint(request: VerificationRequest) -> str:
    """What a request id stands for: a retry must carry the same request (every field a
    result depends on; a reward function's also sees the prompt and the metadata)."""
    parts = (
        request.kind,
        request.response,
        request.reference,
        request.problem,
        request.language,
        request.function,
        request.prompt,
        "chat" if request.chat else "text",
        request.metadata,
    )
    tail = b""
    if request.response_tokens:  # absent: the fingerprint requests had before they existed
        data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in request.response_tokens)
        tail = b"tokens" + len(data).to_bytes(8, "little") + data
    return _digest(parts, tail)


@dataclasses.dataclass(frozen=True, eq=False)
class _Kind:
    """One kind of request the queue serves: a verification (judged) or a program (run)."""

    counter: str  # its count in the metrics: "judged" / "executed"
    verb: str  # what not doing it is called in reasons: "judged" / "run"
    run: Callable[[Any], Any]  # request -> result, blocking
    fingerprint: Callable[[Any], str]
    not_run: Callable[[str], Any]  # the VERIFIER_ERROR result of one not done, with why
    size: Callable[[Any], int] = lambda result: 0  # a result's bytes the cache counts


@dataclasses.dataclass(eq=False)
class _Job:
    key: str  # the request id, or a private key for requests without one
    kind: _Kind
    request: Any  # VerificationRequest | ExecutionRequest, as `kind` says
    fingerprint: str
    deadline: float  # monotonic; the latest deadline of any batch waiting for it
    admitted: float
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One request's answer: its result (a VerificationResult, or an ExecutionResult for a
    program) and whether it was recorded before the call."""

    result: Any
    cached: bool = False


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 when there are no values)."""
    if not sorted_values:
        return 0.0
    rank = max(1, int(-(-q * len(sorted_values) // 100)))  # ceil(q/100 * n)
    return sorted_values[min(rank, len(sorted_values)) - 1]


class VerificationService:
    """Judges batches with `verify`, and runs batches of programs with `execute`, on
    `concurrency` threads behind one bounded queue.

    verify:              blocking request -> result (LocalVerifier.verify); an exception is
                         reported as VERIFIER_ERROR.
    execute:             blocking ExecutionRequest -> ExecutionResult (ProgramRunner.execute);
                         an exception is VERIFIER_ERROR. None: Execute is refused
                         (ExecutionUnavailableError).
    queue_capacity:      requests admitted (waiting + running) at once; a batch that would go
                         over it is refused whole (QueueFullError).
    results_cache_size:  finished results kept by request id (LRU; programs' results also
                         up to RESULTS_CACHE_OUTPUT_BYTES of output). A retried id returns its
                         result without running; an id still running is waited for.
                         VERIFIER_ERROR results are not kept: a retry judges again.
    default_deadline_s:  a batch's deadline when the call names none.
    pool_stats:          the worker pool's counters, reported with the metrics.
    input_stats:         the verifier's input counters (LocalVerifier.stats), likewise.
    sandbox:             how code runs (Sandbox.identity), likewise.
    """

    def __init__(
        self,
        verify: Callable[[VerificationRequest], VerificationResult],
        *,
        execute: Callable[[ExecutionRequest], ExecutionResult] | None = None,
        concurrency: int,
        queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
        results_cache_size: int = DEFAULT_RESULTS_CACHE_SIZE,
        default_deadline_s: float = DEFAULT_DEADLINE_S,
        pool_stats: Callable[[], Mapping[str, int]] | None = None,
        input_stats: Callable[[], Mapping[str, int]] | None = None,
        sandbox: Mapping[str, str] | None = None,
    ) -> None:
        if concurrency < 1 or queue_capacity < 1 or results_cache_size < 0:
            raise ValueError(
                "concurrency and queue_capacity must be >= 1 and results_cache_size >= 0, got "
                f"{concurrency}, {queue_capacity}, {results_cache_size}"
            )
        if default_deadline_s <= 0:
            raise ValueError(f"default_deadline_s must be > 0, got {default_deadline_s}")
        self._judging = _Kind("judged", "judged", verify, _fingerprint, _not_judged)
        self._executing = (
            _Kind("executed", "run", execute, _program_fingerprint, _not_run, _output_bytes)
            if execute is not None
            else None
        )
        self.concurrency = concurrency
        self.queue_capacity = queue_capacity
        self.results_cache_size = results_cache_size
        self.default_deadline_s = default_deadline_s
        self._pool_stats = pool_stats
        self._input_stats = input_stats
        self._sandbox = dict(sandbox or {})
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._running = 0
        self._in_flight: dict[str, _Job] = {}  # by request id: queued or running
        # request id -> (fingerprint, result, its bytes counted in _finished_bytes)
        self._finished: collections.OrderedDict[str, tuple[str, Any, int]] = (
            collections.OrderedDict()
        )
        self._finished_bytes = 0
        self._private_keys = itertools.count()
        self._closed = False
        self._latencies: collections.deque[float] = collections.deque(maxlen=_LATENCY_WINDOW)
        # verdict -> count, by kind ("judged", "executed")
        self._verdicts: dict[str, collections.Counter[str]] = {
            "judged": collections.Counter(),
            "executed": collections.Counter(),
        }
        self._counts = collections.Counter(
            {
                k: 0
                for k in (
                    "judged",
                    "executed",
                    "cache_hits",
                    "joined",
                    "rejected",
                    "deadline_expired",
                )
            }
        )
        self._threads = [
            threading.Thread(target=self._dispatch, name=f"verifier-dispatch-{i}", daemon=True)
            for i in range(concurrency)
        ]
        for thread in self._threads:
            thread.start()

    # -- calls ------------------------------------------------------------------------------
    def verify_batch(
        self, requests: Sequence[VerificationRequest], *, deadline_s: float | None = None
    ) -> list[Outcome]:
        """One outcome per request, in order, by `deadline_s` (default: default_deadline_s)
        from now; requests not judged by then are VERIFIER_ERROR and go on running if they
        started, so a retry with the same ids finds their results."""
        return self._submit(self._judging, requests, deadline_s)

    def execute_batch(
        self, requests: Sequence[ExecutionRequest], *, deadline_s: float | None = None
    ) -> list[Outcome]:
        """Programs run as `verify_batch` judges requests (the same queue, capacity, request
        ids and deadline); their results are ExecutionResults. ExecutionUnavailableError
        when this service was built without `execute`."""
        if self._executing is None:
            raise ExecutionUnavailableError(
                "this verifier service runs no programs (built without a program runner); "
                "`rlax-tpu serve verifier` runs them"
            )
        return self._submit(self._executing, requests, deadline_s)

    def _submit(
        self, kind: _Kind, requests: Sequence[Any], deadline_s: float | None
    ) -> list[Outcome]:
        deadline_s = self.default_deadline_s if deadline_s is None else deadline_s
        now = time.monotonic()
        deadline = now + max(0.0, deadline_s)
        slots: list[Outcome | _Job] = []
        with self._cond:
            if self._closed:
                raise ServiceClosedError("the verifier service is stopping")
            new: dict[str, _Job] = {}
            joined: list[_Job] = []
            hits = 0
            for request in requests:
                fingerprint = kind.fingerprint(request)
                rid = request.request_id
                if rid and rid in self._finished:
                    recorded, result, _ = self._finished[rid]
                    _check_same(rid, recorded, fingerprint)
                    self._finished.move_to_end(rid)
                    slots.append(Outcome(result, cached=True))
                    hits += 1
                    continue
                job = (new.get(rid) or self._in_flight.get(rid)) if rid else None
                if job is not None:
                    _check_same(rid, job.fingerprint, fingerprint)
                    if job.key not in new:
                        joined.append(job)
                else:
                    key = rid or f"\0{next(self._private_keys)}"
                    job = new[key] = _Job(key, kind, request, fingerprint, deadline, now)
                slots.append(job)
            admitted = len(self._queue) + self._running
            if admitted + len(new) > self.queue_capacity:
                self._counts["rejected"] += 1
                raise QueueFullError(
                    f"the verifier queue is full: {admitted} of {self.queue_capacity} requests "
                    f"admitted, this batch adds {len(new)}; retry later"
                    + (" with smaller batches" if len(new) > self.queue_capacity else "")
                )
            for job in joined:
                job.deadline = max(job.deadline, deadline)
            for job in new.values():
                if job.request.request_id:
                    self._in_flight[job.key] = job
                self._queue.append(job)
            self._counts["cache_hits"] += hits
            self._counts["joined"] += len(joined)
            self._cond.notify_all()
        pending = {s.future for s in slots if isinstance(s, _Job)}
        concurrent.futures.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        outcomes = []
        expired = 0
        for slot in slots:
            if isinstance(slot, Outcome):
                outcomes.append(slot)
            elif slot.future.done():
                outcomes.append(Outcome(slot.future.result()))
            else:
                expired += 1
                outcomes.append(
                    Outcome(
                        kind.not_run(
                            f"not {kind.verb} within the batch deadline of {deadline_s:g} s "
                            "(the verifier is busy or the request is slow); retry with the "
                            "same request id to pick up its result"
                        )
                    )
                )
        if expired:
            with self._cond:
                self._counts["deadline_expired"] += expired
        return outcomes

    def metrics(self) -> dict[str, Any]:
        """Queue depth, running, counters, latency p50/p95 (admission to result, recent
        requests of both kinds), verdict counts (of verifications: "verdicts"; of programs:
        "execution_verdicts"), the pool's and the inputs' counters, and how code runs
        ("sandbox")."""
        with self._cond:
            latencies = sorted(self._latencies)
            out: dict[str, Any] = {
                "queue_depth": len(self._queue),
                "running": self._running,
                "queue_capacity": self.queue_capacity,
                "num_workers": self.concurrency,
                **self._counts,
                "latency_p50_s": _percentile(latencies, 50),
                "latency_p95_s": _percentile(latencies, 95),
                "verdicts": dict(self._verdicts["judged"]),
                "execution_verdicts": dict(self._verdicts["executed"]),
            }
        out["pool"] = dict(self._pool_stats()) if self._pool_stats is not None else {}
        out["inputs"] = dict(self._input_stats()) if self._input_stats is not None else {}
        out["sandbox"] = dict(self._sandbox)
        return out

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuse new batches, answer queued requests VERIFIER_ERROR, and wait up to
        `timeout_s` for running ones (their threads are daemons: they never block exit)."""
        with self._cond:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            for job in dropped:
                self._in_flight.pop(job.key, None)
            self._cond.notify_all()
        for job in dropped:
            job.future.set_result(
                job.kind.not_run(f"the verifier service stopped before it was {job.kind.verb}")
            )
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))

    # -- dispatch ---------------------------------------------------------------------------
    def _keep(self, job: _Job, result: Any) -> None:
        """Records a finished result under its request id (holding the lock), dropping the
        least recently used past the cache's size or its programs' output bytes."""
        size = job.kind.size(result)
        self._finished[job.key] = (job.fingerprint, result, size)
        self._finished_bytes += size
        while self._finished and (
            len(self._finished) > self.results_cache_size
            or self._finished_bytes > RESULTS_CACHE_OUTPUT_BYTES
        ):
            _, (_, _, dropped) = self._finished.popitem(last=False)
            self._finished_bytes -= dropped

    def _dispatch(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                if time.monotonic() >= job.deadline:
                    # Every batch waiting for it has given up: drop it, and let a retry of
                    # the id judge it afresh rather than waste a worker now.
                    self._in_flight.pop(job.key, None)
                    drop = True
                else:
                    self._running += 1
                    drop = False
            kind = job.kind
            if drop:
                job.future.set_result(kind.not_run("dropped: its batch deadline passed in queue"))
                continue
            try:
                result = kind.run(job.request)
            except Exception as e:  # a verifier bug must not take the service down
                result = kind.not_run(f"the verifier failed: {type(e).__name__}: {e}")
            # Both kinds' verdicts are StrEnums; "verifier_error" is the same string in both.
            verdict = str(result.verdict)
            with self._cond:
                self._running -= 1
                self._counts[kind.counter] += 1
                self._verdicts[kind.counter][verdict] += 1
                self._latencies.append(time.monotonic() - job.admitted)
                if job.request.request_id:
                    self._in_flight.pop(job.key, None)
                    if verdict != Verdict.VERIFIER_ERROR and self.results_cache_size:
                        self._keep(job, result)
            job.future.set_result(result)


def _check_same(request_id: str, recorded: str, fingerprint: str) -> None:
    if recorded != fingerprint:
        raise RequestIdReusedError(
            f"request id {request_id!r} was already used for a different request; request ids "
            "must be unique per (step, prompt, sample)"
        )


def verifier_status(
    service: VerificationService, *, instance_id: str, config_digest: str
) -> dict[str, Any]:
    """The Health service's ComponentStatus fields; the metrics go in `details`."""
    metrics = service.metrics()
    details = {k: f"{v:.6g}" if isinstance(v, float) else str(v) for k, v in metrics.items()}
    for name in ("verdicts", "execution_verdicts", "pool", "inputs"):
        details[name] = ",".join(f"{k}={v}" for k, v in sorted(metrics[name].items()))
    details.pop("sandbox")
    details.update({f"sandbox.{k}": v for k, v in metrics["sandbox"].items()})
    return {
        "component": "verifier",
        "instance_id": instance_id,
        "version": -1,
        "config_digest": config_digest,
        "details": details,
    }


# -- server side --------------------------------------------------------------------------------
class VerifierServicer(pb_grpc.VerifierServicer):
    """Serves one VerificationService."""

    def __init__(self, service: VerificationService) -> None:
        self.service = service

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_VerifierServicer_to_server(self, server)

    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyReply:
        results = self._batch(
            request.deadline_s,
            context,
            lambda: [request_from_proto(m, i) for i, m in enumerate(request.requests)],
            self.service.verify_batch,
            result_to_proto,
        )
        return pb.VerifyReply(results=results)

    def Execute(self, request: pb.ExecuteRequest, context: grpc.ServicerContext) -> pb.ExecuteReply:
        results = self._batch(
            request.deadline_s,
            context,
            lambda: [execution_request_from_proto(m, i) for i, m in enumerate(request.programs)],
            self.service.execute_batch,
            execution_result_to_proto,
        )
        return pb.ExecuteReply(results=results)

    def _batch(
        self,
        deadline_s: float,
        context: grpc.ServicerContext,
        parse: Callable[[], list[Any]],
        run: Callable[..., list[Any]],
        encode: Callable[..., Any],
    ) -> list[Any]:
        """One batch call (Verify, Execute): its items parsed, run by the deadline, each
        outcome encoded under its request id; any failure aborts the call with its status."""
        try:
            if deadline_s < 0:
                raise ValueError(f"deadline_s must be >= 0, got {deadline_s}")
            items = parse()
            outcomes = run(items, deadline_s=self._deadline_s(deadline_s, context))
        except Exception as e:
            _abort(context, e)
        return [
            encode(o.result, r.request_id, cached=o.cached)
            for r, o in zip(items, outcomes, strict=True)
        ]

    def _deadline_s(self, asked_s: float, context: grpc.ServicerContext) -> float:
        """The batch's deadline: the one asked for (0 = the default), answered before the
        caller's own gRPC deadline fires."""
        deadline_s = asked_s or self.service.default_deadline_s
        remaining = context.time_remaining()
        if remaining is not None:
            deadline_s = min(deadline_s, max(0.0, remaining - _REPLY_MARGIN_S))
        return deadline_s

    def GetMetrics(
        self, request: pb.MetricsRequest, context: grpc.ServicerContext
    ) -> pb.VerifierMetrics:
        return metrics_to_proto(self.service.metrics())


def _abort(context: grpc.ServicerContext, error: Exception) -> None:
    code = status_code(error)
    message = str(error) if code != grpc.StatusCode.INTERNAL else f"{type(error).__name__}: {error}"
    context.abort(code, message)
