"""The inference engine: continuous batching over decode slots backed by the paged KV
cache, with pages on demand (swapping to host memory when the pool runs out), bucketed
batched prefill, decode calls sized to the live sequences, deterministic on-device
sampling, and responses generated over several calls and across weight versions
(continuations, the per-call token budget, inference.in_flight_update).

`Engine` composes three parts: the host scheduler (scheduler.py: admission, pages, swaps,
the per-slot arrays), the served weights (weights.py: placement and dtype of a version's
params) and the jitted steps (steps.py: prefill, decode and the swap copies, their lowering
and saved executables). It holds the KV cache and carries each step's data between them,
reading the sampled tokens back once per prefill round and once per decode call. The gRPC
service is a thin layer over it.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlax_tpu.api.inference import GenerationRequest, Rollout
from rlax_tpu.config import InferenceConfig, ModelConfig
from rlax_tpu.inference.paged_cache import PagedKVCache, placed_layout
from rlax_tpu.inference.scheduler import PagingState, Scheduler, prefill_args, sample_args
from rlax_tpu.inference.steps import StaticKey, StepPrograms, pow2
from rlax_tpu.inference.weights import ServedWeights

_log = logging.getLogger(__name__)


class EngineNotLoadedError(RuntimeError):
    """The engine has no weights yet: call `load(version, params)` first."""


class Engine:
    """Continuous-batching generation for one model, one version of weights at a time.

    Pages, admission and swaps: `Scheduler` (inference.kv_admission).

    Prefill: up to `prefill_rows` (inference.prefill_batch_size, resolved) requests are
    admitted together; each is padded to the smallest `prefill_buckets` entry that holds
    it, and those sharing a bucket are prefilled in one call of shape [prefill_rows,
    bucket] (unused rows are padding: no valid token, an all-padding page-table row, so they
    write nothing). The calls of one admission round share one device-to-host transfer.
    With inference.share_prompt_pages, the samples of a prompt admitted in one round take
    one row: the others share its full prompt pages (a copy of the partial last one each)
    and sample their first token from its logits (`InferenceConfig.sample_rows`); with a
    prefix cache, a sample of a prompt prefilled in an earlier round under the served
    version takes the cache's pages and logits (a sample call, no prefill).
    Decode: the live slots, padded to the smallest of `inference.decode_rows` that holds
    them. Compiled shapes: one per prefill bucket and one per decode bucket used, plus the
    swap copies (page counts rounded up to powers of two), and one per continuation bucket
    a continuation used (prompt + partial response past the largest prefill bucket).

    Determinism: request key = threefry key from sha256(seed, prompt_id, sample_index,
    version); response token t is sampled with fold_in(key, t). Every prefill call has the
    shape [prefill_rows, bucket of the prompt], so for a given `prefill_rows` a request's
    first token is bitwise the same however it is batched. A decode row's numbers do not
    depend on the other rows or on which slot and pages it has as long as the platform's
    matmuls give a row the same bits at every decode bucket (XLA:CPU does from 64 rows up,
    hence the default buckets; docs/inference.md), and a swap copies pages bit for bit, so
    a request's tokens and log-probs are those of an unpreempted run. Across `prefill_rows`
    values the prefill shapes differ: log-probs may differ by float rounding.

    Continuations (`GenerationRequest.partial`) sample with the partial's version's key at
    t = its length on, so a response generated in several calls draws each token t as one
    call does. With inference.in_flight_update "keep" a paused response's pages are parked
    on the host and the continuation decodes on them: bitwise the one-call rollout under
    the same weights. When they are gone (another worker's, an evicted or restarted one)
    and `weights_of` gives the versions that made them, they are replayed as they were made
    (`Scheduler._replay`): still bitwise. Otherwise prompt + partial are prefilled afresh:
    the same distribution, log-probs equal to float rounding.

    `weights_of(version)` (settable; the inference worker pulls from the parameter server)
    gives the params of a version other than the one served, for replays only; the last
    `REPLAY_VERSIONS` placed are kept for the next replays.
    """

    REPLAY_VERSIONS = 2

    def __init__(
        self,
        model_config: ModelConfig,
        inference_config: InferenceConfig,
        *,
        seed: int,
        mesh: Mesh | None = None,
        decode_steps_per_call: int = 1,
        max_stop_tokens: int = 8,
        allocate: bool = True,
        progress: Callable[[str], None] | None = None,
        weights_of: Callable[[int], Mapping[str, Any]] | None = None,
    ):
        """allocate=False builds the programs and layouts only, with no device memory: the
        KV cache stays abstract (`abstract_cache`) and the engine cannot generate, but
        `lower_prefill` / `lower_decode` lower its jitted steps (`rlax-tpu compile`, for a
        mesh of abstract TPU devices). `progress` hears of the first call of each jitted
        shape (its compile) and how long it took; nothing else."""
        if decode_steps_per_call < 1:
            raise ValueError(f"decode_steps_per_call must be >= 1, got {decode_steps_per_call}")
        self.model_config, self.config, self.seed = model_config, inference_config, int(seed)
        self.decode_steps_per_call = decode_steps_per_call
        rules = inference_config.mesh.logical_axis_rules
        self._weights = ServedWeights(model_config, inference_config, mesh)
        # The platform the steps are compiled for picks the attention kernel (TPU for a mesh
        # of abstract TPU devices on any host).
        platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
        new_cache = functools.partial(
            PagedKVCache.from_config, model_config, inference_config, platform=platform
        )
        self.abstract_cache = placed_layout(jax.eval_shape(new_cache), mesh, rules)
        cache = self.abstract_cache
        self._scheduler = Scheduler(
            inference_config,
            cache.make_allocator(),
            seed=self.seed,
            vocab_size=model_config.vocab_size,
            decode_steps_per_call=decode_steps_per_call,
            max_stop_tokens=max_stop_tokens,
            # Parked sequences ("keep") hold at most the pool's size in host memory.
            max_parked_bytes=sum(x.size * x.dtype.itemsize for x in (*cache.keys, *cache.values)),
        )
        s = self._scheduler
        self.defaults, self.max_stop_tokens = s.defaults, s.max_stop_tokens
        self.num_slots, self.max_seq_len, self.on_demand = s.num_slots, s.max_seq_len, s.on_demand
        self.prefill_rows, self.decode_rows = s.prefill_rows, s.decode_rows
        self.continuation_buckets = s.continuation_buckets
        # The mesh is part of the steps' static key since the model's sharding constraints
        # are read from the active mesh at trace time. Params travel as a flat list of
        # arrays (flattening an nnx.State on every call costs about a millisecond).
        mesh_key = None if mesh is None else (mesh, rules)
        w = self._weights
        self._steps = StepPrograms(
            StaticKey.of(w.graphdef, w.treedef, mesh_key),
            self.abstract_cache,
            mesh,
            rules,
            prefill_rows=self.prefill_rows,
            decode_steps_per_call=decode_steps_per_call,
            progress=progress,
        )
        # The prefix cache's last-position logits, a row per entry (one unused row without).
        table_rows = max(1, inference_config.prefix_cache_entries)
        replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self.abstract_logits_table = jax.ShapeDtypeStruct(
            (table_rows, model_config.vocab_size), np.float32, sharding=replicated
        )
        self._logits_table = None
        if allocate:
            self._logits_table = jax.device_put(
                np.zeros((table_rows, model_config.vocab_size), np.float32), replicated
            )
        self._cache = None  # zeroed pools and page table, or abstract only (allocate=False)
        if allocate and mesh is None:
            self._cache = new_cache()
        elif allocate:  # created in place on its devices: no pool ever lives whole on one
            shardings = jax.tree.map(lambda x: x.sharding, self.abstract_cache)
            self._cache = jax.jit(new_cache, out_shardings=shardings)()
        # Device copies of the scheduler's per-slot arrays, and the slots of the last decode's
        # rows: committed again only when they change.
        self._device_carry = self._device_sampling = self._device_live = None
        self._live_rows: np.ndarray | None = None
        self.weights_of = weights_of
        self._calls = _VersionedCalls(self)

    # -- public API ----------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The version of the weights served now (-1 before any load)."""
        return self._weights.version

    def load(self, version: int, params: Mapping[str, Any]) -> list[Rollout]:
        """Serve `version` with `params` (a pure dict tree as `nnx.to_pure_dict` gives), between
        decode calls and without recompiling (same shapes and dtypes).

        Loading the version already served is a no-op (returns []). Requests submitted
        afterwards run with the new version. Those in flight (queued, decoding or swapped
        out), by inference.in_flight_update: "off", or any mode when `version` is older than
        the one served (an evaluation of an earlier version), are aborted and returned, in
        submission order, with finish_reason "aborted". For a newer version, "keep": they
        continue on their KV pages, their tokens sampled from now on by `version`; "resume":
        they are queued again as continuations and prefilled under `version`. Returns the
        aborted rollouts ([] with "keep" / "resume" for a newer version).
        """
        if version == self.version:
            return []
        self._weights.load(version, params)  # validated first: a bad tree changes nothing
        return self._scheduler.load(version)

    def release(self, ended: Sequence[tuple[str, int, int]]) -> None:
        """Drop the parked pages of episodes that ended: (prompt id, sample index, key
        version) each (`GenerateRequest.ended`)."""
        self._scheduler.release(ended)

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request. One that can never run (empty or too long a prompt, bad token ids,
        more pages than the pool) finishes at once with finish_reason "error"."""
        if self.version < 0:
            raise EngineNotLoadedError("submit() before any load(): the engine has no weights")
        self._scheduler.submit(request, self.version)

    def step(self) -> list[Rollout]:
        """One scheduler iteration: swap sequences back in and admit waiting prompts into free
        slots (prefill), give the live sequences their pages (swapping some out if the pool
        runs short), then one decode call for the live slots; with "keep", park the sequences
        that paused. Returns the rollouts that finished since the last step."""
        s = self._scheduler
        if s.busy():
            if self._weights.leaves is None:
                raise EngineNotLoadedError("step() before any load(): the engine has no weights")
            s.admit(self._prefill, self._write_pages, self._calls)
            if self.on_demand:
                s.grow(self.read_kv_pages)
            if s.arrays.active.any():
                self._decode()
            s.park(self.read_kv_pages)  # "keep": the sequences paused in this step
        return s.take_done()

    def has_work(self) -> bool:
        return self._scheduler.busy() or self._scheduler.has_done()

    def run(self, requests: Iterable[GenerationRequest]) -> list[Rollout]:
        """Submit all, step until done; the rollouts in request order. Needs an idle engine."""
        if self.has_work():
            raise RuntimeError("run() needs an idle engine; with requests in flight use step()")
        requests = list(requests)
        for request in requests:
            self.submit(request)
        finished: dict[str, Rollout] = {}
        while self.has_work():
            finished.update((r.request_id, r) for r in self.step())
        return [finished[r.request_id] for r in requests]

    def stats(self) -> dict[str, Any]:
        """Counters since construction; compiled_shapes = distinct jitted signatures traced."""
        compiled = sorted(self._steps.shapes)
        return {
            "version": self.version,
            **self._scheduler.stats(),
            "compiled_shapes": len(compiled),
            "compiled": compiled,
        }

    def paging_state(self) -> PagingState:
        """Where every request in flight is and what the pool holds, as a snapshot."""
        return self._scheduler.paging_state()

    def read_kv_pages(self, pages: list[int]) -> tuple[tuple[np.ndarray, ...], ...]:
        """The keys and values of `pages` of the pool, every layer, on the host: (keys,
        values), each per layer [kv_heads, len(pages), page_size, head_dim]."""
        return self._steps.read_pages(self._cache, pages)

    @property
    def kv_cache(self) -> PagedKVCache | None:
        """The KV cache on its devices (None with allocate=False): read it, do not keep it
        (each step donates it and makes a new one)."""
        return self._cache

    def served_params(self) -> list[jax.Array]:
        """The weights the engine serves now, as placed leaves (empty before any load)."""
        return list(self._weights.leaves or [])

    def compile_seconds(self) -> float:
        """Seconds spent compiling so far, a compile in progress included (any thread)."""
        return self._steps.compile_seconds()

    def compiling_seconds(self) -> float:
        """Seconds the compile running now has taken (0.0 when none runs)."""
        return self._steps.compiling_seconds()

    # -- the data path: the scheduler decides, the steps compute ---------------------------
    def _prefill(
        self, calls: list[tuple[int, tuple[np.ndarray, ...]]], leaves: list | None = None
    ) -> list[np.ndarray]:
        """Run a prefill round's calls (bucket, host args) with the served weights (or
        `leaves`); their packed first tokens, in one device-to-host transfer."""
        outs = []
        leaves = self._weights.leaves if leaves is None else leaves
        for bucket, args in calls:
            packed, self._cache, self._logits_table = self._steps.prefill(
                bucket, leaves, self._cache, self._logits_table, args
            )
            outs.append(packed)
        return jax.device_get(outs)

    def _sample(self, args: tuple[np.ndarray, ...]) -> np.ndarray:
        """A sample call (prefix-cache hits); its packed first tokens, on the host."""
        packed, self._cache = self._steps.sample(self._cache, self._logits_table, args)
        return jax.device_get(packed)

    def _extend(
        self, calls: list[tuple[int, tuple[np.ndarray, ...]]], leaves: list
    ) -> list[np.ndarray]:
        """Run extend calls (bucket, host args) with `leaves`; their packed first tokens."""
        outs = []
        for bucket, args in calls:
            packed, self._cache = self._steps.extend(bucket, leaves, self._cache, args)
            outs.append(packed)
        return jax.device_get(outs)

    def _write_pages(self, pages: list[int], data: Any) -> None:
        self._cache = self._steps.write_pages(self._cache, pages, data)

    def _decode(self) -> None:
        """One decode call of the live slots; the sampled tokens go back to the scheduler."""
        rows = self._scheduler.arrays.decode_rows(self.decode_rows)
        self._scheduler.decoded(rows, self._decode_rows(rows, self._weights.leaves))

    def _decode_rows(self, rows: np.ndarray, leaves: list) -> np.ndarray:
        """One decode call of the slots `rows` with `leaves`: what of the scheduler's host
        state changed goes to the device first; the packed output comes back."""
        s, put = self._scheduler, self._steps.put
        arrays = s.arrays
        if self._live_rows is None or not np.array_equal(rows, self._live_rows):
            self._live_rows, self._device_live = rows, put(rows)
        if arrays.page_table_dirty:
            self._cache = self._cache.with_page_table(put(s.allocator.page_table))
            arrays.page_table_dirty = False
        if arrays.sampling_dirty:
            self._device_sampling = put(arrays.sampling())
            arrays.sampling_dirty = False
        if arrays.carry_dirty:
            self._device_carry = put(arrays.carry())
            arrays.carry_dirty = False
        self._cache, self._device_carry, packed = self._steps.decode(
            leaves, self._cache, self._device_carry, self._device_sampling, self._device_live
        )
        return packed

    # -- lowering without hardware (rlax-tpu compile) and saved executables ----------------
    def abstract_params(self) -> list[jax.ShapeDtypeStruct]:
        """The served weights as the jitted steps take them, abstract (`ServedWeights`)."""
        return self._weights.abstract()

    @property
    def swap_pages(self) -> int:
        """The most pages one swap copy moves (a whole sequence's, rounded up to the power of
        two the copies compile at)."""
        return pow2(self.abstract_cache.pages_per_seq)

    def _prefill_lowering(self, bucket: int) -> Any:
        s = self._scheduler
        args = prefill_args(
            self.prefill_rows, bucket, s.allocator.page_table, [], sample_rows=s.sample_rows
        )
        params, table = self.abstract_params(), self.abstract_logits_table
        return self._steps.prefill_lowering(params, table, args)

    def _sample_lowering(self) -> Any:
        s = self._scheduler
        args = sample_args(self.prefill_rows, s.sample_rows, [])
        return self._steps.sample_lowering(self.abstract_logits_table, args)

    def _extend_lowering(self, bucket: int) -> Any:
        table = self._scheduler.allocator.page_table
        args = prefill_args(self.prefill_rows, bucket, table, [], extend=True)
        return self._steps.extend_lowering(self.abstract_params(), args)

    def _decode_lowering(self, rows: int) -> Any:
        arrays = self._scheduler.arrays
        params = self.abstract_params()
        return self._steps.decode_lowering(params, arrays.carry(), arrays.sampling(), rows)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """The prefill sizes compiled ahead (`lowerings`, `rlax-tpu compile`): the config's,
        and with inference.in_flight_update "resume" or "keep" the continuation buckets
        (with "off" a continuation that needs one compiles it on first use)."""
        if self.config.in_flight_update == "off":
            return self.config.prefill_buckets
        return self.config.prefill_buckets + self.continuation_buckets

    def lowerings(self) -> dict[str, Any]:
        """Every program of the engine at every bucket, by its key ("prefill@128",
        "extend@128", "decode@64", "swap_out@8", "swap_in@8"): (jitted function, abstract
        arguments, static argnums). Extend calls (an episode's next turn, a "keep"
        continuation after its parked pages) run at the prefill buckets."""
        out = {f"prefill@{b}": self._prefill_lowering(b) for b in self.prefill_buckets}
        out.update({f"extend@{b}": self._extend_lowering(b) for b in self.prefill_buckets})
        out.update({f"decode@{r}": self._decode_lowering(r) for r in self.decode_rows})
        if self.config.prefix_cache_entries:
            out[f"sample@{self._scheduler.sample_rows}"] = self._sample_lowering()
        out[f"swap_out@{self.swap_pages}"] = self._steps.swap_out_lowering(self.swap_pages)
        out[f"swap_in@{self.swap_pages}"] = self._steps.swap_in_lowering(self.swap_pages)
        return out

    def lower(self, key: str) -> jax.stages.Lowered:
        """The program of `key` (one of `lowerings()`), lowered abstract."""
        return self._steps.lower(self.lowerings()[key])

    def lower_prefill(self, bucket: int) -> jax.stages.Lowered:
        return self._steps.lower(self._prefill_lowering(bucket))

    def lower_extend(self, bucket: int) -> jax.stages.Lowered:
        return self._steps.lower(self._extend_lowering(bucket))

    def lower_decode(self, rows: int | None = None) -> jax.stages.Lowered:
        """Default: the largest decode bucket (max_decode_slots)."""
        return self._steps.lower(self._decode_lowering(rows or self.decode_rows[-1]))

    def lower_swap_out(self, pages: int | None = None) -> jax.stages.Lowered:
        return self._steps.lower(self._steps.swap_out_lowering(pages or self.swap_pages))

    def lower_swap_in(self, pages: int | None = None) -> jax.stages.Lowered:
        return self._steps.lower(self._steps.swap_in_lowering(pages or self.swap_pages))

    def use_saved_executables(self, directory: str) -> list[str]:
        """Run the executables `directory` holds (`rlax-tpu compile --save-compiled`) in
        place of compiling, for the programs and shapes they were compiled for; returns their
        keys. CompiledMismatchError when one was compiled for another program or mesh."""
        return self._steps.use_saved_executables(directory, self.lowerings())

    @property
    def saved_programs(self) -> dict[str, Any]:
        """The saved executables this engine runs (`use_saved_executables`), by key; each
        counts the calls it ran (`calls`)."""
        return dict(self._steps.programs)


class _VersionedCalls:
    """The engine's `scheduler.VersionedCalls`: prefill, extend and decode calls under the
    weights of the served version or of any version `Engine.weights_of` gives, the last
    REPLAY_VERSIONS of those kept placed."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._placed: collections.OrderedDict[int, list] = collections.OrderedDict()

    def has(self, versions: Iterable[int]) -> bool:
        try:
            for version in sorted(versions):
                self._leaves(version)
        except Exception as e:  # noqa: BLE001 - the continuation is prefilled instead
            _log.warning("cannot replay a continuation's KV pages: %s: %s", type(e).__name__, e)
            return False
        return True

    def _leaves(self, version: int) -> list:
        engine = self._engine
        if version == engine.version:
            return engine._weights.leaves
        if version not in self._placed:
            if engine.weights_of is None:
                raise LookupError(f"no weights_of to get version {version}'s weights from")
            self._placed[version] = engine._weights.place(engine.weights_of(version))
            while len(self._placed) > engine.REPLAY_VERSIONS:
                self._placed.popitem(last=False)
        self._placed.move_to_end(version)
        return self._placed[version]

    def prefill(self, version: int, calls: list) -> list:
        return self._engine._prefill(calls, self._leaves(version))

    def extend(self, version: int, calls: list) -> list:
        return self._engine._extend(calls, self._leaves(version))

    def decode(self, version: int, rows: np.ndarray) -> np.ndarray:
        return self._engine._decode_rows(rows, self._leaves(version))

    def sample(self, args: tuple[np.ndarray, ...]) -> np.ndarray:
        return self._engine._sample(args)
