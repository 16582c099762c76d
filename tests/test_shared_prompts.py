"""Shared prompts in packed training rows (trainer.share_prefixes): the samples of a group
hold their prompt once, attend to it there, and the RL step, the recompute and the step's
gradient equal the padded batch's within float rounding, with fewer token slots run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer_packing import (  # noqa: F401 (model: the fixture)
    MODEL,
    assert_packed_step_equals_padded,
    compiled,
    model,
    objective_batch,
)
from trainer_helpers import assert_trees_close, run_config

from rlax_tpu.algorithms import PRESETS, RolloutBatch, build_objective
from rlax_tpu.config import ConfigError
from rlax_tpu.models.attention import causal_mask
from rlax_tpu.trainer.packing import packed_layout, response_starts, sequence_lengths
from rlax_tpu.trainer.step import BatchLevels, recompute

SEQ = 16
ROWS, GROUP = 16, 4
LEVELS = BatchLevels(global_size=ROWS, mini_size=8, micro_size=2)  # 2 updates of 4 micro-batches


def grouped(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32[16, 16], response mask bool[16, 16]): 4 groups of 4 samples, each
    group's prompt (5-9 tokens) the same in its rows, responses of 1-6 tokens. Row 3 has
    no response (shares nothing); row 7's prompt differs from its group's in its last
    token only (its own unit); row 9's response has a hole (a tool's given tokens)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, MODEL.vocab_size, (ROWS, SEQ))
    mask = np.zeros((ROWS, SEQ), bool)
    for g in range(ROWS // GROUP):
        prompt = int(rng.integers(5, 10))
        rows = slice(g * GROUP, (g + 1) * GROUP)
        tokens[rows, :prompt] = rng.integers(1, MODEL.vocab_size, prompt)
        for b in range(g * GROUP, (g + 1) * GROUP):
            mask[b, prompt - 1 : prompt - 1 + int(rng.integers(1, 7))] = True
    mask[3] = False
    start = int(response_starts(mask)[7])
    tokens[7, start] = tokens[6, start] % (MODEL.vocab_size - 1) + 1  # differs at the last
    mask[9, int(response_starts(mask)[9]) + 1] = False
    return tokens.astype(np.int32), mask


def layout_of(tokens, mask, *, chunks, micro_size=LEVELS.micro_size, width=SEQ, shared=True):
    extra = dict(starts=response_starts(mask), tokens=tokens) if shared else {}
    return packed_layout(
        sequence_lengths(mask),
        chunks=chunks,
        micro_size=micro_size,
        tokens_per_row=width,
        seq=SEQ,
        **extra,
    )


def test_each_position_reads_its_own_token_and_a_groups_prompt_is_packed_once():
    tokens, mask = grouped()
    lengths = sequence_lengths(mask)
    layout = layout_of(tokens, mask, chunks=1, width=32)
    unshared = layout_of(tokens, mask, chunks=1, width=32, shared=False)
    flat = np.append(tokens.reshape(-1), 0)[layout.source.reshape(-1)]  # packed tokens
    flat = np.append(flat, -1)
    within = np.arange(SEQ)[None, :] < lengths[:, None]
    # Every position of every sequence reads its own token back, at its own position.
    np.testing.assert_array_equal(flat[layout.unpack[0]][within], tokens[within])
    positions = np.append(layout.positions.reshape(-1), -1)[layout.unpack[0]]
    np.testing.assert_array_equal(
        positions[within], np.broadcast_to(np.arange(SEQ), mask.shape)[within]
    )
    assert (layout.unpack[0][~within] == layout.source.size).all()
    # Group 0 (rows 0-2; row 3 has no response) holds its prompt once: rows 0-2 read their
    # prompt positions from the same slots, and their samples attend to that segment.
    f = int(response_starts(mask)[0])
    assert (layout.unpack[0, 0, :f] == layout.unpack[0, 1, :f]).all()
    assert (layout.unpack[0, 0, :f] == layout.unpack[0, 2, :f]).all()
    segments = layout.segment_ids.reshape(-1)
    prompt_id = segments[layout.unpack[0, 0, 0]]
    assert prompt_id > ROWS  # a prompt's own segment
    own = layout.unpack[0, 0, f : lengths[0]]
    assert (layout.prefix_ids.reshape(-1)[own] == prompt_id).all()
    assert (segments[own] == 1).all()
    # Row 7 (last prompt token differs) shares nothing: its prompt is its own.
    assert not set(layout.unpack[0, 7, :f].tolist()) & set(layout.unpack[0, 6, :f].tolist())
    # Fewer token slots hold sequences than the unshared packing's.
    assert layout.sequence_tokens < unshared.sequence_tokens == lengths.sum()
    assert layout.padded_sequence_tokens == unshared.padded_sequence_tokens == lengths.sum()


def test_a_group_too_long_for_a_row_splits_with_a_copy_of_its_prompt():
    tokens, mask = grouped()
    lengths, starts = sequence_lengths(mask), response_starts(mask)
    width = SEQ  # group 1 (rows 4-6 share) does not fit one row of 16 with its prompt
    layout = layout_of(tokens, mask, chunks=1, width=width)
    f = int(starts[4])
    assert f + sum(int(lengths[b]) - f for b in (4, 5, 6)) > width
    rows_of = layout.unpack[0, 4:7, 0] // width
    assert len(set(rows_of.tolist())) >= 2  # the group spans rows, each with the prompt
    for b in (4, 5, 6):
        assert layout.unpack[0, b, 0] // width == layout.unpack[0, b, f] // width


def test_a_sample_attends_to_its_prompt_and_never_to_a_sibling():
    segment_ids = jnp.asarray([[5, 5, 1, 1, 2, 2, 0]])
    prefix_ids = jnp.asarray([[0, 0, 5, 5, 5, 5, 0]])
    mask = np.asarray(causal_mask(1, 7, segment_ids, prefix_ids))[0]
    assert mask[4].tolist() == [True, True, False, False, True, False, False]
    assert mask[3].tolist() == [True, True, True, True, False, False, False]
    assert mask[1].tolist() == [True, True, False, False, False, False, False]
    assert not mask[:, 6].any()


@pytest.mark.parametrize("shared", [True, False])
def test_pass_two_cotangents_are_the_transpose_of_reading_outputs_back(shared):
    """Pass 2 of a packed step takes the cotangents of the padded outputs to the packed
    slots: the transpose of the unpacking gather, so a shared prompt's slot gets the sum of
    its samples' (an objective reading prompt positions would train them all)."""
    from rlax_tpu.trainer.step import _pack_cotangent, _unpack

    tokens, mask = grouped()
    layout = layout_of(tokens, mask, chunks=1, width=32, shared=shared)
    one = jax.tree.map(lambda x: None if x is None else jnp.asarray(x[0]), layout)
    packed = jnp.zeros(one.source.shape, jnp.float32)
    cot = jnp.asarray(np.random.default_rng(0).normal(size=mask.shape), jnp.float32)
    _, transpose = jax.vjp(lambda x: _unpack(x, one.unpack), packed)
    want = np.asarray(transpose(cot)[0])
    np.testing.assert_allclose(np.asarray(_pack_cotangent(cot, one)), want, rtol=1e-6)
    if shared:  # a prompt slot sums several samples' cotangents
        prompt_slot = int(one.unpack[0, 0])
        rows_reading_it = int((np.asarray(one.unpack) == prompt_slot).sum())
        assert rows_reading_it > 1


def grouped_batch(objective, seed: int = 0) -> RolloutBatch:
    tokens, mask = grouped(seed)
    return objective_batch(objective, np.random.default_rng(seed + 100), tokens, mask, GROUP)


@pytest.mark.parametrize("preset, micro", [("grpo", 2), ("ppo", 8)])
def test_a_step_sharing_prompts_equals_the_padded_one(model, preset, micro):  # noqa: F811
    """Two passes (micro < mini: the samples' cotangents sum on their prompt's slots) and
    one (micro == mini: through the unpacking gather); PPO reads values and entropies."""
    levels = BatchLevels(global_size=ROWS, mini_size=8, micro_size=micro)
    objective = build_objective(PRESETS[preset]())
    batch = grouped_batch(objective)
    tokens, mask = np.asarray(batch.tokens), np.asarray(batch.response_mask)
    width = 32
    layout = layout_of(tokens, mask, chunks=levels.num_updates, micro_size=micro, width=width)
    if micro < 8:
        unshared = layout_of(tokens, mask, chunks=2, micro_size=micro, width=width, shared=False)
        assert layout.used.sum() < unshared.used.sum()  # sharing runs fewer micro-batches
    assert_packed_step_equals_padded(model, objective, levels, batch, layout)


def test_the_recompute_sharing_prompts_equals_the_padded_one(model):  # noqa: F811
    graphdef, params = model
    tokens, mask = grouped(1)
    layout = layout_of(tokens, mask, chunks=1, width=32)

    def run(layout):
        return recompute(
            graphdef, params, jnp.asarray(tokens), micro_size=2, values=True, layout=layout
        )

    want = compiled(lambda: run(None))
    got = compiled(lambda: run(layout))
    within = np.arange(SEQ)[None, :] < sequence_lengths(mask)[:, None]
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_allclose(g[within], w[within], rtol=1e-5, atol=1e-6)
        assert not g[~within].any()


def test_sharing_prompts_needs_packed_rows_and_an_attention_that_takes_them(tmp_path):
    config = run_config(str(tmp_path))
    with pytest.raises(ConfigError, match=r"trainer.share_prefixes: .*set trainer.tokens_per_row"):
        config.apply_overrides(["trainer.share_prefixes=true"])
    with pytest.raises(ConfigError, match=r"trainer.attention_backend=jax"):
        config.apply_overrides(
            [
                "trainer.share_prefixes=true",
                "trainer.tokens_per_row=64",
                "trainer.attention_backend=pallas",
            ]
        )
    ok = config.apply_overrides(["trainer.share_prefixes=true", "trainer.tokens_per_row=64"])
    assert ok.trainer.share_prefixes


def test_a_trainer_sharing_prompts_trains_as_the_padded_one_and_says_what_it_saved(tmp_path):
    """Through `Trainer.train_step` on a 2-device mesh (GRPO with a KL term: the recompute
    runs on the policy and the reference, sharing too): the padded trainer's weights within
    float rounding, and the step reports the prompt tokens it ran once."""
    from test_trainer_packing import _trainer

    tokens, mask = grouped(2)
    rows = 8  # groups 0 and 1
    rng = np.random.default_rng(3)
    batch = RolloutBatch(
        tokens=jnp.asarray(tokens[:rows]),
        response_mask=jnp.asarray(mask[:rows]),
        group_ids=jnp.asarray(np.arange(rows) // GROUP, jnp.int32),
        rewards=jnp.asarray(rng.normal(size=rows), jnp.float32),
        behaviour_logprobs=jnp.asarray(-rng.uniform(3.5, 4.5, (rows, SEQ)), jnp.float32),
        versions=jnp.zeros((rows,), jnp.int32),
    )
    results, params = {}, {}
    for name, extra in {
        "padded": {},
        "shared": dict(tokens_per_row=32, share_prefixes=True),
    }.items():
        trainer = _trainer(tmp_path / name, **extra)
        trainer.initialize()
        results[name] = trainer.train_step(0, batch).metrics
        params[name] = jax.device_get(trainer.params())
        trainer.close()
    shared = results["shared"]
    lengths = sequence_lengths(mask[:rows])
    assert shared["packing/shared_prompt_fraction"] > 0.2
    assert shared["model_tokens"] < lengths.sum() < results["padded"]["model_tokens"]
    assert results["padded"]["model_tokens"] == rows * SEQ
    assert_trees_close(params["shared"], params["padded"], rtol=1e-5, atol=1e-6)
