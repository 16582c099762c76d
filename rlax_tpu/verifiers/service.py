"""The verifier service (protos/rlax_tpu/v1/verifier.proto): batches of verification requests
judged on a worker pool behind a bounded queue, idempotent by request id, with one deadline
per batch, (the client and the codecs are in rlax_tpu.api.verifier).

`VerificationService` is the core (plain Python, tested directly): admission into a bounded
queue (a batch that does not fit is refused whole, so memory stays bounded), `concurrency`
dispatch threads that call a blocking `verify` (LocalVerifier.verify on a WorkerPool), an LRU
of finished results by request id, and metrics. `VerifierServicer` is a thin gRPC layer.
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
    QueueFullError,
    RequestIdReusedError,
    ServiceClosedError,
    Verdict,
    VerificationRequest,
    VerificationResult,
    metrics_to_proto,
    request_from_proto,
    result_to_proto,
    status_code,
)
from rlax_tpu.rpc.protos import verifier_pb2 as pb
from rlax_tpu.rpc.protos import verifier_pb2_grpc as pb_grpc

DEFAULT_QUEUE_CAPACITY = 1024
DEFAULT_RESULTS_CACHE_SIZE = 10_000
DEFAULT_DEADLINE_S = 600.0
# The server answers this long before the caller's gRPC deadline, so partial results of a
# batch arrive instead of DEADLINE_EXCEEDED; the client adds the same margin the other way.
_REPLY_MARGIN_S = 0.5
_LATENCY_WINDOW = 4096


def _not_judged(reason: str) -> VerificationResult:
    return VerificationResult(reward=0.0, verdict=Verdict.VERIFIER_ERROR, reason=reason)


def _fingerprint(request: VerificationRequest) -> str:
    """What a request id stands for: a retry must carry the same request (every field a
    result depends on; a reward function's also sees the prompt and the metadata)."""
    h = hashlib.sha256()
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
    for part in parts:
        data = part.encode(errors="surrogatepass")
        h.update(len(data).to_bytes(8, "little") + data)
    if request.response_tokens:  # absent: the fingerprint requests had before they existed
        data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in request.response_tokens)
        h.update(b"tokens" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


@dataclasses.dataclass(eq=False)
class _Job:
    key: str  # the request id, or a private key for requests without one
    request: VerificationRequest
    fingerprint: str
    deadline: float  # monotonic; the latest deadline of any batch waiting for it
    admitted: float
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One request's answer: its result and whether it was recorded before the call."""

    result: VerificationResult
    cached: bool = False


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 when there are no values)."""
    if not sorted_values:
        return 0.0
    rank = max(1, int(-(-q * len(sorted_values) // 100)))  # ceil(q/100 * n)
    return sorted_values[min(rank, len(sorted_values)) - 1]


class VerificationService:
    """Judges batches with `verify` on `concurrency` threads behind a bounded queue.

    verify:              blocking request -> result (LocalVerifier.verify); an exception is
                         reported as VERIFIER_ERROR.
    queue_capacity:      requests admitted (waiting + running) at once; a batch that would go
                         over it is refused whole (QueueFullError).
    results_cache_size:  finished results kept by request id (LRU). A retried id returns its
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
        self._verify = verify
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
        self._finished: collections.OrderedDict[str, tuple[str, VerificationResult]] = (
            collections.OrderedDict()
        )
        self._private_keys = itertools.count()
        self._closed = False
        self._latencies: collections.deque[float] = collections.deque(maxlen=_LATENCY_WINDOW)
        self._verdicts: collections.Counter[str] = collections.Counter()
        self._counts = collections.Counter(
            {k: 0 for k in ("judged", "cache_hits", "joined", "rejected", "deadline_expired")}
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
                fingerprint = _fingerprint(request)
                rid = request.request_id
                if rid and rid in self._finished:
                    recorded, result = self._finished[rid]
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
                    job = new[key] = _Job(key, request, fingerprint, deadline, now)
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
                        _not_judged(
                            f"not judged within the batch deadline of {deadline_s:g} s "
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
        verifications), verdict counts, the pool's and the inputs' counters, and how code
        runs ("sandbox")."""
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
                "verdicts": dict(self._verdicts),
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
            job.future.set_result(_not_judged("the verifier service stopped before judging it"))
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))

    # -- dispatch ---------------------------------------------------------------------------
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
            if drop:
                job.future.set_result(_not_judged("dropped: its batch deadline passed in queue"))
                continue
            try:
                result = self._verify(job.request)
            except Exception as e:  # a verifier bug must not take the service down
                result = _not_judged(f"the verifier failed: {type(e).__name__}: {e}")
            with self._cond:
                self._running -= 1
                self._counts["judged"] += 1
                self._verdicts[Verdict(result.verdict).value] += 1
                self._latencies.append(time.monotonic() - job.admitted)
                if job.request.request_id:
                    self._in_flight.pop(job.key, None)
                    if result.verdict != Verdict.VERIFIER_ERROR and self.results_cache_size:
                        self._finished[job.key] = (job.fingerprint, result)
                        while len(self._finished) > self.results_cache_size:
                            self._finished.popitem(last=False)
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
    details["verdicts"] = ",".join(f"{k}={v}" for k, v in sorted(metrics["verdicts"].items()))
    for name in ("pool", "inputs"):
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
        try:
            if request.deadline_s < 0:
                raise ValueError(f"deadline_s must be >= 0, got {request.deadline_s}")
            requests = [request_from_proto(m, i) for i, m in enumerate(request.requests)]
            deadline_s = request.deadline_s or self.service.default_deadline_s
            remaining = context.time_remaining()
            if remaining is not None:  # answer before the caller's own deadline fires
                deadline_s = min(deadline_s, max(0.0, remaining - _REPLY_MARGIN_S))
            outcomes = self.service.verify_batch(requests, deadline_s=deadline_s)
        except Exception as e:
            _abort(context, e)
        return pb.VerifyReply(
            results=[
                result_to_proto(o.result, r.request_id, cached=o.cached)
                for r, o in zip(requests, outcomes, strict=True)
            ]
        )

    def GetMetrics(
        self, request: pb.MetricsRequest, context: grpc.ServicerContext
    ) -> pb.VerifierMetrics:
        return metrics_to_proto(self.service.metrics())


def _abort(context: grpc.ServicerContext, error: Exception) -> None:
    code = status_code(error)
    message = str(error) if code != grpc.StatusCode.INTERNAL else f"{type(error).__name__}: {error}"
    context.abort(code, message)
