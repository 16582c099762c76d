"""The advantage side of the objective against float64 NumPy references written from the
papers (and verl's and Tunix's conventions where the papers leave one open): dense token
rewards, a KL folded into the reward, whitening, advantages and value targets computed
outside, and the estimators of REINFORCE++ (returns-to-go), ReMax, OPO, GPG and pass@k
with their presets. Gradients are central finite differences of the references, with
test_algorithms_presets' inputs and conventions (NaN off the response, ragged groups, a
group of equal rewards, a padding row).
"""

from __future__ import annotations

import functools
import itertools
from fractions import Fraction
from math import comb

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
    groups_of,
    grpo_advantages,
    make_inputs,
    ppo_term,
    rows,
    to_batch,
    tok,
)

from rlax_tpu.algorithms import ADVANTAGES, MissingInputError, build_objective, describe
from rlax_tpu.algorithms import returns as R
from rlax_tpu.algorithms.parts import part_inputs
from rlax_tpu.config import AdvantageOptions, AlgorithmConfig, ConfigError, KLConfig, ValueConfig


def k1(d):
    return d


def k3(d):
    return np.exp(-d) - 1 + d


def with_extras(x, seed: int):
    """x plus dense token rewards, external advantages and value targets (NaN off the
    response). Group 7's rows get no dense reward, so its rewards stay all equal."""
    rng = np.random.default_rng(seed + 1)
    dense = rng.normal(0, 0.1, (B, S)) * (x["group_ids"] != 7)[:, None]
    extra = {
        "token_rewards": dense,
        "token_advantages": rng.normal(0, 1, (B, S)),
        "returns": rng.normal(0, 1, (B, S)),
    }
    return {**x, **{k: np.where(x["mask"], v, np.nan) for k, v in extra.items()}}


def full_batch(x, **drop):
    """The RolloutBatch of x with every optional input x has; `drop` names ones to leave out."""
    batch = to_batch(x)
    names = ("token_rewards", "token_advantages", "returns")
    extras = {k: jnp.asarray(x[k]) for k in names if k in x and k not in drop}
    return batch.replace(**extras, **{k: None for k in drop})


@functools.cache
def _jitted(config, with_values: bool):
    objective = build_objective(config)

    def loss(lp, values, batch):
        return objective(batch, lp, values=values, step=STEP)

    argnums = (0, 1) if with_values else 0
    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


def assert_matches(config, x, ref, value_ref=None):
    """Loss and gradients of `config` on x (float64) equal the reference's value and finite
    differences; `value_ref(x, lp, values)` is the loss as a function of the values."""
    with jax.enable_x64(True):
        lp, values = jnp.asarray(x["logprobs"]), jnp.asarray(x["values"])
        fn = _jitted(config, value_ref is not None)
        (loss, metrics), grads = fn(lp, values, full_batch(x))
        assert loss.dtype == jnp.float64
        grad = np.asarray(grads[0] if value_ref is not None else grads)
        metrics = {k: float(v) for k, v in metrics.items()}
    lp = np.nan_to_num(x["logprobs"])
    np.testing.assert_allclose(float(loss), ref(x, lp, lp), rtol=1e-9, atol=1e-12)
    expected = finite_difference(lambda v: ref(x, v, lp), lp, x["mask"])
    scale = np.abs(expected).max()
    assert scale > 0
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-7 * scale)
    assert np.all(grad[~x["mask"]] == 0)
    if value_ref is not None:
        values = np.nan_to_num(x["values"])
        expected = finite_difference(lambda v: value_ref(x, lp, v), values, x["mask"])
        np.testing.assert_allclose(np.asarray(grads[1]), expected, rtol=1e-6, atol=1e-9)
    return metrics


# -- references, from the papers ---------------------------------------------------------


def sequence_reward(x, i):
    """r_i + Σ_t token_rewards_{i,t}: the reward a sequence-level estimator scores."""
    dense = tok(x["token_rewards"], x, i).sum() if "token_rewards" in x else 0.0
    return x["rewards"][i] + dense


def token_rewards_of(x, i, beta=0.0, kl=k1):
    """R_t of row i: its dense rewards, r_i at its last token, − β·kl(log μ − log π_ref)."""
    if "token_rewards" in x:
        r = tok(x["token_rewards"], x, i).copy()
    else:
        r = np.zeros(x["mask"][i].sum())
    r[-1] += x["rewards"][i]
    return r - beta * kl(tok(x["behaviour"], x, i) - tok(x["reference"], x, i))


def discounted_return(r, gamma):
    out, acc = np.zeros_like(r), 0.0
    for t in reversed(range(len(r))):
        acc = r[t] + gamma * acc
        out[t] = acc
    return out


def whitened(per_row):
    """Every token's value whitened over all response tokens (var with n − 1, + 1e-8)."""
    flat = np.concatenate(list(per_row.values()))
    mean, var = flat.mean(), flat.var(ddof=1)
    return {i: (a - mean) / np.sqrt(var + 1e-8) for i, a in per_row.items()}


def ratio_of(x, lp, i):
    return np.exp(tok(lp, x, i) - tok(x["behaviour"], x, i))


def ref_reinforce_pp_return_to_go(x, lp, lp_sg, gamma=1.0):
    """Hu et al. 2025: k1 KL (β = 0.01) in the reward, returns-to-go, batch whitening."""
    adv = whitened({i: discounted_return(token_rewards_of(x, i, 0.01, k1), gamma) for i in rows(x)})
    total = sum(np.mean(ppo_term(ratio_of(x, lp, i), adv[i], 0.2, 0.2)) for i in rows(x))
    return -total / len(rows(x))


def ref_remax(x, lp, lp_sg):
    """Li et al. 2023 in verl: A_t = Σ_{s≥t} R_s − r(greedy), k1 KL (1e-3) in the reward."""
    total = 0.0
    for i in rows(x):
        adv = discounted_return(token_rewards_of(x, i, 1e-3, k1), 1.0) - x["baseline_rewards"][i]
        total += ppo_term(ratio_of(x, lp, i), adv, 0.2, 0.2).sum()
    return -total / x["mask"].sum()


def ref_opo(x, lp, lp_sg):
    """Hao et al. 2025: baseline Σ|y_j| r_j / Σ|y_j| over the group, no std, token mean."""
    total = 0.0
    for members in groups_of(x).values():
        r = np.array([sequence_reward(x, j) for j in members])
        lengths = x["mask"][members].sum(1)
        baseline = (lengths * r).sum() / lengths.sum()
        for i, r_i in zip(members, r, strict=True):
            adv = 0.0 if np.all(r == r[0]) else r_i - baseline
            total += ppo_term(ratio_of(x, lp, i), adv, 0.2, 0.2).sum()
    return -total / x["mask"].sum()


def ref_gpg(x, lp, lp_sg):
    """Chu et al. 2025: J = 1/N Σ α(r − mean_g r) log π, α = B/(B − M), no ratio."""
    members_of = list(groups_of(x).values())
    reward = {i: sequence_reward(x, i) for i in rows(x)}
    equal = [m for m in members_of if len({reward[i] for i in m}) == 1]
    alpha = len(rows(x)) / (len(rows(x)) - sum(len(m) for m in equal))
    total = 0.0
    for members in members_of:
        if members in equal:
            continue
        mean = np.mean([reward[j] for j in members])
        for i in members:
            total += alpha * (reward[i] - mean) * tok(lp, x, i).sum()
    return -total / x["mask"].sum()


PRESET_REFERENCES = {
    "reinforce_pp_return_to_go": ref_reinforce_pp_return_to_go,
    "remax": ref_remax,
    "opo": ref_opo,
    "gpg": ref_gpg,
}


@pytest.mark.parametrize("name", list(PRESET_REFERENCES))
def test_preset_loss_and_gradient_equal_the_published_formula(name):
    x = with_extras(make_inputs(seed=case_seed(name)), seed=1)
    metrics = assert_matches(AlgorithmConfig(name=name), x, PRESET_REFERENCES[name])
    if AlgorithmConfig(name=name).resolved().gradient_mask != "keep_all":
        assert metrics["clip_fraction"] > 0  # the inputs reach the clip
    assert "kl_loss" not in metrics  # the KL, if any, is in the reward


def test_reinforce_pp_returns_are_discounted_by_gamma():
    x = with_extras(make_inputs(seed=20), seed=20)
    config = AlgorithmConfig.preset(
        "reinforce_pp_return_to_go",
        advantage_options=AdvantageOptions(gae_gamma=0.9),
        kl=KLConfig(beta=0.0),
    )
    with jax.enable_x64(True):
        p = part_inputs(full_batch(x), jnp.asarray(x["logprobs"]))
        adv = np.asarray(ADVANTAGES["reinforce_pp_return_to_go"].fn(p, config))
    expected = whitened({i: discounted_return(token_rewards_of(x, i), 0.9) for i in rows(x)})
    for i in rows(x):
        np.testing.assert_allclose(tok(adv, x, i), expected[i], rtol=1e-10, atol=1e-12)
    assert np.all(adv[~x["mask"]] == 0)


# -- dense token rewards --------------------------------------------------------------------

SEQUENCE_LEVEL = [
    "group_mean_std",
    "group_mean",
    "leave_one_out",
    "batch_norm",
    "group_mean_batch_norm",
    "reward",
    "opo",
    "gpg",
    "pass_at_k",
]


def _estimate(name, batch, logprobs):
    config = AlgorithmConfig.preset("grpo", advantage_options=AdvantageOptions(pass_at_k=2))
    with jax.enable_x64(True):
        return np.asarray(ADVANTAGES[name].fn(part_inputs(batch, jnp.asarray(logprobs)), config))


@pytest.mark.parametrize("name", SEQUENCE_LEVEL)
def test_sequence_estimators_score_the_reward_plus_the_dense_rewards(name):
    x = with_extras(make_inputs(seed=21), seed=21)
    # Move one sample of group 3 across pass@k's threshold 0.5.
    i = groups_of(x)[3][0]
    first = np.argmax(x["mask"][i])
    x["token_rewards"][i, first] += 1.0 if x["rewards"][i] <= 0.5 else -1.0
    folded = dict(
        x, rewards=np.array([sequence_reward(x, i) if i in rows(x) else 0.0 for i in range(B)])
    )
    with jax.enable_x64(True):
        dense = _estimate(name, full_batch(x), x["logprobs"])
        plain = _estimate(name, to_batch(folded), x["logprobs"])
        without = _estimate(name, to_batch(x), x["logprobs"])
    np.testing.assert_allclose(dense, plain, rtol=1e-12, atol=1e-12)
    assert not np.allclose(dense, without)  # the dense rewards did reach the estimator


def gae_dense(rewards, values, gamma, lam):
    """GAE over one response with a reward per token (Schulman et al. 2015), V after it 0."""
    adv, next_adv, next_value = np.zeros(len(values)), 0.0, 0.0
    for t in reversed(range(len(values))):
        adv[t] = rewards[t] + gamma * next_value - values[t] + gamma * lam * next_adv
        next_adv, next_value = adv[t], values[t]
    return adv


def ref_ppo_dense(x, lp, lp_sg, values=None):
    """PPO on R_t with GAE(1, 0.95), whitened for the policy; the value loss (clip 0.2,
    c_V = 0.1) regresses batch.returns when given, else GAE's returns A + V_old."""
    values = np.nan_to_num(x["values"]) if values is None else values
    gae = {
        i: gae_dense(token_rewards_of(x, i), tok(x["old_values"], x, i), 1.0, 0.95) for i in rows(x)
    }
    adv = whitened(gae)
    pg, vf = 0.0, 0.0
    for i in rows(x):
        old = tok(x["old_values"], x, i)
        pg += ppo_term(ratio_of(x, lp, i), adv[i], 0.2, 0.2).sum()
        target = tok(x["returns"], x, i) if "returns" in x else gae[i] + old
        v = tok(values, x, i)
        v_clip = old + np.clip(v - old, -0.2, 0.2)
        vf += np.sum(0.5 * np.maximum((v - target) ** 2, (v_clip - target) ** 2))
    return (-pg + 0.1 * vf) / x["mask"].sum()


def test_ppo_gae_reads_dense_rewards_and_the_value_loss_given_returns():
    # GAE's own returns as the value target: test_algorithms_presets' ppo case.
    x = with_extras(make_inputs(seed=23), seed=23)
    assert_matches(
        AlgorithmConfig(name="ppo"),
        x,
        ref_ppo_dense,
        value_ref=lambda x, lp, v: ref_ppo_dense(x, lp, lp, values=v),
    )


def test_returns_to_go_pass_over_positions_off_the_response():
    # A tool's output (positions 3–4) between two turns: skipped, the return carried over.
    mask = np.array([[0, 1, 1, 0, 0, 1, 1, 0]], float)
    rewards = np.array([[0, 1.0, 2.0, 0, 0, 3.0, 4.0, 0]])
    with jax.enable_x64(True):
        g = np.asarray(R.returns_to_go(jnp.asarray(rewards), jnp.asarray(mask), 0.5))
    on = discounted_return(np.array([1.0, 2.0, 3.0, 4.0]), 0.5)
    np.testing.assert_allclose(g, [[0, on[0], on[1], 0, 0, on[2], on[3], 0]], rtol=1e-12)


# -- the KL in the reward, whitening ------------------------------------------------------------


def ref_grpo_kl_in_reward(x, lp, lp_sg, whiten=True):
    """GRPO on r_i − β Σ_t k3(log μ − log π_ref) (β = 0.04) with no KL loss term, its
    advantages whitened over the batch's response tokens."""
    shaped = np.zeros(B)
    for i in rows(x):
        shaped[i] = token_rewards_of(x, i, 0.04, k3).sum()
    adv = grpo_advantages(dict(x, rewards=shaped))
    adv = {i: np.full(x["mask"][i].sum(), adv[i]) for i in rows(x)}
    adv = whitened(adv) if whiten else adv
    total = sum(np.mean(ppo_term(ratio_of(x, lp, i), adv[i], 0.2, 0.2)) for i in rows(x))
    return -total / len(rows(x))


def test_kl_in_reward_and_whitening_shape_the_advantages_and_drop_the_kl_loss():
    x = make_inputs(seed=24)
    config = AlgorithmConfig(
        name="grpo", kl=KLConfig(in_reward=True), advantage_options=AdvantageOptions(whiten=True)
    )
    metrics = assert_matches(config, x, ref_grpo_kl_in_reward)
    assert "kl_loss" not in metrics
    d = (x["behaviour"] - x["reference"])[x["mask"]]
    assert metrics["kl_in_reward"] == pytest.approx(k3(d).mean(), rel=1e-9)
    assert build_objective(config).needs_reference_logprobs
    assert describe(config).endswith(
        "A=group_mean_std[whitened] M=ppo_clip(ε_low=0.2, ε_high=0.2) R=0.04·k3 in the reward"
    )
    # Both options change the objective: neither is a no-op on these inputs.
    lp = np.nan_to_num(x["logprobs"])
    value = ref_grpo_kl_in_reward(x, lp, lp)
    assert not np.isclose(value, ref_grpo_kl_in_reward(x, lp, lp, whiten=False))
    assert not np.isclose(value, ref_grpo_kl_in_reward(dict(x, reference=x["behaviour"]), lp, lp))


def test_whitened_advantages_have_mean_0_and_variance_1_over_the_tokens():
    x = make_inputs(seed=26)
    mask = x["mask"].astype(float)
    adv = np.random.default_rng(0).normal(3.0, 2.0, (B, S))
    with jax.enable_x64(True):
        out = np.asarray(R.masked_whiten(jnp.asarray(adv), jnp.asarray(mask)))
    on = out[x["mask"]]
    assert abs(on.mean()) < 1e-12
    assert on.var(ddof=1) == pytest.approx(1.0, rel=1e-6)
    assert np.all(out[~x["mask"]] == 0)


# -- advantages and value targets computed outside -----------------------------------------


def ref_given(x, lp, lp_sg, values=None):
    """REINFORCE on the external advantages, −1/B Σ_i Σ_t A_t log π, plus the clipped value
    loss on the external returns G: c_V·½·1/B Σ_i Σ_t max((V − G)², (V_clip − G)²)."""
    values = np.nan_to_num(x["values"]) if values is None else values
    pg, vf = 0.0, 0.0
    for i in rows(x):
        pg += np.sum(tok(x["token_advantages"], x, i) * tok(lp, x, i))
        v, old, target = tok(values, x, i), tok(x["old_values"], x, i), tok(x["returns"], x, i)
        v_clip = old + np.clip(v - old, -0.2, 0.2)
        vf += 0.5 * np.sum(np.maximum((v - target) ** 2, (v_clip - target) ** 2))
    return (-pg + 0.5 * vf) / len(rows(x))


def test_given_advantages_and_returns_are_used_as_they_are():
    x = with_extras(make_inputs(seed=27), seed=27)
    # A value loss with another advantage than GAE: it regresses the given returns.
    config = AlgorithmConfig(
        name="reinforce", advantage="given", value=ValueConfig(loss_coef=0.5, clip_eps=0.2)
    )
    assert_matches(config, x, ref_given, value_ref=lambda x, lp, v: ref_given(x, lp, lp, v))
    objective = build_objective(config)
    assert objective.needs_values and objective.needs_rollout_values  # the clip's centre


# -- pass@k -------------------------------------------------------------------------------------


def pass_at_k_by_enumeration(correct, k):
    """Each sample's mean normalised pass@k advantage over the k-subsets holding it."""
    n = len(correct)
    if n <= k:
        return np.zeros(n)
    subsets = list(itertools.combinations(range(n), k))
    reward = {s: max(correct[j] for j in s) for s in subsets}
    mean = np.mean(list(reward.values()))
    std = np.std(list(reward.values()))
    if std == 0:
        return np.zeros(n)
    return np.array(
        [np.mean([(reward[s] - mean) / std for s in subsets if i in s]) for i in range(n)]
    )


def pass_at_k_formula(correct, k):
    """Chen et al. 2025's closed form with exact binomials."""
    n, n_neg = len(correct), len(correct) - sum(correct)
    if n <= k:
        return np.zeros(n)
    mean = 1 - Fraction(comb(n_neg, k), comb(n, k))
    std = np.sqrt(float(mean * (1 - mean)))
    if std == 0:
        return np.zeros(n)
    miss = Fraction(comb(n_neg - 1, k - 1), comb(n - 1, k - 1)) if n_neg else Fraction(0)
    pos, neg = float(1 - mean) / std, float(1 - mean - miss) / std
    return np.array([pos if c else neg for c in correct])


PASS_AT_K_ROWS = 512  # every case padded to one shape (invalid rows): one compile per k


@functools.partial(jax.jit, static_argnums=3)
def _pass_at_k_jitted(correct, group_ids, valid, k):
    return R.pass_at_k_advantages(correct, group_ids, valid, k)


def _pass_at_k(correct_by_group, k, dtype=jnp.float64):
    """The advantages of the groups' rows (padding rows must get 0 and are dropped)."""
    correct = np.concatenate(correct_by_group).astype(float)
    ids = np.concatenate([np.full(len(c), g) for g, c in enumerate(correct_by_group)])
    n = len(ids)
    pad = PASS_AT_K_ROWS - n
    out = _pass_at_k_jitted(
        jnp.asarray(np.pad(correct, (0, pad), constant_values=1.0), dtype),
        jnp.asarray(np.pad(ids, (0, pad)), jnp.int32),
        jnp.asarray(np.arange(PASS_AT_K_ROWS) < n),
        k,
    )
    out = np.asarray(out)
    assert np.all(out[n:] == 0)
    return out[:n]


GROUPS = [[1, 0, 0, 1, 0], [0, 0, 0, 0, 1, 0], [1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0]]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_pass_at_k_advantage_is_the_mean_over_the_k_subsets(k):
    with jax.enable_x64(True):
        out = _pass_at_k(GROUPS, k)
    expected = np.concatenate([pass_at_k_by_enumeration(g, k) for g in GROUPS])
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    formula = np.concatenate([pass_at_k_formula(g, k) for g in GROUPS])
    np.testing.assert_allclose(out, formula, rtol=1e-12, atol=1e-12)


def test_pass_at_1_is_grpo_with_the_population_std():
    with jax.enable_x64(True):
        out = _pass_at_k(GROUPS, 1)
    expected = []
    for g in GROUPS:
        r = np.array(g, float)
        expected.append((r - r.mean()) / r.std() if r.std() > 0 else np.zeros(len(r)))
    np.testing.assert_allclose(out, np.concatenate(expected), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_pos", [1, 37, 256, 500])
@pytest.mark.parametrize("k", [8, 64])
def test_pass_at_k_binomials_are_stable_in_float32(n_pos, k):
    group = [1] * n_pos + [0] * (512 - n_pos)
    out = _pass_at_k([group], k, jnp.float32)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, pass_at_k_formula(group, k), rtol=2e-4, atol=1e-6)


def test_pass_at_k_degenerate_groups_get_zero():
    # All correct, all wrong, fewer failures than k (every k-subset passes), N ≤ k.
    groups = [[1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 1, 1], [0, 1, 0]]
    with jax.enable_x64(True):
        out = _pass_at_k(groups, 3)
    assert np.all(out == 0)


def test_pass_at_k_estimator_counts_rewards_above_half_as_correct():
    x = with_extras(make_inputs(seed=30), seed=30)
    del x["token_rewards"]
    config = AlgorithmConfig.preset(
        "grpo", advantage="pass_at_k", advantage_options=AdvantageOptions(pass_at_k=2)
    )
    with jax.enable_x64(True):
        p = part_inputs(to_batch(x), jnp.asarray(x["logprobs"]))
        adv = np.asarray(ADVANTAGES["pass_at_k"].fn(p, config))
    expected = np.zeros((B, S))
    for members in groups_of(x).values():
        correct = [int(x["rewards"][i] > 0.5) for i in members]
        for i, a in zip(members, pass_at_k_formula(correct, 2), strict=True):
            expected[i] = a * x["mask"][i]
    assert np.any(expected != 0)
    np.testing.assert_allclose(adv, expected, rtol=1e-12, atol=1e-12)
    assert "A=pass_at_k(k=2)" in describe(config)


# -- missing inputs and configuration ------------------------------------------------------------


@pytest.mark.parametrize(
    "config, drop, field",
    [
        (AlgorithmConfig(name="remax"), "baseline_rewards", "batch.baseline_rewards"),
        (
            AlgorithmConfig(name="reinforce", advantage="given"),
            "token_advantages",
            "token_advantages",
        ),
        (
            AlgorithmConfig(name="grpo", value=ValueConfig(loss_coef=0.5)),
            "returns",
            "batch.returns",
        ),
        (AlgorithmConfig(name="remax"), "reference_logprobs", "reference_logprobs"),
    ],
)
def test_missing_input_names_the_field(config, drop, field):
    x = with_extras(make_inputs(seed=31), seed=31)
    objective = build_objective(config)
    with jax.enable_x64(True), pytest.raises(MissingInputError, match=field):
        batch = full_batch(x, **{drop: None})
        values = jnp.asarray(x["values"])
        jax.eval_shape(lambda lp: objective(batch, lp, values=values), jnp.asarray(x["logprobs"]))


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        (
            {"name": "grpo", "advantage": "given", "kl.in_reward": True},
            "kl.in_reward",
            "advantage='given'",
        ),
        (
            {"name": "grpo", "advantage": "pass_at_k", "advantage_options.pass_at_k": 0},
            "advantage_options.pass_at_k",
            ">= 1",
        ),
        (
            {"name": "trajectory_balance", "advantage_options.whiten": True},
            "advantage_options.whiten",
            "not used",
        ),
        ({"name": "online_dpo", "kl.in_reward": True}, "kl.in_reward", "not used"),
    ],
)
def test_new_fields_are_validated_with_the_fix(kwargs, field, words):
    with pytest.raises(ConfigError) as info:
        AlgorithmConfig().updated(kwargs)
    assert info.value.field == field
    assert words in str(info.value)


def test_only_ppo_whitens_by_default():
    whitening = {
        n
        for n in AlgorithmConfig.PRESET_NAMES
        if AlgorithmConfig(name=n).resolved().advantage_options.whiten
    }
    assert whitening == {"ppo"}
