"""Host-side bookkeeping of the KV page pool: which pages each decode slot owns, and the
host copies of sequences swapped out of the pool.

The allocator owns the page table int32[max_seqs, pages_per_seq] on the host (0 = no
page; page 0 is the padding page and is never handed out) and hands a copy to the device
when the caller commits it, so the jitted decode step never waits on Python. Swapping
moves a slot's pages to host memory under a key (the engine's request) and back into
whichever slot and pages are free later; the caller supplies the copies (`read`, `write`)
so this module stays free of device code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlax_tpu.config import ConfigError

PADDING_PAGE = 0


class OutOfPagesError(RuntimeError):
    """The pool has too few free pages for a reservation; nothing was changed.

    Callers keep the request waiting until another sequence frees its pages.
    """


class SequenceTooLongError(ValueError):
    """A sequence needs more pages than a slot's page-table row can ever hold."""


def num_pages_for_budget(
    kv_cache_bytes: int,
    *,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: jnp.dtype | str,
) -> int:
    """Pages (padding page included) whose keys and values, all layers, fit the budget."""
    itemsize = jnp.dtype(dtype).itemsize
    bytes_per_page = 2 * num_layers * kv_heads * page_size * head_dim * itemsize
    num_pages = kv_cache_bytes // bytes_per_page
    if num_pages < 2:
        raise ConfigError(
            f"{kv_cache_bytes} bytes hold {num_pages} page(s) of {bytes_per_page} bytes (keys "
            "+ values of all layers); at least 2 are needed (page 0 is padding): raise "
            "kv_cache_bytes or lower page_size",
            field="kv_cache_bytes",
            section="InferenceConfig",
        )
    return int(num_pages)


@dataclasses.dataclass(eq=False)
class HostPages:
    """A swapped-out sequence: its pages' contents in host memory, in token order."""

    num_pages: int
    data: Any  # what `read` returned
    nbytes: int


class PageAllocator:
    """Hands out pages of a pool of `num_pages` to `max_seqs` slots.

    page_table: int32[max_seqs, pages_per_seq]; row s lists slot s's pages in token
    order (token p lives in page page_table[s, p // page_size]), 0 past its last page.
    """

    def __init__(self, *, num_pages: int, max_seqs: int, pages_per_seq: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is padding), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.page_table = np.zeros((max_seqs, pages_per_seq), np.int32)
        self._num_owned = np.zeros(max_seqs, np.int64)
        # A stack: the most recently freed page is handed out first (still warm in caches).
        self._free = list(range(num_pages - 1, 0, -1))
        self.swapped: dict[Hashable, HostPages] = {}  # by key, in swap-out order

    @property
    def max_seqs(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_tokens_per_seq(self) -> int:
        return self.pages_per_seq * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return int(self._num_owned.sum())

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def pages_of(self, slot: int) -> list[int]:
        """The pages slot `slot` owns, in token order."""
        return self.page_table[slot, : self._num_owned[slot]].tolist()

    def can_reserve(self, slot: int, num_tokens: int) -> bool:
        needed = self.pages_for(num_tokens) - self._num_owned[slot]
        return num_tokens <= self.max_tokens_per_seq and needed <= len(self._free)

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Make sure slot `slot` has pages for its first `num_tokens` tokens.

        Raises SequenceTooLongError past the page-table row, OutOfPagesError when the pool
        cannot cover it; in both cases nothing changes.
        """
        if num_tokens > self.max_tokens_per_seq:
            raise SequenceTooLongError(
                f"{num_tokens} tokens need {self.pages_for(num_tokens)} pages but a slot holds "
                f"at most {self.pages_per_seq} pages of {self.page_size} tokens "
                f"({self.max_tokens_per_seq} tokens)"
            )
        owned = int(self._num_owned[slot])
        needed = self.pages_for(num_tokens) - owned
        if needed <= 0:
            return
        if needed > len(self._free):
            raise OutOfPagesError(
                f"slot {slot} needs {needed} more page(s) for {num_tokens} tokens, "
                f"{len(self._free)} free"
            )
        for i in range(owned, owned + needed):
            self.page_table[slot, i] = self._free.pop()
        self._num_owned[slot] = owned + needed

    def try_reserve(self, slot: int, num_tokens: int) -> bool:
        """`reserve`, returning False instead of raising OutOfPagesError."""
        try:
            self.reserve(slot, num_tokens)
        except OutOfPagesError:
            return False
        return True

    def free(self, slot: int) -> int:
        """Return all of slot `slot`'s pages to the pool; returns how many."""
        pages = self.pages_of(slot)
        self._free.extend(reversed(pages))
        self.page_table[slot] = PADDING_PAGE
        self._num_owned[slot] = 0
        return len(pages)

    # -- swapping -------------------------------------------------------------------------
    @property
    def swapped_bytes(self) -> int:
        """Host bytes held by swapped-out sequences."""
        return sum(h.nbytes for h in self.swapped.values())

    def swap_out(self, slot: int, key: Hashable, read: Callable[[list[int]], Any]) -> HostPages:
        """Copy slot `slot`'s pages to the host (`read(pages)` returns their contents, in
        token order, with an `nbytes` or as a tuple of arrays), keep them under `key` and
        free the slot. Nothing changes if `read` raises."""
        if key in self.swapped:
            raise ValueError(f"{key!r} is already swapped out")
        pages = self.pages_of(slot)
        data = read(pages)
        nbytes = getattr(data, "nbytes", None)
        if nbytes is None:
            nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(data))
        host = HostPages(len(pages), data, int(nbytes))
        self.swapped[key] = host
        self.free(slot)
        return host

    def can_swap_in(self, key: Hashable) -> bool:
        return self.swapped[key].num_pages <= len(self._free)

    def swap_in(self, key: Hashable, slot: int, write: Callable[[list[int], Any], None]) -> bool:
        """Give empty slot `slot` fresh pages for `key`'s swapped-out sequence and copy its
        contents there (`write(pages, data)`); drop the host copy. False (nothing changed)
        when the pool has too few free pages. If `write` raises, the pages go back to the
        pool and the host copy stays."""
        host = self.swapped[key]
        if self._num_owned[slot]:
            raise ValueError(f"slot {slot} still owns pages: free it before swapping in")
        if host.num_pages > len(self._free):
            return False
        self.reserve(slot, host.num_pages * self.page_size)
        try:
            write(self.pages_of(slot), host.data)
        except BaseException:
            self.free(slot)
            raise
        del self.swapped[key]
        return True

    def drop_swapped(self, key: Hashable) -> None:
        """Forget `key`'s host copy (its request ended while swapped out)."""
        del self.swapped[key]

    def invariant_problems(self) -> list[str]:
        """What is wrong with the bookkeeping ([] when sound): every page 1..num_pages-1 is
        either free or owned by exactly one slot, rows hold their owned pages then padding,
        and the owned counts add up."""
        problems = []
        owned = [p for s in range(self.max_seqs) for p in self.pages_of(s)]
        everything = owned + self._free
        if sorted(everything) != list(range(1, self.num_pages)):
            problems.append(
                f"pages owned {sorted(owned)} + free {sorted(self._free)} "
                f"are not each of 1..{self.num_pages - 1} once"
            )
        for s in range(self.max_seqs):
            tail = self.page_table[s, self._num_owned[s] :]
            if tail.any():
                problems.append(f"slot {s} has pages past its {self._num_owned[s]} owned")
        return problems

    def device_page_table(self, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
        """A device copy of the page table: int32[max_seqs, pages_per_seq]."""
        return jax.device_put(self.page_table.copy(), sharding)
