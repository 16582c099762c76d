"""The paged KV cache: the model's KV-cache seam (rlax_tpu.models.kv_cache) over a pool
of fixed-size pages shared by all decode slots.

Per layer, keys and values live in pools [kv_heads, num_pages, page_size, head_dim] in the
model's compute dtype; a slot's token at position p sits in page page_table[slot, p //
page_size] at offset p % page_size. The host-side PageAllocator decides the page table;
the engine commits it with `with_page_table` before each jitted step, or `for_prefill`
for a step that starts fresh sequences.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlax_tpu.config import InferenceConfig, ModelConfig
from rlax_tpu.inference.attention import (
    Backend,
    fresh_attention,
    paged_attention,
    resolve_backend,
)
from rlax_tpu.inference.page_allocator import PADDING_PAGE, PageAllocator, num_pages_for_budget
from rlax_tpu.sharding import constrain, logical_to_spec

_POOL_AXES = ("act_kv_heads", None, None, "head_dim")


@struct.dataclass
class PagedKVCache:
    """Page pools of every layer plus the page table of the decode slots.

    keys, values: per layer [kv_heads, num_pages, page_size, head_dim]. Heads lead so that
    one (head, page) is a contiguous [page_size, head_dim] tile: the unit the Pallas
    kernels DMA, and the pool shards over kv heads like the model's activations.
    page_table: int32[slots, pages_per_seq], 0 = no page; page 0 is padding, never written.
    fresh: the step's sequences start at position 0 (`for_prefill`), so attention reads
    the new keys and values instead of pages.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    page_table: jax.Array
    backend: Backend = struct.field(pytree_node=False, default="jax")
    fresh: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        batch_slots: int,
        pages_per_seq: int,
        dtype: jnp.dtype | str,
        attention_backend: str = "auto",
        platform: str | None = None,
    ) -> PagedKVCache:
        """Zeroed pools and an empty page table; attention_backend: "auto" | "jax" | "pallas",
        resolved for `platform` (default: the active mesh's, else JAX's default backend).
        Under `jax.eval_shape` nothing is allocated: the engine's abstract cache."""
        dtype = jnp.dtype(dtype)
        shape = (kv_heads, num_pages, page_size, head_dim)
        backend = resolve_backend(
            attention_backend,
            head_dim=head_dim,
            page_size=page_size,
            dtype=dtype,
            platform=platform,
        )
        return cls(
            keys=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            values=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            page_table=jnp.zeros((batch_slots, pages_per_seq), jnp.int32),
            backend=backend,
        )

    @classmethod
    def from_config(
        cls,
        model: ModelConfig,
        inference: InferenceConfig,
        *,
        max_seq_len: int | None = None,
        platform: str | None = None,
    ) -> PagedKVCache:
        """Pool sized by inference.kv_cache_bytes, one page-table row per decode slot.

        max_seq_len: tokens a slot may hold (default max_prompt_len + max_new_tokens);
        platform: what the attention backend is resolved for (`create`).
        """
        if max_seq_len is None:
            max_seq_len = inference.max_prompt_len + inference.max_new_tokens
        num_pages = num_pages_for_budget(
            inference.kv_cache_bytes,
            num_layers=model.num_layers,
            kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            page_size=inference.page_size,
            dtype=model.dtype,
        )
        return cls.create(
            num_layers=model.num_layers,
            num_pages=num_pages,
            page_size=inference.page_size,
            kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            batch_slots=inference.max_decode_slots,
            pages_per_seq=-(-max_seq_len // inference.page_size),
            dtype=model.dtype,
            attention_backend=inference.attention_backend,
            platform=platform,
        )

    @property
    def num_pages(self) -> int:
        return self.keys[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.keys[0].shape[2]

    @property
    def batch_slots(self) -> int:
        return self.page_table.shape[0]

    @property
    def pages_per_seq(self) -> int:
        return self.page_table.shape[1]

    def make_allocator(self) -> PageAllocator:
        """A host allocator for this cache's pool and page-table shape."""
        return PageAllocator(
            num_pages=self.num_pages,
            max_seqs=self.batch_slots,
            pages_per_seq=self.pages_per_seq,
            page_size=self.page_size,
        )

    def with_page_table(self, page_table: jax.Array) -> PagedKVCache:
        """This cache with the allocator's committed page table int32[rows, pages_per_seq]."""
        return self.replace(page_table=jnp.asarray(page_table, jnp.int32), fresh=False)

    def for_prefill(self, page_table: jax.Array) -> PagedKVCache:
        """This cache for a step of fresh sequences, page_table int32[rows, pages_per_seq]
        their rows: the step's tokens are positions 0..n-1 of each row (padding after), so
        they attend each other, not pages. `with_page_table` ends it."""
        return self.with_page_table(page_table).replace(fresh=True)

    def attend(
        self,
        layer: int,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        valid: jax.Array,
    ) -> tuple[jax.Array, PagedKVCache]:
        """The KVCache seam (shapes in rlax_tpu.models.kv_cache.KVCache.attend).

        Tokens whose page is missing (padding, a position past the slot's reserved pages)
        are dropped: callers reserve pages before the step. A fresh cache (`for_prefill`)
        stores the same and attends the new tokens causally among themselves.
        """
        page_index = positions // self.page_size
        pages = jnp.take_along_axis(
            self.page_table, jnp.clip(page_index, 0, self.pages_per_seq - 1), axis=1
        )
        keep = valid & (page_index < self.pages_per_seq) & (pages != PADDING_PAGE)
        # An out-of-range page index makes the scatter drop the write.
        pages = jnp.where(keep, pages, self.num_pages)
        offsets = positions % self.page_size

        def store(pool: jax.Array, new: jax.Array) -> jax.Array:
            # pool[:, pages, offsets] is [kv_heads, slots, new, head_dim].
            new = new.transpose(2, 0, 1, 3).astype(pool.dtype)
            return constrain(pool.at[:, pages, offsets].set(new, mode="drop"), _POOL_AXES)

        keys, values = store(self.keys[layer], k), store(self.values[layer], v)
        if self.fresh:
            # Attend the keys as stored (in the pool's dtype), as a read of the pages would.
            k, v = k.astype(keys.dtype), v.astype(values.dtype)
            out = fresh_attention(q, k, v, valid, backend=self.backend)
        else:
            out = paged_attention(
                q, keys, values, self.page_table, positions, valid, backend=self.backend
            )
        cache = self.replace(
            keys=self.keys[:layer] + (keys,) + self.keys[layer + 1 :],
            values=self.values[:layer] + (values,) + self.values[layer + 1 :],
        )
        return out, cache


def placed_layout(cache: PagedKVCache, mesh: Mesh | None, rules: Any) -> PagedKVCache:
    """The abstract `cache` (ShapeDtypeStructs) with its placement on `mesh`: pools sharded
    over kv heads like the model's activations, the page table replicated; unplaced without
    a mesh."""
    if mesh is None:
        return cache
    pool = cache.keys[0]
    spec = logical_to_spec(_POOL_AXES, rules, shape=pool.shape, mesh=mesh)
    pools = NamedSharding(mesh, spec)
    replicated = NamedSharding(mesh, PartitionSpec())

    def placed(x: jax.ShapeDtypeStruct, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return cache.replace(
        keys=tuple(placed(k, pools) for k in cache.keys),
        values=tuple(placed(v, pools) for v in cache.values),
        page_table=placed(cache.page_table, replicated),
    )
