"""Packing a batch into token-budget rows (rlax_tpu/trainer/packing.py): the first-fit
layout places every token of every sequence once within a row's budget, deterministically;
pack and unpack are inverses, and so are the trainer's index arrays (`packed_layout`); a
sequence ends at its last masked position; and the model's per-token log-probs, and the
gradients of a masked loss over them, are the padded batch's within float rounding when the
sequences are packed as segments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_tpu.config import ModelConfig
from rlax_tpu.models import Transformer
from rlax_tpu.trainer.packing import (
    PackingError,
    first_fit,
    packed_layout,
    sequence_lengths,
)

MODEL = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=4, head_dim=8)


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
    segments = packing.segment_ids
    for b, n in enumerate(lengths):
        assert (segments == b + 1).sum() == n  # each token once
        if n:
            row, start = packing.rows[b], packing.offsets[b]
            assert start + n <= tokens_per_row
            assert (segments[row, start : start + n] == b + 1).all()  # contiguous, in place
            np.testing.assert_array_equal(packing.positions[row, start : start + n], range(n))
    # First fit: no sequence would have fit in an earlier row than the one it went to, at
    # the time it was placed.
    used = [0] * packing.num_rows
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        assert all(u + n > tokens_per_row for u in used[: packing.rows[b]])
        used[packing.rows[b]] += n
    assert packing.num_rows <= max(1, sum(n > 0 for n in lengths))
    total = sum(lengths)
    assert packing.padding_fraction == pytest.approx(
        1 - total / (packing.num_rows * tokens_per_row)
    )


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=10), data=st.data())
def test_pack_and_unpack_are_inverses_on_the_sequences(lengths, data):
    seq = max(lengths) + data.draw(st.integers(0, 3))
    padded = np.arange(len(lengths) * seq, dtype=np.int64).reshape(len(lengths), seq) + 1
    packing = first_fit(lengths, data.draw(st.integers(max(lengths), 30)))
    packed = packing.pack(padded)
    back = packing.unpack(packed, seq)
    valid = np.arange(seq)[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_array_equal(back[valid], padded[valid])
    assert not back[~valid].any() and (packed != 0).sum() == sum(lengths)
    rows, cols = packing.gather_indices(seq)
    np.testing.assert_array_equal(np.where(valid, packed[rows, cols], 0), back)


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


def _logprob_loss(params, graphdef, tokens, targets, mask, positions=None, segment_ids=None):
    model = nnx.merge(graphdef, params)
    out = model.forward_train(tokens, targets, positions=positions, segment_ids=segment_ids)
    return out.logprobs, (out.logprobs * mask).sum() / mask.sum()


def test_packed_log_probs_and_gradients_equal_the_padded_batchs():
    """The same sequences, padded to [4, 24] and packed into rows of 32 tokens: the
    per-token log-probs agree within float rounding, and so do the gradients of a masked
    mean over them (the form of every token-level objective), taken through the unpacking
    gather."""
    rng = np.random.default_rng(0)
    lengths = [24, 9, 17, 5]
    seq, budget = max(lengths), 32
    tokens = np.zeros((len(lengths), seq), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(1, MODEL.vocab_size, n)
    targets = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
    mask = (np.arange(seq)[None, :] < np.asarray(lengths)[:, None] - 1).astype(np.float32)
    mask[:, :2] = 0.0  # a "prompt" the loss leaves out
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def padded_loss(p):
        return _logprob_loss(p, graphdef, tokens, targets, mask)

    packing = first_fit(lengths, budget)
    assert packing.num_rows == 2 and packing.padding_fraction < 0.25  # vs 1 - 55/96 padded
    rows, cols = packing.gather_indices(seq)
    packed_args = (
        packing.pack(tokens),
        packing.pack(targets),
        packing.positions,
        packing.segment_ids,
    )

    def packed_loss(p):
        ptokens, ptargets, positions, segments = packed_args
        out = nnx.merge(graphdef, p).forward_train(
            ptokens, ptargets, positions=positions, segment_ids=segments
        )
        logprobs = out.logprobs[rows, cols]  # back to the padded layout
        return logprobs, (logprobs * mask).sum() / mask.sum()

    want_logprobs, want_loss = padded_loss(params)
    got_logprobs, got_loss = packed_loss(params)
    want_grad = jax.grad(lambda p: padded_loss(p)[1])(params)
    got_grad = jax.grad(lambda p: packed_loss(p)[1])(params)
    valid = mask > 0
    np.testing.assert_allclose(
        np.asarray(got_logprobs)[valid], np.asarray(want_logprobs)[valid], atol=1e-5
    )
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6, atol=1e-6)
    for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)
    # Without segment ids the packed sequences would attend to each other: not the same.
    crossed = nnx.merge(graphdef, params).forward_train(
        packed_args[0], packed_args[1], positions=packed_args[2]
    )
    assert not np.allclose(
        np.asarray(crossed.logprobs[rows, cols])[valid], np.asarray(want_logprobs)[valid], atol=1e-3
    )
    assert jnp.isfinite(got_loss)
