"""Metrics every objective reports, computed from stop-gradient values.

Masked statistics run over response tokens; percentiles use `nanquantile` over the
masked-out array, so they stay inside jit with static shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_tpu.algorithms import groups
from rlax_tpu.algorithms.parts import KL_ESTIMATORS, PartInputs


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask > 0, x * mask, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def masked_std(x: jax.Array, mask: jax.Array) -> jax.Array:
    mean = masked_mean(x, mask)
    return jnp.sqrt(masked_mean((x - mean) ** 2, mask))


def masked_quantile(x: jax.Array, mask: jax.Array, q: float) -> jax.Array:
    """The q-quantile of x over mask > 0 (linear interpolation); NaN if the mask is empty."""
    return jnp.nanquantile(jnp.where(mask > 0, x, jnp.nan), q)


def masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.max(jnp.where(mask > 0, x, -jnp.inf))


def common_metrics(
    p: PartInputs,
    *,
    reference_logprobs: jax.Array | None,
    versions: jax.Array,
    entropy: jax.Array | None,
    step,
) -> dict[str, jax.Array]:
    """Metrics of the batch and the policy that any objective reports.

    ratio/*: π_θ/μ per response token (mean, max, p99); logprob_diff/*: |log π_θ − log μ|
    (mean, p95; RLAX §7.2); kl: mean k3 estimate of KL(π_θ‖π_ref) per token (when the
    reference is given); entropy: the mean of the given entropies, else the sample estimate
    mean(−log π_θ(y_t)); zero_variance_group_fraction: groups whose rewards are all equal;
    staleness/*: step − version per sequence (when step is given).
    """
    m = p.mask
    diff = jnp.where(m > 0, p.logprobs - p.behaviour_logprobs, 0.0)
    ratio = jnp.exp(jnp.clip(diff, -20.0, 20.0))
    out = {
        "ratio/mean": masked_mean(ratio, m),
        "ratio/max": masked_max(ratio, m),
        "ratio/p99": masked_quantile(ratio, m, 0.99),
        "logprob_diff/mean": masked_mean(jnp.abs(diff), m),
        "logprob_diff/p95": masked_quantile(jnp.abs(diff), m, 0.95),
        "reward/mean": masked_mean(p.rewards, p.valid.astype(m.dtype)),
        "reward/std": masked_std(p.rewards, p.valid.astype(m.dtype)),
        "zero_variance_group_fraction": groups.zero_variance_fraction(
            p.rewards, p.group_ids, p.valid
        ),
        "response_length/mean": masked_mean(p.lengths, p.valid.astype(m.dtype)),
    }
    if entropy is not None:
        out["entropy"] = masked_mean(jax.lax.stop_gradient(entropy.astype(m.dtype)), m)
    else:
        out["entropy"] = masked_mean(-p.logprobs, m)
    if reference_logprobs is not None:
        d = jnp.where(m > 0, p.logprobs - reference_logprobs.astype(m.dtype), 0.0)
        out["kl"] = masked_mean(KL_ESTIMATORS["k3"].fn(d), m)
    if step is not None:
        staleness = (jnp.asarray(step) - versions).astype(m.dtype)
        out["staleness/mean"] = masked_mean(staleness, p.valid.astype(m.dtype))
        out["staleness/max"] = masked_max(staleness, p.valid.astype(m.dtype))
    return out
