"""The inference worker (DESIGN §4): one Engine, the weights it holds by version, and the
bookkeeping that makes generation idempotent by request id. Its pulls and prefetches are
inference/fetch.py (WeightFetcher).

Plain Python, unit-testable in-process; rlax_tpu.inference.service puts gRPC in front of it.
The engine is not thread-safe, so one engine thread owns it: callers' threads only queue
work for it and wait on their results, and concurrent callers share its decode slots.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jax.sharding import Mesh

from rlax_tpu.api.inference import (
    GenerationRequest,
    InvalidRequestError,
    LoadResult,
    NotLoadableError,
    NotLoadedError,
    Rollout,
    SamplingParams,
    VersionMismatchError,
    WorkerClosedError,
)
from rlax_tpu.api.param_server import ParamServerCallError
from rlax_tpu.colocation import SharedVersions
from rlax_tpu.config import RunConfig
from rlax_tpu.inference.engine import Engine
from rlax_tpu.inference.fetch import WeightFetcher
from rlax_tpu.param_server.trees import TreeClient
from rlax_tpu.staleness import StalenessPolicy

_log = logging.getLogger(__name__)

# Completed rollouts kept for repeated request ids (per version held; a reload forgets them).
DEFAULT_MAX_RECORDED = 8192
# Only these are final: an aborted or failed request is generated afresh when repeated. A
# paused one is final for its request id: its continuation is another request.
_RECORDED_REASONS = ("stop", "length", "paused")
_STOP = object()  # tells the engine thread to exit
_CANCELLED = object()  # ends a RolloutStream early


def _request_key(request: GenerationRequest, default: SamplingParams) -> tuple:
    """What a request id stands for; reusing an id for anything else is a caller bug."""
    return (
        request.prompt_id,
        request.sample_index,
        tuple(request.prompt_tokens),
        request.sampling or default,
        request.partial,
        request.max_tokens,
        request.keep_pages,
    )


@dataclasses.dataclass
class _Pending:
    key: tuple
    listeners: list[queue.SimpleQueue]


class RolloutStream(Iterator[Rollout]):
    """The rollouts of one generate call, in completion order. `cancel()` (from any thread)
    ends the iteration early; the requests keep running and their results are recorded."""

    def __init__(self, worker: InferenceWorker, inbox: queue.SimpleQueue, ids: list[str]):
        self._worker, self._inbox, self._ids = worker, inbox, ids
        self._remaining = len(ids)

    def __next__(self) -> Rollout:
        if self._remaining > 0:
            item = self._inbox.get()
            if item is not _CANCELLED:
                self._remaining -= 1
                return item
        self.close()
        raise StopIteration

    def cancel(self) -> None:
        self._inbox.put(_CANCELLED)

    def close(self) -> None:
        """Stop listening (idempotent)."""
        self._remaining = 0
        self._worker._unlisten(self._inbox, self._ids)


class InferenceWorker:
    """Generates rollouts with the version it holds; loads versions from the parameter server.

    `engine` may be given (e.g. a pre-built or instrumented one); by default it is built
    from `config` on `mesh`. `max_recorded` bounds the completed rollouts remembered for
    repeated request ids. `progress` hears of the first load and of each jitted shape's
    first call (its compile), with the seconds taken; never of every load or step.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        param_server: TreeClient | None,
        consumer_id: str,
        mesh: Mesh | None = None,
        engine: Engine | None = None,
        max_recorded: int = DEFAULT_MAX_RECORDED,
        progress: Callable[[str], None] | None = None,
        shared: SharedVersions | None = None,
    ) -> None:
        if not consumer_id:
            raise ValueError("consumer_id must name this worker (e.g. 'inference_worker-0')")
        self.config, self.consumer_id, self.mesh = config, consumer_id, mesh
        self.param_server = param_server
        self.policy = StalenessPolicy.from_config(config.staleness)
        self.default_sampling = SamplingParams.from_config(config.inference)
        self._engine = engine or Engine(
            config.model, config.inference, seed=config.seed, mesh=mesh, progress=progress
        )
        if engine is None and config.inference.compiled_dir:
            loaded = self._engine.use_saved_executables(config.inference.compiled_dir)
            _log.info(
                "%s runs the saved executables of %s from %s",
                consumer_id,
                ", ".join(loaded) or "no program",
                config.inference.compiled_dir,
            )
        self._progress = progress
        self._max_recorded = max_recorded
        # _lock guards the bookkeeping below; the engine itself is touched only by its thread.
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()  # one load at a time: pulls must not interleave
        self._version = self._engine.version
        # A handed version's swap queued on the engine thread and not yet run (`load_handed`):
        # (version, its future); requests submitted meanwhile run with that version.
        self._handing: tuple[int, concurrent.futures.Future] | None = None
        self._in_flight: dict[str, _Pending] = {}
        self._recorded: collections.OrderedDict[str, tuple[tuple, Rollout]] = (
            collections.OrderedDict()
        )
        self._counters = collections.Counter()
        self._engine_stats: dict[str, Any] = dict(self._engine.stats())
        self._failure: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="inference-engine", daemon=True)
        self._thread.start()
        # Confirmations to the parameter server after loads: they only free memory there.
        self._confirmations = concurrent.futures.ThreadPoolExecutor(1, "inference-confirm")
        # Pulls, and the next version fetched while generating (inference.prefetch_weights).
        self.weights = WeightFetcher(
            config,
            param_server,
            mesh=mesh,
            stopped=lambda: self._failure is not None,
            shared=shared,
        )
        # "keep": a continuation whose KV pages are lost replays them under the versions
        # that made them, pulled on the engine thread (Engine.weights_of).
        if (param_server is not None or shared is not None) and self._engine.weights_of is None:
            self._engine.weights_of = self.weights.pull

    # -- public API -------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The version held; -1 before the first load."""
        return self._version

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        *,
        version: int | None = None,
        ended: Sequence[tuple[str, int, int]] = (),
    ) -> RolloutStream:
        """Start `requests` and return their rollouts as they complete.

        Idempotent by request id: an id completed with the version held returns its recorded
        rollout, an id in flight is joined rather than started again. With `version`, the
        worker must hold exactly that version (VersionMismatchError otherwise). `ended`:
        episodes that ended ((prompt id, sample index, key version)), whose parked pages the
        engine drops before it admits `requests`.
        """
        requests = list(requests)
        ids = [r.request_id for r in requests]
        if not all(ids):
            raise InvalidRequestError("every request needs a non-empty request_id")
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise InvalidRequestError(f"request id {dup!r} appears twice in one batch")
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._check_open()
            # A request queued now runs after a handed version's swap (`load_handed`).
            serving = self._serving()
            if serving < 0:
                raise NotLoadedError(
                    "the worker holds no weights yet: Load a version before Generate"
                )
            if version is not None and version != serving:
                raise VersionMismatchError(
                    f"the batch asks for version {version} but the worker holds version "
                    f"{serving}; Load {version} first"
                )
            keys = [_request_key(r, self.default_sampling) for r in requests]
            for request, key in zip(requests, keys, strict=True):  # check all before changing any
                if self._known_key(request.request_id) not in (None, key):
                    raise InvalidRequestError(
                        f"request id {request.request_id!r} was already used for a different "
                        "request (prompt, sample index, sampling, partial response or "
                        "max_tokens differ); ids must be unique"
                    )
            if ended:
                ended = tuple(ended)
                self._commands.put((lambda: self._engine.release(ended), None))
            new = []
            for request, key in zip(requests, keys, strict=True):
                rid = request.request_id
                if rid in self._recorded:
                    self._recorded.move_to_end(rid)
                    inbox.put(self._recorded[rid][1])
                    self._counters["recorded_hits"] += 1
                elif rid in self._in_flight:
                    self._in_flight[rid].listeners.append(inbox)
                    self._counters["joined_in_flight"] += 1
                else:
                    self._in_flight[rid] = _Pending(key, [inbox])
                    new.append(request)
            if new:
                self._commands.put((lambda: self._submit(new, version), None))
        return RolloutStream(self, inbox, ids)

    def load(self, version: int, params: Any = None, *, evaluation: bool = False) -> LoadResult:
        """Hold `version`: pull it (unless `params` is given), swap it in, confirm to the
        parameter server that older versions are no longer needed. Idempotent.

        Only multiples of η, unless `evaluation`: then any published version (the run's
        final one, evaluated whatever η is). Requests in flight at the swap end as "aborted"
        (returned here and to their callers), except, for a newer version, with
        inference.in_flight_update "keep" or "resume": they continue (`Engine.load`).
        """
        if not evaluation and not self.policy.is_loadable(version):
            raise NotLoadableError(
                f"version {version} is not loadable: workers load only multiples of "
                f"η = staleness.reload_every = {self.policy.reload_every}"
            )
        with self._load_lock:
            self._check_open()
            handing = self._handing
            if handing is not None:  # a handed version's swap runs first (its error is logged)
                concurrent.futures.wait([handing[1]])
            if version == self._version:
                return LoadResult(version, already_loaded=True, aborted=())
            first, t0 = self._version < 0, time.perf_counter()
            if params is None:
                params = self.weights.prefetched(version)
            if params is None:
                params = self.weights.pull(version)
            aborted = self._on_engine(lambda: self._swap(version, params)).result()
            self.weights.start_prefetch(version + self.policy.reload_every)
            if first and self._progress is not None:
                source = "the parameter server" if self.param_server is not None else "the caller"
                if self.weights.shared is not None:
                    source = "the trainer in this process"
                self._progress(
                    f"loaded the weights of version {version} from {source} in "
                    f"{time.perf_counter() - t0:.1f}s"
                )
        if self.param_server is not None:  # off the load's path, in order
            self._confirmations.submit(self._confirm, version)
        return LoadResult(version, already_loaded=False, aborted=tuple(aborted))

    def load_handed(self, version: int) -> bool:
        """Co-located (inference.colocated): load `version`, which the trainer in this
        process has just published and handed to this worker, as the trainer's step call
        asks (TrainStep's load_colocated), saving the caller a Load call. Returns at once:
        the swap is queued on the engine thread, so every request submitted from now on runs
        with `version` (as after a Load), and the swap's device work overlaps the caller's
        next steps. False, loading nothing, when `version` is not a multiple of η, the
        worker is closed, or the version is not held here (the caller then Loads it); a
        swap that fails is logged, and the caller's next Generate of `version` is refused,
        so it Loads it and sees the error."""
        shared = self.weights.shared
        if shared is None or not self.policy.is_loadable(version):
            return False
        with self._load_lock:
            with self._lock:
                if self._failure is not None:
                    return False
                serving = self._serving()
            if version == serving:
                return True
            params = shared.take(version)
            if params is None:
                return False
            future: concurrent.futures.Future = concurrent.futures.Future()
            with self._lock:  # queued and announced at once: no Generate sees neither
                if self._failure is not None:
                    return False
                self._handing = (version, future)
                self._commands.put((lambda: self._swap(version, params), future))
        future.add_done_callback(lambda done: self._handed(version, done))
        return True

    def _handed(self, version: int, done: concurrent.futures.Future) -> None:
        """After a handed version's swap: what `load` does after its own."""
        if done.exception() is not None:
            _log.warning("the co-located load of version %d failed: %s", version, done.exception())
            return
        if self.param_server is not None:
            self._confirmations.submit(self._confirm, version)

    def _confirm(self, version: int) -> None:
        self.weights.wait_sent(version)  # co-located: the server holds it before we confirm
        try:
            self.param_server.confirm(self.consumer_id, version)
        except ParamServerCallError as e:  # only delays garbage collection: not fatal
            _log.warning("could not confirm version %d to the parameter server: %s", version, e)

    def wait_confirmed(self) -> None:
        """Wait until every load so far is confirmed to the parameter server (or failed to)."""
        self._confirmations.submit(lambda: None).result()

    @property
    def engine(self) -> Engine:
        """The engine this worker drives (touched only by the worker's engine thread while
        the worker runs: read-only queries from elsewhere)."""
        return self._engine

    def stats(self) -> dict[str, Any]:
        """The engine's last reported stats plus the worker's counters (for Health)."""
        with self._lock:
            return {
                **self._engine_stats,
                "version": self._version,
                "queue_depth": self._engine_stats.get("waiting", 0),  # prompts awaiting a slot
                "in_flight": len(self._in_flight),  # requests started and not yet finished
                "recorded": len(self._recorded),
                **{
                    name: self._counters[name]
                    for name in (
                        "started",
                        "recorded_hits",
                        "joined_in_flight",
                        "aborted",
                        "loads",
                    )
                },
                "prefetched_loads": self.weights.prefetched_loads,
                **({"failure": self._failure} if self._failure else {}),
                # Read live (not the engine thread's last report): a watched call's deadline
                # leaves out a compile while it runs.
                "compile_s": round(self._engine.compile_seconds(), 3),
                # The compile running now, if any (progress lines say the worker compiles).
                "compiling_s": round(self._engine.compiling_seconds(), 3),
            }

    def close(self) -> None:
        """Stop the engine thread; requests still in flight end as "aborted"."""
        if self._thread.is_alive():
            self._commands.put((_STOP, None))
            self._thread.join()
        self._confirmations.shutdown(wait=True)
        self.weights.drop_prefetch()

    # -- weights ------------------------------------------------------------------------------
    def param_like(self) -> Any:
        """What a version is pulled into (WeightFetcher.like): the served model's param pure
        dict (`ModelConfig.served`: the published dtype) as jax.ShapeDtypeStruct leaves with
        the shardings the engine uses; with LoRA the packed adapters and the base's digest."""
        return self.weights.like()

    # -- the engine thread --------------------------------------------------------------------
    def _on_engine(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread; its result or exception arrives in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # after a failure nothing may be queued: no thread would run it
            self._check_open()
            self._commands.put((fn, future))
        return future

    def _run(self) -> None:
        try:
            while True:
                block = not self._engine.has_work()
                try:
                    fn, future = self._commands.get(block=block)
                except queue.Empty:  # nothing queued: advance generation by one step
                    self._deliver(self._engine.step())
                    self._refresh_stats()
                    continue
                if fn is _STOP:
                    self._fail_all("the worker is shutting down", "aborted", closed=True)
                    return
                try:
                    result = fn()
                except Exception as e:
                    if future is None:
                        raise
                    future.set_exception(e)
                else:
                    if future is not None:
                        future.set_result(result)
                self._refresh_stats()
        except Exception as e:  # an engine bug: fail every caller loudly instead of hanging
            _log.exception("the inference engine failed")
            self._fail_all(f"the inference engine failed: {type(e).__name__}: {e}", "error")

    def _fail_all(self, reason: str, finish_reason: str, closed: bool = False) -> None:
        """End every waiting caller and refuse new work; queued commands fail too."""
        with self._lock:
            self._failure = "closed" if closed else reason
            pending, self._in_flight = self._in_flight, {}
        for rid, entry in pending.items():
            rollout = self._stub_rollout(rid, entry.key, finish_reason, reason)
            for inbox in entry.listeners:
                inbox.put(rollout)
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                future.set_exception(WorkerClosedError(reason))

    def _stub_rollout(self, rid: str, key: tuple, finish_reason: str, error: str) -> Rollout:
        """A rollout with no tokens that ends request `rid` with `finish_reason`."""
        prompt_id, sample_index, prompt_tokens, _, partial, *_ = key
        return Rollout(
            request_id=rid,
            prompt_id=prompt_id,
            sample_index=sample_index,
            version=self._version if partial is None else partial.version,
            prompt_tokens=prompt_tokens,
            tokens=(),
            logprobs=(),
            finish_reason=finish_reason,
            error=error,
        )

    def _submit(self, requests: list[GenerationRequest], version: int | None) -> None:
        """(engine thread) Hand new requests to the engine; one bad request fails alone."""
        for request in requests:
            if version is not None and version != self._engine.version:
                # A load overtook this batch: it must not run with another version.
                error = f"the worker loaded version {self._engine.version} before it started"
                self._deliver_one(request.request_id, "aborted", error)
                continue
            try:
                self._engine.submit(request)
            except Exception as e:  # e.g. a prompt longer than the cache allows
                self._deliver_one(request.request_id, "error", f"{type(e).__name__}: {e}")
                continue
            with self._lock:
                self._counters["started"] += 1

    def _deliver_one(self, rid: str, finish_reason: str, error: str) -> None:
        with self._lock:
            entry = self._in_flight.get(rid)
        if entry is not None:
            self._deliver([self._stub_rollout(rid, entry.key, finish_reason, error)])

    def _swap(self, version: int, params: Any) -> list[Rollout]:
        """(engine thread) Load the weights; aborted requests go back to their callers. A
        handed version's swap ends its pending state here, whether it loads or fails."""
        try:
            aborted = self._engine.load(version, params)
        except Exception:
            with self._lock:
                self._end_handing(version)
            raise
        with self._lock:
            self._version = self._engine.version
            self._end_handing(version)
            self._recorded.clear()  # results of the old version must not answer new calls
            self._counters["loads"] += 1
        self._deliver(aborted)
        return aborted

    def _end_handing(self, version: int) -> None:
        """(under _lock) The swap to `version` ran: if it was the last handed one, requests
        now check against the version served."""
        if self._handing is not None and self._handing[0] == version:
            self._handing = None

    def _serving(self) -> int:
        """(under _lock) The version a request submitted now runs with: the served one, or
        a handed version whose swap is queued ahead of it."""
        return self._version if self._handing is None else self._handing[0]

    def _deliver(self, rollouts: Sequence[Rollout]) -> None:
        """Send finished rollouts to every caller waiting on them; record the final ones."""
        with self._lock:
            for rollout in rollouts:
                entry = self._in_flight.pop(rollout.request_id, None)
                if entry is None:
                    continue
                if rollout.finish_reason in _RECORDED_REASONS:
                    self._recorded[rollout.request_id] = (entry.key, rollout)
                    while len(self._recorded) > self._max_recorded:
                        self._recorded.popitem(last=False)
                elif rollout.finish_reason == "aborted":
                    self._counters["aborted"] += 1
                for inbox in entry.listeners:
                    inbox.put(rollout)

    def _refresh_stats(self) -> None:
        stats = dict(self._engine.stats())
        with self._lock:
            self._engine_stats = stats

    # -- helpers --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._failure is not None:
            raise WorkerClosedError(
                "the worker is closed" if self._failure == "closed" else self._failure
            )

    def _known_key(self, rid: str) -> tuple | None:
        if rid in self._recorded:
            return self._recorded[rid][0]
        if rid in self._in_flight:
            return self._in_flight[rid].key
        return None

    def _unlisten(self, inbox: queue.SimpleQueue, ids: Sequence[str]) -> None:
        with self._lock:
            for rid in ids:
                entry = self._in_flight.get(rid)
                if entry is not None and inbox in entry.listeners:
                    entry.listeners.remove(inbox)
