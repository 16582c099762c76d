"""The shapes batches are padded or packed to, shared by the controller, the trainer and the
simulator (JAX-free).

Every distinct shape of the trainer's batch is one compile of its jitted step (seconds on a
CPU, minutes for a large model on a TPU pod), so the sequence length of a training batch is
rounded up to 64 tokens at least, and above that to one of four lengths per power of two
(80, 96, 112, 128, 160, …): a run compiles at most about 4·log2(max_seq_len / 64) + 1
shapes (25 up to 4096), and pads its longest sequence by less than 25% above 64 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_SEQ_LEN = 64
STEPS_PER_OCTAVE = 4


def padded_seq_len(longest: int, max_seq_len: int) -> int:
    """The sequence length a batch whose longest row has `longest` tokens is padded to
    (at most `max_seq_len`)."""
    if longest < 1:
        raise ValueError(f"a batch's longest row must have at least one token, got {longest}")
    if longest <= MIN_SEQ_LEN:
        return min(max_seq_len, MIN_SEQ_LEN)
    octave = 1 << ((longest - 1).bit_length() - 1)  # largest power of two < longest
    step = octave // STEPS_PER_OCTAVE
    return min(max_seq_len, step * -(-longest // step))


def first_fit(lengths: Sequence[int], tokens_per_row: int) -> tuple[list[int], list[int], int]:
    """Sequences of `lengths` (in batch order, each at most `tokens_per_row`) packed into rows
    of `tokens_per_row` tokens by first fit: each goes into the first row with room left,
    else a new row; a zero-length one takes no room (row 0, offset 0). Returns each one's
    row and offset in it, and the number of rows (at least 1). A function of the lengths
    alone: the trainer's packed batches (rlax_tpu.trainer.packing) and the simulator's
    count of them."""
    used: list[int] = []  # tokens used in each row so far
    rows, offsets = [0] * len(lengths), [0] * len(lengths)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        row = next((r for r, u in enumerate(used) if u + n <= tokens_per_row), len(used))
        if row == len(used):
            used.append(0)
        rows[b], offsets[b] = row, used[row]
        used[row] += n
    return rows, offsets, max(1, len(used))


def shared_prompt_units(prompt: int, lengths: Sequence[int], width: int) -> list[list[int]]:
    """The rows of a group that share their first `prompt` tokens (`lengths`: each row's
    tokens, prompt included, in batch order) split into packing units (indices into
    `lengths`): each unit holds the prompt once and its rows' tokens past it,
    prompt + Σ (n − prompt) <= width, a unit closed when the next row would not fit. The
    trainer's shared-prompt layouts (rlax_tpu.trainer.packing) and the simulator's count
    of them."""
    units: list[list[int]] = []
    used = prompt
    for i, n in enumerate(lengths):
        grow = n - prompt
        if units and units[-1] and used + grow > width:
            units.append([])
            used = prompt
        if not units:
            units.append([])
        units[-1].append(i)
        used += grow
    return units


def shared_unit_size(prompt: int, lengths: Sequence[int]) -> int:
    """Tokens of a unit of rows of `lengths` sharing `prompt` tokens (one row: its own)."""
    if len(lengths) == 1:
        return int(lengths[0])
    return prompt + sum(int(n) - prompt for n in lengths)
