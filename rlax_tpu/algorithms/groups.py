"""Per-group statistics over ragged prompt groups, with `jax.ops.segment_*` over group ids.

Rows with no response token (padding rows) are `valid=False` and count in no group.
There are at most `batch` groups (ids in [0, batch)), so `num_segments` is static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _segments(x: jax.Array, group_ids: jax.Array, op=jax.ops.segment_sum) -> jax.Array:
    return op(x, group_ids, num_segments=group_ids.shape[0])


def group_count(group_ids: jax.Array, valid: jax.Array) -> jax.Array:
    """float[batch]: the number of valid rows in each row's group."""
    counts = _segments(valid.astype(jnp.float32), group_ids)
    return counts[group_ids]


def group_mean(x: jax.Array, group_ids: jax.Array, valid: jax.Array) -> jax.Array:
    """float[batch]: mean of x[batch] over the valid rows of each row's group."""
    sums = _segments(jnp.where(valid, x, 0), group_ids)
    counts = _segments(valid.astype(x.dtype), group_ids)
    return (sums / jnp.maximum(counts, 1))[group_ids]


def group_std(x: jax.Array, group_ids: jax.Array, valid: jax.Array) -> jax.Array:
    """float[batch]: unbiased (n − 1) std of x within each row's group (0 for n = 1)."""
    centred = jnp.where(valid, x - group_mean(x, group_ids, valid), 0)
    sq = _segments(centred**2, group_ids)
    counts = _segments(valid.astype(x.dtype), group_ids)
    return jnp.sqrt(sq / jnp.maximum(counts - 1, 1))[group_ids]


def group_all_equal(x: jax.Array, group_ids: jax.Array, valid: jax.Array) -> jax.Array:
    """bool[batch]: whether every valid row of the row's group has the same x (exact)."""
    hi = _segments(jnp.where(valid, x, -jnp.inf), group_ids, jax.ops.segment_max)
    lo = _segments(jnp.where(valid, x, jnp.inf), group_ids, jax.ops.segment_min)
    return (hi == lo)[group_ids]


def group_first_argmax(x: jax.Array, group_ids: jax.Array, valid: jax.Array) -> jax.Array:
    """bool[batch]: one-hot per group at its first valid row holding the group's maximum."""
    best = _segments(jnp.where(valid, x, -jnp.inf), group_ids, jax.ops.segment_max)
    rows = jnp.arange(x.shape[0])
    candidate = jnp.where(valid & (x == best[group_ids]), rows, x.shape[0])
    first = _segments(candidate, group_ids, jax.ops.segment_min)
    return valid & (rows == first[group_ids])


def num_groups(group_ids: jax.Array, valid: jax.Array) -> jax.Array:
    """float scalar: the number of groups with at least one valid row."""
    counts = _segments(valid.astype(jnp.float32), group_ids)
    return jnp.sum(counts > 0).astype(jnp.float32)


def zero_variance_fraction(rewards: jax.Array, group_ids: jax.Array, valid: jax.Array):
    """float scalar: fraction of groups whose rewards are all equal (no learning signal)."""
    equal = group_all_equal(rewards, group_ids, valid)
    counts = group_count(group_ids, valid)
    # Each group's rows each add 1/count: the sum over a group is 1.
    per_row = jnp.where(valid & equal, 1.0 / jnp.maximum(counts, 1), 0.0)
    return jnp.sum(per_row) / jnp.maximum(num_groups(group_ids, valid), 1)
