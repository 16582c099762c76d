"""Metrics every objective reports, computed from stop-gradient values.

`REQUIRED_METRICS` is the set that every objective (each policy-gradient preset,
trajectory balance, online DPO) reports, with or without reference log-probs, so
dashboards and the controller can read the same keys whatever the algorithm; `kl` (to
π_ref) is added whenever reference log-probs are given. Masked statistics run over
response tokens; percentiles use `nanquantile` over the masked-out array, so they stay
inside jit with static shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_tpu.algorithms import groups
from rlax_tpu.algorithms.batch import RolloutBatch
from rlax_tpu.algorithms.parts import KL_ESTIMATORS, MAX_LOG_RATIO, PartInputs

# Reported by every objective (issue 5, item 4; docs/algorithms.md "Metrics").
REQUIRED_METRICS = (
    "clip_fraction",  # response tokens whose gradient the clip mask M removes (0: no mask)
    "clip_fraction/high",  # ... of them with A > 0 (ratio above 1 + ε_high)
    "clip_fraction/low",  # ... of them with A < 0 (ratio below 1 − ε_low)
    "ratio/mean",  # π_θ/μ per response token
    "ratio/max",
    "ratio/p99",
    "logprob_diff/mean",  # |log π_θ − log μ| per response token (RLAX §7.2)
    "logprob_diff/p95",
    "kl/behaviour",  # k3 estimate of KL(μ‖π_θ) per response token
    "entropy",
    "advantage/mean",
    "advantage/std",
    "zero_variance_group_fraction",
)
# Reported in addition whenever the batch carries reference log-probs.
REFERENCE_METRICS = ("kl",)  # k3 estimate of KL(π_θ‖π_ref) per response token


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


def no_clipping(dtype) -> dict[str, jax.Array]:
    """The clip fractions of an objective without a clip mask (TB, DPO): exactly 0."""
    zero = jnp.zeros((), dtype)
    return {"clip_fraction": zero, "clip_fraction/high": zero, "clip_fraction/low": zero}


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
    (mean, p95; RLAX §7.2); kl/behaviour: mean over response tokens of the k3 estimate
    r − 1 − log r, r = π_θ/μ, of KL(μ‖π_θ) (unbiased: the tokens were sampled from μ), so
    a KL figure exists without a reference; kl: mean k3 estimate of KL(π_θ‖π_ref) per
    token (when the reference is given); entropy: the mean of the given per-position
    entropies (the trainer computes them only when the objective needs them, entropy_coef
    > 0), else the sample estimate mean(−log π_θ(y_t)) over the sampled tokens (the
    cross-entropy of π_θ on μ's samples: π_θ's entropy in expectation only on-policy);
    zero_variance_group_fraction: groups whose rewards are all equal; staleness/*: step −
    version per sequence (when step is given).
    """
    m = p.mask
    diff = jnp.where(m > 0, p.logprobs - p.behaviour_logprobs, 0.0)
    log_ratio = jnp.clip(diff, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = jnp.exp(log_ratio)
    out = {
        "ratio/mean": masked_mean(ratio, m),
        "ratio/max": masked_max(ratio, m),
        "ratio/p99": masked_quantile(ratio, m, 0.99),
        "logprob_diff/mean": masked_mean(jnp.abs(diff), m),
        "logprob_diff/p95": masked_quantile(jnp.abs(diff), m, 0.95),
        # The registry's k3(d) = e^{−d} − 1 + d estimates KL(π_θ‖π_ref) from d = log π_θ/π_ref;
        # at d = −log r it is r − 1 − log r, the k3 estimate of KL(μ‖π_θ) from μ's samples.
        "kl/behaviour": masked_mean(KL_ESTIMATORS["k3"].fn(-log_ratio), m),
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


def finish_metrics(
    metrics: dict[str, jax.Array],
    p: PartInputs,
    batch: RolloutBatch,
    *,
    advantage: jax.Array,
    advantage_mask: jax.Array,
    entropy: jax.Array | None,
    step,
) -> dict[str, jax.Array]:
    """`metrics` completed with what every objective reports: advantage/* (mean and std of
    `advantage` over `advantage_mask`, per token or per sample as the objective applies it)
    and `common_metrics` of `p` and `batch`. The objective's own metrics come first."""
    return {
        **metrics,
        "advantage/mean": masked_mean(advantage, advantage_mask),
        "advantage/std": masked_std(advantage, advantage_mask),
        **common_metrics(
            p,
            reference_logprobs=batch.reference_logprobs,
            versions=batch.versions,
            entropy=entropy,
            step=step,
        ),
    }
