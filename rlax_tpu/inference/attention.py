"""Attention of new queries over a paged KV pool, with one function per backend.

Pools are laid out [kv_heads, num_pages, page_size, head_dim] (the layout of JAX's Pallas
paged-attention kernels, TPU and GPU). Backends: "jax" gathers each slot's pages into a
contiguous view (any step, any platform; the reference); "pallas_tpu" / "pallas_gpu" run
the Pallas decode kernels for one-token steps, with prefill on the JAX path. On CPU the
kernels run interpreted (tests).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged_attention
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention
from jax.sharding import PartitionSpec

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


class UnsupportedShapeError(ValueError):
    """The cache's shapes do not fit a Pallas kernel's constraints."""


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
    kernel is opt-in with "pallas"). pallas: the platform's kernel (the TPU one, interpreted,
    on CPU); raises UnsupportedShapeError when the shapes don't fit it. platform: what the
    code is compiled for (default `target_platform()`: the active mesh's devices' platform).
    """
    platform = platform or target_platform()
    if name == "jax":
        return "jax"
    if name not in ("auto", "pallas"):
        raise ValueError(f"attention_backend must be 'auto', 'jax' or 'pallas', got {name!r}")
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
    """Causal attention of new queries over their slot's pages, by gathering the pages.

    q: [slots, new, q_heads, head_dim]; k_pages, v_pages: [kv_heads, num_pages, page_size,
    head_dim]; page_table: int32[slots, pages_per_seq]; positions: int32[slots, new].
    Returns [slots, new, q_heads, head_dim]: query at position p sees keys at 0..p.
    """
    keys = gather_pages(k_pages, page_table).astype(q.dtype)
    values = gather_pages(v_pages, page_table).astype(q.dtype)
    mask = jnp.arange(keys.shape[1])[None, None, :] <= positions[:, :, None]
    return grouped_attention(q, keys, values, mask)


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
    backend's decode kernel; steps of several tokens (prefill) take the JAX path.
    """
    if backend == "jax" or q.shape[1] != 1:
        return paged_attention_jax(q, k_pages, v_pages, page_table, positions)
    kernel = {"pallas_tpu": paged_decode_attention_tpu, "pallas_gpu": paged_decode_attention_gpu}
    lengths = jnp.where(valid[:, 0], positions[:, 0] + 1, 0).astype(jnp.int32)
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
