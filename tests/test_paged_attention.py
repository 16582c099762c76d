"""The JAX decode path, an online softmax over chunks of pages: equal to the gather
reference up to rounding, and a row's output bitwise independent of the other rows, of
the page table's width and of how many chunks the loop runs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu.config import MeshConfig
from rlax_tpu.inference.attention import (
    paged_attention,
    paged_attention_jax,
    paged_decode_attention_jax,
)
from rlax_tpu.sharding import build_mesh, use_mesh

KV_HEADS, Q_HEADS, HEAD_DIM, PAGE_SIZE = 2, 4, 8, 4
PAGES_PER_SEQ = 10
DTYPES = [jnp.float32, jnp.bfloat16]
TOLERANCE = {jnp.float32: dict(atol=1e-6, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def decode_case(seed, lengths, dtype, pages_per_seq=PAGES_PER_SEQ):
    """q: [rows, Q_HEADS, HEAD_DIM]; pools with every row's pages scattered in shuffled order
    (pages past a row's length hold other data, as stale pages do)."""
    rng = np.random.default_rng(seed)
    rows = len(lengths)
    num_pages = rows * pages_per_seq + 1
    shape = (KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    table = rng.permutation(np.arange(1, num_pages)).reshape(rows, pages_per_seq)
    q = jnp.asarray(rng.standard_normal((rows, Q_HEADS, HEAD_DIM)), dtype)
    return q, k_pages, v_pages, jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32)


@functools.partial(jax.jit, static_argnames="chunk_pages")
def decode(q, k_pages, v_pages, table, lengths, chunk_pages=2):
    return paged_decode_attention_jax(q, k_pages, v_pages, table, lengths, chunk_pages=chunk_pages)


@jax.jit
def gather_reference(q, k_pages, v_pages, table, lengths):
    positions = (lengths - 1)[:, None]
    return paged_attention_jax(q[:, None], k_pages, v_pages, table, positions)[:, 0]


def rows_of(case, index):
    """The case restricted to rows `index` (same pools)."""
    q, k_pages, v_pages, table, lengths = case
    return q[index], k_pages, v_pages, table[index], lengths[index]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_row_is_bitwise_the_same_alone_and_among_neighbours_of_other_lengths(dtype):
    # Chunks of 2 pages (8 keys): row 0 needs one chunk, its neighbours up to five.
    case = decode_case(0, [5, 37, 1, 22, 40], dtype)
    together = np.asarray(decode(*case))
    alone = np.asarray(decode(*rows_of(case, np.array([0]))))
    reordered = np.asarray(decode(*rows_of(case, np.array([3, 2, 0, 4]))))
    np.testing.assert_array_equal(alone[0], together[0])
    np.testing.assert_array_equal(reordered[2], together[0])
    np.testing.assert_array_equal(reordered[0], together[3])


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_row_is_bitwise_the_same_for_any_page_table_width(dtype):
    q, k_pages, v_pages, table, lengths = decode_case(1, [9, 3], dtype)
    want = np.asarray(decode(q, k_pages, v_pages, table, lengths, chunk_pages=3))
    # Row 0 holds 3 pages: tables of 3, 4, 10 (padded to 12) and 17 columns.
    for width in (3, 4, 17):
        wide = jnp.zeros((2, width), jnp.int32).at[:, :3].set(table[:, :3])
        got = np.asarray(decode(q, k_pages, v_pages, wide, lengths, chunk_pages=3))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_idle_chunks_leave_a_row_bitwise_unchanged(dtype):
    """A row whose keys fit the first chunk, under a loop of one trip and of ten (driven by
    a long neighbour): the nine chunks past its length are exact no-ops."""
    case = decode_case(2, [3, 40], dtype)
    many = np.asarray(decode(*case, chunk_pages=1))
    one = np.asarray(decode(*rows_of(case, np.array([0])), chunk_pages=1))
    np.testing.assert_array_equal(one[0], many[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("chunk_pages", [1, 3, 10, None])
def test_decode_matches_the_gather_reference(dtype, chunk_pages):
    # One key, a full page, one past it, a chunk boundary, the whole table.
    case = decode_case(3, [1, 4, 5, 12, 40], dtype)
    got = np.asarray(decode(*case, chunk_pages=chunk_pages), np.float32)
    want = np.asarray(gather_reference(*case), np.float32)
    np.testing.assert_allclose(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("chunk_pages", [10, None])  # the whole table in one chunk
def test_a_bfloat16_row_within_one_chunk_rounds_as_the_trainers_attention(chunk_pages):
    """The gather reference is the trainer's attention (grouped_attention): a row whose keys
    fit one chunk normalises its probabilities before their cast to bfloat16 as it does,
    so nearly every bf16 output is bitwise the same (all of them on the 2-core Intel host;
    65 % when the chunk cast its unnormalised probabilities, which moved a served bf16
    log-prob by ~1e-3 from the trainer's recompute: tests/test_publish_dtype.py). Not all
    need be: the programs sum over different lengths, which a CPU may round differently in
    float32 before the cast."""
    case = decode_case(3, [1, 4, 5, 12, 40], jnp.bfloat16)
    got = np.asarray(decode(*case, chunk_pages=chunk_pages), np.float32)
    want = np.asarray(gather_reference(*case), np.float32)
    assert (got == want).mean() >= 0.9, (got == want).mean()


def test_empty_rows_output_zeros():
    case = decode_case(4, [0, 7, 0], jnp.float32)
    out = np.asarray(decode(*case))
    assert not out[[0, 2]].any() and np.isfinite(out).all()
    # No row has keys: the loop runs no chunk.
    none = np.asarray(decode(*decode_case(4, [0, 0], jnp.float32)))
    assert not none.any()


def test_one_token_steps_take_the_chunked_path():
    """paged_attention with one new token per row: the chunked decode, padding rows zero."""
    q, k_pages, v_pages, table, lengths = decode_case(5, [6, 30, 2], jnp.float32)
    valid = jnp.asarray([[True], [True], [False]])
    out = jax.jit(paged_attention, static_argnames="backend")(
        q[:, None], k_pages, v_pages, table, (lengths - 1)[:, None], valid, backend="jax"
    )[:, 0]
    want = paged_decode_attention_jax(q, k_pages, v_pages, table, jnp.asarray([6, 30, 0]))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert not np.asarray(out)[2].any()


@pytest.mark.parametrize("data, tensor", [(1, 2), (2, 2)])
def test_decode_under_a_mesh_matches_one_device(data, tensor):
    """Pools split over kv heads (tensor), rows over data: the gathered chunks stay split."""
    case = decode_case(6, [5, 37, 1, 22], jnp.float32)
    want = np.asarray(decode(*case))
    config = MeshConfig(data=data, fsdp=1, tensor=tensor)
    mesh = build_mesh(config, jax.devices()[: data * tensor])
    with use_mesh(mesh, config.logical_axis_rules):
        q, k_pages, v_pages, table, lengths = case
        pool = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tensor"))
        k_pages, v_pages = jax.device_put(k_pages, pool), jax.device_put(v_pages, pool)
        args = (q, k_pages, v_pages, table, lengths)
        hlo = decode.lower(*args).compile().as_text()
        got = np.asarray(decode(*args))
    # Each device reads its own kv heads' pages: the pools are never gathered whole.
    assert "all-gather" not in hlo
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
