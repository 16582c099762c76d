"""The verl (and Tunix) rows of docs/algorithms.md, "Coming from verl or Tunix", on one batch.

The references below are float64 NumPy re-implementations of verl's own code, read at
volcengine/verl b178a3c (2026-01-29), not of ours: verl/trainer/ppo/core_algos.py
(compute_policy_loss_vanilla, agg_loss, kl_penalty_forward, compute_value_loss and the
estimators grpo, rloo, reinforce_plus_plus_baseline, gae), ray_trainer.py (apply_kl_penalty)
and workers/actor/dp_actor.py (actor loss = pg − entropy_coeff·agg(H) + kl_loss_coef·agg(kl)).
Tunix's loss is grpo_loss_fn and aggregate_loss (google/tunix c7d8950, tunix/rl/algo_core.py
and common.py). `from_verl` is the table, as code: it translates a verl config into ours, and
each test asserts that our objective under it gives verl's loss and gradient, or differs by
exactly the formula the docs state. verl's tensors hold numbers off the response; ours hold
NaN there (test_algorithms_presets' inputs), which must not matter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_algorithms_presets import STEP, B, S, finite_difference, make_inputs, to_batch

from rlax_tpu.algorithms import RolloutBatch, build_objective
from rlax_tpu.config import AlgorithmConfig, ClipConfig, KLConfig

# -- the table, as code ---------------------------------------------------------------------

AGGREGATION = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "sequence_mean",
    "seq-mean-token-sum": "sequence_sum",
    "seq-mean-token-sum-norm": "max_length",  # × B_valid: see test_seq_mean_token_sum_norm_...
}
KL_ESTIMATOR = {
    "kl": {"kl_estimator": "k1"},
    "k1": {"kl_estimator": "k1"},
    "abs": {"kl_estimator": "abs"},
    "mse": {"kl_estimator": "k2"},
    "k2": {"kl_estimator": "k2"},
    "low_var_kl": {"kl_estimator": "k3", "kl.clamp": 10.0},
    "k3": {"kl_estimator": "k3", "kl.clamp": 10.0},
}


def advantage_fields(v: dict) -> dict:
    """Our advantage fields for verl's algorithm.adv_estimator (and norm_adv_by_std_in_grpo)."""
    estimator = v["adv_estimator"]
    if estimator == "grpo":
        norm = v.get("norm_adv_by_std_in_grpo", True)
        return {"advantage": "group_mean_std" if norm else "group_mean"}
    return {
        "rloo": {"advantage": "leave_one_out"},
        "reinforce_plus_plus_baseline": {
            "advantage": "group_mean",
            "advantage_options.whiten": True,
        },
        "gae": {"advantage": "gae", "advantage_options.whiten": True},
    }[estimator]


def from_verl(v: dict) -> AlgorithmConfig:
    """Our config for a verl config `v` (flat: actor.*, algorithm.*, critic.* keys)."""
    fields = {
        **advantage_fields(v),
        "aggregation": AGGREGATION[v["loss_agg_mode"]],
        "max_response_len": v.get("loss_scale_factor") or 0,
        "importance_weight": "token",  # policy_loss.loss_mode = "vanilla"
        "gradient_mask": "ppo_clip",
        "clip.eps_low": v["clip_ratio_low"],
        "clip.eps_high": v["clip_ratio_high"],
        "clip.dual_c": v["clip_ratio_c"],  # always on in verl's vanilla loss
        "entropy_coef": v.get("entropy_coeff", 0.0),
        "advantage_options.gae_gamma": v.get("gamma", 1.0),
        "advantage_options.gae_lambda": v.get("lam", 1.0),
        "kl.beta": 0.0,
        "kl.beta_final": 0.0,
        "kl.in_reward": False,
    }
    if v.get("use_kl_loss"):
        beta = v["kl_loss_coef"]
        fields.update(KL_ESTIMATOR[v["kl_loss_type"]], **{"kl.beta": beta, "kl.beta_final": beta})
    elif v.get("use_kl_in_reward"):
        beta = v["kl_coef"]
        fields.update(KL_ESTIMATOR[v["kl_penalty"]], **{"kl.beta": beta, "kl.beta_final": beta})
        fields["kl.in_reward"] = True
    if v["adv_estimator"] == "gae":
        # verl's critic is its own model and optimiser; our value head shares the policy's
        # loss, weighted by value_loss_coef.
        fields.update(
            {"value.loss_coef": v["value_loss_coef"], "value.clip_eps": v["cliprange_value"]}
        )
    return AlgorithmConfig(name="grpo").updated(fields).resolved()


VANILLA = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
CASES = {
    "grpo/token-mean/kl+entropy": {
        **VANILLA,
        "adv_estimator": "grpo",
        "loss_agg_mode": "token-mean",
        "use_kl_loss": True,
        "kl_loss_type": "kl",
        "kl_loss_coef": 0.01,
        "entropy_coeff": 0.01,
    },
    "grpo-no-std/seq-mean-token-mean/low_var_kl": {
        **VANILLA,
        "adv_estimator": "grpo",
        "norm_adv_by_std_in_grpo": False,
        "loss_agg_mode": "seq-mean-token-mean",
        "use_kl_loss": True,
        "kl_loss_type": "low_var_kl",
        "kl_loss_coef": 0.05,
    },
    "rloo/seq-mean-token-sum/mse": {
        **VANILLA,
        "adv_estimator": "rloo",
        "loss_agg_mode": "seq-mean-token-sum",
        "use_kl_loss": True,
        "kl_loss_type": "mse",
        "kl_loss_coef": 0.02,
    },
    "reinforce_plus_plus_baseline/seq-mean-token-sum-norm/k3": {
        **VANILLA,
        "adv_estimator": "reinforce_plus_plus_baseline",
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "use_kl_loss": True,
        "kl_loss_type": "k3",
        "kl_loss_coef": 0.01,
    },
    "gae/token-mean/abs-in-reward/critic": {
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_ratio_c": 3.0,
        "adv_estimator": "gae",
        "gamma": 1.0,
        "lam": 0.95,
        "loss_agg_mode": "token-mean",
        "use_kl_in_reward": True,
        "kl_penalty": "abs",
        "kl_coef": 0.05,
        "cliprange_value": 0.5,
        "value_loss_coef": 0.1,
    },
}
NORM = "reinforce_plus_plus_baseline/seq-mean-token-sum-norm/k3"
EQUAL = [name for name in CASES if name != NORM]

# -- verl, from its code ----------------------------------------------------------------------


def masked_mean(x, m, axis=None):
    """verl_F.masked_mean: the count gets + 1e-8."""
    return np.sum(np.where(m > 0, x, 0.0) * m, axis=axis) / (np.sum(m, axis=axis) + 1e-8)


def masked_whiten(x, m):
    mean = masked_mean(x, m)
    n = m.sum()
    var = masked_mean((x - mean) ** 2, m) * n / (n - 1)  # masked_var(unbiased=True)
    return (x - mean) / np.sqrt(var + 1e-8)


def agg_loss(loss_mat, m, mode, loss_scale_factor=None):
    """core_algos.agg_loss on one (global) batch: dp_size 1, no global_batch_info."""
    if mode == "token-mean":
        return np.sum(np.where(m > 0, loss_mat, 0.0) * m) / m.sum()
    if mode == "seq-mean-token-sum":
        seq_losses = np.sum(loss_mat * m, axis=-1)
        seq_mask = (m.sum(-1) > 0).astype(float)
        return np.sum(seq_losses * seq_mask) / seq_mask.sum()
    if mode == "seq-mean-token-mean":
        tokens = m.sum(-1)
        seq_losses = np.sum(loss_mat * m, axis=-1) / (tokens + 1e-8)
        seq_mask = (tokens > 0).astype(float)
        return np.sum(seq_losses * seq_mask) / seq_mask.sum()
    if mode == "seq-mean-token-sum-norm":
        return np.sum(loss_mat * m) / (loss_scale_factor or m.shape[-1])
    raise ValueError(mode)


def kl_penalty(logprob, ref_logprob, kind):
    """core_algos.kl_penalty_forward (the straight-through "+" kinds are k2 in gradient)."""
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return np.abs(logprob - ref_logprob)
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob) ** 2
    if kind in ("low_var_kl", "k3"):
        kl = np.clip(ref_logprob - logprob, -20, 20)
        return np.clip(np.exp(kl) - kl - 1, -10, 10)
    raise NotImplementedError(kind)  # "full" is NotImplementedError in verl too


def policy_loss_vanilla(v, old, logprob, adv, m):
    """compute_policy_loss_vanilla: (pg_loss, pg_clipfrac, pg_clipfrac_lower)."""
    ratio = np.exp(np.clip(logprob - old, -20.0, 20.0))
    losses1 = -adv * ratio
    losses2 = -adv * np.clip(ratio, 1 - v["clip_ratio_low"], 1 + v["clip_ratio_high"])
    clip_losses1 = np.maximum(losses1, losses2)
    clipfrac = masked_mean((losses2 > losses1).astype(float), m)
    losses3 = -adv * v["clip_ratio_c"]
    clip_losses2 = np.minimum(losses3, clip_losses1)
    clipfrac_lower = masked_mean(((clip_losses1 > losses3) & (adv < 0)).astype(float), m)
    pg_losses = np.where(adv < 0, clip_losses2, clip_losses1)
    return agg_loss(pg_losses, m, v["loss_agg_mode"]), clipfrac, clipfrac_lower


def scores_of(x):
    """float[B, S] verl's token_level_scores: each row's reward at its last response token."""
    m = x["mask"]
    last = np.where(m.any(1), S - 1 - np.argmax(m[:, ::-1], axis=1), 0)
    scores = np.zeros((B, S))
    scores[np.arange(B), last] = np.where(m.any(1), x["rewards"], 0.0)
    return scores


def grpo_outcome(scores, index, norm, eps=1e-6):
    """compute_grpo_outcome_advantage: float[B]; a group of one has mean 0, std 1."""
    total = scores.sum(-1)
    out = np.zeros(B)
    for g in np.unique(index):
        members = index == g
        if members.sum() == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = total[members].mean(), total[members].std(ddof=1)
        out[members] = (total[members] - mean) / (std + eps) if norm else total[members] - mean
    return out


def rloo_outcome(scores, index):
    """compute_rloo_outcome_advantage: float[B]; a group of one keeps its score."""
    total = scores.sum(-1)
    out = total.copy()
    for g in np.unique(index):
        members = index == g
        n = members.sum()
        if n > 1:
            out[members] = total[members] * n / (n - 1) - total[members].mean() * n / (n - 1)
    return out


def group_centred(scores, index):
    """reinforce_plus_plus_baseline before its whitening: r − group mean (mean 0 for one)."""
    total = scores.sum(-1)
    out = total.copy()
    for g in np.unique(index):
        members = index == g
        if members.sum() > 1:
            out[members] = total[members] - total[members].mean()
    return out


def gae(rewards, values, m, gamma, lam):
    """compute_gae_advantage_return: (whitened advantages, returns = advantages + values)."""
    nextvalues, lastgaelam, reversed_ = 0.0, 0.0, []
    for t in reversed(range(S)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * m[:, t] + (1 - m[:, t]) * lastgaelam
        reversed_.append(lastgaelam)
    advantages = np.stack(reversed_[::-1], axis=1)
    return masked_whiten(advantages, m), advantages + values


def verl_side(x):
    """verl's tensors: numbers (here 0) off the response, the mask as floats."""
    return {k: np.nan_to_num(x[k]) for k in ("behaviour", "reference", "old_values")} | {
        "m": x["mask"].astype(float)
    }


def verl_advantages(v, x, zero_singletons=False):
    """float[B, S] advantages and returns (None but for GAE), as compute_advantage makes them;
    zero_singletons: a group of one gets 0 (our convention) instead of verl's."""
    t, index = verl_side(x), x["group_ids"]
    m, scores = t["m"], scores_of(x)
    single = np.isin(index, [g for g in np.unique(index) if (index == g).sum() == 1])
    keep = ~single if zero_singletons else np.ones(B, bool)
    estimator = v["adv_estimator"]
    if estimator == "grpo":
        norm = v.get("norm_adv_by_std_in_grpo", True)
        return (keep * grpo_outcome(scores, index, norm))[:, None] * m, None
    if estimator == "rloo":
        return (keep * rloo_outcome(scores, index))[:, None] * m, None
    if estimator == "reinforce_plus_plus_baseline":
        tiled = (keep * group_centred(scores, index))[:, None] * m
        return masked_whiten(tiled, m) * m, None
    if estimator == "gae":
        rewards = scores
        if v.get("use_kl_in_reward"):  # apply_kl_penalty, on old_log_probs
            kl = kl_penalty(t["behaviour"], t["reference"], v["kl_penalty"]) * m
            rewards = scores - v["kl_coef"] * kl
        return gae(rewards, t["old_values"], m, v["gamma"], v["lam"])
    raise ValueError(estimator)


def verl_loss(v, x, adv, returns, lp, values, entropy):
    """The actor's loss (dp_actor.update_policy) plus value_loss_coef × the critic's
    (compute_value_loss) for GAE; and verl's metrics."""
    t = verl_side(x)
    m, mode = t["m"], v["loss_agg_mode"]
    pg, clipfrac, clipfrac_lower = policy_loss_vanilla(v, t["behaviour"], lp, adv, m)
    metrics = {"pg_loss": pg, "pg_clipfrac": clipfrac, "pg_clipfrac_lower": clipfrac_lower}
    loss = pg
    if v.get("entropy_coeff"):
        loss = loss - v["entropy_coeff"] * agg_loss(entropy, m, mode)
    if v.get("use_kl_loss"):
        kl_loss = agg_loss(kl_penalty(lp, t["reference"], v["kl_loss_type"]), m, mode)
        loss = loss + v["kl_loss_coef"] * kl_loss
        metrics["kl_loss"] = kl_loss
    if v["adv_estimator"] == "gae":
        old = t["old_values"]
        clipped = np.clip(values, old - v["cliprange_value"], old + v["cliprange_value"])
        errors = np.maximum((values - returns) ** 2, (clipped - returns) ** 2)
        vf_loss = 0.5 * agg_loss(errors, m, mode)  # the critic's loss_agg_mode = the actor's
        loss = loss + v["value_loss_coef"] * vf_loss
        metrics["vf_loss"] = vf_loss
    return loss, metrics


# -- inputs and our side ---------------------------------------------------------------------


def inputs(seed: int = 23, singleton: bool = False):
    """test_algorithms_presets' batch, with ratios past the dual clip (log π_θ + 1.3 on every
    4th position: r ≈ e^1.3 > 3), references past low_var_kl's clamp (log π_ref + 3.5 on
    every 5th: k3 ≈ 29 > 10) and entropies. singleton=False moves row 7 out of its group of
    one (group 9) into group 0, so that no real row is alone."""
    x = make_inputs(seed, spread=0.5)
    position = np.arange(S)[None, :]
    x["logprobs"] = np.where(position % 4 == 1, x["logprobs"] + 1.3, x["logprobs"])
    x["reference"] = np.where(position % 5 == 2, x["reference"] + 3.5, x["reference"])
    rng = np.random.default_rng(seed + 11)
    x["entropy"] = np.where(x["mask"], rng.uniform(0.1, 3.0, (B, S)), np.nan)
    if not singleton:
        x["group_ids"] = np.where(np.arange(B) == 7, 0, x["group_ids"])
    return x


@functools.cache
def _jitted(config: AlgorithmConfig):
    objective = build_objective(config)

    def loss(lp, values, entropy, batch):
        return objective(batch, lp, values=values, entropy=entropy, step=STEP)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def ours(config, x, entropy=None):
    """Our float64 loss, its gradients in (log π_θ, values, entropies) and the metrics."""
    with jax.enable_x64(True):
        entropy = x["entropy"] if entropy is None else entropy
        args = (jnp.asarray(x[k]) for k in ("logprobs", "values"))
        (loss, metrics), grads = _jitted(config)(*args, jnp.asarray(entropy), to_batch(x))
        assert loss.dtype == jnp.float64
        grads = [np.asarray(g) for g in grads]
        return float(loss), grads, {k: float(v) for k, v in metrics.items()}


def verl_run(v, x, zero_singletons=False):
    """verl's loss and metrics, and its gradients in (log π_θ, values, entropies) by central
    finite differences of the float64 reference."""
    adv, returns = verl_advantages(v, x, zero_singletons)
    lp, values, entropy = (np.nan_to_num(x[k]) for k in ("logprobs", "values", "entropy"))

    def f(lp=lp, values=values, entropy=entropy):
        return verl_loss(v, x, adv, returns, lp, values, entropy)[0]

    loss, metrics = verl_loss(v, x, adv, returns, lp, values, entropy)
    grads = [
        finite_difference(lambda a: f(lp=a), lp, x["mask"]),
        finite_difference(lambda a: f(values=a), values, x["mask"]),
        finite_difference(lambda a: f(entropy=a), entropy, x["mask"]),
    ]
    return loss, grads, metrics


def assert_close(ours_, verl_, factor=1.0):
    """ours × factor == verl: the loss to 1e-7 (verl's masked means add 1e-8 to their counts),
    each gradient to the finite differences' accuracy."""
    (loss, grads), (expected, expected_grads) = ours_, verl_
    np.testing.assert_allclose(loss * factor, expected, rtol=1e-7, atol=1e-12)
    for grad, want in zip(grads, expected_grads, strict=True):
        scale = np.abs(want).max()
        np.testing.assert_allclose(grad * factor, want, rtol=1e-6, atol=1e-7 * max(scale, 1e-3))


# -- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", EQUAL)
def test_verl_loss_and_gradient_equal_ours_under_the_translated_config(name):
    v, x = CASES[name], inputs()
    loss, grads, metrics = ours(from_verl(v), x)
    want, want_grads, want_metrics = verl_run(v, x)
    assert_close((loss, grads), (want, want_grads))
    assert np.abs(want_grads[0]).max() > 0
    np.testing.assert_allclose(metrics["policy_loss"], want_metrics["pg_loss"], rtol=1e-7)
    if "kl_loss" in want_metrics:
        np.testing.assert_allclose(metrics["kl_loss"], want_metrics["kl_loss"], rtol=1e-7)
    if "vf_loss" in want_metrics:
        np.testing.assert_allclose(metrics["value_loss"], want_metrics["vf_loss"], rtol=1e-7)
        assert np.abs(want_grads[1]).max() > 0  # the value loss is really checked
    if v.get("entropy_coeff"):
        assert np.abs(want_grads[2]).max() > 0  # the entropy bonus is really checked


def test_seq_mean_token_sum_norm_is_b_times_max_length():
    # verl: Σ_{i,t} ℓ / L; ours: Σ_{i,t} ℓ / (B·L), B the rows with a response (10 here).
    v, x = CASES[NORM], inputs()
    b_valid = int(x["mask"].any(1).sum())
    assert b_valid == B - 1
    loss, grads, metrics = ours(from_verl(v), x)
    want, want_grads, want_metrics = verl_run(v, x)
    assert_close((loss, grads), (want, want_grads), factor=b_valid)
    np.testing.assert_allclose(metrics["policy_loss"] * b_valid, want_metrics["pg_loss"], rtol=1e-7)
    np.testing.assert_allclose(metrics["kl_loss"] * b_valid, want_metrics["kl_loss"], rtol=1e-7)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n]["adv_estimator"] != "gae"])
def test_a_group_of_one_gets_verls_advantage_and_our_zero(name):
    # Row 7 is alone in group 9: verl gives it r/(1 + 1e-6) (grpo), r (grpo without std,
    # rloo) or Ã = r before whitening (reinforce_plus_plus_baseline); we give it 0.
    v, x = CASES[name], inputs(singleton=True)
    factor = int(x["mask"].any(1).sum()) if name == NORM else 1
    loss, grads, _ = ours(from_verl(v), x)
    assert_close((loss, grads), verl_run(v, x, zero_singletons=True)[:2], factor=factor)
    verl_loss_, verl_grads, _ = verl_run(v, x)
    assert abs(loss * factor - verl_loss_) > 1e-6
    assert np.abs(grads[0][7] * factor - verl_grads[0][7]).max() > 1e-6


def test_verls_clip_fractions_are_ours_high_plus_low_and_dual():
    # pg_clipfrac counts (A > 0, r > 1 + ε_high) and (A < 0, r < 1 − ε_low): our high + low.
    # pg_clipfrac_lower counts the dual clip (A < 0, r > c): our clip_fraction/dual, not
    # clip_fraction/low.
    v, x = CASES["grpo/token-mean/kl+entropy"], inputs()
    _, _, metrics = ours(from_verl(v), x)
    _, _, want = verl_run(v, x)
    high_low = metrics["clip_fraction/high"] + metrics["clip_fraction/low"]
    np.testing.assert_allclose(high_low, want["pg_clipfrac"], rtol=1e-7)
    np.testing.assert_allclose(metrics["clip_fraction/dual"], want["pg_clipfrac_lower"], rtol=1e-7)
    assert want["pg_clipfrac_lower"] > 0 and metrics["clip_fraction/low"] > 0
    assert metrics["clip_fraction/low"] != pytest.approx(want["pg_clipfrac_lower"])
    # Our clip_fraction counts every token whose gradient a mask removes: both.
    total = want["pg_clipfrac"] + want["pg_clipfrac_lower"]
    np.testing.assert_allclose(metrics["clip_fraction"], total, rtol=1e-7)


def test_the_inputs_reach_low_var_kls_clamp():
    # So the low_var_kl case checks kl.clamp = 10 against verl's fixed clamp, not only k3.
    x = inputs()
    t = verl_side(x)
    lp, ref = np.nan_to_num(x["logprobs"]), t["reference"]
    d = (ref - lp)[x["mask"]]
    k3 = np.exp(d) - d - 1
    assert np.any(k3 > 10) and np.any(k3 < 10)
    assert np.all(np.abs(d) < 20)  # verl's inner ±20 clamp is idle, as ours has none


# -- the ratio's ±20 clamp, on one token ----------------------------------------------------


def one_token_ours(log_ratio: float, advantage: float, behaviour: float = -30.0):
    """Our float64 loss and d loss / d log π_θ on one response token with log π_θ − log μ =
    `log_ratio` and A = `advantage`: verl's vanilla clip (0.2, 0.28), no dual clip."""
    config = AlgorithmConfig(
        name="grpo",
        advantage="given",
        aggregation="token_mean",
        clip=ClipConfig(
            eps_low=VANILLA["clip_ratio_low"], eps_high=VANILLA["clip_ratio_high"], dual_c=0.0
        ),
        kl=KLConfig(beta=0.0, beta_final=0.0),
    )
    objective = build_objective(config)
    with jax.enable_x64(True):
        batch = RolloutBatch(
            tokens=jnp.zeros((1, 1), jnp.int32),
            response_mask=jnp.ones((1, 1), bool),
            group_ids=jnp.zeros(1, jnp.int32),
            rewards=jnp.zeros(1, jnp.float64),
            behaviour_logprobs=jnp.full((1, 1), behaviour, jnp.float64),
            versions=jnp.zeros(1, jnp.int32),
            token_advantages=jnp.full((1, 1), advantage, jnp.float64),
        )
        lp = jnp.full((1, 1), behaviour + log_ratio, jnp.float64)
        loss, grad = jax.value_and_grad(lambda a: objective(batch, a, step=STEP)[0])(lp)
        return float(loss), float(grad[0, 0])


def one_token_verl(log_ratio: float, advantage: float, behaviour: float = -30.0):
    """verl's loss (compute_policy_loss_vanilla, token-mean) and its gradient by finite
    differences on the same token. verl always dual-clips (clip_ratio_c > 1 asserted); an
    infinite c never binds, which is the case without dual clip."""
    v = {**VANILLA, "clip_ratio_c": np.inf, "loss_agg_mode": "token-mean"}
    old, m = np.full((1, 1), behaviour), np.ones((1, 1))
    adv = np.full((1, 1), advantage)

    def f(lp):
        return policy_loss_vanilla(v, old, lp, adv, m)[0]

    lp = old + log_ratio
    return f(lp), finite_difference(f, lp, m > 0)[0, 0]


@pytest.mark.parametrize(
    ("log_ratio", "advantage"), [(25.0, -1.0), (-25.0, 1.0), (19.0, -1.0), (-19.0, 1.0)]
)
def test_a_ratio_beyond_the_clamp_has_verls_zero_gradient(log_ratio, advantage):
    # verl's ratio is exp(clamp(log r, −20, 20)) and torch.clamp passes no gradient beyond
    # its bounds. log r = 25, A = −1 is on the side PPO's clip leaves open: our gradient was
    # e^20·|A| = 4.9e8 there (issue 38); −25 with A = +1 was e^−20.
    loss, grad = one_token_ours(log_ratio, advantage)
    want, want_grad = one_token_verl(log_ratio, advantage)
    assert np.isfinite(loss) and np.isfinite(grad)
    np.testing.assert_allclose(loss, want, rtol=1e-12)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-15)
    if abs(log_ratio) > 20:
        assert grad == 0.0 and want_grad == 0.0
    else:  # inside the clamp: PPO's unclipped side, −A·r
        np.testing.assert_allclose(grad, -advantage * np.exp(log_ratio), rtol=1e-6)


# -- Tunix's loss_agg_mode names, on the same advantages --------------------------------------


def tunix_aggregate_loss(loss, m, mode):
    """tunix/rl/common.py aggregate_loss (unpacked rows), as sum / denominator."""
    if mode == "token-mean":
        return np.sum(loss * m) / m.sum()
    tokens = m.sum(-1)
    rows = (tokens > 0).sum()
    if mode == "sequence-mean-token-mean":
        return np.sum(np.sum(loss * m, -1) / np.clip(tokens, 1.0, None)) / rows
    if mode == "sequence-mean-token-scale":
        return np.sum(np.sum(loss * m, -1) / m.shape[-1]) / rows
    if mode == "seq-mean-token-sum":
        return np.sum(loss * m) / rows
    if mode == "sequence-mean-token-sum-norm":
        return np.sum(loss * m) / m.shape[0]  # norm defaults to the batch size
    raise ValueError(mode)


def tunix_grpo_loss(t, x, adv, lp):
    """grpo_loss_fn (loss_algo="grpo"): dual-clipped PPO per token, then aggregate_loss, plus
    β·aggregate_loss(compute_kl_divergence(..., kl_loss_mode, clamp_value))."""
    m = x["mask"].astype(float)
    ratio = np.exp(np.clip(lp - np.nan_to_num(x["behaviour"]), -20.0, 20.0))
    loss1 = -adv * ratio
    loss2 = -adv * np.clip(ratio, 1 - t["epsilon"], 1 + t["epsilon_high"])
    per_token = np.maximum(loss1, loss2)
    per_token = np.where(adv < 0, np.minimum(-t["epsilon_c"] * adv, per_token), per_token)
    ref = np.nan_to_num(x["reference"])
    kl = {"kl": lp - ref, "mse_kl": 0.5 * (lp - ref) ** 2}.get(t["kl_loss_mode"])
    if t["kl_loss_mode"] == "low_var_kl":
        kl = np.exp(ref - lp) - (ref - lp) - 1
    if t.get("kl_clamp_value") is not None:
        kl = np.clip(kl, -t["kl_clamp_value"], t["kl_clamp_value"])
    mode = t["loss_agg_mode"]
    return tunix_aggregate_loss(per_token, m, mode) + t["beta"] * tunix_aggregate_loss(kl, m, mode)


TUNIX_CASES = {
    # Tunix loss_agg_mode, kl_loss_mode, kl_clamp_value -> the verl case of the same config
    # on our side, and ours × factor = Tunix.
    "token-mean": ("kl", None, "grpo/token-mean/kl+entropy"),
    "sequence-mean-token-mean": ("low_var_kl", 10.0, "grpo-no-std/seq-mean-token-mean/low_var_kl"),
    "seq-mean-token-sum": ("mse_kl", None, "rloo/seq-mean-token-sum/mse"),
    "sequence-mean-token-scale": ("low_var_kl", 10.0, NORM),
    # Σ_{i,t} ℓ / B_all (all rows, padding ones too): ours sequence_sum × B_valid/B_all.
    "sequence-mean-token-sum-norm": ("mse_kl", None, "rloo/seq-mean-token-sum/mse"),
}


@pytest.mark.parametrize("mode", list(TUNIX_CASES))
def test_tunix_loss_agg_modes_match_ours(mode):
    kl_mode, clamp, name = TUNIX_CASES[mode]
    v, x = CASES[name], inputs()
    tunix = {
        "epsilon": v["clip_ratio_low"],
        "epsilon_high": v["clip_ratio_high"],
        "epsilon_c": v["clip_ratio_c"],
        "beta": v["kl_loss_coef"],
        "kl_loss_mode": kl_mode,
        "kl_clamp_value": clamp,
        "loss_agg_mode": mode,
    }
    adv, _ = verl_advantages(v, x)
    lp = np.nan_to_num(x["logprobs"])
    # Tunix's GRPO loss has no entropy bonus: entropies 0 leave ours without one too.
    loss, grads, _ = ours(from_verl(v), x, entropy=np.zeros((B, S)))
    factor = int(x["mask"].any(1).sum()) / B if mode == "sequence-mean-token-sum-norm" else 1.0
    want = tunix_grpo_loss(tunix, x, adv, lp)
    want_grad = finite_difference(lambda a: tunix_grpo_loss(tunix, x, adv, a), lp, x["mask"])
    np.testing.assert_allclose(loss * factor, want, rtol=1e-9)
    scale = np.abs(want_grad).max()
    np.testing.assert_allclose(grads[0] * factor, want_grad, rtol=1e-6, atol=1e-7 * scale)
    if factor != 1.0:
        assert abs(loss - want) > 1e-6
