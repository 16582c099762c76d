"""Attention of new queries over a paged KV pool, with one function per backend.

Pools are laid out [kv_heads, num_pages, page_size, head_dim] (the layout of JAX's Pallas
paged-attention kernels, TPU and GPU). Decode steps (one token per row) run on "jax", an
online softmax over chunks of the pages each row has, or on "pallas_tpu" / "pallas_gpu",
the Pallas decode kernels. A prefill of fresh sequences attends its own keys (splash
attention with "pallas_tpu", else the float32 reference); other multi-token steps gather
each row's pages (`paged_attention_jax`, also the reference of the other paths). The
kernels need a TPU or GPU; tests run them interpreted on CPU under `interpret_kernels()`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged_attention
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention
from jax.sharding import PartitionSpec

from rlax_tpu.models.attention import reference_attention, splash_attention
from rlax_tpu.models.kv_cache import MASK_VALUE, grouped_attention
from rlax_tpu.sharding import active_mesh, constrain, logical_spec, target_platform

Backend = Literal["jax", "pallas_tpu", "pallas_gpu"]

# Mosaic tiles the minor two dims of a VMEM buffer by (sublanes, 128 lanes); the kernel
# DMAs whole [page_size, head_dim] pages into such buffers.
TPU_LANES = 128
# Keys per kernel block: the TPU kernel double-buffers blocks of this many keys in VMEM.
TPU_KEYS_PER_BLOCK = 512
# Triton's tl.dot needs every matmul dim to be a multiple of 16.
GPU_MIN_DIM = 16
# Keys per chunk of the JAX decode path: each loop step gathers this many keys per row.
DECODE_CHUNK_KEYS = 512

# Whether "pallas" may resolve on CPU, running the kernels interpreted (`interpret_kernels`).
_interpret = False


class UnsupportedShapeError(ValueError):
    """A Pallas kernel cannot take the cache's shapes, or cannot run on the platform."""


@contextlib.contextmanager
def interpret_kernels() -> Iterator[None]:
    """Let attention_backend="pallas" resolve on CPU to the TPU kernel, run interpreted
    (tests only: interpreted kernels are orders of magnitude slower than the JAX path)."""
    global _interpret
    previous, _interpret = _interpret, True
    try:
        yield
    finally:
        _interpret = previous


def tpu_kernel_problem(*, head_dim: int, page_size: int, dtype: jnp.dtype) -> str | None:
    """Why the TPU decode kernel cannot take these shapes, or None if it can."""
    sublanes = 8 * (4 // jnp.dtype(dtype).itemsize)  # 8 for float32, 16 for bfloat16
    if head_dim % TPU_LANES:
        return f"head_dim ({head_dim}) must be a multiple of {TPU_LANES}"
    if page_size % sublanes:
        return f"page_size ({page_size}) must be a multiple of {sublanes} for {dtype}"
    return None


def gpu_kernel_problem(*, head_dim: int, page_size: int) -> str | None:
    """Why the GPU decode kernel cannot take these shapes, or None if it can."""
    if head_dim % GPU_MIN_DIM or page_size % GPU_MIN_DIM:
        return f"head_dim ({head_dim}) and page_size ({page_size}) must be multiples of 16"
    return None


def resolve_backend(
    name: str, *, head_dim: int, page_size: int, dtype: jnp.dtype, platform: str | None = None
) -> Backend:
    """Map the config's attention_backend ("auto" | "jax" | "pallas") to a backend.

    auto: the TPU kernel on TPU for bfloat16 pools whose shapes fit it, else "jax" (the
    kernel reads pages as bfloat16, which would silently round a float32 cache; the GPU
    kernel is opt-in with "pallas"). pallas: the platform's kernel; raises
    UnsupportedShapeError when the shapes don't fit it, or on CPU (outside
    `interpret_kernels()`, where it is the TPU kernel, interpreted). platform: what the code
    is compiled for (default `target_platform()`: the active mesh's devices' platform).
    """
    platform = platform or target_platform()
    if name == "jax":
        return "jax"
    if name not in ("auto", "pallas"):
        raise ValueError(f"attention_backend must be 'auto', 'jax' or 'pallas', got {name!r}")
    if name == "pallas" and platform == "cpu" and not _interpret:
        raise UnsupportedShapeError(
            "attention_backend='pallas': the Pallas paged-attention kernels need a TPU or GPU; "
            "use attention_backend='jax' (or 'auto') on CPU"
        )
    if name == "auto" and (platform != "tpu" or jnp.dtype(dtype) != jnp.bfloat16):
        return "jax"
    if platform == "gpu":
        backend, problem = "pallas_gpu", gpu_kernel_problem(head_dim=head_dim, page_size=page_size)
    else:
        backend = "pallas_tpu"
        problem = tpu_kernel_problem(head_dim=head_dim, page_size=page_size, dtype=dtype)
    if problem is None:
        return backend
    if name == "auto":
        return "jax"
    raise UnsupportedShapeError(
        f"attention_backend='pallas' ({backend}): {problem}; use attention_backend='jax' "
        "or 'auto' (which falls back to the JAX path)"
    )


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """Each slot's pages as one contiguous sequence.

    pages: [kv_heads, num_pages, page_size, head_dim]; page_table: int32[slots, pages_per_seq].
    Returns [slots, pages_per_seq * page_size, kv_heads, head_dim]; key index = position.
    """
    kv_heads, _, page_size, head_dim = pages.shape
    slots, pages_per_seq = page_table.shape
    gathered = pages[:, page_table]  # [kv_heads, slots, pages_per_seq, page_size, head_dim]
    gathered = gathered.reshape(kv_heads, slots, pages_per_seq * page_size, head_dim)
    gathered = gathered.transpose(1, 2, 0, 3)
    return constrain(gathered, ("batch", "length", "act_kv_heads", "head_dim"))


def paged_attention_jax(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """Causal attention of new queries over their slot's pages, by gathering every page of
    the row (multi-token steps over a cached prefix; the reference of the other paths).

    q: [slots, new, q_heads, head_dim]; k_pages, v_pages: [kv_heads, num_pages, page_size,
    head_dim]; page_table: int32[slots, pages_per_seq]; positions: int32[slots, new].
    Returns [slots, new, q_heads, head_dim]: query at position p sees keys at 0..p.
    """
    keys = gather_pages(k_pages, page_table).astype(q.dtype)
    values = gather_pages(v_pages, page_table).astype(q.dtype)
    mask = jnp.arange(keys.shape[1])[None, None, :] <= positions[:, :, None]
    return grouped_attention(q, keys, values, mask)


def paged_decode_attention_jax(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    chunk_pages: int | None = None,
) -> jax.Array:
    """One query token per row by an online softmax over chunks of pages (flash decoding):
    a loop reads only the chunks holding some row's keys, not the whole page table.

    q: [rows, q_heads, head_dim]; k_pages, v_pages: [kv_heads, num_pages, page_size,
    head_dim]; page_table: int32[rows, pages_per_seq]; lengths: int32[rows], keys
    0..length-1 are attended (0: the row outputs zeros). Returns [rows, q_heads, head_dim]
    in q's dtype. chunk_pages: pages per chunk (default: DECODE_CHUNK_KEYS keys' worth).
    Scores, softmax and the accumulator are float32; each chunk's probabilities are
    normalised before the cast to the values' dtype, so a row within one chunk rounds as
    the trainer's attention does. A row's output is bitwise independent of the other rows
    and of the table's width: chunks past its length change nothing.
    """
    kv_heads, _, page_size, head_dim = k_pages.shape
    rows, q_heads, _ = q.shape
    chunk = chunk_pages or max(1, DECODE_CHUNK_KEYS // page_size)
    chunk_keys = chunk * page_size
    width = page_table.shape[1]
    num_chunks = -(-width // chunk)
    # Whole chunks: padding columns point at page 0 and lie past every length.
    table = jnp.pad(page_table, ((0, 0), (0, num_chunks * chunk - width)))
    lengths = jnp.minimum(lengths, width * page_size)
    trips = (jnp.max(lengths) + chunk_keys - 1) // chunk_keys
    qg = q.reshape(rows, kv_heads, q_heads // kv_heads, head_dim)

    def gather(pages: jax.Array, columns: jax.Array) -> jax.Array:
        gathered = pages[:, columns].reshape(kv_heads, rows, chunk_keys, head_dim)
        return constrain(gathered.astype(q.dtype), ("act_kv_heads", "batch", None, "head_dim"))

    def step(i, carry):
        top, total, out = carry  # [rows, kv_heads, group] (x head_dim for out), float32
        columns = jax.lax.dynamic_slice_in_dim(table, i * chunk, chunk, axis=1)
        keys, values = gather(k_pages, columns), gather(v_pages, columns)
        scores = jnp.einsum("rkgd,krsd->rkgs", qg, keys, preferred_element_type=jnp.float32)
        scores = scores * (head_dim**-0.5)
        seen = (i * chunk_keys + jnp.arange(chunk_keys) < lengths[:, None])[:, None, None]
        scores = jnp.where(seen, scores, MASK_VALUE)
        # The chunk's own softmax, normalised before it is cast to the values' dtype, as
        # the trainer's attention (grouped_attention) rounds its probabilities: a row within
        # one chunk gets the trainer's rounding also in bfloat16 (an unnormalised cast
        # differed from it by ~1e-3 in a bf16 log-prob).
        chunk_top = scores.max(axis=-1)
        probs = jnp.where(seen, jnp.exp(scores - chunk_top[..., None]), 0.0)
        chunk_total = probs.sum(axis=-1)
        weights = probs / jnp.where(chunk_total > 0, chunk_total, 1.0)[..., None]
        chunk_out = jnp.einsum(
            "rkgs,krsd->rkgd",
            weights.astype(values.dtype),
            values,
            preferred_element_type=jnp.float32,
        )
        # Chunks combine by their share of the row's softmax mass. The state is left
        # bitwise as it was by a chunk past the row's length (no mass), and a row's first
        # chunk is taken as it is (no mass before it), by `where`, not by rounding: the
        # state starts at top = -inf and total = 0.
        new_top = jnp.maximum(top, chunk_top)
        old_mass = total * jnp.where(top == new_top, 1.0, jnp.exp(top - new_top))
        new_mass = chunk_total * jnp.where(chunk_top == new_top, 1.0, jnp.exp(chunk_top - new_top))
        new_total = old_mass + new_mass
        mixed = (old_mass[..., None] * out + new_mass[..., None] * chunk_out) / jnp.where(
            new_total > 0, new_total, 1.0
        )[..., None]
        out = jnp.where(
            (new_mass == 0)[..., None],
            out,
            jnp.where((old_mass == 0)[..., None], chunk_out, mixed),
        )
        top = jnp.where(new_mass == 0, top, new_top)
        total = jnp.where(new_mass == 0, total, new_total)
        return top, total, out

    state = qg.shape[:3]
    init = (
        jnp.full(state, -jnp.inf, jnp.float32),
        jnp.zeros(state, jnp.float32),
        jnp.zeros(qg.shape, jnp.float32),
    )
    _, _, out = jax.lax.fori_loop(0, trips, step, init)
    return out.reshape(q.shape).astype(q.dtype)


def fresh_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, *, backend: Backend
) -> jax.Array:
    """Causal attention of fresh sequences' new tokens over themselves (no cached prefix):
    what `paged_attention_jax` computes for them, without reading pages. The training
    forward's attention with the valid tokens as one segment per row.

    q: [rows, new, q_heads, head_dim]; k, v: [rows, new, kv_heads, head_dim]; valid:
    bool[rows, new], the row's tokens at positions 0..n-1 then padding (never seen). Splash
    attention with "pallas_tpu", else float32 reference attention.
    """
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    attend = splash_attention if backend == "pallas_tpu" else reference_attention
    return attend(q, k, v, valid.astype(jnp.int32))


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, max(limit, 1)) + 1) if n % d == 0)


def paged_decode_attention_tpu(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, lengths: jax.Array
) -> jax.Array:
    """One query token per slot through the Pallas TPU paged-attention kernel.

    q: [slots, q_heads, head_dim]; lengths: int32[slots], keys 0..length-1 are attended
    (0 = empty slot, output zeros). Returns [slots, q_heads, head_dim] in q's dtype. The
    kernel computes q·k in float32 from bfloat16 keys/values (it casts pages to bfloat16).
    """
    kv_heads, _, page_size, head_dim = k_pages.shape
    problem = tpu_kernel_problem(head_dim=head_dim, page_size=page_size, dtype=k_pages.dtype)
    if problem is not None:
        raise UnsupportedShapeError(f"TPU paged-attention kernel: {problem}")
    pages_per_seq = page_table.shape[1]
    block = _largest_divisor_at_most(pages_per_seq, TPU_KEYS_PER_BLOCK // page_size)
    # The kernel does not scale scores; scale the float32 query once instead.
    scaled = q.astype(jnp.float32) * head_dim**-0.5
    call = functools.partial(
        tpu_paged_attention,
        scaled,
        k_pages,
        v_pages,
        lengths,
        page_table,
        mask_value=MASK_VALUE,
        pages_per_compute_block=block,
    )
    # Interpreted only when compiling for the CPU: for a mesh of abstract TPU devices (rlax-tpu
    # compile on a CPU host) the real kernel is compiled.
    if target_platform() == "cpu":
        with pltpu.force_tpu_interpret_mode():
            out = call()
    else:
        out = call()
    return out.astype(q.dtype)


def paged_decode_attention_gpu(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, lengths: jax.Array
) -> jax.Array:
    """One query token per slot through the Pallas GPU (Triton) paged-attention kernel.

    Shapes as `paged_decode_attention_tpu`. Splits each sequence into up to 8 partitions
    (flash-decoding) combined outside the kernel.
    """
    _, _, page_size, head_dim = k_pages.shape
    problem = gpu_kernel_problem(head_dim=head_dim, page_size=page_size)
    if problem is not None:
        raise UnsupportedShapeError(f"GPU paged-attention kernel: {problem}")
    pages_per_seq = page_table.shape[1]
    k_splits = _largest_divisor_at_most(pages_per_seq, 8)
    block = _largest_divisor_at_most(pages_per_seq // k_splits, 64 // page_size)
    scaled = (q.astype(jnp.float32) * head_dim**-0.5).astype(k_pages.dtype)
    out = gpu_paged_attention.paged_attention(
        scaled,
        k_pages,
        v_pages,
        page_table,
        lengths,
        k_splits=k_splits,
        pages_per_compute_block=block,
        mask_value=MASK_VALUE,
        interpret=target_platform() == "cpu",
    )
    return out.astype(q.dtype)


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    *,
    backend: Backend,
) -> jax.Array:
    """Causal attention of new tokens over the pool through `backend`.

    Shapes as `paged_attention_jax`; valid: bool[slots, new]. One-token steps go to the
    backend's decode path (padding rows output zeros); steps of several tokens gather pages.
    """
    if q.shape[1] != 1:
        return paged_attention_jax(q, k_pages, v_pages, page_table, positions)
    lengths = jnp.where(valid[:, 0], positions[:, 0] + 1, 0).astype(jnp.int32)
    if backend == "jax":
        out = paged_decode_attention_jax(q[:, 0], k_pages, v_pages, page_table, lengths)
    else:
        kernel = {
            "pallas_tpu": paged_decode_attention_tpu,
            "pallas_gpu": paged_decode_attention_gpu,
        }
        out = _per_device(kernel[backend])(q[:, 0], k_pages, v_pages, page_table, lengths)
    return out[:, None]


def _per_device(kernel):
    """`kernel` (q, k_pages, v_pages, page_table, lengths) on each device's own kv heads
    under the active mesh: XLA cannot partition a Pallas kernel itself. The query heads are
    split over the same mesh axes as the pool's kv heads, so each device keeps whole
    groups; a pool whose kv heads are replicated runs the kernel whole on every device."""
    mesh = active_mesh()
    if mesh is None:
        return kernel

    def call(q, k_pages, v_pages, page_table, lengths):
        pool = logical_spec(("act_kv_heads", None, None, "head_dim"), k_pages.shape)
        heads = PartitionSpec(None, pool[0], None)
        rows = PartitionSpec()
        return jax.shard_map(
            kernel,
            mesh=mesh,
            in_specs=(heads, pool, pool, rows, rows),
            out_specs=heads,
            check_vma=False,
        )(q, k_pages, v_pages, page_table, lengths)

    return call
