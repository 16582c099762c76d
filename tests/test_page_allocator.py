"""The host-side page allocator: its invariants under any sequence of reserve/free, and of
admit / grow / swap out / swap in / finish (with a numpy pool standing for the device's, so
the pages' contents are checked too), and the pool size from a memory budget."""

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
    """Sequences admitted, grown token by token, swapped out to host copies and back into
    other slots and pages, and finished, live or swapped. Every token's value is written
    into the pool when it is stored, and must read back from wherever its page is now."""

    sequences = Bundle("sequences")

    def __init__(self):
        super().__init__()
        self.tokens: dict[int, int] = {}  # key -> tokens stored
        self.slot_of: dict[int, int] = {}  # key -> slot, live sequences only
        self.next_key = 0

    @initialize(num_pages=st.integers(2, 14))
    def start(self, num_pages):
        self.allocator = machine_allocator(num_pages)
        self.pool = np.zeros((num_pages, PAGE_SIZE), np.int64)

    def value(self, key: int, position: int) -> int:
        return 1000 * (key + 1) + position

    def store(self, key: int, first: int, last: int) -> None:
        pages = self.allocator.pages_of(self.slot_of[key])
        for p in range(first, last):
            self.pool[pages[p // PAGE_SIZE], p % PAGE_SIZE] = self.value(key, p)

    def read(self, pages):
        return self.pool[pages].copy()

    def write(self, pages, data):
        self.pool[pages] = data

    @rule(target=sequences, tokens=st.integers(1, PAGES_PER_SEQ * PAGE_SIZE))
    def admit(self, tokens):
        free = [s for s in range(MAX_SEQS) if s not in self.slot_of.values()]
        if not free or not self.allocator.try_reserve(free[0], tokens):
            return multiple()  # nothing admitted
        key, self.next_key = self.next_key, self.next_key + 1
        self.slot_of[key], self.tokens[key] = free[0], tokens
        self.store(key, 0, tokens)
        return key

    @rule(key=sequences, more=st.integers(1, 2 * PAGE_SIZE))
    def grow(self, key, more):
        if key not in self.slot_of:
            return
        tokens = min(self.tokens[key] + more, PAGES_PER_SEQ * PAGE_SIZE)
        if self.allocator.try_reserve(self.slot_of[key], tokens):
            self.store(key, self.tokens[key], tokens)
            self.tokens[key] = tokens

    @rule(key=sequences)
    def swap_out(self, key):
        if key not in self.slot_of:
            return
        slot = self.slot_of.pop(key)
        pages = self.allocator.pages_of(slot)
        host = self.allocator.swap_out(slot, key, self.read)
        self.pool[pages] = -1  # freed pages get scribbled on by whoever takes them
        assert host.num_pages == self.allocator.pages_for(self.tokens[key])
        assert self.allocator.pages_of(slot) == []

    @rule(key=sequences)
    def swap_in(self, key):
        if key not in self.allocator.swapped:
            return
        free = [s for s in range(MAX_SEQS) if s not in self.slot_of.values()]
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
            self.allocator.free(self.slot_of.pop(key))
        elif key in self.allocator.swapped:
            self.allocator.drop_swapped(key)
        del self.tokens[key]

    @invariant()
    def pages_owned_once_and_contents_where_their_sequence_left_them(self):
        if not hasattr(self, "allocator"):
            return
        a = self.allocator
        assert a.invariant_problems() == []
        assert set(a.swapped) == set(self.tokens) - set(self.slot_of)  # host copies: no leak
        assert a.swapped_bytes == sum(h.data.nbytes for h in a.swapped.values())
        for key, slot in self.slot_of.items():
            pages = a.pages_of(slot)
            assert len(pages) == a.pages_for(self.tokens[key])
            for p in range(self.tokens[key]):
                assert self.pool[pages[p // PAGE_SIZE], p % PAGE_SIZE] == self.value(key, p)

    def teardown(self):
        if not hasattr(self, "allocator"):
            return
        for key in list(self.tokens):
            self.finish(key)
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
