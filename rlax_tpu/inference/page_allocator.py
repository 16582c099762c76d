"""Host-side bookkeeping of the KV page pool: which pages each decode slot holds, and the
host copies of sequences swapped out of the pool.

Pages are reference-counted: `fork` lets a slot share another's full pages of a common
prefix (the prompt of a GRPO group) read-only, and gives it a copy of the prefix's last,
partial page, so a slot only ever writes pages no other slot holds. A page goes back to the
pool when the last slot holding it lets go (`free`, a swap-out).

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
    A page may be in several rows (`fork`): `refcount(page)` says in how many.
    """

    def __init__(self, *, num_pages: int, max_seqs: int, pages_per_seq: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is padding), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.page_table = np.zeros((max_seqs, pages_per_seq), np.int32)
        self._num_owned = np.zeros(max_seqs, np.int64)
        self._refs = np.zeros(num_pages, np.int64)  # holders of each page (0: free)
        self._held = np.zeros(num_pages, np.int64)  # holders that are not slots (`hold`)
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
        """Pages held by any slot, a shared page once."""
        return self.num_pages - 1 - len(self._free)

    @property
    def shared_pages(self) -> int:
        """Pages held by more than one slot."""
        return int((self._refs > 1).sum())

    def refcount(self, page: int) -> int:
        """How many slots hold `page` (0: free)."""
        return int(self._refs[page])

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def num_pages_of(self, slot: int) -> int:
        """How many pages slot `slot` holds (`len(pages_of(slot))`, without the list)."""
        return int(self._num_owned[slot])

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
            page = self._free.pop()
            self.page_table[slot, i] = page
            self._refs[page] = 1
        self._num_owned[slot] = owned + needed

    def try_reserve(self, slot: int, num_tokens: int) -> bool:
        """`reserve`, returning False instead of raising OutOfPagesError."""
        try:
            self.reserve(slot, num_tokens)
        except OutOfPagesError:
            return False
        return True

    def free(self, slot: int) -> int:
        """Let go of all of slot `slot`'s pages: each goes back to the pool unless another
        slot still holds it. Returns how many the slot held."""
        pages = self.pages_of(slot)
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
        self.page_table[slot] = PADDING_PAGE
        self._num_owned[slot] = 0
        return len(pages)

    def fork(self, src: int, dst: int, num_tokens: int, copy: Callable[[int, int], None]) -> None:
        """Give empty slot `dst` the first `num_tokens` tokens of slot `src`: it shares the
        full pages among them (read-only from then on: both slots write only past
        `num_tokens`) and gets a fresh copy of the last, partial one, if any
        (`copy(src_page, dst_page)` copies its contents). Raises OutOfPagesError when no page
        is free for that copy, ValueError when `src` holds fewer tokens' pages or `dst`
        holds pages; in each case nothing changes. If `copy` raises, nothing changes."""
        self.fork_pages(self.pages_of(src), dst, num_tokens, copy, source=f"slot {src}")

    def fork_pages(
        self,
        held: list[int],
        dst: int,
        num_tokens: int,
        copy: Callable[[int, int], None],
        *,
        source: str = "the pages given",
    ) -> None:
        """`fork` from pages in token order (a slot's, or ones kept by `hold`)."""
        if self._num_owned[dst]:
            raise ValueError(f"slot {dst} still holds pages: free it before forking into it")
        held = list(held)
        if self.pages_for(num_tokens) > len(held):
            raise ValueError(
                f"{source} hold {len(held)} page(s), fewer than {num_tokens} tokens need"
            )
        full, partial = divmod(num_tokens, self.page_size)
        if partial and not self._free:
            raise OutOfPagesError(
                f"forking {num_tokens} tokens of {source} needs a page for its partial last "
                "page, 0 free"
            )
        pages = held[:full]
        if partial:
            page = self._free.pop()
            try:
                copy(held[full], page)
            except BaseException:
                self._free.append(page)
                raise
            self._refs[page] = 1
            pages.append(page)
        for page in held[:full]:
            self._refs[page] += 1
        self.page_table[dst, : len(pages)] = pages
        self._num_owned[dst] = len(pages)

    def new_page(self) -> int | None:
        """A free page, held by the caller (`let_go` returns it); None when none is free."""
        if not self._free:
            return None
        page = self._free.pop()
        self._refs[page] = self._held[page] = 1
        return page

    def hold(self, pages: list[int]) -> None:
        """Keep `pages` (each held by some slot now) past their slots' letting go: a holder
        that is not a slot (the prefix cache). `let_go` ends it."""
        for page in pages:
            if self._refs[page] < 1:
                raise ValueError(f"page {page} is free: only a page in use can be held")
        for page in pages:
            self._refs[page] += 1
            self._held[page] += 1

    def let_go(self, pages: list[int]) -> None:
        """End a `hold` (or `new_page`) of `pages`: each goes back to the pool unless a slot or
        another holder still has it."""
        for page in pages:
            if self._held[page] < 1:
                raise ValueError(f"page {page} is not held")
        for page in reversed(pages):
            self._held[page] -= 1
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    @property
    def held_pages(self) -> int:
        """Pages kept by holders that are not slots (`hold`), each once."""
        return int((self._held > 0).sum())

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
        either free (once) or held, by as many rows as its reference count says, never both;
        a page is in a row at most once; rows hold their pages then padding."""
        problems = []
        held = [p for s in range(self.max_seqs) for p in self.pages_of(s)]
        held += [p for p in np.flatnonzero(self._held).tolist() for _ in range(self._held[p])]
        counts = np.bincount(np.asarray(held, np.int64), minlength=self.num_pages)
        distinct = sorted(set(held))
        if sorted(distinct + self._free) != list(range(1, self.num_pages)):
            problems.append(
                f"pages held {distinct} + free {sorted(self._free)} "
                f"are not each of 1..{self.num_pages - 1} once"
            )
        if not np.array_equal(counts[1:], self._refs[1:]) or counts[0]:
            wrong = [p for p in range(1, self.num_pages) if counts[p] != self._refs[p]]
            problems.append(f"pages {wrong} are held by other numbers of rows than counted")
        for s in range(self.max_seqs):
            pages = self.pages_of(s)
            if len(set(pages)) != len(pages):
                problems.append(f"slot {s} holds a page twice")
        for s in range(self.max_seqs):
            tail = self.page_table[s, self._num_owned[s] :]
            if tail.any():
                problems.append(f"slot {s} has pages past its {self._num_owned[s]} owned")
        return problems

    def device_page_table(self, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
        """A device copy of the page table: int32[max_seqs, pages_per_seq]."""
        return jax.device_put(self.page_table.copy(), sharding)
