"""Structure of the objective: stop-gradients, padding, equal-reward groups, trajectory
balance's reduction to REINFORCE, DPO ties, GAE, schedules, metrics, jit, missing inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_algorithms_presets import (
    STEP,
    B,
    S,
    finite_difference,
    groups_of,
    grpo_advantages,
    make_inputs,
    rows,
    to_batch,
    tok,
)

from rlax_tpu.algorithms import (
    ADVANTAGES,
    PRESETS,
    REFERENCE_METRICS,
    REQUIRED_METRICS,
    MissingInputError,
    build_objective,
    gae,
    kl_beta_at,
    objective,
    reference_reset_due,
)
from rlax_tpu.algorithms import groups as G
from rlax_tpu.algorithms.parts import PartInputs
from rlax_tpu.config import AlgorithmConfig, KLConfig
from rlax_tpu.controller.filters import dynamic_sampling_keep


@functools.cache
def _jitted_loss_and_grad(config):
    def loss(lp, batch, values):
        return objective(batch, lp, config=config, values=values, step=STEP)[0]

    return jax.jit(jax.value_and_grad(loss))


def loss_and_grad(config, x, lp=None):
    """float64 loss and d loss / d logprobs of `config` on inputs `x` (jitted once)."""
    with jax.enable_x64(True):
        lp = jnp.asarray(x["logprobs"] if lp is None else lp)
        values = jnp.asarray(x["values"])
        loss, grad = _jitted_loss_and_grad(config)(lp, to_batch(x), values)
        return float(loss), np.asarray(grad)


def jax_loss_fd(config, x, co_shift_behaviour: bool) -> np.ndarray:
    """Finite differences of the JAX loss value itself; with co_shift_behaviour, log μ moves
    with log π_θ so every ratio π_θ/μ is held fixed."""
    lp0 = np.nan_to_num(x["logprobs"])

    def f(lp):
        y = dict(x, logprobs=lp)
        if co_shift_behaviour:
            y["behaviour"] = x["behaviour"] + (lp - lp0)
        return loss_and_grad(config, y, lp=lp)[0]

    return finite_difference(f, lp0, x["mask"])


# -- stop-gradient structure, by finite differences ------------------------------------------


def test_grpo_clipped_tokens_carry_no_gradient():
    x = make_inputs(seed=1)
    config = AlgorithmConfig(name="grpo", kl=KLConfig(beta=0.0))
    _, grad = loss_and_grad(config, x)
    # The gradient is the derivative of the published clipped objective's value ...
    np.testing.assert_allclose(grad, jax_loss_fd(config, x, False), rtol=1e-6, atol=1e-9)
    # ... and exactly 0 on the tokens PPO's min clips.
    ratio = np.exp(x["logprobs"] - x["behaviour"])
    with jax.enable_x64(True):
        adv = np.asarray(
            ADVANTAGES["group_mean_std"].fn(_part_inputs(x), AlgorithmConfig.preset("grpo"))
        )
    clipped = x["mask"] & (((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8)))
    assert clipped.sum() >= 3
    assert np.all(grad[clipped] == 0)
    assert np.all(grad[x["mask"] & ~clipped & (adv != 0)] != 0)


@pytest.mark.parametrize("name", ["aipo", "cispo"])
def test_importance_weights_of_aipo_and_cispo_carry_no_gradient(name):
    x = make_inputs(seed=2)
    # Push some ratios past ρ_max (AIPO 2, CISPO 8): truncated, yet not masked.
    push = x["mask"] & (np.arange(S)[None, :] % 4 == 2)
    x["logprobs"] = np.where(push, x["behaviour"] + 2.5, x["logprobs"])
    config = AlgorithmConfig(name=name)
    _, grad = loss_and_grad(config, x)
    # Holding every ratio fixed, the loss moves exactly as autodiff says: ρ has no gradient.
    np.testing.assert_allclose(grad, jax_loss_fd(config, x, True), rtol=1e-6, atol=1e-9)
    # Letting ρ move with π_θ changes the derivative wherever ρ is not truncated.
    free = jax_loss_fd(config, x, False)
    rho_max = config.resolved().importance.rho_max
    ratio = np.exp(x["logprobs"] - x["behaviour"])
    moving = x["mask"] & (ratio < rho_max) & (np.abs(grad) > 1e-6)
    assert moving.any() and not np.allclose(grad[moving], free[moving], rtol=1e-3)
    truncated = x["mask"] & (ratio > rho_max) & (np.abs(grad) > 0)
    assert truncated.any()  # weight ρ_max: a weight, not a mask (CISPO's point)


def test_trajectory_balance_gradient_is_the_derivative_of_its_value():
    # VarGrad's log Ẑ makes each group's residuals sum to 0, so sg(log Ẑ) leaves the
    # derivative of the loss value unchanged.
    x = make_inputs(seed=3)
    config = AlgorithmConfig(name="trajectory_balance")
    _, grad = loss_and_grad(config, x)
    np.testing.assert_allclose(grad, jax_loss_fd(config, x, False), rtol=1e-5, atol=1e-6)


# -- padding and equal rewards ------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_padding_contributes_nothing(name):
    x = make_inputs(seed=4)
    config = AlgorithmConfig(name=name)
    loss, grad = loss_and_grad(config, x)
    # Other garbage on padding positions, and the padding row's reward: same loss.
    y = {
        k: np.where(x["mask"], v, -1e30) if np.shape(v) == (B, S) and k != "mask" else v
        for k, v in x.items()
    }
    y["rewards"] = np.where(x["mask"].any(1), x["rewards"], np.nan)
    loss2, grad2 = loss_and_grad(config, y)
    assert loss2 == pytest.approx(loss, rel=1e-12)
    np.testing.assert_array_equal(grad2, grad)
    assert np.all(grad[~x["mask"]] == 0)


ZERO_ON_EQUAL = ["group_mean_std", "group_mean", "leave_one_out", "group_mean_batch_norm"]


def _part_inputs(x, rewards=None):
    mask = x["mask"].astype(np.float64)
    with jax.enable_x64(True):
        return PartInputs(
            mask=jnp.asarray(mask),
            lengths=jnp.asarray(mask.sum(1)),
            valid=jnp.asarray(mask.sum(1) > 0),
            group_ids=jnp.asarray(x["group_ids"], jnp.int32),
            rewards=jnp.asarray(x["rewards"] if rewards is None else rewards),
            logprobs=jnp.asarray(np.nan_to_num(x["logprobs"])),
            behaviour_logprobs=jnp.asarray(np.nan_to_num(x["behaviour"])),
            old_values=jnp.asarray(np.nan_to_num(x["old_values"])),
        )


@pytest.mark.parametrize("advantage", ZERO_ON_EQUAL)
def test_group_with_equal_rewards_has_exactly_zero_advantage(advantage):
    x = make_inputs(seed=5)
    # 0.1 is not exact in binary: the group mean differs from 0.1 by rounding.
    rewards = np.where(x["group_ids"] == 3, 0.1, x["rewards"])
    with jax.enable_x64(True):
        adv = np.asarray(
            ADVANTAGES[advantage].fn(_part_inputs(x, rewards), AlgorithmConfig.preset("grpo"))
        )
    equal = np.isin(x["group_ids"], [3, 7])  # group 7 has equal rewards by construction
    assert np.all(adv[equal] == 0.0)
    assert np.any(adv[~equal & x["mask"].any(1)] != 0)


@pytest.mark.parametrize("advantage", ["reward", "batch_norm", "gae"])
def test_advantages_without_a_group_baseline_keep_equal_reward_groups(advantage):
    x = make_inputs(seed=5)
    with jax.enable_x64(True):
        adv = np.asarray(ADVANTAGES[advantage].fn(_part_inputs(x), AlgorithmConfig.preset("ppo")))
    assert np.any(adv[x["group_ids"] == 7][x["mask"][x["group_ids"] == 7]] != 0)


def test_equal_reward_group_gets_no_policy_gradient_under_grpo():
    x = make_inputs(seed=6)
    _, grad = loss_and_grad(AlgorithmConfig(name="grpo", kl=KLConfig(beta=0.0)), x)
    assert np.all(grad[x["group_ids"] == 7] == 0)
    assert np.any(grad[x["group_ids"] == 0] != 0)


# -- trajectory balance reduces to REINFORCE with a mean baseline (TBA App. A) ----------------


@pytest.mark.parametrize("beta", [0.01, 1.0, 1e3, 1e6])
def test_trajectory_balance_on_policy_is_reinforce_with_a_mean_baseline(beta):
    """With π_ref = π_θ (on-policy, just after a reference reset) KL̂ = 0 and
    (β/2)·∇L_TB = −∇ of REINFORCE with the group-mean baseline, for every β."""
    x = make_inputs(seed=7)
    x["reference"] = x["logprobs"].copy()
    tb = AlgorithmConfig(name="trajectory_balance", kl=KLConfig(beta=beta, beta_final=beta))
    _, tb_grad = loss_and_grad(tb, x)
    reinforce = AlgorithmConfig(name="reinforce", advantage="group_mean")
    _, pg_grad = loss_and_grad(reinforce, x)
    np.testing.assert_allclose(beta / 2 * tb_grad, pg_grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("beta", [0.01, 1.0, 1e3])
def test_trajectory_balance_gradient_is_reinforce_with_a_kl_shaped_reward(beta):
    """Off the reference: A = (r − r̄) − β(KL̂ − KL̄), KL̂ = log π_θ(y) − log π_ref(y)."""
    x = make_inputs(seed=8)
    tb = AlgorithmConfig(name="trajectory_balance", kl=KLConfig(beta=beta, beta_final=beta))
    _, tb_grad = loss_and_grad(tb, x)
    lp, ref = np.nan_to_num(x["logprobs"]), np.nan_to_num(x["reference"])
    kl = ((lp - ref) * x["mask"]).sum(1)
    expected = np.zeros((B, S))
    valid = x["mask"].any(1)
    for g in np.unique(x["group_ids"][valid]):
        members = valid & (x["group_ids"] == g)
        adv = (x["rewards"] - x["rewards"][members].mean()) - beta * (kl - kl[members].mean())
        expected[members] = -adv[members, None] * x["mask"][members] / valid.sum()
    np.testing.assert_allclose(beta / 2 * tb_grad, expected, rtol=1e-6, atol=1e-9)


# -- online DPO --------------------------------------------------------------------------


def test_online_dpo_tied_group_adds_log2_and_no_gradient():
    x = make_inputs(seed=9)
    loss, grad = loss_and_grad(AlgorithmConfig(name="online_dpo"), x)
    assert np.all(grad[x["group_ids"] == 7] == 0) and np.all(grad[x["group_ids"] == 9] == 0)
    # Per group: only the best and the worst sample have a gradient.
    for g in (0, 3):
        touched = (np.abs(grad[x["group_ids"] == g]).sum(1) > 0).sum()
        assert touched == 2
    assert loss > 0


# -- GAE ---------------------------------------------------------------------------------


def test_gae_with_gamma_and_lambda_one_is_the_return_minus_the_value():
    x = make_inputs(seed=10)
    mask = x["mask"].astype(np.float64)
    with jax.enable_x64(True):
        adv = np.asarray(
            gae(
                jnp.asarray(mask),
                jnp.asarray(x["rewards"]),
                jnp.asarray(np.nan_to_num(x["old_values"])),
                1.0,
                1.0,
            )
        )
    expected = (x["rewards"][:, None] - np.nan_to_num(x["old_values"])) * mask
    np.testing.assert_allclose(adv, expected, rtol=1e-12, atol=1e-12)


# -- schedules ---------------------------------------------------------------------------


def test_tb_beta_schedule_decays_linearly_then_holds():
    config = AlgorithmConfig(name="trajectory_balance")
    betas = [float(kl_beta_at(config, s)) for s in (0, 250, 500, 10_000)]
    np.testing.assert_allclose(betas, [0.012, 0.008, 0.004, 0.004], rtol=1e-6)


def test_beta_cut_step_jumps_to_the_final_value():
    # TBA's TL;DR schedule: 1 → 0.05 nominally by step 128, cut to 0.05 at step 32.
    config = AlgorithmConfig(
        name="trajectory_balance",
        kl=KLConfig(beta=1.0, beta_final=0.05, beta_decay_steps=128, beta_cut_step=32),
    )
    assert float(kl_beta_at(config, 31)) == pytest.approx(1 - 0.95 * 31 / 128)
    assert float(kl_beta_at(config, 32)) == pytest.approx(0.05)
    assert float(jax.jit(lambda s: kl_beta_at(config, s))(jnp.int32(40))) == pytest.approx(0.05)


def test_reference_reset_every_rho_steps():
    config = AlgorithmConfig(name="trajectory_balance", kl=KLConfig(reference_reset_every=50))
    assert [s for s in range(151) if reference_reset_due(config, s)] == [50, 100, 150]
    assert not any(reference_reset_due(AlgorithmConfig(name="grpo"), s) for s in range(100))


# -- DAPO's dynamic sampling -------------------------------------------------------------


def test_dynamic_sampling_drops_groups_with_equal_rewards():
    keep = dynamic_sampling_keep([1, 1, 0, 1, 0, 0, 1, 1], [5, 5, 2, 2, 9, 9, 7, 7])
    assert keep.tolist() == [False, False, True, True, False, False, False, False]


_zero_variance_fraction = jax.jit(G.zero_variance_fraction)
MAX_ROWS = 12


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 4), st.sampled_from([0.0, 0.5, 1.0])),
        min_size=1,
        max_size=MAX_ROWS,
    )
)
def test_dynamic_sampling_agrees_with_the_zero_variance_fraction(rows):
    ids = np.array([g for g, _ in rows])
    rewards = np.array([r for _, r in rows])
    keep = dynamic_sampling_keep(rewards, ids)
    for g in np.unique(ids):
        assert np.all(keep[ids == g] == (len(set(rewards[ids == g])) > 1))
    # The in-graph metric on the same groups, padded to a fixed batch with invalid rows.
    pad = MAX_ROWS - len(rows)
    fraction = _zero_variance_fraction(
        jnp.asarray(np.pad(rewards, (0, pad)), jnp.float32),
        jnp.asarray(np.pad(ids, (0, pad))),
        jnp.asarray(np.arange(MAX_ROWS) < len(rows)),
    )
    dropped_groups = len(set(ids[~keep]))
    assert float(fraction) == pytest.approx(dropped_groups / len(set(ids)))


# -- metrics, jit and inputs -------------------------------------------------------------


def test_on_policy_metrics():
    x = make_inputs(seed=11)
    x["behaviour"] = x["logprobs"].copy()
    with jax.enable_x64(True):
        _, m = objective(
            to_batch(x), jnp.asarray(x["logprobs"]), config=AlgorithmConfig(), step=STEP
        )
    assert float(m["ratio/mean"]) == pytest.approx(1.0)
    assert float(m["ratio/p99"]) == pytest.approx(1.0)
    assert float(m["logprob_diff/p95"]) == 0.0
    assert float(m["clip_fraction"]) == 0.0
    assert float(m["kl/behaviour"]) == 0.0
    # Of groups 0, 3, 7, 9: 7 has equal rewards and 9 a single sample.
    assert float(m["zero_variance_group_fraction"]) == pytest.approx(2 / 4)
    valid = x["mask"].any(1)
    assert float(m["staleness/max"]) == (STEP - x["versions"][valid]).max()
    expected_entropy = -np.nansum(np.where(x["mask"], x["logprobs"], 0)) / x["mask"].sum()
    assert float(m["entropy"]) == pytest.approx(expected_entropy)
    wanted = {"ratio/max", "kl", "advantage/mean", "advantage/std", "clip_fraction/high"}
    assert wanted <= set(m)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_objective_reports_the_required_metrics(name):
    """The same keys from every preset, TB and DPO, with the reference log-probs the trainer
    would supply (none where the objective reads none) and with them."""
    x = make_inputs(seed=15)
    objective = build_objective(AlgorithmConfig(name=name))
    runs = {}
    with jax.enable_x64(True):
        batch = to_batch(x)
        cases = {"with reference": batch}
        if not objective.needs_reference_logprobs:
            cases["without reference"] = batch.replace(reference_logprobs=None)
        for case, b in cases.items():
            _, m = objective(b, jnp.asarray(x["logprobs"]), values=jnp.asarray(x["values"]))
            runs[case] = {k: float(v) for k, v in m.items()}
    for case, m in runs.items():
        missing = set(REQUIRED_METRICS) - set(m)
        assert not missing, f"{name} {case}: missing {sorted(missing)}"
        assert all(np.isfinite(m[k]) for k in REQUIRED_METRICS), (case, m)
        assert m["kl/behaviour"] > 0  # off-policy inputs: μ ≠ π_θ
        has_reference = case == "with reference"
        assert (set(REFERENCE_METRICS) <= set(m)) == has_reference, case
        if has_reference:
            assert np.isfinite(m["kl"]) and m["kl"] > 0


@pytest.mark.parametrize("name", ["dapo", "gspo", "trajectory_balance", "online_dpo"])
def test_off_policy_metrics_equal_a_direct_numpy_computation(name):
    """Behaviour log-probs ≠ current ones, with tokens clipped on both sides (DAPO: per
    token, ε 0.2/0.28; GSPO: per sequence); TB and DPO have no clip mask."""
    x = make_inputs(seed=23, spread=4e-4 if name == "gspo" else 0.4)
    with jax.enable_x64(True):
        _, m = objective(to_batch(x), jnp.asarray(x["logprobs"]), config=AlgorithmConfig(name=name))
        m = {k: float(v) for k, v in m.items()}
    mask = x["mask"]
    d = (x["logprobs"] - x["behaviour"])[mask]  # response tokens, row by row
    r = np.exp(d)
    expected = {
        "ratio/mean": r.mean(),
        "ratio/max": r.max(),
        "ratio/p99": np.quantile(r, 0.99),
        "logprob_diff/mean": np.abs(d).mean(),
        "logprob_diff/p95": np.quantile(np.abs(d), 0.95),
        "kl/behaviour": np.mean(r - 1 - np.log(r)),  # k3 of KL(μ‖π_θ), y ~ μ
        "clip_fraction": 0.0,
        "clip_fraction/high": 0.0,
        "clip_fraction/low": 0.0,
    }
    if name in ("dapo", "gspo"):
        adv = grpo_advantages(x)
        a = np.concatenate([np.full(mask[i].sum(), adv[i]) for i in rows(x)])
        if name == "dapo":
            ratio, low, high = r, 0.2, 0.28
        else:  # one geometric-mean ratio per sequence, on each of its tokens
            seq = [
                np.exp(np.mean(tok(x["logprobs"], x, i) - tok(x["behaviour"], x, i)))
                for i in rows(x)
            ]
            ratio = np.concatenate(
                [np.full(mask[i].sum(), s) for i, s in zip(rows(x), seq, strict=True)]
            )
            low, high = 3e-4, 4e-4
        clipped_high = (a > 0) & (ratio > 1 + high)
        clipped_low = (a < 0) & (ratio < 1 - low)
        assert clipped_high.any() and clipped_low.any()
        expected["clip_fraction"] = np.mean(clipped_high | clipped_low)
        expected["clip_fraction/high"] = np.mean(clipped_high)
        expected["clip_fraction/low"] = np.mean(clipped_low)
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_online_dpo_advantage_metrics_are_its_implicit_per_sample_weights():
    x = make_inputs(seed=17)
    beta = 0.1
    weights = np.zeros(B)
    for members in groups_of(x).values():
        r = x["rewards"][members]
        best, worst = members[int(np.argmax(r))], members[int(np.argmin(r))]
        if best == worst:  # tied or single-sample group: no pair, no gradient
            continue

        def log_ratio(i):
            return tok(x["logprobs"], x, i).sum() - tok(x["reference"], x, i).sum()

        margin = log_ratio(best) - log_ratio(worst)
        w = beta / (1 + np.exp(beta * margin))  # β·σ(−β·margin)
        weights[best], weights[worst] = w, -w
    valid = rows(x)
    config = AlgorithmConfig(name="online_dpo")
    with jax.enable_x64(True):
        _, m = objective(to_batch(x), jnp.asarray(x["logprobs"]), config=config)
    assert float(m["advantage/mean"]) == pytest.approx(weights[valid].mean(), abs=1e-12)
    assert float(m["advantage/std"]) == pytest.approx(weights[valid].std(), rel=1e-9)
    # They are the coefficients of ∇log π_θ(y) in −∇L (on each token of y), times #groups.
    _, grad = loss_and_grad(config, x)
    expected = -weights[:, None] * x["mask"] / len(groups_of(x))
    np.testing.assert_allclose(grad, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["dapo", "trajectory_balance", "online_dpo"])
def test_objective_jits_in_float32_with_a_traced_step(name):
    x = make_inputs(seed=12)
    batch = to_batch(x, jnp.float32)
    f = jax.jit(objective, static_argnames="config")
    step = jnp.int32(STEP)
    loss, m = f(
        batch, batch.behaviour_logprobs + 0.01, config=AlgorithmConfig(name=name), step=step
    )
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
    assert all(v.dtype == jnp.float32 for v in m.values())


def _without(x, **changes):
    batch = to_batch(x)
    return batch.replace(**changes)


@pytest.mark.parametrize(
    "config, changes, call, words",
    [
        (AlgorithmConfig(name="grpo"), {"reference_logprobs": None}, {}, "reference_logprobs"),
        (AlgorithmConfig(name="ppo"), {"values": None}, {}, "batch.values"),
        (AlgorithmConfig(name="ppo"), {}, {"values": None}, "values="),
        (AlgorithmConfig(name="dapo", entropy_coef=0.01), {}, {}, "entropies"),
        (AlgorithmConfig(name="trajectory_balance"), {"reference_logprobs": None}, {}, "π_ref"),
        (AlgorithmConfig(name="online_dpo"), {"reference_logprobs": None}, {}, "frozen"),
    ],
)
def test_missing_input_names_what_to_pass(config, changes, call, words):
    x = make_inputs(seed=13)
    kwargs = {"values": jnp.asarray(x["values"]), **call}
    with jax.enable_x64(True), pytest.raises(MissingInputError, match=words):
        objective(_without(x, **changes), jnp.asarray(x["logprobs"]), config=config, **kwargs)


def test_build_objective_says_which_inputs_it_needs():
    grpo, dapo, ppo = (build_objective(AlgorithmConfig(name=n)) for n in ("grpo", "dapo", "ppo"))
    assert grpo.needs_reference_logprobs and not dapo.needs_reference_logprobs
    assert ppo.needs_values and ppo.needs_rollout_values and not dapo.needs_values
    assert build_objective(AlgorithmConfig(name="online_dpo")).needs_reference_logprobs


def test_entropy_bonus_raises_the_entropy_gradient():
    x = make_inputs(seed=14)
    config = AlgorithmConfig(name="dapo", entropy_coef=0.01)
    with jax.enable_x64(True):
        batch, lp = to_batch(x), jnp.asarray(x["logprobs"])
        entropy = jnp.ones((B, S))
        grad = jax.grad(lambda h: objective(batch, lp, config=config, entropy=h)[0])(entropy)
    # d loss / d H = −c_H·w with DAPO's w; zero on padding.
    assert np.all(np.asarray(grad)[x["mask"]] < 0) and np.all(np.asarray(grad)[~x["mask"]] == 0)
