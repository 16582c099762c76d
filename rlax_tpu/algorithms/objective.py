"""The RL objective: one function assembling the parts named by an `AlgorithmConfig`.

    J = Σ_{i,t} w_{i,t} · sg(ρ_{i,t}) · sg(A_{i,t}) · M_{i,t} · log π_θ(y_{i,t}) − β·R_{i,t}(θ)
    loss = −J − c_H·Σ w·H + c_V·L_V

The gradient w.r.t. log π_θ is exactly w·sg(ρ)·sg(A)·M (+ the regulariser's), as in
RLAX Eq. 3. The reported loss value is the published objective: for ratio-gradient
algorithms (an untransformed ratio: PPO, GRPO, DAPO, GSPO, ...) it is the clipped
surrogate min(ρA, clip(ρ)A) (with dual clip, SAPO's soft gate and GMPO's geometric
mean, their own), whose gradient is that same expression; for log-π algorithms
(REINFORCE, RLOO, AIPO, CISPO) it is the surrogate itself. A rollout correction
multiplies each token's term, value and gradient alike, by one more stop-gradient factor.

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
from rlax_tpu.algorithms.covariance import COVARIANCE_CONTROLS
from rlax_tpu.algorithms.metrics import finish_metrics, masked_mean
from rlax_tpu.algorithms.parts import (
    ADVANTAGES,
    AGGREGATIONS,
    GRADIENT_MASKS,
    IMPORTANCE_WEIGHTS,
    PartInputs,
    Ratio,
    dual_clip_mask,
    fold_kl_into_rewards,
    geometric_mean_clip,
    is_ratio_objective,
    kl_estimate,
    part_inputs,
    ratio_in_clamp,
    soft_gate,
    weight_level,
)
from rlax_tpu.algorithms.returns import masked_whiten
from rlax_tpu.algorithms.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    Correction,
    check_inputs,
    gated,
    mismatch_gate,
    needs_rollout_logprobs,
)
from rlax_tpu.algorithms.schedules import kl_beta_at, kl_may_be_nonzero
from rlax_tpu.config import AlgorithmConfig

Metrics = dict[str, jax.Array]


def needs_rollout_values(c: AlgorithmConfig) -> bool:
    """Whether V_old (batch.values) is read: GAE's baseline, or the clipped value loss's centre."""
    return c.advantage == "gae" or (c.value.loss_coef > 0 and c.value.clip_eps > 0)


def _surrogate_value(
    c: AlgorithmConfig,
    p: PartInputs,
    ratio: Ratio,
    adv: jax.Array,
    keep: jax.Array,
    dual: jax.Array,
) -> jax.Array:
    """float[batch, seq]: the published per-token objective of a ratio-gradient algorithm,
    whose gradient w.r.t. log π_θ(y_t) is ρ·A·M: PPO's min(ρA, clip(ρ)A), −(verl's
    max(min(ρA, clip(ρ)A), c·A)) for A < 0 under dual clip, SAPO's f(ρ)·A, GMPO's A·G."""
    if c.gradient_mask == "token_soft_gate":
        value = adv * soft_gate(ratio.raw, adv, c)
    elif c.gradient_mask == "sequence_log_clip":
        value = adv * ratio.weight
    else:
        if c.gradient_mask == "keep_all":
            bounded = ratio.raw
        else:
            bounded = jnp.clip(ratio.raw, 1 - c.clip.eps_low, 1 + c.clip.eps_high)
        value = adv * jnp.where(dual > 0, c.clip.dual_c, jnp.where(keep > 0, ratio.raw, bounded))
    value = value * p.mask
    if weight_level(c.importance_weight) == "sequence" and c.sequence_ratio == "product":
        # One term per sequence: d log ρ_i / d log π_t = 1, so spread it over the tokens.
        value = value / jnp.maximum(p.lengths, 1)[:, None]
    return value


def _policy_term(
    c: AlgorithmConfig,
    p: PartInputs,
    lp: jax.Array,
    w: jax.Array,
    adv: jax.Array,
    correction: Correction,
    step,
) -> tuple[jax.Array, Metrics]:
    """The policy part of J and the metrics of its ratio, masks and covariance control.

    Value Σ w·c·(surrogate), gradient Σ w·c·ρ·A·M·∇log π_θ, c the rollout correction's
    factor; M is the clip mask times the dual clip's and Clip-Cov's, and for a ratio-gradient
    objective the ratio's clamp (M = 0 where they flatten the objective); KL-Cov subtracts
    κ·Σ w·c·|log π_θ − log π_old| on its tokens.
    """
    sg = jax.lax.stop_gradient
    m, corr = p.mask, correction.weight
    if c.gradient_mask == "sequence_log_clip":
        ratio, clip_keep = geometric_mean_clip(p, adv, c)
    else:
        ratio = IMPORTANCE_WEIGHTS[c.importance_weight].fn(p, c)
        clip_keep = GRADIENT_MASKS[c.gradient_mask].fn(ratio.raw, adv, m, c)
    ratio, clip_keep = jax.tree.map(sg, (ratio, clip_keep))
    dual = dual_clip_mask(ratio.raw, adv, m, c)
    keep = clip_keep * (1 - dual)
    selected = COVARIANCE_CONTROLS[c.covariance_control].fn(p, adv, keep, c, step)
    cov_keep = 1 - selected if c.covariance_control == "clip_cov" else 1.0
    in_clamp = 1.0
    if is_ratio_objective(c.importance_weight):
        # It differentiates exp(clamped log-ratio): nothing beyond the clamp (verl, Tunix).
        in_clamp = ratio_in_clamp(p, c, weight_level(c.importance_weight))
    coef = ratio.weight * adv * keep * in_clamp * cov_keep * corr  # ∂J/∂log π_θ, before w

    if is_ratio_objective(c.importance_weight):
        # The published objective's value; gradient w·coef through log π_θ.
        value = _surrogate_value(c, p, ratio, adv, keep, dual) * cov_keep * corr
        pg = sg(jnp.sum(w * value)) + jnp.sum(w * coef * (lp - sg(lp)))
    else:
        pg = jnp.sum(w * coef * lp)
    metrics: Metrics = {
        "clip_fraction": masked_mean(keep * cov_keep == 0, m),
        "clip_fraction/high": masked_mean((adv > 0) * (clip_keep == 0), m),
        "clip_fraction/low": masked_mean((adv < 0) * (clip_keep == 0), m),
        # verl's pg_clipfrac_lower (Tunix's pg_clipfrac_lower with epsilon_c) exactly.
        "clip_fraction/dual": masked_mean(dual, m),
        "importance_weight/mean": masked_mean(ratio.weight, m),
        "importance_weight/bounded_fraction": masked_mean(ratio.weight != ratio.raw, m),
    }
    if c.covariance_control != "none":
        metrics["covariance/selected_fraction"] = masked_mean(selected, m)
    if c.covariance_control == "kl_cov":
        drift = jnp.abs(lp - p.behaviour_logprobs) * m
        penalty = jnp.sum(w * corr * selected * drift)
        pg = pg - c.covariance.kl_coef * penalty
        metrics["covariance/kl_penalty"] = penalty
    return pg, metrics


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
    current value-head outputs (needed when value.loss_coef > 0), differentiated;
    entropy: float[batch, seq] per-position policy entropies (needed when entropy_coef > 0);
    step: int or int32 scalar, the trainer step (β schedule, staleness metrics, Clip-Cov's
    random draw; None draws as step 0).
    """
    c = config.resolved()
    p = part_inputs(batch, logprobs, need_old_values=needs_rollout_values(c))
    m = p.mask
    dtype = m.dtype
    lp = jnp.where(m > 0, logprobs.astype(dtype), 0.0)  # padding may hold -inf or NaN
    beta = kl_beta_at(c, step, dtype)
    metrics: Metrics = {}
    if c.kl.in_reward and kl_may_be_nonzero(c):
        if batch.reference_logprobs is None:
            raise MissingInputError(
                f"kl.in_reward with kl.beta > 0 ({c.name}) needs batch.reference_logprobs; "
                "set kl.beta=0 to train without a reference"
            )
        p, reward_kl = fold_kl_into_rewards(p, batch.reference_logprobs, beta, c)
        metrics["kl_in_reward"] = masked_mean(reward_kl, m)

    # The mismatch gate drops sequences from the aggregation's denominators too (Tunix).
    check_inputs(c, p)
    kept = mismatch_gate(p, c)
    w = AGGREGATIONS[c.aggregation].fn(gated(p, kept), c)
    estimated = jax.lax.stop_gradient(ADVANTAGES[c.advantage].fn(p, c))
    adv = masked_whiten(estimated, m) if c.advantage_options.whiten else estimated
    correction = jax.tree.map(
        jax.lax.stop_gradient, ROLLOUT_CORRECTIONS[c.rollout_correction].fn(p, c)
    )
    pg, pg_metrics = _policy_term(c, p, lp, w, adv, correction, step)
    loss = -pg
    metrics["policy_loss"] = -pg

    if kl_may_be_nonzero(c) and not c.kl.in_reward:
        if batch.reference_logprobs is None:
            raise MissingInputError(
                f"kl.beta > 0 ({c.name}) needs batch.reference_logprobs; set kl.beta=0 to "
                "train without a reference"
            )
        d = jnp.where(m > 0, lp - batch.reference_logprobs.astype(dtype), 0.0)
        kl_term = jnp.sum(w * kl_estimate(d, c) * m)
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

    if c.value.loss_coef > 0:
        if values is None:
            raise MissingInputError(
                "value.loss_coef > 0 needs the current value-head outputs float[batch, seq] "
                "passed as values="
            )
        v = jnp.where(m > 0, values.astype(dtype), 0.0)
        if p.returns is not None:
            target = p.returns
        elif c.advantage == "gae":
            target = estimated + p.old_values  # GAE's returns, before any whitening
        else:
            raise MissingInputError(
                f"value.loss_coef > 0 with advantage={c.advantage!r} needs batch.returns: "
                "the value targets float[batch, seq] (advantage='gae' regresses A + V_old)"
            )
        error = (v - target) ** 2
        if c.value.clip_eps > 0:
            # value.clip_eps is verl's cliprange_value (Tunix's clip_range_value).
            clipped = p.old_values + jnp.clip(v - p.old_values, -c.value.clip_eps, c.value.clip_eps)
            error = jnp.maximum(error, (clipped - target) ** 2)
        value_loss = 0.5 * jnp.sum(w * error * m)
        loss = loss + c.value.loss_coef * value_loss
        metrics["value_loss"] = value_loss

    metrics.update(pg_metrics)
    if needs_rollout_logprobs(c):
        valid = p.valid.astype(dtype)
        metrics.update(
            {
                "rollout_correction/weight_mean": masked_mean(correction.weight, m),
                "rollout_correction/truncated_fraction": masked_mean(correction.truncated, m),
                "rollout_correction/masked_fraction": masked_mean(correction.masked, m),
                "rollout_correction/gated_sequence_fraction": masked_mean(1.0 - kept, valid),
            }
        )
    return loss, finish_metrics(
        metrics, p, batch, advantage=adv, advantage_mask=m, entropy=entropy, step=step
    )


class Objective:
    """The loss of one `AlgorithmConfig`, resolved and checked once; call it under jit.

    `objective(batch, logprobs, values=None, entropy=None, step=None) -> (loss, metrics)`.
    The `needs_*` flags tell the trainer which inputs to compute (e.g. skip the
    reference forward pass when no reference is read):

    needs_reference_logprobs: the batch must carry `reference_logprobs` (log π_ref): for a
        KL term, or only for the `kl` metric (`kl.log_reference`);
    needs_rollout_values: the batch must carry `values`, V_old float[batch, seq]: the
        value head's outputs on the rollout tokens with the weights before the update
        (GAE's baseline and the value clip's centre), e.g. from the recompute pass that
        gives π_old; needs `model.value_head` (RunConfig checks it);
    needs_values: pass the current value-head outputs as `values=` (the value loss);
    needs_entropy: pass the per-position entropies as `entropy=` (the entropy bonus);
    needs_rollout_logprobs: the batch must carry `rollout_logprobs`, the inference
        workers' own log π_rollout, next to the trainer's recomputed π_old in
        `behaviour_logprobs` (the rollout correction and the mismatch gate).
    """

    def __init__(self, config: AlgorithmConfig):
        self.config = config.resolved()
        c = self.config
        self.kind = c.name if not c.is_policy_gradient else "policy_gradient"
        if c.is_policy_gradient:
            self.needs_reference_logprobs = kl_may_be_nonzero(c) or c.kl.log_reference
            self.needs_values = c.value.loss_coef > 0
            self.needs_rollout_values = needs_rollout_values(c)
            self.needs_entropy = c.entropy_coef > 0
            self.needs_rollout_logprobs = needs_rollout_logprobs(c)
        else:
            self.needs_reference_logprobs = True
            self.needs_values = self.needs_rollout_values = self.needs_entropy = False
            self.needs_rollout_logprobs = False

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
        beta = f"β={c.kl.beta}"
        if c.kl.beta_decay_steps:
            beta += f"→{c.kl.beta_final} by step {c.kl.beta_decay_steps}"
        if c.kl.beta_cut_step:
            beta += f", {c.kl.beta_final} from step {c.kl.beta_cut_step}"
        reset = c.kl.reference_reset_every
        return f"{c.name}: {beta}, reference reset {f'every {reset}' if reset else 'never'}"
    rho = c.importance_weight
    if rho.endswith("truncated"):
        rho += f"(ρ_max={c.importance.rho_max})"
    elif rho.endswith("clipped"):
        rho += f"(ρ∈[{c.importance.rho_min}, {c.importance.rho_max}])"
    if rho.startswith("sequence"):
        rho += f"[{c.sequence_ratio}]"
    mask = c.gradient_mask
    if mask == "token_soft_gate":
        mask += f"(τ_pos={c.soft_gate.tau_pos}, τ_neg={c.soft_gate.tau_neg})"
    elif mask != "keep_all":
        mask += f"(ε_low={c.clip.eps_low}, ε_high={c.clip.eps_high})"
    if c.clip.dual_c:
        mask += f"+dual_clip(c={c.clip.dual_c})"
    kl = f"{c.kl.beta}·{c.kl_estimator}" if kl_may_be_nonzero(c) else "none"
    if c.kl.clamp and kl_may_be_nonzero(c):
        kl += f"(clamped to ±{c.kl.clamp})"
    if c.kl.in_reward and kl_may_be_nonzero(c):
        kl += " in the reward"
    adv = c.advantage
    if adv == "pass_at_k":
        adv += f"(k={c.advantage_options.pass_at_k})"
    if c.advantage_options.whiten:
        adv += "[whitened]"
    line = f"{c.name}: w={c.aggregation} ρ={rho} A={adv} M={mask} R={kl}"
    if c.covariance_control == "clip_cov":
        cov = c.covariance
        line += f" cov=clip_cov(ratio={cov.ratio}, cov∈({cov.bounds_low}, {cov.bounds_high}))"
    elif c.covariance_control == "kl_cov":
        line += f" cov=kl_cov(ratio={c.covariance.ratio}, κ={c.covariance.kl_coef})"
    if c.rollout_correction.endswith("tis"):
        line += f" rollout={c.rollout_correction}(C={c.rollout_is.threshold})"
    elif c.rollout_correction.endswith("mis"):
        lower = c.rollout_is.threshold_lower or 1 / c.rollout_is.threshold
        line += f" rollout={c.rollout_correction}([{lower:g}, {c.rollout_is.threshold}])"
    if c.rollout_is.gate_threshold:
        line += f" gate(error≤{c.rollout_is.gate_threshold})"
    return line
