"""Packing a batch's sequences into rows of a token budget (issue 42): no token padded.

A padded batch is [batch, seq]: each sequence its own row, padded to the longest. A packed
batch is [rows, tokens_per_row]: sequences laid end to end, each a *segment* with its own
segment id (its index + 1; 0 is padding) and positions counted from 0 at its start, so the
model's attention stays within a segment (`Transformer.forward_train(segment_ids=...)`) and
RoPE sees the positions it would see padded. `Packing.unpack` puts per-token results back in
the padded layout, where every objective, normalisation and metric reads them as before.

The layout is a deterministic first fit over the sequences in batch order: each goes into
the first row with room for it (a function of the lengths alone, so a resumed step packs
the same way). Host code only (numpy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


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

    @property
    def segment_ids(self) -> np.ndarray:
        """int32[rows, tokens_per_row]: sequence b's tokens hold b + 1, padding 0."""
        out = np.zeros((self.num_rows, self.tokens_per_row), np.int32)
        for b, row, start, n in self.spans():
            out[row, start : start + n] = b + 1
        return out

    @property
    def positions(self) -> np.ndarray:
        """int32[rows, tokens_per_row]: each token's position within its sequence (0 on
        padding)."""
        out = np.zeros((self.num_rows, self.tokens_per_row), np.int32)
        for _, row, start, n in self.spans():
            out[row, start : start + n] = np.arange(n)
        return out

    @property
    def padding_fraction(self) -> float:
        """The share of the packed rows' tokens that are padding."""
        return 1.0 - float(self.lengths.sum()) / (self.num_rows * self.tokens_per_row)

    def pack(self, padded: np.ndarray, fill: int | float = 0) -> np.ndarray:
        """A [batch, seq, ...] array (sequence b in row b's first lengths[b] entries) laid out
        packed: [rows, tokens_per_row, ...], `fill` off the sequences."""
        out = np.full((self.num_rows, self.tokens_per_row, *padded.shape[2:]), fill, padded.dtype)
        for b, row, start, n in self.spans():
            out[row, start : start + n] = padded[b, :n]
        return out

    def unpack(self, packed: np.ndarray, seq: int, fill: int | float = 0) -> np.ndarray:
        """The inverse of `pack`: [rows, tokens_per_row, ...] back to [batch, seq, ...],
        `fill` past each sequence's length."""
        batch = len(self.lengths)
        out = np.full((batch, seq, *packed.shape[2:]), fill, packed.dtype)
        for b, row, start, n in self.spans():
            out[b, :n] = packed[row, start : start + n]
        return out

    def gather_indices(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """(row, column) int32[batch, seq] indices into the packed layout of each padded
        position, for unpacking on the device (`x[rows, cols]`); positions past a sequence's
        length point at padding (row 0's last column when it is padding, else any: the
        caller masks them)."""
        cols = np.arange(seq)[None, :]
        valid = cols < self.lengths[:, None]
        rows = np.where(valid, self.rows[:, None], 0).astype(np.int32)
        columns = np.where(valid, self.offsets[:, None] + cols, 0).astype(np.int32)
        return rows, columns


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
    used: list[int] = []  # tokens used in each row so far
    rows = np.zeros(len(lengths), np.int64)
    offsets = np.zeros(len(lengths), np.int64)
    for b, n in enumerate(lengths.tolist()):
        if n == 0:
            continue
        row = next((r for r, u in enumerate(used) if u + n <= tokens_per_row), len(used))
        if row == len(used):
            used.append(0)
        rows[b], offsets[b] = row, used[row]
        used[row] += n
    return Packing(lengths, rows, offsets, max(1, len(used)), tokens_per_row)
