"""Per-token loss masks (multi-turn episodes, issue 41): a response is the turns the policy
sampled with observation tokens given between them, and the trainer never learns from a
given token. The objective (every preset, and the parts no preset combines: rollout
corrections, the mismatch gate, whitening, the entropy bonus, given advantages and returns)
reads only the mask: its gradient at a given token is exactly 0, what a given token holds
changes nothing, and an episode trains as the same response with its given tokens cut out.

The gradient is taken with respect to the log-probs: the logits of position t reach the
loss only through log π(y_t) = log_softmax(logits_t)[y_t], so a zero gradient at log π(y_t)
is a zero gradient at logits_t.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_helpers import rollout_batch, run_config

from rlax_tpu.algorithms import PRESETS, RolloutBatch, objective
from rlax_tpu.config import (
    AdvantageOptions,
    AlgorithmConfig,
    MeshConfig,
    RolloutISConfig,
    ValueConfig,
)
from rlax_tpu.sharding import build_mesh
from rlax_tpu.trainer import Trainer

ONE_DEVICE = MeshConfig(data=1, fsdp=1, tensor=1)

B, S = 8, 16
GROUP_IDS = np.array([0, 0, 0, 1, 1, 1, 2, 2])
STEP = 7

# Every preset, and each part no preset uses on a preset that takes it.
CASES = {
    **{name: AlgorithmConfig(name=name) for name in PRESETS},
    "grpo+token_tis+gate": AlgorithmConfig(
        name="grpo", rollout_correction="token_tis", rollout_is=RolloutISConfig(gate_threshold=3.0)
    ),
    "dapo+sequence_mis": AlgorithmConfig(name="dapo", rollout_correction="sequence_mis"),
    "gspo+sequence_tis": AlgorithmConfig(name="gspo", rollout_correction="sequence_tis"),
    "grpo+token_mis": AlgorithmConfig(name="grpo", rollout_correction="token_mis"),
    "grpo+entropy+whiten": AlgorithmConfig(
        name="grpo", entropy_coef=0.01, advantage_options=AdvantageOptions(whiten=True)
    ),
    "grpo+pass_at_k": AlgorithmConfig(
        name="grpo", advantage="pass_at_k", advantage_options=AdvantageOptions(pass_at_k=2)
    ),
    "reinforce+given+returns": AlgorithmConfig(
        name="reinforce", advantage="given", value=ValueConfig(loss_coef=0.1)
    ),
}
# Per-token fields of the batch (besides the mask) and the gradient's inputs.
BATCH_FIELDS = ("behaviour", "rollout", "reference", "old_values", "token_rewards", "given_adv")
INPUTS = ("logprobs", "values", "entropy")


def inputs(seed: int, mask: np.ndarray, *, placeholder: float = 0.0) -> dict[str, np.ndarray]:
    """Random float64 rollouts on `mask`; off it, every per-token field holds `placeholder`
    (0.0 is what the engine gives an observation token: log-prob 0.0)."""
    rng = np.random.default_rng(seed)
    behaviour = -rng.uniform(0.05, 3.0, (B, S))
    x = {
        "mask": mask,
        "behaviour": behaviour,
        "rollout": behaviour + rng.normal(0, 0.1, (B, S)),
        "logprobs": behaviour + rng.normal(0, 0.3, (B, S)),
        "reference": behaviour + rng.normal(0, 0.2, (B, S)),
        "old_values": rng.normal(0, 1, (B, S)),
        "values": rng.normal(0, 1, (B, S)),
        "entropy": rng.uniform(0.1, 2.0, (B, S)),
        "token_rewards": rng.normal(0, 0.1, (B, S)),
        "given_adv": rng.normal(0, 1, (B, S)),
        "returns": rng.normal(0, 1, (B, S)),
    }
    for key in (*BATCH_FIELDS, *INPUTS, "returns"):
        x[key] = np.where(mask, x[key], placeholder)
    # Group 2 has equal rewards; the others spread in [0, 1].
    x["rewards"] = np.where(GROUP_IDS == 2, 0.5, rng.integers(0, 3, B) / 2 + rng.normal(0, 0.1, B))
    x["baseline"] = rng.integers(0, 3, B) / 2
    return x


def batch_of(x: dict[str, np.ndarray], config: AlgorithmConfig) -> RolloutBatch:
    f64 = functools.partial(jnp.asarray, dtype=jnp.float64)
    return RolloutBatch(
        tokens=jnp.zeros((B, S), jnp.int32),
        response_mask=jnp.asarray(x["mask"]),
        group_ids=jnp.asarray(GROUP_IDS, jnp.int32),
        rewards=f64(x["rewards"]),
        behaviour_logprobs=f64(x["behaviour"]),
        versions=jnp.full((B,), STEP, jnp.int32),
        reference_logprobs=f64(x["reference"]),
        values=f64(x["old_values"]),
        rollout_logprobs=f64(x["rollout"]),
        token_rewards=f64(x["token_rewards"]),
        token_advantages=f64(x["given_adv"]),
        returns=f64(x["returns"]) if config.resolved().advantage == "given" else None,
        baseline_rewards=f64(x["baseline"]),
    )


@functools.cache
def _loss_and_grads(name: str):
    config = CASES[name]

    def loss(lp, values, entropy, batch):
        return objective(batch, lp, config=config, values=values, entropy=entropy, step=STEP)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def run(name: str, x: dict[str, np.ndarray]):
    """(loss, metrics, (d/d logprobs, d/d values, d/d entropy)) of case `name` on `x`."""
    with jax.enable_x64(True):
        (loss, metrics), grads = _loss_and_grads(name)(
            *(jnp.asarray(x[k]) for k in INPUTS), batch_of(x, CASES[name])
        )
        return (
            float(loss),
            {k: float(v) for k, v in metrics.items()},
            tuple(np.asarray(g) for g in grads),
        )


@st.composite
def masks(draw) -> np.ndarray:
    """bool[B, S]: each row a prompt (1..3 positions), then alternating runs of sampled and
    given tokens in any pattern (a row may end on given tokens, or be padding: all 0)."""
    mask = np.zeros((B, S), bool)
    for row in range(B):
        t = draw(st.integers(1, 3))
        sampled = True
        while t < S:
            run_length = draw(st.integers(1, 4))
            mask[row, t : t + run_length] = sampled
            t += run_length
            sampled = not sampled if draw(st.booleans()) else sampled
        mask[row, t:] = False
    if mask.sum(1).astype(bool).sum() < 2:  # at least two rows with a sampled token
        mask[:2, 2] = True
    return mask


def episode_mask() -> np.ndarray:
    """bool[B, S]: episode-shaped rows, turn 1 (sampled) · observation (given) · turn 2."""
    mask = np.zeros((B, S), bool)
    rng = np.random.default_rng(0)
    for row in range(B):
        prompt, turn1, obs = rng.integers(1, 3), rng.integers(1, 5), rng.integers(1, 4)
        turn2 = rng.integers(1, S - prompt - turn1 - obs + 1)
        mask[row, prompt : prompt + turn1] = True
        mask[row, prompt + turn1 + obs : prompt + turn1 + obs + turn2] = True
    return mask


# -- (a) the gradient at a given token is exactly 0 -------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=4, deadline=None)
@given(mask=masks(), seed=st.integers(0, 2**16))
def test_no_gradient_reaches_a_masked_out_token(name, mask, seed):
    loss, metrics, grads = run(name, inputs(seed, mask))
    assert np.isfinite(loss)
    for what, grad in zip(INPUTS, grads, strict=True):
        assert np.all(grad[~mask] == 0), f"{name}: d loss / d {what} off the mask"
    # ... while the sampled tokens do get one (the property is not vacuous), unless no token
    # can: no advantage, or every sampled token's ratio clipped.
    vacuous = metrics["advantage/std"] == 0 or metrics.get("clip_fraction", 0.0) == 1.0
    assert np.any(grads[0][mask] != 0) or vacuous


# -- (b) what a given token holds is ignored ----------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_absurd_placeholders_on_given_tokens_change_nothing(name):
    mask = episode_mask()
    sane = inputs(1, mask, placeholder=0.0)
    # Log-probs of -1e9 (a ratio of e^1e9 if one were read), values, rewards, entropies 1e9.
    absurd = inputs(1, mask, placeholder=-1e9)
    absurd = {
        k: np.where(mask, v, 1e9)
        if k in ("values", "old_values", "token_rewards", "entropy", "given_adv", "returns")
        else v
        for k, v in absurd.items()
    }
    loss, metrics, grads = run(name, sane)
    loss2, metrics2, grads2 = run(name, absurd)
    assert loss2 == loss
    assert metrics2 == pytest.approx(metrics, rel=0, abs=0, nan_ok=True)
    for g, g2 in zip(grads, grads2, strict=True):
        np.testing.assert_array_equal(g2, g)


# -- (c) an episode trains as its response with the given tokens cut out ----------------------


def cut_out_given(x: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """`x` with every masked-out position after a row's first sampled token deleted (the
    later positions move left; the freed ones at the end are padding holding NaN), and per
    row the old positions of the kept ones."""
    mask = x["mask"]
    out = {k: v.copy() for k, v in x.items()}
    kept_positions = []
    for row in range(B):
        first = int(np.argmax(mask[row])) if mask[row].any() else S
        keep = np.concatenate([np.arange(first), first + np.flatnonzero(mask[row, first:])])
        kept_positions.append(keep)
        for key, value in x.items():
            if np.shape(value) != (B, S):
                continue
            fill = False if key == "mask" else np.nan
            out[key][row] = np.concatenate([value[row, keep], np.full(S - len(keep), fill)])
    return out, kept_positions


# Clip-Cov draws its tokens by a uniform field over [batch, seq] positions: moving a token
# moves its draw, so its selection (not its rule) depends on where the token sits.
POSITIONAL = {"clip_cov"}


@pytest.mark.parametrize("name", [n for n in CASES if n not in POSITIONAL])
def test_an_episode_trains_as_its_response_with_the_given_tokens_cut_out(name):
    x = inputs(2, episode_mask())
    compact, kept = cut_out_given(x)
    assert compact["mask"].sum() == x["mask"].sum() and (compact["mask"] != x["mask"]).any()
    loss, metrics, grads = run(name, x)
    loss2, metrics2, grads2 = run(name, compact)
    assert loss2 == pytest.approx(loss, rel=1e-12, abs=1e-15)
    assert metrics2 == pytest.approx(metrics, rel=1e-12, abs=1e-15, nan_ok=True)
    for g, g2 in zip(grads, grads2, strict=True):
        for row in range(B):
            np.testing.assert_allclose(
                g2[row, : len(kept[row])], g[row, kept[row]], rtol=1e-12, atol=1e-15
            )


# -- (b) end to end through the trainer: placeholders and their versions are never read -------


def episode_batch(placeholder_logprob: float, placeholder_version: int) -> RolloutBatch:
    """`rollout_batch(0)` as episodes: in each row a run of given tokens inside the response
    (response_mask 0 there, as assembly sends them), which hold `placeholder_logprob` and
    `placeholder_version`; every sampled token is version 0's (batch 0 accepts only it)."""
    batch = rollout_batch(0)
    response = np.asarray(batch.response_mask)
    mask = response.copy()
    for row in range(mask.shape[0]):
        positions = np.flatnonzero(response[row])
        mask[row, positions[1 : 1 + len(positions) // 2]] = False  # an observation
    given = response & ~mask
    assert given.any(1).all()
    behaviour = np.where(given, placeholder_logprob, np.asarray(batch.behaviour_logprobs))
    return batch.replace(
        response_mask=jnp.asarray(mask),
        behaviour_logprobs=jnp.asarray(behaviour, jnp.float32),
        token_versions=jnp.asarray(np.where(given, placeholder_version, 0), jnp.int32),
    )


# Metrics of the clock, not of the step's numbers.
TIMING = ("time/", "tokens_per_s", "mfu")


@pytest.mark.parametrize(
    "trainer_fields",
    [
        # The workers' log-probs are the behaviour policy: a placeholder would enter ρ.
        dict(behaviour_logprobs="cached", algorithm=AlgorithmConfig(name="grpo")),
        # They are π_rollout: a placeholder would enter TIS, the gate and the mismatch metrics.
        dict(
            algorithm=AlgorithmConfig(
                name="grpo",
                rollout_correction="token_tis",
                rollout_is=RolloutISConfig(gate_threshold=3.0),
            )
        ),
    ],
    ids=["cached", "rollout_correction"],
)
def test_the_trainer_ignores_what_given_tokens_hold(tmp_path, trainer_fields):
    """A given token with log-prob −1e9 and a version after the step (it would be refused
    if it were checked) trains exactly as one with the engine's placeholders."""
    results, params = [], []
    for name, batch in (("sane", episode_batch(0.0, 0)), ("absurd", episode_batch(-1e9, 99))):
        trainer = Trainer(
            run_config(str(tmp_path / name), mesh=ONE_DEVICE, micro=4, **trainer_fields),
            mesh=build_mesh(ONE_DEVICE, devices=jax.devices()[:1]),
        )
        trainer.initialize()
        results.append(trainer.train_step(0, batch))
        params.append(jax.tree.map(np.asarray, trainer.params()))
        trainer.close()
    sane, absurd = (
        {k: v for k, v in r.metrics.items() if not k.startswith(TIMING)} for r in results
    )
    assert absurd == pytest.approx(sane, rel=0, abs=0, nan_ok=True)
    for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1]), strict=True):
        np.testing.assert_array_equal(a, b)
