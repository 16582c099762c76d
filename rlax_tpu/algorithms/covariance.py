"""Covariance-based entropy control: Clip-Cov and KL-Cov (Cui et al. 2025).

'The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models' traces
entropy collapse to tokens whose log-probability and advantage covary strongly, and
restrains the updates of a small fraction of them: Clip-Cov takes their gradient away
(M = 0), KL-Cov adds a penalty |log π_θ − log π_old| on them. Each control selects tokens
from the batch's response tokens; the objective applies the selection (verl's
compute_policy_loss_clip_cov and compute_policy_loss_kl_cov, whose conventions these
follow). Shapes: [batch, seq], zero off the response.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp

from rlax_tpu.algorithms.parts import Part, PartInputs
from rlax_tpu.config import AlgorithmConfig

# The PRNG stream of Clip-Cov's draw: key = fold_in(key(CLIP_COV_STREAM), trainer step).
CLIP_COV_STREAM = zlib.crc32(b"rlax_tpu.algorithms.covariance.clip_cov") & 0x7FFFFFFF


def token_covariance(p: PartInputs, adv: jax.Array) -> jax.Array:
    """float[batch, seq] cov_t = (log π_θ(y_t) − mean log π_θ)·(A_t − mean A).

    Both means run over the batch's response tokens (verl: masked_mean over the micro-
    batch); log π_θ is the stop-gradient current log-prob.
    """
    m = p.mask
    n = jnp.maximum(jnp.sum(m), 1)
    logprob_mean = jnp.sum(p.logprobs * m) / n
    adv_mean = jnp.sum(adv * m) / n
    return (p.logprobs - logprob_mean) * (adv - adv_mean) * m


def selection_size(p: PartInputs, fraction: float) -> jax.Array:
    """max(⌊fraction·N⌋, 1), N the batch's response tokens (verl's clip_num, k_percent_nums)."""
    return jnp.maximum(jnp.floor(fraction * jnp.sum(p.mask)), 1)


def _rank(x: jax.Array) -> jax.Array:
    """int32[batch, seq]: each entry's position in the ascending stable sort of x."""
    order = jnp.argsort(x.ravel(), stable=True)
    ranks = jnp.zeros(order.shape, jnp.int32).at[order].set(jnp.arange(order.size, dtype=jnp.int32))
    return ranks.reshape(x.shape)


def _none(p: PartInputs, adv: jax.Array, keep: jax.Array, c: AlgorithmConfig, step) -> jax.Array:
    return jnp.zeros_like(p.mask)


def _clip_cov(
    p: PartInputs, adv: jax.Array, keep: jax.Array, c: AlgorithmConfig, step
) -> jax.Array:
    """float[batch, seq]: 1 on the tokens Clip-Cov takes the gradient from.

    Candidates: response tokens the clip mask keeps (`keep` > 0; verl excludes the tokens
    PPO's clip already flattens) with covariance.bounds_low < cov_t <
    covariance.bounds_high. Of them, min(selection_size, #candidates) drawn uniformly without
    replacement. The draw is deterministic: uniforms from
    jax.random.fold_in(jax.random.key(CLIP_COV_STREAM), step) (step = the trainer step, 0 when
    None), the candidates with the smallest win. Every micro-batch of a step draws the same
    uniform field over its [batch, seq] positions.
    """
    cov = token_covariance(p, adv)
    candidate = (
        (p.mask > 0)
        & (keep > 0)
        & (cov > c.covariance.bounds_low)
        & (cov < c.covariance.bounds_high)
    )
    key = jax.random.fold_in(jax.random.key(CLIP_COV_STREAM), 0 if step is None else step)
    draw = jax.random.uniform(key, p.mask.shape, jnp.float32)
    ranks = _rank(jnp.where(candidate, draw, 2.0))
    return jnp.where(candidate & (ranks < selection_size(p, c.covariance.ratio)), 1.0, 0.0)


def _kl_cov(p: PartInputs, adv: jax.Array, keep: jax.Array, c: AlgorithmConfig, step) -> jax.Array:
    """float[batch, seq]: 1 on the selection_size response tokens of largest cov_t (ties by
    position), where KL-Cov adds its penalty."""
    cov = token_covariance(p, adv)
    ranks = _rank(jnp.where(p.mask > 0, -cov, jnp.inf))
    return jnp.where((p.mask > 0) & (ranks < selection_size(p, c.covariance.ratio)), 1.0, 0.0)


_PARTS = (
    Part("none", _none, "no covariance control", "GRPO, PPO, ..."),
    Part(
        "clip_cov",
        _clip_cov,
        "M_t = 0 on max(⌊r·N⌋, 1) tokens drawn uniformly from {t : M_t = 1, ω_low < cov_t < "
        "ω_high}, cov_t = (log π_t − mean log π)(A_t − mean A) over the batch's tokens",
        "Clip-Cov (Cui et al. 2025, 'The Entropy Mechanism of RL for Reasoning LMs'; "
        "r = 2e-4, [ω_low, ω_high] = [1, 5]); verl's compute_policy_loss_clip_cov",
    ),
    Part(
        "kl_cov",
        _kl_cov,
        "J −= κ·Σ w·|log π_θ(y_t) − log π_old(y_t)| over the max(⌊k·N⌋, 1) tokens of "
        "largest cov_t (unclipped ρA elsewhere in the paper)",
        "KL-Cov (Cui et al. 2025; k = 2e-3, κ = 1 for 7B); verl's compute_policy_loss_kl_cov",
    ),
)
# Name -> part; fn(p, adv, keep, c, step) -> float[batch, seq], 1 on the selected tokens.
COVARIANCE_CONTROLS = {part.name: part for part in _PARTS}
