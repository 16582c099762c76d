"""KV pages on demand: a pool too small for every request at once swaps sequences out to
host memory and back, and every rollout is bitwise the one a large pool gives; decode calls
are sized to the live sequences without changing any row's numbers."""

import dataclasses

import jax
import numpy as np
import pytest
from test_engine import GREEDY, LLAMA, init_params, prompt

from rlax_tpu.config import InferenceConfig, MeshConfig
from rlax_tpu.inference.attention import interpret_kernels
from rlax_tpu.inference.engine import Engine, GenerationRequest
from rlax_tpu.inference.sampling import SamplingParams
from rlax_tpu.sharding import build_mesh

PAGE = 4
# Keys + values of every layer for one page, float32.
BYTES_PER_PAGE = 2 * LLAMA.num_layers * LLAMA.num_kv_heads * PAGE * LLAMA.head_dim * 4
LARGE = InferenceConfig(
    max_decode_slots=8,
    prefill_batch_size=4,
    page_size=PAGE,
    kv_cache_bytes=200 * BYTES_PER_PAGE,  # every request at its longest, at once
    prefill_buckets=(8, 16),
    max_prompt_len=16,
    max_new_tokens=24,
    temperature=1.0,
    top_p=0.9,
    top_k=20,
)
# 12 usable pages: one longest sequence (16 + 24 tokens = 10 pages) fits alone, eight
# requests together cannot.
SMALL = dataclasses.replace(LARGE, kv_cache_bytes=13 * BYTES_PER_PAGE)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_new_tokens=24)
LENGTHS = [16, 3, 9, 14, 1, 7, 12, 5]


def requests(sampling, lengths=LENGTHS, start=0):
    return [
        GenerationRequest(f"r{i}", f"p{i}", 0, prompt(n, i), sampling)
        for i, n in enumerate(lengths, start=start)
    ]


def engine(inference, config=LLAMA, **kwargs) -> Engine:
    e = Engine(config, inference, seed=3, **kwargs)
    e.load(0, init_params(config))
    return e


def assert_clean(e: Engine) -> None:
    """Nothing in flight, every page back, no host copy left, bookkeeping sound."""
    stats = e.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["swapped"] == 0
    state = e.paging_state()
    assert state.swapped_bytes == 0 and state.problems == ()


@pytest.mark.parametrize("sampling", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_a_small_pool_swaps_and_gives_bitwise_the_large_pools_rollouts(sampling):
    large = engine(LARGE).run(requests(sampling))
    small_engine = engine(SMALL)
    small = small_engine.run(requests(sampling))
    stats = small_engine.stats()
    assert stats["preemptions"] > 0 and stats["swap_in_bytes"] == stats["swap_out_bytes"] > 0
    assert [r.finish_reason for r in small] == ["length"] * len(LENGTHS)
    assert small == large  # tokens, log-probs (float32 bits), versions: all of it
    assert_clean(small_engine)


@pytest.mark.slow  # ~17 s; the float32 swap tests stay in the default suite
def test_swapping_holds_with_several_decode_steps_per_call_and_bfloat16():
    config = dataclasses.replace(LLAMA, dtype="bfloat16", publish_dtype="bfloat16")
    small = dataclasses.replace(SMALL, kv_cache_bytes=13 * BYTES_PER_PAGE // 2)  # bf16 pages
    e = engine(small, config, decode_steps_per_call=3)
    assert e.kv_cache.keys[0].dtype == np.dtype("bfloat16")
    assert {x.dtype for x in e.served_params()} == {np.dtype("bfloat16")}
    got = e.run(requests(SAMPLED))
    assert e.stats()["preemptions"] > 0
    assert got == engine(LARGE, config, decode_steps_per_call=3).run(requests(SAMPLED))
    assert all(isinstance(x, float) for r in got for x in r.logprobs)  # float32 values
    assert_clean(e)


# ~20 s: `-m slow`. The default run swaps on one device (above) and serves on a tensor-
# parallel mesh (tests/test_engine.py); this is the two together.
@pytest.mark.slow
def test_swapping_on_a_tensor_parallel_mesh_gives_the_large_pools_rollouts():
    """Swapped pages leave and return sharded over kv heads, as the pool holds them."""
    mesh = build_mesh(MeshConfig(data=1, fsdp=1, tensor=2), devices=jax.devices()[:2])
    small = engine(SMALL, mesh=mesh)
    assert small.kv_cache.keys[0].sharding.spec[0] is not None  # kv heads split
    got = small.run(requests(SAMPLED))
    assert small.stats()["preemptions"] > 0
    assert got == engine(LARGE, mesh=mesh).run(requests(SAMPLED))
    assert_clean(small)


def test_on_demand_keeps_more_sequences_live_than_reserving_and_matches_it():
    # 24 usable pages: reserving 10 per longest request admits two at a time.
    pool = dataclasses.replace(LARGE, kv_cache_bytes=25 * BYTES_PER_PAGE)
    short = dataclasses.replace(SAMPLED, max_new_tokens=24)
    on_demand, reserve = engine(pool), engine(dataclasses.replace(pool, kv_admission="reserve"))
    a, b = on_demand.run(requests(short)), reserve.run(requests(short))
    assert a == b
    assert reserve.stats()["preemptions"] == 0
    assert on_demand.stats()["mean_live_sequences"] > 1.5 * reserve.stats()["mean_live_sequences"]


def swapping_engine() -> Engine:
    """The small-pool engine with every request submitted, stepped until one is out."""
    e = engine(SMALL)
    for r in requests(GREEDY):
        e.submit(r)
    while not e.paging_state().swapped:
        e.step()
    return e


def test_preempting_takes_the_most_recently_admitted_sequence():
    e = swapping_engine()
    state = e.paging_state()
    # Requests are admitted first in, first out: the admission order is the submission order.
    admitted = {request_id: n for n, request_id in enumerate(state.in_flight)}
    live = [admitted[request_id] for request_id in state.slots if request_id is not None]
    assert all(admitted[request_id] > max(live) for request_id in state.swapped)
    while e.has_work():
        e.step()
    assert_clean(e)


def test_load_aborts_swapped_sequences_and_frees_their_host_copies():
    e = swapping_engine()
    swapped = set(e.paging_state().swapped)
    aborted = e.load(1, init_params(LLAMA, seed=1))
    assert {r.request_id for r in aborted} == {r.request_id for r in requests(GREEDY)}
    assert all(r.tokens for r in aborted if r.request_id in swapped)
    assert not e.has_work()
    assert_clean(e)


def test_decode_calls_are_sized_to_the_live_sequences():
    buckets = dataclasses.replace(LARGE, decode_buckets=(2, 4, 8))
    e = engine(buckets)
    e.run(requests(GREEDY, [5]))
    assert e.stats()["compiled"] == ["decode:2x1", "prefill:4x8"]
    e.run(requests(GREEDY, [5, 6, 7], start=10))
    e.run(requests(GREEDY, LENGTHS, start=20))
    assert {"decode:2x1", "decode:4x1", "decode:8x1"} <= set(e.stats()["compiled"])
    assert e.stats()["mean_live_sequences"] < 8


def test_a_rows_numbers_do_not_depend_on_the_decode_bucket():
    """Automatic buckets (64, 128): alone a request decodes in 64 rows, among 69 others in
    128 rows. Its tokens are the same on every host; its log-probs bitwise the same only
    where XLA:CPU's kernels give a row the same bits at both sizes (the AMD EPYC host of
    docs/inference.md, not the Intel Xeon one: 1 ulp in one log-prob). One decode size
    (`decode_buckets=(max_decode_slots,)`, the documented fallback) is bitwise on any host."""
    wide = dataclasses.replace(
        LARGE,
        max_decode_slots=128,
        prefill_batch_size=8,
        max_new_tokens=6,
        kv_cache_bytes=600 * BYTES_PER_PAGE,
    )
    assert wide.decode_rows == (64, 128)
    sampling = dataclasses.replace(SAMPLED, max_new_tokens=6)
    (alone,) = engine(wide).run(requests(sampling, [11]))
    crowd = engine(wide)
    together = crowd.run(requests(sampling, [11] + [1 + i % 16 for i in range(69)]))
    assert "decode:128x1" in crowd.stats()["compiled"]
    assert together[0].tokens == alone.tokens
    np.testing.assert_allclose(together[0].logprobs, alone.logprobs, rtol=0, atol=1e-6)
    if together[0] != alone:  # a host whose kernels round by row count: the fallback holds
        single = dataclasses.replace(wide, decode_buckets=(128,))
        (alone,) = engine(single).run(requests(sampling, [11]))
        together = engine(single).run(requests(sampling, [11] + [1 + i % 16 for i in range(69)]))
        assert together[0] == alone


@pytest.mark.slow  # ~30 s interpreted; the kernels alone: tests/test_paged_attention.py
def test_whole_generations_through_the_pallas_kernels_match_the_jax_path():
    """attention_backend="pallas" on the engine path, prefill (splash over the prompt) and
    decode (the paged-attention kernel), interpreted on CPU, with a pool small enough to
    swap: the same tokens as the JAX path, log-probs equal up to the kernels' rounding."""
    config = dataclasses.replace(
        LLAMA,
        hidden_size=256,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=128,
        dtype="bfloat16",
        publish_dtype="bfloat16",
    )
    page_bytes = 2 * config.num_kv_heads * 16 * config.head_dim * 2
    inference = dataclasses.replace(
        LARGE,
        page_size=16,
        kv_cache_bytes=6 * page_bytes,  # 5 pages: a 14 + 30 token sequence needs 3
        prefill_buckets=(128,),
        max_prompt_len=32,
        max_new_tokens=30,
    )
    greedy = dataclasses.replace(GREEDY, max_new_tokens=30)
    with interpret_kernels():
        kernels = engine(dataclasses.replace(inference, attention_backend="pallas"), config)
        assert kernels.kv_cache.backend == "pallas_tpu"
        got = kernels.run(requests(greedy, [12, 9, 14]))
    want = engine(dataclasses.replace(inference, attention_backend="jax"), config).run(
        requests(greedy, [12, 9, 14])
    )
    assert kernels.stats()["preemptions"] > 0
    assert [r.tokens for r in got] == [r.tokens for r in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-2)


def group_requests(sampling, lengths=(16, 3, 9, 13), k=4):
    """K samples of each prompt, a GRPO group after another (the controller's order)."""
    return [
        GenerationRequest(f"r{i}.{s}", f"p{i}", s, prompt(n, i), sampling)
        for i, n in enumerate(lengths)
        for s in range(k)
    ]


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("sampling", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_a_group_sharing_its_prompt_pages_generates_bitwise_what_it_does_alone(sampling, rows):
    """A group's samples share one prefill row and the prompt's full pages; under a pool that
    preempts and swaps (shared pages included) every sample's tokens and log-probs are
    bitwise those of prefilling each sample on its own in a pool that never swaps. With
    pages reserved at admission a sharing sample reserves only past the shared pages."""
    alone = dataclasses.replace(LARGE, prefill_batch_size=rows, share_prompt_pages=False)
    small = dataclasses.replace(SMALL, prefill_batch_size=rows)
    e = engine(small)
    got = e.run(group_requests(sampling))
    stats = e.stats()
    assert stats["prefill_shared"] > 0 and stats["pages_shared"] > 0
    assert stats["preemptions"] > 0
    if rows == 4:  # reserving: once is enough
        reserve = dataclasses.replace(LARGE, prefill_batch_size=rows, kv_admission="reserve")
        reserving = engine(reserve)
        assert reserving.run(group_requests(sampling)) == got
        assert reserving.stats()["prefill_shared"] > 0 and reserving.stats()["preemptions"] == 0
        assert_clean(reserving)
    assert stats["prefill_tokens"] < sum(16 + 3 + 9 + 13 for _ in range(4))
    assert got == engine(alone).run(group_requests(sampling))
    assert_clean(e)


def test_shared_pages_are_counted_once_so_a_group_fits_where_it_could_not_alone():
    """Four samples of a 16-token prompt (4 pages): sharing, they hold 4 + 4 pages (each its
    first decode page) and all start in the first step; alone each needs 5 and the pool of
    12 holds two of them."""
    sampling = dataclasses.replace(GREEDY, max_new_tokens=3)
    requests_ = group_requests(sampling, lengths=(16,))
    live = {}
    for share in (True, False):
        e = engine(dataclasses.replace(SMALL, share_prompt_pages=share))
        for r in requests_:
            e.submit(r)
        e.step()
        live[share] = e.stats()["active_slots"]
        state = e.paging_state()
        assert state.problems == ()
        if share:  # the prompt's 4 pages are in every sample's row
            rows = state.page_table[[state.slots.index(r.request_id) for r in requests_]]
            assert (rows[:, :4] == rows[0, :4]).all() and len(set(rows[:, 4])) == 4
        while e.has_work():
            e.step()
        assert_clean(e)
    assert live == {True: 4, False: 2}


@pytest.mark.parametrize("pool", [LARGE, SMALL], ids=["large", "small"])
def test_samples_admitted_after_their_group_come_from_the_prefix_cache_bitwise(pool):
    """Two slots for groups of four: a group's last samples are admitted rounds after its
    prefill and, with a prefix cache, take its pages and logits instead of a prefill; every
    rollout is bitwise the one of prefilling each sample alone. The small pool gives cached
    prompts' pages back to running sequences (and preempts)."""
    two = dict(max_decode_slots=2, prefill_batch_size=1)
    cached = engine(dataclasses.replace(pool, prefix_cache_entries=2, **two))
    got = cached.run(group_requests(SAMPLED))
    stats = cached.stats()
    if pool is LARGE:
        assert stats["prefix_hits"] == 4 * 2 and stats["prefill_tokens"] == 16 + 3 + 9 + 13
    else:
        assert stats["prefix_evictions"] > 0 and stats["preemptions"] > 0
    alone = dataclasses.replace(LARGE, share_prompt_pages=False, **two)
    assert got == engine(alone).run(group_requests(SAMPLED))
    assert cached.paging_state().problems == ()


def test_a_weight_load_empties_the_prefix_cache():
    """Cached prompts hold the keys and values of the weights that computed them: after a
    load the same prompts are prefilled again under the new weights."""
    e = engine(dataclasses.replace(LARGE, prefix_cache_entries=4))
    e.run(group_requests(GREEDY, k=1))
    assert e.stats()["prefix_entries"] == 4
    again = [
        dataclasses.replace(r, request_id=r.request_id + "'") for r in group_requests(GREEDY, k=1)
    ]
    e.run(again)
    assert e.stats()["prefix_hits"] == 4  # the same prompts, the same version: all cached
    e.load(1, init_params(LLAMA, seed=1))
    assert e.stats()["prefix_entries"] == 0
    got = e.run(group_requests(GREEDY, k=1))
    assert e.stats()["prefix_hits"] == 4
    fresh = Engine(LLAMA, LARGE, seed=3)
    fresh.load(1, init_params(LLAMA, seed=1))
    assert got == fresh.run(group_requests(GREEDY, k=1))
    e.load(2, init_params(LLAMA, seed=2))  # gives every cached page back
    assert_clean(e)


def test_rlax_tpu_compile_lowers_the_sample_call_only_with_a_prefix_cache():
    def keys(entries):
        inference = dataclasses.replace(LARGE, prefix_cache_entries=entries)
        return set(Engine(LLAMA, inference, seed=0, allocate=False).lowerings())

    assert "sample@8" in keys(2) and not any(k.startswith("sample") for k in keys(0))
