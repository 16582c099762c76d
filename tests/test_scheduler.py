"""The engine's host scheduler on its own, no device: prefill and decode are stand-ins that
sample token 1, so what is tested is admission, pages and swaps."""

import numpy as np

from rlax_tpu.api.inference import GenerationRequest
from rlax_tpu.config import InferenceConfig
from rlax_tpu.inference.page_allocator import PageAllocator
from rlax_tpu.inference.scheduler import Scheduler

PAGE = 4
CONFIG = InferenceConfig(
    max_decode_slots=4,
    prefill_batch_size=4,
    page_size=PAGE,
    prefill_buckets=(8,),
    max_prompt_len=8,
    max_new_tokens=8,
)


def scheduler(usable_pages: int) -> Scheduler:
    pool = PageAllocator(num_pages=usable_pages + 1, max_seqs=4, pages_per_seq=4, page_size=PAGE)
    return Scheduler(
        CONFIG, pool, seed=0, vocab_size=16, decode_steps_per_call=1, max_stop_tokens=4
    )


def prefill(calls):
    """Every prompt's first token is 1, log-prob 0.0: int32[2, prefill_rows] per call."""
    return [
        np.stack([np.ones(len(args[2]), np.int32), np.zeros(len(args[2]), np.int32)])
        for _, args in calls
    ]


def decode(s: Scheduler) -> None:
    """One decode call of one step: every live row emits token 1."""
    rows = s.arrays.decode_rows(s.decode_rows)
    live = (rows < s.num_slots).astype(np.int32)
    s.decoded(rows, np.stack([live, np.zeros_like(live), live])[:, None, :])


def test_a_short_pool_swaps_out_the_latest_admitted_and_every_request_finishes():
    # 6 usable pages: each request is admitted with 1 page for its 4-token prompt and a
    # page of growth to spare, but at their longest (12 tokens) the three need 9.
    s = scheduler(usable_pages=6)
    swaps = []

    def read_pages(pages):
        swaps.append(pages)
        return np.zeros((len(pages), 8), np.float32)

    for i in range(3):
        s.submit(GenerationRequest(f"r{i}", f"p{i}", 0, (1, 2, 3, 4)), version=0)
    swapped_ever = set()
    while s.busy():
        s.admit(prefill, lambda pages, data: None)
        s.grow(read_pages)
        state = s.paging_state()
        assert state.problems == ()
        live = [request_id for request_id in state.slots if request_id is not None]
        # Admission is FIFO, so the latest admitted is the last submitted among them.
        assert not state.swapped or all(out > max(live) for out in state.swapped)
        swapped_ever.update(state.swapped)
        if s.arrays.active.any():
            decode(s)
    done = s.take_done()
    assert swapped_ever == {"r2"} and s.stats()["preemptions"] == len(swaps) > 0
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
    assert all(r.finish_reason == "length" and r.tokens == (1,) * 8 for r in done)
    assert s.paging_state().swapped_bytes == 0 and s.allocator.free_pages == 6
