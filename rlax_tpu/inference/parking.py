"""Parked sequences: the KV pages of responses that paused under inference.in_flight_update
"keep", and of multi-turn episodes' turns that ended (`GenerationRequest.keep_pages`), held
in host memory until their continuation comes. Host code only: the pages are copied by the
allocator's swap machinery, with the engine's device copies handed in."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

from rlax_tpu.inference.page_allocator import HostPages, PageAllocator


@dataclasses.dataclass(frozen=True)
class ParkedKey:
    """What a parked sequence's KV pages continue: the response of (prompt_id, sample_index)
    sampled with `version`'s key, `num_tokens` tokens long."""

    prompt_id: str
    sample_index: int
    version: int
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class Parked:
    """A parked sequence's prompt and response, and the version served when it was parked.
    Its pages hold the keys and values of the prompt and of every response token but the
    last (sampled, not yet fed): a continuation whose tokens start with these resumes on
    them."""

    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    served: int


class ParkedStore:
    """The parked sequences, oldest first; the allocator holds their host pages under their
    `ParkedKey`. Their bytes stay within `max_bytes` (None: unbounded), the oldest evicted
    first (`evict`); parked sequences hold no slot and no page of the pool."""

    def __init__(self, allocator: PageAllocator, max_bytes: int | None):
        self.allocator, self.max_bytes = allocator, max_bytes
        self._parked: collections.OrderedDict[ParkedKey, Parked] = collections.OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, key: object) -> bool:
        return key in self._parked

    def __getitem__(self, key: ParkedKey) -> Parked:
        return self._parked[key]

    def keys(self) -> tuple[ParkedKey, ...]:
        return tuple(self._parked)

    def park(
        self, slot: int, key: ParkedKey, parked: Parked, read_pages: Callable[[list[int]], Any]
    ) -> HostPages:
        """Copy slot `slot`'s pages to the host under `key` (replacing one parked there) and
        free the slot."""
        if key in self._parked:
            self.drop(key)
        host = self.allocator.swap_out(slot, key, read_pages)
        self._parked[key] = parked
        self.bytes += host.nbytes
        return host

    def find(
        self,
        prompt_id: str,
        sample_index: int,
        version: int,
        prompt_tokens: tuple[int, ...],
        tokens: tuple[int, ...],
    ) -> ParkedKey | None:
        """The parked sequence a continuation of `tokens` resumes on: of the same request
        (prompt id, sample, key version and prompt), with the most tokens that begin
        `tokens` (at least one; None: none)."""
        best = None
        for key, parked in self._parked.items():
            n = key.num_tokens
            if (
                (key.prompt_id, key.sample_index, key.version) == (prompt_id, sample_index, version)
                and 0 < n <= len(tokens)
                and (best is None or n > best.num_tokens)
                and parked.prompt_tokens == prompt_tokens
                and parked.tokens == tokens[:n]
            ):
                best = key
        return best

    def take(self, key: ParkedKey, slot: int, write_pages: Callable[[list[int], Any], None]) -> int:
        """Copy `key`'s pages into empty slot `slot` and forget them; returns their bytes."""
        nbytes = self.allocator.swapped[key].nbytes
        if not self.allocator.swap_in(key, slot, write_pages):
            raise RuntimeError(
                f"the pool has too few free pages to take parked {key} back (the caller checks "
                "that it fits first)"
            )
        del self._parked[key]
        self.bytes -= nbytes
        return nbytes

    def drop(self, key: ParkedKey) -> None:
        self.bytes -= self.allocator.swapped[key].nbytes
        self.allocator.drop_swapped(key)
        del self._parked[key]

    def release(self, prompt_id: str, sample_index: int, version: int) -> int:
        """Drop every parked sequence of the request (prompt id, sample, key version): an
        episode that ended. Returns how many went."""
        keys = [
            k
            for k in self._parked
            if (k.prompt_id, k.sample_index, k.version) == (prompt_id, sample_index, version)
        ]
        for key in keys:
            self.drop(key)
        return len(keys)

    def evict(self) -> int:
        """Drop the oldest parked while their bytes exceed `max_bytes`; how many went."""
        evicted = 0
        while self._parked and self.max_bytes is not None and self.bytes > self.max_bytes:
            self.drop(next(iter(self._parked)))
            evicted += 1
        return evicted
