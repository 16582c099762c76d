"""Rollout correction: the trainer–inference mismatch between π_old and π_rollout.

The inference workers sample with their own kernels and precision (π_rollout, the batch's
`rollout_logprobs`) while the trainer's recompute gives π_old (`behaviour_logprobs`). ρ =
π_θ/π_old stays the importance weight; the correction multiplies each token's term of J
(its value and its gradient weight) by one more stop-gradient factor of π_old/π_rollout
(TIS, MIS), and the mismatch gate drops whole sequences the two disagree on too much.
Shapes: [batch, seq] per token (zero off the response), [batch] per sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rlax_tpu.algorithms.batch import MissingInputError
from rlax_tpu.algorithms.parts import MAX_LOG_RATIO, Part, PartInputs
from rlax_tpu.config import AlgorithmConfig


class Correction(NamedTuple):
    """weight: float[batch, seq] the stop-gradient factor on each token's term (the mask
    when there is no correction); truncated: float[batch, seq] 1 where TIS capped the
    ratio at C; masked: float[batch, seq] 1 where MIS zeroed it."""

    weight: jax.Array
    truncated: jax.Array
    masked: jax.Array


def needs_rollout_logprobs(c: AlgorithmConfig) -> bool:
    """Whether the resolved config `c` reads batch.rollout_logprobs."""
    return bool(c.rollout_correction_fields())


def check_inputs(c: AlgorithmConfig, p: PartInputs) -> None:
    """MissingInputError naming what to pass when `c` needs π_rollout and `p` has none."""
    users = c.rollout_correction_fields()
    if users and p.rollout_logprobs is None:
        raise MissingInputError(
            f"{' and '.join(users)} ({c.name}) need batch.rollout_logprobs: the inference "
            "workers' own log π_rollout(targets), float[batch, seq], next to "
            "behaviour_logprobs, the trainer's recomputed log π_old; pass them, or set "
            "rollout_correction='none' and rollout_is.gate_threshold=0"
        )


def _level_ratio(p: PartInputs, level: str) -> jax.Array:
    """float[batch, seq] π_old/π_rollout per token, or the sequence product on each token.

    As verl's compute_rollout_correction_weights: the token log-ratios (or their sum over
    the sequence) are clamped to ±20 before exp.
    """
    diff = jnp.where(p.mask > 0, p.behaviour_logprobs - p.rollout_logprobs, 0.0)
    if level == "token":
        return jnp.exp(jnp.clip(diff, -MAX_LOG_RATIO, MAX_LOG_RATIO)) * p.mask
    total = jnp.clip(jnp.sum(diff, axis=1), -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return jnp.exp(total)[:, None] * p.mask


def _none(p: PartInputs, c: AlgorithmConfig) -> Correction:
    zeros = jnp.zeros_like(p.mask)
    return Correction(p.mask, zeros, zeros)


def _truncated(level: str):
    def fn(p: PartInputs, c: AlgorithmConfig) -> Correction:
        ratio = _level_ratio(p, level)
        capped = jnp.where(ratio > c.rollout_is.threshold, 1.0, 0.0) * p.mask
        return Correction(
            jnp.minimum(ratio, c.rollout_is.threshold), capped, jnp.zeros_like(p.mask)
        )

    return fn


def _masked(level: str):
    def fn(p: PartInputs, c: AlgorithmConfig) -> Correction:
        ratio = _level_ratio(p, level)
        lower = c.rollout_is.threshold_lower or 1 / c.rollout_is.threshold
        inside = (ratio >= lower) & (ratio <= c.rollout_is.threshold)
        outside = jnp.where(inside, 0.0, 1.0) * p.mask
        return Correction(jnp.where(inside, ratio, 0.0), jnp.zeros_like(p.mask), outside)

    return fn


_PARTS = (
    Part("none", _none, "c_t = 1", "no correction: π_rollout = π_old assumed"),
    Part(
        "token_tis",
        _truncated("token"),
        "c_t = sg(min(π_old(y_t)/π_rollout(y_t), C))",
        "TIS (Yao et al. 2025, 'Your efficient RL framework secretly brings you off-policy "
        "RL training'); verl's rollout_is='token', C = rollout_is.threshold = 2",
    ),
    Part(
        "sequence_tis",
        _truncated("sequence"),
        "c_i = sg(min(exp(clip(Σ_t log π_old/π_rollout, ±20)), C)) on every token of y_i",
        "sequence-level TIS (Liu, Li et al. 2025, 'When speed kills stability'); verl's "
        "rollout_is='sequence'",
    ),
    Part(
        "token_mis",
        _masked("token"),
        "c_t = sg(ρ_t·1[C_low ≤ ρ_t ≤ C]), ρ_t = π_old(y_t)/π_rollout(y_t), C_low = 1/C",
        "token-level MIS (Liu, Li et al. 2025); verl's token IS with its token_k1 rejection mask",
    ),
    Part(
        "sequence_mis",
        _masked("sequence"),
        "c_i = sg(ρ_i·1[C_low ≤ ρ_i ≤ C]), ρ_i = π_old(y_i)/π_rollout(y_i) (the product)",
        "sequence-level MIS (Liu, Li et al. 2025); verl's sequence IS with its seq_sum_k1 "
        "rejection mask (Seq-MIS)",
    ),
)
ROLLOUT_CORRECTIONS = {part.name: part for part in _PARTS}


def mismatch_gate(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    """bool[batch]: the sequences the mismatch gate keeps (all of them when it is off).

    Tunix's seq_logprob_error_threshold (algo_core.sequence_loss_mask, after NeMo-RL):
    a sequence is dropped when its multiplicative probability error
    e_i = 1/|y_i| Σ_t exp(|log π_old(y_t) − log π_rollout(y_t)|) exceeds the threshold
    (1 = exact agreement; a non-finite e_i drops the sequence too). Tunix reads the
    current π_θ, which is π_old on a step's first pass; this gate reads π_old, so its
    verdict is the same for every pass over the batch. The objective takes a dropped
    sequence out of the aggregation's denominators as well (Tunix's loss_mask), so the
    kept sequences keep their full weight.
    """
    if not c.rollout_is.gate_threshold:
        return jnp.ones_like(p.valid)
    diff = jnp.where(p.mask > 0, jnp.abs(p.behaviour_logprobs - p.rollout_logprobs), 0.0)
    error = jnp.sum(jnp.exp(diff) * p.mask, axis=1) / jnp.maximum(p.lengths, 1)
    return (error <= c.rollout_is.gate_threshold) | ~p.valid


def gated(p: PartInputs, keep: jax.Array) -> PartInputs:
    """`p` with the sequences outside bool[batch] `keep` taken off the response."""
    mask = p.mask * keep[:, None]
    return p._replace(mask=mask, lengths=jnp.sum(mask, axis=1), valid=p.valid & keep)
