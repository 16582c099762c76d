"""The prefix cache (inference.prefix_cache_entries): prompts kept after their prefill, so
a sample of one admitted in a later round takes its KV pages and draws its first token from
the logits its prefill computed, instead of being prefilled again.

An entry is keyed by (context tokens, weight version) and holds the context's full pages
(shared with the slots that hold them, `PageAllocator.hold`), a copy of its last, partial
page made before any slot wrote past the context there (`PageAllocator.new_page`), and a row
of the engine's device table of last-position logits. The prefill call that computes a
prompt fills its entry: the partial page's copy and the logits row (`steps.prefill_step`,
`logit_rows`); a later sample forks the entry's pages (`PageAllocator.fork_pages`) and is
sampled from the row (`steps.sample_step`), which gives bitwise the token and log-prob its
own prefill would: the logits are the bits that prefill computes for the prompt in any row,
and the sampler runs on a block of the same shape. Entries of another version are never
used: a weight load clears the cache. The least recently used entry goes first when the
cache is full, and whenever the pool needs pages for a sequence. Host code only.
"""

from __future__ import annotations

import collections
import dataclasses

from rlax_tpu.inference.page_allocator import PageAllocator

Context = tuple[int, ...]


@dataclasses.dataclass(eq=False)
class Entry:
    """A kept prompt: `pages` in token order (the full ones shared, the last its own copy)
    for its first `num_tokens` tokens, and its `row` of the logits table."""

    pages: list[int]
    num_tokens: int
    row: int
    # Added in the admission round running now: its prefill has not run, so it is neither
    # used nor evicted (its copy page and row would be written after being handed out).
    pending: bool = True


class PrefixCache:
    """At most `capacity` entries over `allocator`'s pool."""

    def __init__(self, allocator: PageAllocator, capacity: int):
        self.allocator, self.capacity = allocator, capacity
        self._entries: collections.OrderedDict[tuple[Context, int], Entry] = (
            collections.OrderedDict()
        )
        self._rows = list(range(capacity - 1, -1, -1))  # free rows of the logits table

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, context: Context, version: int) -> Entry | None:
        """The entry of `context` under `version`, now the most recently used; or None."""
        entry = self._entries.get((context, version))
        if entry is not None:
            self._entries.move_to_end((context, version))
        return entry

    def add(
        self, context: Context, version: int, slot: int
    ) -> tuple[Entry, tuple[int, int] | None] | None:
        """Keep `context` (just admitted into `slot`, whose pages hold it once its prefill
        runs) under `version`, evicting the least recently used entry when full: the
        entry, and the (src, dst) page copy its prefill must make of the partial last page
        (None when the context ends on a page boundary). KeyError if it is kept already;
        None when no page is free for the copy (nothing is kept)."""
        key = (context, version)
        if key in self._entries:
            raise KeyError(f"a context of {len(context)} tokens is cached already")
        if not self.capacity:
            return None
        if len(self._entries) == self.capacity and not self.evict():
            return None  # every entry waits for its prefill
        a = self.allocator
        full, partial = divmod(len(context), a.page_size)
        slot_pages = a.pages_of(slot)
        copy = None
        pages = slot_pages[:full]
        if partial:
            page = a.new_page()
            if page is None:
                return None
            copy = (slot_pages[full], page)
        a.hold(pages)
        if partial:
            pages = [*pages, copy[1]]
        entry = Entry(pages, len(context), self._rows.pop())
        self._entries[key] = entry
        return entry, copy

    def settle(self) -> None:
        """The admission round's prefill calls have run: its entries are filled."""
        for entry in self._entries.values():
            entry.pending = False

    def evict(self, keep: Entry | None = None) -> bool:
        """Drop the least recently used entry but `keep` and those pending (its pages go
        back to the pool unless a slot holds them); False when there is none."""
        key = next((k for k, e in self._entries.items() if e is not keep and not e.pending), None)
        if key is None:
            return False
        entry = self._entries.pop(key)
        self.allocator.let_go(entry.pages)
        self._rows.append(entry.row)
        return True

    def clear(self) -> int:
        """Drop every entry (none is pending: between rounds); how many there were."""
        n = len(self._entries)
        self.settle()
        while self.evict():
            pass
        return n
