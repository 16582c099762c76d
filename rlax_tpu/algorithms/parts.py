"""The parts of the policy-gradient objective (DESIGN §6), each in a registry by name.

    J = Σ_{i,t} w_{i,t} · sg(ρ_{i,t}) · sg(A_{i,t}) · M_{i,t} · log π_θ(y_{i,t}) − β·R_{i,t}(θ)

w: AGGREGATIONS, ρ: IMPORTANCE_WEIGHTS, A: ADVANTAGES, M: GRADIENT_MASKS, R: KL_ESTIMATORS.
A part is a pure function of a `PartInputs` (everything but θ is stop-gradient), so a fix
to one part reaches every preset that uses it. The names are exactly the JAX-free tuples
on `AlgorithmConfig` (tested). Shapes: [batch, seq] per token, [batch] per sequence.
Beside them: the rollout correction's factor on each term (rollout_correction) and the
covariance controls Clip-Cov and KL-Cov (covariance).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rlax_tpu.algorithms import groups, returns
from rlax_tpu.algorithms.batch import MissingInputError, RolloutBatch
from rlax_tpu.config import AlgorithmConfig

# Added to std denominators (verl's value); groups with equal rewards get exactly A = 0.
STD_EPS = 1e-6
# Log-ratios are clamped to ±MAX_LOG_RATIO before exp, so ratios stay finite in float32
# (verl's and Tunix's exp(clamp(log r, −20, 20))). The clamp is flat beyond its bounds, so an
# objective that differentiates the ratio has no gradient there (`ratio_in_clamp`, part of
# M): PPO's clip leaves r > e^20 with A < 0 unclipped, where the weight would be e^20·|A|.
MAX_LOG_RATIO = 20.0


class PartInputs(NamedTuple):
    """Everything a part may read; all stop-gradient.

    mask: float[batch, seq] response mask; lengths: float[batch] response tokens per row;
    valid: bool[batch] rows with a response; group_ids: int32[batch]; rewards:
    float[batch]; logprobs: float[batch, seq] sg(log π_θ); behaviour_logprobs:
    float[batch, seq] log μ; old_values: float[batch, seq] | None (GAE). The optional
    inputs of `RolloutBatch` (None when the batch does not carry them), zero off the
    response: rollout_logprobs float[batch, seq] log π_rollout; token_rewards,
    token_advantages, returns float[batch, seq]; baseline_rewards float[batch].
    """

    mask: jax.Array
    lengths: jax.Array
    valid: jax.Array
    group_ids: jax.Array
    rewards: jax.Array
    logprobs: jax.Array
    behaviour_logprobs: jax.Array
    old_values: jax.Array | None
    rollout_logprobs: jax.Array | None = None
    token_rewards: jax.Array | None = None
    token_advantages: jax.Array | None = None
    returns: jax.Array | None = None
    baseline_rewards: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Part:
    """A registered part: its function, the formula it computes and where it is from."""

    name: str
    fn: Callable
    formula: str
    source: str


def _registry(*parts: Part) -> dict[str, Part]:
    return {p.name: p for p in parts}


def per_token(x: jax.Array, mask: jax.Array) -> jax.Array:
    """A per-sequence float[batch] broadcast to float[batch, seq], zero off the response."""
    return x[:, None] * mask


# -- w: aggregation weights ---------------------------------------------------------------


def _num_rows(p: PartInputs) -> jax.Array:
    return jnp.maximum(jnp.sum(p.valid), 1).astype(p.mask.dtype)


def _sequence_mean(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    return p.mask / (jnp.maximum(p.lengths, 1)[:, None] * _num_rows(p))


def _token_mean(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    return p.mask / jnp.maximum(jnp.sum(p.mask), 1)


def _group_token_mean(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    group_tokens = groups.group_mean(p.lengths, p.group_ids, p.valid) * groups.group_count(
        p.group_ids, p.valid
    )
    n_groups = jnp.maximum(groups.num_groups(p.group_ids, p.valid), 1)
    return p.mask / (jnp.maximum(group_tokens, 1)[:, None] * n_groups)


def _max_length(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    max_len = c.max_response_len or p.mask.shape[1]
    return p.mask / (max_len * _num_rows(p))


def _sequence_sum(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    return p.mask / _num_rows(p)


AGGREGATIONS = _registry(
    Part(
        "sequence_mean",
        _sequence_mean,
        "w = 1/(B·|y_i|): mean over each sequence's tokens, then over sequences",
        "GRPO (Shao et al. 2024, Eq. 3)",
    ),
    Part(
        "token_mean",
        _token_mean,
        "w = 1/Σ_{j}|y_j|: mean over every response token of the batch",
        "PPO for LLMs (Huang et al. 2024); verl's token-mean",
    ),
    Part(
        "group_token_mean",
        _group_token_mean,
        "w = 1/(#groups·Σ_{j∈g(i)}|y_j|): token mean within each group, then over groups",
        "DAPO (Yu et al. 2025, Eq. 8); CISPO (Chen et al. 2025, Eq. 4)",
    ),
    Part(
        "max_length",
        _max_length,
        "w = 1/(B·L): constant denominator, L = the generation budget",
        "Dr. GRPO (Liu et al. 2025); RLAX App. A",
    ),
    Part(
        "sequence_sum",
        _sequence_sum,
        "w = 1/B: the sequence log-likelihood Σ_t log π, averaged over sequences",
        "REINFORCE (Williams 1992); RLOO (Kool et al. 2019); AIPO (Wu et al. 2025)",
    ),
)

# -- ρ: importance weights (stop-gradient) --------------------------------------------------


class Ratio(NamedTuple):
    """raw: float[batch, seq] π/μ at the weight's level (a sequence ratio is broadcast over
    its tokens; 1 for "one"); weight: float[batch, seq] ρ after truncation or clipping."""

    raw: jax.Array
    weight: jax.Array


def token_log_ratio(p: PartInputs) -> jax.Array:
    """float[batch, seq]: log π_θ − log μ per response token (0 elsewhere), clamped."""
    diff = jnp.clip(p.logprobs - p.behaviour_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return jnp.where(p.mask > 0, diff, 0.0)


def _sequence_log_ratio_unclamped(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    total = jnp.sum(token_log_ratio(p), axis=1)
    if c.sequence_ratio == "geometric_mean":
        total = total / jnp.maximum(p.lengths, 1)
    return total


def sequence_log_ratio(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    """float[batch]: log of the sequence ratio: the mean (GSPO) or sum of token log-ratios."""
    return jnp.clip(_sequence_log_ratio_unclamped(p, c), -MAX_LOG_RATIO, MAX_LOG_RATIO)


def ratio_in_clamp(p: PartInputs, c: AlgorithmConfig, level: str) -> jax.Array:
    """float[batch, seq]: 1 where the ratio at `level` ("token" or "sequence") is inside its
    clamp, else 0 (and 0 off the response).

    The ratio is exp(clip(log r, ±MAX_LOG_RATIO)); like torch.clamp in verl's
    compute_policy_loss, the clip passes the gradient inside its bounds (ends included) and
    none beyond. A sequence ratio clamps each token's log-ratio, then their mean or sum:
    token t keeps its gradient when both are inside.
    """
    inside = jnp.abs(p.logprobs - p.behaviour_logprobs) <= MAX_LOG_RATIO
    if level == "sequence":
        sequence = jnp.abs(_sequence_log_ratio_unclamped(p, c)) <= MAX_LOG_RATIO
        inside = inside & sequence[:, None]
    return jnp.where(inside, p.mask, 0.0)


def _level_ratio(p: PartInputs, c: AlgorithmConfig, level: str) -> jax.Array:
    if level == "token":
        return jnp.exp(token_log_ratio(p)) * p.mask
    return per_token(jnp.exp(sequence_log_ratio(p, c)), p.mask)


def _weight(level: str, transform: str) -> Callable:
    def fn(p: PartInputs, c: AlgorithmConfig) -> Ratio:
        raw = _level_ratio(p, c, level)
        if transform == "truncated":
            weight = jnp.minimum(raw, c.importance.rho_max)
        elif transform == "clipped":
            weight = jnp.clip(raw, c.importance.rho_min, c.importance.rho_max)
        else:
            weight = raw
        return Ratio(raw, weight * p.mask)

    return fn


def _one(p: PartInputs, c: AlgorithmConfig) -> Ratio:
    return Ratio(p.mask, p.mask)


IMPORTANCE_WEIGHTS = _registry(
    Part("one", _one, "ρ = 1 (treats the data as on-policy)", "REINFORCE, RLOO"),
    Part(
        "token",
        _weight("token", "raw"),
        "ρ_t = π_θ(y_t)/μ(y_t)",
        "PPO (Schulman et al. 2017); GRPO; RLAX Eq. 3",
    ),
    Part(
        "token_truncated",
        _weight("token", "truncated"),
        "ρ_t = min(π_θ(y_t)/μ(y_t), ρ_max)",
        "AIPO (Wu et al. 2025, §6)",
    ),
    Part(
        "token_clipped",
        _weight("token", "clipped"),
        "ρ_t = clip(π_θ(y_t)/μ(y_t), ρ_min, ρ_max)",
        "CISPO (Chen et al. 2025, Eq. 4: ρ_min = 1−ε_low^IS, ρ_max = 1+ε_high^IS)",
    ),
    Part(
        "sequence",
        _weight("sequence", "raw"),
        "ρ_i = (π_θ(y_i)/μ(y_i))^{1/|y_i|} (geometric_mean) or π_θ(y_i)/μ(y_i) (product)",
        "GSPO (Zheng et al. 2025); Proximal RLOO (Noukhovitch et al. 2024)",
    ),
    Part(
        "sequence_truncated",
        _weight("sequence", "truncated"),
        "ρ_i = min(sequence ratio, ρ_max)",
        "truncated IS at sequence level (AIPO's rule on GSPO's ratio)",
    ),
    Part(
        "sequence_clipped",
        _weight("sequence", "clipped"),
        "ρ_i = clip(sequence ratio, ρ_min, ρ_max)",
        "clipped IS at sequence level (CISPO's rule on GSPO's ratio)",
    ),
)


def weight_level(name: str) -> str:
    """ "token", "sequence" or "none" (for "one")."""
    return "none" if name == "one" else name.split("_")[0]


def is_ratio_objective(name: str) -> bool:
    """Whether the published objective differentiates the ratio itself (PPO family).

    For these (an untransformed ratio) the reported loss is the published clipped
    surrogate min(ρA, clip(ρ)A), whose gradient is w·ρ·A·M·∇log π; for the others
    (REINFORCE, AIPO, CISPO) it is the log-π surrogate Σ w·sg(ρ)·A·M·log π itself.
    """
    return name in ("token", "sequence")


# -- A: advantage estimators ---------------------------------------------------------------
# Sequence-level estimators score r_i = the sequence reward + Σ_t token_rewards_{i,t} (dense
# rewards, a KL folded into the reward); token-level ones (gae, reinforce_pp_return_to_go,
# remax) read R_t = token_rewards_t + r_i·1[t = the row's last response token].


def last_token_mask(mask: jax.Array) -> jax.Array:
    """float[batch, seq]: 1 at each row's last response token."""
    after = jnp.cumsum(mask[:, ::-1], axis=1)[:, ::-1]  # response tokens at or after t
    return mask * (after == 1)


def token_level_rewards(p: PartInputs) -> jax.Array:
    """float[batch, seq] R_t = token_rewards_t + r_i·1[t = the last response token]."""
    at_end = last_token_mask(p.mask) * p.rewards[:, None]
    return at_end if p.token_rewards is None else at_end + p.token_rewards


def sequence_rewards(p: PartInputs) -> jax.Array:
    """float[batch] r_i + Σ_t token_rewards_{i,t} (0 on rows without a response)."""
    if p.token_rewards is None:
        return p.rewards
    return p.rewards + jnp.sum(p.token_rewards, axis=1)


def fold_kl_into_rewards(
    p: PartInputs, reference_logprobs: jax.Array, beta: jax.Array, c: AlgorithmConfig
) -> tuple[PartInputs, jax.Array]:
    """`p` with R_t −= β·kl_t folded into its token rewards, and kl float[batch, seq].

    kl_t is the configured estimator (`kl_estimate`: kl_estimator, kl.clamp) of
    d = log π_behaviour − log π_ref (verl's apply_kl_penalty on old_log_prob − ref_log_prob;
    Tunix's PPO), stop-gradient: the KL is part of the reward, not of the loss.
    """
    ref = jnp.where(p.mask > 0, reference_logprobs.astype(p.mask.dtype), 0.0)
    d = jnp.where(p.mask > 0, p.behaviour_logprobs - ref, 0.0)
    kl = jax.lax.stop_gradient(kl_estimate(d, c) * p.mask)
    shaped = -beta * kl if p.token_rewards is None else p.token_rewards - beta * kl
    return p._replace(token_rewards=shaped), kl


def _group_baselined(p: PartInputs, r: jax.Array, adv: jax.Array) -> jax.Array:
    """A group whose rewards r are all equal carries no signal: exactly 0, not rounding noise."""
    equal = groups.group_all_equal(r, p.group_ids, p.valid)
    return per_token(jnp.where(equal | ~p.valid, 0.0, adv), p.mask)


def _group_mean_std(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    r = sequence_rewards(p)
    mean = groups.group_mean(r, p.group_ids, p.valid)
    std = groups.group_std(r, p.group_ids, p.valid)
    return _group_baselined(p, r, (r - mean) / (std + STD_EPS))


def _group_mean(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    r = sequence_rewards(p)
    return _group_baselined(p, r, r - groups.group_mean(r, p.group_ids, p.valid))


def _leave_one_out(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    r = sequence_rewards(p)
    n = groups.group_count(p.group_ids, p.valid).astype(r.dtype)
    total = groups.group_mean(r, p.group_ids, p.valid) * n
    others = (total - r) / jnp.maximum(n - 1, 1)
    return _group_baselined(p, r, jnp.where(n > 1, r - others, 0.0))


def _batch_std(x: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    n = jnp.maximum(jnp.sum(valid), 1).astype(x.dtype)
    mean = jnp.sum(jnp.where(valid, x, 0)) / n
    var = jnp.sum(jnp.where(valid, (x - mean) ** 2, 0)) / jnp.maximum(n - 1, 1)
    return mean, jnp.sqrt(var)


def _batch_norm(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    r = sequence_rewards(p)
    mean, std = _batch_std(r, p.valid)
    return per_token(jnp.where(p.valid, (r - mean) / (std + STD_EPS), 0.0), p.mask)


def _group_mean_batch_norm(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    r = sequence_rewards(p)
    centred = r - groups.group_mean(r, p.group_ids, p.valid)
    centred = jnp.where(groups.group_all_equal(r, p.group_ids, p.valid), 0.0, centred)
    _, std = _batch_std(centred, p.valid)
    return per_token(jnp.where(p.valid, centred / (std + STD_EPS), 0.0), p.mask)


def gae(
    mask: jax.Array,
    rewards: jax.Array,
    old_values: jax.Array,
    gamma: float,
    lam: float,
    token_rewards: jax.Array | None = None,
) -> jax.Array:
    """float[batch, seq] GAE (Schulman et al. 2015) over the response tokens.

    The sequence reward float[batch] arrives at the last response token, plus the dense
    token_rewards float[batch, seq] (zero off the response) at theirs; V after the last
    token is 0. δ_t = R_t + γ·V_{t+1} − V_t, A_t = δ_t + γλ·A_{t+1}; non-response
    positions are skipped (their carry passes through) and get A = 0.
    """
    rewards_t = last_token_mask(mask) * rewards[:, None]
    if token_rewards is not None:
        rewards_t = rewards_t + token_rewards

    def step(carry, x):
        next_adv, next_value = carry
        r, v, m = x
        adv = r + gamma * next_value - v + gamma * lam * next_adv
        on = m > 0
        return (jnp.where(on, adv, next_adv), jnp.where(on, v, next_value)), jnp.where(on, adv, 0.0)

    zeros = jnp.zeros_like(rewards)
    xs = (rewards_t.T, old_values.astype(mask.dtype).T, mask.T)
    _, adv = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
    return adv.T


def _gae(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    return gae(
        p.mask,
        p.rewards,
        p.old_values,
        c.advantage_options.gae_gamma,
        c.advantage_options.gae_lambda,
        p.token_rewards,
    )


def _reward(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    return per_token(jnp.where(p.valid, sequence_rewards(p), 0.0), p.mask)


def _given(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    if p.token_advantages is None:
        raise MissingInputError(
            "advantage='given' needs batch.token_advantages: the advantages computed "
            "outside the trainer, float[batch, seq]"
        )
    return p.token_advantages * p.mask


def _reinforce_pp_return_to_go(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    g = returns.returns_to_go(token_level_rewards(p), p.mask, c.advantage_options.gae_gamma)
    return returns.masked_whiten(g, p.mask)


def _remax(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    if p.baseline_rewards is None:
        raise MissingInputError(
            "advantage='remax' needs batch.baseline_rewards: the reward of each prompt's "
            "greedy response, float[batch]"
        )
    g = returns.returns_to_go(token_level_rewards(p), p.mask, 1.0)
    return g - per_token(p.baseline_rewards, p.mask)


def _opo(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    r = sequence_rewards(p)
    weighted = groups.group_mean(p.lengths * r, p.group_ids, p.valid)
    mean_length = groups.group_mean(p.lengths, p.group_ids, p.valid)
    return _group_baselined(p, r, r - weighted / jnp.maximum(mean_length, 1))


def _gpg(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    r = sequence_rewards(p)
    equal = groups.group_all_equal(r, p.group_ids, p.valid)
    rows = jnp.sum(p.valid).astype(r.dtype)
    live = jnp.sum(p.valid & ~equal).astype(r.dtype)
    alpha = rows / jnp.maximum(live, 1)
    return _group_baselined(p, r, alpha * (r - groups.group_mean(r, p.group_ids, p.valid)))


def _pass_at_k(p: PartInputs, c: AlgorithmConfig) -> jax.Array:
    correct = (sequence_rewards(p) > 0.5).astype(p.mask.dtype)
    adv = returns.pass_at_k_advantages(correct, p.group_ids, p.valid, c.advantage_options.pass_at_k)
    return per_token(adv, p.mask)


ADVANTAGES = _registry(
    Part(
        "group_mean_std",
        _group_mean_std,
        "A_i = (r_i − mean_g r)/(std_g r + 1e-6), std with n−1",
        "GRPO (Shao et al. 2024)",
    ),
    Part("group_mean", _group_mean, "A_i = r_i − mean_g r", "Dr. GRPO; AIPO (Wu et al. 2025)"),
    Part(
        "leave_one_out",
        _leave_one_out,
        "A_i = r_i − (Σ_{j∈g, j≠i} r_j)/(n_g − 1)",
        "RLOO (Kool et al. 2019; Ahmadian et al. 2024)",
    ),
    Part(
        "batch_norm",
        _batch_norm,
        "A_i = (r_i − mean_B r)/(std_B r + 1e-6)",
        "REINFORCE++ (Hu et al. 2025, global normalisation)",
    ),
    Part(
        "group_mean_batch_norm",
        _group_mean_batch_norm,
        "Ã_i = r_i − mean_g r; A_i = Ã_i/(std_B Ã + 1e-6)",
        "REINFORCE++-baseline (Hu et al. 2025); RLAX §4.2",
    ),
    Part(
        "gae",
        _gae,
        "A_t = Σ_l (γλ)^l δ_{t+l}, δ_t = R_t + γV_{t+1} − V_t",
        "GAE (Schulman et al. 2015); PPO; verl compute_gae_advantage_return",
    ),
    Part("reward", _reward, "A_i = r_i", "REINFORCE (Williams 1992)"),
    Part(
        "given",
        _given,
        "A_t = batch.token_advantages_t, computed outside the trainer",
        "any external estimator (verl's and Tunix's registries take custom ones)",
    ),
    Part(
        "reinforce_pp_return_to_go",
        _reinforce_pp_return_to_go,
        "G_t = Σ_{s≥t} γ^{s−t} R_s; A_t = (G_t − mean_B G)·rsqrt(var_B G + 1e-8) over the "
        "batch's response tokens, var with n−1",
        "REINFORCE++ (Hu et al. 2025); verl compute_reinforce_plus_plus_outcome_advantage",
    ),
    Part(
        "remax",
        _remax,
        "A_t = Σ_{s≥t} R_s − b_i, b_i = r(x_i, greedy response) (= r_i − b_i when the "
        "reward comes at the last token only)",
        "ReMax (Li et al. 2023); verl compute_remax_outcome_advantage",
    ),
    Part(
        "opo",
        _opo,
        "A_i = r_i − Σ_{j∈g}|y_j| r_j / Σ_{j∈g}|y_j| (length-weighted group baseline)",
        "OPO (Hao et al. 2025, optimal baseline); verl compute_opo_outcome_advantage",
    ),
    Part(
        "gpg",
        _gpg,
        "A_i = α(r_i − mean_g r), α = B/(B − M), M = rows in groups of equal rewards (F_norm = 1)",
        "GPG (Chu et al. 2025); AMAP-ML/GPG's adjust_gd",
    ),
    Part(
        "pass_at_k",
        _pass_at_k,
        "R̄ = 1 − C(N_neg,k)/C(N,k), σ = sqrt(R̄(1−R̄)); A_pos = (1−R̄)/σ, "
        "A_neg = (1 − R̄ − C(N_neg−1,k−1)/C(N−1,k−1))/σ; correct: r_i > 0.5; σ = 0 → 0",
        "Pass@k Training (Chen et al. 2025), the analytical advantage",
    ),
)

# -- M: gradient masks ---------------------------------------------------------------------


def clip_mask(raw: jax.Array, adv: jax.Array, mask: jax.Array, c: AlgorithmConfig) -> jax.Array:
    """float[batch, seq]: 0 where PPO's min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) is flat in θ.

    That is ρ > 1+ε_high with A > 0, or ρ < 1−ε_low with A < 0 (DAPO's clip-higher when
    ε_high > ε_low). `raw` is the ratio at the importance weight's level (token or sequence).
    """
    high = (adv > 0) & (raw > 1 + c.clip.eps_high)
    low = (adv < 0) & (raw < 1 - c.clip.eps_low)
    return jnp.where(high | low, 0.0, 1.0) * mask


def _keep_all(raw, adv, mask, c) -> jax.Array:
    return mask


def dual_clip_mask(
    raw: jax.Array, adv: jax.Array, mask: jax.Array, c: AlgorithmConfig
) -> jax.Array:
    """float[batch, seq]: 1 where dual-clip PPO caps the loss, else 0 (all 0 when off).

    Dual clip (Ye et al. 2020; verl's clip_ratio_c, Tunix's epsilon_c) takes, for
    A < 0, max(min(ρA, clip(ρ)A), c·A): where ρ > c that is the constant c·A, flat in θ,
    so the objective folds it into M (M = 0 there). `raw` is the ratio at the weight's
    level, as for `clip_mask`. The mean over response tokens is verl's pg_clipfrac_lower.
    """
    if not c.clip.dual_c:
        return jnp.zeros_like(mask)
    return jnp.where((adv < 0) & (raw > c.clip.dual_c), 1.0, 0.0) * mask


def soft_gate(raw: jax.Array, adv: jax.Array, c: AlgorithmConfig) -> jax.Array:
    """float[batch, seq] SAPO's gate f(r) = σ(τ(r − 1))·4/τ, τ = τ_pos if A > 0 else τ_neg.

    The per-token objective is f(r)·A in place of PPO's min(rA, clip(r)A); f(1) = 2/τ and
    f'(1) = 1, so near r = 1 it moves like rA and it flattens smoothly away from it.
    """
    tau = jnp.where(adv > 0, c.soft_gate.tau_pos, c.soft_gate.tau_neg)
    return jax.nn.sigmoid(tau * (raw - 1)) * 4 / tau


def _soft_gate_mask(raw, adv, mask, c) -> jax.Array:
    # d f(r)·A / d log π_θ = r·A·f'(r), f'(r) = 4σ(1 − σ): the soft mask times ρ = r.
    tau = jnp.where(adv > 0, c.soft_gate.tau_pos, c.soft_gate.tau_neg)
    s = jax.nn.sigmoid(tau * (raw - 1))
    return 4 * s * (1 - s) * mask


def log_clip_mask(
    log_ratio: jax.Array, adv: jax.Array, mask: jax.Array, c: AlgorithmConfig
) -> jax.Array:
    """float[batch, seq]: 0 where GMPO clips the token log-ratio, against A's sign.

    log_ratio: float[batch, seq] log r_t per token. Clipped: A > 0 and log r_t > ε_high,
    or A < 0 and log r_t < −ε_low (the bounds are in log space: r ∉ (e^−ε_low, e^ε_high)).
    """
    high = (adv > 0) & (log_ratio > c.clip.eps_high)
    low = (adv < 0) & (log_ratio < -c.clip.eps_low)
    return jnp.where(high | low, 0.0, 1.0) * mask


def _log_clip_mask_of_ratio(raw, adv, mask, c) -> jax.Array:
    # The registry's signature takes a ratio; GMPO's objective calls log_clip_mask itself.
    return log_clip_mask(jnp.log(jnp.where(mask > 0, raw, 1.0)), adv, mask, c)


def geometric_mean_clip(
    p: PartInputs, adv: jax.Array, c: AlgorithmConfig
) -> tuple[Ratio, jax.Array]:
    """GMPO's sequence weight and token mask (Zhao et al. 2025; verl's geo_mean).

    J_i = A_i·exp(1/|y_i| Σ_t sgn(A)·min(sgn(A)·log r_t, sgn(A)·clip(log r_t, −ε_low,
    ε_high))): each token's log-ratio is clipped on the side A pushes it, then averaged.
    Returns Ratio(raw = exp(mean_t log r_t) the unclipped (GSPO) ratio, weight = the
    clipped geometric mean G_i), both broadcast over the tokens, and M_t = 0 on the
    clipped tokens: ∂J_i/∂log π_θ(y_t) = A_i·G_i·M_t/|y_i|, i.e. w = 1/(B·|y_i|), ρ = G_i.
    """
    log_r = token_log_ratio(p)
    keep = log_clip_mask(log_r, adv, p.mask, c)
    clipped = jnp.where(keep > 0, log_r, jnp.clip(log_r, -c.clip.eps_low, c.clip.eps_high))
    length = jnp.maximum(p.lengths, 1)
    raw = jnp.exp(jnp.sum(log_r, axis=1) / length)
    weight = jnp.exp(jnp.sum(clipped * p.mask, axis=1) / length)
    return Ratio(per_token(raw, p.mask), per_token(weight, p.mask)), keep


GRADIENT_MASKS = _registry(
    Part("keep_all", _keep_all, "M = 1", "REINFORCE, AIPO, CISPO"),
    Part(
        "ppo_clip",
        clip_mask,
        "M_t = 0 if (A>0 ∧ ρ_t>1+ε_high) ∨ (A<0 ∧ ρ_t<1−ε_low), else 1",
        "PPO (Schulman et al. 2017); clip-higher: DAPO; mask form: CISPO Eq. 7, RLAX Eq. 7",
    ),
    Part(
        "sequence_clip",
        clip_mask,
        "M_i = 0 if (A>0 ∧ ρ_i>1+ε_high) ∨ (A<0 ∧ ρ_i<1−ε_low), for the whole sequence",
        "GSPO (Zheng et al. 2025); Proximal RLOO (Noukhovitch et al. 2024)",
    ),
    Part(
        "token_soft_gate",
        _soft_gate_mask,
        "M_t = 4σ(τ(ρ_t−1))(1−σ(τ(ρ_t−1))), τ = τ_pos if A>0 else τ_neg: the gradient of "
        "the smooth gate f(ρ)·A, f(ρ) = σ(τ(ρ−1))·4/τ, in place of PPO's hard clip",
        "SAPO (Gao et al. 2025, Qwen team; τ_pos = 1, τ_neg = 1.05: verl's defaults)",
    ),
    Part(
        "sequence_log_clip",
        _log_clip_mask_of_ratio,
        "M_t = 0 if (A>0 ∧ log r_t>ε_high) ∨ (A<0 ∧ log r_t<−ε_low), and the sequence "
        "weight is the geometric mean of the clipped token ratios (geometric_mean_clip)",
        "GMPO (Zhao et al. 2025; ε = 0.4 in log space); verl's geo_mean",
    ),
)

# -- R: KL estimators of KL(π_θ ‖ π_ref), from samples, d = log π_θ − log π_ref ----------------


KL_ESTIMATORS = _registry(
    Part("k1", lambda d: d, "k1 = d", "Schulman 2020, 'Approximating KL divergence'"),
    Part("k2", lambda d: 0.5 * d**2, "k2 = d²/2", "Schulman 2020; REINFORCE++"),
    Part(
        "k3",
        lambda d: jnp.exp(-d) - 1 + d,
        "k3 = π_ref/π_θ − log(π_ref/π_θ) − 1",
        "Schulman 2020; GRPO (Shao et al. 2024, Eq. 4)",
    ),
    Part("abs", jnp.abs, "|d| = |log π_θ − log π_ref|", "verl's kl_penalty='abs'"),
)


def kl_estimate(d: jax.Array, c: AlgorithmConfig) -> jax.Array:
    """float[batch, seq]: the kl_estimator of d, clipped to [−kl.clamp, kl.clamp] when
    kl.clamp > 0 (Tunix's compute_kl_divergence clamp_value; verl clamps k3 to ±10)."""
    estimate = KL_ESTIMATORS[c.kl_estimator].fn(d)
    if c.kl.clamp:
        estimate = jnp.clip(estimate, -c.kl.clamp, c.kl.clamp)
    return estimate


def part_inputs(
    batch: RolloutBatch, logprobs: jax.Array, *, need_old_values: bool = False
) -> PartInputs:
    """The stop-gradient view of a `RolloutBatch` and the current log-probs that parts read.

    Computes in float32, or float64 when the log-probs are float64.
    """
    dtype = jnp.promote_types(logprobs.dtype, jnp.float32)
    mask = batch.response_mask.astype(dtype)
    lengths = jnp.sum(mask, axis=1)
    valid = lengths > 0

    def on_response(x: jax.Array) -> jax.Array:
        # Padding may hold anything (-inf, NaN): it must not reach a sum or a gradient.
        return jax.lax.stop_gradient(jnp.where(mask > 0, x.astype(dtype), 0.0))

    old_values = None
    if need_old_values:
        if batch.values is None:
            raise MissingInputError(
                "advantage='gae' and the clipped value loss need batch.values: the value "
                "head's predictions at rollout time, float[batch, seq]"
            )
        old_values = on_response(batch.values)

    def optional(x: jax.Array | None) -> jax.Array | None:
        return None if x is None else on_response(x)

    baseline = batch.baseline_rewards
    if baseline is not None:
        baseline = jax.lax.stop_gradient(jnp.where(valid, baseline.astype(dtype), 0.0))
    return PartInputs(
        mask=mask,
        lengths=lengths,
        valid=valid,
        group_ids=batch.group_ids.astype(jnp.int32),
        rewards=jnp.where(valid, batch.rewards.astype(dtype), 0.0),
        logprobs=on_response(logprobs),
        behaviour_logprobs=on_response(batch.behaviour_logprobs),
        old_values=old_values,
        rollout_logprobs=optional(batch.rollout_logprobs),
        token_rewards=optional(batch.token_rewards),
        token_advantages=optional(batch.token_advantages),
        returns=optional(batch.returns),
        baseline_rewards=baseline,
    )
