"""The jitted steps of the inference engine: prefill (a batch of prompts of one bucket, their
first tokens sampled), decode (`num_steps` tokens of the live slots) and the page copies of a
swap, with the static key that names the model and mesh they run. Pure functions of
(weights, cache, host arrays): the engine (engine.py) schedules, these compute."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rlax_tpu.inference.page_allocator import PADDING_PAGE
from rlax_tpu.inference.sampling import sample_tokens
from rlax_tpu.models import Transformer


class StaticKey:
    """The static part of a jitted step (model graphdef, state treedef, mesh): hashed once,
    compared by identity.

    jit hashes static arguments on every call, and hashing an nnx GraphDef walks the whole
    module graph (~0.6 ms for a 4-layer model). Interning makes engines of the same model
    and mesh share one key, hence one compilation cache entry.
    """

    _interned: dict = {}

    def __init__(self, graphdef: nnx.GraphDef, treedef: Any, mesh_key: Any):
        self.graphdef, self.treedef, self.mesh_key = graphdef, treedef, mesh_key

    @classmethod
    def of(cls, graphdef: nnx.GraphDef, treedef: Any, mesh_key: Any) -> StaticKey:
        key = (graphdef, treedef, mesh_key)
        return cls._interned.setdefault(key, cls(*key))

    def model(self, params: list[jax.Array]) -> Transformer:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, params))

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def prefill_step(
    static, params, cache, rows, tokens, lengths, key_data, temperature, top_k, top_p, lp
):
    """Prefill a batch of prompts and sample each one's first response token (t = 0).

    rows: int32[batch, pages_per_seq], each prompt's page-table row; tokens: int32[batch,
    bucket] (right-padded); lengths: int32[batch] prompt lengths (0 = a padding row: it
    writes nothing and its output is garbage); key_data: uint32[batch, 2]; temperature,
    top_p: float32[batch]; top_k: int32[batch]; lp: bool[batch] ("sampled" log-probs).
    Returns (packed int32[2, batch]: tokens and log-probs as float32 bits, so the host
    fetches them in one transfer; cache with the prompts' keys/values written).
    """
    model = static.model(params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    table = cache.page_table
    logits, cache = model.decode(
        tokens,
        positions,
        positions < lengths[:, None],
        cache.for_prefill(rows),
        logits_index=jnp.maximum(lengths - 1, 0),
    )
    token, logprob = sample_tokens(
        logits,
        key_data,
        jnp.zeros(lengths.shape, jnp.int32),
        temperature,
        top_k,
        top_p,
        lp,
    )
    packed = jnp.stack([token, jax.lax.bitcast_convert_type(logprob, jnp.int32)])
    return packed, cache.with_page_table(table)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def decode_step(static, num_steps, params, cache, carry, sampling, live):
    """`num_steps` decode steps of the slots `live`, sampling on device.

    carry: (last token, position, response index t of the next token: int32[slots],
    active: bool[slots]); sampling: Engine._sampling_arrays (per-slot key data, temperature,
    top_k, top_p, "sampled" flag, response limit, stop ids int32[slots, max_stop_tokens]);
    live: int32[rows], the slot of each row (`slots` = a padding row: inactive, no page).
    The rows' state is gathered from the slots', stepped, and written back. A slot stops
    (active = False, no more cache writes) at a stop token or its limit. Returns (cache,
    carry, out: int32[3, steps, rows]): out packs the sampled tokens, their log-probs
    (float32 bits) and whether each was emitted (1) or the row was idle (0), so the host
    fetches them in one transfer.
    """
    model = static.model(params)
    slots = carry[0].shape[0]
    present = live < slots
    index_of = jnp.where(present, live, 0)
    tokens, positions, index, active = (x[index_of] for x in carry)
    active = active & present
    key_data, temperature, top_k, top_p, lp, limit, stop_ids = (x[index_of] for x in sampling)
    table = cache.page_table
    rows_table = jnp.where(present[:, None], table[index_of], PADDING_PAGE)

    def one_step(c, _):
        cache, tokens, positions, index, active = c
        logits, cache = model.decode(tokens[:, None], positions[:, None], active[:, None], cache)
        new, logprobs = sample_tokens(logits[:, 0], key_data, index, temperature, top_k, top_p, lp)
        emitted = active
        index = index + emitted
        stopped = jnp.any(new[:, None] == stop_ids, axis=-1)
        active = active & ~stopped & (index < limit)
        tokens = jnp.where(emitted, new, tokens)
        positions = positions + emitted
        return (cache, tokens, positions, index, active), (new, logprobs, emitted)

    (cache, *rows), (tokens, logprobs, emitted) = jax.lax.scan(
        one_step,
        (cache.with_page_table(rows_table), tokens, positions, index, active),
        length=num_steps,
    )
    back = jnp.where(present, live, slots)  # padding rows write out of range: dropped
    carry = tuple(x.at[back].set(r, mode="drop") for x, r in zip(carry, rows, strict=True))
    logprob_bits = jax.lax.bitcast_convert_type(logprobs, jnp.int32)
    out = jnp.stack([tokens, logprob_bits, emitted.astype(jnp.int32)])
    return cache.with_page_table(table), carry, out


@jax.jit
def read_pages(cache, pages):
    """Keys and values of `pages` (int32[n]) in every layer: per layer [kv_heads, n,
    page_size, head_dim]."""
    return tuple(k[:, pages] for k in cache.keys), tuple(v[:, pages] for v in cache.values)


@functools.partial(jax.jit, donate_argnums=(0,))
def write_pages(cache, pages, keys, values):
    """`cache` with `keys` / `values` (as `_read_pages` returns) written into `pages`; an
    out-of-range page (padding) is dropped."""

    def write(pool, new):
        return pool.at[:, pages].set(new.astype(pool.dtype), mode="drop")

    return cache.replace(
        keys=tuple(write(k, x) for k, x in zip(cache.keys, keys, strict=True)),
        values=tuple(write(v, x) for v, x in zip(cache.values, values, strict=True)),
    )


def pow2(n: int) -> int:
    """The smallest power of two >= n (swap copies compile once per such size)."""
    return 1 << max(0, n - 1).bit_length()
