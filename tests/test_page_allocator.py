"""The host-side page allocator: its invariants under any sequence of reserve/free, and of
admit / grow / fork / swap out / swap in / finish (with a numpy pool standing for the
device's, so the pages' contents are checked too: a page shared by a fork is never written,
never freed while held, never leaked), and the pool size from a memory budget."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from rlax_tpu.config import ConfigError
from rlax_tpu.inference.page_allocator import (
    OutOfPagesError,
    PageAllocator,
    SequenceTooLongError,
    num_pages_for_budget,
)
from rlax_tpu.inference.prefix_cache import PrefixCache

MAX_SEQS, PAGES_PER_SEQ, PAGE_SIZE = 4, 5, 4


def machine_allocator(num_pages: int) -> PageAllocator:
    return PageAllocator(
        num_pages=num_pages, max_seqs=MAX_SEQS, pages_per_seq=PAGES_PER_SEQ, page_size=PAGE_SIZE
    )


class AllocatorMachine(RuleBasedStateMachine):
    """Random reserve/free sequences against a model of how many tokens each slot holds."""

    def __init__(self):
        super().__init__()
        self.tokens = [0] * MAX_SEQS

    @initialize(num_pages=st.integers(2, 14))
    def start(self, num_pages):
        self.allocator = machine_allocator(num_pages)

    @rule(slot=st.integers(0, MAX_SEQS - 1), num_tokens=st.integers(0, PAGES_PER_SEQ * PAGE_SIZE))
    def reserve(self, slot, num_tokens):
        a = self.allocator
        before = (a.page_table.copy(), a.free_pages, a.pages_of(slot))
        needed = a.pages_for(num_tokens) - len(before[2])
        if needed > before[1]:
            assert not a.can_reserve(slot, num_tokens)
            with pytest.raises(OutOfPagesError):
                a.reserve(slot, num_tokens)
            # A failed reservation changes nothing.
            np.testing.assert_array_equal(a.page_table, before[0])
            assert a.free_pages == before[1]
            return
        assert a.can_reserve(slot, num_tokens)
        a.reserve(slot, num_tokens)
        self.tokens[slot] = max(self.tokens[slot], num_tokens)
        # Growing keeps the pages already held, in place.
        assert a.pages_of(slot)[: len(before[2])] == before[2]

    @rule(slot=st.integers(0, MAX_SEQS - 1))
    def free(self, slot):
        held = len(self.allocator.pages_of(slot))
        assert self.allocator.free(slot) == held
        self.tokens[slot] = 0
        assert self.allocator.pages_of(slot) == []

    @invariant()
    def pages_are_owned_once_and_accounted(self):
        a = self.allocator
        owned = [p for slot in range(MAX_SEQS) for p in a.pages_of(slot)]
        assert len(owned) == len(set(owned)), "a page is owned by two slots"
        assert 0 not in owned, "the padding page was handed out"
        assert all(1 <= p < a.num_pages for p in owned)
        assert a.free_pages + a.used_pages == a.num_pages - 1
        assert a.used_pages == len(owned)
        for slot in range(MAX_SEQS):
            held = a.pages_of(slot)
            assert len(held) == a.pages_for(self.tokens[slot])
            # Past its pages a row is padding.
            assert (a.page_table[slot, len(held) :] == 0).all()

    def teardown(self):
        for slot in range(MAX_SEQS):
            self.allocator.free(slot)
        assert self.allocator.free_pages == self.allocator.num_pages - 1
        assert (self.allocator.page_table == 0).all()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


class SwapMachine(RuleBasedStateMachine):
    """Sequences admitted, grown token by token, forked (a group's samples sharing their
    prompt's pages), swapped out to host copies and back into other slots and pages, and
    finished, live or swapped; prompts kept by a prefix cache (`PrefixCache`: pages held past
    their slots, a copy of the partial page), forked from there and evicted. Every token's
    value is written into the pool when it is stored, only ever into a page no other slot
    holds, and must read back from wherever its page is now; a page let go by its last
    holder is scribbled on, so a page freed while in use shows up as a wrong value."""

    sequences = Bundle("sequences")

    def __init__(self):
        super().__init__()
        self.values: dict[int, list[int]] = {}  # key -> the value of each token stored
        self.slot_of: dict[int, int] = {}  # key -> slot, live sequences only
        self.next_key = 0

    @initialize(num_pages=st.integers(2, 14))
    def start(self, num_pages):
        self.allocator = machine_allocator(num_pages)
        self.pool = np.zeros((num_pages, PAGE_SIZE), np.int64)
        self.cache = PrefixCache(self.allocator, 3)
        self.cached: dict[tuple[int, ...], list[int]] = {}  # context -> its values

    def new_key(self) -> int:
        key, self.next_key = self.next_key, self.next_key + 1
        return key

    def store(self, key: int, first: int, last: int) -> None:
        pages = self.allocator.pages_of(self.slot_of[key])
        for p in range(first, last):
            page = pages[p // PAGE_SIZE]
            assert self.allocator.refcount(page) == 1, "a write into a page another slot holds"
            self.pool[page, p % PAGE_SIZE] = 1000 * (key + 1) + p
            self.values[key].append(1000 * (key + 1) + p)

    def release(self, pages) -> None:
        """Scribble on the pages no slot holds any more (whoever takes them next would)."""
        for page in pages:
            if self.allocator.refcount(page) == 0:
                self.pool[page] = -1

    def read(self, pages):
        return self.pool[pages].copy()

    def write(self, pages, data):
        self.pool[pages] = data

    def free_slots(self) -> list[int]:
        return [s for s in range(MAX_SEQS) if s not in self.slot_of.values()]

    @rule(target=sequences, tokens=st.integers(1, PAGES_PER_SEQ * PAGE_SIZE))
    def admit(self, tokens):
        free = self.free_slots()
        if not free or not self.allocator.try_reserve(free[0], tokens):
            return multiple()  # nothing admitted
        key = self.new_key()
        self.slot_of[key], self.values[key] = free[0], []
        self.store(key, 0, tokens)
        return key

    @rule(key=sequences, more=st.integers(1, 2 * PAGE_SIZE))
    def grow(self, key, more):
        if key not in self.slot_of:
            return
        held = len(self.values[key])
        tokens = min(held + more, PAGES_PER_SEQ * PAGE_SIZE)
        if self.allocator.try_reserve(self.slot_of[key], tokens):
            self.store(key, held, tokens)

    @rule(target=sequences, key=sequences, data=st.data())
    def fork(self, key, data):
        """Another sample of `key`'s first tokens (its group's prompt) in a free slot."""
        free = self.free_slots()
        if key not in self.slot_of or not free:
            return multiple()
        n = data.draw(st.integers(1, len(self.values[key])), label="prefix")
        a, src = self.allocator, self.slot_of[key]
        before = (a.page_table.copy(), a.free_pages)

        def copy(page, to):
            self.pool[to] = self.pool[page]

        try:
            a.fork(src, free[0], n, copy)
        except OutOfPagesError:
            assert n % PAGE_SIZE and before[1] == 0  # only the partial page's copy needs one
            np.testing.assert_array_equal(a.page_table, before[0])
            return multiple()
        child = self.new_key()
        self.slot_of[child], self.values[child] = free[0], self.values[key][:n]
        shared = a.pages_of(src)[: n // PAGE_SIZE]
        assert a.pages_of(free[0])[: len(shared)] == shared
        assert a.free_pages == before[1] - (n % PAGE_SIZE > 0)  # shared pages cost nothing
        return child

    @rule(key=sequences)
    def keep(self, key):
        """The prefix cache keeps `key`'s tokens so far (a prompt just prefilled)."""
        if key not in self.slot_of:
            return
        context = tuple(self.values[key])
        if self.cache.get(context, 0) is not None:
            return
        before = {e.row: e.pages for e in self.cache._entries.values()}
        added = self.cache.add(context, 0, self.slot_of[key])
        self.release([p for pages in before.values() for p in pages])  # an eviction
        self.cached = {c: v for c, v in self.cached.items() if self.cache.get(c, 0)}
        if added is None:
            return
        _, copy = added
        if copy is not None:
            self.pool[copy[1]] = self.pool[copy[0]]
        self.cache.settle()
        self.cached[context] = list(context)

    @rule(target=sequences, data=st.data())
    def fork_cached(self, data):
        """A later sample of a cached prompt, in a free slot, from the cache's pages."""
        free = self.free_slots()
        if not self.cached or not free:
            return multiple()
        context = data.draw(st.sampled_from(sorted(self.cached)), label="context")
        entry = self.cache.get(context, 0)

        def copy(page, to):
            self.pool[to] = self.pool[page]

        try:
            self.allocator.fork_pages(entry.pages, free[0], len(context), copy)
        except OutOfPagesError:
            return multiple()
        child = self.new_key()
        self.slot_of[child], self.values[child] = free[0], list(self.cached[context])
        return child

    @rule()
    def evict(self):
        pages = {e.row: e.pages for e in self.cache._entries.values()}
        if self.cache.evict():
            self.release([p for ps in pages.values() for p in ps])
            self.cached = {c: v for c, v in self.cached.items() if self.cache.get(c, 0)}

    @rule(key=sequences)
    def swap_out(self, key):
        if key not in self.slot_of:
            return
        slot = self.slot_of.pop(key)
        pages = self.allocator.pages_of(slot)
        host = self.allocator.swap_out(slot, key, self.read)
        self.release(pages)
        assert host.num_pages == self.allocator.pages_for(len(self.values[key]))
        assert self.allocator.pages_of(slot) == []

    @rule(key=sequences)
    def swap_in(self, key):
        if key not in self.allocator.swapped:
            return
        free = self.free_slots()
        if not free:
            return
        fits = self.allocator.can_swap_in(key)
        assert self.allocator.swap_in(key, free[0], self.write) == fits
        if fits:
            self.slot_of[key] = free[0]
            assert key not in self.allocator.swapped

    @rule(key=consumes(sequences))
    def finish(self, key):
        if key in self.slot_of:
            slot = self.slot_of.pop(key)
            pages = self.allocator.pages_of(slot)
            self.allocator.free(slot)
            self.release(pages)
        elif key in self.allocator.swapped:
            self.allocator.drop_swapped(key)
        del self.values[key]

    @invariant()
    def pages_held_as_counted_and_contents_where_their_sequence_left_them(self):
        if not hasattr(self, "allocator"):
            return
        a = self.allocator
        assert a.invariant_problems() == []
        assert set(a.swapped) == set(self.values) - set(self.slot_of)  # host copies: no leak
        assert a.swapped_bytes == sum(h.data.nbytes for h in a.swapped.values())
        held = {p for slot in self.slot_of.values() for p in a.pages_of(slot)}
        held |= {p for e in self.cache._entries.values() for p in e.pages}
        assert a.used_pages == len(held) and a.free_pages + len(held) == a.num_pages - 1
        for context in self.cached:  # a cached prompt's pages still hold it
            pages = self.cache.get(context, 0).pages
            for p, value in enumerate(context):
                assert self.pool[pages[p // PAGE_SIZE], p % PAGE_SIZE] == value
        for key, slot in self.slot_of.items():
            pages = a.pages_of(slot)
            assert len(pages) == a.pages_for(len(self.values[key]))
            for p, value in enumerate(self.values[key]):
                assert self.pool[pages[p // PAGE_SIZE], p % PAGE_SIZE] == value

    def teardown(self):
        if not hasattr(self, "allocator"):
            return
        for key in list(self.values):
            self.finish(key)
        self.cache.clear()
        assert self.allocator.free_pages == self.allocator.num_pages - 1
        assert self.allocator.swapped == {} and self.allocator.invariant_problems() == []


TestSwapMachine = SwapMachine.TestCase
TestSwapMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_invariant_problems_names_a_page_owned_twice():
    a = allocator()
    a.reserve(0, 4)
    a.page_table[1, 0] = a.page_table[0, 0]
    a._num_owned[1] = 1
    assert a.invariant_problems()


def allocator(num_pages=8):
    return PageAllocator(num_pages=num_pages, max_seqs=2, pages_per_seq=4, page_size=4)


def test_reserve_allocates_pages_by_token_count():
    a = allocator()
    a.reserve(0, 5)
    assert len(a.pages_of(0)) == 2
    a.reserve(0, 8)  # still two pages
    assert len(a.pages_of(0)) == 2
    a.reserve(0, 3)  # shrinking is a no-op
    assert len(a.pages_of(0)) == 2


def test_out_of_pages_raises_and_try_reserve_returns_false():
    a = allocator(num_pages=4)  # 3 usable pages
    a.reserve(0, 8)
    with pytest.raises(OutOfPagesError):
        a.reserve(1, 9)
    assert not a.try_reserve(1, 9)
    assert a.try_reserve(1, 4) and a.free_pages == 0


def test_sequence_longer_than_a_row_is_rejected():
    a = allocator()
    with pytest.raises(SequenceTooLongError):
        a.reserve(0, 17)
    assert a.free_pages == 7


def test_freed_pages_are_reused():
    a = allocator(num_pages=3)
    a.reserve(0, 8)
    pages = set(a.pages_of(0))
    a.free(0)
    a.reserve(1, 8)
    assert set(a.pages_of(1)) == pages


def test_device_page_table_is_a_snapshot():
    a = allocator()
    a.reserve(0, 4)
    table = a.device_page_table()
    a.reserve(1, 4)
    assert table.dtype == jnp.int32 and table.shape == (2, 4)
    np.testing.assert_array_equal(np.asarray(table)[1], 0)


def test_num_pages_for_budget_counts_keys_and_values_of_all_layers():
    # 2 (k, v) * 3 layers * 2 heads * 16 tokens * 64 dims * 2 bytes = 24 KiB per page.
    per_page = 2 * 3 * 2 * 16 * 64 * 2
    kwargs = dict(num_layers=3, kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16")
    assert num_pages_for_budget(10 * per_page + 1, **kwargs) == 10
    with pytest.raises(ConfigError, match="kv_cache_bytes"):
        num_pages_for_budget(per_page, **kwargs)


def test_fork_shares_full_pages_copies_the_partial_one_and_refuses_without_changing():
    a = allocator(num_pages=8)
    a.reserve(0, 10)  # 3 pages of 4: two full, one holding 2 tokens
    src = a.pages_of(0)
    copies = []
    a.fork(0, 1, 10, lambda page, to: copies.append((page, to)))
    forked = a.pages_of(1)
    assert forked[:2] == src[:2] and forked[2] not in src and copies == [(src[2], forked[2])]
    assert [a.refcount(p) for p in forked] == [2, 2, 1] and a.shared_pages == 2
    assert a.used_pages == 4 and a.invariant_problems() == []
    # The first of the two to finish leaves the shared pages to the other.
    a.free(0)
    assert [a.refcount(p) for p in forked] == [1, 1, 1] and a.free_pages == 4
    before = (a.page_table.copy(), a.free_pages)
    with pytest.raises(ValueError, match="still holds pages"):
        a.fork(0, 1, 4, lambda page, to: None)
    with pytest.raises(ValueError, match="fewer than 13 tokens"):
        a.fork(1, 0, 13, lambda page, to: None)

    def broken(page, to):
        raise RuntimeError("device copy failed")

    with pytest.raises(RuntimeError, match="device copy failed"):
        a.fork(1, 0, 6, broken)
    np.testing.assert_array_equal(a.page_table, before[0])
    assert a.free_pages == before[1] and a.invariant_problems() == []
    a.fork(1, 0, 8, broken)  # a whole-page prefix copies nothing
    assert a.pages_of(0) == forked[:2]
