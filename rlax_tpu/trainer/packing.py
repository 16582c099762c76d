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
the same way).

Shared prompts (trainer.share_prefixes): the rows of a chunk whose tokens agree up to their
first response target (a GRPO group's samples of one prompt) hold that prompt once. A
*unit* is laid out as the prompt up to its last token, a segment of its own, then each
sample from the prompt's last token on, a segment whose tokens also attend to the prompt's
(`prefix_ids`: the prompt segment's id) with positions continuing the prompt's. Every
padded position still has one packed slot (the prompt's positions that of the shared
prompt), so log-probs read back as padded; the gradient sums over the samples, as it does
over the padded copies. A function of the lengths and the tokens before each row's first
response target. The trainer packs each mini-batch (and the recompute's whole batch) on its
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


def _check_fits(lengths: np.ndarray, tokens_per_row: int) -> None:
    """PackingError naming the first sequence longer than a packed row, and the fix."""
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


def first_fit(lengths: Sequence[int], tokens_per_row: int) -> Packing:
    """Pack sequences of `lengths` (in batch order) into rows of `tokens_per_row` tokens by
    first fit: each goes into the first row with room left, else a new row. Zero-length
    sequences take no room (row 0, offset 0). PackingError names a sequence longer than a
    row."""
    lengths = np.asarray(lengths, np.int64)
    _check_fits(lengths, tokens_per_row)
    rows, offsets, num_rows = shapes.first_fit(lengths.tolist(), tokens_per_row)
    return Packing(
        lengths, np.asarray(rows, np.int64), np.asarray(offsets, np.int64), num_rows, tokens_per_row
    )


def response_starts(mask: np.ndarray) -> np.ndarray:
    """int64[batch]: the first position where `mask` (the loss / response mask, aligned with
    the targets) is nonzero: the prompt's last token, whose target is the first response
    token; 0 for a row without one."""
    on = np.asarray(mask) != 0
    return np.where(on.any(axis=1), np.argmax(on, axis=1), 0).astype(np.int64)


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
        all padding and are skipped);
    prefix_ids: int32[U, M, R, P] with shared prompts, on a sample's slots the segment id
        of the prompt its tokens also attend to (0 elsewhere); None without.

    With shared prompts a prompt segment's id is B + 1 + its unit's index, and `unpack`
    maps every sample's prompt positions to the prompt's one set of slots.
    """

    source: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    unpack: np.ndarray
    used: np.ndarray
    prefix_ids: np.ndarray | None = None

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
        """Tokens of the sequences themselves, as packed (a shared prompt once)."""
        return int((self.segment_ids > 0).sum())

    @property
    def padded_sequence_tokens(self) -> int:
        """Tokens of the sequences in the padded layout (a shared prompt once per sample)."""
        return int((self.unpack < np.prod(self.source.shape[1:])).sum())


def _units(
    lengths: np.ndarray, starts: np.ndarray | None, tokens: np.ndarray | None, width: int
) -> list[tuple[int, list[int]]]:
    """A chunk's packing units, in the order of their first row: (shared prompt tokens, rows).
    Without `tokens` every row is a unit of its own (0, [b]). With them, rows whose tokens
    agree up to and including their first response start (`response_starts`) share a unit
    of f = that start tokens of prompt, as many of them as fit a row of `width` tokens
    beside it (f + Σ (n - f) <= width; the rest open further units with their own copy);
    a unit of one row shares nothing."""
    if tokens is None:
        return [(0, [b]) for b in range(len(lengths))]
    groups: dict[bytes, list[int]] = {}
    keys: list[bytes | None] = []
    for b, n in enumerate(lengths):
        f = int(starts[b])
        key = None if n == 0 or f < 1 else np.asarray(tokens[b, : f + 1]).tobytes()
        keys.append(key)
        if key is not None:
            groups.setdefault(key, []).append(b)
    units: list[tuple[int, list[int]]] = []
    for b, key in enumerate(keys):
        if key is None:
            units.append((0, [b]))
            continue
        members = groups[key]
        if members[0] != b:
            continue  # laid out with the group's first row
        f = int(starts[b])
        for unit in shapes.shared_prompt_units(f, [int(lengths[m]) for m in members], width):
            rows = [members[i] for i in unit]
            units.append((f if len(rows) > 1 else 0, rows))
    return units


def packed_layout(
    lengths: Sequence[int],
    *,
    chunks: int,
    micro_size: int,
    tokens_per_row: int,
    seq: int,
    starts: Sequence[int] | None = None,
    tokens: np.ndarray | None = None,
) -> PackedLayout:
    """The `PackedLayout` of a batch of rows with `lengths` (`sequence_lengths`; in batch
    order, `chunks` consecutive chunks of equal size), each chunk packed by `first_fit` into
    rows of `tokens_per_row` tokens, `micro_size` rows per packed micro-batch. A function of
    the lengths alone. PackingError when a sequence is longer than a row.

    With `tokens` (int[batch, seq]) and `starts` (`response_starts`) the rows of a chunk that
    share a prompt hold it once (the module's "Shared prompts"); the layout then carries
    `prefix_ids`."""
    lengths = np.asarray(lengths, np.int64).reshape(chunks, -1)
    rows = lengths.shape[1]
    if rows % micro_size:
        raise PackingError(f"{rows} rows per chunk are not a multiple of micro_size {micro_size}")
    shared = tokens is not None
    if shared:
        tokens = np.asarray(tokens).reshape(chunks, rows, -1)
        starts = np.asarray(starts, np.int64).reshape(chunks, rows)
    micro_per_chunk, width = rows // micro_size, tokens_per_row
    flat_padded, flat_packed = rows * seq, rows * width
    source = np.full((chunks, rows, width), flat_padded, np.int32)
    segment_ids = np.zeros((chunks, rows, width), np.int32)
    positions = np.zeros((chunks, rows, width), np.int32)
    prefix_ids = np.zeros((chunks, rows, width), np.int32)
    unpack = np.full((chunks, rows, seq), flat_packed, np.int32)
    used = np.zeros(chunks, np.int32)
    for u, chunk in enumerate(lengths):
        _check_fits(chunk, tokens_per_row)
        units = _units(chunk, starts[u] if shared else None, tokens[u] if shared else None, width)
        sizes = [shapes.shared_unit_size(f, [chunk[b] for b in members]) for f, members in units]
        unit_rows, unit_offsets, num_rows = shapes.first_fit(sizes, width)
        for i, ((f, members), row, start) in enumerate(
            zip(units, unit_rows, unit_offsets, strict=True)
        ):
            at = start
            if f:  # the shared prompt, up to its last token: a segment of its own
                prompt_id = rows + 1 + i
                source[u, row, at : at + f] = members[0] * seq + np.arange(f)
                segment_ids[u, row, at : at + f] = prompt_id
                positions[u, row, at : at + f] = np.arange(f)
                at += f
            for b in members:
                n = int(chunk[b])
                if n == 0:
                    continue
                span = np.arange(f, n)
                source[u, row, at : at + n - f] = b * seq + span
                segment_ids[u, row, at : at + n - f] = b + 1
                positions[u, row, at : at + n - f] = span
                unpack[u, b, f:n] = row * width + at + np.arange(n - f)
                if f:
                    prefix_ids[u, row, at : at + n - f] = prompt_id
                    unpack[u, b, :f] = row * width + start + np.arange(f)
                at += n - f
        if chunk.any():  # first fit opens a row only for a unit, and never more than B
            used[u] = -(-num_rows // micro_size)
    shape = (chunks, micro_per_chunk, micro_size, width)
    return PackedLayout(
        source.reshape(shape),
        segment_ids.reshape(shape),
        positions.reshape(shape),
        unpack,
        used,
        prefix_ids.reshape(shape) if shared else None,
    )
