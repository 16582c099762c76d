"""The inference engine: continuous batching over decode slots backed by the paged KV
cache, with pages on demand (swapping to host memory when the pool runs out), bucketed
batched prefill, decode calls sized to the live sequences, and deterministic on-device
sampling.

The host (this class) only schedules: it admits waiting prompts into free slots, gives
sequences pages as they grow, swaps sequences out and back in, and reads the sampled
tokens back once per prefill round and once per decode call. The model, sampling and cache
writes run in jitted functions: prefill (`prefill_rows` prompts of one bucket), decode (the
live slots, padded to a decode bucket, `decode_steps_per_call` tokens) and the page copies
of a swap. The gRPC service is a thin layer over it.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlax_tpu.config import InferenceConfig, ModelConfig
from rlax_tpu.inference.page_allocator import PADDING_PAGE
from rlax_tpu.inference.paged_cache import PagedKVCache
from rlax_tpu.inference.sampling import request_key_data
from rlax_tpu.inference.steps import (
    StaticKey,
    decode_step,
    pow2,
    prefill_step,
    read_pages,
    write_pages,
)
from rlax_tpu.inference.types import FinishReason, GenerationRequest, Rollout, SamplingParams
from rlax_tpu.inference.weights import ServedWeights
from rlax_tpu.sharding import logical_to_spec, use_mesh


class EngineNotLoadedError(RuntimeError):
    """The engine has no weights yet: call `load(version, params)` first."""


@dataclasses.dataclass(frozen=True)
class PagingState:
    """A snapshot of the engine's scheduling (`Engine.paging_state`): request ids in flight
    (submission order), in each decode slot (None: free; a slot holds a live sequence
    between steps), waiting and swapped out (by admission order); the pages in use, the
    page table (one row of page ids per slot, 0 = padding), the host bytes swapped-out
    sequences hold and what is wrong with the page bookkeeping (() when sound)."""

    in_flight: tuple[str, ...]
    slots: tuple[str | None, ...]
    waiting: tuple[str, ...]
    swapped: tuple[str, ...]
    used_pages: int
    page_table: np.ndarray
    swapped_bytes: int = 0
    problems: tuple[str, ...] = ()


@dataclasses.dataclass(eq=False)
class _Sequence:
    """Host-side state of a request in flight."""

    request: GenerationRequest
    sampling: SamplingParams
    limit: int  # response tokens allowed: max_new_tokens clipped by the slot's capacity
    version: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    slot: int = -1  # -1 while waiting or swapped out
    order: int = -1  # admission number: preemption takes the highest live one
    key_data: Any = None  # the request's sampling key (set at admission)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_tokens)


class Engine:
    """Continuous-batching generation for one model, one version of weights at a time.

    Pages (inference.kv_admission). "on_demand": a waiting request is admitted (FIFO) into
    a free slot when the pool has pages for its prompt plus one page of growth for every
    live sequence; before each decode call every live sequence gets the pages its next
    `decode_steps_per_call` tokens need, oldest admission first. When the pool cannot
    cover one, the most recently admitted live sequence is preempted: its pages are copied
    to host memory and freed (it may be the one growing). Swapped-out sequences come back,
    earliest admitted first, as soon as a slot and their pages (plus the same growth margin)
    are free, and no new request is admitted while any is out. A sequence alone always fits
    (`submit` refuses one whose prompt + limit exceeds the pool), so the engine never
    deadlocks. "reserve": pages for prompt + limit are reserved at admission; nothing ever
    swaps.

    Prefill: up to `prefill_rows` (inference.prefill_batch_size, resolved) requests are
    admitted together; each is padded to the smallest `prefill_buckets` entry that holds
    it, and those sharing a bucket are prefilled in one call of shape [prefill_rows,
    bucket] (unused rows are padding: no valid token, an all-padding page-table row, so they
    write nothing). The calls of one admission round share one device-to-host transfer.
    Decode: the live slots, padded to the smallest of `inference.decode_rows` that holds
    them. Compiled shapes: one per prefill bucket and one per decode bucket used, plus the
    swap copies (page counts rounded up to powers of two).

    Determinism: request key = threefry key from sha256(seed, prompt_id, sample_index,
    version); response token t is sampled with fold_in(key, t). Every prefill call has the
    shape [prefill_rows, bucket of the prompt], so for a given `prefill_rows` a request's
    first token is bitwise the same however it is batched. A decode row's numbers do not
    depend on the other rows or on which slot and pages it has as long as the platform's
    matmuls give a row the same bits at every decode bucket (XLA:CPU does from 64 rows up,
    hence the default buckets; docs/inference.md), and a swap copies pages bit for bit, so
    a request's tokens and log-probs are those of an unpreempted run. Across `prefill_rows`
    values the prefill shapes differ: log-probs may differ by float rounding.
    """

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
    ):
        """allocate=False builds the programs and layouts only, with no device memory: the
        KV cache stays abstract (`abstract_cache`) and the engine cannot generate, but
        `lower_prefill` / `lower_decode` lower its jitted steps (`rlax-tpu compile`, for a
        mesh of abstract TPU devices). `progress` hears of the first call of each jitted
        shape (its compile) and how long it took; nothing else."""
        self.progress = progress
        if decode_steps_per_call < 1:
            raise ValueError(f"decode_steps_per_call must be >= 1, got {decode_steps_per_call}")
        self.model_config = model_config
        self.config = inference_config
        self.seed = int(seed)
        self.defaults = SamplingParams.from_config(inference_config)
        self.version = -1
        self.decode_steps_per_call = decode_steps_per_call
        self.max_stop_tokens = max(max_stop_tokens, len(self.defaults.stop_token_ids))
        self._mesh = mesh
        self._rules = inference_config.mesh.logical_axis_rules
        self._weights = ServedWeights(model_config, inference_config, mesh)
        self._params: list[jax.Array] | None = None  # leaves of the model state, placed
        # The platform the steps are compiled for picks the attention kernel (TPU for a mesh
        # of abstract TPU devices on any host).
        platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
        self._new_cache = functools.partial(
            PagedKVCache.from_config, model_config, inference_config, platform=platform
        )
        self.abstract_cache = self._cache_layout(jax.eval_shape(self._new_cache))
        self._cache = self._allocate_cache() if allocate else None
        self._allocator = self.abstract_cache.make_allocator()
        self.num_slots = self.abstract_cache.batch_slots
        self.prefill_rows = inference_config.prefill_rows
        self.decode_rows = inference_config.decode_rows
        self.on_demand = inference_config.kv_admission == "on_demand"
        self.max_seq_len = self._allocator.max_tokens_per_seq
        # Pages a live sequence may need for one decode call (the admission margin).
        self._growth_pages = -(-decode_steps_per_call // self._allocator.page_size)
        self._slots: list[_Sequence | None] = [None] * self.num_slots
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._swapped: list[_Sequence] = []  # swapped out, by admission order
        self._admissions = 0
        self._in_flight: dict[str, _Sequence] = {}  # by request id, in submission order
        self._done: list[Rollout] = []  # finished, returned by the next step()
        self._init_slot_state()
        self._shapes: set[str] = set()  # jitted signatures used: "prefill:<rows>x<bucket>", ...
        # Seconds spent in first calls (compiles) so far, and when the one running began:
        # the worker's status reports them, so a watched call's deadline leaves them out.
        self._compile_s = 0.0
        self._compiling_since: float | None = None
        self._counters: collections.Counter = collections.Counter()
        # Static args of the jitted steps; the mesh is part of it since the model's sharding
        # constraints are read from the active mesh at trace time. Params travel as a flat
        # list of arrays (flattening an nnx.State on every call costs about a millisecond).
        mesh_key = None if mesh is None else (mesh, self._rules)
        self._static = (StaticKey.of(self._weights.graphdef, self._weights.treedef, mesh_key),)
        # Saved executables in place of jitted steps, by program key (`use_saved_executables`).
        self._programs: dict[str, Any] = {}

    # -- public API ----------------------------------------------------------------------
    def load(self, version: int, params: Mapping[str, Any]) -> list[Rollout]:
        """Serve `version` with `params` (a pure dict tree as `nnx.to_pure_dict` gives).

        Loading the version already served is a no-op (returns []). Otherwise every request
        in flight (queued or decoding) is aborted and returned, in submission order, with
        finish_reason "aborted"; requests submitted afterwards run with the new version.
        """
        if version == self.version:
            return []
        leaves = self._weights.place(params)  # validate first: a bad tree changes nothing
        aborted = [
            self._finish(seq, "aborted", report=False) for seq in self._in_flight.copy().values()
        ]
        self._params, self.version = leaves, int(version)
        return aborted

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request. One that can never run (empty or too long a prompt, bad token ids,
        more pages than the pool) finishes at once with finish_reason "error"."""
        if self.version < 0:
            raise EngineNotLoadedError("submit() before any load(): the engine has no weights")
        if request.request_id in self._in_flight:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        sampling = request.sampling or self.defaults
        prompt_len = len(request.prompt_tokens)
        limit = min(sampling.max_new_tokens, self.max_seq_len - prompt_len)
        seq = _Sequence(request, sampling, limit, self.version)
        self._in_flight[request.request_id] = seq
        problem = self._problem(request, sampling, limit)
        if problem:
            self._finish(seq, "error", error=problem)
        else:
            self._waiting.append(seq)

    def step(self) -> list[Rollout]:
        """One scheduler iteration: swap sequences back in and admit waiting prompts into free
        slots (prefill), give the live sequences their pages (swapping some out if the pool
        runs short), then one decode call for the live slots. Returns the rollouts that
        finished since the last step."""
        if self._waiting or self._swapped or self._active.any():
            self._admit()
            if self.on_demand:
                self._grow()
            if self._active.any():
                self._decode()
        done, self._done = self._done, []
        return done

    def has_work(self) -> bool:
        return bool(self._waiting or self._swapped or self._active.any() or self._done)

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
        return {
            "version": self.version,
            "tokens_generated": self._counters["tokens_generated"],
            "decode_steps": self._counters["decode_steps"],
            "decode_calls": self._counters["decode_calls"],
            "prefills": self._counters["prefills"],
            "prefill_calls": self._counters["prefill_calls"],
            "compiled_shapes": len(self._shapes),
            "compiled": sorted(self._shapes),
            "active_slots": int(self._active.sum()),
            "waiting": len(self._waiting),
            "swapped": len(self._swapped),
            "free_pages": self._allocator.free_pages,
            "total_pages": self._allocator.num_pages - 1,
            "preemptions": self._counters["preemptions"],
            "swap_out_bytes": self._counters["swap_out_bytes"],
            "swap_in_bytes": self._counters["swap_in_bytes"],
            # Live sequences per decode call, and the share of decode rows that were live.
            "mean_live_sequences": self._counters["live_rows"]
            / max(1, self._counters["decode_calls"]),
            "slot_utilization": self._counters["slot_tokens"]
            / max(1, self._counters["decode_rows"]),
        }

    def paging_state(self) -> PagingState:
        """Where every request in flight is and what the pool holds, as a snapshot."""

        def ids(seqs: Iterable[_Sequence]) -> tuple[str, ...]:
            return tuple(seq.request.request_id for seq in seqs)

        return PagingState(
            in_flight=tuple(self._in_flight),
            slots=tuple(None if s is None else s.request.request_id for s in self._slots),
            waiting=ids(self._waiting),
            swapped=ids(self._swapped),
            used_pages=self._allocator.used_pages,
            page_table=self._allocator.page_table.copy(),
            swapped_bytes=self._allocator.swapped_bytes,
            problems=tuple(self._allocator.invariant_problems()),
        )

    def read_kv_pages(self, pages: list[int]) -> tuple[tuple[np.ndarray, ...], ...]:
        """The keys and values of `pages` of the pool, every layer, on the host: (keys,
        values), each per layer [kv_heads, len(pages), page_size, head_dim]."""
        return self._read_pages(pages)

    @property
    def kv_cache(self) -> PagedKVCache | None:
        """The KV cache on its devices (None with allocate=False): read it, do not keep it
        (each step donates it and makes a new one)."""
        return self._cache

    def served_params(self) -> list[jax.Array]:
        """The weights the engine serves now, as placed leaves (empty before any load)."""
        return list(self._params or [])

    # -- admission and prefill -------------------------------------------------------------
    def _problem(self, request: GenerationRequest, sampling: SamplingParams, limit: int) -> str:
        """Why the request can never run, or "" if it can."""
        n, cfg = len(request.prompt_tokens), self.config
        if n == 0:
            return "empty prompt: at least one token is needed"
        if n > cfg.max_prompt_len:
            return f"prompt has {n} tokens, more than max_prompt_len ({cfg.max_prompt_len})"
        if limit < 1:
            return f"prompt has {n} tokens, a slot holds at most {self.max_seq_len}"
        vocab = self.model_config.vocab_size
        if not all(0 <= t < vocab for t in request.prompt_tokens):
            return f"prompt token ids must be in [0, {vocab})"
        if len(sampling.stop_token_ids) > self.max_stop_tokens:
            return f"{len(sampling.stop_token_ids)} stop tokens, at most {self.max_stop_tokens}"
        pages = self._allocator.pages_for(n + limit)
        if pages > self._allocator.num_pages - 1:
            return (
                f"{n} + {limit} tokens need {pages} pages, the pool has "
                f"{self._allocator.num_pages - 1}: raise kv_cache_bytes or lower max_new_tokens"
            )
        return ""

    def _admit(self) -> None:
        if self._params is None:
            raise EngineNotLoadedError("step() before any load(): the engine has no weights")
        self._resume()
        # A sequence that ends at its first token frees its slot and pages at once, so a
        # round may make room for another.
        while not self._swapped and (batch := self._take_waiting()):
            self._prefill(batch)

    def _fits(self, pages: int, joining: int = 0) -> bool:
        """Whether a sequence needing `pages` more pages may join the live ones and the
        `joining` others admitted with it: on demand, the pool must keep one decode call's
        growth for every sequence live after it (none when it would be alone: a lone
        sequence always fits)."""
        after = int(self._active.sum()) + joining + 1
        margin = after * self._growth_pages if self.on_demand and after > 1 else 0
        return pages + margin <= self._allocator.free_pages

    def _take_waiting(self) -> list[_Sequence]:
        """Up to `prefill_rows` waiting sequences, first in first out, each put in a free slot
        with pages for its prompt (on demand) or its whole sequence (reserve). Stops at the
        first that does not fit: it waits (FIFO) until a running sequence frees pages."""
        free = [s for s, seq in enumerate(self._slots) if seq is None][: self.prefill_rows]
        batch: list[_Sequence] = []
        for slot in free:
            if not self._waiting:
                break
            seq = self._waiting[0]
            tokens = seq.prompt_len if self.on_demand else seq.prompt_len + seq.limit
            pages = self._allocator.pages_for(tokens)
            if not self._fits(pages, len(batch)) or not self._allocator.try_reserve(slot, tokens):
                break
            self._waiting.popleft()
            seq.slot, seq.order = slot, self._admissions
            self._admissions += 1
            self._slots[slot] = seq
            batch.append(seq)
        return batch

    # -- pages on demand: growth, swap-out, swap-in ----------------------------------------
    def _grow(self) -> None:
        """Give every live sequence the pages its next decode call writes, oldest admission
        first; when the pool runs out, swap out the most recently admitted live sequence
        (possibly the one growing) and retry."""
        k, free = self.decode_steps_per_call, self._allocator.free_pages
        for seq in sorted(self._live(), key=lambda q: q.order):
            if seq.slot < 0:
                continue  # swapped out below, to make room for an older one
            # The token fed at position p is written there; the last one fed is at
            # prompt_len + limit - 2 (the final token is sampled, never fed).
            tokens = min(int(self._position[seq.slot]) + k, seq.prompt_len + seq.limit - 1)
            while not self._allocator.try_reserve(seq.slot, tokens):
                victim = max(self._live(), key=lambda q: q.order)
                self._swap_out(victim)
                if victim is seq:
                    break
        if self._allocator.free_pages != free:
            self._page_table_dirty = True

    def _live(self) -> list[_Sequence]:
        return [self._slots[s] for s in np.flatnonzero(self._active).tolist()]

    def _swap_out(self, seq: _Sequence) -> None:
        host = self._allocator.swap_out(seq.slot, seq, self._read_pages)
        self._slots[seq.slot] = None
        self._active[seq.slot] = False
        seq.slot = -1
        bisect.insort(self._swapped, seq, key=lambda q: q.order)
        self._counters["preemptions"] += 1
        self._counters["swap_out_bytes"] += host.nbytes
        self._page_table_dirty = self._carry_dirty = True

    def _resume(self) -> None:
        """Swap sequences back in, earliest admitted first, while a slot and their pages
        (with the growth margin) are free; stops at the first that does not fit."""
        while self._swapped:
            seq = self._swapped[0]
            free = [s for s, other in enumerate(self._slots) if other is None]
            host = self._allocator.swapped[seq]
            if not free or not self._fits(host.num_pages):
                return
            slot = free[0]
            self._allocator.swap_in(seq, slot, self._write_pages)
            self._swapped.pop(0)
            seq.slot = slot
            self._slots[slot] = seq
            self._set_slot_sampling(slot, seq)
            self._activate(seq, len(seq.tokens))
            self._counters["swap_in_bytes"] += host.nbytes
            self._page_table_dirty = True

    def _read_pages(self, pages: list[int]) -> tuple[tuple[np.ndarray, ...], ...]:
        """The keys and values of `pages` (every layer) copied to the host: per layer
        [kv_heads, len(pages), page_size, head_dim]."""
        index = np.zeros(pow2(len(pages)), np.int32)  # padded with the padding page
        index[: len(pages)] = pages
        with self._mesh_context():
            read = self._program(f"swap_out@{len(index)}", read_pages)
            keys, values = jax.device_get(read(self._cache, self._put(index)))
        n = len(pages)
        return tuple(k[:, :n].copy() for k in keys), tuple(v[:, :n].copy() for v in values)

    def _write_pages(self, pages: list[int], data: tuple[tuple[np.ndarray, ...], ...]) -> None:
        """Copy a swapped-out sequence's keys and values (`_read_pages`) into `pages`."""
        n, size = len(pages), pow2(len(pages))
        index = np.full(size, self._allocator.num_pages, np.int32)  # padding: dropped
        index[:n] = pages

        def padded(x: np.ndarray) -> np.ndarray:
            out = np.zeros((x.shape[0], size, *x.shape[2:]), x.dtype)
            out[:, :n] = x
            return out

        keys, values = (tuple(padded(x) for x in part) for part in data)
        # Each device receives only its own kv heads of the pages, as the pool holds them.
        pool = self.abstract_cache.keys[0].sharding
        keys, values = jax.device_put((keys, values), pool)
        with self._mesh_context():
            write = self._program(f"swap_in@{size}", write_pages)
            self._cache = write(self._cache, self._put(index), keys, values)

    def _prefill(self, batch: list[_Sequence]) -> None:
        """Prefill `batch` (admitted, in FIFO order): one call per bucket among its prompts,
        one device-to-host transfer for all, then each sequence's first token in order."""
        by_bucket: dict[int, list[_Sequence]] = {}
        for seq in batch:
            bucket = next(b for b in self.config.prefill_buckets if b >= seq.prompt_len)
            by_bucket.setdefault(bucket, []).append(seq)
        for seq in batch:
            r = seq.request
            seq.key_data = request_key_data(self.seed, r.prompt_id, r.sample_index, seq.version)
        outs = [self._prefill_call(bucket, seqs) for bucket, seqs in by_bucket.items()]
        first: dict[_Sequence, tuple[int, float]] = {}
        for seqs, packed in zip(by_bucket.values(), jax.device_get(outs), strict=True):
            tokens, logprobs = packed[0].tolist(), packed[1].view(np.float32).tolist()
            for row, seq in enumerate(seqs):
                first[seq] = tokens[row], logprobs[row]
        self._counters["prefills"] += len(batch)
        self._page_table_dirty = True
        for seq in batch:
            slot = seq.slot
            self._set_slot_sampling(slot, seq)
            token, logprob = first[seq]
            if not self._append(seq, token, logprob):
                self._activate(seq, 1)

    def _activate(self, seq: _Sequence, generated: int) -> None:
        """Mark `seq`'s slot live with `generated` response tokens so far: its next decode
        step feeds the last one at position prompt_len + generated - 1."""
        slot = seq.slot
        self._active[slot] = True
        self._last_token[slot] = seq.tokens[-1]
        self._position[slot] = seq.prompt_len + generated - 1
        self._index[slot] = generated
        self._carry_dirty = True

    def _prefill_call(self, bucket: int, seqs: list[_Sequence]) -> jax.Array:
        """Dispatch one prefill of `seqs` (at most prefill_rows, all in `bucket`); returns the
        packed int32[2, prefill_rows] (first tokens, log-prob bits) still on the device.

        Unused rows are padding: length 0 (no valid token), an all-padding page-table row
        (PADDING_PAGE; writes there are dropped) and non-truncating sampling params."""
        args = self._prefill_args(bucket, seqs)
        what = f"prefill for {self.prefill_rows}x{bucket} prompt tokens"
        step = self._program(f"prefill@{bucket}", prefill_step)
        first = (
            None
            if step is not prefill_step
            else self._first_call(f"prefill:{self.prefill_rows}x{bucket}", what)
        )
        self._counters["prefill_calls"] += 1
        with self._mesh_context():
            packed, self._cache = step(*self._static, self._params, self._cache, *self._put(args))
        if first is not None:  # the call returns once compiled; it runs asynchronously
            seconds = first()
            if self.progress is not None:
                self.progress(f"{what}: compiled in {seconds:.1f}s")
        return packed

    def _prefill_args(self, bucket: int, seqs: list[_Sequence]) -> tuple[np.ndarray, ...]:
        """The host arguments of a prefill call after (params, cache): page-table rows,
        tokens, lengths, key data, temperature, top_k, top_p, "sampled" flags."""
        rows = self.prefill_rows
        page_rows = np.full((rows, self._allocator.pages_per_seq), PADDING_PAGE, np.int32)
        tokens = np.zeros((rows, bucket), np.int32)
        lengths = np.zeros(rows, np.int32)
        key_data = np.zeros((rows, 2), np.uint32)
        temperature = np.ones(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        top_p = np.ones(rows, np.float32)
        sampled_logprobs = np.zeros(rows, bool)
        for row, seq in enumerate(seqs):
            prompt, s = seq.request.prompt_tokens, seq.sampling
            page_rows[row] = self._allocator.page_table[seq.slot]
            tokens[row, : len(prompt)] = prompt
            lengths[row] = len(prompt)
            key_data[row] = seq.key_data
            temperature[row], top_k[row], top_p[row] = s.temperature, s.top_k, s.top_p
            sampled_logprobs[row] = s.logprobs_of == "sampled"
        return (page_rows, tokens, lengths, key_data, temperature, top_k, top_p, sampled_logprobs)

    # -- decode --------------------------------------------------------------------------
    def _decode(self) -> None:
        live = np.flatnonzero(self._active)
        rows = next(b for b in self.decode_rows if b >= len(live))
        padded = np.full(rows, self.num_slots, np.int32)  # padding rows: out of range
        padded[: len(live)] = live
        if self._live_rows is None or not np.array_equal(padded, self._live_rows):
            self._live_rows, self._device_live = padded, self._put(padded)
        if self._page_table_dirty:
            self._cache = self._cache.with_page_table(self._put(self._allocator.page_table))
            self._page_table_dirty = False
        if self._sampling_dirty:
            self._device_sampling = self._put(self._sampling_arrays())
            self._sampling_dirty = False
        if self._carry_dirty:
            carry = (self._last_token, self._position, self._index, self._active)
            self._device_carry = self._put(carry)
            self._carry_dirty = False
        k = self.decode_steps_per_call
        what = f"decode for {rows} slots, {k} steps a call"
        step = self._program(f"decode@{rows}", decode_step)
        first = None if step is not decode_step else self._first_call(f"decode:{rows}x{k}", what)
        with self._mesh_context():
            self._cache, self._device_carry, out = step(
                *self._static,
                k,
                self._params,
                self._cache,
                self._device_carry,
                self._device_sampling,
                self._device_live,
            )
        packed = np.asarray(out)  # the one device-to-host transfer per decode call
        if first is not None:
            seconds = first()
            if self.progress is not None:
                self.progress(f"{what}: compiled and ran in {seconds:.1f}s")
        tokens, emitted = packed[0].T.tolist(), packed[2].T.tolist()  # [rows][steps]
        logprobs = packed[1].view(np.float32).T.tolist()
        self._counters["decode_calls"] += 1
        self._counters["decode_steps"] += k
        self._counters["decode_rows"] += rows * k
        self._counters["live_rows"] += len(live)
        for row, slot in enumerate(live.tolist()):
            seq, taken, finished = self._slots[slot], 0, False
            for token, logprob, real in zip(tokens[row], logprobs[row], emitted[row], strict=True):
                if finished or not real:
                    break
                finished = self._append(seq, token, logprob)
                taken += 1
            self._counters["slot_tokens"] += taken
            if not finished:
                self._last_token[slot] = seq.tokens[-1]
                self._position[slot] += taken
                self._index[slot] += taken

    def _first_call(self, shape: str, what: str) -> Callable[[], float] | None:
        """Record `shape` ("decode:<rows>x<steps>") as used. The first time, say that `what`
        compiles (with a `progress` to tell) and return a clock of the seconds since;
        reading it ends the compile's count in `compile_seconds`."""
        if shape in self._shapes:
            return None
        self._shapes.add(shape)
        if self.progress is not None:
            self.progress(f"compiling the {what} ...")
        t0 = self._compiling_since = time.monotonic()

        def done() -> float:
            seconds = time.monotonic() - t0
            if self._compiling_since == t0:
                self._compile_s += seconds
                self._compiling_since = None
            return seconds

        return done

    def compile_seconds(self) -> float:
        """Seconds spent compiling so far, a compile in progress included (any thread may
        ask: two plain reads)."""
        since = self._compiling_since
        return self._compile_s + (time.monotonic() - since if since is not None else 0.0)

    def compiling_seconds(self) -> float:
        """Seconds the compile running now has taken (0.0 when none runs)."""
        since = self._compiling_since
        return time.monotonic() - since if since is not None else 0.0

    def _append(self, seq: _Sequence, token: int, logprob: float) -> bool:
        """Record a sampled token; finish the sequence if it ends it. Returns whether it did."""
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        self._counters["tokens_generated"] += 1
        if token in seq.sampling.stop_token_ids:
            self._finish(seq, "stop")
        elif len(seq.tokens) >= seq.limit:
            self._finish(seq, "length")
        else:
            return False
        return True

    def _finish(
        self, seq: _Sequence, reason: FinishReason, *, error: str = "", report: bool = True
    ) -> Rollout:
        """End a sequence: free its slot and pages at once, and build its rollout."""
        if seq.slot >= 0:
            self._allocator.free(seq.slot)
            self._slots[seq.slot] = None
            self._active[seq.slot] = False
            self._carry_dirty = True
        elif seq in self._allocator.swapped:
            self._allocator.drop_swapped(seq)
            self._swapped.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        del self._in_flight[seq.request.request_id]
        r = seq.request
        rollout = Rollout(
            request_id=r.request_id,
            prompt_id=r.prompt_id,
            sample_index=r.sample_index,
            version=seq.version,
            prompt_tokens=tuple(r.prompt_tokens),
            tokens=tuple(seq.tokens),
            logprobs=tuple(seq.logprobs),
            finish_reason=reason,
            error=error,
        )
        if report:
            self._done.append(rollout)
        return rollout

    # -- per-slot state, mirrored on the host and committed to the device on change ------
    def _init_slot_state(self) -> None:
        n = self.num_slots
        self._last_token = np.zeros(n, np.int32)
        self._position = np.zeros(n, np.int32)
        self._index = np.zeros(n, np.int32)  # response tokens so far = t of the next token
        self._active = np.zeros(n, bool)
        self._key_data = np.zeros((n, 2), np.uint32)
        self._temperature = np.ones(n, np.float32)
        self._top_k = np.zeros(n, np.int32)
        self._top_p = np.ones(n, np.float32)
        self._sampled_logprobs = np.zeros(n, bool)
        self._limit = np.ones(n, np.int32)
        self._stop_ids = np.full((n, self.max_stop_tokens), -1, np.int32)
        self._page_table_dirty = self._sampling_dirty = self._carry_dirty = True
        self._device_carry = self._device_sampling = self._device_live = None
        self._live_rows: np.ndarray | None = None  # the slots of the last decode's rows

    def _set_slot_sampling(self, slot: int, seq: _Sequence) -> None:
        s = seq.sampling
        self._key_data[slot] = seq.key_data
        self._temperature[slot] = s.temperature
        self._top_k[slot] = s.top_k
        self._top_p[slot] = s.top_p
        self._sampled_logprobs[slot] = s.logprobs_of == "sampled"
        self._limit[slot] = seq.limit
        self._stop_ids[slot] = -1
        self._stop_ids[slot, : len(s.stop_token_ids)] = s.stop_token_ids
        self._sampling_dirty = True

    def _sampling_arrays(self) -> tuple[np.ndarray, ...]:
        return (
            self._key_data,
            self._temperature,
            self._top_k,
            self._top_p,
            self._sampled_logprobs,
            self._limit,
            self._stop_ids,
        )

    def _cache_layout(self, cache: PagedKVCache) -> PagedKVCache:
        """The abstract `cache` (ShapeDtypeStructs) with its placement: pools sharded over kv
        heads like the model's activations, the page table replicated; unplaced without a
        mesh."""
        if self._mesh is None:
            return cache
        pool = cache.keys[0]
        spec = logical_to_spec(
            ("act_kv_heads", None, None, "head_dim"), self._rules, shape=pool.shape, mesh=self._mesh
        )
        pools = NamedSharding(self._mesh, spec)
        replicated = NamedSharding(self._mesh, PartitionSpec())

        def placed(x: jax.ShapeDtypeStruct, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        return cache.replace(
            keys=tuple(placed(k, pools) for k in cache.keys),
            values=tuple(placed(v, pools) for v in cache.values),
            page_table=placed(cache.page_table, replicated),
        )

    def _allocate_cache(self) -> PagedKVCache:
        """Zeroed pools and page table, created in place on their devices (no pool ever
        lives whole on one device)."""
        if self._mesh is None:
            return self._new_cache()
        shardings = jax.tree.map(lambda x: x.sharding, self.abstract_cache)
        return jax.jit(self._new_cache, out_shardings=shardings)()

    # -- lowering without hardware (rlax-tpu compile) -------------------------------------
    def abstract_params(self) -> list[jax.ShapeDtypeStruct]:
        """The served weights as the jitted steps take them, abstract (`ServedWeights`)."""
        return self._weights.abstract()

    def _abstract_host(self, tree: Any) -> Any:
        """Host arrays as `_put` would place them (replicated), abstract."""
        sharding = None if self._mesh is None else NamedSharding(self._mesh, PartitionSpec())
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding),
            tree,
        )

    # Each jitted step as (the jitted function, its abstract arguments, the static argnums):
    # what `rlax-tpu compile` lowers, what `--save-compiled` saves under the program's key
    # ("prefill@128", "decode@64", "swap_out@8", "swap_in@8"), and what a worker with
    # `inference.compiled_dir` loads in place of compiling.
    def _prefill_lowering(self, bucket: int) -> tuple[Any, tuple, tuple[int, ...]]:
        """The prefill step of `prefill_rows` prompts of `bucket` tokens, on abstract
        weights, cache and arguments (those `_prefill_call` builds)."""
        args = self._abstract_host(self._prefill_args(bucket, []))
        return (
            prefill_step,
            (*self._static, self.abstract_params(), self.abstract_cache, *args),
            (0,),
        )

    def _decode_lowering(self, rows: int) -> tuple[Any, tuple, tuple[int, ...]]:
        """The decode step of `rows` live slots for `decode_steps_per_call` tokens."""
        carry = (self._last_token, self._position, self._index, self._active)
        args = (
            *self._static,
            self.decode_steps_per_call,
            self.abstract_params(),
            self.abstract_cache,
            self._abstract_host(carry),
            self._abstract_host(self._sampling_arrays()),
            self._abstract_host(np.zeros(rows, np.int32)),
        )
        return decode_step, args, (0, 1)

    def _swap_out_lowering(self, pages: int) -> tuple[Any, tuple, tuple[int, ...]]:
        """The copy of `pages` pages out of the pool (`_read_pages`: what a swap-out runs
        before its device-to-host transfer)."""
        return (
            read_pages,
            (self.abstract_cache, self._abstract_host(np.zeros(pages, np.int32))),
            (),
        )

    def _swap_in_lowering(self, pages: int) -> tuple[Any, tuple, tuple[int, ...]]:
        """The write of `pages` swapped pages back into the pool (`_write_pages`, the pool
        donated)."""
        pool = self.abstract_cache.keys[0]

        def page_block(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(
                (x.shape[0], pages, *x.shape[2:]), x.dtype, sharding=pool.sharding
            )

        keys = tuple(page_block(k) for k in self.abstract_cache.keys)
        values = tuple(page_block(v) for v in self.abstract_cache.values)
        index = self._abstract_host(np.zeros(pages, np.int32))
        return write_pages, (self.abstract_cache, index, keys, values), ()

    def lowerings(self) -> dict[str, tuple[Any, tuple, tuple[int, ...]]]:
        """Every program of the engine at every bucket, by its key."""
        out = {f"prefill@{b}": self._prefill_lowering(b) for b in self.config.prefill_buckets}
        out.update({f"decode@{r}": self._decode_lowering(r) for r in self.decode_rows})
        out[f"swap_out@{self.swap_pages}"] = self._swap_out_lowering(self.swap_pages)
        out[f"swap_in@{self.swap_pages}"] = self._swap_in_lowering(self.swap_pages)
        return out

    def lower(self, key: str) -> jax.stages.Lowered:
        """The program of `key` (one of `lowerings()`), lowered abstract."""
        return self._lower(self.lowerings()[key])

    @property
    def saved_programs(self) -> dict[str, Any]:
        """The saved executables this engine runs (`use_saved_executables`), by key; each
        counts the calls it ran (`calls`)."""
        return dict(self._programs)

    def _lower(self, lowering: tuple[Any, tuple, tuple[int, ...]]) -> jax.stages.Lowered:
        jitted, args, _ = lowering
        with self._mesh_context():
            return jitted.lower(*args)

    def lower_prefill(self, bucket: int) -> jax.stages.Lowered:
        return self._lower(self._prefill_lowering(bucket))

    def lower_decode(self, rows: int | None = None) -> jax.stages.Lowered:
        """Default: the largest decode bucket (max_decode_slots)."""
        return self._lower(self._decode_lowering(rows or self.decode_rows[-1]))

    @property
    def swap_pages(self) -> int:
        """The most pages one swap copy moves (a whole sequence's, rounded up to the power of
        two the copies compile at)."""
        return pow2(self._allocator.pages_per_seq)

    def lower_swap_out(self, pages: int | None = None) -> jax.stages.Lowered:
        return self._lower(self._swap_out_lowering(pages or self.swap_pages))

    def lower_swap_in(self, pages: int | None = None) -> jax.stages.Lowered:
        return self._lower(self._swap_in_lowering(pages or self.swap_pages))

    def use_saved_executables(self, directory: str) -> list[str]:
        """Run the executables `directory` holds (`rlax-tpu compile --save-compiled`) in
        place of compiling, for the programs and shapes they were compiled for; returns their
        keys. CompiledMismatchError when one was compiled for another program or mesh."""
        from rlax_tpu.compile import executables

        if self._mesh is None:
            raise executables.CompiledMismatchError(
                "saved executables are compiled for a mesh; this engine has none"
            )
        loaded = []
        for key, lowering in self.lowerings().items():
            executable = executables.load(directory, key, self._lower(lowering), self._mesh)
            if executable is not None:
                jitted, args, static = lowering
                self._programs[key] = executables.SavedProgram(executable, jitted, args, static)
                loaded.append(key)
        return loaded

    def _program(self, key: str, jitted: Any) -> Any:
        """The saved executable of `key` if one was loaded, else the jitted step."""
        return self._programs.get(key, jitted)

    def _put(self, tree: Any) -> Any:
        """Host arrays to the device (replicated over the mesh, if any). Copied first: on
        CPU a device array may alias the numpy buffer, and the host mirrors change."""
        tree = jax.tree.map(np.array, tree)
        if self._mesh is None:
            return jax.device_put(tree)
        return jax.device_put(tree, NamedSharding(self._mesh, PartitionSpec()))

    def _mesh_context(self) -> contextlib.AbstractContextManager:
        if self._mesh is None:
            return contextlib.nullcontext()
        return use_mesh(self._mesh, self._rules)


# -- the jitted steps: module-level so engines of the same model share compilations ----------
