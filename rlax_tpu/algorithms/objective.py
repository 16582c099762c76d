"""The RL objective: one function assembling the parts named by an `AlgorithmConfig`.

    J = Σ_{i,t} w_{i,t} · sg(ρ_{i,t}) · sg(A_{i,t}) · M_{i,t} · log π_θ(y_{i,t}) − β·R_{i,t}(θ)
    loss = −J − c_H·Σ w·H + c_V·L_V

The gradient w.r.t. log π_θ is exactly w·sg(ρ)·sg(A)·M (+ the regulariser's), as in
RLAX Eq. 3. The reported loss value is the published objective: for ratio-gradient
algorithms (an untransformed ratio: PPO, GRPO, DAPO, GSPO, ...) it is the clipped
surrogate min(ρA, clip(ρ)A), whose gradient is that same expression; for log-π
algorithms (REINFORCE, RLOO, AIPO, CISPO) it is the surrogate itself.

Trajectory balance and online DPO are separate objectives on the same inputs;
`build_objective` picks the right one for any preset. Call it inside the trainer's loss
function with the log-probs (and values, entropies) the model just computed:

    objective = build_objective(config.trainer.algorithm)
    def loss_fn(params, batch, step):
        out = model.train(params, batch.tokens, batch.targets)
        return objective(batch, out.logprobs, values=out.values, step=step)
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, step)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_tpu.algorithms import dpo, trajectory_balance
from rlax_tpu.algorithms.batch import MissingInputError, RolloutBatch
from rlax_tpu.algorithms.metrics import common_metrics, masked_mean, masked_std
from rlax_tpu.algorithms.parts import (
    ADVANTAGES,
    AGGREGATIONS,
    GRADIENT_MASKS,
    IMPORTANCE_WEIGHTS,
    KL_ESTIMATORS,
    is_ratio_objective,
    part_inputs,
    weight_level,
)
from rlax_tpu.algorithms.schedules import kl_beta_at, kl_may_be_nonzero
from rlax_tpu.config import AlgorithmConfig

Metrics = dict[str, jax.Array]


def policy_gradient_loss(
    config: AlgorithmConfig,
    batch: RolloutBatch,
    logprobs: jax.Array,
    *,
    values: jax.Array | None = None,
    entropy: jax.Array | None = None,
    step=None,
) -> tuple[jax.Array, Metrics]:
    """The modular objective J (above) as a loss to minimise, and its metrics.

    logprobs: float[batch, seq] log π_θ(targets), differentiated; values: float[batch, seq]
    current value-head outputs (needed when value_loss_coef > 0), differentiated;
    entropy: float[batch, seq] per-position policy entropies (needed when entropy_coef > 0);
    step: int or int32 scalar, the trainer step (β schedule, staleness metrics).
    """
    c = config.resolved()
    p = part_inputs(batch, logprobs, need_old_values=c.advantage == "gae")
    m = p.mask
    dtype = m.dtype
    lp = jnp.where(m > 0, logprobs.astype(dtype), 0.0)  # padding may hold -inf or NaN

    w = AGGREGATIONS[c.aggregation].fn(p, c)
    adv = jax.lax.stop_gradient(ADVANTAGES[c.advantage].fn(p, c))
    ratio = jax.tree.map(jax.lax.stop_gradient, IMPORTANCE_WEIGHTS[c.importance_weight].fn(p, c))
    keep = GRADIENT_MASKS[c.gradient_mask].fn(ratio.raw, adv, m, c)
    coef = ratio.weight * adv * keep  # ∂J/∂log π_θ per token, before w

    if is_ratio_objective(c.importance_weight):
        # Value of the published min(ρA, clip(ρ)A); gradient w·coef through log π_θ.
        if c.gradient_mask == "keep_all":
            bounded = ratio.raw
        else:
            bounded = jnp.clip(ratio.raw, 1 - c.clip_eps_low, 1 + c.clip_eps_high)
        value = adv * jnp.where(keep > 0, ratio.raw, bounded) * m
        if weight_level(c.importance_weight) == "sequence" and c.sequence_ratio == "product":
            # One term per sequence: d log ρ_i / d log π_t = 1, so spread it over the tokens.
            value = value / jnp.maximum(p.lengths, 1)[:, None]
        pg = jax.lax.stop_gradient(jnp.sum(w * value)) + jnp.sum(
            w * coef * (lp - jax.lax.stop_gradient(lp))
        )
    else:
        pg = jnp.sum(w * coef * lp)
    loss = -pg
    metrics: Metrics = {"policy_loss": -pg}

    beta = kl_beta_at(c, step, dtype)
    if kl_may_be_nonzero(c):
        if batch.reference_logprobs is None:
            raise MissingInputError(
                f"kl_beta > 0 ({c.name}) needs batch.reference_logprobs; set kl_beta=0 to "
                "train without a reference"
            )
        d = jnp.where(m > 0, lp - batch.reference_logprobs.astype(dtype), 0.0)
        kl_term = jnp.sum(w * KL_ESTIMATORS[c.kl_estimator].fn(d) * m)
        loss = loss + beta * kl_term
        metrics["kl_loss"] = kl_term
    metrics["kl_beta"] = beta

    if c.entropy_coef > 0:
        if entropy is None:
            raise MissingInputError(
                "entropy_coef > 0 needs the per-position entropies float[batch, seq] of π_θ "
                "(from the logits) passed as entropy="
            )
        bonus = jnp.sum(w * jnp.where(m > 0, entropy.astype(dtype), 0.0))
        loss = loss - c.entropy_coef * bonus
        metrics["entropy_bonus"] = bonus

    if c.value_loss_coef > 0:
        if values is None:
            raise MissingInputError(
                "value_loss_coef > 0 needs the current value-head outputs float[batch, seq] "
                "passed as values="
            )
        v = jnp.where(m > 0, values.astype(dtype), 0.0)
        returns = adv + p.old_values
        error = (v - returns) ** 2
        if c.value_clip_eps > 0:
            clipped = p.old_values + jnp.clip(v - p.old_values, -c.value_clip_eps, c.value_clip_eps)
            error = jnp.maximum(error, (clipped - returns) ** 2)
        value_loss = 0.5 * jnp.sum(w * error * m)
        loss = loss + c.value_loss_coef * value_loss
        metrics["value_loss"] = value_loss

    metrics.update(
        {
            "advantage/mean": masked_mean(adv, m),
            "advantage/std": masked_std(adv, m),
            "clip_fraction": masked_mean(1.0 - keep, m),
            "clip_fraction/high": masked_mean((adv > 0) * (keep == 0), m),
            "clip_fraction/low": masked_mean((adv < 0) * (keep == 0), m),
            "importance_weight/mean": masked_mean(ratio.weight, m),
            "importance_weight/bounded_fraction": masked_mean(ratio.weight != ratio.raw, m),
        }
    )
    metrics.update(
        common_metrics(
            p,
            reference_logprobs=batch.reference_logprobs,
            versions=batch.versions,
            entropy=entropy,
            step=step,
        )
    )
    return loss, metrics


class Objective:
    """The loss of one `AlgorithmConfig`, resolved and checked once; call it under jit.

    `objective(batch, logprobs, values=None, entropy=None, step=None) -> (loss, metrics)`.
    The `needs_*` flags tell the trainer which inputs to compute (e.g. skip the
    reference forward pass when no reference is read):

    needs_reference_logprobs: the batch must carry `reference_logprobs` (log π_ref);
    needs_rollout_values: the batch must carry `values`, V_old float[batch, seq]: the
        value head's outputs on the rollout tokens with the weights before the update
        (GAE's baseline and the value clip's centre), e.g. from the recompute pass that
        gives π_old; needs `model.value_head` (RunConfig checks it);
    needs_values: pass the current value-head outputs as `values=` (the value loss);
    needs_entropy: pass the per-position entropies as `entropy=` (the entropy bonus).
    """

    def __init__(self, config: AlgorithmConfig):
        self.config = config.resolved()
        c = self.config
        self.kind = c.name if not c.is_policy_gradient else "policy_gradient"
        if c.is_policy_gradient:
            self.needs_reference_logprobs = kl_may_be_nonzero(c)
            self.needs_values = c.value_loss_coef > 0
            self.needs_rollout_values = c.advantage == "gae"
            self.needs_entropy = c.entropy_coef > 0
        else:
            self.needs_reference_logprobs = True
            self.needs_values = self.needs_rollout_values = self.needs_entropy = False

    def __call__(
        self,
        batch: RolloutBatch,
        logprobs: jax.Array,
        *,
        values: jax.Array | None = None,
        entropy: jax.Array | None = None,
        step=None,
    ) -> tuple[jax.Array, Metrics]:
        if self.kind == "trajectory_balance":
            return trajectory_balance.trajectory_balance_loss(
                self.config, batch, logprobs, entropy=entropy, step=step
            )
        if self.kind == "online_dpo":
            return dpo.online_dpo_loss(self.config, batch, logprobs, entropy=entropy, step=step)
        return policy_gradient_loss(
            self.config, batch, logprobs, values=values, entropy=entropy, step=step
        )

    def __repr__(self) -> str:
        return f"Objective({describe(self.config)})"


def build_objective(config: AlgorithmConfig) -> Objective:
    """The objective of `config` (any preset, with its overrides)."""
    return Objective(config)


def objective(
    batch: RolloutBatch,
    logprobs: jax.Array,
    *,
    config: AlgorithmConfig,
    values: jax.Array | None = None,
    entropy: jax.Array | None = None,
    step=None,
) -> tuple[jax.Array, Metrics]:
    """`build_objective(config)(batch, logprobs, ...)` in one call (config is hashable:
    pass it as a static argument under jit)."""
    return Objective(config)(batch, logprobs, values=values, entropy=entropy, step=step)


def describe(config: AlgorithmConfig) -> str:
    """One line naming the parts, e.g. for the run log."""
    c = config.resolved()
    if not c.is_policy_gradient:
        beta = f"β={c.kl_beta}"
        if c.kl_beta_decay_steps:
            beta += f"→{c.kl_beta_final} by step {c.kl_beta_decay_steps}"
        if c.kl_beta_cut_step:
            beta += f", {c.kl_beta_final} from step {c.kl_beta_cut_step}"
        reset = c.reference_reset_every
        return f"{c.name}: {beta}, reference reset {f'every {reset}' if reset else 'never'}"
    rho = c.importance_weight
    if rho.endswith("truncated"):
        rho += f"(ρ_max={c.rho_max})"
    elif rho.endswith("clipped"):
        rho += f"(ρ∈[{c.rho_min}, {c.rho_max}])"
    if rho.startswith("sequence"):
        rho += f"[{c.sequence_ratio}]"
    mask = c.gradient_mask
    if mask != "keep_all":
        mask += f"(ε_low={c.clip_eps_low}, ε_high={c.clip_eps_high})"
    kl = f"{c.kl_beta}·{c.kl_estimator}" if kl_may_be_nonzero(c) else "none"
    return f"{c.name}: w={c.aggregation} ρ={rho} A={c.advantage} M={mask} R={kl}"
