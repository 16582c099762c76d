"""Token-level returns, whitening and pass@k statistics that advantage estimators build on.

Pure functions of arrays, no config: `parts.ADVANTAGES` wraps them as named parts.
Shapes: [batch, seq] per token (zero off the response), [batch] per sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_tpu.algorithms import groups

# verl's and Tunix's masked_whiten add this to the variance under the rsqrt.
WHITEN_EPS = 1e-8


def returns_to_go(token_rewards: jax.Array, mask: jax.Array, gamma: float) -> jax.Array:
    """float[batch, seq] G_t = Σ_{s≥t} γ^{s−t} R_s over each row's response tokens.

    token_rewards: float[batch, seq] R_t, zero off the response. The sum runs over response
    tokens only: a position off the response (a tool's output between turns) passes the
    return through undiscounted and gets G = 0, as GAE skips it. For one contiguous
    response this is verl's compute_reinforce_plus_plus_outcome_advantage before whitening.
    """

    def step(next_return, x):
        r, m = x
        g = r + gamma * next_return
        on = m > 0
        return jnp.where(on, g, next_return), jnp.where(on, g, 0.0)

    zeros = jnp.zeros(token_rewards.shape[0], token_rewards.dtype)
    _, out = jax.lax.scan(step, zeros, (token_rewards.T, mask.T), reverse=True)
    return out.T


def masked_whiten(x: jax.Array, mask: jax.Array) -> jax.Array:
    """float[batch, seq] (x − mean)·rsqrt(var + 1e-8) over the response tokens, 0 elsewhere.

    mean and var are over every response token of the batch, var with n − 1 (Bessel), as
    verl's verl_F.masked_whiten (masked_var(unbiased=True)) and Tunix's ppo_helpers.
    """
    n = jnp.sum(mask)
    mean = jnp.sum(x * mask) / jnp.maximum(n, 1)
    var = jnp.sum((x - mean) ** 2 * mask) / jnp.maximum(n - 1, 1)
    return (x - mean) * jax.lax.rsqrt(var + WHITEN_EPS) * mask


def binomial_ratio(a: jax.Array, b: jax.Array, k: int) -> jax.Array:
    """C(a, k)/C(b, k) for integer-valued float arrays a ≤ b, b ≥ k; 0 where a < k.

    As the product Π_{i<k} (a − i)/(b − i) of factors in [0, 1]: no factorial overflows
    and a relative error of ~k·eps (a log-gamma difference cancels: lgamma(513) ≈ 2.7e3
    leaves ~2e-4 in float32), exact 0 when a < k (a factor is 0) and exact 1 when a = b.
    """
    i = jnp.arange(k, dtype=a.dtype)
    top = jnp.maximum(a[..., None] - i, 0.0)
    bottom = jnp.maximum(b[..., None] - i, 1.0)
    return jnp.prod(top / bottom, axis=-1)


def pass_at_k_advantages(
    correct: jax.Array, group_ids: jax.Array, valid: jax.Array, k: int
) -> jax.Array:
    """float[batch] the analytical pass@k advantages of Chen et al. 2025 (binary rewards).

    correct: float[batch], 1 for a correct sample, 0 for a failed one (its dtype is the
    result's). In a group of N samples with N_neg failures, the pass@k of a random k-subset
    has mean R̄ = 1 − C(N_neg, k)/C(N, k) and std σ = sqrt(R̄(1 − R̄)); a correct sample
    gets (1 − R̄)/σ, a failed one (1 − R̄ − C(N_neg−1, k−1)/C(N−1, k−1))/σ. Groups with
    σ = 0 (every k-subset passes, or none does, or N ≤ k) and invalid rows get 0.

    Computed without cancellation: 1 − R̄ = C(N_neg, k)/C(N, k) directly, and since
    C(N_neg−1, k−1)/C(N−1, k−1) = (N/N_neg)·C(N_neg, k)/C(N, k), a failed sample's
    advantage is −(N_pos/N_neg) times a correct one's.
    """
    n = groups.group_count(group_ids, valid).astype(correct.dtype)
    # A group mean times the count: rounded, the number of failures is exact again.
    n_neg = jnp.round((1.0 - groups.group_mean(correct, group_ids, valid)) * n)
    fail = binomial_ratio(n_neg, n, k)  # 1 − R̄: the chance that a k-subset has no success
    std = jnp.sqrt(fail * (1.0 - fail))
    live = valid & (n > k) & (std > 0)
    positive = fail / jnp.where(live, std, 1.0)
    negative = -(n - n_neg) / jnp.maximum(n_neg, 1.0) * positive
    return jnp.where(live, jnp.where(correct > 0, positive, negative), 0.0)
