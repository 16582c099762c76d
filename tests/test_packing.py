"""Packing a batch into token-budget rows (rlax_tpu/trainer/packing.py): the first-fit
layout places every token of every sequence once within a row's budget, deterministically;
the trainer's index arrays (`packed_layout`) gather each sequence into its packed slots and
back; a sequence ends at its last masked position. (That a packed step gives the padded one's loss,
metrics and gradients, and not without segment ids: tests/test_trainer_packing.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_tpu.trainer.packing import (
    PackingError,
    first_fit,
    packed_layout,
    sequence_lengths,
)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=24),
    tokens_per_row=st.integers(40, 96),
)
def test_first_fit_places_every_token_once_within_the_budget(lengths, tokens_per_row):
    packing = first_fit(lengths, tokens_per_row)
    again = first_fit(list(lengths), tokens_per_row)  # a function of the lengths alone
    assert np.array_equal(again.rows, packing.rows) and np.array_equal(
        again.offsets, packing.offsets
    )
    occupied = np.zeros((packing.num_rows, tokens_per_row), np.int64)
    for b, row, start, n in packing.spans():
        assert n == lengths[b] and start + n <= tokens_per_row
        occupied[row, start : start + n] += 1  # contiguous, in place
    assert occupied.max(initial=0) <= 1 and occupied.sum() == sum(lengths)  # each token once
    # First fit: no sequence would have fit in an earlier row than the one it went to, at
    # the time it was placed.
    used = [0] * packing.num_rows
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        assert all(u + n > tokens_per_row for u in used[: packing.rows[b]])
        used[packing.rows[b]] += n
    assert packing.num_rows <= max(1, sum(n > 0 for n in lengths))


def test_a_sequence_longer_than_a_row_is_refused_naming_the_knob():
    with pytest.raises(
        PackingError, match=r"sequence 1 has 70 tokens.*tokens_per_row to at least 70"
    ):
        first_fit([10, 70, 5], 64)


def test_a_sequence_ends_at_its_last_masked_position_holes_and_prompt_included():
    mask = np.array(
        [
            [0, 0, 1, 1, 0, 1, 0, 0],  # a response with a hole (an episode's given tokens)
            [0, 0, 0, 0, 0, 0, 0, 0],  # no response: nothing to pack
            [1, 1, 1, 1, 1, 1, 1, 1],
        ]
    )
    np.testing.assert_array_equal(sequence_lengths(mask), [6, 0, 8])
    np.testing.assert_array_equal(sequence_lengths(mask.astype(np.float32) * 0.5), [6, 0, 8])


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_packed_layout_gathers_each_chunks_sequences_and_back(data):
    """Gathering a chunk's padded values through `source` and the results back through
    `unpack` returns every value within a sequence's length and 0 past it; packed slots
    hold one chunk's tokens each, in rows of at most tokens_per_row; only the micro-batches
    counted in `used` hold any; the layout is a function of the lengths."""
    chunks, micro = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    rows = micro * data.draw(st.integers(1, 4))
    seq = data.draw(st.integers(2, 12))
    width = data.draw(st.integers(seq, 2 * seq))
    lengths = data.draw(
        st.lists(st.integers(0, seq), min_size=chunks * rows, max_size=chunks * rows)
    )
    layout = packed_layout(lengths, chunks=chunks, micro_size=micro, tokens_per_row=width, seq=seq)
    again = packed_layout(
        list(lengths), chunks=chunks, micro_size=micro, tokens_per_row=width, seq=seq
    )
    for a, b in zip(layout, again, strict=True):
        np.testing.assert_array_equal(a, b)
    m = rows // micro
    assert layout.source.shape == (chunks, m, micro, width) and layout.unpack.shape == (
        chunks,
        rows,
        seq,
    )
    padded = np.arange(1, chunks * rows * seq + 1).reshape(chunks, rows, seq)
    within = np.arange(seq)[None, :] < np.reshape(lengths, (chunks, rows))[..., None]
    for u in range(chunks):
        flat = np.append(padded[u].reshape(-1), 0)
        packed = flat[layout.source[u]]  # [m, micro, width]
        assert (packed > 0).sum() == within[u].sum()
        np.testing.assert_array_equal(packed > 0, layout.segment_ids[u] > 0)
        assert not packed[layout.used[u] :].any()  # unused micro-batches: all padding
        back = np.append(packed.reshape(-1), 0)[layout.unpack[u]]
        np.testing.assert_array_equal(back, np.where(within[u], padded[u], 0))
        # A sequence's positions count from 0 in its segment; segment b + 1 is row b's.
        rows_of = (layout.source[u] // seq)[packed > 0]
        np.testing.assert_array_equal(layout.segment_ids[u][packed > 0], rows_of + 1)
        np.testing.assert_array_equal(
            layout.positions[u][packed > 0], (layout.source[u] % seq)[packed > 0]
        )
    assert layout.sequence_tokens == sum(lengths)
    assert layout.sequence_tokens <= layout.packed_tokens <= chunks * rows * width
