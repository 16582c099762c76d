"""How many sequences an inference worker's KV page pool holds at once, from its config.

Pure arithmetic on `ModelConfig` / `InferenceConfig` (no JAX): `rlax-tpu compile` reports it
next to the compiled programs, and a test holds the shipped configs to it. The pool is sized
as `PagedKVCache.from_config` sizes it (`page_allocator.num_pages_for_budget`).
"""

from __future__ import annotations

import dataclasses
import math

from rlax_tpu.config import Distribution, InferenceConfig, ModelConfig

# Points of the quantile grid the expected lengths are integrated on (midpoint rule).
GRID_POINTS = 4096


@dataclasses.dataclass(frozen=True)
class KvCapacity:
    """One worker's KV page pool and the sequences it holds at once (see `kv_capacity`)."""

    admission: str  # the config's inference.kv_admission
    page_size: int  # tokens a page holds
    bytes_per_token: int  # keys + values of every layer, one token
    usable_pages: int  # the pool, less the padding page
    tokens: int  # usable_pages × page_size
    max_decode_slots: int
    # "reserve": every admitted sequence holds pages for max_prompt_len + max_new_tokens.
    reserved_tokens_per_sequence: int
    concurrent_sequences_reserved: int
    # "on_demand" at the expected lengths: the steady-state mean KV of a live sequence.
    expected_prompt_tokens: float  # E[P]
    expected_response_tokens: float  # E[L]
    mean_live_tokens_per_sequence: float  # E[P] + E[L²] / (2 E[L]) + page_size / 2
    concurrent_sequences_on_demand: int
    limited_by: str  # of the on-demand figure: "kv_pages" or "decode_slots"

    @property
    def concurrent_sequences(self) -> int:
        """The figure of the admission the config uses."""
        if self.admission == "reserve":
            return self.concurrent_sequences_reserved
        return self.concurrent_sequences_on_demand

    @property
    def on_demand_over_reserved(self) -> float | None:
        """concurrent_sequences_on_demand / concurrent_sequences_reserved (None when the
        pool cannot reserve even one worst-case sequence)."""
        if not self.concurrent_sequences_reserved:
            return None
        return self.concurrent_sequences_on_demand / self.concurrent_sequences_reserved

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["concurrent_sequences"] = self.concurrent_sequences
        out["on_demand_over_reserved"] = self.on_demand_over_reserved
        return out


def kv_capacity(model: ModelConfig, inference: InferenceConfig) -> KvCapacity:
    """The KV capacity of one worker of `inference` serving `model`.

    Pool: bytes_per_token = 2 (keys, values) × num_layers × num_kv_heads × head_dim × the
    itemsize of model.dtype; pages = kv_cache_bytes // (bytes_per_token × page_size), of
    which page 0 is padding and never handed out; tokens = (pages − 1) × page_size.

    "reserve" admission reserves a worst-case sequence at admission, so

        reserved = min(max_decode_slots, (pages − 1) // ⌈(max_prompt_len + max_new_tokens)
                                                         / page_size⌉)

    "on_demand" admission holds only the pages a sequence has filled, so the pool holds as
    many sequences as its tokens divided by the mean KV of a live sequence. In steady-state
    continuous batching a sequence of prompt P and response L is live for a time ∝ L (one
    decode step per token) and over that time holds P + L/2 tokens on average, rounded up to
    whole pages (half a page on average). A live sequence picked at random is therefore a
    draw of (P, L) weighted by L (long responses are over-represented among the live ones:
    the inspection paradox), and with P and L independent its mean KV is

        E[L · (P + L/2)] / E[L] + page_size/2 = E[P] + E[L²] / (2 E[L]) + page_size/2

    which exceeds E[P] + E[L]/2 by Var[L] / (2 E[L]): a heavy tail costs more than its mean
    says. Then

        on_demand = min(max_decode_slots, ⌊tokens / (E[P] + E[L²] / (2 E[L]) + page_size/2)⌋)

    P and L follow `inference.length_distributions()` (the config's expected lengths,
    clipped to max_prompt_len / max_new_tokens), in whole tokens (rounded up as
    `Distribution.tokens` draws them). E[·] is exact for fixed and empirical distributions
    and the midpoint rule over GRID_POINTS quantiles for a lognormal: deterministic, no
    sampling. The figure is a steady-state mean: prefill time and the pool's fluctuation
    around it (which on-demand admission absorbs by swapping sequences out) are left out.
    """
    bytes_per_token = int(model.kv_bytes_per_token())
    page_size = inference.page_size
    pages = inference.kv_cache_bytes // (bytes_per_token * page_size)
    usable_pages = max(0, pages - 1)
    tokens = usable_pages * page_size
    slots = inference.max_decode_slots

    worst_pages = -(-(inference.max_prompt_len + inference.max_new_tokens) // page_size)
    reserved = min(slots, usable_pages // worst_pages)

    prompt, response = inference.length_distributions()
    mean_prompt, _ = _token_moments(prompt)
    mean_response, mean_square_response = _token_moments(response)
    live = mean_prompt + mean_square_response / (2 * mean_response) + page_size / 2
    by_pages = math.floor(tokens / live)
    return KvCapacity(
        admission=inference.kv_admission,
        page_size=page_size,
        bytes_per_token=bytes_per_token,
        usable_pages=usable_pages,
        tokens=tokens,
        max_decode_slots=slots,
        reserved_tokens_per_sequence=worst_pages * page_size,
        concurrent_sequences_reserved=reserved,
        expected_prompt_tokens=mean_prompt,
        expected_response_tokens=mean_response,
        mean_live_tokens_per_sequence=live,
        concurrent_sequences_on_demand=min(slots, by_pages),
        limited_by="decode_slots" if slots <= by_pages else "kv_pages",
    )


def _token_moments(d: Distribution) -> tuple[float, float]:
    """(E[X], E[X²]) of d's draws in whole tokens (max(1, ⌈x⌉) of a clipped draw)."""
    # An empirical distribution's quantile at the midpoint of the i-th of len(values) equal
    # slices is its i-th smallest value: that grid weighs every value once, exactly.
    n = {"fixed": 1, "empirical": len(d.values)}.get(d.kind, GRID_POINTS)
    tokens = [max(1, math.ceil(d.quantile((i + 0.5) / n))) for i in range(n)]
    return sum(tokens) / len(tokens), sum(t * t for t in tokens) / len(tokens)
