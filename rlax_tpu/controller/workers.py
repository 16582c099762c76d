"""The controller's threads that drive the inference workers: one per worker client, fed
from one priority queue of jobs (the generation pool's batches and evaluations). A thread
takes a job, loads its version if the worker holds another, generates it and hands the
finished rollouts to the job; a rollout aborted by a reload is generated again.

Workers are elastic (DESIGN §8): a worker that does not answer (UNAVAILABLE: it died, or
its connection broke mid-call; or, its calls watched, it stopped answering health checks or
ran past a Generate's deadline: rpc/liveness.py) hands its unfinished requests back to the
queue, for the others, and nothing its given-up call sends later is used; its thread then
waits until the worker (or its replacement, on the same address) answers again, and it
rejoins, loading the version of its next job. Only when every worker has been silent for
`wait_s` does the pool fail. A version the parameter server lost (it restarted before the
version was on storage) is published again by the trainer (`republish`, once) and the load
retried.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import grpc

from rlax_tpu.api.inference import GenerationRequest, Rollout, SamplingParams
from rlax_tpu.rpc.client import is_unreachable
from rlax_tpu.rpc.liveness import ComponentLostError, Watch

_log = logging.getLogger(__name__)

FINAL_REASONS = ("stop", "length")
# What a job's `timing` adds up: seconds loading weights, generating, logging.
TIMINGS = ("load_s", "generate_s", "log_s")
# How long a stopping pool waits for its threads.
STOP_JOIN_S = 5.0


@dataclasses.dataclass(order=True)
class Job:
    """Requests for one worker, generated with exactly `version`. Ordered by `priority`.

    `pause(rollouts, worker)` takes the rollouts that stopped at their token budget
    (finish_reason "paused": mixed-version rollouts, inference.in_flight_update) and the
    index of the worker that holds their parked KV; `turn(rollouts, worker)`, when set,
    takes the finished rollouts instead of `deliver` (turns of multi-turn episodes: the
    pool steps their environments); `worker`: only that worker may run the job (None:
    any)."""

    priority: tuple[int, int]
    version: int = dataclasses.field(compare=False)
    requests: list[GenerationRequest] = dataclasses.field(compare=False)
    deliver: Callable[[list[Rollout]], None] = dataclasses.field(compare=False)
    fail: Callable[[str], None] = dataclasses.field(compare=False)
    timing: dict[str, float] = dataclasses.field(
        compare=False, default_factory=lambda: dict.fromkeys(TIMINGS, 0.0)
    )
    evaluation: bool = dataclasses.field(compare=False, default=False)  # any version
    pause: Callable[[list[Rollout], int], None] | None = dataclasses.field(
        compare=False, default=None
    )
    worker: int | None = dataclasses.field(compare=False, default=None)
    turn: Callable[[list[Rollout], int], None] | None = dataclasses.field(
        compare=False, default=None
    )

    def runs_on(self, i: int) -> bool:
        return self.worker is None or self.worker == i


def merged(jobs: Sequence[Job]) -> Job:
    """One job of `jobs` (one version, the first's priority and timing): its rollouts go
    back to the job each request came from. One Generate call then decodes them together,
    so a tick's continuations and a batch's new requests share decode calls; a request's
    tokens do not depend on what it is decoded with (docs/inference.md)."""
    if len(jobs) == 1:
        return jobs[0]
    owner = {r.request_id: job for job in jobs for r in job.requests}

    def by_owner(rollouts: list[Rollout]) -> dict[int, tuple[Job, list[Rollout]]]:
        out: dict[int, tuple[Job, list[Rollout]]] = {}
        for rollout in rollouts:
            job = owner[rollout.request_id]
            out.setdefault(id(job), (job, []))[1].append(rollout)
        return out

    def deliver(rollouts: list[Rollout]) -> None:
        for job, own in by_owner(rollouts).values():
            job.deliver(own)

    def pause(rollouts: list[Rollout], worker: int) -> None:
        for job, own in by_owner(rollouts).values():
            if job.pause is None:
                job.fail(f"{len(own)} rollouts paused, and their job takes none")
            else:
                job.pause(own, worker)

    def turn(rollouts: list[Rollout], worker: int) -> None:
        for job, own in by_owner(rollouts).values():
            if job.turn is None:
                job.deliver(own)
            else:
                job.turn(own, worker)

    def fail(error: str) -> None:
        for job in jobs:
            job.fail(error)

    first = jobs[0]
    return dataclasses.replace(
        first,
        requests=[r for job in jobs for r in job.requests],
        deliver=deliver,
        fail=fail,
        pause=pause,
        worker=next((job.worker for job in jobs if job.worker is not None), None),
        turn=turn if any(job.turn is not None for job in jobs) else None,
    )


class JobQueue:
    """The pool's jobs in priority order. A worker's thread takes the first job it may run
    (`Job.runs_on`) and, with `merge`, the other queued jobs of the same version kept for it
    (`Job.worker`: the continuations of what it paused) and at most one more for any worker
    (a share of a batch), as one job (`merged`). A job kept for a worker that is down
    (`down`) is for any worker: its parked KV is gone, another rebuilds it."""

    def __init__(self, *, merge: bool = False) -> None:
        self.merge = merge
        self._jobs: list[Job] = []
        self._down: set[int] = set()
        self._ready = threading.Condition()

    def put(self, job: Job) -> None:
        with self._ready:
            if job.worker in self._down:
                job = dataclasses.replace(job, worker=None)
            bisect.insort(self._jobs, job)
            self._ready.notify_all()

    def down(self, i: int, is_down: bool = True) -> None:
        """Worker i stopped answering (its queued jobs go to any worker), or is back."""
        with self._ready:
            if not is_down:
                self._down.discard(i)
                return
            self._down.add(i)
            self._jobs = [
                dataclasses.replace(job, worker=None) if job.worker == i else job
                for job in self._jobs
            ]
            self._ready.notify_all()

    def take(self, i: int) -> Job:
        with self._ready:
            while True:
                first = next((job for job in self._jobs if job.runs_on(i)), None)
                if first is not None:
                    break
                self._ready.wait()
            if first is _STOP or not self.merge:
                self._take_out([first])
                return first
            same = [
                job
                for job in self._jobs
                if job is not _STOP
                and job.runs_on(i)
                and (job.version, job.evaluation) == (first.version, first.evaluation)
            ]
            kept = [job for job in same if job.worker == i]
            shared = [job for job in same if job.worker is None][:1]
            chosen = [job for job in same if job is first or job in kept or job in shared]
            self._take_out(chosen)
            return merged(chosen)

    def _take_out(self, jobs: list[Job]) -> None:
        """Remove `jobs` by identity (jobs compare by priority alone: two of one batch and
        tick, kept for two workers, are equal)."""
        taken = {id(job) for job in jobs}
        self._jobs = [job for job in self._jobs if id(job) not in taken]


_STOP = Job((2**62, 0), -1, [], lambda r: None, lambda e: None)


class WorkerThreads:
    """One thread per inference worker client, fed from one priority queue of `Job`s.

    `counters["regenerated"]` counts rollouts aborted by a reload and generated again;
    `wait_s`: how long the threads wait with every worker silent before `failure` is set;
    `report(line)` hears of workers lost and back; `republish(version)` has the trainer
    publish a version the parameter server lost again (None: such a load fails the run)."""

    def __init__(
        self,
        workers: Sequence[Any],
        *,
        sampling: SamplingParams,
        counters: MutableMapping[str, int],
        wait_s: float = 300.0,
        report: Callable[[str], None] | None = None,
        republish: Callable[[int], object] | None = None,
        liveness_s: float = 0.0,
        decode_step_deadline_s: float = 0.0,
        decode_slots: int = 1,
        merge_jobs: bool = False,
    ) -> None:
        """merge_jobs: a thread takes every queued job of its job's version it may run, as
        one Generate call (with in-flight updates: a tick's continuations and new requests
        decode together)."""
        self.workers = list(workers)
        # Liveness (rpc/liveness.py): with liveness_s > 0, every Load and Generate is watched
        # by health checks, and a Generate has a deadline from the tokens it carries.
        self.liveness_s = liveness_s
        self.decode_step_deadline_s = decode_step_deadline_s
        self.decode_slots = max(1, decode_slots)
        self.republish = republish
        self._republished: dict[int, float] = {}  # version -> when it was published again
        self.wait_s = wait_s
        self.report = report or _log.warning
        self.sampling = sampling
        self.counters = counters
        counters.setdefault("regenerated", 0)
        self.worker_versions = [-1] * len(self.workers)  # the version each worker loaded last
        self.busy_s = [0.0] * len(self.workers)
        self.failure: str | None = None  # set, the run stops (resume later)
        self.lost = 0  # times a worker stopped answering (and its requests moved)
        self._down_since: dict[int, float] = {}  # silent workers: since when
        self._closing = threading.Event()
        self._jobs = JobQueue(merge=merge_jobs)
        self._lock = threading.Lock()
        # Per worker, episodes that ended since its last Generate call: their parked pages
        # are dropped with the next one (`ended`).
        self._ended: list[list[tuple[str, int, int]]] = [[] for _ in self.workers]
        self._republish_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def put(self, job: Job) -> None:
        """Queue `job`: the threads take jobs in `priority` order."""
        self._jobs.put(job)

    def ended(self, i: int, key: tuple[str, int, int]) -> None:
        """The episode of request `key` (prompt id, sample index, version), whose last turn
        worker `i` generated, is over: its next Generate call tells it to drop the pages it
        parked. Memory only: a worker that never hears of it evicts them in time."""
        with self._lock:
            self._ended[i].append(key)

    def start(self) -> None:
        if self._threads:
            return
        for i in range(len(self.workers)):
            thread = threading.Thread(target=self._work, args=(i,), name=f"worker-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the worker threads. One in a call still running is not waited for beyond
        STOP_JOIN_S: a run that stops stops its workers next, which ends the call, and what
        the thread receives after this is dropped (generated again on resume, the same)."""
        self._closing.set()
        for _ in self._threads:
            self._jobs.put(_STOP)
        deadline = time.monotonic() + STOP_JOIN_S
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._threads = []

    def loaded(self, i: int, version: int) -> None:
        """Worker i holds `version`, loaded outside its thread (co-located: by the trainer's
        step call), so its next job of that version loads nothing. Only while worker i has
        no job: its thread reads this when it takes one."""
        self.worker_versions[i] = version

    def _work(self, i: int) -> None:
        client = self.workers[i]
        while True:
            job = self._jobs.take(i)
            if job is _STOP:
                return
            t0 = time.perf_counter()
            done: set[str] = set()
            try:
                self._run(i, client, job, done)
                with self._lock:
                    self._down_since.pop(i, None)
            except Exception as e:  # noqa: BLE001 - lost: move its work; else the run stops
                if self._closing.is_set():  # the run is stopping its workers: not a loss
                    return
                if getattr(e, "code", None) == grpc.StatusCode.NOT_FOUND and self._found_again(
                    job.version, t0
                ):
                    self._requeue(job, done)
                    continue
                if not is_unreachable(e):
                    self.failure = f"inference worker {i} failed: {type(e).__name__}: {e}"
                    job.fail(self.failure)
                    return
                self._requeue(job, done)
                if not self._wait_for_worker(i, client, e):
                    return
            finally:
                self.busy_s[i] += time.perf_counter() - t0

    def _run(self, i: int, client: Any, job: Job, done: set[str]) -> None:
        """Load the job's version if needed, generate, hand the finished rollouts over (their
        ids into `done`), and requeue those a reload aborted. A worker that turns out not to
        hold the version it last loaded (FAILED_PRECONDITION before any rollout: it was
        restarted between two jobs, unseen) loads it again, once."""
        for attempt in range(2):
            t0 = time.perf_counter()
            if self.worker_versions[i] != job.version:
                if self.liveness_s > 0:
                    watch = Watch(self._name(i, client), client.status_details, **self._live())
                    loaded = client.load(job.version, evaluation=job.evaluation, watch=watch)
                else:
                    loaded = client.load(job.version, evaluation=job.evaluation)
                self.worker_versions[i] = loaded.version
            job.timing["load_s"] += time.perf_counter() - t0
            try:
                self._generate(i, client, job, done)
                return
            except Exception as e:
                lost_weights = getattr(e, "code", None) == grpc.StatusCode.FAILED_PRECONDITION
                if not lost_weights or attempt or done:
                    raise
                self.report(f"inference worker {i} lost its weights ({e}): it loads them again")
                with self._lock:
                    self.worker_versions[i] = -1

    def _generate(self, i: int, client: Any, job: Job, done: set[str]) -> None:
        t_loaded = time.perf_counter()
        retry, finished = [], []
        with self._lock:
            ended, self._ended[i] = self._ended[i], []
        extra = {"ended": ended} if ended else {}
        if self.liveness_s > 0:
            deadline_s, why = self.generate_deadline(job.requests)
            watch = Watch(
                self._name(i, client),
                client.status_details,
                **self._live(),
                deadline_s=deadline_s,
                deadline_why=why,
            )
            stream = client.generate(job.requests, version=job.version, watch=watch, **extra)
        else:
            stream = client.generate(job.requests, version=job.version, **extra)
        paused: list[Rollout] = []
        try:
            for rollout in stream:
                if rollout.finish_reason in FINAL_REASONS:
                    finished.append(rollout)
                elif rollout.finish_reason == "paused" and job.pause is not None:
                    paused.append(rollout)
                elif rollout.finish_reason == "aborted":
                    retry.append(rollout.request_id)
                else:
                    job.fail(f"request {rollout.request_id} failed on worker {i}: {rollout.error}")
        finally:  # what finished before a lost connection is kept (unless stopping)
            t_generated = time.perf_counter()
            job.timing["generate_s"] += t_generated - t_loaded
            if finished and not self._closing.is_set():
                if job.turn is not None:
                    job.turn(finished, i)  # the next turns are queued before the next take
                else:
                    job.deliver(finished)
                done.update(r.request_id for r in finished)
            if paused and not self._closing.is_set():
                job.pause(paused, i)  # their continuations are queued before the next take
                done.update(r.request_id for r in paused)
            job.timing["log_s"] += time.perf_counter() - t_generated
        if retry:
            with self._lock:
                self.counters["regenerated"] += len(retry)
            again = [r for r in job.requests if r.request_id in set(retry)]
            self._jobs.put(dataclasses.replace(job, requests=again))

    def generate_deadline(self, requests: Sequence[GenerationRequest]) -> tuple[float, str]:
        """(seconds, how they were derived) a Generate of `requests` may take: the liveness
        timeout plus, for each wave of `decode_slots` requests, its longest max_new_tokens at
        `decode_step_deadline_s` a token (the worker's compile time is added by the watch);
        infinite when decode_step_deadline_s is 0."""
        if self.decode_step_deadline_s <= 0:
            return math.inf, ""
        tokens = sorted(
            ((r.sampling or self.sampling).max_new_tokens for r in requests), reverse=True
        )
        steps = sum(tokens[k] for k in range(0, len(tokens), self.decode_slots))
        seconds = self.liveness_s + steps * self.decode_step_deadline_s
        why = (
            f"{len(requests)} requests in {math.ceil(len(tokens) / self.decode_slots)} wave(s) "
            f"of {self.decode_slots} slots, {steps} decode steps at "
            f"controller.decode_step_deadline_s = {self.decode_step_deadline_s:g}s, plus "
            f"{self.liveness_s:g}s"
        )
        return seconds, why

    def _live(self) -> dict[str, float]:
        return {"liveness_s": self.liveness_s}

    @staticmethod
    def _name(i: int, client: Any) -> str:
        return f"inference worker {i} ({getattr(client, 'address', '?')})"

    def _found_again(self, version: int, attempt_t0: float) -> bool:
        """A load of `version` found it missing: whether it is published again now (by the
        trainer, once per version; a load that started before that publish ended is tried
        again too). False: it stays missing, and the run stops."""
        if self.republish is None:
            return False
        with self._republish_lock:
            if version in self._republished:
                return attempt_t0 < self._republished[version]
            self.report(f"the parameter server lost version {version}: the trainer publishes it")
            try:
                self.republish(version)
            except Exception as e:  # noqa: BLE001 - not the trainer's version: a resume
                self.report(f"version {version} cannot be published again: {e}")
                return False
            self._republished[version] = time.perf_counter()
            return True

    def _requeue(self, job: Job, done: set[str]) -> None:
        """A lost worker's job goes back to the queue (same priority) without what it
        finished."""
        rest = [r for r in job.requests if r.request_id not in done]
        if rest:  # kept for a worker that is lost: for any (JobQueue.down), else still its
            self._jobs.put(dataclasses.replace(job, requests=rest))

    def _wait_for_worker(self, i: int, client: Any, error: BaseException) -> bool:
        """Worker i did not answer: until it answers its status again (True: it rejoins and
        loads its next job's version), the pool stops (False), or every worker has been
        silent for `wait_s` (False, with `failure` set)."""
        address = getattr(client, "address", "?")
        self._jobs.down(i)
        with self._lock:
            self._down_since.setdefault(i, time.monotonic())
            self.worker_versions[i] = -1  # a replacement holds no weights
            self.lost += 1
            down = len(self._down_since)
        lost = (
            str(error)
            if isinstance(error, ComponentLostError)
            else f"inference worker {i} ({address}) does not answer ({error})"
        )
        self.report(
            f"{lost}; its requests go to the other workers ({len(self.workers) - down} "
            "answering), and it rejoins when it answers again"
        )
        delay = 0.2
        while not self._closing.wait(delay):
            try:
                client.status()
            except Exception:  # noqa: BLE001 - still down
                delay = min(delay * 2, 2.0)
                with self._lock:
                    silent = len(self._down_since) == len(self.workers) and (
                        time.monotonic() - max(self._down_since.values()) >= self.wait_s
                    )
                if silent and self.failure is None:
                    self.failure = (
                        f"no inference worker has answered for {self.wait_s:g}s "
                        f"(controller.component_wait_s; the last error: {error}); start them "
                        "again, then `rlax-tpu resume`"
                    )
                if self.failure is not None:
                    return False
                continue
            self.report(f"inference worker {i} ({address}) answers again: it rejoins")
            self._jobs.down(i, False)
            return True
        return False
