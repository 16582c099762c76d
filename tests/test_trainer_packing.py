"""Packed training batches (issue 42) in the trainer: for every preset, an RL step over
heavy-tailed sequence lengths packed into token rows gives the padded step's loss, metrics
and parameters within float rounding; so do the log-prob recompute and the SFT step; the
config refuses rows shorter than a sequence; and a packed run killed and resumed from its
checkpoint ends with the uninterrupted run's weights."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trainer_helpers import assert_trees_close, run_config

from rlax_tpu.algorithms import PRESETS, RolloutBatch, build_objective
from rlax_tpu.config import ConfigError, MeshConfig, ModelConfig, OptimizerConfig
from rlax_tpu.models import Transformer
from rlax_tpu.sharding import build_mesh
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer.packing import packed_layout, sequence_lengths
from rlax_tpu.trainer.programs import objective_inputs
from rlax_tpu.trainer.step import (
    BatchLevels,
    build_optimizer,
    make_rl_step,
    make_sft_step,
    recompute,
)

# One layer, a value head (PPO reads it; the others ignore it), float32.
MODEL = ModelConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    value_head=True,
)
SEQ = 16  # the padded length T, and the packed rows' tokens_per_row
LEVELS = BatchLevels(global_size=16, mini_size=8, micro_size=2)  # 2 updates of 4 micro-batches
PROMPT = 3


def compiled(fn, *args):
    # The suite compiles with XLA:CPU's quick code generation (tests/conftest.py), which
    # matters here: the per-preset test compiles two steps per preset.
    return jax.jit(fn)(*args)


@pytest.fixture(scope="module")
def model():
    graphdef, state = nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)), nnx.Param)
    return graphdef, nnx.to_pure_dict(state)


def heavy_tailed_mask(
    rng: np.random.Generator, rows: int = LEVELS.global_size, long_every: int = LEVELS.mini_size
) -> np.ndarray:
    """bool[rows, SEQ] response masks after a PROMPT-token prompt: most responses 1-3 tokens,
    one in `long_every` the whole row (the heavy tail), one empty; a hole in one response
    (an episode's given tokens)."""
    lengths = rng.integers(1, 4, rows)
    lengths[::long_every] = SEQ - PROMPT  # the longest: targets up to position T - 2
    lengths[3] = 0
    t = np.arange(SEQ)[None, :]
    mask = (t >= PROMPT - 1) & (t < PROMPT - 1 + lengths[:, None])
    mask[0, PROMPT + 2] = False
    return mask


def objective_batch(objective, rng: np.random.Generator, tokens, mask, group: int) -> RolloutBatch:
    """A batch of `tokens` and response `mask` ([rows, SEQ]) in groups of `group` rows, with
    random rewards, behaviour log-probs and every optional field `objective` reads."""
    rows = np.shape(tokens)[0]
    per_token = lambda lo, hi: jnp.asarray(rng.uniform(lo, hi, (rows, SEQ)), jnp.float32)  # noqa: E731
    optional = {
        "reference_logprobs": per_token(-4.0, -3.0),
        "values": per_token(-0.5, 0.5),
        "rollout_logprobs": per_token(-4.0, -3.0),
        "token_rewards": per_token(-0.1, 0.1),
        "token_advantages": per_token(-1.0, 1.0),
        "returns": per_token(-1.0, 1.0),
        "baseline_rewards": jnp.asarray(rng.normal(size=rows), jnp.float32),
    }
    return RolloutBatch(
        tokens=jnp.asarray(tokens, jnp.int32),
        response_mask=jnp.asarray(mask),
        group_ids=jnp.asarray(np.arange(rows) // group, jnp.int32),
        rewards=jnp.asarray(rng.normal(size=rows), jnp.float32),
        behaviour_logprobs=per_token(-4.0, -3.0),
        versions=jnp.zeros((rows,), jnp.int32),
        **{name: optional[name] for name in objective_inputs(objective)},
    )


def rollout_batch(objective, seed: int = 0) -> RolloutBatch:
    """A global batch with every optional field `objective` reads."""
    rng = np.random.default_rng(seed)
    mask = heavy_tailed_mask(rng)
    tokens = rng.integers(1, MODEL.vocab_size, mask.shape)
    return objective_batch(objective, rng, tokens, mask, group=2)


def layout_of(mask, chunks: int, tokens_per_row: int = SEQ, micro_size: int = LEVELS.micro_size):
    return packed_layout(
        sequence_lengths(np.asarray(mask)),
        chunks=chunks,
        micro_size=micro_size,
        tokens_per_row=tokens_per_row,
        seq=np.shape(mask)[1],
    )


def assert_metrics_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(
            np.asarray(got[key]), np.asarray(want[key]), rtol=1e-5, atol=1e-6, err_msg=key
        )


def assert_packed_step_equals_padded(model, objective, levels, batch, layout) -> None:
    """One RL step of `batch`, padded and packed by `layout`: loss, metrics and the updated
    parameters within float rounding. adam_eps well above the gradients' rounding noise, so
    the parameters compare tightly (with eps = 1e-8 a 1e-9 gradient is a ±lr update)."""
    graphdef, params = model
    optimizer = build_optimizer(
        OptimizerConfig(learning_rate=1e-2, adam_eps=1e-4), num_steps=10, updates_per_step=2
    )
    step, behaviour = jnp.asarray(3, jnp.int32), {"cached": batch.behaviour_logprobs}
    opt_state = optimizer.transform.init(params)
    padded = make_rl_step(graphdef, objective, optimizer, levels)
    packed = make_rl_step(graphdef, objective, optimizer, levels, packed=True)
    want_params, _, want = compiled(padded, params, opt_state, batch, step, behaviour)
    got_params, _, got = compiled(packed, params, opt_state, batch, step, behaviour, layout)
    assert np.isfinite(float(want["loss"])) and float(want["grad_norm"]) > 0
    assert_metrics_close(got, want)
    assert_trees_close(got_params, want_params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_packed_rl_step_equals_the_padded_one(model, preset):
    objective = build_objective(PRESETS[preset]())
    batch = rollout_batch(objective)
    layout = layout_of(batch.response_mask, LEVELS.num_updates)
    assert (layout.used < LEVELS.micro_per_mini).all()  # packing saves micro-batches
    assert_packed_step_equals_padded(model, objective, LEVELS, batch, layout)


@pytest.mark.parametrize("preset", ["ppo", "grpo"])
def test_a_packed_step_of_one_micro_batch_per_update_equals_the_padded_one(model, preset):
    """micro == mini: the one packed micro-batch is differentiated directly through the
    unpacking gather (values and entropies too, for PPO)."""
    levels = BatchLevels(global_size=16, mini_size=8, micro_size=8)
    objective = build_objective(PRESETS[preset]())
    batch = rollout_batch(objective)
    layout = layout_of(batch.response_mask, levels.num_updates, micro_size=levels.micro_size)
    assert_packed_step_equals_padded(model, objective, levels, batch, layout)


def test_the_packed_recompute_equals_the_padded_one(model):
    """π_old and V_old of the whole batch packed as one chunk: the padded recompute's on
    every position of every sequence, 0 past each sequence's length."""
    graphdef, params = model
    mask = heavy_tailed_mask(np.random.default_rng(1))
    tokens = jnp.asarray(
        np.random.default_rng(2).integers(1, MODEL.vocab_size, mask.shape), jnp.int32
    )
    layout = layout_of(mask, 1)
    assert layout.used[0] < LEVELS.global_size // LEVELS.micro_size

    def run(layout):
        return recompute(
            graphdef, params, tokens, micro_size=LEVELS.micro_size, values=True, layout=layout
        )

    want = compiled(lambda: run(None))
    got = compiled(lambda: run(layout))
    within = np.arange(SEQ)[None, :] < sequence_lengths(mask)[:, None]
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype == np.float32
        np.testing.assert_allclose(g[within], w[within], rtol=1e-5, atol=1e-6)
        assert not g[~within].any()


def test_a_packed_sft_step_equals_the_padded_one(model):
    graphdef, params = model
    rng = np.random.default_rng(3)
    loss_mask = heavy_tailed_mask(rng).astype(np.float32)
    tokens = jnp.asarray(rng.integers(1, MODEL.vocab_size, loss_mask.shape), jnp.int32)
    targets = jnp.asarray(rng.integers(1, MODEL.vocab_size, loss_mask.shape), jnp.int32)
    optimizer = build_optimizer(
        OptimizerConfig(learning_rate=1e-2, adam_eps=1e-4), num_steps=10, updates_per_step=2
    )
    opt_state = optimizer.transform.init(params)
    layout = layout_of(loss_mask, LEVELS.num_updates)
    args = (params, opt_state, tokens, targets, jnp.asarray(loss_mask))
    want_params, _, want = compiled(make_sft_step(graphdef, optimizer, LEVELS), *args)
    packed = make_sft_step(graphdef, optimizer, LEVELS, packed=True)
    got_params, _, got = compiled(packed, *args, layout)
    assert float(want["nll"]) > 0
    assert_metrics_close(got, want)
    assert_trees_close(got_params, want_params, rtol=1e-5, atol=1e-6)


def test_rows_shorter_than_a_sequence_are_a_config_error(tmp_path):
    config = run_config(str(tmp_path))  # max_seq_len 32
    with pytest.raises(
        ConfigError,
        match=r"trainer.tokens_per_row: must be 0 \(packing off\) or at least max_seq_len "
        r"\(32\).*got 24; set trainer.tokens_per_row=32 or more",
    ):
        config.apply_overrides(["trainer.tokens_per_row=24"])
    assert config.apply_overrides(["trainer.tokens_per_row=32"]).trainer.tokens_per_row == 32


TWO_DEVICES = MeshConfig(data=2, fsdp=1, tensor=1)


def _trainer(run_dir, **trainer) -> Trainer:
    # GRPO with a KL term: the recompute runs packed on the policy and on the reference.
    config = run_config(
        str(run_dir),
        mini=4,
        micro=1,
        mesh=TWO_DEVICES,
        model=dataclasses.replace(MODEL, value_head=False),
        adam_eps=1e-4,
        **trainer,
    )
    return Trainer(config, mesh=build_mesh(TWO_DEVICES, devices=jax.devices()[:2]))


def _batch(step: int) -> RolloutBatch:
    """Step `step`'s global batch (8 rows of 16 tokens, heavy-tailed responses)."""
    rng = np.random.default_rng(10 + step)
    mask = heavy_tailed_mask(rng, rows=8, long_every=4)
    return RolloutBatch(
        tokens=jnp.asarray(rng.integers(1, MODEL.vocab_size, mask.shape), jnp.int32),
        response_mask=jnp.asarray(mask),
        group_ids=jnp.asarray(np.arange(8) // 2, jnp.int32),
        rewards=jnp.asarray(rng.normal(size=8), jnp.float32),
        behaviour_logprobs=jnp.asarray(-rng.uniform(3.5, 4.5, mask.shape), jnp.float32),
        versions=jnp.zeros((8,), jnp.int32),
    )


def test_a_packed_step_reports_the_padding_it_no_longer_computes(tmp_path):
    """Each step reports how much of the packed and of the padded layout is padding. (A
    packed run killed and resumed ends with the uninterrupted run's weights: the e2e job
    packs, tests/test_controller_e2e.py.)"""
    trainer = _trainer(tmp_path, tokens_per_row=32)
    trainer.initialize()
    first = trainer.train_step(0, _batch(0))
    trainer.close()
    # Each mini-batch's 4 sequences (one of 15 tokens, the others 0-5) fit one row of 32
    # tokens: one packed micro-batch of 1 row runs instead of 4 padded rows of 16 tokens.
    tokens = sequence_lengths(np.asarray(_batch(0).response_mask)).sum()
    assert first.metrics["packing/padding_fraction_padded"] == pytest.approx(1 - tokens / 128)
    assert first.metrics["packing/padding_fraction"] == pytest.approx(1 - tokens / 64)
