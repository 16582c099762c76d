"""A discrete-event simulation of one run: the controller's loop, N inference workers, the
verifier pool, the trainer and the parameter server, on the timing model's durations.

The schedule is the controller's (rlax_tpu/controller/controller.py), step for step: at
step b (trainer at version b) every batch b' in [b, b + N] (and < num_steps) whose
`StalenessPolicy.generation_version(b', b)` is not None is launched, in order, as jobs of
whole groups, one per worker; a worker takes the earliest job (eval jobs first, then by
batch), loads the job's version if it holds another, generates and delivers (the samples
of a group have their prompt's length and, with share_prompt_pages, share its prefill:
`generation_s`); when batch b is complete it is verified, assembled and trained (its rows
padded, or packed: `train_s`), and the train step makes version b + 1, published when
workers may load it (every η-th) or it is the run's last. Held-out evaluations, snapshots
at reload boundaries and preemptions (a restart from the newest snapshot's checkpoint,
reusing the rollout log) are simulated too.

With in-flight weight updates (`Workload.in_flight`, staleness.InFlightPlan) the launch of
batch k opens tick k: a request that paused at its budget in an earlier tick continues in
its next one on the worker that paused it, queued when both that tick is open and the
pause is back; a worker's call takes its continuations of one version and at most one
batch job of that version together (the controller's worker thread merges them so).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import random
from collections.abc import Callable, Generator
from typing import Any

from rlax_tpu.simulator.model import (
    PreemptionConfig,
    TimingModel,
    Workload,
    generation_s,
    publish_s,
    pull_latency_s,
    swap_s,
    train_s,
    train_seq_len,
    verify_s,
)

WARMUP_STEPS = 2  # steps whose time counts as warm-up in the warm step time (as bench_e2e)
_TIMELINE_LIMIT = 50_000


# -- a small process-oriented event loop ----------------------------------------------------------
class _Event:
    """Something a process can wait for; `succeed` wakes every waiter."""

    def __init__(self) -> None:
        self.done = False
        self.value: Any = None
        self._waiters: list[Callable[[Any], None]] = []

    def succeed(self, value: Any = None) -> None:
        if self.done:
            return
        self.done, self.value = True, value
        waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake(value)

    def on_done(self, wake: Callable[[Any], None]) -> None:
        if self.done:
            wake(self.value)
        else:
            self._waiters.append(wake)


class _Loop:
    """Time and the calendar. A process is a generator yielding seconds to wait (float) or
    an `_Event` to wait for."""

    def __init__(self, start_s: float) -> None:
        self.now = start_s
        self._calendar: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, delay_s: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._calendar, (self.now + max(0.0, delay_s), self._seq, action))

    def process(self, body: Generator[Any, Any, None]) -> None:
        def advance(value: Any = None) -> None:
            try:
                waited = body.send(value)
            except StopIteration:
                return
            if isinstance(waited, _Event):
                waited.on_done(lambda v: self.at(0.0, lambda: advance(v)))
            else:
                self.at(float(waited), advance)

        self.at(0.0, advance)

    def run(self, until_s: float | None = None) -> bool:
        """Run until the calendar is empty (True) or `until_s` is reached (False)."""
        while self._calendar:
            if until_s is not None and self._calendar[0][0] > until_s:
                self.now = until_s
                return False
            self.now, _, action = heapq.heappop(self._calendar)
            action()
        return True


class _ParamServer:
    """Pulls of weights as fluid flows: concurrent pulls share `ps_bytes_per_s` fairly
    (water-filling), each capped by its own link; the first pull of a version, which
    shares the server with the version's storage write, at `first_pull_bytes_per_s`."""

    def __init__(self, loop: _Loop, timing: TimingModel) -> None:
        self.loop, self.timing = loop, timing
        self._flows: dict[int, list] = {}  # id -> [remaining bytes, cap, event, rate]
        self._next_id = 0
        self._token = 0
        self._last = loop.now
        self._pulled: set[int] = set()

    def pull(self, version: int, nbytes: float) -> _Event:
        t = self.timing
        first = version not in self._pulled
        self._pulled.add(version)
        cap = t.first_pull_bytes_per_s if first else t.pull_bytes_per_s
        done = _Event()
        self._advance()
        self._next_id += 1
        self._flows[self._next_id] = [nbytes, cap, done, 0.0]
        self._reschedule()
        return done

    def _advance(self) -> None:
        elapsed = self.loop.now - self._last
        for flow in self._flows.values():
            flow[0] -= flow[3] * elapsed
        self._last = self.loop.now

    def _reschedule(self) -> None:
        # Done: nothing left, or less than a nanosecond of it (float rounding on large sizes).
        for key in [k for k, f in self._flows.items() if f[0] <= max(1e-6, f[3] * 1e-9)]:
            self._flows.pop(key)[2].succeed()
        if not self._flows:
            return
        aggregate = self.timing.ps_bytes_per_s or math.inf
        order = sorted(self._flows.values(), key=lambda f: f[1])
        for i, flow in enumerate(order):
            flow[3] = min(flow[1], aggregate / (len(order) - i))
            aggregate -= flow[3]
        soonest = min(f[0] / f[3] for f in self._flows.values())
        self._token += 1
        token = self._token

        def wake() -> None:
            if token == self._token:
                self._advance()
                self._reschedule()

        self.loop.at(soonest, wake)


class _Host:
    """Components sharing one machine's cores (`TimingModel.host_cores` > 0): each piece of
    work is a fluid job demanding some cores; while the demands exceed the cores, every
    job slows down in proportion (processor sharing), at `contention_efficiency` of the
    cores. With host_cores = 0 every component has its own hardware and work takes its
    duration."""

    def __init__(self, loop: _Loop, timing: TimingModel) -> None:
        self.loop, self.timing = loop, timing
        self._jobs: dict[int, list] = {}  # id -> [remaining s at full speed, demand, event]
        self._rate = 1.0
        self._next_id = 0
        self._token = 0
        self._last = loop.now

    def work(self, seconds: float, demand: float) -> Any:
        if self.timing.host_cores <= 0 or seconds <= 0 or demand <= 0:
            return seconds
        self._advance()
        done = _Event()
        self._next_id += 1
        self._jobs[self._next_id] = [seconds, demand, done]
        self._reschedule()
        return done

    def _advance(self) -> None:
        elapsed = self.loop.now - self._last
        for job in self._jobs.values():
            job[0] -= self._rate * elapsed
        self._last = self.loop.now

    def _reschedule(self) -> None:
        for key in [k for k, j in self._jobs.items() if j[0] <= 1e-9]:
            self._jobs.pop(key)[2].succeed()
        if not self._jobs:
            return
        t = self.timing
        demand = sum(j[1] for j in self._jobs.values())
        cores = t.host_cores * (t.contention_efficiency if demand > t.host_cores else 1.0)
        self._rate = min(1.0, cores / demand)
        soonest = min(j[0] for j in self._jobs.values()) / self._rate
        self._token += 1
        token = self._token

        def wake() -> None:
            if token == self._token:
                self._advance()
                self._reschedule()

        self.loop.at(soonest, wake)


# -- the run ---------------------------------------------------------------------------------
@dataclasses.dataclass
class SimResult:
    """What a simulated run did. Times are seconds since the run started."""

    num_steps: int
    num_workers: int
    wall_s: float = 0.0
    step_end_s: dict[int, float] = dataclasses.field(default_factory=dict)  # step s -> time
    evals: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    trainer_busy_s: float = 0.0
    worker_busy_s: list[float] = dataclasses.field(default_factory=list)
    consumed: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # b -> (v, n)
    rollouts_generated: int = 0
    rollouts_discarded: int = 0
    tokens_generated: int = 0  # response tokens of the training batches' calls
    # Those tokens by staleness: the batch − the version that generated the token.
    token_staleness: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    continuations: int = 0  # calls of a request after a pause (in-flight updates)
    reloads: int = 0
    preemptions: list[float] = dataclasses.field(default_factory=list)
    lost_s: float = 0.0  # restart time plus work thrown away by preemptions
    timeline: list[tuple[str, str, float, float]] = dataclasses.field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.step_end_s)

    @property
    def step_time_s(self) -> float:
        """Mean wall seconds per step, everything included."""
        return self.wall_s / self.steps if self.steps else math.inf

    @property
    def warm_step_time_s(self) -> float:
        """Seconds per step after the first WARMUP_STEPS steps, evaluations taken out (what
        tools/bench_e2e.py reports as 1 / steps_per_s)."""
        last = max(self.step_end_s, default=0)
        if last <= WARMUP_STEPS:
            return self.step_time_s
        span = self.step_end_s[last] - self.step_end_s[WARMUP_STEPS]
        span -= sum(e - s for k, (s, e) in self.evals.items() if WARMUP_STEPS <= k < last)
        return span / (last - WARMUP_STEPS)

    @property
    def trainer_idle_fraction(self) -> float:
        return max(0.0, 1 - self.trainer_busy_s / self.wall_s) if self.wall_s else 0.0

    @property
    def generation_tokens_per_s(self) -> float:
        """Response tokens of the training batches per wall second."""
        return self.tokens_generated / self.wall_s if self.wall_s else 0.0

    @property
    def worker_idle_fraction(self) -> float:
        busy = sum(self.worker_busy_s)
        return max(0.0, 1 - busy / (self.wall_s * self.num_workers)) if self.wall_s else 0.0

    def staleness_histogram(self) -> dict[int, int]:
        """Rollouts trained on, by staleness (batch − generating version)."""
        hist: dict[int, int] = collections.Counter()
        for b, (version, n) in self.consumed.items():
            hist[b - version] += n
        return dict(sorted(hist.items()))

    @property
    def staleness_mean(self) -> float:
        hist = self.staleness_histogram()
        total = sum(hist.values())
        return sum(s * n for s, n in hist.items()) / total if total else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.staleness_histogram(), default=0)

    def time_to_step(self, step: int) -> float:
        """When step `step` finished training (the version it published was out)."""
        return self.step_end_s.get(step, math.inf)

    def time_to_eval(self, step: int) -> float:
        """When the evaluation at `step` finished (tools/bench_e2e.py's time to target)."""
        return self.evals[step][1] if step in self.evals else math.inf

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "wall_s": self.wall_s,
            "step_time_s": self.step_time_s,
            "warm_step_time_s": self.warm_step_time_s,
            "steps_per_s": 1 / self.warm_step_time_s if self.warm_step_time_s else math.inf,
            "trainer_idle_fraction": self.trainer_idle_fraction,
            "worker_idle_fraction": self.worker_idle_fraction,
            "staleness_mean": self.staleness_mean,
            "staleness_max": self.staleness_max,
            "staleness_histogram": {str(k): v for k, v in self.staleness_histogram().items()},
            "rollouts_generated": self.rollouts_generated,
            "rollouts_consumed": sum(n for _, n in self.consumed.values()),
            "rollouts_discarded": self.rollouts_discarded,
            "tokens_generated": self.tokens_generated,
            "generation_tokens_per_s": self.generation_tokens_per_s,
            "token_staleness_max": max(self.token_staleness, default=0),
            "continuations": self.continuations,
            "reloads": self.reloads,
            "preemptions": len(self.preemptions),
            "lost_s": self.lost_s,
        }


@dataclasses.dataclass
class _Batch:
    index: int
    version: int
    expected: int
    have: int = 0
    done: _Event = dataclasses.field(default_factory=_Event)
    lengths: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (prompt, resp)


@dataclasses.dataclass
class _Request:
    """A request of a batch and its tokens so far (> 0: paused in an earlier tick)."""

    batch: _Batch
    index: int
    done_tokens: int = 0


@dataclasses.dataclass(order=True)
class _Job:
    """A share of a batch (`size` requests from `offset`) or of an evaluation, which any
    worker may take."""

    priority: tuple[int, int]
    version: int = dataclasses.field(compare=False)
    size: int = dataclasses.field(compare=False)
    batch: _Batch | None = dataclasses.field(compare=False)  # None: an evaluation job
    # An evaluation's; a batch's requests are delivered one by one (_Segment.deliver).
    deliver: Callable[[_Job], None] | None = dataclasses.field(compare=False)
    offset: int = dataclasses.field(default=0, compare=False)  # first request in the batch


@dataclasses.dataclass
class _Call:
    """One Generate call of a worker: a job, and with in-flight updates the continuations
    kept for the worker of the same version (the job may then be None)."""

    tick: int
    version: int
    job: _Job | None
    continuing: list[_Request]

    def requests(self) -> list[_Request]:
        """The batch requests of the call, continuations first."""
        job = self.job
        if job is None or job.batch is None:
            return list(self.continuing)
        return self.continuing + [_Request(job.batch, job.offset + j) for j in range(job.size)]


def split_jobs(missing: int, workers: int, group: int) -> list[int]:
    """Job sizes of a batch's `missing` requests: one job per worker of whole groups, as the
    controller splits (per worker ceil(missing / workers), rounded up to whole groups)."""
    per_worker = math.ceil(missing / workers)
    per_worker = group * math.ceil(per_worker / group)
    return [min(per_worker, missing - k) for k in range(0, missing, per_worker)]


class _Segment:
    """The run from one start (the beginning, or a resume) until it ends or is preempted."""

    def __init__(
        self,
        workload: Workload,
        timing: TimingModel,
        result: SimResult,
        *,
        start_step: int,
        start_s: float,
        logged: dict[int, tuple[int, int]],
        seed: int,
    ) -> None:
        self.w, self.t, self.r = workload, timing, result
        self.policy = workload.policy
        self.loop = _Loop(start_s)
        self.ps = _ParamServer(self.loop, timing)
        self.host = _Host(self.loop, timing)
        self.seed = seed
        self.start_step = start_step
        self.step = start_step  # the trainer's version
        self.logged = logged  # batch -> (version, rollouts) in the rollout log
        self.batches: dict[int, _Batch] = {}
        self.jobs: list[_Job] = []
        self.idle: list[int] = []  # workers waiting for a job (they add themselves)
        self.wake: dict[int, _Event] = {}
        self.versions = [-1] * workload.num_workers
        self.compiled = [False] * workload.num_workers
        self.running: dict[int, tuple[_Call, float]] = {}
        # In-flight updates: the open ticks' versions, per worker its continuations by
        # tick, and the pauses whose tick is not open yet (tick -> (worker, request)).
        self.ticks: dict[int, int] = {}
        self.kept: list[dict[int, list[_Request]]] = [{} for _ in range(workload.num_workers)]
        self.waiting: dict[int, list[tuple[int, _Request]]] = {}
        self.trainer_shapes: set[int] = set()  # padded lengths compiled since this start
        self.training_since: float | None = None
        self.snapshots: list[tuple[int, int]] = []  # (step, checkpoint step)
        self.finished = False
        self._seq = 0

    # -- bookkeeping -------------------------------------------------------------------------
    def _mark(self, who: str, what: str, start: float) -> None:
        if len(self.r.timeline) < _TIMELINE_LIMIT:
            self.r.timeline.append((who, what, start, self.loop.now))

    def _rng(self, *key: Any) -> random.Random:
        return random.Random(f"{self.seed}:" + ":".join(map(str, key)))

    # -- the controller -----------------------------------------------------------------------
    def controller(self) -> Generator[Any, Any, None]:
        w = self.w
        if self.start_step == 0 and w.evaluations:
            yield from self.evaluate(0)
        while self.step < w.num_steps:
            self.launch_ahead(self.step)
            batch = self.batches[self.step]
            yield batch.done
            t0 = self.loop.now
            rng = self._rng("verify", batch.index)
            yield self.t.verify_call_s
            verify = (
                verify_s(self.t, w.verifier_workers, batch.expected, rng) - self.t.verify_call_s
            )
            yield self.host.work(verify, self.t.verifier_cores)
            yield self.host.work(self.t.controller_step_s, self.t.controller_cores)
            self._mark("controller", "verify+assemble", t0)
            t0 = self.training_since = self.loop.now
            prompts, responses = zip(*batch.lengths, strict=True)
            duration = train_s(self.t, w, prompts, responses)
            seq = train_seq_len(w, prompts, responses)
            if seq not in self.trainer_shapes:  # a new padded length: one more compile
                duration += self.t.trainer_compile_s
                self.trainer_shapes.add(seq)
            yield self.host.work(duration, self.t.trainer_cores)
            # Around the jitted step: placement and bookkeeping, the async checkpoint's start
            # on its steps, and the publish of version b + 1 when the trainer publishes it
            # (a version workers may load, every η-th, or the run's last).
            rest = self.t.train_overhead_s
            if self.policy.publishes(self.step + 1, w.num_steps):
                rest += publish_s(self.t, w)
            if (self.step + 1) % w.checkpoint_every == 0:
                rest += self.t.checkpoint_s
            yield self.host.work(rest, self.t.io_cores)
            self.training_since = None
            self.r.trainer_busy_s += self.loop.now - t0
            self._mark("trainer", f"train {batch.index}", t0)
            self.r.consumed[batch.index] = (batch.version, batch.expected)
            del self.batches[batch.index]
            self.step += 1
            self.r.step_end_s[self.step] = self.loop.now
            if w.evaluations and w.eval_every and self.step % w.eval_every == 0:
                if self.step < w.num_steps:
                    yield from self.evaluate(self.step)
            if self.step % self.policy.reload_every == 0 or self.step == w.num_steps:
                checkpoint = (
                    self.step
                    if self.step == w.num_steps
                    else (self.step - self.step % w.checkpoint_every)
                )
                self.snapshots.append((self.step, checkpoint))
                yield self.t.snapshot_s
        if w.evaluations and w.num_steps not in self.r.evals:
            yield from self.evaluate(w.num_steps)
        self.finished = True

    def launch_ahead(self, step: int) -> None:
        b = step
        while b < self.w.num_steps and b < step + self.policy.max_staleness + 1:
            if b not in self.batches:
                version = self.policy.generation_version(b, step)
                if version is None:
                    break
                self.launch(b, version)
            b += 1

    def launch(self, b: int, version: int) -> None:
        w = self.w
        batch = _Batch(b, version, w.batch_size)
        rng = self._rng("lengths", b, version)  # a regenerated rollout is the same rollout
        # Group by group: one prompt length per group, its samples' (so a group's samples
        # can share their prompt's prefill); samples_per_prompt 1 draws as before.
        for _ in range(batch.expected // w.samples_per_prompt):
            prompt = w.prompt_tokens.tokens(rng)
            batch.lengths += [
                (prompt, w.response_tokens.tokens(rng)) for _ in range(w.samples_per_prompt)
            ]
        self.batches[b] = batch
        self.ticks[b] = version
        for worker, request in self.waiting.pop(b, []):
            self._keep(worker, b, request)
        reused = 0
        if b in self.logged:
            logged_version, count = self.logged.pop(b)
            if logged_version == version:
                reused = count
            else:  # generated with another version before the restart: never trained on
                self.r.rollouts_discarded += count
        batch.have = reused
        missing = batch.expected - reused
        if missing == 0:
            batch.done.succeed()
            return
        offset = reused
        for k, size in enumerate(split_jobs(missing, w.num_workers, w.samples_per_prompt)):
            self.put(_Job((b, k), version, size, batch, None, offset))
            offset += size

    def deliver(self, worker: int, version: int, requests: list[_Request], new: list[int]) -> None:
        """A call's batch requests are back: each finished, or paused at its budget and
        continued in its next tick on this worker."""
        plan = self.w.in_flight
        for request, tokens in zip(requests, new, strict=True):
            batch = request.batch
            self.r.tokens_generated += tokens
            self.r.token_staleness[batch.index - version] += tokens
            request.done_tokens += tokens
            if request.done_tokens < batch.lengths[request.index][1]:
                assert plan is not None  # only a budget pauses a request
                tick = plan.tick(batch.index, request.done_tokens)
                if tick in self.ticks:
                    self._keep(worker, tick, request)
                else:
                    self.waiting.setdefault(tick, []).append((worker, request))
                continue
            batch.have += 1
            self.r.rollouts_generated += 1
            if batch.have == batch.expected:
                batch.done.succeed()

    def _keep(self, worker: int, tick: int, request: _Request) -> None:
        """Queue a paused request's continuation for the worker that paused it (its tick
        is open: the tick's version is published)."""
        self.kept[worker].setdefault(tick, []).append(request)
        if worker in self.idle:
            self.idle.remove(worker)
            self.wake.pop(worker).succeed()

    def evaluate(self, version: int) -> Generator[Any, Any, None]:
        w = self.w
        start = self.loop.now
        done = _Event()
        remaining = [w.eval_size]

        def deliver(job: _Job) -> None:
            remaining[0] -= job.size
            if remaining[0] == 0:
                done.succeed()

        per_worker = math.ceil(w.eval_size / w.num_workers)
        for k in range(0, w.eval_size, per_worker):
            self.put(_Job((-1, k), version, min(per_worker, w.eval_size - k), None, deliver))
        yield done
        verify = verify_s(self.t, w.verifier_workers, w.eval_size, self._rng("eval", version))
        yield self.host.work(verify, self.t.verifier_cores)
        self.r.evals[version] = (start, self.loop.now)
        self._mark("controller", f"eval {version}", start)

    # -- workers ------------------------------------------------------------------------------
    def put(self, job: _Job) -> None:
        heapq.heappush(self.jobs, job)
        if self.idle:
            worker = self.idle.pop(0)
            self.wake.pop(worker).succeed()

    def take(self, i: int) -> _Call:
        """Worker i's next call: the earliest of the shared jobs and its continuations; with
        a batch's work, its continuations of that version and at most one batch job of it."""
        kept = self.kept[i]
        tick = min(kept, default=None)
        if tick is None or (self.jobs and self.jobs[0].priority < (tick, -1)):
            job = heapq.heappop(self.jobs)
            if job.batch is None or not kept:
                return _Call(job.priority[0], job.version, job, [])
            tick, version = job.priority[0], job.version
        else:
            version = self.ticks[tick]
            shared = (j for j in self.jobs if j.batch is not None and j.version == version)
            job = min(shared, default=None)
            if job is not None:
                self.jobs.remove(job)
                heapq.heapify(self.jobs)
        continuing = [r for k in sorted(kept) if self.ticks[k] == version for r in kept.pop(k)]
        return _Call(tick, version, job, continuing)

    def worker(self, i: int) -> Generator[Any, Any, None]:
        w, t = self.w, self.t
        while True:
            if not self.jobs and not self.kept[i]:
                if i not in self.idle:
                    self.idle.append(i)
                self.wake[i] = _Event()
                yield self.wake[i]
                continue
            call = self.take(i)
            t0 = self.loop.now
            self.running[i] = (call, t0)
            if self.versions[i] != call.version:
                yield self.host.work(pull_latency_s(t, w), t.io_cores)
                yield self.ps.pull(call.version, w.model_bytes * t.pull_fraction)
                yield self.host.work(swap_s(t, w), t.io_cores)
                self.versions[i] = call.version
                self.r.reloads += 1
                self._mark(f"worker {i}", f"load v{call.version}", t0)
            t1 = self.loop.now
            compile_s = 0.0 if self.compiled[i] else t.worker_compile_s
            self.compiled[i] = True
            job = call.job
            evaluation = job is not None and job.batch is None
            if evaluation:  # greedy, the task's lengths
                assert job is not None
                rng = self._rng("eval", job.version, job.priority[1])
                lengths = [
                    (w.prompt_tokens.tokens(rng), w.response_tokens.tokens(rng))
                    for _ in range(job.size)
                ]
                duration = generation_s(t, w, [p for p, _ in lengths], [r for _, r in lengths])
            else:
                requests = call.requests()
                lengths = [r.batch.lengths[r.index] for r in requests]
                done = [r.done_tokens for r in requests]
                new = [
                    w.new_tokens(r.batch.index, n, d)
                    for r, (_, n), d in zip(requests, lengths, done, strict=True)
                ]
                self.r.continuations += len(call.continuing)
                # A request's group: its batch's index and its prompt's in the batch.
                groups = [(r.batch.index, r.index // w.samples_per_prompt) for r in requests]
                duration = generation_s(t, w, [p for p, _ in lengths], new, done, groups)
            yield self.host.work(compile_s + duration, t.worker_cores)
            self._mark(f"worker {i}", "eval" if evaluation else f"gen {call.tick}", t1)
            del self.running[i]
            self.r.worker_busy_s[i] += self.loop.now - t0
            if evaluation:
                assert job is not None and job.deliver is not None
                job.deliver(job)
            else:
                self.deliver(i, call.version, requests, new)

    # -- the segment ---------------------------------------------------------------------------
    def run(self, until_s: float | None) -> bool:
        self.loop.process(self.controller())
        for i in range(self.w.num_workers):
            self.loop.process(self.worker(i))
        self.loop.run(until_s)
        if not self.finished:
            now = self.loop.now
            for i, (call, t0) in self.running.items():  # in flight at the preemption: lost
                self.r.worker_busy_s[i] += now - t0
                self.r.rollouts_discarded += len(call.requests())
            # Paused requests waiting for their next tick are lost with their tokens.
            self.r.rollouts_discarded += sum(len(r) for kept in self.kept for r in kept.values())
            self.r.rollouts_discarded += sum(len(r) for r in self.waiting.values())
            if self.training_since is not None:
                self.r.trainer_busy_s += now - self.training_since
        return self.finished


def simulate(
    workload: Workload,
    timing: TimingModel,
    *,
    preemption: PreemptionConfig | None = None,
    seed: int = 0,
    max_restarts: int = 1000,
) -> SimResult:
    """Simulate the whole run (through preemptions and restarts)."""
    preemption = preemption or PreemptionConfig()
    result = SimResult(
        num_steps=workload.num_steps,
        num_workers=workload.num_workers,
        worker_busy_s=[0.0] * workload.num_workers,
    )
    rng = random.Random(f"{seed}:preemptions")
    start_step, start_s = 0, 0.0
    logged: dict[int, tuple[int, int]] = {}
    for _ in range(max_restarts + 1):
        until = None
        if preemption.per_hour > 0:
            until = start_s + rng.expovariate(preemption.per_hour / 3600.0)
        segment = _Segment(
            workload,
            timing,
            result,
            start_step=start_step,
            start_s=start_s,
            logged=logged,
            seed=seed,
        )
        if segment.run(until):
            result.wall_s = segment.loop.now
            return result
        # Preempted at `until`: resume from the newest snapshot's checkpoint (or, with a
        # notice, the step reached), after the restart.
        assert until is not None
        result.preemptions.append(until)
        reached = segment.step
        if preemption.notice:  # SIGTERM first: the final snapshot checkpoints `reached`
            resume = reached
        else:  # the newest snapshot's checkpoint (none newer than the resume point: it)
            resume = max([start_step] + [c for _, c in segment.snapshots])
        kept_until = max(start_s, result.step_end_s.get(resume, start_s))
        result.lost_s += preemption.restart_s + (until - kept_until)
        for s in [s for s in result.step_end_s if s > resume]:
            del result.step_end_s[s]
        for s in [s for s in result.evals if s > resume]:
            del result.evals[s]
        logged = {}
        for b, batch in segment.batches.items():  # generated, not yet trained
            if batch.have:
                logged[b] = (batch.version, batch.have)
        for b in [b for b in result.consumed if b >= resume]:  # trained, to be redone
            version, n = result.consumed.pop(b)
            logged[b] = (version, n)
        if not preemption.reuse_rollout_log:
            result.rollouts_discarded += sum(n for _, n in logged.values())
            logged = {}
        start_step, start_s = resume, until + preemption.restart_s
    raise RuntimeError(f"more than {max_restarts} preemptions: lower preemption.per_hour")
