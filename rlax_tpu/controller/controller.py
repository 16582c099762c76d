"""The controller: the one active process of a run (DESIGN §1, §2, §8).

It drives the passive components only through their clients: it draws the prompts of
batch b, has inference workers generate them with version g(b) of the staleness policy,
scores them with the verifiers, assembles a RolloutBatch and calls train_step(b). Batches
whose version is already published are generated ahead of training (as far as N allows)
by every worker at once. Every choice is a function of (config, seed, step): request ids,
PRNG keys and versions derive from (batch, prompt, sample), never from timing or from
the order replies arrive in, so a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from rlax_tpu.algorithms import RolloutBatch
from rlax_tpu.algorithms.filters import dynamic_sampling_keep
from rlax_tpu.config import RunConfig
from rlax_tpu.controller.datasets import decode_response, encode_prompt, stop_tokens
from rlax_tpu.controller.replay import Entry, ReplayBuffer
from rlax_tpu.controller.snapshots import RolloutLog, Snapshot, SnapshotError, SnapshotStore
from rlax_tpu.inference.engine import GenerationRequest
from rlax_tpu.inference.sampling import SamplingParams
from rlax_tpu.shapes import padded_seq_len
from rlax_tpu.staleness import StalenessPolicy
from rlax_tpu.verifiers.types import VerificationRequest, VerificationResult

_log = logging.getLogger(__name__)

FINAL_REASONS = ("stop", "length")
CONTROLLER_CONSUMER = "controller"


class ControllerError(RuntimeError):
    """The run cannot go on (a component failed, a prompt cannot be generated, ...)."""


class Verifier(Protocol):
    def verify_many(self, requests: Sequence[VerificationRequest]) -> list[VerificationResult]: ...


@dataclasses.dataclass
class Components:
    """The clients of the passive components the controller drives."""

    trainer: Any  # rlax_tpu.trainer.service.TrainerClient
    param_server: Any  # rlax_tpu.param_server.client.ParamServerClient
    workers: list[Any]  # rlax_tpu.inference.service.InferenceWorkerClient, one per worker
    verifier: Verifier


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt of one batch: `key` is unique per draw, so two draws of the same dataset
    row in different batches sample independently."""

    key: str  # "b<batch>:<dataset>:<id>"
    tokens: tuple[int, ...]
    record: Any  # rlax_tpu.controller.datasets.PromptRecord


@dataclasses.dataclass
class _Batch:
    """Rollouts of one batch as they arrive (by (prompt key, sample index))."""

    index: int
    version: int
    prompts: list[Prompt]
    samples: int
    rollouts: dict[tuple[str, int], dict[str, Any]] = dataclasses.field(default_factory=dict)
    rewards: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    rounds: int = 1  # dynamic sampling: rounds of prompts drawn for this batch
    error: str | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    launched_s: float = 0.0
    # Seconds the worker threads spent on this batch: loading weights, generating, logging.
    timing: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(("load_s", "generate_s", "log_s"), 0.0)
    )

    @property
    def expected(self) -> int:
        return len(self.prompts) * self.samples


@dataclasses.dataclass(order=True)
class _Job:
    """Requests for one worker: generated with exactly `version`. Ordered by batch, so
    the batch the trainer waits for goes first; eval jobs carry their step. `deliver`
    takes the job's finished rollouts at once; `timing` accumulates where its time went."""

    priority: tuple[int, int]
    version: int = dataclasses.field(compare=False)
    requests: list[GenerationRequest] = dataclasses.field(compare=False)
    deliver: Callable[[list[Any]], None] = dataclasses.field(compare=False)
    fail: Callable[[str], None] = dataclasses.field(compare=False)
    timing: dict[str, float] = dataclasses.field(
        compare=False, default_factory=lambda: dict.fromkeys(("load_s", "generate_s", "log_s"), 0.0)
    )


_STOP_JOB = _Job((2**62, 0), -1, [], lambda r: None, lambda e: None)


class Controller:
    def __init__(
        self,
        config: RunConfig,
        components: Components,
        *,
        tokenizer: Any,
        mixture: Any,
        refill: Any = None,
        eval_prompts: Sequence[Any] = (),
        metrics: Any = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
        stop: threading.Event | None = None,
        digest: str | None = None,
    ) -> None:
        self.config = config
        self.c = components
        self.tokenizer = tokenizer
        self.mixture = mixture
        # Dynamic sampling (DAPO): groups whose rewards are all equal are dropped and batch b
        # draws more prompts from `refill`, its own named stream, in batch order.
        self.dynamic = config.controller.dynamic_sampling
        if self.dynamic and refill is None:
            raise ValueError("controller.dynamic_sampling needs a refill prompt mixture")
        self.refill = refill
        ctl = config.controller
        self.replay = (
            ReplayBuffer(
                per_prompt_cap=ctl.replay_per_prompt_cap,
                global_cap=ctl.replay_global_cap,
                recency_prob=ctl.replay_recency_prob,
                reward_temperature=ctl.replay_reward_temperature,
                seed=config.seed,
            )
            if ctl.replay
            else None
        )
        self._replay_pending: list[tuple[str, Entry]] = []
        self._replay_records: dict[tuple[str, int, int], dict] = {}
        self.eval_prompts = list(eval_prompts)
        self.metrics = metrics
        self.progress = progress
        self.stop = stop or threading.Event()
        self.policy = StalenessPolicy.from_config(config.staleness)
        # Which version generates batch b. In replay mode generation lags by at most
        # replay_generation_lag versions, leaving the rest of N for reusing rollouts.
        self.generation_policy = self.policy
        if config.controller.replay:
            eta = self.policy.reload_every
            lag = min(
                self.policy.max_staleness, max(config.controller.replay_generation_lag, eta - 1)
            )
            self.generation_policy = StalenessPolicy(eta, lag, self.policy.schedule)
        self.run_dir = config.storage.run_dir
        self.snapshots = SnapshotStore(self.run_dir, config.controller.keep_snapshots)
        self.log = RolloutLog(self.run_dir)
        # The digest of the config the user ran (snapshots must match it on resume).
        self.digest = digest or config.digest()
        ctl = config.controller
        self.num_steps, self.samples = ctl.num_steps, ctl.samples_per_prompt
        stops = stop_tokens(config.inference.stop_token_ids, tokenizer)
        base = SamplingParams.from_config(config.inference)
        self.sampling = dataclasses.replace(base, stop_token_ids=tuple(stops))
        self.greedy = dataclasses.replace(self.sampling, temperature=0.0)
        self.stats: dict[str, Any] = {
            "rejected_stale": 0,
            "regenerated": 0,
            "reused": 0,
            "groups_filtered": 0,
            "groups_generated": 0,
        }
        self._batches: dict[int, _Batch] = {}
        # What a resume from step b needs, recorded as the run passes b: the main prompt
        # stream before batch b's first draw (which happens up to N steps early), and the
        # refill stream and accounting when the loop reaches step b.
        self._main_at: dict[int, dict[str, Any]] = {}
        self._refill_at: dict[int, dict[str, Any] | None] = {}
        self._replay_at: dict[int, dict[str, Any] | None] = {}
        self._stats_at: dict[int, dict[str, Any]] = {}
        self._next_draw = 0
        self._jobs: queue.PriorityQueue[_Job] = queue.PriorityQueue()
        self._worker_versions = [-1] * len(components.workers)
        self._worker_failure: str | None = None
        self._busy_s = [0.0] * len(components.workers)
        self._lock = threading.Lock()  # batches' rollouts, filled by the worker threads
        self._threads: list[threading.Thread] = []
        # Confirmations and garbage collection at snapshots (they only free memory).
        self._housekeeping = concurrent.futures.ThreadPoolExecutor(1, "controller-housekeeping")
        # The checkpoint whose versions were last found on the server's storage: snapshots
        # between checkpoints rely on the same versions, so they are checked once.
        self._persisted_for: int | None = None
        self.history: list[dict[str, Any]] = []  # per step metrics, for callers and benches
        self.evals: dict[int, float] = {}
        self.eval_elapsed_s: dict[int, float] = {}
        self._t0 = time.perf_counter()

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train batches [resume step, num_steps); returns a summary. On `stop` it writes a
        final snapshot (with a checkpoint of the step reached) and returns early."""
        start = self._resume()
        self._start_workers()
        t0 = self._t0 = time.perf_counter()
        trainer_busy = 0.0
        try:
            if start == 0 and self.replay is not None:
                self._prefill()
            if start == 0 and self.eval_prompts:
                self.evals[0] = self.evaluate(0)
                if self.metrics is not None:
                    self.metrics.write(0, {"eval_accuracy": self.evals[0]})
                if self.progress is not None:
                    self.progress({"step": 0, "eval_accuracy": self.evals[0]})
            step = start
            while step < self.num_steps:
                if self.stop.is_set():
                    break
                t_step = time.perf_counter()
                self._at_step(step)
                self._launch_ahead(step)
                batch = self._wait(step)
                if batch is not None and self.dynamic:
                    batch = self._resample(batch)
                if batch is None:  # stopped while waiting
                    break
                t_assemble = time.perf_counter()
                rows, keys, rewards, extra = self._assemble(batch)
                t_train = time.perf_counter()
                result = self.c.trainer.train_step(step, rows)
                t_trained = time.perf_counter()
                trainer_busy += t_trained - t_train
                self.log.record_consumed(step, keys)
                # Where the step's wall time went, as the controller sees it.
                extra["timing"] = {
                    **{f"time/worker_{k}": v for k, v in batch.timing.items()},
                    "time/wait_rollouts_s": t_assemble - t_step,
                    "time/verify_assemble_s": t_train - t_assemble,
                    "time/train_step_call_s": t_trained - t_train,
                    "time/controller_step_s": time.perf_counter() - t_step,
                }
                step += 1
                self._after_step(step, batch, rewards, extra, result.metrics, t0)
                if step % self.policy.reload_every == 0 or step == self.num_steps:
                    self._snapshot(step, final=step == self.num_steps)
            if step < self.num_steps:  # stopped early: keep everything done so far
                self._snapshot(step, final=True)
            elif self.eval_prompts and self.num_steps not in self.evals:
                self.evals[self.num_steps] = self.evaluate(self.num_steps)
        finally:
            self._stop_workers()
            self._housekeeping.shutdown(wait=True)
        wall = time.perf_counter() - t0
        return {
            "start_step": start,
            "end_step": step,
            "final_digest": self.version_digest(step),
            "wall_s": wall,
            "trainer_idle_fraction": max(0.0, 1 - trainer_busy / wall) if wall else 0.0,
            "worker_idle_fraction": (
                max(0.0, 1 - sum(self._busy_s) / (wall * len(self._busy_s))) if wall else 0.0
            ),
            "evals": dict(self.evals),
            # Seconds since the run (this process) started at which each evaluation finished.
            "eval_elapsed_s": dict(self.eval_elapsed_s),
            "staleness_mean": (
                float(np.mean([r["staleness_mean"] for r in self.history])) if self.history else 0.0
            ),
            "steps_per_s": (step - start) / wall if wall else 0.0,
            **self.stats,
        }

    def version_digest(self, version: int) -> str:
        """The parameter server's content digest of `version` ("" if it does not hold it)."""
        for info in self.c.param_server.list_versions().versions:
            if info.version == version:
                return info.version_digest
        return ""

    # -- resume ------------------------------------------------------------------------------------
    def _resume(self) -> int:
        """Continue from the newest snapshot whose checkpoint loads, else start at step 0."""
        snapshot = None
        for candidate in self.snapshots.candidates(self.digest):
            try:
                restored = self.c.trainer.restore(candidate.checkpoint_step)
            except Exception as e:  # noqa: BLE001 - the checkpoint is gone or broken
                _log.warning(
                    "snapshot of step %d: checkpoint %d does not load (%s); trying an older one",
                    candidate.step,
                    candidate.checkpoint_step,
                    e,
                )
                continue
            if restored != candidate.checkpoint_step:
                raise ControllerError(
                    f"asked the trainer for checkpoint {candidate.checkpoint_step}, it "
                    f"restored {restored}"
                )
            snapshot = candidate
            break
        if snapshot is None:
            if self.snapshots.steps():
                raise SnapshotError(
                    f"no snapshot in {self.snapshots.directory} is usable (each is truncated "
                    "or its trainer checkpoint does not load; snapshot steps "
                    f"{self.snapshots.steps()}); the run cannot resume without diverging: "
                    "start a new run directory"
                )
            status = self.c.trainer.status()
            if status.version != 0:
                raise ControllerError(
                    f"the trainer is at step {status.version} but the run directory has no "
                    "snapshot: a half-started run; start a new run directory"
                )
            self.c.trainer.save(wait=True)  # checkpoint 0: the first snapshot's resume point
            self._next_draw = 0
            self._main_at[0] = self.mixture.state()
            self._at_step(0)
            self._snapshot(0)
            return 0
        step = snapshot.checkpoint_step
        self._mixture_restore(snapshot.mixture)
        self.stats = dict(snapshot.stats)
        self._next_draw = step
        self._main_at[step] = self.mixture.state()
        self._at_step(step)
        _log.info(
            "resuming at step %d (snapshot of step %d, checkpoint %d)",
            step,
            snapshot.step,
            snapshot.checkpoint_step,
        )
        return step

    def _at_step(self, step: int) -> None:
        """Record the refill stream and the accounting as the loop reaches `step` (and the
        main stream too if batch `step` is not drawn yet, as on-policy)."""
        if self._next_draw == step:
            self._main_at.setdefault(step, self.mixture.state())
        self._refill_at.setdefault(step, self.refill.state() if self.refill else None)
        self._replay_at.setdefault(step, self._replay_state())
        self._stats_at.setdefault(step, dict(self.stats))

    def _mixture_restore(self, state: dict[str, Any]) -> None:
        self.mixture.restore(state["main"])
        if self.refill is not None:
            if state.get("refill") is None:
                raise SnapshotError("the snapshot has no refill stream state for dynamic sampling")
            self.refill.restore(state["refill"])
        self._replay_restore(state.get("replay"))

    def _snapshot(self, step: int, final: bool = False) -> None:
        """Snapshot at `step`; resumable from the newest finished trainer checkpoint.

        A final snapshot checkpoints `step` itself first, so a stop loses no training."""
        every = self.config.trainer.checkpoint_every
        if final:
            self.c.trainer.save(wait=True)
            checkpoint = step
        else:
            checkpoint = step - step % every
        checkpoint = max(c for c in self._main_at if c <= checkpoint)
        self._at_step(step)  # a final snapshot resumes from `step` itself
        snapshot = Snapshot(
            step=step,
            checkpoint_step=checkpoint,
            config_digest=self.digest,
            mixture={
                "main": self._main_at[checkpoint],
                "refill": self._refill_at[checkpoint],
                "replay": self._replay_at[checkpoint],
            },
            stats=self._stats_at[checkpoint],
            versions={
                "trainer": step,
                **{f"worker-{i}": v for i, v in enumerate(self._worker_versions)},
            },
        )
        # A resume from `checkpoint` generates with versions [oldest needed, checkpoint]
        # from the server: they must be on its storage (a publish returns once the memory
        # copy is complete, the persistent one follows) before a snapshot relies on them.
        if checkpoint != self._persisted_for:  # a new checkpoint: new versions to check
            self.c.param_server.wait_persisted(
                range(self.policy.oldest_needed(checkpoint), checkpoint + 1)
            )
            self._persisted_for = checkpoint
        self.snapshots.write(snapshot)
        # Versions a resume from `checkpoint` may generate with must survive on the server.
        # Then the server may delete what no consumer needs (memory and persisted copies).
        # On the housekeeping thread, in order: no decision waits for it.
        self._housekeeping.submit(self._collect, self.policy.oldest_needed(checkpoint))
        for old in [b for b in self._main_at if b < checkpoint]:
            del self._main_at[old]
            self._refill_at.pop(old, None)
            self._replay_at.pop(old, None)
            self._stats_at.pop(old, None)

    def _collect(self, oldest: int) -> None:
        try:
            self.c.param_server.confirm(CONTROLLER_CONSUMER, oldest)
            self.c.param_server.garbage_collect(oldest)
        except Exception as e:  # noqa: BLE001 - only delays garbage collection
            _log.warning("could not confirm version %d to the parameter server: %s", oldest, e)

    # -- generation -----------------------------------------------------------------------------
    def _launch_ahead(self, step: int) -> None:
        """Start every batch in [step, num_steps) whose version is published (trainer at
        version `step`), in order: as far ahead as N allows."""
        b = step
        lead = self.generation_policy.max_staleness
        while b < self.num_steps and b < step + lead + 1:
            if b not in self._batches:
                version = self.generation_policy.generation_version(b, step)
                if version is None:
                    break
                self._launch(b, version)
            b += 1

    def _draw(self, b: int) -> list[Prompt]:
        if b != self._next_draw:
            raise ControllerError(
                f"prompts drawn out of order: batch {b}, expected {self._next_draw}"
            )
        self._main_at.setdefault(b, self.mixture.state())
        records = self.mixture.draw(self.config.controller.prompts_per_batch)
        self._next_draw = b + 1
        return [Prompt(f"b{b}:{r.dataset}:{r.id}", self.encode(r), r) for r in records]

    def encode(self, record: Any) -> tuple[int, ...]:
        return encode_prompt(self.tokenizer, record, self.config.inference.max_prompt_len)

    def _launch(self, b: int, version: int) -> None:
        batch = _Batch(b, version, [], self.samples, launched_s=time.perf_counter())
        self._batches[b] = batch
        self._submit(batch, self._draw(b))

    def _submit(self, batch: _Batch, prompts: list[Prompt]) -> None:
        """Add `prompts` to `batch`: reuse what the rollout log has, generate the rest."""
        b, version = batch.index, batch.version
        with self._lock:
            batch.prompts.extend(prompts)
            batch.done.clear()
        logged = self.log.read_batch(b)
        missing: list[GenerationRequest] = []
        for prompt in prompts:
            for i in range(self.samples):
                record = logged.get((prompt.key, i, version))
                if record is not None:
                    batch.rollouts[(prompt.key, i)] = record
                    self.stats["reused"] += 1
                else:
                    missing.append(self._request(b, prompt, i, version))
        with self._lock:
            if len(batch.rollouts) == batch.expected:
                batch.done.set()
        if not missing:
            return
        per_worker = math.ceil(len(missing) / len(self.c.workers))
        per_worker = self.samples * math.ceil(per_worker / self.samples)  # whole groups
        for k in range(0, len(missing), per_worker):
            self._jobs.put(
                _Job(
                    (b, batch.rounds * 2**20 + k),
                    version,
                    missing[k : k + per_worker],
                    deliver=lambda r, batch=batch: self._deliver(batch, r),
                    fail=lambda e, batch=batch: self._fail(batch, e),
                    timing=batch.timing,
                )
            )

    def _request(self, b: int, prompt: Prompt, i: int, version: int) -> GenerationRequest:
        return GenerationRequest(
            request_id=f"{prompt.key}/s{i}/v{version}",
            prompt_id=prompt.key,
            sample_index=i,
            prompt_tokens=prompt.tokens,
            sampling=self.sampling,
        )

    def _deliver(self, batch: _Batch, rollouts: list[Any]) -> None:
        records = [
            {
                "batch": batch.index,
                "prompt_id": rollout.prompt_id,
                "sample_index": rollout.sample_index,
                "version": rollout.version,
                "prompt_tokens": list(rollout.prompt_tokens),
                "tokens": list(rollout.tokens),
                "logprobs": list(rollout.logprobs),
                "finish_reason": rollout.finish_reason,
            }
            for rollout in rollouts
        ]
        self.log.append(batch.index, records)  # persisted before they can be trained on
        with self._lock:
            for record in records:
                batch.rollouts[(record["prompt_id"], record["sample_index"])] = record
            if len(batch.rollouts) == batch.expected:
                batch.done.set()

    def _fail(self, batch: _Batch, error: str) -> None:
        batch.error = error
        batch.done.set()

    def _wait(self, b: int) -> _Batch | None:
        """Batch `b` once all its rollouts are in; None if the run is stopped meanwhile."""
        batch = self._batches[b]
        while not batch.done.wait(0.5):
            if self.stop.is_set():
                return None
            if self._worker_failure:
                raise ControllerError(self._worker_failure)
        if batch.error:
            raise ControllerError(f"batch {b}: {batch.error}")
        return batch

    # -- worker threads ----------------------------------------------------------------------------
    def _start_workers(self) -> None:
        for i, _ in enumerate(self.c.workers):
            thread = threading.Thread(target=self._work, args=(i,), name=f"worker-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _stop_workers(self) -> None:
        for _ in self._threads:
            self._jobs.put(_STOP_JOB)
        for thread in self._threads:
            thread.join(timeout=60)
        self._threads = []

    def _work(self, i: int) -> None:
        client = self.c.workers[i]
        while True:
            job = self._jobs.get()
            if job is _STOP_JOB:
                return
            t0 = time.perf_counter()
            try:
                if self._worker_versions[i] != job.version:
                    loaded = client.load(job.version)
                    self._worker_versions[i] = loaded.version
                t_loaded = time.perf_counter()
                job.timing["load_s"] += t_loaded - t0
                retry, finished = [], []
                for rollout in client.generate(job.requests, version=job.version):
                    if rollout.finish_reason in FINAL_REASONS:
                        finished.append(rollout)
                    elif rollout.finish_reason == "aborted":
                        retry.append(rollout.request_id)
                    else:
                        job.fail(
                            f"request {rollout.request_id} failed on worker {i}: {rollout.error}"
                        )
                t_generated = time.perf_counter()
                job.timing["generate_s"] += t_generated - t_loaded
                if finished:
                    job.deliver(finished)
                job.timing["log_s"] += time.perf_counter() - t_generated
                if retry:
                    self.stats["regenerated"] += len(retry)
                    again = [r for r in job.requests if r.request_id in set(retry)]
                    self._jobs.put(dataclasses.replace(job, requests=again))
            except Exception as e:  # noqa: BLE001 - a dead worker ends the run (resume later)
                self._worker_failure = f"inference worker {i} failed: {type(e).__name__}: {e}"
                job.fail(self._worker_failure)
                return
            finally:
                self._busy_s[i] += time.perf_counter() - t0

    # -- scoring and assembly ------------------------------------------------------------------
    def decode(self, tokens: Sequence[int]) -> str:
        return decode_response(self.tokenizer, tokens, self.sampling.stop_token_ids)

    def verify(self, prompts: Sequence[Prompt], records: Sequence[dict]) -> list[float]:
        by_key = {p.key: p.record for p in prompts}
        requests = []
        for r in records:
            rec = by_key[r["prompt_id"]]
            requests.append(
                VerificationRequest(
                    kind=rec.verifier,
                    response=self.decode(r["tokens"]),
                    reference=rec.reference,
                    problem=rec.problem,
                    request_id=f"{r['prompt_id']}/s{r['sample_index']}/v{r['version']}",
                )
            )
        scorable = [i for i, q in enumerate(requests) if q.kind != "none"]
        rewards = [0.0] * len(requests)
        results = self.c.verifier.verify_many([requests[i] for i in scorable])
        for i, result in zip(scorable, results, strict=True):
            rewards[i] = float(result.reward)
        return rewards

    def _score(self, batch: _Batch) -> None:
        """Verify every rollout of `batch` that has no reward yet."""
        todo = [
            (p, i)
            for p in batch.prompts
            for i in range(self.samples)
            if (p.key, i) not in batch.rewards
        ]
        records = [batch.rollouts[(p.key, i)] for p, i in todo]
        for (p, i), reward in zip(todo, self.verify(batch.prompts, records), strict=True):
            batch.rewards[(p.key, i)] = reward

    def _with_signal(self, batch: _Batch) -> dict[str, bool]:
        """Per prompt of `batch`: whether its group has reward variance (DAPO's predicate,
        rlax_tpu.algorithms.filters.dynamic_sampling_keep, on the scored groups)."""
        rewards = [batch.rewards[(p.key, i)] for p in batch.prompts for i in range(self.samples)]
        groups = np.repeat(np.arange(len(batch.prompts)), self.samples)
        keep = dynamic_sampling_keep(rewards, groups)
        return {p.key: bool(keep[g * self.samples]) for g, p in enumerate(batch.prompts)}

    def _resample(self, batch: _Batch) -> _Batch | None:
        """DAPO's dynamic sampling: while fewer than prompts_per_batch groups have reward
        variance, draw that many more prompts for this batch from the refill stream (same
        version) — at most `dynamic_sampling_max_rounds` extra rounds."""
        wanted = self.config.controller.prompts_per_batch
        rounds = self.config.controller.dynamic_sampling_max_rounds
        while True:
            self._score(batch)
            kept = sum(self._with_signal(batch).values())
            if kept >= wanted or batch.rounds > rounds:
                return batch
            records = self.refill.draw(wanted - kept)
            r, b = batch.rounds, batch.index
            extra = [Prompt(f"b{b}r{r}:{x.dataset}:{x.id}", self.encode(x), x) for x in records]
            batch.rounds += 1
            self._submit(batch, extra)
            if self._wait(b) is None:
                return None

    def _select(self, batch: _Batch, has: Mapping[str, bool]) -> list[Prompt]:
        """The batch's groups: all of them, or with dynamic sampling the first
        prompts_per_batch groups with reward variance (in draw order), topped up with the
        first groups without when the extra rounds ran out."""
        if not self.dynamic:
            return batch.prompts
        wanted = self.config.controller.prompts_per_batch
        signal = [p for p in batch.prompts if has[p.key]]
        flat = [p for p in batch.prompts if not has[p.key]]
        self.stats["groups_generated"] += len(batch.prompts)
        self.stats["groups_filtered"] += len(flat)
        chosen = {p.key for p in (signal + flat)[:wanted]}
        return [p for p in batch.prompts if p.key in chosen]

    def _assemble(self, batch: _Batch) -> tuple[RolloutBatch, list, np.ndarray, dict]:
        """The training batch of step `batch.index`: its own groups, or (replay mode) groups
        sampled from the replay buffer after this step's sync."""
        self._score(batch)
        has = self._with_signal(batch)
        if self.replay is not None:
            groups = self._replay_groups(batch)
        else:
            groups = [
                [
                    (batch.rollouts[(p.key, i)], batch.rewards[(p.key, i)])
                    for i in range(self.samples)
                ]
                for p in self._select(batch, has)
            ]
        flat = len(batch.prompts) - sum(has.values())
        return self._build(batch.index, groups, filtered_fraction=flat / len(batch.prompts))

    def _build(
        self, index: int, groups: list[list[tuple[dict, float]]], *, filtered_fraction: float
    ) -> tuple[RolloutBatch, list, np.ndarray, dict]:
        """A RolloutBatch of `groups` (each a list of (rollout record, reward)) for step
        `index`; every rollout must be acceptable for it (b − version ≤ N)."""
        records, rewards, group_ids = [], [], []
        for g, group in enumerate(groups):
            for record, reward in group:
                if not self.policy.is_acceptable(index, record["version"]):
                    # Never trained on; the schedule and the buffer's eviction prevent it.
                    self.stats["rejected_stale"] += 1
                    raise ControllerError(
                        f"rollout {record['prompt_id']}/s{record['sample_index']} has version "
                        f"{record['version']}, too stale for batch {index} "
                        f"(N={self.policy.max_staleness})"
                    )
                records.append(record)
                rewards.append(reward)
                group_ids.append(g)
        rewards = np.asarray(rewards, np.float32)
        lengths = [len(r["prompt_tokens"]) + len(r["tokens"]) for r in records]
        seq = padded_seq_len(max(lengths), self.config.trainer.max_seq_len)
        rows = len(records)
        tokens = np.zeros((rows, seq), np.int32)
        mask = np.zeros((rows, seq), bool)
        behaviour = np.zeros((rows, seq), np.float32)
        for row, r in enumerate(records):
            p, resp = r["prompt_tokens"], r["tokens"]
            full = (list(p) + list(resp))[:seq]
            tokens[row, : len(full)] = full
            # Position t scores tokens[t + 1]: response token j sits at len(p) + j.
            n = min(len(resp), seq - len(p))
            mask[row, len(p) - 1 : len(p) - 1 + n] = True
            behaviour[row, len(p) - 1 : len(p) - 1 + n] = r["logprobs"][:n]
        rollout_batch = RolloutBatch(
            tokens=tokens,
            response_mask=mask,
            group_ids=np.asarray(group_ids, np.int32),
            rewards=rewards,
            behaviour_logprobs=behaviour,
            versions=np.asarray([r["version"] for r in records], np.int32),
        )
        keys = [(r["prompt_id"], r["sample_index"], r["version"]) for r in records]
        staleness = [index - r["version"] for r in records]
        extra = {
            "filtered_fraction": filtered_fraction,
            "staleness_mean": float(np.mean(staleness)),
            "response_tokens": int(sum(len(r["tokens"]) for r in records)),
        }
        return rollout_batch, keys, rewards, extra

    # -- replay (TBA) ------------------------------------------------------------------------
    def _replay_groups(self, batch: _Batch) -> list[list[tuple[dict, float]]]:
        """Queue this batch's rollouts for the buffer; every `replay_sync_every` steps add
        what is queued; evict what step b can no longer accept; sample the groups."""
        b = batch.index
        for p in batch.prompts:
            for i in range(self.samples):
                record = batch.rollouts[(p.key, i)]
                entry = Entry(
                    batch=b,
                    prompt_key=p.key,
                    sample_index=i,
                    version=record["version"],
                    reward=batch.rewards[(p.key, i)],
                    added_at=b,
                )
                self._replay_pending.append((f"{p.record.dataset}:{p.record.id}", entry))
                self._replay_records[entry.key] = record
        ctl = self.config.controller
        if b % ctl.replay_sync_every == 0:
            self.replay.add(b, self._replay_pending)
            self._replay_pending = []
        self.replay.evict_older_than(b - self.policy.max_staleness)
        groups = []
        for _, entries in self.replay.sample(ctl.prompts_per_batch, self.samples):
            groups.append([(self._replay_record(e), e.reward) for e in entries])
        live = {e.key for u in self.replay.prompts for e in self.replay.entries(u)}
        live |= {e.key for _, e in self._replay_pending}
        self._replay_records = {k: v for k, v in self._replay_records.items() if k in live}
        return groups

    def _prefill(self) -> None:
        """TBA's pre-fill: before step 0, `replay_prefill_batches` batches of prompts from
        the main stream, generated with version 0 and verified, enter the buffer. A resume
        from step 0 restores the streams from before it and so pre-fills identically."""
        ctl = self.config.controller
        if not ctl.replay_prefill_batches:
            return
        batch = _Batch(0, 0, [], self.samples)  # logged under batch 0 as "pre<j>:" prompts
        prompts = []
        for j in range(ctl.replay_prefill_batches):
            for r in self.mixture.draw(ctl.prompts_per_batch):
                prompts.append(Prompt(f"pre{j}:{r.dataset}:{r.id}", self.encode(r), r))
        self._submit(batch, prompts)
        while not batch.done.wait(0.5):
            if self._worker_failure:
                raise ControllerError(self._worker_failure)
        if batch.error:
            raise ControllerError(f"replay pre-fill: {batch.error}")
        self._score(batch)
        items = []
        for p in batch.prompts:
            for i in range(self.samples):
                record = batch.rollouts[(p.key, i)]
                entry = Entry(
                    batch=0,
                    prompt_key=p.key,
                    sample_index=i,
                    version=0,
                    reward=batch.rewards[(p.key, i)],
                    added_at=0,
                )
                self._replay_records[entry.key] = record
                items.append((f"{p.record.dataset}:{p.record.id}", entry))
        self.replay.add(0, items)

    def _replay_record(self, entry: Entry) -> dict:
        record = self._replay_records.get(entry.key)
        if record is None:  # after a resume: the rollout log has it
            logged = self.log.read_batch(entry.batch)
            for key, rec in logged.items():
                self._replay_records.setdefault(key, rec)
            record = self._replay_records.get(entry.key)
            if record is None:
                raise ControllerError(
                    f"replay buffer entry {entry.key} of batch {entry.batch} is not in the "
                    "rollout log: the run directory is incomplete"
                )
        return record

    def _replay_state(self) -> dict[str, Any] | None:
        if self.replay is None:
            return None
        return {
            "buffer": self.replay.state(),
            "pending": [[uid, dataclasses.asdict(e)] for uid, e in self._replay_pending],
        }

    def _replay_restore(self, state: dict[str, Any] | None) -> None:
        if self.replay is None:
            return
        if state is None:
            raise SnapshotError("the snapshot has no replay buffer state (replay mode is on)")
        self.replay.restore(state["buffer"])
        self._replay_pending = [(uid, Entry(**e)) for uid, e in state["pending"]]

    def _after_step(
        self,
        step: int,
        batch: _Batch,
        rewards: np.ndarray,
        extra: Mapping[str, Any],
        train_metrics: Mapping[str, float],
        t0: float,
    ) -> None:
        del self._batches[batch.index]
        elapsed = time.perf_counter() - t0
        row = {
            "step": step,
            "version": batch.version,
            "reward_mean": float(np.mean(rewards)),
            "accuracy": float(np.mean(rewards >= 1.0)),
            "staleness_mean": extra["staleness_mean"],
            "filtered_fraction": extra["filtered_fraction"],
            "response_tokens": extra["response_tokens"],
            "elapsed_s": elapsed,
            **extra.get("timing", {}),
            **{f"train/{k}": float(v) for k, v in train_metrics.items()},
        }
        eval_every = self.config.controller.eval_every
        if self.eval_prompts and eval_every and step % eval_every == 0 and step < self.num_steps:
            self.evals[step] = self.evaluate(step)
        if step in self.evals:
            row["eval_accuracy"] = self.evals[step]
        self.history.append(row)
        if self.metrics is not None:
            self.metrics.write(step, {k: v for k, v in row.items() if k != "step"})
        if self.progress is not None:
            self.progress(row)

    # -- evaluation -----------------------------------------------------------------------------
    def evaluate(self, version: int) -> float:
        """Greedy accuracy of `version` on the held-out prompts (through the workers)."""
        prompts = [Prompt(f"eval:{r.dataset}:{r.id}", self.encode(r), r) for r in self.eval_prompts]
        requests = [
            GenerationRequest(
                request_id=f"{p.key}/v{version}",
                prompt_id=p.key,
                sample_index=0,
                prompt_tokens=p.tokens,
                sampling=self.greedy,
            )
            for p in prompts
        ]
        done = threading.Event()
        got: dict[str, Any] = {}
        errors: list[str] = []
        lock = threading.Lock()

        def deliver(rollouts: list[Any]) -> None:
            with lock:
                got.update((rollout.prompt_id, rollout) for rollout in rollouts)
                if len(got) == len(requests):
                    done.set()

        def fail(error: str) -> None:
            errors.append(error)
            done.set()

        per_worker = math.ceil(len(requests) / len(self.c.workers))
        started = bool(self._threads)
        if not started:
            self._start_workers()
        try:
            for k in range(0, len(requests), per_worker):
                self._jobs.put(_Job((-1, k), version, requests[k : k + per_worker], deliver, fail))
            while not done.wait(0.5):
                if self._worker_failure:
                    raise ControllerError(self._worker_failure)
        finally:
            if not started:
                self._stop_workers()
        if errors:
            raise ControllerError(f"evaluation of version {version}: {errors[0]}")
        records = [
            {
                "prompt_id": p.key,
                "sample_index": 0,
                "version": version,
                "tokens": list(got[p.key].tokens),
            }
            for p in prompts
        ]
        rewards = self.verify(prompts, records)
        accuracy = float(np.mean(np.asarray(rewards) >= 1.0))
        self.eval_elapsed_s[version] = time.perf_counter() - self._t0
        _log.info("held-out greedy accuracy of version %d: %.3f", version, accuracy)
        return accuracy
