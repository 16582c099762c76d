"""The engine's host scheduler: which requests wait, which decode slot each live one has, its
pages (on demand, swapping sequences out to host memory and back when the pool runs short),
the per-slot arrays the jitted steps take, and the tokens they sampled, with the version that
sampled each. Continuations (a request's `partial`), the per-call token budget (`max_tokens`,
"paused"), parked sequences and what a weight load does to the requests in flight
(inference.in_flight_update) are decided here too. Host code only (numpy, no JAX): the engine
(engine.py) hands its device work (prefill, swap copies) in as callables and runs the decode
call itself, so tests drive the scheduler with stand-ins."""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from rlax_tpu.api.inference import FinishReason, GenerationRequest, Rollout, SamplingParams
from rlax_tpu.config import InferenceConfig
from rlax_tpu.inference.page_allocator import PADDING_PAGE, HostPages, PageAllocator
from rlax_tpu.inference.parking import Parked, ParkedKey, ParkedStore
from rlax_tpu.inference.prefix_cache import Entry, PrefixCache
from rlax_tpu.inference.sampling import request_key_data

# The device work the engine hands in. A prefill round: (bucket, `prefill_args`) per call ->
# each call's packed first tokens, int32[2, prefill_rows], on the host. A swap's copy of
# pages to the host and back (`PageAllocator.swap_out` / `swap_in`).
Prefill = Callable[[list[tuple[int, tuple[np.ndarray, ...]]]], list[np.ndarray]]
ReadPages = Callable[[list[int]], Any]
WritePages = Callable[[list[int], Any], None]


class VersionedCalls(Protocol):
    """Device work under the weights of a given version (the served one's, or another's):
    the extend calls of continuations that feed tokens after pages they hold, and a replay's
    prefill, extend and decode calls (`Scheduler._replay`)."""

    def has(self, versions: Iterable[int]) -> bool:
        """Whether the weights of every version in `versions` can be had (fetched now)."""

    def prefill(self, version: int, calls: list[tuple[int, tuple[np.ndarray, ...]]]) -> list:
        """A prefill round's calls (as `Prefill`) under `version`'s weights."""

    def extend(self, version: int, calls: list[tuple[int, tuple[np.ndarray, ...]]]) -> list:
        """Extend calls (`extend_args`: tokens fed after each row's cached positions, the
        next token sampled) under `version`'s weights; their packed outputs, on the host."""

    def decode(self, version: int, rows: np.ndarray) -> np.ndarray:
        """One decode call of the slots `rows` under `version`'s weights: its packed output,
        int32[3, steps, rows], on the host."""

    def sample(self, args: tuple[np.ndarray, ...]) -> np.ndarray:
        """A sample call (`sample_args`: first tokens from the prefix cache's logits, with
        the page copies): its packed output, int32[2, sample_rows], on the host."""


@dataclasses.dataclass(frozen=True)
class PagingState:
    """A snapshot of the engine's scheduling (`Engine.paging_state`): request ids in flight
    (submission order), in each decode slot (None: free; a slot holds a live sequence
    between steps), waiting and swapped out (by admission order); the pages in use, the
    page table (one row of page ids per slot, 0 = padding), the host bytes swapped-out
    sequences hold, the parked sequences (`ParkedKey`s, oldest first) and their host bytes,
    and what is wrong with the page bookkeeping (() when sound)."""

    in_flight: tuple[str, ...]
    slots: tuple[str | None, ...]
    waiting: tuple[str, ...]
    swapped: tuple[str, ...]
    used_pages: int
    page_table: np.ndarray
    swapped_bytes: int = 0
    problems: tuple[str, ...] = ()
    parked: tuple[ParkedKey, ...] = ()
    parked_bytes: int = 0


@dataclasses.dataclass(eq=False)
class SequenceState:
    """Host-side state of a request in flight. `tokens` is the response so far (a
    continuation's partial first), `token_versions` the served version that sampled each,
    `loss_mask` 1 for a sampled token, 0 for one given (an episode's observation)."""

    request: GenerationRequest
    sampling: SamplingParams
    limit: int  # response tokens allowed: max_new_tokens clipped by the slot's capacity
    version: int  # the sampling key's: the version at submit, or the partial's
    stop_at: int = 0  # response length this call ends at: `limit`, or sooner by max_tokens
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    token_versions: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1  # -1 while waiting or swapped out
    order: int = -1  # admission number: preemption takes the highest live one
    key_data: Any = None  # the request's sampling key
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    # A continuation that looks for parked pages ("keep", or an episode's next turn); the
    # parked pages found for it, or whether its lost pages are to be replayed.
    resumes: bool = False
    parked: ParkedKey | None = None
    replay: bool = False
    cached: int = 0  # context positions whose keys and values its pages hold (once admitted)
    # Admitted with a sequence of the same context (a GRPO group's first sample): it shares
    # that one's prefill row and prompt pages, and has `copy` (src, dst) made of the last,
    # partial page after the prefill writes it. Set from admission to its first token.
    leader: SequenceState | None = None
    copy: tuple[int, int] | None = None
    # The prefix cache: the logits-table row of the entry it is admitted from (it samples
    # from there, no prefill), or of the entry its prefill fills (with that entry's copy
    # of its partial last page).
    cached_row: int | None = None
    entry_row: int | None = None
    entry_copy: tuple[int, int] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def context_len(self) -> int:
        """Tokens a prefill of this sequence feeds: the prompt and the response so far."""
        return self.prompt_len + len(self.tokens)

    def parked_key(self) -> ParkedKey:
        r = self.request
        return ParkedKey(r.prompt_id, r.sample_index, self.version, len(self.tokens))

    def rollout(self, reason: FinishReason, error: str = "") -> Rollout:
        r = self.request
        versions = None
        if any(v != self.version for v in self.token_versions):
            versions = tuple(self.token_versions)
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
            token_versions=versions,
            loss_mask=None if all(self.loss_mask) else tuple(self.loss_mask),
        )


def continuation_buckets(prefill_buckets: tuple[int, ...], max_seq_len: int) -> tuple[int, ...]:
    """Prefill sizes past the largest prefill bucket, for continuations (prompt + partial
    response, up to max_seq_len - 1 tokens): powers of two, the last the first to hold
    max_seq_len - 1 tokens; () when the prefill buckets already do."""
    out, bucket = [], prefill_buckets[-1]
    while bucket < max_seq_len - 1:
        bucket = 1 << bucket.bit_length()  # the next power of two above it
        out.append(bucket)
    return tuple(out)


# A logits-table row, or a page copy's destination, that the device step drops.
NOT_KEPT = 2**30


def prefill_args(
    rows: int,
    bucket: int,
    page_table: np.ndarray,
    seqs: list[SequenceState],
    *,
    extend: bool = False,
    sample_rows: int | None = None,
) -> tuple[np.ndarray, ...]:
    """The host arguments of a prefill call of `seqs` (all in `bucket`) after (params,
    cache, logits table), as `steps.prefill_step` takes them.

    Model rows (at most `rows`: the sequences without a `leader`, in order): page-table
    rows, tokens (the prompt, then a continuation's response so far), lengths, and the
    prefix cache's logits-table row each is kept in (`entry_row`; NOT_KEPT: none). Sample
    rows (`sample_rows`, default `rows`: every sequence, in order): `sampling_args`, each
    sampling from its own model row or its leader's; then the blocks of `rows` sample rows
    in use, and the page copies (src, dst: `sample_rows` + `rows` of them) of the sequences
    that share their leader's pages and of the prompts the prefix cache keeps. Unused rows
    are padding: length 0 (no valid token), an all-padding page-table row (PADDING_PAGE;
    writes there are dropped), non-truncating sampling params, and a copy of the padding
    page onto itself.

    extend: the arguments of an extend call (`steps.extend_step`) instead: one row per
    sequence (no leaders), each row's tokens its context after the `cached` positions its
    pages hold, `offsets` (those positions: where its tokens start) after the lengths, and
    the sampling arrays of the same rows."""
    models = seqs if extend else [seq for seq in seqs if seq.leader is None]
    page_rows = np.full((rows, page_table.shape[1]), PADDING_PAGE, np.int32)
    tokens = np.zeros((rows, bucket), np.int32)
    lengths = np.zeros(rows, np.int32)
    offsets = np.zeros(rows, np.int32)
    logit_rows = np.full(rows, NOT_KEPT, np.int32)
    model_row = {}
    for row, seq in enumerate(models):
        model_row[seq] = row
        page_rows[row] = page_table[seq.slot]
        fed = (*seq.request.prompt_tokens, *seq.tokens)[seq.cached :]
        tokens[row, : len(fed)] = fed
        lengths[row], offsets[row] = len(fed), seq.cached
        if seq.entry_row is not None:
            logit_rows[row] = seq.entry_row
    if extend:
        sampling = sampling_args(rows, seqs, [model_row[seq] for seq in seqs])
        return (page_rows, tokens, lengths, offsets, *sampling[1:])
    samples = rows if sample_rows is None else sample_rows
    source = [model_row[seq.leader or seq] for seq in seqs]
    copies = np.zeros((2, samples + rows), np.int32)  # the padding page onto itself
    made = [seq.copy for seq in seqs] + [seq.entry_copy for seq in models]
    for i, copy in enumerate(c for c in made if c is not None):
        copies[:, i] = copy
    blocks = np.int32(-(-max(len(seqs), 1) // rows))
    return (
        page_rows,
        tokens,
        lengths,
        logit_rows,
        *sampling_args(samples, seqs, source),
        blocks,
        copies[0],
        copies[1],
    )


def sampling_args(
    samples: int, seqs: list[SequenceState], source: list[int]
) -> tuple[np.ndarray, ...]:
    """The sample rows of a first-token call (padded to `samples`): the row of logits each
    sequence samples from (`source`), starts (the response index t of the token sampled: 0,
    or the tokens a continuation has), key data, temperature, top_k, top_p, "sampled"
    flags."""
    rows = np.zeros(samples, np.int32)
    starts = np.zeros(samples, np.int32)
    key_data = np.zeros((samples, 2), np.uint32)
    temperature = np.ones(samples, np.float32)
    top_k = np.zeros(samples, np.int32)
    top_p = np.ones(samples, np.float32)
    sampled_logprobs = np.zeros(samples, bool)
    for row, (seq, src) in enumerate(zip(seqs, source, strict=True)):
        s = seq.sampling
        rows[row] = src
        starts[row] = len(seq.tokens)
        key_data[row] = seq.key_data
        temperature[row], top_k[row], top_p[row] = s.temperature, s.top_k, s.top_p
        sampled_logprobs[row] = s.logprobs_of == "sampled"
    return (rows, starts, key_data, temperature, top_k, top_p, sampled_logprobs)


def sample_args(rows: int, samples: int, seqs: list[SequenceState]) -> tuple[np.ndarray, ...]:
    """The host arguments of a sample call (`steps.sample_step`) of `seqs`, whose prompts the
    prefix cache holds (`cached_row`): `sampling_args` from their logits-table rows, the
    blocks of `rows` in use, and each one's copy of the partial last page (src, dst)."""
    copies = np.zeros((2, samples), np.int32)
    for i, copy in enumerate(seq.copy for seq in seqs if seq.copy is not None):
        copies[:, i] = copy
    blocks = np.int32(-(-max(len(seqs), 1) // rows))
    sampling = sampling_args(samples, seqs, [seq.cached_row for seq in seqs])
    return (*sampling, blocks, copies[0], copies[1])


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
        self.limit[slot] = seq.stop_at
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : len(s.stop_token_ids)] = s.stop_token_ids
        self.sampling_dirty = True

    def activate(self, seq: SequenceState) -> None:
        """Mark `seq`'s slot live with its response so far: its next decode step feeds the
        last token at position context_len - 1 and samples response token len(tokens)."""
        slot = seq.slot
        self.active[slot] = True
        self.last_token[slot] = seq.tokens[-1]
        self.position[slot] = seq.context_len - 1
        self.index[slot] = len(seq.tokens)
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
    `prefill_buckets` entry that holds each prompt (a continuation's prompt and response
    so far; past the largest, the `continuation_buckets`).

    Continuations and the token budget: a request's `partial` is its response so far, and
    its key is the partial's version's, so response token t is sampled as in one call. A
    call that generates `max_tokens` new tokens without ending the response finishes
    "paused". With inference.in_flight_update "keep" a paused sequence is parked (`park`):
    its pages go to the host under its `ParkedKey`, and a continuation of exactly its
    prompt and tokens swaps them back in instead of being prefilled (parking.py: bytes
    bounded by `max_parked_bytes`, the oldest evicted first; parked sequences hold no slot
    and no page). A continuation that finds no pages (another worker's, an evicted or
    restarted one) has them replayed (`_replay`, `kv_replayed`): made again as they were
    first made, so it continues bitwise as if it had found them. Without the weights of the
    versions that made them (`VersionedCalls.has`) it is prefilled under the served version
    instead (`kv_rebuilt`: the same distribution, not the same bits).

    Multi-turn episodes: a request with `keep_pages` that ends at a stop token (a turn that
    called a tool) is parked too, under any in_flight_update; its next turn is a
    continuation whose partial is the turn's tokens followed by the observation's tokens
    (given, loss mask 0). It swaps the parked pages in and an extend call feeds only the
    tokens after them (the turn's last token and the observation's) and samples the next
    turn's first token (`_extend`). Under "off" / "resume", pages parked under another
    version than the one served are not reused: the turn is prefilled afresh.

    A weight load (`load`): with "off", or to a version older than the one served, every
    request in flight is aborted. To a newer version, "keep" lets them continue as they are
    (the tokens sampled after it record the new version); "resume" frees their pages and
    queues them again, ahead of the waiting ones, to be prefilled under the new weights as
    continuations of their tokens so far.
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
        max_parked_bytes: int | None = None,
    ):
        self.config, self.allocator = config, allocator
        self.seed, self.vocab_size = seed, vocab_size
        self.defaults = SamplingParams.from_config(config)
        self.max_stop_tokens = max(max_stop_tokens, len(self.defaults.stop_token_ids))
        self.decode_steps_per_call = decode_steps_per_call
        self.num_slots, self.max_seq_len = allocator.max_seqs, allocator.max_tokens_per_seq
        self.prefill_rows, self.decode_rows = config.prefill_rows, config.decode_rows
        self.sample_rows, self.share_prompts = config.sample_rows, config.share_prompt_pages
        self.continuation_buckets = continuation_buckets(config.prefill_buckets, self.max_seq_len)
        self.on_demand = config.kv_admission == "on_demand"
        self.in_flight_update = config.in_flight_update
        self.served_version = -1  # what the engine serves: the version of each token sampled
        # Pages a live sequence may need for one decode call (the admission margin).
        self._growth_pages = -(-decode_steps_per_call // allocator.page_size)
        self.arrays = SlotArrays(self.num_slots, self.max_stop_tokens)
        self._slots: list[SequenceState | None] = [None] * self.num_slots
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._swapped: list[SequenceState] = []  # swapped out, by admission order
        self._admissions = 0
        self._in_flight: dict[str, SequenceState] = {}  # by request id, in submission order
        self._done: list[Rollout] = []  # finished, returned by the next step()
        # Paused sequences whose pages the allocator holds on the host, oldest first, and
        # those paused in this step (still in their slots until `park`).
        self._parked = ParkedStore(allocator, max_parked_bytes)
        entries = config.prefix_cache_entries
        self._prefix = PrefixCache(allocator, entries) if entries else None
        self._to_park: list[SequenceState] = []
        self.counters: collections.Counter = collections.Counter()

    def submit(self, request: GenerationRequest, version: int) -> None:
        """Queue a request (sampled with `version`'s key, or its partial's); one that can
        never run finishes at once with "error"."""
        if request.request_id in self._in_flight:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        sampling, partial = request.sampling or self.defaults, request.partial
        limit = min(sampling.max_new_tokens, self.max_seq_len - len(request.prompt_tokens))
        seq = SequenceState(
            request, sampling, limit, version if partial is None else partial.version
        )
        self._in_flight[request.request_id] = seq
        problem = self._problem(request, sampling, limit)
        if problem:
            self._finish(seq, "error", error=problem)
            return
        if partial is not None:
            seq.tokens, seq.logprobs = list(partial.tokens), list(partial.logprobs)
            seq.token_versions, seq.loss_mask = list(partial.token_versions), list(partial.mask)
            self.counters["continuations"] += 1
            # A "keep" continuation, or an episode's next turn, looks for its parked pages.
            seq.resumes = self.in_flight_update == "keep" or not all(seq.loss_mask)
        budget = request.max_tokens
        seq.stop_at = min(limit, len(seq.tokens) + budget) if budget else limit
        r = request
        seq.key_data = request_key_data(self.seed, r.prompt_id, r.sample_index, seq.version)
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

    def load(self, version: int) -> list[Rollout]:
        """The engine serves `version` from now on (between steps). Returns the requests this
        aborts (in submission order): all in flight with "off" or an older version, none
        for a newer one with "keep" (they continue) or "resume" (queued again as
        continuations, to be prefilled under the new weights)."""
        previous, self.served_version = self.served_version, version
        if self._prefix is not None:  # keys and values of other weights: never reused
            self.counters["prefix_evictions"] += self._prefix.clear()
        if self.in_flight_update == "off" or version < previous:
            return self.abort_all()
        if self.in_flight_update == "resume":
            self._requeue_in_flight()
        return []

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "tokens_generated": c["tokens_generated"],
            "decode_steps": c["decode_steps"],
            "decode_calls": c["decode_calls"],
            "prefills": c["prefills"],
            "prefill_calls": c["prefill_calls"],
            # Prompt tokens the prefill calls computed (a shared prompt once), sequences that
            # shared another's prefill row and prompt pages, and the full pages they shared.
            "prefill_tokens": c["prefill_tokens"],
            "prefill_shared": c["prefill_shared"],
            "pages_shared": c["pages_shared"],
            # The prefix cache: samples admitted from it (no prefill), prompts it keeps now,
            # and those it gave up (for pages, for room, at a weight load).
            "prefix_hits": c["prefix_hits"],
            "prefix_entries": 0 if self._prefix is None else len(self._prefix),
            "prefix_evictions": c["prefix_evictions"],
            # Continuations that fed tokens after their pages (an episode's observation),
            # the calls and the tokens fed.
            "extends": c["extends"],
            "extend_calls": c["extend_calls"],
            "extend_tokens": c["extend_tokens"],
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
            # Continuations submitted, calls ended by their max_tokens, sequences queued
            # again by a "resume" load; "keep": continuations that found their parked pages,
            # those prefilled instead, those whose pages were replayed (the decode calls
            # that took, and replays that did not give back the logged tokens), the parked
            # sequences now and their host bytes, and those evicted to keep these within
            # the pool's size.
            "continuations": c["continuations"],
            "paused": c["paused"],
            "requeued": c["requeued"],
            "kv_reused": c["kv_reused"],
            "kv_rebuilt": c["kv_rebuilt"],
            "kv_replayed": c["kv_replayed"],
            "replay_decode_calls": c["replay_decode_calls"],
            "replay_mismatches": c["replay_mismatches"],
            "parked": len(self._parked),
            "parked_bytes": self._parked.bytes,
            "parked_evictions": c["parked_evictions"],
            "parked_released": c["parked_released"],
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
            swapped_bytes=sum(self.allocator.swapped[seq].nbytes for seq in self._swapped),
            problems=tuple(self.allocator.invariant_problems()),
            parked=self._parked.keys(),
            parked_bytes=self._parked.bytes,
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
        if request.max_tokens < 0:
            return (
                f"max_tokens must be >= 0 (0 = until the response ends), got {request.max_tokens}"
            )
        if request.partial is not None:
            problem = self._partial_problem(request, sampling, limit)
            if problem:
                return problem
        pages = self.allocator.pages_for(n + limit)
        if pages > self.allocator.num_pages - 1:
            return (
                f"{n} + {limit} tokens need {pages} pages, the pool has "
                f"{self.allocator.num_pages - 1}: raise kv_cache_bytes or lower max_new_tokens"
            )
        return ""

    def _partial_problem(
        self, request: GenerationRequest, sampling: SamplingParams, limit: int
    ) -> str:
        """Why a continuation's partial response cannot be continued, or "" if it can."""
        p = request.partial
        n = len(p.tokens)
        if not n == len(p.logprobs) == len(p.token_versions) == len(p.mask):
            return (
                f"partial response has {n} tokens, {len(p.logprobs)} log-probs, "
                f"{len(p.token_versions)} token versions and {len(p.mask)} loss-mask "
                "entries: one of each per token"
            )
        if not all(0 <= t < self.vocab_size for t in p.tokens):
            return f"partial response token ids must be in [0, {self.vocab_size})"
        if n >= limit:
            return (
                f"prompt ({len(request.prompt_tokens)} tokens) + partial response ({n}) leave "
                f"nothing to generate: a response holds at most {limit} tokens "
                f"(max_new_tokens {sampling.max_new_tokens}, a slot {self.max_seq_len} tokens)"
            )
        if n and p.mask[-1] and p.tokens[-1] in sampling.stop_token_ids:
            return f"the partial response already ended with stop token {p.tokens[-1]}"
        return ""

    # -- admission, prefill and extend -----------------------------------------------------
    def admit(
        self, prefill: Prefill, write_pages: WritePages, calls: VersionedCalls | None = None
    ) -> None:
        """Swap sequences back in (`write_pages` copies their pages into the pool), then admit
        waiting ones in prefill rounds (`prefill` runs a round's calls: their first tokens).
        A continuation whose pages are parked swaps them in instead, or has them replayed
        when they are lost ("keep"); one with tokens after its pages has them fed by an
        extend call (`calls`)."""
        self._resume(write_pages)
        # A sequence that ends at its first token frees its slot and pages at once, so a
        # round may make room for another.
        while not self._swapped:
            admitted, batch = self._take_waiting(write_pages, calls)
            if not admitted:
                return
            fresh, extend = [], []
            for seq in batch:
                if seq.replay:
                    self._replay(seq, calls)
                if seq.cached == 0:
                    fresh.append(seq)
                elif seq.cached < seq.context_len - 1:
                    extend.append(seq)
                else:  # its pages hold everything but its last token: it decodes on
                    self.arrays.set_sampling(seq.slot, seq)
                    self.arrays.activate(seq)
            if extend:
                self._first_tokens(extend, calls, extend=True)
            if fresh:
                self._first_tokens(fresh, prefill, calls=calls)
            if self._prefix is not None:
                self._prefix.settle()

    def _fits(self, pages: int, joining: int = 0) -> bool:
        """Whether a sequence needing `pages` more pages may join the live ones and the
        `joining` others admitted with it: on demand, the pool must keep one decode call's
        growth for every sequence live after it (none when it would be alone: a lone
        sequence always fits)."""
        after = int(self.arrays.active.sum()) + joining + 1
        margin = after * self._growth_pages if self.on_demand and after > 1 else 0
        return pages + margin <= self.allocator.free_pages

    def _take_waiting(
        self, write_pages: WritePages, calls: VersionedCalls | None
    ) -> tuple[int, list[SequenceState]]:
        """Admit waiting sequences, first in first out, each into a free slot: a continuation
        whose parked pages are held gets them back (swapped in, with pages for the tokens
        after them); any other gets pages for its prompt and response so far (on demand) or
        its whole sequence (reserve), to be prefilled, or replayed (a "keep" continuation
        whose pages are lost). At most `prefill_rows` take a prefill row. With
        share_prompt_pages one whose context (prompt and response so far) is that of a
        sequence admitted before it in this round is prefilled in that one's row and shares
        its full pages (`PageAllocator.fork`), taking pages only past them; with a prefix
        cache, one whose context the cache holds under the served version forks the
        cache's pages and is sampled from its logits (no prefill row), and every other
        fresh prompt is kept in the cache. Cached prompts not in use give their pages back
        when a sequence needs them. Stops at the first that does not fit: it waits (FIFO)
        until a running sequence frees pages. Returns how many were admitted and the
        admitted."""
        free = [s for s, seq in enumerate(self._slots) if seq is None]
        admitted, rows, batch = 0, 0, []
        leaders: dict[tuple[int, ...], SequenceState] = {}  # by context, prefilled fresh
        for slot in free:
            if not self._waiting:
                break
            seq = self._waiting[0]
            host = self._parked_pages(seq, calls)
            fresh = host is None and not seq.replay and seq.cached == 0
            context = (*seq.request.prompt_tokens, *seq.tokens) if fresh else None
            leader = leaders.get(context) if self.share_prompts and fresh else None
            entry = None
            if fresh and leader is None and self._prefix is not None:
                entry = self._prefix.get(context, self.served_version)
                entry = None if entry is None or entry.pending else entry
            if leader is None and entry is None and rows == self.prefill_rows:
                break
            if self.on_demand:
                # Pages for every position fed before the next decode call: all but the last
                # token's when it decodes on from its pages, all with an extend or prefill.
                fed_all = host is None or len(seq.tokens) > seq.parked.num_tokens
                tokens = seq.context_len if fed_all else seq.context_len - 1
            else:
                tokens = seq.prompt_len + seq.stop_at
            if host is not None:
                needed = max(host.num_pages, self.allocator.pages_for(tokens))
            elif leader is not None or entry is not None:
                shared = seq.context_len // self.allocator.page_size
                needed = self.allocator.pages_for(tokens) - shared
            else:
                needed = self.allocator.pages_for(tokens)
            if not self._room_for(needed, admitted, keep=entry):
                break
            if leader is not None:
                self._share(leader.slot, seq, slot, tokens, leader=leader)
            elif entry is not None:
                self._share(None, seq, slot, tokens, entry=entry)
            elif host is None and not self.allocator.try_reserve(slot, tokens):
                break
            self._waiting.popleft()
            seq.slot, seq.order = slot, self._admissions
            self._admissions += 1
            self._slots[slot] = seq
            admitted += 1
            rows += leader is None and entry is None
            if fresh and leader is None and entry is None:
                leaders[context] = seq
                self._keep_prefix(seq, context)
            if host is not None:
                self._unpark(seq, write_pages, tokens)
            batch.append(seq)
        return admitted, batch

    def _room_for(self, pages: int, joining: int, keep: Entry | None) -> bool:
        """`_fits`, giving back cached prompts' pages (not `keep`'s) until it does; False
        when even that is not enough."""
        while not self._fits(pages, joining):
            if not self._evict_cached(keep=keep):
                return False
        return True

    def _share(
        self,
        src: int | None,
        seq: SequenceState,
        slot: int,
        tokens: int,
        *,
        leader: SequenceState | None = None,
        entry: Entry | None = None,
    ) -> None:
        """Give `seq` (admitted into `slot`) the pages of its context that `leader` (in slot
        `src`) or the prefix cache's `entry` holds, the full ones shared, the last, partial
        one its own (copied by the round's prefill or sample call), then its own pages up to
        `tokens` tokens; it samples from `leader`'s prefill row or `entry`'s logits."""
        copies: list[tuple[int, int]] = []
        n = seq.context_len
        if leader is not None:
            self.allocator.fork(src, slot, n, lambda s, d: copies.append((s, d)))
            seq.leader = leader
            self.counters["prefill_shared"] += 1
        else:
            self.allocator.fork_pages(entry.pages, slot, n, lambda s, d: copies.append((s, d)))
            seq.cached_row = entry.row
            self.counters["prefix_hits"] += 1
        self.allocator.reserve(slot, tokens)
        seq.copy = copies[0] if copies else None
        self.counters["pages_shared"] += n // self.allocator.page_size

    def _keep_prefix(self, seq: SequenceState, context: tuple[int, ...]) -> None:
        """Keep a fresh prompt just admitted in the prefix cache (if any, and if it has room):
        its prefill fills the entry."""
        if self._prefix is None or self._prefix.get(context, self.served_version):
            return
        added = self._prefix.add(context, self.served_version, seq.slot)
        if added is not None:
            entry, seq.entry_copy = added
            seq.entry_row = entry.row

    def _evict_cached(self, keep: Entry | None = None) -> bool:
        """Give back the pages of the least recently used cached prompt not in use this round
        (nor `keep`); False when there is none."""
        if self._prefix is None or not self._prefix.evict(keep):
            return False
        self.counters["prefix_evictions"] += 1
        return True

    def _first_tokens(
        self,
        batch: list[SequenceState],
        run: Prefill | VersionedCalls,
        *,
        extend: bool = False,
        calls: VersionedCalls | None = None,
    ) -> None:
        """Prefill `batch` (admitted, in FIFO order; `run` a `Prefill`), or with `extend` feed
        each one's tokens after its cached positions (`run` the `VersionedCalls`, under the
        served version): one call per bucket of the tokens fed, then each sequence's next
        token in order. Those whose prompt the prefix cache holds are sampled from its
        logits by one sample call (`calls`) instead."""
        first: dict[SequenceState, tuple[int, float]] = {}
        cached = [seq for seq in batch if seq.cached_row is not None]
        if cached:  # prompts the prefix cache holds: sampled from its logits, no prefill
            if calls is None or extend:
                raise RuntimeError("samples from the prefix cache need VersionedCalls")
            packed = calls.sample(sample_args(self.prefill_rows, self.sample_rows, cached))
            tokens, logprobs = packed[0].tolist(), packed[1].view(np.float32).tolist()
            first.update((seq, (tokens[i], logprobs[i])) for i, seq in enumerate(cached))
            batch_calls = [seq for seq in batch if seq.cached_row is None]
        else:
            batch_calls = batch
        buckets = self.config.prefill_buckets + self.continuation_buckets
        by_bucket: dict[int, list[SequenceState]] = {}
        for seq in batch_calls:  # a leader comes before the sequences that share its row
            bucket = next(b for b in buckets if b >= seq.context_len - seq.cached)
            by_bucket.setdefault(bucket, []).append(seq)
        table, rows = self.allocator.page_table, self.prefill_rows
        args = [
            (b, prefill_args(rows, b, table, seqs, extend=extend, sample_rows=self.sample_rows))
            for b, seqs in by_bucket.items()
        ]
        if extend:
            if run is None:
                raise RuntimeError("a continuation after its parked pages needs VersionedCalls")
            outs = run.extend(self.served_version, args)
            self.counters["extend_calls"] += len(by_bucket)
            self.counters["extends"] += len(batch)
            self.counters["extend_tokens"] += sum(s.context_len - s.cached for s in batch)
        else:
            outs = run(args) if args else []
            self.counters["prefill_calls"] += len(by_bucket)
            self.counters["prefills"] += len(batch)
            self.counters["prefill_tokens"] += sum(
                s.context_len for s in batch_calls if s.leader is None
            )
        for seqs, packed in zip(by_bucket.values(), outs, strict=True):
            tokens, logprobs = packed[0].tolist(), packed[1].view(np.float32).tolist()
            for row, seq in enumerate(seqs):
                first[seq] = tokens[row], logprobs[row]
        self.arrays.page_table_dirty = True
        for seq in batch:
            seq.leader = seq.copy = seq.entry_copy = None
            seq.cached_row = seq.entry_row = None
            self.arrays.set_sampling(seq.slot, seq)
            token, logprob = first[seq]
            if not self._append(seq, token, logprob):
                self.arrays.activate(seq)

    # -- pages on demand: growth, swap-out, swap-in ----------------------------------------
    def grow(self, read_pages: ReadPages) -> None:
        """Give every live sequence the pages its next decode call writes, oldest admission
        first; when the pool runs out, swap out the most recently admitted live sequence
        (possibly the one growing; `read_pages` copies its pages to the host) and retry."""
        k = self.decode_steps_per_call
        for seq in sorted(self._live(), key=lambda q: q.order):
            if seq.slot < 0:
                continue  # swapped out below, to make room for an older one
            # The token fed at position p is written there; the last one fed this call is
            # at prompt_len + stop_at - 2 (the final token is sampled, never fed).
            tokens = min(int(self.arrays.position[seq.slot]) + k, seq.prompt_len + seq.stop_at - 1)
            held = self.allocator.num_pages_of(seq.slot)
            while not self.allocator.try_reserve(seq.slot, tokens):
                if self._evict_cached():  # pages no slot holds: the page table is unchanged
                    continue
                victim = max(self._live(), key=lambda q: q.order)
                self._swap_out(victim, read_pages)
                if victim is seq:
                    break
            if seq.slot >= 0 and self.allocator.num_pages_of(seq.slot) != held:
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
            self.arrays.activate(seq)
            self.counters["swap_in_bytes"] += host.nbytes
            self.arrays.page_table_dirty = True

    def _requeue_in_flight(self) -> None:
        """("resume" load) Free the pages of every live and swapped-out sequence and queue
        them again, in admission order ahead of the waiting ones: each is prefilled anew
        (prompt + its tokens so far) under the weights served when it is admitted."""
        seqs = sorted([*self._live(), *self._swapped], key=lambda q: q.order)
        for seq in seqs:
            if seq.slot >= 0:
                self.allocator.free(seq.slot)
                self._slots[seq.slot] = None
                self.arrays.active[seq.slot] = False
            else:
                self.allocator.drop_swapped(seq)
            seq.slot = -1
            # Its pages are gone: nothing is cached, found parked or to be replayed any more.
            seq.cached, seq.parked, seq.replay = 0, None, False
        self._swapped = []
        self._waiting.extendleft(reversed(seqs))
        self.counters["requeued"] += len(seqs)
        self.arrays.page_table_dirty = self.arrays.carry_dirty = True

    # -- parked sequences ("keep", episodes' turns) ----------------------------------------
    def park(self, read_pages: ReadPages) -> None:
        """Park the sequences that paused ("keep") or ended a turn (`keep_pages`) in this
        step: their pages copied to the host (`read_pages`) under their `ParkedKey`, their
        slots freed; then evict the oldest parked while their bytes exceed the bound."""
        for seq in self._to_park:
            key = seq.parked_key()
            prompt, tokens = tuple(seq.request.prompt_tokens), tuple(seq.tokens)
            parked = Parked(prompt, tokens, self.served_version)
            host = self._parked.park(seq.slot, key, parked, read_pages)
            self._slots[seq.slot] = None
            seq.slot = -1
            self.counters["swap_out_bytes"] += host.nbytes
            self.arrays.page_table_dirty = True
        self._to_park = []
        self.counters["parked_evictions"] += self._parked.evict()

    def release(self, ended: Sequence[tuple[str, int, int]]) -> None:
        """Drop the parked pages of episodes that ended ((prompt id, sample, key version))."""
        for prompt_id, sample_index, version in ended:
            self.counters["parked_released"] += self._parked.release(
                prompt_id, sample_index, version
            )

    def _parked_pages(self, seq: SequenceState, calls: VersionedCalls | None) -> HostPages | None:
        """The host pages `seq` continues on, if it is a continuation whose prompt and first
        tokens are parked (`seq.parked` set), and, under "off" / "resume", parked while the
        version served now was. One that finds none (another worker's, an evicted or
        restarted one) is replayed (`seq.replay`) under "keep", and in any mode when it is an
        episode's turn (it has given tokens), if `calls` has the weights of the versions that
        sampled its tokens; else prefilled (`kv_rebuilt`)."""
        if not seq.resumes or seq.replay:
            return None
        if seq.parked in self._parked:  # found when it last waited, and still there
            return self.allocator.swapped[seq.parked]
        seq.parked, r = None, seq.request
        key = self._parked.find(
            r.prompt_id, r.sample_index, seq.version, tuple(r.prompt_tokens), tuple(seq.tokens)
        )
        if key is not None:
            if self.in_flight_update == "keep" or self._parked[key].served == self.served_version:
                seq.parked = key
                return self.allocator.swapped[key]
            self._parked.drop(key)  # keys and values of older weights: prefilled afresh
        sampled = {v for v, m in zip(seq.token_versions, seq.loss_mask, strict=True) if m}
        if (
            (self.in_flight_update == "keep" or not all(seq.loss_mask))
            and seq.loss_mask[0]
            and calls is not None
            and calls.has(sampled)
        ):
            seq.replay = True
            return None
        seq.resumes = False
        self.counters["kv_rebuilt"] += 1
        return None

    def _unpark(self, seq: SequenceState, write_pages: WritePages, tokens: int) -> None:
        """Swap `seq`'s parked pages into its (new) slot, with pages for its first `tokens`
        tokens: they hold its prompt and the parked tokens but the last."""
        key, seq.parked = seq.parked, None
        nbytes = self._parked.take(key, seq.slot, write_pages)
        self.allocator.reserve(seq.slot, tokens)
        seq.cached = seq.prompt_len + key.num_tokens - 1
        self.counters["kv_reused"] += 1
        self.counters["swap_in_bytes"] += nbytes
        self.arrays.page_table_dirty = True

    def _replay(self, seq: SequenceState, calls: VersionedCalls) -> None:
        """Make a "keep" continuation's lost pages again, as they were first made, in its
        (new) slot; `seq.cached` says how far.

        The prompt's keys and values come from the prefill that sampled token 0 (under its
        version); a sampled token's from the decode step that fed it, which sampled the next
        one under that one's version; an episode's given tokens (and the turn's last token
        before them) from the extend call that fed them and sampled the next turn's first
        token under its version. So: the prompt is prefilled under token 0's version, each
        run of sampled tokens of one version is decoded again under it (the slot alone, in
        the smallest decode size, limited to the run's end), and each run of given tokens
        is extended under the version of the token after it, sampling with the request's
        key; given tokens at the end are left to the continuation's own extend. The same
        tokens and log-probs come out, which is checked (a mismatch, e.g. a partial made on
        another kind of machine, is counted in `replay_mismatches`: the pages are then this
        machine's, the continuation goes on from them). A row's bits do not depend on its
        batch, slot or pages (`Engine`), so the pages are bitwise those a run that never
        lost them holds."""
        tokens, versions, mask, n = seq.tokens, seq.token_versions, seq.loss_mask, len(seq.tokens)
        slot, a, rows_of = seq.slot, self.arrays, self.prefill_rows
        seq.replay = False
        buckets = self.config.prefill_buckets + self.continuation_buckets

        def first_token(version: int, view: SequenceState, extend: bool) -> tuple[int, int]:
            bucket = next(b for b in buckets if b >= view.context_len - view.cached)
            table = self.allocator.page_table
            args = prefill_args(
                rows_of, bucket, table, [view], extend=extend, sample_rows=self.sample_rows
            )
            run = calls.extend if extend else calls.prefill
            (packed,) = run(version, [(bucket, args)])
            return int(packed[0][0]), int(packed[1][0])

        prompt_only = dataclasses.replace(seq, tokens=[], cached=0)
        sampled = [first_token(versions[0], prompt_only, extend=False)]
        a.set_sampling(slot, seq)
        a.page_table_dirty = True
        rows = np.full(self.decode_rows[0], self.num_slots, np.int32)
        rows[0] = slot
        t = 1
        while t < n:
            if not mask[t]:  # given tokens t..g-1, fed with token t-1 by the call sampling g
                g = next((u for u in range(t, n) if mask[u]), n)
                if g == n:
                    break
                view = dataclasses.replace(seq, tokens=tokens[:g], cached=seq.prompt_len + t - 1)
                sampled.append(first_token(versions[g], view, extend=True))
                t = g + 1
                continue
            end = next((u for u in range(t, n) if not mask[u] or versions[u] != versions[t]), n)
            a.limit[slot], a.sampling_dirty = end, True
            a.active[slot], a.last_token[slot] = True, tokens[t - 1]
            a.position[slot], a.index[slot] = seq.prompt_len + t - 1, t
            a.carry_dirty = True
            while t < end:
                out = calls.decode(versions[t], rows)
                self.counters["replay_decode_calls"] += 1
                for step in range(out.shape[1]):
                    if out[2, step, 0]:
                        sampled.append((int(out[0, step, 0]), int(out[1, step, 0])))
                        t += 1
        a.active[slot], a.carry_dirty = False, True
        seq.cached = seq.prompt_len + t - 1
        bits = np.asarray(seq.logprobs, np.float32).view(np.int32).tolist()
        if sampled != [(tokens[i], bits[i]) for i in range(t) if mask[i]]:
            self.counters["replay_mismatches"] += 1
        self.counters["kv_replayed"] += 1

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
        """Record a sampled token (by the version served now); finish the sequence if it
        ends it or this call's budget. Returns whether it did."""
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.token_versions.append(self.served_version)
        seq.loss_mask.append(1)
        self.counters["tokens_generated"] += 1
        if token in seq.sampling.stop_token_ids:
            self._finish(seq, "stop")
        elif len(seq.tokens) >= seq.limit:
            self._finish(seq, "length")
        elif len(seq.tokens) >= seq.stop_at:
            self._finish(seq, "paused")
        else:
            return False
        return True

    def _finish(
        self, seq: SequenceState, reason: FinishReason, *, error: str = "", report: bool = True
    ) -> Rollout:
        """End a sequence: free its slot and pages at once (one that parks, paused under
        "keep" or a turn that ended with `keep_pages`, keeps them until `park`), and build
        its rollout."""
        parks = (reason == "paused" and self.in_flight_update == "keep") or (
            reason == "stop" and seq.request.keep_pages
        )
        if parks and seq.slot >= 0:
            self.arrays.active[seq.slot] = False
            self.arrays.carry_dirty = True
            self._to_park.append(seq)
        elif seq.slot >= 0:
            self.allocator.free(seq.slot)
            self._slots[seq.slot] = None
            self.arrays.active[seq.slot] = False
            self.arrays.carry_dirty = True
        elif seq in self.allocator.swapped:
            self.allocator.drop_swapped(seq)
            self._swapped.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        if reason == "paused":
            self.counters["paused"] += 1
        del self._in_flight[seq.request.request_id]
        rollout = seq.rollout(reason, error)
        if report:
            self._done.append(rollout)
        return rollout
