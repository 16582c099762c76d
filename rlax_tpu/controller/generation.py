"""The generation pool: the controller's threads that drive the inference workers.

A batch's requests go into one priority queue (the batch the trainer waits for first,
evaluations before everything), split into jobs of whole groups; each worker thread takes a
job, loads its version if the worker holds another, generates it and hands the finished
rollouts over. A rollout aborted by a reload is regenerated (its request id, and so its
tokens, are the same). Finished rollouts are written to the rollout log before anything can
train on them (with the dataset records of their prompts, for people reading the log), and
a batch first takes what the log already holds (a resumed run).

Workers are elastic (DESIGN §8): a worker that does not answer (UNAVAILABLE: it died, or
its connection broke mid-call; or, its calls watched, it stopped answering health checks or
ran past a Generate's deadline: rpc/liveness.py) hands its unfinished requests back to the
queue, for the others, and nothing its given-up call sends later is used; its thread then
waits until the worker (or its replacement, on the same address) answers again, and it
rejoins, loading the version of its next job. A request's tokens do
not depend on which worker serves it, so the run's results do not change. Only when every
worker has been silent for `wait_s` does the pool fail, and the run stop. A version the
parameter server lost (it restarted before the version was on storage) is published again
by the trainer (`republish`, once) and the load retried.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import grpc

from rlax_tpu.api.inference import GenerationRequest, Rollout, SamplingParams
from rlax_tpu.api.records import Group, Judgement, RolloutRecord, ScoredRollout
from rlax_tpu.controller.errors import ControllerError
from rlax_tpu.controller.snapshots import RolloutLog
from rlax_tpu.data.datasets import PromptRecord
from rlax_tpu.rpc.client import is_unreachable
from rlax_tpu.rpc.liveness import ComponentLostError, Watch

_log = logging.getLogger(__name__)

FINAL_REASONS = ("stop", "length")
_TIMINGS = ("load_s", "generate_s", "log_s")
# The sample index of a prompt's greedy response (ReMax's baseline, `BatchState.greedy`):
# logged, judged and keyed like the K samples, never trained on.
GREEDY_SAMPLE = -1


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of one batch: `key` is unique per draw ("b<batch>:<dataset>:<id>"), so two
    draws of the same dataset row in different batches sample independently."""

    key: str
    tokens: tuple[int, ...]
    record: PromptRecord

    @property
    def uid(self) -> str:
        """The dataset row the prompt is drawn from: the replay buffer's prompt key."""
        return f"{self.record.dataset}:{self.record.id}"


@dataclasses.dataclass
class BatchState:
    """One batch as its rollouts arrive and are judged, by (prompt key, sample index).
    With `greedy` (ReMax), each prompt also has a greedy response at GREEDY_SAMPLE, whose
    reward is its group's baseline."""

    index: int
    version: int
    samples: int
    prompts: list[Prompt] = dataclasses.field(default_factory=list)
    rollouts: dict[tuple[str, int], RolloutRecord] = dataclasses.field(default_factory=dict)
    judgements: dict[tuple[str, int], Judgement] = dataclasses.field(default_factory=dict)
    rounds: int = 1  # rounds of prompts drawn for this batch (refills add rounds)
    error: str | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    # Seconds the worker threads spent on this batch: loading weights, generating, logging.
    timing: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(_TIMINGS, 0.0)
    )
    greedy: bool = False

    @property
    def sample_indices(self) -> list[int]:
        """Every prompt's rollouts: the K samples, then the greedy one (with `greedy`)."""
        return [*range(self.samples), *([GREEDY_SAMPLE] if self.greedy else [])]

    @property
    def expected(self) -> int:
        return len(self.prompts) * len(self.sample_indices)

    def judgements_of(self, prompt: Prompt) -> list[Judgement]:
        """The judgements of the prompt's samples, in index order."""
        return [self.judgements[(prompt.key, i)] for i in range(self.samples)]

    def baseline(self, prompt: Prompt) -> Judgement:
        """The judgement of the prompt's greedy response; only with `greedy`."""
        return self.judgements[(prompt.key, GREEDY_SAMPLE)]

    def judged(self, prompt: Prompt) -> bool:
        """Whether the prompt's samples (and, with `greedy`, its greedy baseline) are all
        judged: a group's advantages are never computed against a missing reward."""
        if self.greedy and not self.baseline(prompt).judged:
            return False
        return all(j.judged for j in self.judgements_of(prompt))

    def group(self, prompt: Prompt) -> Group:
        """The prompt's scored samples in index order, with its greedy reward as the
        baseline (with `greedy`); the prompt must be `judged`."""
        samples = [
            ScoredRollout.of(self.rollouts[(prompt.key, i)], self.judgements[(prompt.key, i)])
            for i in range(self.samples)
        ]
        baseline = self.baseline(prompt).reward if self.greedy else None
        return Group(prompt.key, tuple(samples), baseline)

    def unjudged(self) -> list[tuple[Prompt, int]]:
        """(prompt, sample index) of every rollout that has no judgement yet, in draw order."""
        return [
            (p, i)
            for p in self.prompts
            for i in self.sample_indices
            if (p.key, i) not in self.judgements
        ]


@dataclasses.dataclass(order=True)
class _Job:
    """Requests for one worker, generated with exactly `version`. Ordered by `priority`."""

    priority: tuple[int, int]
    version: int = dataclasses.field(compare=False)
    requests: list[GenerationRequest] = dataclasses.field(compare=False)
    deliver: Callable[[list[Rollout]], None] = dataclasses.field(compare=False)
    fail: Callable[[str], None] = dataclasses.field(compare=False)
    timing: dict[str, float] = dataclasses.field(
        compare=False, default_factory=lambda: dict.fromkeys(_TIMINGS, 0.0)
    )
    evaluation: bool = dataclasses.field(compare=False, default=False)  # any version


# How long a stopping pool waits for its threads, and how long a progress line waits for a
# worker's status.
STOP_JOIN_S = 5.0
PROGRESS_STATUS_TIMEOUT_S = 2.0


class Stopped(Exception):
    """The run was stopped (SIGTERM / Ctrl-C) while the controller waited for generation."""


_STOP = _Job((2**62, 0), -1, [], lambda r: None, lambda e: None)


def rollout_record(batch: int, rollout: Rollout) -> RolloutRecord:
    """A worker's finished rollout of `batch` as the controller keeps it."""
    return RolloutRecord(
        batch=batch,
        prompt_id=rollout.prompt_id,
        sample_index=rollout.sample_index,
        version=rollout.version,
        prompt_tokens=tuple(rollout.prompt_tokens),
        tokens=tuple(rollout.tokens),
        logprobs=tuple(rollout.logprobs),
        finish_reason=rollout.finish_reason,
    )


class GenerationPool:
    """One thread per inference worker client, fed from one priority queue.

    `counters` is the run's snapshotted accounting: `reused` (rollouts taken from the log)
    and `regenerated` (aborted by a reload and generated again) are counted into it.
    `wait_s`: how long the pool waits with every worker silent before it fails;
    `report(line)` hears of workers lost and back; `republish(version)` has the trainer
    publish a version the parameter server lost again (None: such a load fails the run)."""

    def __init__(
        self,
        workers: Sequence[Any],
        log: RolloutLog,
        *,
        samples: int,
        sampling: SamplingParams,
        counters: MutableMapping[str, int],
        wait_s: float = 300.0,
        report: Callable[[str], None] | None = None,
        republish: Callable[[int], object] | None = None,
        liveness_s: float = 0.0,
        decode_step_deadline_s: float = 0.0,
        decode_slots: int = 1,
        progress_every_s: float = 10.0,
    ) -> None:
        self.workers = list(workers)
        self.progress_every_s = progress_every_s  # 0: no progress lines while waiting
        # Liveness (rpc/liveness.py): with liveness_s > 0, every Load and Generate is watched
        # by health checks, and a Generate has a deadline from the tokens it carries.
        self.liveness_s = liveness_s
        self.decode_step_deadline_s = decode_step_deadline_s
        self.decode_slots = max(1, decode_slots)
        self.republish = republish
        self._republished: dict[int, float] = {}  # version -> when it was published again
        self.wait_s = wait_s
        self.report = report or _log.warning
        self.log = log
        self.samples = samples
        self.sampling = sampling
        self.counters = counters
        for key in ("reused", "regenerated"):
            counters.setdefault(key, 0)
        self.worker_versions = [-1] * len(self.workers)  # the version each worker loaded last
        self.busy_s = [0.0] * len(self.workers)
        self.failure: str | None = None  # set, the run stops (resume later)
        self.lost = 0  # times a worker stopped answering (and its requests moved)
        self._down_since: dict[int, float] = {}  # silent workers: since when
        self._closing = threading.Event()
        self._jobs: queue.PriorityQueue[_Job] = queue.PriorityQueue()
        self._lock = threading.Lock()  # batches' rollouts, filled by the worker threads
        self._republish_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # -- threads ------------------------------------------------------------------------------
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

    def _work(self, i: int) -> None:
        client = self.workers[i]
        while True:
            job = self._jobs.get()
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

    def _run(self, i: int, client: Any, job: _Job, done: set[str]) -> None:
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

    def _generate(self, i: int, client: Any, job: _Job, done: set[str]) -> None:
        t_loaded = time.perf_counter()
        retry, finished = [], []
        if self.liveness_s > 0:
            deadline_s, why = self.generate_deadline(job.requests)
            watch = Watch(
                self._name(i, client),
                client.status_details,
                **self._live(),
                deadline_s=deadline_s,
                deadline_why=why,
            )
            stream = client.generate(job.requests, version=job.version, watch=watch)
        else:
            stream = client.generate(job.requests, version=job.version)
        try:
            for rollout in stream:
                if rollout.finish_reason in FINAL_REASONS:
                    finished.append(rollout)
                elif rollout.finish_reason == "aborted":
                    retry.append(rollout.request_id)
                else:
                    job.fail(f"request {rollout.request_id} failed on worker {i}: {rollout.error}")
        finally:  # what finished before a lost connection is kept (unless stopping)
            t_generated = time.perf_counter()
            job.timing["generate_s"] += t_generated - t_loaded
            if finished and not self._closing.is_set():
                job.deliver(finished)
                done.update(r.request_id for r in finished)
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

    def _requeue(self, job: _Job, done: set[str]) -> None:
        """A lost worker's job goes back to the queue (same priority) without what it
        finished."""
        rest = [r for r in job.requests if r.request_id not in done]
        if rest:
            self._jobs.put(dataclasses.replace(job, requests=rest))

    def _wait_for_worker(self, i: int, client: Any, error: BaseException) -> bool:
        """Worker i did not answer: until it answers its status again (True: it rejoins and
        loads its next job's version), the pool stops (False), or every worker has been
        silent for `wait_s` (False, with `failure` set)."""
        address = getattr(client, "address", "?")
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
            return True
        return False

    # -- batches ------------------------------------------------------------------------------
    def request(self, prompt: Prompt, sample_index: int, version: int) -> GenerationRequest:
        """The request of one sample: its id (and so its PRNG key) is a function of the
        prompt key, the sample index and the version. GREEDY_SAMPLE is the prompt's greedy
        response (temperature 0, the samples' other settings)."""
        greedy = sample_index == GREEDY_SAMPLE
        return GenerationRequest(
            request_id=f"{prompt.key}/{'greedy' if greedy else f's{sample_index}'}/v{version}",
            prompt_id=prompt.key,
            sample_index=sample_index,
            prompt_tokens=prompt.tokens,
            sampling=dataclasses.replace(self.sampling, temperature=0.0)
            if greedy
            else self.sampling,
        )

    def submit(self, batch: BatchState, prompts: list[Prompt]) -> None:
        """Add `prompts` to `batch`: reuse what the rollout log has, generate the rest."""
        b, version = batch.index, batch.version
        with self._lock:
            batch.prompts.extend(prompts)
            batch.done.clear()
        logged = self.log.rollouts(b)
        missing: list[GenerationRequest] = []
        indices = batch.sample_indices
        for prompt in prompts:
            for i in indices:
                record = logged.get((prompt.key, i, version))
                if record is not None:
                    batch.rollouts[(prompt.key, i)] = record
                    self.counters["reused"] += 1
                else:
                    missing.append(self.request(prompt, i, version))
        with self._lock:
            if len(batch.rollouts) == batch.expected:
                batch.done.set()
        if not missing:
            return
        per_worker = math.ceil(len(missing) / len(self.workers))
        per_worker = len(indices) * math.ceil(per_worker / len(indices))  # whole groups
        records = {p.key: p.record for p in prompts}
        for k in range(0, len(missing), per_worker):
            requests = missing[k : k + per_worker]
            # Each job logs the records of its own prompts, next to their rollouts: once per
            # prompt, not per sample.
            job_prompts = {i: records[i] for i in {q.prompt_id for q in requests}}
            self._jobs.put(
                _Job(
                    (b, batch.rounds * 2**20 + k),
                    version,
                    requests,
                    deliver=lambda r, batch=batch, ps=job_prompts: self._deliver(batch, r, ps),
                    fail=lambda e, batch=batch: self._fail(batch, e),
                    timing=batch.timing,
                )
            )

    def _deliver(
        self, batch: BatchState, rollouts: list[Rollout], prompts: Mapping[str, PromptRecord]
    ) -> None:
        records = [rollout_record(batch.index, r) for r in rollouts]
        self.log.append_prompts(batch.index, prompts)  # for people: `rlax-tpu samples`
        self.log.append(batch.index, records)  # persisted before they can be trained on
        with self._lock:
            for record in records:
                batch.rollouts[(record.prompt_id, record.sample_index)] = record
            if len(batch.rollouts) == batch.expected:
                batch.done.set()

    def _fail(self, batch: BatchState, error: str) -> None:
        batch.error = error
        batch.done.set()

    def wait(self, batch: BatchState, stop: threading.Event) -> bool:
        """Until all of `batch`'s rollouts are in (True), or the run is stopped (False).
        Every `progress_every_s` of waiting it reports how far generation is."""
        started = last = time.monotonic()
        while not batch.done.wait(0.5):
            if stop.is_set():
                return False
            self._raise_on_failure()
            if self.progress_every_s > 0 and time.monotonic() - last >= self.progress_every_s:
                last = time.monotonic()
                rollouts = len(batch.rollouts)
                self.report(
                    f"batch {batch.index}: {rollouts} of {batch.expected} rollouts in after "
                    f"{last - started:.0f}s; {self.progress()}"
                )
        if batch.error:
            raise ControllerError(f"batch {batch.index}: {batch.error}")
        return True

    def progress(self) -> str:
        """What each worker is doing, from its status: compiling (for how long), or tokens
        generated and sequences live; "silent" for one that does not answer."""
        parts = []
        for i, client in enumerate(self.workers):
            try:
                details = client.status_details(PROGRESS_STATUS_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a worker lost or busy: the pool handles it
                parts.append(f"worker {i} silent")
                continue
            compiling = float(details.get("compiling_s", 0))
            if compiling > 0:
                parts.append(f"worker {i} compiling for {compiling:.0f}s")
            else:
                tokens = int(details.get("tokens_generated", 0))
                live = int(details.get("active_slots", 0))
                parts.append(f"worker {i}: {tokens:,} tokens generated, {live} sequences live")
        return "; ".join(parts)

    def _raise_on_failure(self) -> None:
        if self.failure:
            raise ControllerError(self.failure)

    # -- one-off generation (evaluation) -------------------------------------------------------
    def generate(
        self,
        requests: list[GenerationRequest],
        version: int,
        *,
        evaluation: bool = False,
        stop: threading.Event | None = None,
    ) -> dict[str, Rollout]:
        """The rollouts of `requests` generated with `version`, by request id, ahead of every
        batch in the queue; spread over the workers. Blocks until all are in, or raises
        Stopped once `stop` is set. `evaluation`: `version` may be any published one
        (workers load it for this only)."""
        if not requests:
            return {}
        done = threading.Event()
        got: dict[str, Rollout] = {}
        errors: list[str] = []

        def deliver(rollouts: list[Rollout]) -> None:
            with self._lock:
                got.update((rollout.request_id, rollout) for rollout in rollouts)
                if len(got) == len(requests):
                    done.set()

        def fail(error: str) -> None:
            errors.append(error)
            done.set()

        per_worker = math.ceil(len(requests) / len(self.workers))
        for k in range(0, len(requests), per_worker):
            job = _Job((-1, k), version, requests[k : k + per_worker], deliver, fail)
            job.evaluation = evaluation
            self._jobs.put(job)
        while not done.wait(0.5):
            if stop is not None and stop.is_set():
                raise Stopped(f"stopped while generating {len(requests)} requests")
            self._raise_on_failure()
        if errors:
            raise ControllerError(errors[0])
        return got
