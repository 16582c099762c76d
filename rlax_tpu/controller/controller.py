"""The controller: the one active process of a run (DESIGN §1, §2, §8).

It drives the passive components only through their clients, and composes five parts:

* `schedule.Schedule` (pure): which version generates batch b, how far ahead batches may
  be generated, which version an evaluation measures, when to snapshot;
* `generation.GenerationPool`: threads that have the inference workers generate batches
  and evaluations, reusing what the rollout log holds;
* `assembly` (pure) with `scoring.Scorer`: verdicts with retries, which groups train
  (dynamic sampling; a group with an unjudged sample is dropped), the step's arrays;
* `recovery.Recovery`: snapshots, resume, garbage collection of old versions;
* `evaluation.Evaluator`: held-out greedy accuracy of the newest loadable version.

A step b: draw batch b's prompts (up to N steps early), generate them with version g(b),
judge them, choose the groups (drawing more from the refill stream while dynamic sampling
wants groups with signal or dropped groups leave the batch short), assemble, and call
`train_step(b)`. Every choice is a function of (config, seed, step): request ids, PRNG keys
and versions derive from (batch, prompt, sample), never from timing or from the order
replies arrive in, so a resumed run equals an uninterrupted one. Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from rlax_tpu.api.inference import SamplingParams
from rlax_tpu.config import RunConfig
from rlax_tpu.config.run import greedy_baseline
from rlax_tpu.controller.assembly import Assembled
from rlax_tpu.controller.batches import BatchBuilder
from rlax_tpu.controller.episodes import Episodes, episode_metrics
from rlax_tpu.controller.errors import ControllerError
from rlax_tpu.controller.evaluation import EvalResult, Evaluator
from rlax_tpu.controller.generation import (
    BatchState,
    GenerationPool,
    Prompt,
    Stopped,
)
from rlax_tpu.controller.recovery import Recovery
from rlax_tpu.controller.replay import ReplayStage
from rlax_tpu.controller.schedule import Schedule
from rlax_tpu.controller.scoring import Scorer, Verifier, run_prefix
from rlax_tpu.controller.snapshots import RolloutLog, SnapshotError, SnapshotStore
from rlax_tpu.controller.warm_start import run_warm_start
from rlax_tpu.controller.workers import WorkerThreads
from rlax_tpu.data.datasets import PromptMixture, PromptRecord, encode_prompt, stop_tokens
from rlax_tpu.staleness import InFlightPlan

_log = logging.getLogger(__name__)

REFILL_STREAM = 104729  # the refill prompt stream: seed + REFILL_STREAM
_VERIFY_METRICS = {
    "verify/errors": "verify_errors",
    "verify/retries": "verify_retries",
    "verify/dropped": "verify_unjudged",
    "verify/dropped_groups": "groups_dropped",
}


@dataclasses.dataclass
class Components:
    """The clients of the passive components the controller drives."""

    trainer: Any  # rlax_tpu.api.trainer.TrainerClient
    param_server: Any  # rlax_tpu.api.param_server.ParamServerClient
    workers: list[Any]  # rlax_tpu.api.inference.InferenceWorkerClient, one per worker
    verifier: Verifier


def _fresh_stats() -> dict[str, int]:
    """The run's accounting (cumulative, snapshotted); the parts add their own counters."""
    return {
        "rejected_stale": 0,
        "groups_filtered": 0,
        "groups_generated": 0,
        "groups_dropped": 0,
        # Batches launched as soon as their version existed, before the previous step's
        # bookkeeping (Controller._launches_early).
        "batches_launched_early": 0,
        # Co-located: versions the worker loaded within the trainer's step call, so the
        # controller made no Load call for them (Controller._loads_with_step).
        "loads_with_step": 0,
    }


class MetricsSink(Protocol):
    """Where the controller writes each step's metrics (launch.metrics.MetricsWriter: JSONL,
    TensorBoard, W&B)."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> None: ...


class Controller:
    def __init__(
        self,
        config: RunConfig,
        components: Components,
        *,
        tokenizer: Any,
        mixture: PromptMixture,
        eval_prompts: Sequence[PromptRecord] = (),
        eval_overlap: float | None = None,
        metrics: MetricsSink | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
        report: Callable[[str], None] | None = None,
        stop: threading.Event | None = None,
        digest: str | None = None,
    ) -> None:
        self.config = config
        self.c = components
        ctl = config.controller
        self.tokenizer = tokenizer
        self.mixture = mixture
        # Rows the datasets scan left out (controller.overlong_prompts=drop), in every row.
        self._dataset_metrics = (
            {"dataset/overlong_dropped": sum(mixture.dropped.values())}
            if ctl.overlong_prompts == "drop"
            else {}
        )
        # The fraction of the held-out prompts that are training prompts (checked at start
        # against controller.max_eval_overlap), in every row.
        if eval_overlap is not None:
            self._dataset_metrics["dataset/eval_overlap"] = eval_overlap
        # Dynamic sampling's extra rounds and the replacements of groups dropped as
        # unjudged draw from their own named stream, in batch order.
        self.refill = mixture.sibling(config.seed + REFILL_STREAM)
        self.metrics = metrics
        self.progress = progress
        self.report = report or _log.info
        self.stop = stop or threading.Event()
        self.digest = digest or config.digest()  # of the config the user ran
        self.num_steps, self.samples = ctl.num_steps, ctl.samples_per_prompt
        # ReMax: a greedy response per prompt, judged, its reward the group's baseline.
        self.greedy_baseline = greedy_baseline(config.trainer.algorithm)
        self.schedule = Schedule(config)
        self.policy = self.schedule.policy
        stops = stop_tokens(config.inference.stop_token_ids, tokenizer)
        self.sampling = dataclasses.replace(
            SamplingParams.from_config(config.inference), stop_token_ids=tuple(stops)
        )
        self.stats = _fresh_stats()
        self.log = RolloutLog(config.storage.run_dir)
        # Mixed-version rollouts: requests cut into ticks (staleness.InFlightPlan).
        in_flight = InFlightPlan.of(config, self.schedule.generation_policy)
        if in_flight is None and config.inference.in_flight_update != "off":
            self.report(
                f"inference.in_flight_update = {config.inference.in_flight_update!r} changes "
                f"nothing here: with N = {self.schedule.generation_policy.max_staleness} and "
                f"η = {self.policy.reload_every} no response may span two versions (that needs "
                "N > η: N - η ticks to carry a response into); every rollout is of one version"
            )
        # Multi-turn episodes: an environment steps between a policy's turns.
        self.episodes = None
        if ctl.environment.enabled:
            self.episodes = Episodes(
                ctl.environment,
                tokenizer,
                max_new_tokens=config.inference.max_new_tokens,
                verifier=components.verifier,
            )
        if self.episodes is not None:
            self._check_episode_prompts(eval_prompts)
        threads = WorkerThreads(
            components.workers,
            sampling=self.sampling,
            counters=self.stats,
            wait_s=ctl.component_wait_s,
            report=self.report,
            republish=components.trainer.republish,
            liveness_s=ctl.liveness_timeout_s,
            decode_step_deadline_s=ctl.decode_step_deadline_s,
            decode_slots=config.inference.max_decode_slots,
            # Continuations (ticks' and episodes' next turns) decode with the new requests.
            merge_jobs=in_flight is not None or self.episodes is not None,
        )
        self.pool = GenerationPool(
            threads, self.log, samples=self.samples, in_flight=in_flight, episodes=self.episodes
        )
        self.scorer = Scorer(
            components.verifier,
            tokenizer,
            stops,
            retries=ctl.verify.retries,
            backoff_s=ctl.verify.retry_backoff_s,
            max_unjudged_fraction=ctl.verify.max_unjudged_fraction,
            counters=self.stats,
            request_prefix=run_prefix(self.digest, config.storage.run_dir),
        )
        self.replay = (
            ReplayStage(config, log=self.log, max_staleness=self.policy.max_staleness)
            if ctl.replay.enabled
            else None
        )
        self.builder = BatchBuilder(
            config,
            pool=self.pool,
            scorer=self.scorer,
            log=self.log,
            refill=self.refill,
            replay=self.replay,
            policy=self.policy,
            encode=self.encode,
            counters=self.stats,
        )
        self.recovery = Recovery(
            self.schedule,
            SnapshotStore(config.storage.run_dir, ctl.keep_snapshots),
            trainer=components.trainer,
            param_server=components.param_server,
            digest=self.digest,
            capture_main=self.mixture.state,
            capture_step=self._step_state,
            restore=self._restore,
            worker_versions=lambda: list(self.pool.worker_versions),
            wait_s=ctl.component_wait_s,
            stop=self.stop,
            flush_log=self.log.flush,
        )
        self.evaluator = None
        if eval_prompts:
            prompts = [Prompt(f"eval:{r.dataset}:{r.id}", self.encode(r), r) for r in eval_prompts]
            greedy = dataclasses.replace(self.sampling, temperature=0.0)
            self.evaluator = Evaluator(
                prompts, self.pool, self.scorer, self.schedule, sampling=greedy, report=self.report
            )
        self._batches: dict[int, BatchState] = {}
        self._next_draw = 0
        self.history: list[dict[str, Any]] = []  # per step metrics, for callers and benches
        self.evals: dict[int, float] = {}  # by step
        self.eval_versions: dict[int, int] = {}  # the version measured at each of those steps
        self.eval_elapsed_s: dict[int, float] = {}
        self._t0 = time.perf_counter()

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train batches [resume step, num_steps); returns a summary. On `stop` it writes a
        final snapshot (with a checkpoint of the step reached) and returns early."""
        self._t0 = time.perf_counter()
        if not self._warm_start():  # stopped during the warm start (the trainer saved it)
            return self._summary(0, 0, time.perf_counter() - self._t0, 0.0)
        start = self._next_draw = self.recovery.resume()
        self.pool.start()
        t0 = self._t0 = time.perf_counter()
        trainer_busy = 0.0
        step = start
        try:
            if start == 0 and self.replay is not None:
                self._prefill()
            result = self._evaluate(0) if start == 0 and self.evaluator is not None else None
            if result is not None:
                if self.metrics is not None:
                    self.metrics.write(0, result.metrics())
                if self.progress is not None:
                    self.progress({"step": 0, **result.metrics()})
            while step < self.num_steps and not self.stop.is_set():
                t_step = time.perf_counter()
                self.recovery.at_step(step, drawn=self._next_draw > step)
                self._launch_ahead(step)
                batch = self._batches[step]
                before = {k: self.stats[v] for k, v in _VERIFY_METRICS.items()}
                selection = self.builder.fill(batch, self.stop)
                if selection is None:  # stopped while waiting
                    break
                t_assemble = time.perf_counter()
                assembled = self.builder.assemble(batch, selection)
                t_train = time.perf_counter()
                hand_over = self._loads_with_step(step)
                result = self.c.trainer.train_step(step, assembled.batch, load_colocated=hand_over)
                t_trained = time.perf_counter()
                if result.colocated_loaded:  # the worker's next job loads nothing
                    self.pool.loaded(0, result.version)
                    self.stats["loads_with_step"] += 1
                trainer_busy += t_trained - t_train
                if self._launches_early(step + 1):
                    # The next batch's generation starts as soon as its version exists; this
                    # step's bookkeeping below (rollout log, metrics, snapshot) overlaps it.
                    self.stats["batches_launched_early"] += self._launch_ahead(step + 1)
                self.log.record_consumed(step, assembled.keys)
                extra = {
                    "filtered_fraction": selection.flat / len(batch.prompts),
                    **self._dataset_metrics,
                    **{k: self.stats[v] - before[k] for k, v in _VERIFY_METRICS.items()},
                    # Where the step's wall time went, as the controller sees it.
                    **{f"time/worker_{k}": v for k, v in batch.timing.items()},
                    "time/wait_rollouts_s": t_assemble - t_step,
                    "time/verify_assemble_s": t_train - t_assemble,
                    "time/train_step_call_s": t_trained - t_train,
                    "time/controller_step_s": time.perf_counter() - t_step,
                }
                if self.episodes is not None:  # turns, tool calls and their errors
                    extra.update(self._episode_metrics(batch, assembled.keys))
                step += 1
                self._after_step(step, batch, assembled, extra, result.metrics, t0)
                if self.schedule.snapshot_due(step):
                    final = step == self.num_steps
                    self.recovery.snapshot(step, drawn=self._next_draw > step, final=final)
            if step < self.num_steps:  # stopped early: keep everything done so far
                self.recovery.snapshot(step, drawn=self._next_draw > step, final=True)
        finally:
            self.pool.stop()
            self.recovery.close()
            self.log.close()
        return self._summary(start, step, time.perf_counter() - t0, trainer_busy)

    def _episode_metrics(self, batch: Any, keys: Sequence[Any]) -> dict[str, float]:
        """`episode_metrics` of the rows of `batch` its step trained on, from what the pool
        holds in memory (rows a replay buffer drew from earlier batches are left out)."""
        records = [
            r
            for k in keys
            if (r := batch.rollouts.get((k.prompt_id, k.sample_index))) is not None
            and r.version == k.version
        ]
        return episode_metrics(records, self.pool.logged_turns(batch.index))

    def _summary(self, start: int, step: int, wall: float, trainer_busy: float) -> dict[str, Any]:
        busy = self.pool.busy_s
        return {
            "start_step": start,
            "end_step": step,
            "final_digest": self.version_digest(step),
            "wall_s": wall,
            "trainer_idle_fraction": max(0.0, 1 - trainer_busy / wall) if wall else 0.0,
            "worker_idle_fraction": (
                max(0.0, 1 - sum(busy) / (wall * len(busy))) if wall and busy else 0.0
            ),
            "evals": dict(self.evals),
            "eval_versions": dict(self.eval_versions),
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

    def _warm_start(self) -> bool:
        """The SFT warm start, through the trainer, unless it is done; False if stopped."""
        total = self.config.trainer.warm_start.steps
        if not total:
            return True
        next_step = self.c.trainer.warm_start_step()
        if next_step < total:
            self.report(f"SFT warm start on the trainer: steps {next_step}..{total - 1}")
            run_warm_start(
                self.config,
                self.c.trainer,
                self.tokenizer,
                self.mixture,
                next_step=next_step,
                report=self.report,
                stop=self.stop,
                episodes=self.episodes,
            )
        if self.stop.is_set() and self.c.trainer.warm_start_step() < total:
            self.c.trainer.save(wait=True)  # checkpoints the warm start where it stands
            return False
        return True

    # -- stream state for recovery -----------------------------------------------------------
    def _step_state(self) -> dict[str, Any]:
        return {
            "refill": self.refill.state(),
            "replay": self.replay.state() if self.replay is not None else None,
            "stats": dict(self.stats),
        }

    def _restore(self, mixture: Mapping[str, Any], stats: Mapping[str, int]) -> None:
        self.mixture.restore(mixture["main"])
        if mixture.get("refill") is None:
            raise SnapshotError("the snapshot has no refill stream state")
        self.refill.restore(mixture["refill"])
        if self.replay is not None:
            self.replay.restore(mixture.get("replay"))
        fresh = {**_fresh_stats(), **{k: 0 for k in self.stats}}
        self.stats.update({**fresh, **stats})

    # -- prompts -------------------------------------------------------------------------------
    def _check_episode_prompts(self, eval_prompts: Sequence[PromptRecord]) -> None:
        """Every training and held-out prompt, rendered as an episode's first observation
        with the environment's tools, within inference.max_prompt_len: checked at start (the
        datasets scan measured them without the tools), so no batch meets one mid-run."""
        limit = self.config.inference.max_prompt_len
        rows = [r for name in self.mixture.names for r in self.mixture.records(name)]
        over = [
            (r, n)
            for r in (*rows, *eval_prompts)
            if (n := len(self.episodes.prompt_tokens(r))) > limit
        ]
        if over:
            record, longest = max(over, key=lambda x: x[1])
            raise ControllerError(
                f"{len(over)} prompts are longer than inference.max_prompt_len={limit} "
                f"once rendered with the environment's tools (the longest: prompt "
                f"{record.id!r} of dataset {record.dataset!r}, {longest} tokens); set "
                f"--set inference.max_prompt_len={longest} (and prefill_buckets to hold it)"
            )
        if self.config.trainer.warm_start.steps <= 0:
            return
        # The SFT warm start's rows: each training row's demonstration as its episode.
        seq = self.config.trainer.max_seq_len
        over = [(r, n) for r in rows if (n := len(self.episodes.demonstration(r)[0])) > seq]
        if over:
            record, longest = max(over, key=lambda x: x[1])
            raise ControllerError(
                f"{len(over)} SFT warm-start rows are longer than trainer.max_seq_len={seq} "
                f"as episodes (the longest: row {record.id!r} of dataset {record.dataset!r}, "
                f"{longest} tokens with its demonstration); set --set "
                f"trainer.max_seq_len={16 * -(-longest // 16)}"
            )

    def encode(self, record: PromptRecord) -> tuple[int, ...]:
        """A prompt's tokens: the dataset's rendering, or an episode's first observation
        with its tools (controller.environment)."""
        limit = self.config.inference.max_prompt_len
        if self.episodes is None:
            return encode_prompt(self.tokenizer, record, limit)
        ids = self.episodes.prompt_tokens(record)
        if len(ids) > limit:
            raise ControllerError(
                f"episode prompt {record.id!r} of dataset {record.dataset!r} has {len(ids)} "
                f"tokens with its tools, more than inference.max_prompt_len={limit}: raise it"
            )
        return ids

    def _draw(self, b: int) -> list[Prompt]:
        if b != self._next_draw:
            raise ControllerError(
                f"prompts drawn out of order: batch {b}, expected {self._next_draw}"
            )
        self.recovery.before_draw(b)
        records = self.mixture.draw(self.config.controller.prompts_per_batch)
        self._next_draw = b + 1
        return [Prompt(f"b{b}:{r.dataset}:{r.id}", self.encode(r), r) for r in records]

    def _launches_early(self, step: int) -> bool:
        """Whether the batches of `step` launch before step - 1's bookkeeping is done: not
        when an evaluation at `step` comes first (its generation would queue behind the
        batch's, and its time would include theirs), nor with continuations of partial
        rollouts or episodes (whose jobs are queued in the order the loop reaches them)."""
        evaluates = self.evaluator is not None and (
            self.schedule.eval_due(step) or step == self.num_steps
        )
        return not (
            evaluates
            or self.stop.is_set()
            or self.pool.in_flight is not None
            or self.episodes is not None
        )

    def _loads_with_step(self, step: int) -> bool:
        """Whether the co-located worker (inference.colocated) loads version step + 1 within
        the trainer's step call, saving a Load call on the step's path: only when the batches
        launched next generate with that version at once (`_launches_early`) and no other
        batch is generating, so the worker would load it next anyway and the load aborts
        nothing. A function of the config and the step, not of timing."""
        if not self.config.inference.colocated or not self._launches_early(step + 1):
            return False
        if set(self._batches) != {step}:
            return False
        launched = self.schedule.to_launch(step + 1, self._batches)
        return bool(launched) and all(version == step + 1 for _, version in launched)

    def _launch_ahead(self, step: int) -> int:
        """Start every batch whose version is published (trainer at version `step`); returns
        how many started."""
        launched = self.schedule.to_launch(step, self._batches)
        for b, version in launched:
            batch = BatchState(b, version, self.samples, greedy=self.greedy_baseline)
            self._batches[b] = batch
            self.pool.submit(batch, self._draw(b))
            self.pool.open_tick(b, version)  # the continuations due with batch b's version
        return len(launched)

    # -- replay pre-fill -----------------------------------------------------------------------
    def _prefill(self) -> None:
        """TBA's pre-fill: before step 0, `controller.replay.prefill_batches` batches of
        prompts from the main stream, generated with version 0 and judged, enter the buffer. A
        resume from step 0 restores the streams from before it and so pre-fills identically."""
        ctl = self.config.controller
        if not ctl.replay.prefill_batches:
            return
        batch = BatchState(0, 0, self.samples)  # logged under batch 0 as "pre<j>:" prompts
        prompts = []
        for j in range(ctl.replay.prefill_batches):
            for r in self.mixture.draw(ctl.prompts_per_batch):
                prompts.append(Prompt(f"pre{j}:{r.dataset}:{r.id}", self.encode(r), r))
        self.pool.submit(batch, prompts)
        if not self.pool.wait(batch, self.stop):
            return
        self.builder.judge(batch)
        groups = [
            dataclasses.replace(batch.group(p), key=p.uid) for p in batch.prompts if batch.judged(p)
        ]
        self.replay.prefill(self.replay.entries(0, groups))

    # -- after a step -------------------------------------------------------------------------
    def _after_step(
        self,
        step: int,
        batch: BatchState,
        assembled: Assembled,
        extra: Mapping[str, Any],
        train_metrics: Mapping[str, float],
        t0: float,
    ) -> None:
        del self._batches[batch.index]
        rewards = assembled.rewards
        row = {
            "step": step,
            "version": batch.version,
            "reward_mean": float(np.mean(rewards)),
            "accuracy": float(np.mean(rewards >= 1.0)),
            "staleness_mean": assembled.staleness_mean,
            "rollout/version_span": assembled.version_span,
            "rollout/partial_fraction": assembled.partial_fraction,
            "response_tokens": assembled.response_tokens,
            # Multi-turn episodes: response tokens that were given (observations), not
            # sampled; only then, so the rows of other runs stay what they were.
            **({"rollout/given_tokens": assembled.given_tokens} if assembled.given_tokens else {}),
            "elapsed_s": time.perf_counter() - t0,
            **extra,
            **{f"train/{k}": float(v) for k, v in train_metrics.items()},
        }
        if self.evaluator is not None and (self.schedule.eval_due(step) or step == self.num_steps):
            result = self._evaluate(step)
            if result is not None:
                row.update(result.metrics())
        self.history.append(row)
        if self.metrics is not None:
            self.metrics.write(step, {k: v for k, v in row.items() if k != "step"})
        if self.progress is not None:
            self.progress(row)

    def _evaluate(self, step: int) -> EvalResult | None:
        """The evaluation at `step`; None when the run was stopped during it (said)."""
        try:
            result = self.evaluator.evaluate(step, stop=self.stop)
        except Stopped:
            self.report(
                f"the evaluation at step {step} was stopped before it finished; `rlax-tpu "
                "eval` measures any saved version"
            )
            return None
        self.evals[step] = result.accuracy
        self.eval_versions[step] = result.version
        self.eval_elapsed_s[step] = time.perf_counter() - self._t0
        return result
