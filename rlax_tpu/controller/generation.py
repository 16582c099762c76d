"""The generation pool: a run's batches and evaluations as jobs for the inference workers.

A batch's requests go into one priority queue (the batch the trainer waits for first,
evaluations before everything), split into jobs of whole groups; each worker thread takes a
job, loads its version if the worker holds another, generates it and hands the finished
rollouts over. A rollout aborted by a reload is regenerated (its request id, and so its
tokens, are the same). Finished rollouts are written to the rollout log before anything can
train on them (with the dataset records of their prompts, for people reading the log), and
a batch first takes what the log already holds (a resumed run).

The threads that drive the workers, and how a lost worker's requests move to the
others, are controller/workers.py (`WorkerThreads`). A request's tokens do not depend on
which worker serves it, so the run's results do not change.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from rlax_tpu.api.inference import GenerationRequest, Partial, Rollout
from rlax_tpu.api.records import Group, Judgement, RolloutKey, RolloutRecord, ScoredRollout
from rlax_tpu.controller.episodes import Episodes, Turn, TurnLog
from rlax_tpu.controller.errors import ControllerError
from rlax_tpu.controller.snapshots import RolloutLog
from rlax_tpu.controller.workers import TIMINGS, Job, WorkerThreads
from rlax_tpu.data.datasets import PromptRecord
from rlax_tpu.staleness import InFlightPlan

_log = logging.getLogger(__name__)

# The sample index of a prompt's greedy response (ReMax's baseline, `BatchState.greedy`):
# logged, judged and keyed like the K samples, never trained on.
GREEDY_SAMPLE = -1


TURN_SUFFIX = "/turn"  # an episode's turn n > 1 is requested as "<first request's id>/turn<n>"


def episode_root(request_id: str) -> str:
    """The id of the episode's first request, whichever turn's id this is: only a trailing
    "/turn<digits>" is cut (a dataset id may hold "/turn" itself)."""
    root, sep, n = request_id.rpartition(TURN_SUFFIX)
    return root if sep and n.isdigit() else request_id


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
        default_factory=lambda: dict.fromkeys(TIMINGS, 0.0)
    )
    greedy: bool = False
    # The verdicts the rollout log held for this batch when it was first submitted (an
    # earlier process's, on resume), read then, before this process writes any of the
    # batch's files; None: not submitted yet (read when judging).
    logged_judgements: dict[RolloutKey, Judgement] | None = None

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


# How long a progress line waits for a worker's status.
PROGRESS_STATUS_TIMEOUT_S = 2.0


class Stopped(Exception):
    """The run was stopped (SIGTERM / Ctrl-C) while the controller waited for generation."""


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
        token_versions=rollout.token_versions,
        loss_mask=rollout.loss_mask,
    )


@dataclasses.dataclass(frozen=True)
class _EpisodeRun:
    """Where a set of episodes' results go: a batch's (steps logged, rollouts delivered to
    it) or an evaluation's (nothing logged: it is measured again after a restart)."""

    record_of: Callable[[str], PromptRecord]  # an episode's dataset record, by prompt id
    finish: Callable[[Rollout, PromptRecord], None]  # the episode's rollout, when it ends
    fail: Callable[[str], None]
    log: Callable[[Turn], None] | None  # a step, before its next turn is queued
    priority: int
    version: int
    timing: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(TIMINGS, 0.0)
    )
    evaluation: bool = False

    def deliver(self, rollouts: list[Rollout]) -> None:
        """A job's finished rollouts when it has no turn handler (`Job.deliver`)."""
        for rollout in rollouts:
            self.finish(rollout, self.record_of(rollout.prompt_id))


class GenerationPool:
    """A run's batches (and evaluations) as jobs for the worker threads (`WorkerThreads`).

    The threads' `counters` are the run's snapshotted accounting: `reused` (rollouts taken
    from the log) is counted into them here, `regenerated` by the threads.
    `progress_every_s`: how often a wait reports how far generation is (0: never).

    `episodes` (controller.environment): each request is an episode's first turn; a turn
    that ends is handed to the episode's environment (on a thread of its own, tools may take
    long), whose step is logged before the next turn is queued on the worker that parked
    the episode's pages; the episode's last turn is its rollout."""

    def __init__(
        self,
        threads: WorkerThreads,
        log: RolloutLog,
        *,
        samples: int,
        progress_every_s: float = 10.0,
        in_flight: InFlightPlan | None = None,
        episodes: Episodes | None = None,
        episode_threads: int = 8,
    ) -> None:
        self.threads = threads
        self.progress_every_s = progress_every_s  # 0: no progress lines while waiting
        self.report = threads.report
        self.log = log
        self.samples = samples
        self.sampling = threads.sampling
        self.counters = threads.counters
        self.counters.setdefault("reused", 0)
        self._lock = threading.Lock()  # batches' rollouts, filled by the worker threads
        # Mixed-version rollouts: the ticks whose version is out (their batch launched), and
        # the continuations waiting for theirs, with the worker holding their parked KV.
        self.in_flight = in_flight
        self._open_ticks: dict[int, int] = {}  # tick -> its version
        self._held: dict[int, list[tuple[BatchState, GenerationRequest, int | None]]] = {}
        if in_flight is not None:
            self.counters.setdefault("continued", 0)
        self.episodes = episodes
        if episodes is not None:
            # A turn also ends at the template's end-of-turn token (and the pages stay), and
            # no turn runs past the episode's token limit (a request's max_new_tokens counts
            # its partial's tokens: the episode's so far).
            stops = (*self.sampling.stop_token_ids, *episodes.stop_token_ids)
            self.sampling = dataclasses.replace(
                self.sampling,
                stop_token_ids=tuple(dict.fromkeys(stops)),
                max_new_tokens=min(self.sampling.max_new_tokens, episodes.limits.max_total_tokens),
            )
            self.turn_log = TurnLog(log.directory)
            self._steps = concurrent.futures.ThreadPoolExecutor(
                episode_threads, thread_name_prefix="episode-steps"
            )
            # Each live episode's logged steps, by (prompt key, sample index, version).
            self._episode_turns: dict[tuple[str, int, int], list[Turn]] = {}
            # Every logged step of each batch, by episode: what its step's metrics read,
            # kept here as they are logged (seeded from the log when a batch is submitted),
            # so a step does not read its turn files back.
            self._logged_turns: dict[int, dict[tuple[str, int, int], list[Turn]]] = {}
            for key in ("episodes", "episode_turns", "tool_calls"):
                self.counters.setdefault(key, 0)

    # -- the worker threads ---------------------------------------------------------------------
    def start(self) -> None:
        self.threads.start()

    def stop(self) -> None:
        """Stop the worker threads (WorkerThreads.stop), and the episode steps."""
        self.threads.stop()
        if self.episodes is not None:
            self._steps.shutdown(wait=True, cancel_futures=True)

    @property
    def workers(self) -> list[Any]:
        return self.threads.workers

    @property
    def worker_versions(self) -> list[int]:
        """The version each worker loaded last (-1: none, or lost)."""
        return self.threads.worker_versions

    def loaded(self, i: int, version: int) -> None:
        """Worker i holds `version` (WorkerThreads.loaded)."""
        self.threads.loaded(i, version)

    @property
    def busy_s(self) -> list[float]:
        """Seconds each worker's thread spent on jobs."""
        return self.threads.busy_s

    @property
    def failure(self) -> str | None:
        """Why the pool failed (set, the run stops), else None."""
        return self.threads.failure

    @property
    def lost(self) -> int:
        """Times a worker stopped answering (and its requests moved)."""
        return self.threads.lost

    # -- batches ------------------------------------------------------------------------------
    def request(
        self, prompt: Prompt, sample_index: int, version: int, batch: int | None = None
    ) -> GenerationRequest:
        """The request of one sample: its id (and so its PRNG key) is a function of the
        prompt key, the sample index and the version. GREEDY_SAMPLE is the prompt's greedy
        response (temperature 0, the samples' other settings). With in-flight updates, a
        request of `batch` generates at most its first tick's tokens."""
        greedy = sample_index == GREEDY_SAMPLE
        budget = 0 if self.in_flight is None or batch is None else self.in_flight.budget(batch, 0)
        return GenerationRequest(
            request_id=f"{prompt.key}/{'greedy' if greedy else f's{sample_index}'}/v{version}",
            prompt_id=prompt.key,
            sample_index=sample_index,
            prompt_tokens=prompt.tokens,
            sampling=dataclasses.replace(self.sampling, temperature=0.0)
            if greedy
            else self.sampling,
            max_tokens=budget,
            keep_pages=self.episodes is not None,
        )

    def continuation(
        self, batch: int, base: GenerationRequest, paused: Rollout | RolloutRecord
    ) -> GenerationRequest:
        """The next call of request `base`, `paused` at its tick's budget: the same prompt
        and sampling key, its tokens so far as the partial, the budget of its next tick. Its
        id is the first call's with the tokens so far ("<id>/t<n>"), so each call is
        idempotent on its own."""
        n = len(paused.tokens)
        root = base.request_id if base.partial is None else base.request_id.rsplit("/t", 1)[0]
        return dataclasses.replace(
            base,
            request_id=f"{root}/t{n}",
            partial=Partial.of(paused),
            max_tokens=self.in_flight.budget(batch, n),
        )

    def submit(self, batch: BatchState, prompts: list[Prompt]) -> None:
        """Add `prompts` to `batch`: reuse what the rollout log has, generate the rest."""
        b, version = batch.index, batch.version
        with self._lock:
            batch.prompts.extend(prompts)
            batch.done.clear()
        logged = self.log.rollouts(b)
        if batch.logged_judgements is None:
            batch.logged_judgements = self.log.judgements(b)
        partials = self.log.partials(b) if self.in_flight is not None else {}
        stepped = self.turn_log.turns(b) if self.episodes is not None else {}
        if self.episodes is not None:
            with self._lock:
                self._logged_turns[b] = {k: list(v) for k, v in stepped.items()}
        missing: list[GenerationRequest] = []
        carried: list[tuple[GenerationRequest, Rollout]] = []
        episodes: list[tuple[GenerationRequest, list[Turn]]] = []
        indices = batch.sample_indices
        for prompt in prompts:
            for i in indices:
                record = logged.get((prompt.key, i, version))
                if record is not None:
                    batch.rollouts[(prompt.key, i)] = record
                    self.counters["reused"] += 1
                elif (prompt.key, i, version) in stepped:  # a resumed run's episode goes on
                    episodes.append(
                        (self.request(prompt, i, version, b), stepped[(prompt.key, i, version)])
                    )
                elif (prompt.key, i, version) in partials:  # a resumed run carries it on
                    carried.append(
                        (self.request(prompt, i, version, b), partials[(prompt.key, i, version)])
                    )
                else:
                    missing.append(self.request(prompt, i, version, b))
        with self._lock:
            if len(batch.rollouts) == batch.expected:
                batch.done.set()
        for base, partial in carried:
            self._carry_on(batch, base, partial, None)
        for base, turns in episodes:
            with self._lock:
                self._episode_turns[(base.prompt_id, base.sample_index, version)] = turns
            self._next_turn(self._batch_run(batch), base, turns[-1], None)
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
            self.threads.put(
                Job(
                    (b, batch.rounds * 2**20 + k),
                    version,
                    requests,
                    deliver=lambda r, batch=batch, ps=job_prompts: self._deliver(batch, r, ps),
                    fail=lambda e, batch=batch: self._fail(batch, e),
                    timing=batch.timing,
                    pause=self._pause_handler(batch, requests),
                    turn=self._turn_handler(self._batch_run(batch), requests),
                )
            )

    # -- multi-turn episodes --------------------------------------------------------------
    def _log_turn(self, b: int, turn: Turn) -> None:
        self.turn_log.append(b, turn)
        with self._lock:
            episode = (turn.prompt_id, turn.sample_index, turn.version)
            self._logged_turns.setdefault(b, {}).setdefault(episode, []).append(turn)

    def logged_turns(self, b: int) -> dict[tuple[str, int, int], list[Turn]]:
        """Batch `b`'s logged steps by episode, in turn order, once (for its step's metrics:
        then forgotten); from the turn log when this pool did not submit the batch."""
        with self._lock:
            turns = self._logged_turns.pop(b, None)
        if turns is None:
            return self.turn_log.turns(b)
        return {k: sorted(v, key=lambda t: t.turn) for k, v in turns.items()}

    def _batch_run(self, batch: BatchState) -> _EpisodeRun:
        """A batch's episodes: steps logged, finished rollouts delivered to the batch."""
        return _EpisodeRun(
            record_of=lambda pid: next(p.record for p in batch.prompts if p.key == pid),
            finish=lambda rollout, record: self._deliver(
                batch, [rollout], {rollout.prompt_id: record}
            ),
            fail=lambda error: self._fail(batch, error),
            log=lambda turn: self._log_turn(batch.index, turn),
            priority=batch.index,
            version=batch.version,
            timing=batch.timing,
        )

    def _turn_handler(self, run: _EpisodeRun | None, requests: list[GenerationRequest]):
        if self.episodes is None or run is None:
            return None
        by_id = {r.request_id: r for r in requests}

        def turned(rollouts: list[Rollout], worker: int) -> None:
            for rollout in rollouts:
                base = by_id[rollout.request_id]
                self._steps.submit(self._step_episode, run, base, rollout, worker)

        return turned

    def _step_episode(
        self, run: _EpisodeRun, base: GenerationRequest, rollout: Rollout, worker: int
    ) -> None:
        """(an episode thread) Step the environment with the turn `rollout` ended; log the
        step and queue the next turn, or hand the episode's rollout over when it is over."""
        try:
            key = (rollout.prompt_id, rollout.sample_index, rollout.version)
            record = run.record_of(rollout.prompt_id)
            with self._lock:
                turns = self._episode_turns.setdefault(key, [])
            outcome = self.episodes.step(rollout, record, turns)
            with self._lock:
                self.counters["episode_turns"] += 1
                if outcome.result is not None:
                    self.counters["tool_calls"] += len(outcome.result.info.get("verdicts", ()))
            if outcome.done:
                with self._lock:
                    self._episode_turns.pop(key, None)
                    self.counters["episodes"] += 1
                self.threads.ended(worker, key)  # its last turn's parked pages can go
                run.finish(rollout, record)
                return
            if run.log is not None:
                run.log(outcome.turn)  # before the next turn can run
            turns.append(outcome.turn)
            self._next_turn(run, base, outcome.turn, worker)
        except Exception as e:  # noqa: BLE001 - the batch fails, and with it the run, loudly
            _log.exception("episode step failed")
            run.fail(f"episode {rollout.prompt_id!r} sample {rollout.sample_index}: {e}")

    def _next_turn(
        self, run: _EpisodeRun, base: GenerationRequest, turn: Turn, worker: int | None
    ) -> None:
        """Queue the turn after `turn`: the same prompt and sampling key, the partial with the
        observation, on `worker` (its parked pages; None: any). Its id is the episode's
        first request's with the turn ("<id>/turn<n>")."""
        root = episode_root(base.request_id)
        request = dataclasses.replace(
            base,
            request_id=f"{root}{TURN_SUFFIX}{turn.turn + 1}",
            partial=turn.partial,
            keep_pages=True,
            max_tokens=0,
        )
        job = Job(
            (run.priority, 2**41 + turn.turn),
            run.version,
            [request],
            deliver=run.deliver,
            fail=run.fail,
            timing=run.timing,
            turn=self._turn_handler(run, [request]),
            worker=worker,
        )
        job.evaluation = run.evaluation
        self.threads.put(job)

    # -- mixed-version rollouts: ticks and continuations -----------------------------------
    def open_tick(self, tick: int, version: int) -> None:
        """Batch `tick` is launched with `version`: the continuations due in this tick go to
        the workers with it (those paused later go at once)."""
        if self.in_flight is None:
            return
        with self._lock:
            self._open_ticks[tick] = version
            held = self._held.pop(tick, [])
        self._queue_continuations(tick, held)

    def _pause_handler(self, batch: BatchState, requests: list[GenerationRequest]):
        if self.in_flight is None:
            return None
        by_id = {r.request_id: r for r in requests}
        return lambda rollouts, worker: self._paused(batch, by_id, rollouts, worker)

    def _paused(
        self,
        batch: BatchState,
        requests: Mapping[str, GenerationRequest],
        rollouts: list[Rollout],
        worker: int,
    ) -> None:
        """Rollouts that stopped at their tick's budget: logged (a resumed run carries them
        on from there), then continued in their next tick, on the worker that parked them."""
        self.log.append_partials(batch.index, [rollout_record(batch.index, r) for r in rollouts])
        for rollout in rollouts:
            self._carry_on(batch, requests[rollout.request_id], rollout, worker)

    def _carry_on(
        self, batch: BatchState, base: GenerationRequest, paused: Rollout, worker: int | None
    ) -> None:
        request = self.continuation(batch.index, base, paused)
        tick = self.in_flight.tick(batch.index, len(paused.tokens))
        with self._lock:
            self.counters["continued"] += 1
            if tick not in self._open_ticks:
                self._held.setdefault(tick, []).append((batch, request, worker))
                return
        self._queue_continuations(tick, [(batch, request, worker)])

    def _queue_continuations(
        self, tick: int, held: list[tuple[BatchState, GenerationRequest, int | None]]
    ) -> None:
        """One job per (batch, worker) of `held`, with the version of batch `tick`."""
        version = self._open_ticks[tick]
        jobs: dict[tuple[int, int | None], list[GenerationRequest]] = {}
        owners: dict[int, BatchState] = {}
        for batch, request, worker in held:
            jobs.setdefault((batch.index, worker), []).append(request)
            owners[batch.index] = batch
        for (b, worker), requests in jobs.items():
            batch = owners[b]
            self.threads.put(
                Job(
                    (b, 2**40 + tick),
                    version,
                    requests,
                    deliver=lambda r, batch=batch: self._deliver(batch, r, {}),
                    fail=lambda e, batch=batch: self._fail(batch, e),
                    timing=batch.timing,
                    pause=self._pause_handler(batch, requests),
                    worker=worker,
                )
            )

    def _deliver(
        self, batch: BatchState, rollouts: list[Rollout], prompts: Mapping[str, PromptRecord]
    ) -> None:
        records = [rollout_record(batch.index, r) for r in rollouts]
        with self._lock:  # a prompt's record once (an episode's samples finish one by one)
            known = {prompt_id for prompt_id, _ in batch.rollouts}
        prompts = {pid: record for pid, record in prompts.items() if pid not in known}
        if prompts:
            self.log.append_prompts(batch.index, prompts)  # for people: `rlax-tpu samples`
        self.log.append(batch.index, records)  # on storage before the next snapshot
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
        records: Mapping[str, PromptRecord] | None = None,
    ) -> dict[str, Rollout]:
        """The rollouts of `requests` generated with `version`, by request id, ahead of every
        batch in the queue; spread over the workers. Blocks until all are in, or raises
        Stopped once `stop` is set. `evaluation`: `version` may be any published one
        (workers load it for this only). With episodes (controller.environment), `records`
        (the requests' dataset records by prompt id) make each request an episode, whose
        last turn's rollout is returned under the request's id (steps not logged)."""
        if not requests:
            return {}
        done = threading.Event()
        got: dict[str, Rollout] = {}
        errors: list[str] = []

        def deliver(rollouts: list[Rollout]) -> None:
            with self._lock:
                for rollout in rollouts:
                    got[episode_root(rollout.request_id)] = rollout
                if len(got) == len(requests):
                    done.set()

        def fail(error: str) -> None:
            errors.append(error)
            done.set()

        run = None
        if self.episodes is not None and records is not None:
            stops, limit = self.sampling.stop_token_ids, self.sampling.max_new_tokens
            requests = [
                dataclasses.replace(
                    r,
                    keep_pages=True,
                    sampling=dataclasses.replace(
                        r.sampling or self.sampling,
                        stop_token_ids=stops,
                        max_new_tokens=min((r.sampling or self.sampling).max_new_tokens, limit),
                    ),
                )
                for r in requests
            ]
            run = _EpisodeRun(
                record_of=records.__getitem__,
                finish=lambda rollout, _: deliver([rollout]),
                fail=fail,
                log=None,
                priority=-1,
                version=version,
                evaluation=evaluation,
            )
        per_worker = math.ceil(len(requests) / len(self.workers))
        for k in range(0, len(requests), per_worker):
            chunk = requests[k : k + per_worker]
            job = Job((-1, k), version, chunk, deliver, fail, turn=self._turn_handler(run, chunk))
            job.evaluation = evaluation
            self.threads.put(job)
        while not done.wait(0.5):
            if stop is not None and stop.is_set():
                raise Stopped(f"stopped while generating {len(requests)} requests")
            self._raise_on_failure()
        if errors:
            raise ControllerError(errors[0])
        return got
