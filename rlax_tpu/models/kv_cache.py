"""The seam between the model and its KV storage.

In an inference forward the model calls `cache.attend(layer, q, k, v, positions, valid)`
once per layer: the cache stores the new keys/values and returns attention of the new
queries over everything the sequence has stored so far. The dense cache below is the
reference; the inference worker's paged cache implements the same method over a page
pool and page table, so the model never knows how keys are laid out.
"""

from __future__ import annotations

from typing import Protocol, Self

import jax
import jax.numpy as jnp
from flax import struct

from rlax_tpu.sharding import constrain

# Large negative instead of -inf: a fully masked (padding) row stays finite.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class KVCache(Protocol):
    """A pytree holding keys and values of every layer for a batch of sequences."""

    def attend(
        self,
        layer: int,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        valid: jax.Array,
    ) -> tuple[jax.Array, Self]:
        """Store k, v of the new tokens and attend the new queries causally.

        q: float[batch, new, q_heads, head_dim] (RoPE applied);
        k, v: float[batch, new, kv_heads, head_dim];
        positions: int32[batch, new], absolute position of each new token in its sequence;
        valid: bool[batch, new], False for padding (not stored; its output is ignored).
        Returns (out: float[batch, new, q_heads, head_dim], updated cache).
        """
        ...


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention with grouped-query heads.

    q: [batch, tq, q_heads, d]; k, v: [batch, tk, kv_heads, d]; mask: bool[batch, tq, tk].
    Returns [batch, tq, q_heads, d] in q's dtype; scores and softmax in float32.
    """
    batch, tq, q_heads, d = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    qg = q.reshape(batch, tq, kv_heads, group, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, tq, q_heads, d)


@struct.dataclass
class DenseKVCache:
    """Keys/values of each layer in a dense [batch, max_len, kv_heads, head_dim] buffer.

    Token at position p of sequence b lives at index p, so causality alone (key index <=
    query position) selects what a query may see: positions past the current one may hold
    stale data from an earlier sequence in the same row, and are masked.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]

    @classmethod
    def create(
        cls,
        *,
        num_layers: int,
        batch: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype,
    ) -> DenseKVCache:
        shape = (batch, max_len, kv_heads, head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        return cls(keys=zeros, values=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]

    def attend(self, layer, q, k, v, positions, valid):
        batch, new = positions.shape
        # Padding writes go out of bounds and are dropped.
        index = jnp.where(valid, positions, self.max_len)
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, new))
        keys = self.keys[layer].at[rows, index].set(k.astype(self.keys[layer].dtype), mode="drop")
        values = (
            self.values[layer].at[rows, index].set(v.astype(self.values[layer].dtype), mode="drop")
        )
        keys = constrain(keys, ("batch", "length", "act_kv_heads", "head_dim"))
        values = constrain(values, ("batch", "length", "act_kv_heads", "head_dim"))
        mask = jnp.arange(self.max_len)[None, None, :] <= positions[:, :, None]
        out = grouped_attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask)
        cache = self.replace(
            keys=self.keys[:layer] + (keys,) + self.keys[layer + 1 :],
            values=self.values[:layer] + (values,) + self.values[layer + 1 :],
        )
        return out, cache
