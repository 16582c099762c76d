"""The engine's host scheduler: which requests wait, which decode slot each live one has, its
pages (on demand, swapping sequences out to host memory and back when the pool runs short),
the per-slot arrays the jitted steps take, and the tokens they sampled. Host code only (numpy,
no JAX): the engine (engine.py) hands its device work (prefill, swap copies) in as callables
and runs the decode call itself, so tests drive the scheduler with stand-ins."""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from rlax_tpu.api.inference import FinishReason, GenerationRequest, Rollout, SamplingParams
from rlax_tpu.config import InferenceConfig
from rlax_tpu.inference.page_allocator import PADDING_PAGE, PageAllocator
from rlax_tpu.inference.sampling import request_key_data

# The device work the engine hands in. A prefill round: (bucket, `prefill_args`) per call ->
# each call's packed first tokens, int32[2, prefill_rows], on the host. A swap's copy of
# pages to the host and back (`PageAllocator.swap_out` / `swap_in`).
Prefill = Callable[[list[tuple[int, tuple[np.ndarray, ...]]]], list[np.ndarray]]
ReadPages = Callable[[list[int]], Any]
WritePages = Callable[[list[int], Any], None]


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
class SequenceState:
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

    def rollout(self, reason: FinishReason, error: str = "") -> Rollout:
        r = self.request
        return Rollout(
            request_id=r.request_id,
            prompt_id=r.prompt_id,
            sample_index=r.sample_index,
            version=self.version,
            prompt_tokens=tuple(r.prompt_tokens),
            tokens=tuple(self.tokens),
            logprobs=tuple(self.logprobs),
            finish_reason=reason,
            error=error,
        )


def prefill_args(
    rows: int, bucket: int, page_table: np.ndarray, seqs: list[SequenceState]
) -> tuple[np.ndarray, ...]:
    """The host arguments of a prefill call of `seqs` (at most `rows`, all in `bucket`) after
    (params, cache): page-table rows, tokens, lengths, key data, temperature, top_k, top_p,
    "sampled" flags. Unused rows are padding: length 0 (no valid token), an all-padding
    page-table row (PADDING_PAGE; writes there are dropped) and non-truncating sampling
    params."""
    page_rows = np.full((rows, page_table.shape[1]), PADDING_PAGE, np.int32)
    tokens = np.zeros((rows, bucket), np.int32)
    lengths = np.zeros(rows, np.int32)
    key_data = np.zeros((rows, 2), np.uint32)
    temperature = np.ones(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    sampled_logprobs = np.zeros(rows, bool)
    for row, seq in enumerate(seqs):
        prompt, s = seq.request.prompt_tokens, seq.sampling
        page_rows[row] = page_table[seq.slot]
        tokens[row, : len(prompt)] = prompt
        lengths[row] = len(prompt)
        key_data[row] = seq.key_data
        temperature[row], top_k[row], top_p[row] = s.temperature, s.top_k, s.top_p
        sampled_logprobs[row] = s.logprobs_of == "sampled"
    return (page_rows, tokens, lengths, key_data, temperature, top_k, top_p, sampled_logprobs)


class SlotArrays:
    """Per-slot arrays as the decode step takes them, mirrored on the host: each [slots]
    (key_data uint32[slots, 2], stop_ids int32[slots, max_stop_tokens]). The engine commits
    each group (and the allocator's page table) to the device before a decode call only
    when its `*_dirty` flag says it changed since."""

    def __init__(self, num_slots: int, max_stop_tokens: int):
        n = num_slots
        self.last_token = np.zeros(n, np.int32)
        self.position = np.zeros(n, np.int32)
        self.index = np.zeros(n, np.int32)  # response tokens so far = t of the next token
        self.active = np.zeros(n, bool)
        self.key_data = np.zeros((n, 2), np.uint32)
        self.temperature = np.ones(n, np.float32)
        self.top_k = np.zeros(n, np.int32)
        self.top_p = np.ones(n, np.float32)
        self.sampled_logprobs = np.zeros(n, bool)
        self.limit = np.ones(n, np.int32)
        self.stop_ids = np.full((n, max_stop_tokens), -1, np.int32)
        self.page_table_dirty = self.sampling_dirty = self.carry_dirty = True

    def carry(self) -> tuple[np.ndarray, ...]:
        """The decode step's carry: last token, position, index, active."""
        return (self.last_token, self.position, self.index, self.active)

    def sampling(self) -> tuple[np.ndarray, ...]:
        """The decode step's sampling arrays (`steps.decode_step`)."""
        return (
            self.key_data,
            self.temperature,
            self.top_k,
            self.top_p,
            self.sampled_logprobs,
            self.limit,
            self.stop_ids,
        )

    def decode_rows(self, buckets: tuple[int, ...]) -> np.ndarray:
        """The slot of each row of the next decode call: the live slots, padded (with the
        slot count, out of range) to the smallest of `buckets` that holds them."""
        live = np.flatnonzero(self.active)
        padded = np.full(next(b for b in buckets if b >= len(live)), len(self.active), np.int32)
        padded[: len(live)] = live
        return padded

    def set_sampling(self, slot: int, seq: SequenceState) -> None:
        s = seq.sampling
        self.key_data[slot] = seq.key_data
        self.temperature[slot] = s.temperature
        self.top_k[slot] = s.top_k
        self.top_p[slot] = s.top_p
        self.sampled_logprobs[slot] = s.logprobs_of == "sampled"
        self.limit[slot] = seq.limit
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : len(s.stop_token_ids)] = s.stop_token_ids
        self.sampling_dirty = True

    def activate(self, seq: SequenceState, generated: int) -> None:
        """Mark `seq`'s slot live with `generated` response tokens so far: its next decode
        step feeds the last one at position prompt_len + generated - 1."""
        slot = seq.slot
        self.active[slot] = True
        self.last_token[slot] = seq.tokens[-1]
        self.position[slot] = seq.prompt_len + generated - 1
        self.index[slot] = generated
        self.carry_dirty = True


class Scheduler:
    """Admission, pages and swaps of the requests in flight, over `allocator`'s pool and its
    decode slots.

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

    Prefill rounds take up to `prefill_rows` waiting requests, grouped by the smallest
    `prefill_buckets` entry that holds each prompt.
    """

    def __init__(
        self,
        config: InferenceConfig,
        allocator: PageAllocator,
        *,
        seed: int,
        vocab_size: int,
        decode_steps_per_call: int,
        max_stop_tokens: int,
    ):
        self.config, self.allocator = config, allocator
        self.seed, self.vocab_size = seed, vocab_size
        self.defaults = SamplingParams.from_config(config)
        self.max_stop_tokens = max(max_stop_tokens, len(self.defaults.stop_token_ids))
        self.decode_steps_per_call = decode_steps_per_call
        self.num_slots, self.max_seq_len = allocator.max_seqs, allocator.max_tokens_per_seq
        self.prefill_rows, self.decode_rows = config.prefill_rows, config.decode_rows
        self.on_demand = config.kv_admission == "on_demand"
        # Pages a live sequence may need for one decode call (the admission margin).
        self._growth_pages = -(-decode_steps_per_call // allocator.page_size)
        self.arrays = SlotArrays(self.num_slots, self.max_stop_tokens)
        self._slots: list[SequenceState | None] = [None] * self.num_slots
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._swapped: list[SequenceState] = []  # swapped out, by admission order
        self._admissions = 0
        self._in_flight: dict[str, SequenceState] = {}  # by request id, in submission order
        self._done: list[Rollout] = []  # finished, returned by the next step()
        self.counters: collections.Counter = collections.Counter()

    def submit(self, request: GenerationRequest, version: int) -> None:
        """Queue a request; one that can never run finishes at once with "error"."""
        if request.request_id in self._in_flight:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        sampling = request.sampling or self.defaults
        limit = min(sampling.max_new_tokens, self.max_seq_len - len(request.prompt_tokens))
        seq = SequenceState(request, sampling, limit, version)
        self._in_flight[request.request_id] = seq
        problem = self._problem(request, sampling, limit)
        if problem:
            self._finish(seq, "error", error=problem)
        else:
            self._waiting.append(seq)

    def busy(self) -> bool:
        """Whether any request waits, is swapped out or decodes."""
        return bool(self._waiting or self._swapped or self.arrays.active.any())

    def has_done(self) -> bool:
        return bool(self._done)

    def take_done(self) -> list[Rollout]:
        """The rollouts finished since the last call."""
        done, self._done = self._done, []
        return done

    def abort_all(self) -> list[Rollout]:
        """End every request in flight with "aborted"; their rollouts, in submission order."""
        return [self._finish(seq, "aborted", report=False) for seq in [*self._in_flight.values()]]

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "tokens_generated": c["tokens_generated"],
            "decode_steps": c["decode_steps"],
            "decode_calls": c["decode_calls"],
            "prefills": c["prefills"],
            "prefill_calls": c["prefill_calls"],
            "active_slots": int(self.arrays.active.sum()),
            "waiting": len(self._waiting),
            "swapped": len(self._swapped),
            "free_pages": self.allocator.free_pages,
            "total_pages": self.allocator.num_pages - 1,
            "preemptions": c["preemptions"],
            "swap_out_bytes": c["swap_out_bytes"],
            "swap_in_bytes": c["swap_in_bytes"],
            # Live sequences per decode call, and the share of decode rows that were live.
            "mean_live_sequences": c["live_rows"] / max(1, c["decode_calls"]),
            "slot_utilization": c["slot_tokens"] / max(1, c["decode_rows"]),
        }

    def paging_state(self) -> PagingState:
        def ids(seqs: Iterable[SequenceState]) -> tuple[str, ...]:
            return tuple(seq.request.request_id for seq in seqs)

        return PagingState(
            in_flight=tuple(self._in_flight),
            slots=tuple(None if s is None else s.request.request_id for s in self._slots),
            waiting=ids(self._waiting),
            swapped=ids(self._swapped),
            used_pages=self.allocator.used_pages,
            page_table=self.allocator.page_table.copy(),
            swapped_bytes=self.allocator.swapped_bytes,
            problems=tuple(self.allocator.invariant_problems()),
        )

    def _problem(self, request: GenerationRequest, sampling: SamplingParams, limit: int) -> str:
        """Why the request can never run, or "" if it can."""
        n, cfg = len(request.prompt_tokens), self.config
        if n == 0:
            return "empty prompt: at least one token is needed"
        if n > cfg.max_prompt_len:
            return f"prompt has {n} tokens, more than max_prompt_len ({cfg.max_prompt_len})"
        if limit < 1:
            return f"prompt has {n} tokens, a slot holds at most {self.max_seq_len}"
        if not all(0 <= t < self.vocab_size for t in request.prompt_tokens):
            return f"prompt token ids must be in [0, {self.vocab_size})"
        if len(sampling.stop_token_ids) > self.max_stop_tokens:
            return f"{len(sampling.stop_token_ids)} stop tokens, at most {self.max_stop_tokens}"
        pages = self.allocator.pages_for(n + limit)
        if pages > self.allocator.num_pages - 1:
            return (
                f"{n} + {limit} tokens need {pages} pages, the pool has "
                f"{self.allocator.num_pages - 1}: raise kv_cache_bytes or lower max_new_tokens"
            )
        return ""

    # -- admission and prefill -------------------------------------------------------------
    def admit(self, prefill: Prefill, write_pages: WritePages) -> None:
        """Swap sequences back in (`write_pages` copies their pages into the pool), then admit
        waiting ones in prefill rounds (`prefill` runs a round's calls: their first tokens)."""
        self._resume(write_pages)
        # A sequence that ends at its first token frees its slot and pages at once, so a
        # round may make room for another.
        while not self._swapped and (batch := self._take_waiting()):
            self._prefill(batch, prefill)

    def _fits(self, pages: int, joining: int = 0) -> bool:
        """Whether a sequence needing `pages` more pages may join the live ones and the
        `joining` others admitted with it: on demand, the pool must keep one decode call's
        growth for every sequence live after it (none when it would be alone: a lone
        sequence always fits)."""
        after = int(self.arrays.active.sum()) + joining + 1
        margin = after * self._growth_pages if self.on_demand and after > 1 else 0
        return pages + margin <= self.allocator.free_pages

    def _take_waiting(self) -> list[SequenceState]:
        """Up to `prefill_rows` waiting sequences, first in first out, each put in a free slot
        with pages for its prompt (on demand) or its whole sequence (reserve). Stops at the
        first that does not fit: it waits (FIFO) until a running sequence frees pages."""
        free = [s for s, seq in enumerate(self._slots) if seq is None][: self.prefill_rows]
        batch: list[SequenceState] = []
        for slot in free:
            if not self._waiting:
                break
            seq = self._waiting[0]
            tokens = seq.prompt_len if self.on_demand else seq.prompt_len + seq.limit
            pages = self.allocator.pages_for(tokens)
            if not self._fits(pages, len(batch)) or not self.allocator.try_reserve(slot, tokens):
                break
            self._waiting.popleft()
            seq.slot, seq.order = slot, self._admissions
            self._admissions += 1
            self._slots[slot] = seq
            batch.append(seq)
        return batch

    def _prefill(self, batch: list[SequenceState], prefill: Prefill) -> None:
        """Prefill `batch` (admitted, in FIFO order): one call per bucket among its prompts,
        then each sequence's first token in order."""
        by_bucket: dict[int, list[SequenceState]] = {}
        for seq in batch:
            bucket = next(b for b in self.config.prefill_buckets if b >= seq.prompt_len)
            by_bucket.setdefault(bucket, []).append(seq)
        for seq in batch:
            r = seq.request
            seq.key_data = request_key_data(self.seed, r.prompt_id, r.sample_index, seq.version)
        self.counters["prefill_calls"] += len(by_bucket)
        table, rows = self.allocator.page_table, self.prefill_rows
        outs = prefill([(b, prefill_args(rows, b, table, seqs)) for b, seqs in by_bucket.items()])
        first: dict[SequenceState, tuple[int, float]] = {}
        for seqs, packed in zip(by_bucket.values(), outs, strict=True):
            tokens, logprobs = packed[0].tolist(), packed[1].view(np.float32).tolist()
            for row, seq in enumerate(seqs):
                first[seq] = tokens[row], logprobs[row]
        self.counters["prefills"] += len(batch)
        self.arrays.page_table_dirty = True
        for seq in batch:
            self.arrays.set_sampling(seq.slot, seq)
            token, logprob = first[seq]
            if not self._append(seq, token, logprob):
                self.arrays.activate(seq, 1)

    # -- pages on demand: growth, swap-out, swap-in ----------------------------------------
    def grow(self, read_pages: ReadPages) -> None:
        """Give every live sequence the pages its next decode call writes, oldest admission
        first; when the pool runs out, swap out the most recently admitted live sequence
        (possibly the one growing; `read_pages` copies its pages to the host) and retry."""
        k, free = self.decode_steps_per_call, self.allocator.free_pages
        for seq in sorted(self._live(), key=lambda q: q.order):
            if seq.slot < 0:
                continue  # swapped out below, to make room for an older one
            # The token fed at position p is written there; the last one fed is at
            # prompt_len + limit - 2 (the final token is sampled, never fed).
            tokens = min(int(self.arrays.position[seq.slot]) + k, seq.prompt_len + seq.limit - 1)
            while not self.allocator.try_reserve(seq.slot, tokens):
                victim = max(self._live(), key=lambda q: q.order)
                self._swap_out(victim, read_pages)
                if victim is seq:
                    break
        if self.allocator.free_pages != free:
            self.arrays.page_table_dirty = True

    def _live(self) -> list[SequenceState]:
        return [self._slots[s] for s in np.flatnonzero(self.arrays.active).tolist()]

    def _swap_out(self, seq: SequenceState, read_pages: ReadPages) -> None:
        host = self.allocator.swap_out(seq.slot, seq, read_pages)
        self._slots[seq.slot] = None
        self.arrays.active[seq.slot] = False
        seq.slot = -1
        bisect.insort(self._swapped, seq, key=lambda q: q.order)
        self.counters["preemptions"] += 1
        self.counters["swap_out_bytes"] += host.nbytes
        self.arrays.page_table_dirty = self.arrays.carry_dirty = True

    def _resume(self, write_pages: WritePages) -> None:
        """Swap sequences back in, earliest admitted first, while a slot and their pages
        (with the growth margin) are free; stops at the first that does not fit."""
        while self._swapped:
            seq = self._swapped[0]
            free = [s for s, other in enumerate(self._slots) if other is None]
            host = self.allocator.swapped[seq]
            if not free or not self._fits(host.num_pages):
                return
            slot = free[0]
            self.allocator.swap_in(seq, slot, write_pages)
            self._swapped.pop(0)
            seq.slot = slot
            self._slots[slot] = seq
            self.arrays.set_sampling(slot, seq)
            self.arrays.activate(seq, len(seq.tokens))
            self.counters["swap_in_bytes"] += host.nbytes
            self.arrays.page_table_dirty = True

    # -- decode ------------------------------------------------------------------------------
    def decoded(self, live_rows: np.ndarray, packed: np.ndarray) -> None:
        """Take a decode call's output (`steps.decode_step`: int32[3, steps, rows]) for the
        slots of `live_rows` (`SlotArrays.decode_rows`)."""
        _, k, rows = packed.shape
        tokens, emitted = packed[0].T.tolist(), packed[2].T.tolist()  # [rows][steps]
        logprobs = packed[1].view(np.float32).T.tolist()
        live = live_rows[live_rows < self.num_slots].tolist()
        self.counters["decode_calls"] += 1
        self.counters["decode_steps"] += k
        self.counters["decode_rows"] += rows * k
        self.counters["live_rows"] += len(live)
        a = self.arrays
        for row, slot in enumerate(live):
            seq, taken, finished = self._slots[slot], 0, False
            for token, logprob, real in zip(tokens[row], logprobs[row], emitted[row], strict=True):
                if finished or not real:
                    break
                finished = self._append(seq, token, logprob)
                taken += 1
            self.counters["slot_tokens"] += taken
            if not finished:
                a.last_token[slot] = seq.tokens[-1]
                a.position[slot] += taken
                a.index[slot] += taken

    def _append(self, seq: SequenceState, token: int, logprob: float) -> bool:
        """Record a sampled token; finish the sequence if it ends it. Returns whether it did."""
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        self.counters["tokens_generated"] += 1
        if token in seq.sampling.stop_token_ids:
            self._finish(seq, "stop")
        elif len(seq.tokens) >= seq.limit:
            self._finish(seq, "length")
        else:
            return False
        return True

    def _finish(
        self, seq: SequenceState, reason: FinishReason, *, error: str = "", report: bool = True
    ) -> Rollout:
        """End a sequence: free its slot and pages at once, and build its rollout."""
        if seq.slot >= 0:
            self.allocator.free(seq.slot)
            self._slots[seq.slot] = None
            self.arrays.active[seq.slot] = False
            self.arrays.carry_dirty = True
        elif seq in self.allocator.swapped:
            self.allocator.drop_swapped(seq)
            self._swapped.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        del self._in_flight[seq.request.request_id]
        rollout = seq.rollout(reason, error)
        if report:
            self._done.append(rollout)
        return rollout
