"""Step-dependent settings of the objective: the β schedule and the reference reset.

TBA (Bartoldson et al. 2025) anneals β linearly (GSM8K: 0.012 → 0.004 by step 500),
optionally cuts it to the final value at a step (TL;DR), and resets π_ref ← π_θ every
ρ steps (TBA-PRIME: ρ = 50). `kl_beta_at` runs inside jit (step may be traced); the
trainer asks `reference_reset_due` on the host after each step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_tpu.config import AlgorithmConfig


def kl_beta_at(config: AlgorithmConfig, step, dtype=jnp.float32) -> jax.Array:
    """β at `step` (int or int32 scalar; None = 0): linear from kl.beta to kl.beta_final
    over kl.beta_decay_steps, then kl.beta_final; kl.beta_final from kl.beta_cut_step on."""
    c = config.resolved()
    s = jnp.asarray(0 if step is None else step, dtype)
    beta = jnp.asarray(c.kl.beta, dtype)
    if c.kl.beta_decay_steps:
        frac = jnp.clip(s / c.kl.beta_decay_steps, 0.0, 1.0)
        beta = c.kl.beta + (c.kl.beta_final - c.kl.beta) * frac
    if c.kl.beta_cut_step:
        beta = jnp.where(s >= c.kl.beta_cut_step, jnp.asarray(c.kl.beta_final, dtype), beta)
    return beta.astype(dtype)


def kl_may_be_nonzero(config: AlgorithmConfig) -> bool:
    """Whether β is ever > 0 (so the objective needs reference log-probs)."""
    c = config.resolved()
    return c.kl.beta > 0 or (
        (c.kl.beta_decay_steps > 0 or c.kl.beta_cut_step > 0) and c.kl.beta_final > 0
    )


def reference_reset_due(config: AlgorithmConfig, step: int) -> bool:
    """Whether the trainer copies π_θ into π_ref after finishing `step` (TBA's ρ)."""
    every = config.resolved().kl.reference_reset_every
    return bool(every) and step > 0 and step % every == 0
