"""A multi-turn episode's loss mask from the worker's rollout to the trainer's batch: the
controller's record, the rollout log (rollouts and partials, and logs written before the
field existed), batch assembly (the response_mask, placeholders, dense rewards, the
staleness bound) and the TrainStep stream; and the verifier judges the final turn only.
JAX-free, like the controller."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlax_tpu.api.inference import Partial, Rollout, rollout_from_proto, rollout_to_proto
from rlax_tpu.api.records import Group, RolloutRecord, ScoredRollout
from rlax_tpu.api.trainer import TRAIN_STEP, pack_batch, unpack_batch
from rlax_tpu.controller.assembly import assemble_batch, on_sampled_tokens
from rlax_tpu.controller.errors import ControllerError
from rlax_tpu.controller.generation import rollout_record
from rlax_tpu.controller.scoring import Scorer
from rlax_tpu.controller.snapshots import RolloutLog
from rlax_tpu.data.datasets import PromptRecord
from rlax_tpu.staleness import StalenessPolicy

PROMPT = (101, 7, 8)
# turn 1 (sampled) · an observation (given) · turn 2 (sampled)
MASK = (1, 1, 1, 0, 0, 1, 1)
TOKENS = (20, 21, 22, 30, 31, 23, 24)
# Sampled tokens' behaviour log-probs; the engine gives an observation 0.0.
LOGPROBS = (-0.5, -1.0, -0.25, 0.0, 0.0, -2.0, -0.75)


def episode(
    *, logprobs=LOGPROBS, versions=(3, 3, 3, 4, 4, 4, 4), mask=MASK, **fields
) -> RolloutRecord:
    return RolloutRecord(
        **{
            "batch": 5,
            "prompt_id": "b5:tools:1",
            "sample_index": 0,
            "version": 3,
            "prompt_tokens": PROMPT,
            "tokens": TOKENS,
            "logprobs": logprobs,
            "finish_reason": "stop",
            "token_versions": versions,
            "loss_mask": mask,
            **fields,
        }
    )


def assemble(*records: RolloutRecord, token_rewards=None, step: int = 5, n: int = 2):
    samples = tuple(ScoredRollout(r, 1.0, token_rewards) for r in records)
    return assemble_batch(step, [Group("g", samples)], policy=StalenessPolicy(1, n), max_seq_len=64)


# -- (d) the record and its journeys -------------------------------------------------------


def test_a_workers_episode_becomes_a_record_that_keeps_its_loss_mask_through_the_log(tmp_path):
    rollout = Rollout(
        request_id="b5:tools:1/s0/v3",
        prompt_id="b5:tools:1",
        sample_index=0,
        version=3,
        prompt_tokens=PROMPT,
        tokens=TOKENS,
        logprobs=LOGPROBS,
        finish_reason="stop",
        token_versions=(3, 3, 3, 4, 4, 4, 4),
        loss_mask=MASK,
    )
    record = rollout_record(5, rollout_from_proto(rollout_to_proto(rollout)))
    assert record == episode()
    line = json.loads(json.dumps(record.to_json(), sort_keys=True))
    assert line["loss_mask"] == list(MASK)
    assert RolloutRecord.from_json(line) == record
    log = RolloutLog(str(tmp_path))
    log.append(5, [record])
    assert log.rollouts(5) == {record.key: record}
    # A paused episode logged as a partial is carried on with its mask (a resumed run).
    log.append_partials(5, [record])
    carried = log.partials(5)[record.key]
    assert Partial.of(carried).loss_mask == MASK


def test_a_record_without_given_tokens_and_an_old_line_carry_no_mask():
    old = episode(mask=None, versions=None)
    assert "loss_mask" not in old.to_json()  # the line of a run without episodes: as before
    assert episode(mask=(1,) * len(TOKENS), versions=None) == old  # all sampled: None
    assert old.mask == (1,) * len(TOKENS) and old.final_turn == TOKENS
    line = {k: v for k, v in episode().to_json().items() if k != "loss_mask"}
    assert RolloutRecord.from_json(line).loss_mask is None  # a log of an older run resumes


def test_a_record_refuses_a_mask_that_does_not_fit_its_tokens():
    with pytest.raises(ValueError, match="a loss mask of 3 entries for 7 response tokens"):
        episode(mask=(1, 0, 1))
    with pytest.raises(ValueError, match="0 and 1 only"):
        episode(mask=(1, 1, 1, 2, 0, 1, 1))


def test_staleness_is_its_sampled_tokens_and_given_tokens_hold_placeholder_versions():
    # An observation may carry any version (the engine's: the next turn's); it is not read.
    record = episode(versions=(3, 3, 3, 0, 99, 4, 4))
    assert (record.oldest_version, record.newest_version, record.mixed) == (3, 4, True)
    # A trailing observation stamped with a version after the step leaves the bound alone.
    trailing = episode(versions=(3, 3, 3, 3, 3, 3, 9), mask=(1, 1, 1, 1, 1, 1, 0))
    assert (trailing.newest_version, trailing.mixed) == (3, False)
    # The sampled tokens' versions must still never decrease, across the observation too.
    with pytest.raises(ValueError, match="never decrease along the response's sampled"):
        episode(versions=(4, 4, 4, 4, 4, 3, 3))


# -- (e) assembly ---------------------------------------------------------------------------------


def test_the_batch_response_mask_is_the_loss_mask_over_the_response_positions():
    assembled = assemble(episode())
    batch = assembled.batch
    start = len(PROMPT) - 1  # response token j is scored at P − 1 + j
    row = batch.response_mask[0]
    assert row[start : start + len(TOKENS)].tolist() == [bool(m) for m in MASK]
    assert not row[:start].any() and not row[start + len(TOKENS) :].any()
    assert batch.tokens[0, : len(PROMPT) + len(TOKENS)].tolist() == [*PROMPT, *TOKENS]
    assert batch.behaviour_logprobs[0, start : start + len(TOKENS)].tolist() == list(LOGPROBS)
    # Per-token versions on the sampled tokens only; the row's version is its oldest one's.
    assert batch.token_versions[0, start : start + len(TOKENS)].tolist() == [3, 3, 3, 0, 0, 4, 4]
    assert batch.versions.tolist() == [3]
    assert (assembled.response_tokens, assembled.given_tokens) == (7, 2)


def test_placeholders_of_given_tokens_do_not_reach_the_batch():
    sane = assemble(episode()).batch
    absurd = assemble(
        episode(
            logprobs=(-0.5, -1.0, -0.25, -1e9, -1e9, -2.0, -0.75),
            versions=(3, 3, 3, 0, 99, 4, 4),
        )
    ).batch
    for name in ("tokens", "response_mask", "behaviour_logprobs", "versions", "token_versions"):
        np.testing.assert_array_equal(getattr(absurd, name), getattr(sane, name))
    # Version 99 is after step 5 and version 0 over N = 2 before it: neither is checked ...
    with pytest.raises(ControllerError, match="tokens of version 3, not acceptable"):
        assemble(episode(), step=6)  # ... while a sampled token's is (6 accepts 4..6)


def test_a_dense_reward_on_a_given_token_moves_to_the_sampled_token_before_it():
    rewards = (0.1, 0.2, 0.3, 5.0, 6.0, 0.4, 1.0)
    assert on_sampled_tokens(rewards, MASK) == pytest.approx([0.1, 0.2, 11.3, 0, 0, 0.4, 1.0])
    assert on_sampled_tokens(rewards, (0, 1, 1, 1, 1, 1, 1))[:2] == pytest.approx([0, 0.3])
    assert on_sampled_tokens(rewards, (1,) * 7) == pytest.approx(list(rewards))
    batch = assemble(episode(), token_rewards=rewards).batch
    start = len(PROMPT) - 1
    placed = batch.token_rewards[0, start : start + len(TOKENS)]
    np.testing.assert_allclose(placed, [0.1, 0.2, 11.3, 0, 0, 0.4, 1.0], rtol=1e-6)
    assert placed.sum() == pytest.approx(sum(rewards))


def test_the_loss_mask_survives_the_train_step_stream():
    plain = episode(mask=None, versions=None, sample_index=1)
    arrays = assemble(episode(), plain).batch
    step, received = unpack_batch(b"".join(pack_batch(5, TRAIN_STEP.arrays_of(arrays))), TRAIN_STEP)
    assert step == 5
    for name in ("response_mask", "behaviour_logprobs", "token_versions", "versions"):
        np.testing.assert_array_equal(received[name], getattr(arrays, name))
    assert received["response_mask"][0].sum() == sum(MASK)
    assert received["response_mask"][1].sum() == len(TOKENS)


# -- scoring: the answer is the final turn --------------------------------------------------------


class CharTokenizer:
    def decode(self, tokens, **_):
        return "".join(chr(t) for t in tokens)


def test_the_verifier_judges_an_episodes_final_turn_and_a_plain_response_whole():
    text = [ord(c) for c in "call 2+3"], [ord(c) for c in "\n=5\n"], [ord(c) for c in "so 5"]
    tokens = (*text[0], *text[1], *text[2])
    mask = (1,) * len(text[0]) + (0,) * len(text[1]) + (1,) * len(text[2])
    record = episode(tokens=tokens, logprobs=(0.0,) * len(tokens), versions=None, mask=mask)
    scorer = Scorer(
        None, CharTokenizer(), (), retries=0, backoff_s=0.0, max_unjudged_fraction=0.0, counters={}
    )
    row = PromptRecord(
        dataset="d",
        id="1",
        prompt="2+3?",
        reference="5",
        verifier="function",
        reward_function="my_rewards:score",
    )
    request = scorer.request(row, record)
    assert request.response == "so 5"
    assert request.response_tokens == tokens  # a reward function's tokens: the whole response
    plain = scorer.request(
        row, episode(tokens=tokens, logprobs=(0.0,) * len(tokens), versions=None, mask=None)
    )
    assert plain.response == "call 2+3\n=5\nso 5"
