"""The shapes batches are padded to, shared by the controller and the simulator (JAX-free).

Every distinct shape of the trainer's batch is one compile of its jitted step (seconds on a
CPU, minutes for a large model on a TPU pod), so the sequence length of a training batch is
rounded up to 64 tokens at least, and above that to one of four lengths per power of two
(80, 96, 112, 128, 160, …): a run compiles at most about 4·log2(max_seq_len / 64) + 1
shapes (25 up to 4096), and pads its longest sequence by less than 25% above 64 tokens.
"""

from __future__ import annotations

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
