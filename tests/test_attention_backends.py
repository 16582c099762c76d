"""The attention backends: the Pallas TPU decode kernel (interpreted on CPU) and the Pallas
GPU decode kernel (interpreted) agree with the pure-JAX gather reference; backend choice,
and "pallas" on CPU only under `interpret_kernels()`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu.inference.attention import (
    UnsupportedShapeError,
    gather_pages,
    interpret_kernels,
    paged_attention,
    paged_attention_jax,
    paged_decode_attention_gpu,
    paged_decode_attention_tpu,
    resolve_backend,
)
from rlax_tpu.inference.paged_cache import PagedKVCache

# bf16 keeps 8 bits of mantissa; the TPU kernel reads pages as bf16 whatever their dtype.
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def random_pool(rng, kv_heads, num_pages, page_size, head_dim, dtype):
    shape = (kv_heads, num_pages, page_size, head_dim)
    return (
        jnp.asarray(rng.standard_normal(shape), dtype),
        jnp.asarray(rng.standard_normal(shape), dtype),
    )


def decode_case(seed, *, kv_heads, q_heads, head_dim, page_size, lengths, pages_per_seq):
    """Pools with pages scattered in shuffled order, one query per slot."""
    rng = np.random.default_rng(seed)
    slots = len(lengths)
    num_pages = slots * pages_per_seq + 3
    k_pages, v_pages = random_pool(rng, kv_heads, num_pages, page_size, head_dim, jnp.bfloat16)
    table = rng.permutation(np.arange(1, num_pages))[: slots * pages_per_seq]
    table = jnp.asarray(table.reshape(slots, pages_per_seq), jnp.int32)
    q = jnp.asarray(rng.standard_normal((slots, q_heads, head_dim)), jnp.float32)
    return q, k_pages, v_pages, table, jnp.asarray(lengths, jnp.int32)


def jax_reference(q, k_pages, v_pages, table, lengths):
    """The JAX path for one query at position length - 1: [slots, q_heads, head_dim]."""
    positions = (lengths - 1)[:, None]
    return paged_attention_jax(q[:, None], k_pages, v_pages, table, positions)[:, 0]


# Lengths: one token, a full page, one past it, several pages, an empty slot.
@pytest.mark.parametrize("kv_heads, q_heads", [(2, 4), (1, 8)])
def test_tpu_decode_kernel_matches_jax_reference(kv_heads, q_heads):
    lengths = [1, 16, 17, 45, 0]
    case = decode_case(
        0,
        kv_heads=kv_heads,
        q_heads=q_heads,
        head_dim=128,
        page_size=16,
        lengths=lengths,
        pages_per_seq=3,
    )
    out = paged_decode_attention_tpu(*case)
    want = jax_reference(*case)
    live = np.asarray(lengths) > 0
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(want)[live], **BF16_TOL)


def test_gpu_decode_kernel_matches_jax_reference():
    lengths = [1, 16, 17, 45, 0]
    case = decode_case(
        1, kv_heads=2, q_heads=4, head_dim=16, page_size=16, lengths=lengths, pages_per_seq=4
    )
    out = paged_decode_attention_gpu(*case)
    want = jax_reference(*case)
    live = np.asarray(lengths) > 0
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(want)[live], **BF16_TOL)


@pytest.mark.parametrize("fresh_prefill", [False, True], ids=["paged", "fresh"])
def test_pallas_cache_decode_steps_match_jax_cache(fresh_prefill):
    """Prefill (by reading pages: the JAX path in both; fresh: splash against the reference)
    then decode steps through the TPU kernel, bf16 pools."""
    rng = np.random.default_rng(2)
    slots, kv_heads, q_heads, head_dim, page_size, pages_per_seq = 3, 2, 4, 128, 16, 3
    kwargs = dict(
        num_layers=1,
        num_pages=slots * pages_per_seq + 1,
        page_size=page_size,
        kv_heads=kv_heads,
        head_dim=head_dim,
        batch_slots=slots,
        pages_per_seq=pages_per_seq,
        dtype=jnp.bfloat16,
    )
    with interpret_kernels():
        caches = [
            PagedKVCache.create(**kwargs, attention_backend=backend)
            for backend in ("jax", "pallas")
        ]
    assert [c.backend for c in caches] == ["jax", "pallas_tpu"]
    table = rng.permutation(np.arange(1, slots * pages_per_seq + 1)).reshape(slots, -1)
    table = table.astype(np.int32)

    def qkv(new):
        return [
            jnp.asarray(rng.standard_normal((slots, new, h, head_dim)), jnp.bfloat16)
            for h in (q_heads, kv_heads, kv_heads)
        ]

    lengths = np.array([3, 16, 0])
    positions = np.broadcast_to(np.arange(16, dtype=np.int32), (slots, 16))
    steps = [(positions, positions < lengths[:, None])]
    for i in range(3):
        active = np.array([True, i != 1, i > 0])  # slot 1 idles once, slot 2 starts late
        steps.append((lengths[:, None].astype(np.int32), active[:, None]))
        lengths = lengths + active
    attend = jax.jit(lambda cache, *args: cache.attend(0, *args))
    for i, (positions, valid) in enumerate(steps):
        first = fresh_prefill and i == 0
        caches = [c.for_prefill(table) if first else c.with_page_table(table) for c in caches]
        args = (*qkv(positions.shape[1]), positions, valid)
        (want, caches[0]), (out, caches[1]) = [attend(c, *args) for c in caches]
        mask = valid[:, :, None, None]
        np.testing.assert_allclose(
            np.where(mask, np.asarray(out, np.float32), 0),
            np.where(mask, np.asarray(want, np.float32), 0),
            **BF16_TOL,
        )


def test_gather_pages_puts_position_p_at_index_p():
    rng = np.random.default_rng(3)
    k_pages, _ = random_pool(rng, 2, 6, 4, 8, jnp.float32)
    table = jnp.asarray([[3, 1], [5, 0]], jnp.int32)
    gathered = np.asarray(gather_pages(k_pages, table))  # [slots, 8, kv_heads, head_dim]
    np.testing.assert_array_equal(gathered[0, 6], np.asarray(k_pages)[:, 1, 2])
    np.testing.assert_array_equal(gathered[1, 3], np.asarray(k_pages)[:, 5, 3])


@pytest.mark.parametrize(
    "name, platform, head_dim, dtype, expected",
    [
        ("auto", "cpu", 128, "bfloat16", "jax"),
        ("auto", "gpu", 128, "bfloat16", "jax"),  # the GPU kernel is opt-in
        ("auto", "tpu", 128, "bfloat16", "pallas_tpu"),
        ("auto", "tpu", 64, "bfloat16", "jax"),  # shapes the kernel can't take fall back
        ("auto", "tpu", 128, "float32", "jax"),  # the kernel would round pages to bf16
        ("jax", "tpu", 128, "bfloat16", "jax"),
        ("pallas", "tpu", 128, "float32", "pallas_tpu"),
        ("pallas", "gpu", 64, "bfloat16", "pallas_gpu"),
    ],
)
def test_resolve_backend(name, platform, head_dim, dtype, expected):
    got = resolve_backend(name, head_dim=head_dim, page_size=16, dtype=dtype, platform=platform)
    assert got == expected


def test_pallas_on_cpu_is_an_error_naming_the_jax_backend():
    with pytest.raises(UnsupportedShapeError, match="TPU or GPU.*attention_backend='jax'"):
        resolve_backend("pallas", head_dim=128, page_size=16, dtype=jnp.bfloat16, platform="cpu")
    with pytest.raises(UnsupportedShapeError, match="attention_backend='jax'"):
        PagedKVCache.create(
            num_layers=1,
            num_pages=4,
            page_size=16,
            kv_heads=2,
            head_dim=128,
            batch_slots=2,
            pages_per_seq=2,
            dtype=jnp.bfloat16,
            attention_backend="pallas",
            platform="cpu",
        )


def test_interpret_kernels_lets_pallas_resolve_on_cpu_while_it_lasts():
    kwargs = dict(head_dim=128, page_size=16, dtype=jnp.bfloat16, platform="cpu")
    with interpret_kernels():
        assert resolve_backend("pallas", **kwargs) == "pallas_tpu"
    with pytest.raises(UnsupportedShapeError):
        resolve_backend("pallas", **kwargs)


def test_explicit_pallas_with_unfit_shapes_is_an_error():
    with pytest.raises(UnsupportedShapeError, match="head_dim"):
        resolve_backend("pallas", head_dim=64, page_size=16, dtype=jnp.bfloat16, platform="tpu")
    with pytest.raises(UnsupportedShapeError, match="page_size"):
        resolve_backend("pallas", head_dim=128, page_size=8, dtype=jnp.bfloat16, platform="tpu")


def test_tpu_decode_kernel_split_over_kv_heads_on_a_mesh_matches_jax_reference():
    """Under a mesh the kernel runs in shard_map, each device on its own kv heads (tensor=2
    splits 2 kv heads); XLA cannot partition a Pallas call itself."""
    from rlax_tpu.config import MeshConfig
    from rlax_tpu.sharding import build_mesh, use_mesh

    lengths = [1, 17, 45, 0]
    case = decode_case(
        1, kv_heads=2, q_heads=4, head_dim=128, page_size=16, lengths=lengths, pages_per_seq=3
    )
    q, k_pages, v_pages, table, lens = case
    positions = jnp.maximum(lens - 1, 0)[:, None]
    mesh_config = MeshConfig(data=1, fsdp=1, tensor=2)
    with use_mesh(build_mesh(mesh_config, jax.devices()[:2]), mesh_config.logical_axis_rules):
        out = jax.jit(paged_attention, static_argnames="backend")(
            q[:, None],
            k_pages,
            v_pages,
            table,
            positions,
            (lens > 0)[:, None],
            backend="pallas_tpu",
        )[:, 0]
    want = jax_reference(*case)
    live = np.asarray(lengths) > 0
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(want)[live], **BF16_TOL)


@pytest.mark.parametrize("tensor", [1, 2], ids=["one_device", "mesh"])
def test_tpu_decode_kernel_takes_a_bucket_of_rows_gathered_from_the_slot_table(tensor):
    """Decode over 3 of 5 slots: the page table is [rows, pages_per_seq], its rows picked
    from the slot table; the kernel agrees with the JAX decode path on those rows."""
    from rlax_tpu.config import MeshConfig
    from rlax_tpu.sharding import build_mesh, use_mesh

    q, k_pages, v_pages, table, lengths = decode_case(
        2,
        kv_heads=2,
        q_heads=4,
        head_dim=128,
        page_size=16,
        lengths=[9, 33, 0, 48, 17],
        pages_per_seq=3,
    )
    rows = jnp.asarray([3, 0, 4])
    args = (q[rows][:, None], k_pages, v_pages, table[rows], (lengths[rows] - 1)[:, None])
    valid = jnp.ones((3, 1), bool)
    attend = jax.jit(paged_attention, static_argnames="backend")
    want = attend(*args, valid, backend="jax")
    mesh_config = MeshConfig(data=1, fsdp=1, tensor=tensor)
    with use_mesh(build_mesh(mesh_config, jax.devices()[:tensor]), mesh_config.logical_axis_rules):
        out = attend(*args, valid, backend="pallas_tpu")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **BF16_TOL)
