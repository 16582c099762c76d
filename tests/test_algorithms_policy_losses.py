"""The policy-loss side of the objective against float64 NumPy references written from the
papers (and verl's and Tunix's conventions where a paper leaves one open): dual-clip PPO,
the rollout correction (TIS, MIS, the mismatch gate), the abs KL estimator and the KL
clamp, Clip-Cov and KL-Cov, GMPO and SAPO, with their presets. Gradients are central
finite differences of the references, on test_algorithms_presets' inputs (NaN off the
response, ragged groups, a group of equal rewards, a padding row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_algorithms_presets import (
    STEP,
    B,
    S,
    case_seed,
    finite_difference,
    grpo_advantages,
    make_inputs,
    ppo_term,
    rows,
    to_batch,
    tok,
)

from rlax_tpu.algorithms import MissingInputError, RolloutBatch, build_objective, describe
from rlax_tpu.algorithms.covariance import CLIP_COV_STREAM
from rlax_tpu.config import (
    AlgorithmConfig,
    ClipConfig,
    ConfigError,
    CovarianceConfig,
    KLConfig,
    RolloutISConfig,
)


def k3(d):
    return np.exp(-d) - 1 + d


def sigmoid(z):
    return 1 / (1 + np.exp(-z))


def token_advantages(x):
    """float[B, S]: GRPO's Â_i on every response token of row i, 0 elsewhere."""
    adv = grpo_advantages(x)
    out = np.zeros((B, S))
    for i in rows(x):
        out[i, x["mask"][i]] = adv[i]
    return out


def with_rollout(x, seed: int, spread: float = 0.5):
    """x plus the inference workers' log π_rollout = log π_old + N(0, spread) (NaN off the
    response)."""
    rng = np.random.default_rng(seed + 7)
    rollout = x["behaviour"] + rng.normal(0, spread, (B, S))
    return {**x, "rollout": np.where(x["mask"], rollout, np.nan)}


def pushed(x, shift: float, every: int = 3):
    """x with log π_θ raised by `shift` on every `every`-th position (ratios e^shift there)."""
    up = x["mask"] & (np.arange(S)[None, :] % every == 1)
    return {**x, "logprobs": np.where(up, x["logprobs"] + shift, x["logprobs"])}


def batch_of(x):
    batch = to_batch(x)
    if "rollout" in x:
        batch = batch.replace(rollout_logprobs=jnp.asarray(x["rollout"]))
    return batch


@functools.cache
def _jitted(config):
    objective = build_objective(config)

    def loss(lp, batch, step):
        return objective(batch, lp, step=step)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def run(config, x, step=STEP):
    """float64 loss, d loss / d logprobs and metrics of `config` on inputs `x` (jitted once)."""
    with jax.enable_x64(True):
        (loss, metrics), grad = _jitted(config)(
            jnp.asarray(x["logprobs"]), batch_of(x), jnp.int32(step)
        )
        assert loss.dtype == jnp.float64
        return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


def assert_matches(config, x, ref):
    """The loss equals ref(x, lp, lp_sg) and its gradient the finite differences of ref in lp
    (lp_sg, the stop-gradient copy, held fixed); returns the metrics."""
    loss, grad, metrics = run(config, x)
    lp = np.nan_to_num(x["logprobs"])
    np.testing.assert_allclose(loss, ref(x, lp, lp), rtol=1e-9, atol=1e-12)
    expected = finite_difference(lambda v: ref(x, v, lp), lp, x["mask"])
    scale = np.abs(expected).max()
    assert scale > 0
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-7 * scale)
    assert np.all(grad[~x["mask"]] == 0)
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    return metrics


def masked_fraction(flags, x):
    return flags[x["mask"]].mean()


# -- references ---------------------------------------------------------------------------


def grpo_reference(x, lp, *, beta=0.04, kl=k3, term=None, factor=None, keep_rows=None):
    """−1/B Σ_i 1/|y_i| Σ_t [c_t·ℓ_t − β·kl(log π_θ − log π_ref)]: GRPO with a per-token
    surrogate ℓ = term(ratio, Â) (PPO's clip by default), a per-token factor c (1 by
    default), over the rows in keep_rows (all by default)."""
    adv = grpo_advantages(x)
    term = term or (lambda ratio, a: ppo_term(ratio, a, 0.2, 0.2))
    kept = [i for i in rows(x) if keep_rows is None or keep_rows[i]]
    total = 0.0
    for i in kept:
        ratio = np.exp(tok(lp, x, i) - tok(x["behaviour"], x, i))
        c = 1.0 if factor is None else tok(factor, x, i)
        log_ref_over = tok(lp, x, i) - tok(x["reference"], x, i)
        total += np.mean(c * term(ratio, adv[i]) - beta * kl(log_ref_over))
    return -total / len(kept)


def dual_clip_term(c):
    """verl's dual clip: max(min(ρA, clip(ρ)A), c·A) for A < 0, PPO's term otherwise."""

    def term(ratio, a):
        ppo = ppo_term(ratio, a, 0.2, 0.2)
        return np.maximum(ppo, c * a) if a < 0 else ppo

    return term


def ref_grpo_dual_clip(x, lp, lp_sg):
    return grpo_reference(x, lp, term=dual_clip_term(3.0))


def ref_gmpo(x, lp, lp_sg, eps=0.4):
    """Zhao et al. 2025: A_i·exp(1/|y| Σ_t sgn(A)·min(sgn(A)·log r_t, sgn(A)·clip(log r_t))),
    averaged over the sequences."""
    adv, total = grpo_advantages(x), 0.0
    for i in rows(x):
        log_r = tok(lp, x, i) - tok(x["behaviour"], x, i)
        sign = np.sign(adv[i])
        clipped = sign * np.minimum(sign * log_r, sign * np.clip(log_r, -eps, eps))
        total += adv[i] * np.exp(clipped.mean())
    return -total / len(rows(x))


def ref_sapo(x, lp, lp_sg, tau_pos=1.0, tau_neg=1.05):
    """SAPO: 1/B Σ_i 1/|y_i| Σ_t f(r_t)·A_i, f(r) = σ(τ(r − 1))·4/τ."""

    def term(ratio, a):
        tau = tau_pos if a > 0 else tau_neg
        return sigmoid(tau * (ratio - 1)) * 4 / tau * a

    return grpo_reference(x, lp, beta=0.0, term=term)


def covariance(x, lp_sg):
    """cov_t = (log π_t − mean log π)(A_t − mean A) over the batch's response tokens."""
    mask, adv = x["mask"], token_advantages(x)
    lp_tokens, adv_tokens = lp_sg[mask], adv[mask]
    cov = np.zeros((B, S))
    cov[mask] = (lp_tokens - lp_tokens.mean()) * (adv_tokens - adv_tokens.mean())
    return cov


def ref_kl_cov(x, lp, lp_sg, ratio=2e-3, coef=1.0):
    """KL-Cov: token mean of r_t·A_t − κ·1[t in the top ⌊k·N⌋∨1 by cov]·|log π_θ − log π_old|."""
    mask, adv = x["mask"], token_advantages(x)
    cov = covariance(x, lp_sg)[mask]
    n_top = max(int(ratio * mask.sum()), 1)
    selected = np.zeros(mask.sum())
    selected[np.argsort(-cov, kind="stable")[:n_top]] = 1
    log_r = (lp - np.nan_to_num(x["behaviour"]))[mask]
    per_token = np.exp(log_r) * adv[mask] - coef * selected * np.abs(log_r)
    return -per_token.mean()


@functools.cache
def clip_cov_draw(step=STEP):
    """The documented draw of Clip-Cov: uniforms from fold_in(key(CLIP_COV_STREAM), step)."""
    key = jax.random.fold_in(jax.random.key(CLIP_COV_STREAM), step)
    return np.asarray(jax.random.uniform(key, (B, S), jnp.float32))


def clip_cov_selection(x, lp_sg, ratio, low, high, eps, step=STEP):
    """bool[B, S]: min(⌊r·N⌋∨1, #candidates) candidates, those with the smallest draws;
    candidates: response tokens PPO's clip keeps with low < cov < high."""
    mask, adv = x["mask"], token_advantages(x)
    cov = covariance(x, lp_sg)
    r = np.exp(lp_sg - np.nan_to_num(x["behaviour"]))
    clipped = ((adv > 0) & (r > 1 + eps)) | ((adv < 0) & (r < 1 - eps))
    candidate = mask & ~clipped & (cov > low) & (cov < high)
    n_clip = max(int(ratio * mask.sum()), 1)
    draw = np.where(candidate, clip_cov_draw(step), np.inf).ravel()
    chosen = np.argsort(draw, kind="stable")[: min(n_clip, candidate.sum())]
    selected = np.zeros(B * S, bool)
    selected[chosen] = True
    return selected.reshape(B, S), candidate


def ref_clip_cov(x, lp, lp_sg, ratio=2e-4, low=1.0, high=5.0, eps=1.0):
    """Clip-Cov (verl's compute_policy_loss_clip_cov): token mean of PPO's term, 0 on the
    selected tokens."""
    mask, adv = x["mask"], token_advantages(x)
    selected, _ = clip_cov_selection(x, lp_sg, ratio, low, high, eps)
    r = np.exp(lp - np.nan_to_num(x["behaviour"]))
    per_token = np.minimum(r * adv, np.clip(r, 1 - eps, 1 + eps) * adv) * ~selected
    return -per_token[mask].mean()


# The presets of these parts: name -> reference (on preset_inputs, which reach the clips).
PRESET_REFERENCES = {
    "grpo_dual_clip": ref_grpo_dual_clip,
    "clip_cov": ref_clip_cov,
    "kl_cov": ref_kl_cov,
    "gmpo": ref_gmpo,
    "sapo": ref_sapo,
}


def preset_inputs(name):
    x = make_inputs(seed=case_seed(name), spread=0.4)
    if name == "grpo_dual_clip":
        x = pushed(x, 1.4)  # ratios ≈ 4 > c = 3 on some tokens
    return x


@pytest.mark.parametrize("name", list(PRESET_REFERENCES))
def test_preset_loss_and_gradient_equal_the_published_formula(name):
    x = preset_inputs(name)
    metrics = assert_matches(AlgorithmConfig(name=name), x, PRESET_REFERENCES[name])
    if name in ("grpo_dual_clip", "gmpo"):
        assert metrics["clip_fraction"] > 0  # the inputs reach the clip
    if name in ("clip_cov", "kl_cov"):
        assert metrics["covariance/selected_fraction"] > 0


# -- dual clip ------------------------------------------------------------------------------


def test_dual_clip_zeroes_the_capped_tokens_and_reports_verls_clipfrac_lower():
    x = preset_inputs("grpo_dual_clip")
    _, grad, metrics = run(AlgorithmConfig(name="grpo_dual_clip"), x)
    adv = token_advantages(x)
    ratio = np.exp(x["logprobs"] - x["behaviour"])
    lower = (adv < 0) & (ratio > 3.0)  # verl's pg_clipfrac_lower: clip_pg_losses1 > −c·A
    assert lower[x["mask"]].sum() >= 2
    assert metrics["clip_fraction/dual"] == pytest.approx(masked_fraction(lower, x), abs=1e-12)
    # There only GRPO's KL term moves the loss; in GRPO's own objective the ratio does too.
    lp = np.nan_to_num(x["logprobs"])
    kl_only = finite_difference(lambda v: grpo_reference(x, v, term=lambda r, a: 0 * r), lp, lower)
    np.testing.assert_allclose(grad[lower], kl_only[lower], rtol=1e-6, atol=1e-10)
    plain = finite_difference(lambda v: grpo_reference(x, v), lp, lower)
    assert np.all(np.abs(plain[lower] - kl_only[lower]) > 1e-5)


def test_dual_clip_acts_on_the_sequence_ratio_with_the_sequence_mask():
    x = make_inputs(seed=32, spread=0.4)
    config = AlgorithmConfig(name="proximal_rloo", clip=ClipConfig(dual_c=1.5))

    def ref(x, lp, lp_sg):  # TRL/Noukhovitch's whole-sequence ratio, RLOO advantages
        total = 0.0
        for members in _groups(x).values():
            for i in members:
                others = [x["rewards"][j] for j in members if j != i]
                adv = x["rewards"][i] - np.mean(others) if others else 0.0
                ratio = np.exp((tok(lp, x, i) - tok(x["behaviour"], x, i)).sum())
                term = ppo_term(ratio, adv, 0.2, 0.2)
                total += max(term, 1.5 * adv) if adv < 0 else term
        return -total / len(rows(x))

    metrics = assert_matches(config, x, ref)
    assert metrics["clip_fraction/dual"] > 0


@pytest.mark.parametrize(
    ("log_ratios", "expected"),
    [
        ((9.0, 9.0), (np.exp(18), np.exp(18))),  # inside: ∂ = −A·s_i on every token
        ((12.0, 12.0), (0.0, 0.0)),  # the sequence's 24 is beyond the clamp
        ((25.0, -10.0), (0.0, np.exp(10))),  # token 0's 25 is, the sequence's 10 not
    ],
)
def test_a_sequence_ratio_beyond_its_clamp_has_no_gradient(log_ratios, expected):
    # s_i = exp(clip(Σ_t clip(log r_t, ±20), ±20)) (Proximal RLOO's product, A = −1): the
    # gradient is the derivative of that value, 0 where a clamp holds it (as verl's ratio).
    config = AlgorithmConfig(name="proximal_rloo", advantage="given")
    objective = build_objective(config)
    behaviour = np.full((1, 2), -30.0)

    def loss_and_grad(lp):
        batch = RolloutBatch(
            tokens=jnp.zeros((1, 2), jnp.int32),
            response_mask=jnp.ones((1, 2), bool),
            group_ids=jnp.zeros(1, jnp.int32),
            rewards=jnp.zeros(1, jnp.float64),
            behaviour_logprobs=jnp.asarray(behaviour),
            versions=jnp.zeros(1, jnp.int32),
            token_advantages=jnp.full((1, 2), -1.0, jnp.float64),
        )
        f = jax.value_and_grad(lambda a: objective(batch, a, step=STEP)[0])
        loss, grad = f(jnp.asarray(lp))
        return float(loss), np.asarray(grad)

    with jax.enable_x64(True):
        lp = behaviour + np.asarray(log_ratios)[None, :]
        _, grad = loss_and_grad(lp)
        of_value = finite_difference(lambda v: loss_and_grad(v)[0], lp, np.ones((1, 2), bool))
    np.testing.assert_allclose(grad[0], expected, rtol=1e-6)
    np.testing.assert_allclose(grad, of_value, rtol=1e-6, atol=1e-12)


def _groups(x):
    out: dict[int, list[int]] = {}
    for i in rows(x):
        out.setdefault(int(x["group_ids"][i]), []).append(i)
    return out


# -- rollout correction ---------------------------------------------------------------------


def correction_factor(x, kind, upper=2.0, lower=None):
    """float[B, S] the reference's c_t: π_old/π_rollout per token or its product per
    sequence, truncated at C (TIS) or kept only inside [C_low, C] (MIS)."""
    log_ratio = np.nan_to_num(x["behaviour"] - x["rollout"])
    if kind.startswith("sequence"):
        log_ratio = np.repeat(log_ratio.sum(1, keepdims=True), S, axis=1)
    ratio = np.exp(log_ratio)
    if kind.endswith("tis"):
        return np.minimum(ratio, upper)
    lower = 1 / upper if lower is None else lower
    return np.where((ratio >= lower) & (ratio <= upper), ratio, 0.0)


# kind, C, C_low (None: the default 1/C).
CORRECTIONS = [
    ("token_tis", 2.0, None),
    ("sequence_tis", 2.0, None),
    ("token_mis", 3.0, 0.8),
    ("sequence_mis", 2.0, None),
]


@pytest.mark.parametrize("kind, upper, lower", CORRECTIONS)
def test_rollout_correction_multiplies_each_tokens_term(kind, upper, lower):
    x = with_rollout(make_inputs(seed=33), seed=33, spread=0.5 if kind[0] == "t" else 0.3)
    config = AlgorithmConfig(
        name="grpo",
        rollout_correction=kind,
        rollout_is=RolloutISConfig(threshold=upper, threshold_lower=lower or 0.0),
    )
    factor = correction_factor(x, kind, upper, lower)
    metrics = assert_matches(config, x, lambda x, lp, lp_sg: grpo_reference(x, lp, factor=factor))
    log_ratio = np.nan_to_num(x["behaviour"] - x["rollout"])
    if kind.startswith("sequence"):
        log_ratio = np.repeat(log_ratio.sum(1, keepdims=True), S, axis=1)
    ratio = np.exp(log_ratio)
    assert metrics["rollout_correction/weight_mean"] == pytest.approx(
        factor[x["mask"]].mean(), rel=1e-9
    )
    outside = (ratio > upper) | (ratio < (lower or 1 / upper))
    truncated = masked_fraction(ratio > upper, x) if kind.endswith("tis") else 0.0
    masked = masked_fraction(outside, x) if kind.endswith("mis") else 0.0
    assert metrics["rollout_correction/truncated_fraction"] == pytest.approx(truncated, abs=1e-12)
    assert metrics["rollout_correction/masked_fraction"] == pytest.approx(masked, abs=1e-12)
    assert max(truncated, masked) > 0  # the inputs reach the bound
    if kind == "token_mis":  # below C_low = 0.8 but above 1/C: masked by the set bound
        assert (x["mask"] & (ratio < 0.8) & (ratio > 1 / 3)).any()
    assert metrics["rollout_correction/gated_sequence_fraction"] == 0


def mismatch_error(x):
    """float[B]: Tunix's per-sequence multiplicative error mean_t exp(|log π_old − log π_r|)."""
    diff = np.abs(np.nan_to_num(x["behaviour"] - x["rollout"]))
    return np.where(x["mask"], np.exp(diff), 0).sum(1) / np.maximum(x["mask"].sum(1), 1)


def test_mismatch_gate_drops_sequences_from_the_loss_and_its_denominators():
    x = with_rollout(make_inputs(seed=35), seed=35)
    # One token far off in an otherwise agreeing row: its mean error stays under the
    # threshold (Tunix takes the mean of exp|d|, not the max).
    x["rollout"][0] = np.where(x["mask"][0], x["behaviour"][0], np.nan)
    first = np.flatnonzero(x["mask"][0])[0]
    x["rollout"][0, first] -= 0.3
    error = mismatch_error(x)
    threshold = float(np.median(error[x["mask"].any(1)]))
    kept = error <= threshold
    assert kept[0] and (~kept & x["mask"].any(1)).sum() >= 3
    config = AlgorithmConfig(name="dapo", rollout_is=RolloutISConfig(gate_threshold=threshold))

    def ref(x, lp, lp_sg):  # DAPO's token mean per group, then over groups: of kept rows
        adv, total, groups = grpo_advantages(x), 0.0, {}  # Â from every row, as Tunix's
        for i in rows(x):
            if kept[i]:
                groups.setdefault(int(x["group_ids"][i]), []).append(i)
        for members in groups.values():
            n_tokens = sum(x["mask"][i].sum() for i in members)
            for i in members:
                ratio = np.exp(tok(lp, x, i) - tok(x["behaviour"], x, i))
                total += ppo_term(ratio, adv[i], 0.2, 0.28).sum() / n_tokens
        return -total / len(groups)

    metrics = assert_matches(config, x, ref)
    valid = x["mask"].any(1)
    assert metrics["rollout_correction/gated_sequence_fraction"] == pytest.approx(
        (~kept & valid).sum() / valid.sum()
    )
    assert metrics["rollout_correction/weight_mean"] == 1.0


def test_rollout_inputs_are_required_and_announced():
    x = make_inputs(seed=36)
    for config, needs in [
        (AlgorithmConfig(name="grpo"), False),
        (AlgorithmConfig(name="grpo", rollout_correction="sequence_tis"), True),
        (AlgorithmConfig(name="gspo", rollout_is=RolloutISConfig(gate_threshold=2.0)), True),
        (AlgorithmConfig(name="trajectory_balance"), False),
        (AlgorithmConfig(name="online_dpo"), False),
    ]:
        objective = build_objective(config)
        assert objective.needs_rollout_logprobs is needs
        if needs:
            with jax.enable_x64(True), pytest.raises(MissingInputError, match="rollout_logprobs"):
                objective(to_batch(x), jnp.asarray(x["logprobs"]), step=STEP)


# -- KL options -----------------------------------------------------------------------------


def test_abs_kl_estimator_clamped_per_token():
    """R = clip(|log π_θ − log π_ref|, ±kl_clamp) per token: beyond the clamp a token's KL
    term is constant (no gradient), inside it is verl's 'abs'."""
    x = make_inputs(seed=37)
    config = AlgorithmConfig(
        name="grpo", kl_estimator="abs", kl=KLConfig(clamp=0.15, beta=0.5, beta_final=0.5)
    )

    def clamped_abs(d):
        return np.clip(np.abs(d), -0.15, 0.15)

    d = np.abs(x["logprobs"] - x["reference"])[x["mask"]]
    assert (d > 0.15).sum() >= 3 and (d < 0.15).sum() >= 3
    assert_matches(config, x, lambda x, lp, lp_sg: grpo_reference(x, lp, beta=0.5, kl=clamped_abs))


# -- Clip-Cov, KL-Cov -----------------------------------------------------------------------


def test_clip_cov_takes_the_gradient_of_a_drawn_fraction_of_the_window():
    x = make_inputs(seed=39, spread=0.4)
    settings = {
        "covariance.ratio": 0.1,
        "covariance.bounds_low": 0.1,
        "covariance.bounds_high": 5.0,
    }
    config = AlgorithmConfig(name="clip_cov").updated(settings)
    lp = np.nan_to_num(x["logprobs"])
    selected, candidate = clip_cov_selection(x, lp, 0.1, 0.1, 5.0, 1.0)
    assert candidate.sum() > selected.sum() == int(0.1 * x["mask"].sum()) > 1
    metrics = assert_matches(
        config, x, lambda x, lp, lp_sg: ref_clip_cov(x, lp, lp_sg, 0.1, 0.1, 5.0)
    )
    assert metrics["covariance/selected_fraction"] == pytest.approx(masked_fraction(selected, x))
    # Whatever the draw: the count is min(⌊r·N⌋, #candidates) (the metric above), the tokens
    # it takes the gradient from are candidates, and the draw is the step's.
    _, grad, _ = run(config, x)
    _, again, _ = run(config, x)
    _, other, _ = run(config, x, step=STEP + 1)
    adv, ratio = token_advantages(x), np.exp(x["logprobs"] - x["behaviour"])
    ppo_clipped = ((adv > 0) & (ratio > 2)) | ((adv < 0) & (ratio < 0))  # ε = 1
    moving = x["mask"] & (adv != 0) & ~ppo_clipped  # a gradient unless Clip-Cov takes it
    zero = moving & (grad == 0)
    assert zero.any() and np.all(candidate[zero])
    np.testing.assert_array_equal(grad, again)
    assert np.any((moving & (other == 0)) != zero)


def test_kl_cov_penalises_the_top_covariance_tokens():
    x = make_inputs(seed=40, spread=0.4)
    config = AlgorithmConfig(name="kl_cov", covariance=CovarianceConfig(ratio=0.1, kl_coef=0.5))
    metrics = assert_matches(
        config, x, lambda x, lp, lp_sg: ref_kl_cov(x, lp, lp_sg, ratio=0.1, coef=0.5)
    )
    assert metrics["covariance/selected_fraction"] == pytest.approx(
        int(0.1 * x["mask"].sum()) / x["mask"].sum()
    )
    assert metrics["covariance/kl_penalty"] > 0


# -- GMPO, SAPO -----------------------------------------------------------------------------


def test_gmpo_clips_in_log_space_on_the_side_the_advantage_pushes():
    x = make_inputs(seed=41, spread=0.5)
    config = AlgorithmConfig(name="gmpo", clip=ClipConfig(eps_low=0.3, eps_high=0.5))
    metrics = assert_matches(config, x, lambda x, lp, lp_sg: ref_gmpo_asymmetric(x, lp))
    adv, log_r = token_advantages(x), x["logprobs"] - x["behaviour"]
    high, low = (adv > 0) & (log_r > 0.5), (adv < 0) & (log_r < -0.3)
    assert high[x["mask"]].any() and low[x["mask"]].any()
    assert metrics["clip_fraction/high"] == pytest.approx(masked_fraction(high, x))
    assert metrics["clip_fraction/low"] == pytest.approx(masked_fraction(low, x))


def ref_gmpo_asymmetric(x, lp, low=0.3, high=0.5):
    adv, total = grpo_advantages(x), 0.0
    for i in rows(x):
        log_r = tok(lp, x, i) - tok(x["behaviour"], x, i)
        sign = np.sign(adv[i])
        clipped = sign * np.minimum(sign * log_r, sign * np.clip(log_r, -low, high))
        total += adv[i] * np.exp(clipped.mean())
    return -total / len(rows(x))


def test_sapo_gate_has_unit_slope_on_policy():
    """f'(1) = 1 for every τ: on-policy, SAPO's gradient is the plain policy gradient
    −Â_i/(B·|y_i|) per token (GRPO's without a KL). Off-policy, the preset's test checks
    f itself, τ_pos on Â > 0 and τ_neg on the rest."""
    x = make_inputs(seed=42)
    x["logprobs"] = x["behaviour"].copy()
    _, grad, metrics = run(AlgorithmConfig(name="sapo"), x)
    lengths = np.maximum(x["mask"].sum(1, keepdims=True), 1)
    expected = -token_advantages(x) / (lengths * len(rows(x)))
    np.testing.assert_allclose(grad, expected, rtol=1e-12, atol=1e-15)
    assert metrics["clip_fraction"] == 0.0  # a soft gate removes no token


# -- config ---------------------------------------------------------------------------------


def test_published_presets_keep_the_new_options_off():
    for name in AlgorithmConfig.PRESET_NAMES:
        c = AlgorithmConfig.preset(name)
        if not c.is_policy_gradient:
            continue
        off = (c.rollout_correction, c.rollout_is.gate_threshold, c.kl.clamp) == ("none", 0, 0)
        assert off, name
        assert (c.clip.dual_c == 0) == (name != "grpo_dual_clip"), name
        assert (c.covariance_control == "none") == (name not in ("clip_cov", "kl_cov")), name


def test_describe_names_the_options_that_are_on():
    config = AlgorithmConfig(
        name="grpo",
        rollout_correction="sequence_mis",
        rollout_is=RolloutISConfig(gate_threshold=1.5),
        kl=KLConfig(clamp=10.0),
    )
    line = describe(config)
    assert "rollout=sequence_mis([0.5, 2.0])" in line and "gate(error≤1.5)" in line
    assert "R=0.04·k3(clamped to ±10.0)" in line


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        ({"clip.dual_c": 1.0}, "clip.dual_c", "must be > 1"),
        ({"name": "cispo", "clip.dual_c": 3.0}, "clip.dual_c", "gradient_mask='ppo_clip'"),
        ({"rollout_is.threshold": 0.5}, "rollout_is.threshold", ">= 1"),
        ({"rollout_is.threshold_lower": 0.5}, "rollout_is.threshold_lower", "'token_mis'"),
        (
            {"rollout_correction": "token_mis", "rollout_is.threshold_lower": 3.0},
            "rollout_is.threshold_lower",
            "[0, rollout_is.threshold=2.0]",
        ),
        ({"rollout_is.gate_threshold": 0.5}, "rollout_is.gate_threshold", ">= 1"),
        ({"kl.clamp": -1.0}, "kl.clamp", ">= 0"),
        ({"covariance.ratio": 0.0}, "covariance.ratio", "(0, 1]"),
        ({"covariance.bounds_low": 5.0}, "covariance.bounds_high", "is empty"),
        ({"name": "gspo", "covariance_control": "kl_cov"}, "covariance_control", "token-level"),
        ({"name": "gspo", "gradient_mask": "token_soft_gate"}, "gradient_mask", "'token'"),
        ({"gradient_mask": "sequence_log_clip"}, "gradient_mask", "importance_weight='sequence'"),
        ({"name": "sapo", "soft_gate.tau_neg": 0.0}, "soft_gate.tau_neg", "> 0"),
        ({"name": "online_dpo", "clip.dual_c": 3.0}, "clip.dual_c", "not used by online_dpo"),
    ],
)
def test_policy_loss_options_fail_with_the_fix(kwargs, field, words):
    with pytest.raises(ConfigError) as info:
        AlgorithmConfig().updated(kwargs)
    assert info.value.field == field
    assert words in str(info.value)


def test_clip_cov_with_a_rollout_correction_jits_in_float32_with_a_traced_step():
    x = with_rollout(make_inputs(seed=44), seed=44)
    batch = to_batch(x, jnp.float32).replace(
        rollout_logprobs=jnp.asarray(x["rollout"], jnp.float32)
    )
    config = AlgorithmConfig(
        name="clip_cov",
        rollout_correction="token_tis",
        rollout_is=RolloutISConfig(gate_threshold=2.0),
    )
    f = jax.jit(lambda b, lp, s: build_objective(config)(b, lp, step=s))
    loss, m = f(batch, batch.behaviour_logprobs + 0.01, jnp.int32(STEP))
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
    assert all(v.dtype == jnp.float32 and np.isfinite(v) for v in m.values())
