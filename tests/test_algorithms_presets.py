"""Every preset against a separate float64 NumPy implementation of its published formula.

The reference losses below are written from the papers (not from rlax_tpu's parts): one
loop per group and sequence. Their gradients are central finite differences in float64;
stop-gradients are a frozen copy of the log-probs (`lp_sg`) that the differences do not
move. Inputs are random, with ragged response lengths, ragged and non-contiguous groups,
a group whose rewards are all equal, and a padding row; padding holds NaN. Parts that no
preset uses are checked on presets with overrides (`OVERRIDE_CASES`).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu.algorithms import PRESETS, RolloutBatch, build_objective
from rlax_tpu.config import AlgorithmConfig, ImportanceConfig

B, S = 11, 12
GROUP_IDS = np.array([3, 0, 3, 7, 0, 3, 7, 9, 3, 0, 5])  # sizes 4, 3, 2, 1 (+ row 10: padding)
STEP = 100


def make_inputs(seed: int, spread: float = 0.3) -> dict[str, np.ndarray]:
    """Random float64 rollouts; log π_θ = log μ + N(0, spread) on response tokens."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, S), bool)
    for i in range(B - 1):
        start = rng.integers(1, 4)
        mask[i, start : start + rng.integers(1, S - start)] = True
    behaviour = -rng.uniform(0.05, 3.0, (B, S))
    inputs = {
        "mask": mask,
        "group_ids": GROUP_IDS,
        # Group 7 (rows 3, 6) has equal rewards; rewards in {0, 0.5, 1} plus noise elsewhere.
        "rewards": np.where(GROUP_IDS == 7, 0.5, rng.integers(0, 3, B) / 2 + rng.normal(0, 0.1, B)),
        "behaviour": behaviour,
        "logprobs": behaviour + rng.normal(0, spread, (B, S)),
        "reference": behaviour + rng.normal(0, 0.2, (B, S)),
        "old_values": rng.normal(0, 1, (B, S)),
        "values": rng.normal(0, 1, (B, S)),
        "versions": rng.integers(90, 101, B),
        # ReMax's baseline: the reward of each prompt's greedy response.
        "baseline_rewards": rng.integers(0, 3, B) / 2,
    }
    for key in ("behaviour", "logprobs", "reference", "old_values", "values"):
        inputs[key] = np.where(mask, inputs[key], np.nan)
    return inputs


# -- reference implementations of the published formulas ----------------------------------


def rows(x):
    return [i for i in range(B) if x["mask"][i].any()]


def groups_of(x):
    out: dict[int, list[int]] = {}
    for i in rows(x):
        out.setdefault(int(x["group_ids"][i]), []).append(i)
    return out


def tok(a, x, i):
    return a[i][x["mask"][i]]


def grpo_advantages(x, std=True):
    adv = {}
    for members in groups_of(x).values():
        r = x["rewards"][members]
        for i in members:
            if np.all(r == r[0]):
                adv[i] = 0.0
            elif std:
                adv[i] = (x["rewards"][i] - r.mean()) / (r.std(ddof=1) + 1e-6)
            else:
                adv[i] = x["rewards"][i] - r.mean()
    return adv


def ppo_term(ratio, adv, lo, hi):
    return np.minimum(ratio * adv, np.clip(ratio, 1 - lo, 1 + hi) * adv)


def ref_reinforce(x, lp, lp_sg):
    return -np.mean([x["rewards"][i] * tok(lp, x, i).sum() for i in rows(x)])


def ref_rloo(x, lp, lp_sg):
    total = []
    for members in groups_of(x).values():
        for i in members:
            others = [x["rewards"][j] for j in members if j != i]
            adv = x["rewards"][i] - np.mean(others) if others else 0.0
            total.append(adv * tok(lp, x, i).sum())
    return -np.sum(total) / len(rows(x))


def ref_proximal_rloo(x, lp, lp_sg):
    total = 0.0
    for members in groups_of(x).values():
        for i in members:
            others = [x["rewards"][j] for j in members if j != i]
            adv = x["rewards"][i] - np.mean(others) if others else 0.0
            ratio = np.exp((tok(lp, x, i) - tok(x["behaviour"], x, i)).sum())
            total += ppo_term(ratio, adv, 0.2, 0.2)
    return -total / len(rows(x))


def ref_grpo(x, lp, lp_sg):
    adv, beta = grpo_advantages(x), 0.04
    total = 0.0
    for i in rows(x):
        ratio = np.exp(tok(lp, x, i) - tok(x["behaviour"], x, i))
        log_ref_over_pi = tok(x["reference"], x, i) - tok(lp, x, i)
        k3 = np.exp(log_ref_over_pi) - log_ref_over_pi - 1
        total += np.mean(ppo_term(ratio, adv[i], 0.2, 0.2) - beta * k3)
    return -total / len(rows(x))


def ref_dapo(x, lp, lp_sg):
    adv, total = grpo_advantages(x), 0.0
    for members in groups_of(x).values():
        n_tokens = sum(x["mask"][i].sum() for i in members)
        for i in members:
            ratio = np.exp(tok(lp, x, i) - tok(x["behaviour"], x, i))
            total += ppo_term(ratio, adv[i], 0.2, 0.28).sum() / n_tokens
    return -total / len(groups_of(x))


def ref_dr_grpo(x, lp, lp_sg):
    adv, total = grpo_advantages(x, std=False), 0.0
    for i in rows(x):
        ratio = np.exp(tok(lp, x, i) - tok(x["behaviour"], x, i))
        total += ppo_term(ratio, adv[i], 0.2, 0.2).sum() / S  # L = the padded length
    return -total / len(rows(x))


def ref_gspo(x, lp, lp_sg):
    adv, total = grpo_advantages(x), 0.0
    for i in rows(x):
        s = np.exp(np.mean(tok(lp, x, i) - tok(x["behaviour"], x, i)))
        total += ppo_term(s, adv[i], 3e-4, 4e-4)
    return -total / len(rows(x))


def ref_cispo(x, lp, lp_sg):
    adv, total = grpo_advantages(x), 0.0
    for members in groups_of(x).values():
        n_tokens = sum(x["mask"][i].sum() for i in members)
        for i in members:
            weight = np.clip(np.exp(tok(lp_sg, x, i) - tok(x["behaviour"], x, i)), 0.0, 8.0)
            total += np.sum(weight * adv[i] * tok(lp, x, i)) / n_tokens
    return -total / len(groups_of(x))


def ref_reinforce_pp(x, lp, lp_sg):
    centred = {}
    for members in groups_of(x).values():
        for i in members:
            centred[i] = x["rewards"][i] - x["rewards"][members].mean()
    std = np.std(list(centred.values()), ddof=1)
    total = 0.0
    for i in rows(x):
        adv = centred[i] / (std + 1e-6)
        ratio = np.exp(tok(lp, x, i) - tok(x["behaviour"], x, i))
        k2 = 0.5 * (tok(lp, x, i) - tok(x["reference"], x, i)) ** 2
        total += np.mean(ppo_term(ratio, adv, 0.2, 0.2) - 1e-3 * k2)
    return -total / len(rows(x))


def ref_reinforce_pp_batch(x, lp, lp_sg):
    r = x["rewards"][rows(x)]
    mean, std = r.mean(), r.std(ddof=1)
    total = 0.0
    for i in rows(x):
        adv = (x["rewards"][i] - mean) / (std + 1e-6)  # no group baseline
        ratio = np.exp(tok(lp, x, i) - tok(x["behaviour"], x, i))
        k2 = 0.5 * (tok(lp, x, i) - tok(x["reference"], x, i)) ** 2
        total += np.mean(ppo_term(ratio, adv, 0.2, 0.2) - 0.01 * k2)
    return -total / len(rows(x))


def gae_reference(rewards, values, gamma, lam):
    """GAE over one response: reward at the last token, V after it = 0."""
    n = len(values)
    adv, next_adv, next_value = np.zeros(n), 0.0, 0.0
    for t in reversed(range(n)):
        r = rewards if t == n - 1 else 0.0
        adv[t] = r + gamma * next_value - values[t] + gamma * lam * next_adv
        next_adv, next_value = adv[t], values[t]
    return adv


def ref_ppo(x, lp, lp_sg, values=None):
    values = x["values"] if values is None else values
    n_tokens = x["mask"].sum()
    gae = {
        i: gae_reference(x["rewards"][i], tok(x["old_values"], x, i), 1.0, 0.95) for i in rows(x)
    }
    # verl/Tunix whiten GAE over every response token of the batch: var with n − 1, + 1e-8.
    flat = np.concatenate(list(gae.values()))
    mean, var = flat.mean(), flat.var(ddof=1)
    pg, vf = 0.0, 0.0
    for i in rows(x):
        old = tok(x["old_values"], x, i)
        adv = (gae[i] - mean) / np.sqrt(var + 1e-8)
        ratio = np.exp(tok(lp, x, i) - tok(x["behaviour"], x, i))
        pg += ppo_term(ratio, adv, 0.2, 0.2).sum()
        v, ret = tok(values, x, i), gae[i] + old  # the value target: GAE before whitening
        v_clip = old + np.clip(v - old, -0.2, 0.2)
        vf += np.sum(0.5 * np.maximum((v - ret) ** 2, (v_clip - ret) ** 2))
    return -pg / n_tokens + 0.1 * vf / n_tokens


def ref_aipo(x, lp, lp_sg):
    adv, total = grpo_advantages(x, std=False), 0.0
    for i in rows(x):
        weight = np.minimum(np.exp(tok(lp_sg, x, i) - tok(x["behaviour"], x, i)), 2.0)
        total += np.sum(weight * adv[i] * tok(lp, x, i))
    return -total / len(rows(x))


def tb_beta(step):
    return 0.012 + (0.004 - 0.012) * min(step / 500, 1.0)


def ref_trajectory_balance(x, lp, lp_sg):
    beta, total = tb_beta(STEP), 0.0
    for members in groups_of(x).values():
        log_z = np.mean(
            [
                tok(x["reference"], x, j).sum() - tok(lp_sg, x, j).sum() + x["rewards"][j] / beta
                for j in members
            ]
        )
        for i in members:
            residual = (
                log_z
                + tok(lp, x, i).sum()
                - tok(x["reference"], x, i).sum()
                - x["rewards"][i] / beta
            )
            total += residual**2
    return total / len(rows(x))


def ref_online_dpo(x, lp, lp_sg):
    beta, total = 0.1, 0.0
    for members in groups_of(x).values():
        r = x["rewards"][members]
        best, worst = members[int(np.argmax(r))], members[int(np.argmin(r))]

        def log_ratio(i):
            return tok(lp, x, i).sum() - tok(x["reference"], x, i).sum()

        margin = beta * (log_ratio(best) - log_ratio(worst))
        total += np.log1p(np.exp(-margin))  # −log σ(margin)
    return total / len(groups_of(x))


# -- parts no preset uses, on a preset with overrides ----------------------------------------


def ref_grpo_k1(x, lp, lp_sg):
    adv, beta = grpo_advantages(x), 0.04
    total = 0.0
    for i in rows(x):
        ratio = np.exp(tok(lp, x, i) - tok(x["behaviour"], x, i))
        k1 = tok(lp, x, i) - tok(x["reference"], x, i)  # log π_θ/π_ref
        total += np.mean(ppo_term(ratio, adv[i], 0.2, 0.2) - beta * k1)
    return -total / len(rows(x))


def ref_reinforce_batch_norm(x, lp, lp_sg):
    r = x["rewards"][rows(x)]
    mean, std = r.mean(), r.std(ddof=1)
    total = [(x["rewards"][i] - mean) / (std + 1e-6) * tok(lp, x, i).sum() for i in rows(x)]
    return -np.mean(total)


def ref_aipo_sequence_truncated(x, lp, lp_sg):
    """AIPO's truncation on the whole-sequence ratio π_θ(y)/μ(y) (a product over tokens)."""
    adv, total = grpo_advantages(x, std=False), 0.0
    for i in rows(x):
        seq_ratio = np.exp(np.sum(tok(lp_sg, x, i) - tok(x["behaviour"], x, i)))
        total += min(seq_ratio, 2.0) * adv[i] * tok(lp, x, i).sum()
    return -total / len(rows(x))


def ref_cispo_sequence_clipped(x, lp, lp_sg):
    """CISPO's clipped weight on GSPO's length-normalised sequence ratio, bounds [0.9, 1.1]."""
    adv, total = grpo_advantages(x), 0.0
    for members in groups_of(x).values():
        n_tokens = sum(x["mask"][i].sum() for i in members)
        for i in members:
            s = np.exp(np.mean(tok(lp_sg, x, i) - tok(x["behaviour"], x, i)))
            total += np.clip(s, 0.9, 1.1) * adv[i] * tok(lp, x, i).sum() / n_tokens
    return -total / len(groups_of(x))


# name -> (config, reference): the parts batch_norm, sequence_truncated, sequence_clipped
# and k1, which no published preset (or only a new one) combines this way.
OVERRIDE_CASES = {
    "grpo+k1": (AlgorithmConfig(name="grpo", kl_estimator="k1"), ref_grpo_k1),
    "reinforce+batch_norm": (
        AlgorithmConfig(name="reinforce", advantage="batch_norm"),
        ref_reinforce_batch_norm,
    ),
    "aipo+sequence_truncated": (
        AlgorithmConfig(
            name="aipo", importance_weight="sequence_truncated", sequence_ratio="product"
        ),
        ref_aipo_sequence_truncated,
    ),
    "cispo+sequence_clipped": (
        AlgorithmConfig(
            name="cispo",
            importance_weight="sequence_clipped",
            importance=ImportanceConfig(rho_min=0.9, rho_max=1.1),
        ),
        ref_cispo_sequence_clipped,
    ),
}

REFERENCES = {
    "reinforce": ref_reinforce,
    "rloo": ref_rloo,
    "proximal_rloo": ref_proximal_rloo,
    "grpo": ref_grpo,
    "dapo": ref_dapo,
    "dr_grpo": ref_dr_grpo,
    "gspo": ref_gspo,
    "cispo": ref_cispo,
    "reinforce_pp": ref_reinforce_pp,
    "reinforce_pp_batch": ref_reinforce_pp_batch,
    "ppo": ref_ppo,
    "aipo": ref_aipo,
    "trajectory_balance": ref_trajectory_balance,
    "online_dpo": ref_online_dpo,
}
# Log-prob spread per preset, so ratios straddle its clip range (GSPO's is 3e-4 wide) and
# reach CISPO's bound 8; the test asserts that the clip and the bounds are reached.
SPREAD = {"gspo": 4e-4, "proximal_rloo": 0.2, "cispo": 1.2}


def finite_difference(f, x: np.ndarray, mask: np.ndarray, h: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(x)
    for idx in zip(*np.nonzero(mask), strict=True):
        up, down = x.copy(), x.copy()
        up[idx] += h
        down[idx] -= h
        grad[idx] = (f(up) - f(down)) / (2 * h)
    return grad


def to_batch(x, dtype=jnp.float64) -> RolloutBatch:
    return RolloutBatch(
        tokens=jnp.zeros((B, S), jnp.int32),
        response_mask=jnp.asarray(x["mask"]),
        group_ids=jnp.asarray(x["group_ids"], jnp.int32),
        rewards=jnp.asarray(x["rewards"], dtype),
        behaviour_logprobs=jnp.asarray(x["behaviour"], dtype),
        versions=jnp.asarray(x["versions"], jnp.int32),
        reference_logprobs=jnp.asarray(x["reference"], dtype),
        values=jnp.asarray(x["old_values"], dtype),
        baseline_rewards=(
            jnp.asarray(x["baseline_rewards"], dtype) if "baseline_rewards" in x else None
        ),
    )


def test_every_preset_has_a_reference():
    # The presets of the newer advantage estimators and policy losses have theirs next to
    # those parts' tests.
    from test_algorithms_advantages import PRESET_REFERENCES
    from test_algorithms_policy_losses import PRESET_REFERENCES as POLICY_LOSS_REFERENCES

    assert set(REFERENCES) | set(PRESET_REFERENCES) | set(POLICY_LOSS_REFERENCES) == set(PRESETS)
    assert set(PRESETS) == set(AlgorithmConfig.PRESET_NAMES)


CASES = {
    **{name: (AlgorithmConfig(name=name), ref) for name, ref in REFERENCES.items()},
    **OVERRIDE_CASES,
}


def case_seed(name: str) -> int:
    """A seed per case that adding another case leaves alone."""
    return zlib.crc32(name.encode()) % 2**16


@pytest.mark.parametrize("name", list(CASES))
def test_preset_loss_and_gradient_equal_the_published_formula(name):
    config, ref = CASES[name]
    x = make_inputs(seed=case_seed(name), spread=SPREAD.get(name, 0.3))
    objective = build_objective(config)
    with jax.enable_x64(True):
        batch = to_batch(x)

        @jax.jit
        def loss_fn(lp, values):
            return objective(batch, lp, values=values, step=STEP)

        (loss, metrics), (grad, value_grad) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True
        )(jnp.asarray(x["logprobs"]), jnp.asarray(x["values"]))
        assert loss.dtype == jnp.float64
        loss, grad, value_grad = float(loss), np.asarray(grad), np.asarray(value_grad)
        metrics = {k: float(v) for k, v in metrics.items()}

    lp = np.nan_to_num(x["logprobs"])
    expected = ref(x, lp, lp)
    np.testing.assert_allclose(loss, expected, rtol=1e-9, atol=1e-12)
    expected_grad = finite_difference(lambda v: ref(x, v, lp), lp, x["mask"])
    scale = np.abs(expected_grad).max()
    assert scale > 0
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-6, atol=1e-7 * scale)
    assert np.all(grad[~x["mask"]] == 0)  # padding contributes nothing
    if name == "ppo":
        values = np.nan_to_num(x["values"])
        expected_value_grad = finite_difference(
            lambda v: ref_ppo(x, lp, lp, values=v), values, x["mask"]
        )
        np.testing.assert_allclose(value_grad, expected_value_grad, rtol=1e-6, atol=1e-9)
    else:
        assert not np.any(value_grad)
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    # The inputs reach the clip and the bounds, so those branches are checked too.
    c = config.resolved()
    if c.is_policy_gradient and c.gradient_mask != "keep_all":
        assert metrics["clip_fraction"] > 0
    if c.is_policy_gradient and c.importance_weight.endswith(("truncated", "clipped")):
        assert metrics["importance_weight/bounded_fraction"] > 0
