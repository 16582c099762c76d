"""Host-side bookkeeping of the KV page pool: which pages each decode slot owns.

The allocator owns the page table int32[max_seqs, pages_per_seq] on the host (0 = no
page; page 0 is the padding page and is never handed out) and hands a copy to the device
when the caller commits it, so the jitted decode step never waits on Python.
"""

from __future__ import annotations

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

    def device_page_table(self, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
        """A device copy of the page table: int32[max_seqs, pages_per_seq]."""
        return jax.device_put(self.page_table.copy(), sharding)
