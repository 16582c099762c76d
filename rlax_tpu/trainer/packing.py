"""Packing a batch's sequences into rows of a token budget (issue 42): no token padded.

A padded batch is [batch, seq]: each sequence its own row, padded to the longest. A packed
batch is [rows, tokens_per_row]: sequences laid end to end, each a *segment* with its own
segment id (its index + 1; 0 is padding) and positions counted from 0 at its start, so the
model's attention stays within a segment (`Transformer.forward_train(segment_ids=...)`) and
RoPE sees the positions it would see padded. `PackedLayout.unpack` puts per-token results
back in the padded layout, where every objective, normalisation and metric reads them as
before.

The layout is a deterministic first fit over the sequences in batch order: each goes into
the first row with room for it (a function of the lengths alone, so a resumed step packs
the same way). The trainer packs each mini-batch (and the recompute's whole batch) on its
own: `packed_layout` gives the static-shaped index arrays its jitted steps gather with
(rlax_tpu/trainer/step.py), `sequence_lengths` the tokens of each row to keep. Host code
only (numpy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from rlax_tpu import shapes


class PackingError(ValueError):
    """A sequence longer than a packed row can hold."""


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each sequence of a batch goes: sequence b occupies tokens
    [offsets[b], offsets[b] + lengths[b]) of row rows[b]. `num_rows` rows of
    `tokens_per_row` tokens."""

    lengths: np.ndarray  # int64[batch]
    rows: np.ndarray  # int64[batch]
    offsets: np.ndarray  # int64[batch]
    num_rows: int
    tokens_per_row: int

    def spans(self) -> list[tuple[int, int, int, int]]:
        """(sequence, row, start, length) of every sequence."""
        return [
            (b, int(row), int(start), int(n))
            for b, (row, start, n) in enumerate(
                zip(self.rows, self.offsets, self.lengths, strict=True)
            )
        ]


def first_fit(lengths: Sequence[int], tokens_per_row: int) -> Packing:
    """Pack sequences of `lengths` (in batch order) into rows of `tokens_per_row` tokens by
    first fit: each goes into the first row with room left, else a new row. Zero-length
    sequences take no room (row 0, offset 0). PackingError names a sequence longer than a
    row."""
    lengths = np.asarray(lengths, np.int64)
    if tokens_per_row < 1:
        raise PackingError(f"tokens_per_row must be >= 1, got {tokens_per_row}")
    too_long = np.flatnonzero(lengths > tokens_per_row)
    if too_long.size:
        b = int(too_long[0])
        raise PackingError(
            f"sequence {b} has {int(lengths[b])} tokens, more than a packed row holds "
            f"(trainer.tokens_per_row={tokens_per_row}): raise tokens_per_row to at least "
            f"{int(lengths.max())}"
        )
    rows, offsets, num_rows = shapes.first_fit(lengths.tolist(), tokens_per_row)
    return Packing(
        lengths, np.asarray(rows, np.int64), np.asarray(offsets, np.int64), num_rows, tokens_per_row
    )


def sequence_lengths(mask: np.ndarray) -> np.ndarray:
    """int64[batch]: the tokens of each row a packed layout must keep, the last position
    where `mask` (float|bool[batch, seq], the loss / response mask) is nonzero plus one; 0
    for a row without one. Every objective part reads log-probs, values and entropies only
    where the response mask is on (GAE's V_{t+1} is that of the next *response* token), so
    nothing past this length is ever read."""
    on = np.asarray(mask) != 0
    last = on.shape[1] - np.argmax(on[:, ::-1], axis=1)
    return np.where(on.any(axis=1), last, 0).astype(np.int64)


class PackedLayout(NamedTuple):
    """Where a batch's sequences go when its chunks (the mini-batches of a train step, or the
    whole batch for the recompute) are packed, as static-shaped int32 index arrays the
    jitted steps gather with. U chunks of B rows of T tokens; each chunk packed into M
    micro-batches of R rows of P = tokens_per_row tokens (M·R = B: the padded micro-batch
    count, the most a chunk can need).

    source: int32[U, M, R, P], each packed slot's index into its chunk's padded [B, T]
        arrays flattened ([B·T]), B·T (a padding slot past the end) off the sequences;
    segment_ids: int32[U, M, R, P], the sequence's row in its chunk + 1, 0 on padding;
    positions: int32[U, M, R, P], the token's position within its sequence (0 on padding);
    unpack: int32[U, B, T], each padded position's index into its chunk's packed outputs
        flattened ([M·R·P]), M·R·P (a padding slot) past its sequence's length;
    used: int32[U], the packed micro-batches of each chunk that hold tokens (the rest are
        all padding and are skipped).
    """

    source: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    unpack: np.ndarray
    used: np.ndarray

    @property
    def padded_tokens(self) -> int:
        """Token slots of the padded layout: U·B·T."""
        return int(np.prod(self.unpack.shape))

    @property
    def packed_tokens(self) -> int:
        """Token slots of the packed micro-batches that run: Σ used · R · P."""
        return int(self.used.sum()) * int(np.prod(self.source.shape[2:]))

    @property
    def sequence_tokens(self) -> int:
        """Tokens of the sequences themselves."""
        return int((self.segment_ids > 0).sum())


def packed_layout(
    lengths: Sequence[int], *, chunks: int, micro_size: int, tokens_per_row: int, seq: int
) -> PackedLayout:
    """The `PackedLayout` of a batch of rows with `lengths` (`sequence_lengths`; in batch
    order, `chunks` consecutive chunks of equal size), each chunk packed by `first_fit` into
    rows of `tokens_per_row` tokens, `micro_size` rows per packed micro-batch. A function of
    the lengths alone. PackingError when a sequence is longer than a row."""
    lengths = np.asarray(lengths, np.int64).reshape(chunks, -1)
    rows = lengths.shape[1]
    if rows % micro_size:
        raise PackingError(f"{rows} rows per chunk are not a multiple of micro_size {micro_size}")
    micro_per_chunk, width = rows // micro_size, tokens_per_row
    flat_padded, flat_packed = rows * seq, rows * width
    source = np.full((chunks, rows, width), flat_padded, np.int32)
    segment_ids = np.zeros((chunks, rows, width), np.int32)
    positions = np.zeros((chunks, rows, width), np.int32)
    unpack = np.full((chunks, rows, seq), flat_packed, np.int32)
    used = np.zeros(chunks, np.int32)
    for u, chunk in enumerate(lengths):
        packing = first_fit(chunk, tokens_per_row)
        for b, row, start, n in packing.spans():
            if n == 0:
                continue
            source[u, row, start : start + n] = b * seq + np.arange(n)
            segment_ids[u, row, start : start + n] = b + 1
            positions[u, row, start : start + n] = np.arange(n)
            unpack[u, b, :n] = row * width + start + np.arange(n)
        if chunk.any():  # first fit opens a row only for a sequence, and never more than B
            used[u] = -(-packing.num_rows // micro_size)
    shape = (chunks, micro_per_chunk, micro_size, width)
    return PackedLayout(
        source.reshape(shape),
        segment_ids.reshape(shape),
        positions.reshape(shape),
        unpack,
        used,
    )
